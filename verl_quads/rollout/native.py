"""The ``native`` rollout backend (Blackwell, sm_100+): vLLM's CUTLASS FP4 GEMM on our NVFP4 codes.

UNTESTED ON HARDWARE. Nothing in this project's test machines has FP4 tensor cores; this module is
written against vLLM's op API (identical in 0.24.0 and 0.32: ``vllm._custom_ops.cutlass_scaled_fp4_mm``
and ``vllm.model_executor.layers.quantization.utils.nvfp4_utils.cutlass_fp4_supported``) and tested
on CPU with that op REPLACED by a torch emulation of an FP4 tensor-core GEMM that reads the swizzled
scales (tests/unit/test_rollout_native_mocked_blackwell.py). Real-hardware tests:
tests/gpu/test_rollout_native_blackwell.py (skipped below sm_100).

Linear layers, W4A4 modes (``naive``, ``quads``, ``trace``)
-----------------------------------------------------------
1. The activation ``x`` ``[M, K]`` is quantized by OUR core (:mod:`verl_quads.nvfp4`, backend
   ``auto``: triton on CUDA) with one float32 global scale per token (row),
   ``gs_r = 448 * 6 / amax(|x_r|)`` -- the same codes and block scales as the ``torch`` backend
   and the trainer, bit for bit. ``trace`` extracts the guidance record from these codes;
   ``quads`` runs :func:`verl_quads.nvfp4.residual_quantize` and its second pass ``Q(R_sel)`` is
   scattered into a dense ``[M, K]`` NVFP4 operand (zero codes and zero block scales in the
   unselected blocks: exact), run as a second FP4 GEMM with its own per-row global scale.
   vLLM's ``scaled_fp4_quant`` is NOT used: it takes one global scale per call.
2. The activation block scales (linear ``[M, K/16]``) are converted to the swizzled layout with
   :func:`verl_quads.nvfp4.swizzle_block_scale` (``[round_up(M,128), round_up(K/16,4)]``).
3. ``G = cutlass_scaled_fp4_mm(x_codes, w_codes, x_scale_swz, w_scale_swz, alpha, bfloat16)``
   with ``alpha = 1 / weight_global_scale`` (float32 ``[1]``): ``G ~= (x * gs_r) @ W^T`` rounded
   to bf16 (the op writes bf16/fp16 only; bf16 is always requested because ``x * gs_r`` reaches
   ~2688 * K * max|W| and would overflow fp16).
4. ``y = sum_passes float32(G) / gs_r (+ bias in float32)``, one cast to x's dtype.

Double rounding vs the ``torch`` backend (which rounds once, from float32): with ``u = 2**-8``
(bf16 unit roundoff) and ``A = sum_passes |x_q| @ |W_q|^T`` (float32 magnitudes of the
dequantized operands), per output element

    ``|y_native - y_torch| <= u * |y_torch| + (2 u + K * 2**-23) * A``       (out dtype bf16)

(the ``G`` rounding of each pass and the final cast, plus float32 accumulation-order differences;
for an fp16 model the final cast's term is ``2**-11 * |y|``). Where the two roundings agree the
outputs are equal; the mocked test measures how often.

Weights (linear)
----------------
The layer keeps the kernel-format parameters of :mod:`verl_quads.rollout.linear` (linear layout;
the packed weight sync writes those) and gets two NON-persistent buffers derived from them:
``weight_scale_swizzled`` (e4m3, swizzled) and ``weight_alpha`` (float32 ``[1]``).
:func:`prepare_linear` fills them once after loading and rewrites them IN PLACE (``copy_``, fixed
storage: CUDA graphs stay valid) after every reload: vLLM's reload re-runs
``process_weights_after_loading`` (which calls it); the packed sync calls the method's
``after_packed_load`` (verl_quads/sync/receiver.py). The CUTLASS kernel needs N and K multiples of
32: other layers are refused at engine start (no padding is done here).

``w4a16`` on Blackwell (decision)
---------------------------------
vLLM's FP4 GEMM needs FP4 activations. The W4A16 options are vLLM's Marlin FP4 (needs its own
repacked weight layout, which the packed sync does not write) and our triton fused dequantize +
GEMM (reads the linear-layout params as they are). ``native`` runs ``w4a16`` linear layers with
OUR TRITON KERNEL (``torch.ops.verl_quads.nvfp4_linear``), always, and logs it at engine start.

Routed experts
--------------
vLLM's FP4 MoE ops (``cutlass_moe_fp4``, the flashinfer paths) quantize activations inside the op
with one global scale per expert (``a1_gscale``/``a2_gscale`` ``[E]``) and apply ``silu * up``
between the two GEMMs, so per-token global scales cannot be applied after GEMM1; the lower-level
grouped op (``cutlass_fp4_moe_mm``) could take them but is not wired here. So: with
``backend='native'`` a model with quantized routed experts is REFUSED at engine start, naming the
layer, unless the user sets ``VERL_QUADS_NATIVE_EXPERTS=triton`` (run the experts with our triton
grouped GEMM: explicit, logged), or chooses ``backend='triton'``, or ignores the experts.
"""

