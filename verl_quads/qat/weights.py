"""Weight fake quantization for QAT: which tensor is quantized along which axis, with which global scale.

All QDQ goes through :func:`verl_quads.nvfp4.fake_quantize_ste` (forward bit-identical to
:func:`verl_quads.nvfp4.fake_quantize`, gradient straight through to the master weight).

Layouts (transformers 5.x, checked in 5.19 ``integrations/moe.py`` and the model files):

- ``nn.Linear.weight``: ``[out, in]``. The GEMM's K (reduction) dimension is ``in`` = the last
  dimension, so the 16-element blocks run along the last dimension, as vLLM stores it.
- Fused experts (``@use_experts_implementation`` classes, e.g. ``Qwen3MoeExperts``,
  ``OlmoeExperts``, ``MixtralExperts``): ``gate_up_proj`` ``[E, 2I, H]`` (gate rows then up rows
  when ``is_concatenated``) and ``down_proj`` ``[E, H, I]``, i.e. ``[E, out, in]``: K is again the
  last dimension. Classes with ``is_transposed=True`` (gpt-oss) store ``[E, in, out]``; their
  weight is transposed to ``[E, out, in]`` for QDQ and back, so blocks still run along K.

Global scales (``QuantConfig`` docstring; the rollout must agree):

- Linear: one float32 scale per tensor, ``global_scale_from_amax(amax(|W|))``. Siblings that vLLM
  fuses into one GEMM share one scale computed from the max of their amaxes: ``q_proj/k_proj/
  v_proj`` (vLLM ``qkv_proj``) and ``gate_proj/up_proj`` (vLLM ``gate_up_proj``).
- Experts: one scale per expert, shape ``[E, 1, 1]``; ``gate_up_proj`` of an expert (gate and up
  together) has one, ``down_proj`` of an expert has one.

The amax is computed on the weight the forward actually sees. Under FSDP2 that is the
unsharded parameter; a sharded ``DTensor`` here means the QDQ would see a shard, which is an
error (see :func:`check_unsharded`).
"""

from __future__ import annotations

import torch

from verl_quads.nvfp4 import fake_quantize_ste, global_scale_from_amax

#: Sibling ``nn.Linear`` names that vLLM fuses into one GEMM (one shared global scale), and the
#: vLLM name of the fused GEMM (also the TRACE guidance GEMM name).
FUSED_GROUPS: dict[tuple[str, ...], str] = {
    ("q_proj", "k_proj", "v_proj"): "qkv_proj",
    ("gate_proj", "up_proj"): "gate_up_proj",
}

#: Direct 3-D parameters of a fused-experts module and the vLLM fused-MoE weight they become.
EXPERT_PARAMS: dict[str, str] = {"gate_up_proj": "w13", "up_proj": "w13", "down_proj": "w2"}


def check_unsharded(t: torch.Tensor, what: str) -> None:
    """Raise if ``t`` is a sharded DTensor (QDQ of a shard would use the shard's amax)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return
    if isinstance(t, DTensor):
        raise RuntimeError(
            f"verl-quads QAT: {what} is a sharded DTensor {tuple(t.shape)} at forward time; QDQ must see the "
            "full unsharded weight. Apply fully_shard at (or above) the module that owns the whole fused "
            "group (the decoder layer, as verl does), not to single projections."
        )


def abs_max(w: torch.Tensor, dim=None, keepdim: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``amax(|w|)`` over ``dim`` (all dims if None) in ``w``'s dtype, in ONE read of ``w``: the
    infinity norm, which does not materialize ``|w|`` (``w.abs().amax()`` writes and re-reads a full
    copy). Bit-identical to ``w.abs().amax(...)`` (the result is one of the elements' magnitudes;
    NaN propagates), checked in tests/unit/test_qat_model.py. ``out``: write it there (e.g. one entry of a
    fused group's amax buffer; same dtype as ``w``)."""
    if out is not None:
        return torch.linalg.vector_norm(w.detach(), ord=float("inf"), dim=dim, keepdim=keepdim, out=out)
    return torch.linalg.vector_norm(w.detach(), ord=float("inf"), dim=dim, keepdim=keepdim)


def linear_global_scale(weights: list[torch.Tensor], amaxes: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Shared per-tensor encode scale (0-d float32) of one or more ``[out, in]`` weights.

    ``amaxes``: their :func:`abs_max` (0-d, weight dtype) if the caller has them already."""
    if amaxes is None:
        amaxes = [abs_max(w) for w in weights]
    amax = amaxes[0] if len(amaxes) == 1 else torch.stack(amaxes).amax()
    return global_scale_from_amax(amax.to(torch.float32))


def expert_global_scale(w: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """Per-expert encode scale ``[E, 1, 1]`` float32 of a ``[E, out, in]`` expert weight
    (``amax``: its ``abs_max(w, dim=(1, 2), keepdim=True)`` if the caller has it)."""
    if amax is None:
        amax = abs_max(w, dim=(1, 2), keepdim=True)
    return global_scale_from_amax(amax.to(torch.float32))


def qdq_linear_weight(
    w: torch.Tensor, global_scale: torch.Tensor | None, backend: str = "auto", check_finite: bool = True,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """NVFP4 QDQ (STE) of a linear weight ``[out, in]``, blocks along ``in``; same dtype as ``w``.
    ``amax`` instead of ``global_scale``: the weight's :func:`abs_max` (0-d) or its fused group's member
    amaxes (1-D ``[G]``); the scale ``global_scale_from_amax(max)`` is then derived inside the QDQ kernel
    (triton backend; bit-identical to passing :func:`linear_global_scale`)."""
    return fake_quantize_ste(w, global_scale, amax=amax, backend=backend, check_finite=check_finite)


def qdq_expert_weight(
    w: torch.Tensor, transposed: bool, backend: str = "auto", check_finite: bool = True, on_amax=None
) -> torch.Tensor:
    """NVFP4 QDQ (STE) of a fused expert weight, per-expert global scale, blocks along K.

    ``w``: ``[E, out, in]`` (``transposed=False``) or ``[E, in, out]`` (``transposed=True``).
    Returns a tensor of ``w``'s shape and dtype. All experts in ONE QDQ call (one kernel launch on the
    triton backend) with the per-expert scale ``[E, 1, 1]`` derived in that kernel from one amax reduction
    over dims (1, 2) (:func:`expert_global_scale` of it, bit for bit).
    ``on_amax``: optional callable receiving that amax (``[E, 1, 1]``, ``w``'s dtype; NaN/Inf if the
    expert has any), e.g. for :meth:`QATState.note_weight`.
    """
    w_oi = w.transpose(-1, -2) if transposed else w
    amax = abs_max(w_oi, dim=(1, 2), keepdim=True)
    if on_amax is not None:
        on_amax(amax)
    q = fake_quantize_ste(w_oi, amax=amax, backend=backend, check_finite=check_finite)
    return q.transpose(-1, -2) if transposed else q


__all__ = [
    "FUSED_GROUPS",
    "EXPERT_PARAMS",
    "abs_max",
    "check_unsharded",
    "linear_global_scale",
    "expert_global_scale",
    "qdq_linear_weight",
    "qdq_expert_weight",
]
