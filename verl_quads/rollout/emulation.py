"""The ``torch`` backend: NVFP4 GEMMs emulated with the shared NVFP4 core, then plain matmuls.

Every quantization goes through :mod:`verl_quads.nvfp4` (the same code the trainer calls), so the
rollout's codes and scales are the trainer's bit for bit. What this module defines is only the
arithmetic around them, modelled on an FP4 tensor-core GEMM (exact FP4 x FP4 products, float32
accumulation, one rounding to the output dtype):

- weights: NVFP4 (uint8 codes + E4M3 block scales + float32 global scale(s)), dequantized to
  float32 (exact: one product per element);
- activations of the W4A4 modes: one float32 global scale per token (row), ``448 * 6 /
  amax(|row|)``, block scales and codes from :func:`verl_quads.nvfp4.quantize`; dequantized to
  float32 (exact). ``w4a16`` keeps the activation as is (upcast to float32, exact);
- GEMM: ``x_f32 @ w_f32.T`` in float32, bias added in float32, one cast to the input dtype.

Modes (rollout vocabulary of :class:`verl_quads.config.QuantConfig`): ``w4a16``, ``naive``
(W4A4, round-to-nearest-even activations), ``quads`` (W4A4 + residual compensation:
``Q(x) + Q(R_sel)``, :func:`verl_quads.nvfp4.residual_quantize`), ``trace`` (``naive`` arithmetic;
the activation's :class:`~verl_quads.nvfp4.GuidanceRecord` is returned for capture).

QUADS operand form (``ActQuant.residual_combine``, always concrete): ``fp4x2`` (ActQuant's default, as the
NVFP4 core's): ``deq(Q(x)) + deq(Q(R_sel))`` in float32, never rounded (the model of a GEMM that reads both
FP4 operands and combines them in float32); ``bf16``: :func:`verl_quads.nvfp4.residual_fake_quantize` (the
same sum in float32, rounded ONCE to the activation dtype: relative <= 2**-8 per element for bf16, 2**-11 for
fp16, none for float32), upcast to float32 (exact), i.e. the operand of the ``w4a16`` GEMM that the
``triton`` backend then runs. The product's key ``quant_config.residual_combine`` defaults to ``auto``, which
the engine resolves once where the backend is known (:func:`verl_quads.config.resolve_residual_combine`:
``bf16`` on ``torch``/``triton``, ``fp4x2`` on ``native``) before it builds any ActQuant; ActQuant refuses
``auto``.

QUADS selection unit (``ActQuant.residual_granularity``, default as :class:`verl_quads.config.QuantConfig`):
``channel_sampled`` (default since session 33: single channels per token over the row's threshold from a fixed
sample of its scores, :mod:`verl_quads.nvfp4.residual`; with ``backend="auto"`` on CUDA tensors the core runs its
Triton kernel, :mod:`verl_quads.nvfp4.triton_channel`, same bytes), ``channel`` (the exact ``round(k * K)``
channels; the same kernel module) or ``block``
(16-channel blocks; the only unit of per-call selection, ``residual_per_token=False``). The NVFP4 core's own
default (:func:`verl_quads.nvfp4.residual_quantize`, the ``triton_gemm`` functions) stays ``block``: this
module always passes the unit explicitly. The plugin's
``triton`` backend builds the same operands (:func:`verl_quads.nvfp4.triton_gemm.quantize_activation`: ``fp4x2``
with the rule's dense second FP4 operand, or ``bf16``); ``native`` uses that dense second pass as its second FP4
GEMM operand (:func:`verl_quads.rollout.native.activation_passes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_quads import nvfp4
from verl_quads.config import DEFAULT_RESIDUAL_GRANULARITY, RESIDUAL_COMBINE_FORMS, RESIDUAL_GRANULARITIES
from verl_quads.nvfp4 import GuidanceRecord, NVFP4Tensor

W4A4_MODES = ("naive", "quads", "trace")
RUNTIME_MODES = ("w4a16",) + W4A4_MODES


@dataclass(frozen=True)
class ActQuant:
    """How activations are quantized in one GEMM call.

    Attributes:
        mode: one of :data:`RUNTIME_MODES`.
        residual_ratio: QUADS fraction k of the row compensated, in [0, 1] (``quads`` only): ``round(k * K)``
            channels (``channel``) or ``round(k * K / 16)`` 16-blocks (``block``).
        residual_per_token: QUADS per-token (default, as :class:`verl_quads.config.QuantConfig`) instead of
            per-call selection (``False``: blocks only, needs ``residual_granularity="block"``).
        capture: ``trace`` only: also return the guidance record of the activation.
        backend: NVFP4 core backend for the activation quantization: ``torch`` (this module is the
            plugin's torch backend) or ``auto`` (Triton for CUDA tensors; the kernels are bit-exact
            with the torch reference, so only speed changes: used by the HF emulator on GPUs).
        residual_combine: ``quads`` only, a concrete form: ``fp4x2`` (default) or ``bf16`` (module docstring);
            ``auto`` (the quant_config default) is refused: the engine resolves it first
            (:func:`verl_quads.config.resolve_residual_combine`).
        residual_granularity: ``quads`` only: ``channel_sampled`` (default, as QuantConfig; per token only),
            ``channel`` (per token only) or ``block`` (module docstring).
    """

    mode: str
    residual_ratio: float = 0.5
    residual_per_token: bool = True
    capture: bool = False
    backend: str = "torch"
    residual_combine: str = "fp4x2"
    residual_granularity: str = DEFAULT_RESIDUAL_GRANULARITY

    def __post_init__(self) -> None:
        if self.mode not in RUNTIME_MODES:
            raise ValueError(f"quads_nvfp4: runtime mode must be one of {RUNTIME_MODES}, got {self.mode!r}")
        if self.backend not in ("torch", "auto"):
            raise ValueError(f"ActQuant.backend must be 'torch' or 'auto', got {self.backend!r}")
        if self.residual_combine == "auto":
            raise ValueError(
                "ActQuant.residual_combine='auto' (the quant_config.residual_combine default) must be resolved where "
                "the rollout backend is known, before a layer is built: verl_quads.config.resolve_residual_combine("
                "'auto', backend) gives 'bf16' on torch/triton and 'fp4x2' on native; ActQuant takes one of "
                f"{RESIDUAL_COMBINE_FORMS}"
            )
        if self.residual_combine not in RESIDUAL_COMBINE_FORMS:
            raise ValueError(
                f"ActQuant.residual_combine (quant_config.residual_combine) must be one of {RESIDUAL_COMBINE_FORMS}, "
                f"got {self.residual_combine!r}"
            )
        if self.residual_granularity not in RESIDUAL_GRANULARITIES:
            raise ValueError(
                f"ActQuant.residual_granularity (quant_config.residual_granularity) must be one of "
                f"{RESIDUAL_GRANULARITIES}, got {self.residual_granularity!r}"
            )
        if self.mode == "quads" and self.residual_granularity != "block" and not self.residual_per_token:
            raise ValueError(
                "ActQuant: residual_per_token=False (per-call selection, quant_config.residual_per_token) is defined "
                f"for 16-channel blocks only, but residual_granularity={self.residual_granularity!r}"
                f"{' (the default)' if self.residual_granularity == DEFAULT_RESIDUAL_GRANULARITY else ''} selects "
                "channels per token: "
                "pass residual_granularity='block' (quant_config.residual_granularity=block) for per-call selection"
            )


#: One encode scale per token (row), float32 ``[M, 1]``: the core's definition, shared with the trainer.
per_token_global_scale = nvfp4.per_row_global_scale


def quantize_activation(x: torch.Tensor, q: ActQuant) -> tuple[torch.Tensor, GuidanceRecord | None]:
    """Activation operand of one GEMM, float32 ``[M, K]``, and its guidance record (trace only).

    ``x``: 2-D ``[M, K]`` (bf16/fp16/fp32, K % 16 == 0 for the W4A4 modes). ``w4a16`` returns
    ``x`` upcast to float32; ``quads`` with ``residual_combine="bf16"`` returns
    ``residual_fake_quantize(x)`` (x's dtype) upcast to float32. Non-finite activations are not
    checked here (hot path).
    """
    if q.mode == "w4a16":
        return x.to(torch.float32), None
    if x.shape[0] == 0:
        return x.to(torch.float32), None
    gs = per_token_global_scale(x)
    if q.mode == "quads" and q.residual_combine == "bf16":
        xq = nvfp4.residual_fake_quantize(
            x, q.residual_ratio, gs, per_token=q.residual_per_token, granularity=q.residual_granularity,
            backend=q.backend, check_finite=False,
        )
        return xq.to(torch.float32), None
    if q.mode == "quads":
        r = nvfp4.residual_quantize(
            x, q.residual_ratio, gs, per_token=q.residual_per_token, granularity=q.residual_granularity,
            backend=q.backend, check_finite=False,
        )
        return r.dequantize(torch.float32), None
    if q.mode == "trace" and q.capture:
        xq, record = nvfp4.quantize_with_guidance(x, gs, backend=q.backend, check_finite=False)
    else:
        xq, record = nvfp4.quantize(x, gs, backend=q.backend, check_finite=False), None
    return nvfp4.dequantize(xq, torch.float32, backend=q.backend), record


def check_gemm_input_length(q: ActQuant, backend: str, k: int, where: str) -> None:
    """Engine-start check (layer creation) that this GEMM's activation rule can run at row length ``k``.

    ``q``: the layer's :class:`ActQuant`; ``backend``: the plugin's concrete backend (``torch``, ``triton``,
    ``native``); ``k``: channels per activation row (the GEMM's input size per tensor-parallel rank); ``where``:
    the layer name for the message. Only the QUADS channel rule on ``triton`` / ``native`` (which run the
    activation step through the NVFP4 core's Triton channel kernel on CUDA tensors) has a limit: that kernel holds
    a row on chip and refuses rows longer than ``verl_quads.nvfp4.triton_channel.CHANNEL_CONFIG["max_k"]``
    channels (after its padding); the check asks the kernel module itself, so it moves with that limit. Raises
    ValueError naming the layer, K, the limit and what to set instead, so an engine fails when it builds the
    model, not at its first generation."""
    if q.mode != "quads" or q.residual_granularity == "block" or backend not in ("triton", "native"):
        return
    from verl_quads.nvfp4 import triton_channel

    try:
        triton_channel._check_row(int(k))
    except NotImplementedError as e:
        raise ValueError(
            f"quads_nvfp4: {where}: GEMM input of K = {k} channels per row is too long for the QUADS channel rule "
            f"(quant_config.residual_granularity={q.residual_granularity}) on backend {backend!r}: {e}. Set "
            "actor_rollout_ref.actor.quant_config.residual_granularity=block (the 16-channel block rule has no row "
            "limit), or add the layer to quant_config.ignore"
        ) from e


def quantize_weight(w: torch.Tensor, reduce_dims: tuple[int, ...] | None = None) -> NVFP4Tensor:
    """NVFP4 of a weight ``[..., N, K]``; one global scale over ``reduce_dims`` (default: all dims).

    Linear layers pass None (one scale per tensor; a fused qkv/gate_up tensor thus shares one);
    expert stacks ``[E, N, K]`` pass ``(1, 2)`` (one scale per expert, shape ``[E, 1, 1]``).
    """
    if reduce_dims is None:
        amax = w.abs().amax().to(torch.float32)
    else:
        amax = w.abs().amax(dim=reduce_dims, keepdim=True).to(torch.float32)
    return nvfp4.quantize(w, nvfp4.global_scale_from_amax(amax), backend="torch")


def weight_f32(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Dequantize held NVFP4 weight tensors to float32 ``[..., N, K]`` (exact).

    ``packed`` uint8 ``[..., N, K/2]``, ``block_scale`` e4m3 ``[..., N, K/16]``, ``global_scale``
    float32 0-d (per tensor) or ``[E]`` (per expert of an ``[E, N, K]`` stack).
    """
    gs = global_scale
    if gs.dim() == 1:
        gs = gs.view(-1, *([1] * (packed.dim() - 1)))
    shape = torch.Size((*packed.shape[:-1], packed.shape[-1] * 2))
    t = NVFP4Tensor(packed, block_scale, gs, shape, torch.bfloat16)
    return nvfp4.dequantize(t, torch.float32, backend="torch")


def gemm(x_f32: torch.Tensor, w_f32: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``x_f32 @ w_f32.T (+ bias)`` in float32, one cast to ``out_dtype``."""
    y = x_f32 @ w_f32.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype)


__all__ = [
    "W4A4_MODES",
    "RUNTIME_MODES",
    "RESIDUAL_COMBINE_FORMS",
    "RESIDUAL_GRANULARITIES",
    "ActQuant",
    "check_gemm_input_length",
    "per_token_global_scale",
    "quantize_activation",
    "quantize_weight",
    "weight_f32",
    "gemm",
]