from __future__ import annotations

import logging
import os

import torch

from verl_quads import nvfp4
from verl_quads.config import DEFAULT_RESIDUAL_GRANULARITY
from verl_quads.nvfp4 import BLOCK_SIZE
from verl_quads.nvfp4.custom_ops import linear_custom_op, op_or_function

logger = logging.getLogger("verl_quads")

#: Env var selecting how routed experts run under ``backend='native'``; only ``triton`` is allowed.
NATIVE_EXPERTS_ENV = "VERL_QUADS_NATIVE_EXPERTS"
SWIZZLED_SCALE = "weight_scale_swizzled"
ALPHA = "weight_alpha"
#: CUTLASS FP4 GEMM alignment of N and K (vLLM pads to it; we refuse instead).
CUTLASS_ALIGN = 32
#: The FP4 GEMM's output dtype (see module docstring, step 3).
GEMM_OUT_DTYPE = torch.bfloat16


def fp4_ops_unavailable_reason() -> str | None:
    """None when vLLM's CUTLASS FP4 GEMM can run on this device, else why not (for the error)."""
    try:
        from vllm.model_executor.layers.quantization.utils.nvfp4_utils import cutlass_fp4_supported
        import vllm._custom_ops as ops
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return f"vLLM's FP4 ops cannot be imported ({type(e).__name__}: {e})"
    if not hasattr(ops, "cutlass_scaled_fp4_mm"):
        return "this vLLM has no vllm._custom_ops.cutlass_scaled_fp4_mm"
    try:
        ok = bool(cutlass_fp4_supported())
    except Exception as e:  # noqa: BLE001
        return f"vLLM's cutlass_fp4_supported() raised {type(e).__name__}: {e}"
    if not ok:
        return "vLLM's cutlass_fp4_supported() is False (this vLLM build has no CUTLASS FP4 kernels for this GPU)"
    return None


_w4a16_logged = False


def log_w4a16_choice() -> None:
    """Say once per process that ``native`` runs ``w4a16`` linear layers with the triton kernel."""
    global _w4a16_logged
    if not _w4a16_logged:
        _w4a16_logged = True
        logger.info("verl-quads: backend 'native', mode w4a16: linear layers run the triton NVFP4 W4A16 kernel "
                    "(vLLM's FP4 GEMM needs FP4 activations; see verl_quads/rollout/native.py)")


def _fp4_mm():
    """vLLM's FP4 GEMM, looked up at call time (the CPU tests replace it with an emulation)."""
    import vllm._custom_ops as ops

    return ops.cutlass_scaled_fp4_mm


def check_linear_shape(name: str, n: int, k: int) -> None:
    """Refuse (at engine start) a linear layer the CUTLASS FP4 GEMM cannot take without padding."""
    if n % CUTLASS_ALIGN or k % CUTLASS_ALIGN:
        raise ValueError(
            f"quads_nvfp4 backend 'native': layer {name} is [N={n}, K={k}] per partition; vLLM's CUTLASS "
            f"FP4 GEMM needs N and K multiples of {CUTLASS_ALIGN}. Alternatives: backend='triton', or add "
            "the layer to quant_config.ignore"
        )


def experts_backend(layer_name: str) -> str:
    """Backend of routed experts under ``native``: ``triton`` if the user opted in, else refuse."""
    choice = os.environ.get(NATIVE_EXPERTS_ENV, "")
    if choice == "triton":
        logger.info("verl-quads: %s: backend 'native' runs routed experts with the triton grouped GEMM (%s=triton)",
                    layer_name, NATIVE_EXPERTS_ENV)
        return "triton"
    raise NotImplementedError(
        f"quads_nvfp4 backend 'native': routed experts {layer_name or '(unnamed)'} cannot run on vLLM's FP4 MoE "
        "ops (they quantize activations with one global scale per expert; our codes use one per token). "
        f"Alternatives: set {NATIVE_EXPERTS_ENV}=triton to run the experts with the triton grouped NVFP4 GEMM "
        "(linear layers stay native), or quant_config.backend='triton', or add the experts to quant_config.ignore"
        + (f" (got {NATIVE_EXPERTS_ENV}={choice!r}; allowed: triton)" if choice else "")
    )


def _set_buffer(layer: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Write ``value`` into buffer ``name`` in place when shape/dtype match (storage kept), else register it."""
    old = layer._buffers.get(name)
    if old is not None and old.shape == value.shape and old.dtype == value.dtype and old.device == value.device:
        old.copy_(value)
        return
    layer.register_buffer(name, value.contiguous(), persistent=False)


@torch.no_grad()
def prepare_linear(layer: torch.nn.Module) -> None:
    """(Re)derive ``weight_scale_swizzled`` and ``weight_alpha`` from the layer's linear-layout
    ``weight_scale`` (e4m3 ``[N, K/16]``) and ``weight_global_scale`` (float32 0-d), in place."""
    _set_buffer(layer, SWIZZLED_SCALE, nvfp4.swizzle_block_scale(layer.weight_scale.data))
    alpha = torch.reciprocal(layer.weight_global_scale.data.to(torch.float32)).reshape(1)
    _set_buffer(layer, ALPHA, alpha)


def _row_vector(gs: torch.Tensor, m: int) -> torch.Tensor:
    """A global scale (0-d, ``[1, 1]`` or ``[M, 1]``) as float32 ``[M]``."""
    gs = gs.to(torch.float32).reshape(-1)
    return gs.expand(m).contiguous() if gs.numel() == 1 else gs.contiguous()


def _dense_residual(r, m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """QUADS second pass scattered to a dense ``[M, K]`` operand: (uint8 ``[M, K/2]``, e4m3 ``[M, K/16]``).
    Unselected blocks get code 0 and block scale 0 (value 0, exact)."""
    nb = k // BLOCK_SIZE
    n_sel = r.block_idx.shape[-1]
    idx = r.block_idx.to(torch.int64)
    if idx.dim() == 1:
        idx = idx.unsqueeze(0).expand(m, n_sel)
    packed = torch.zeros(m, nb, BLOCK_SIZE // 2, dtype=torch.uint8, device=r.second.packed.device)
    packed.scatter_(1, idx.unsqueeze(-1).expand(m, n_sel, BLOCK_SIZE // 2),
                    r.second.packed.reshape(m, n_sel, BLOCK_SIZE // 2))
    scale = torch.zeros(m, nb, dtype=torch.uint8, device=packed.device)
    scale.scatter_(1, idx, r.second.block_scale.view(torch.uint8).reshape(m, n_sel))
    return packed.reshape(m, k // 2), scale.view(torch.float8_e4m3fn)


def activation_passes(x: torch.Tensor, mode: str, residual_ratio: float = 0.5, residual_per_token: bool = True,
                      capture: bool = False, residual_granularity: str = DEFAULT_RESIDUAL_GRANULARITY):
    """FP4 operands of the activation ``x`` ``[M, K]`` for the native GEMM, and the guidance record.

    Returns ``(passes, record)``: ``passes`` is a list of ``(packed uint8 [M, K/2], block_scale e4m3
    [M, K/16] linear layout, global_scale float32 [M])``, one for ``naive``/``trace``, two for
    ``quads`` with a non-empty selection; ``record`` is the :class:`~verl_quads.nvfp4.GuidanceRecord`
    (``trace`` with ``capture``) or None. Codes are the core's (same as the ``torch`` backend).
    ``residual_granularity``: the QUADS selection rule (default as :class:`verl_quads.config.QuantConfig`):
    ``channel_sampled`` or ``channel``, whose second pass is already a dense ``[M, K]`` FP4 tensor in the original
    16-blocks, so it is the second operand as it is; or ``block``, whose selected blocks are scattered into that dense form; per-call
    selection, ``residual_per_token=False``, needs ``block``)."""
    m, k = x.shape
    # amax="row": the per-token scale (per_row_global_scale) derived inside the triton kernels where they can
    if mode == "quads" and residual_granularity in nvfp4.CHANNEL_GRANULARITIES:
        r = nvfp4.residual_quantize(x, residual_ratio, amax="row", per_token=residual_per_token, backend="auto",
                                    check_finite=False, granularity=residual_granularity)
        passes = [(r.first.packed, r.first.block_scale, _row_vector(r.first.global_scale, m))]
        if nvfp4.num_selected_channels(k, residual_ratio):
            passes.append((r.second.packed, r.second.block_scale, _row_vector(r.second.global_scale, m)))
        return passes, None
    if mode == "quads":
        r = nvfp4.residual_quantize(x, residual_ratio, amax="row", per_token=residual_per_token, backend="auto",
                                    check_finite=False)
        passes = [(r.first.packed, r.first.block_scale, _row_vector(r.first.global_scale, m))]
        if r.block_idx.shape[-1]:
            packed2, scale2 = _dense_residual(r, m, k)
            passes.append((packed2, scale2, _row_vector(r.second.global_scale, m)))
        return passes, None
    if mode not in ("naive", "trace"):
        raise ValueError(f"quads_nvfp4 native: W4A4 mode must be naive, quads or trace, got {mode!r}")
    if mode == "trace" and capture:
        q, record = nvfp4.quantize_with_guidance(x, amax="row", backend="auto", check_finite=False)
    else:
        q, record = nvfp4.quantize(x, amax="row", backend="auto", check_finite=False), None
    return [(q.packed, q.block_scale, _row_vector(q.global_scale, m))], record


def gemm_passes(passes, w_packed: torch.Tensor, w_scale_swizzled: torch.Tensor, alpha: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``sum_p float32(fp4_mm(p)) / gs_p (+ bias)``, one cast to ``out_dtype``: ``[M, N]``."""
    mm = _fp4_mm()
    acc = None
    for packed, scale, gs in passes:
        g = mm(packed, w_packed, nvfp4.swizzle_block_scale(scale), w_scale_swizzled, alpha, GEMM_OUT_DTYPE)
        t = g.to(torch.float32) / gs.unsqueeze(-1)
        acc = t if acc is None else acc + t
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def _native_linear(x: torch.Tensor, w_packed: torch.Tensor, w_scale_swizzled: torch.Tensor, alpha: torch.Tensor,
                   bias: torch.Tensor | None, act_mode: str, residual_ratio: float,
                   residual_per_token: bool, residual_granularity: str = DEFAULT_RESIDUAL_GRANULARITY) -> torch.Tensor:
    if x.shape[0] == 0:
        return x.new_empty(0, w_packed.shape[0])
    passes, _ = activation_passes(x, act_mode, residual_ratio, residual_per_token,
                                  residual_granularity=residual_granularity)
    return gemm_passes(passes, w_packed, w_scale_swizzled, alpha, bias, x.dtype)


#: The non-capturing native linear as an opaque custom op for torch.compile (as the triton backend's).
native_linear_op = linear_custom_op(
    "nvfp4_native_linear", _native_linear,
    "(Tensor x, Tensor w_packed, Tensor w_scale_swizzled, Tensor alpha, Tensor? bias, str act_mode, "
    "float residual_ratio, bool residual_per_token, "
    f"str residual_granularity='{DEFAULT_RESIDUAL_GRANULARITY}') -> Tensor",
)


def _native_linear_guided(x: torch.Tensor, w_packed: torch.Tensor, w_scale_swizzled: torch.Tensor, alpha: torch.Tensor,
                          bias: torch.Tensor | None, act_mode: str, residual_ratio: float, residual_per_token: bool,
                          residual_granularity: str, layer: int, gemm: str) -> torch.Tensor:
    """The native linear that also hands its input's guidance record (decoder layer ``layer``, GEMM ``gemm``) to the
    guidance store, whose copies into persistent buffers a CUDA graph replays (the triton backend's guided op has its
    quantize kernel write those buffers directly)."""
    if x.shape[0] == 0:
        return x.new_empty(0, w_packed.shape[0])
    passes, record = activation_passes(x, act_mode, residual_ratio, residual_per_token, capture=True,
                                       residual_granularity=residual_granularity)
    if record is not None:
        from verl_quads.rollout.capture import get_store

        get_store().add(layer, gemm, record)
    return gemm_passes(passes, w_packed, w_scale_swizzled, alpha, bias, x.dtype)


#: The capturing native linear (trace) as an opaque custom op
#: (see :func:`~verl_quads.nvfp4.custom_ops.linear_custom_op`).
native_linear_guided_op = linear_custom_op(
    "nvfp4_native_linear_guided", _native_linear_guided,
    "(Tensor x, Tensor w_packed, Tensor w_scale_swizzled, Tensor alpha, Tensor? bias, str act_mode, "
    "float residual_ratio, bool residual_per_token, str residual_granularity, int layer, str gemm) -> Tensor",
)


def apply_linear(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, act,
                 capture_key: tuple[int, str] | None) -> torch.Tensor:
    """Forward of a ``quads_nvfp4`` linear layer with backend ``native`` (see module docstring).

    ``x`` ``[..., K]`` bf16/fp16; returns ``[..., N]`` in x's dtype. ``act``: the layer's
    :class:`~verl_quads.rollout.emulation.ActQuant`."""
    x2 = x.reshape(-1, x.shape[-1])
    if act.mode == "w4a16":  # decision: our triton kernel (module docstring)
        from verl_quads.nvfp4 import triton_gemm  # noqa: F401  (registers torch.ops.verl_quads.nvfp4_linear)

        y = torch.ops.verl_quads.nvfp4_linear(x2, layer.weight_packed, layer.weight_scale, layer.weight_global_scale,
                                              bias, "w4a16", act.residual_ratio, act.residual_per_token)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    args = (x2, layer.weight_packed, getattr(layer, SWIZZLED_SCALE), getattr(layer, ALPHA), bias, act.mode,
            act.residual_ratio, act.residual_per_token, act.residual_granularity)
    if not (act.capture and capture_key is not None):
        y = torch.ops.verl_quads.nvfp4_native_linear(*args)
    else:
        y = op_or_function(torch.ops.verl_quads.nvfp4_native_linear_guided, _native_linear_guided, *args, *capture_key)
    return y.reshape(*x.shape[:-1], y.shape[-1])


__all__ = [
    "ALPHA",
    "CUTLASS_ALIGN",
    "NATIVE_EXPERTS_ENV",
    "SWIZZLED_SCALE",
    "activation_passes",
    "apply_linear",
    "check_linear_shape",
    "experts_backend",
    "fp4_ops_unavailable_reason",
    "gemm_passes",
    "log_w4a16_choice",
    "native_linear_guided_op",
    "native_linear_op",
    "prepare_linear",
]
