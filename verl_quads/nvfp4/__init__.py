"""NVFP4: the one quantization core that the trainer and the rollout both call.

Public API (names other modules rely on): :class:`NVFP4Tensor`, :func:`quantize`,
:func:`dequantize`, :func:`fake_quantize`, :func:`fake_quantize_ste`,
:func:`global_scale_from_amax`, :func:`per_row_global_scale`, :func:`swizzle_block_scale` / :func:`unswizzle_block_scale`,
compressed-tensors / ModelOpt conversions, residual compensation
(:func:`residual_quantize`, :func:`residual_fake_quantize`) and guided rounding
(:func:`extract_guidance`, :func:`quantize_guided`, :func:`fake_quantize_guided`).

``backend``: ``"torch"`` (the reference, :mod:`.reference`), ``"triton"`` (:mod:`.triton_kernels`,
same bytes; on a machine without a GPU only under ``TRITON_INTERPRET=1``) or ``"auto"`` (triton
for CUDA tensors, torch otherwise). Asking for triton where it cannot run is an error, never a
silent switch to torch.
"""

from __future__ import annotations

import torch

from verl_quads.nvfp4 import reference as _ref
from verl_quads.nvfp4.format import (
    BLOCK_SIZE,
    E2M1_VALUES,
    E4M3_MAX,
    FP4_MAX,
    NVFP4Tensor,
    e2m1_table,
    pack_codes,
    unpack_codes,
)
from verl_quads.nvfp4.guidance import GuidanceRecord, check_record_out, extract_guidance, pack_bits, unpack_bits
from verl_quads.nvfp4.guidance import quantize_guided as _quantize_guided_ref
from verl_quads.nvfp4.layout import (
    from_compressed_tensors,
    from_modelopt,
    swizzle_block_scale,
    to_compressed_tensors,
    to_modelopt,
    unswizzle_block_scale,
)
from verl_quads.nvfp4.reference import global_scale_from_amax, per_row_global_scale, validate_input
from verl_quads.nvfp4.residual import (
    CHANNEL_GRANULARITIES,
    ChannelResidualNVFP4,
    ResidualNVFP4,
    SampledChannelResidualNVFP4,
    num_selected_blocks,
    num_selected_channels,
)
from verl_quads.nvfp4.residual import GRANULARITIES as RESIDUAL_GRANULARITIES
from verl_quads.nvfp4.residual import check_granularity as _check_granularity
from verl_quads.nvfp4.residual import residual_quantize as _residual_quantize_ref
from verl_quads.nvfp4.ste import fake_quantize_ste

BACKENDS = ("auto", "torch", "triton")


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"NVFP4 backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "auto":
        return x.is_cuda
    from verl_quads.nvfp4 import triton_kernels

    triton_kernels.check_available(x)
    return True


def _amax_to_global_scale(x: torch.Tensor, global_scale, amax):
    """The torch route of ``amax=`` (see :func:`fake_quantize`): the global scale it stands for."""
    if amax is None:
        return global_scale
    if global_scale is not None:
        raise ValueError("NVFP4: pass global_scale or amax, not both")
    return _ref._gs_of_amax(x, *_ref._check_amax(amax, x))


def quantize(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    *,
    amax: torch.Tensor | str | None = None,
    backend: str = "auto",
    check_finite: bool = True,
) -> NVFP4Tensor:
    """Quantize ``x`` ``[..., K]`` (float32/bf16/fp16, K % 16 == 0); see :mod:`.reference`.
    ``amax``: instead of ``global_scale``, see :func:`fake_quantize`."""
    if _use_triton(x, backend):
        from verl_quads.nvfp4 import triton_kernels

        return triton_kernels.quantize(x, global_scale, amax=amax, check_finite=check_finite)
    return _ref.quantize(x, _amax_to_global_scale(x, global_scale, amax), check_finite=check_finite)


def quantize_with_guidance(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    *,
    amax: torch.Tensor | str | None = None,
    backend: str = "auto",
    check_finite: bool = True,
    out: GuidanceRecord | None = None,
) -> tuple[NVFP4Tensor, GuidanceRecord]:
    """:func:`quantize` and the TRACE guidance record of its codes (:func:`extract_guidance`'s, the same bytes).
    On the triton backend the quantize kernel writes the record's bits itself: one launch instead of the record's
    ~6 torch ops (host time of an eager rollout step).

    ``out``: fill this record (returned) instead of allocating one: bits uint8 ``[R, K/8]``, block scales
    ``[R, K/16]`` (e4m3 or uint8 bytes), global scales float32 ``[R, 1]`` (R = x's rows, any row stride), or
    ``[T, S, ...]`` with x's row ``t * S + s`` at ``[t, s]`` (TRACE's token rows, whose routed slots are
    contiguous). On the triton backend the quantize kernel writes all three there (the rollout's TRACE record
    buffer: no copy kernels); the torch backend copies them."""
    if _use_triton(x, backend):
        from verl_quads.nvfp4 import triton_kernels

        return triton_kernels.quantize_with_guidance(x, global_scale, amax=amax, check_finite=check_finite,
                                                     out=out)
    q = quantize(x, global_scale, amax=amax, backend=backend, check_finite=check_finite)
    rec = extract_guidance(q)
    if out is None:
        return q, rec
    lead = check_record_out(out, x)
    out.bits.copy_(rec.bits.reshape(*lead, -1))
    out.block_scale.view(torch.uint8).copy_(rec.block_scale.view(torch.uint8).reshape(*lead, -1))
    out.global_scale.copy_(torch.broadcast_to(rec.global_scale, (*x.shape[:-1], 1)).reshape(*lead, 1))
    return q, out


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16, *, backend: str = "auto") -> torch.Tensor:
    """Dequantize to ``dtype`` (float32 products, one cast)."""
    if _use_triton(q.packed, backend):
        from verl_quads.nvfp4 import triton_kernels

        return triton_kernels.dequantize(q, dtype)
    return _ref.dequantize(q, dtype)


def fake_quantize(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    *,
    amax: torch.Tensor | str | None = None,
    backend: str = "auto",
    check_finite: bool = True,
) -> torch.Tensor:
    """Quantize-dequantize, same shape and dtype as ``x`` (no autograd; see :func:`fake_quantize_ste`).

    ``amax`` (instead of ``global_scale``; the result is the same bytes as passing
    ``global_scale_from_amax(amax)``): a floating tensor shaped like a global scale (0-d, ``[E, 1, 1]``,
    ``[..., 1]``), a 1-D ``[G]`` (a fused group's member amaxes: one scale from their max) or ``"row"``
    (per-row scale of x's own rows, as :func:`per_row_global_scale`). On the triton backend the scale
    is then derived inside the QDQ kernel (one launch; for "row" the row amax too)."""
    if _use_triton(x, backend):
        from verl_quads.nvfp4 import triton_kernels

        return triton_kernels.fake_quantize(x, global_scale, amax=amax, check_finite=check_finite)
    return _ref.fake_quantize(x, _amax_to_global_scale(x, global_scale, amax), check_finite=check_finite)


def _residual_use_triton(x: torch.Tensor, backend: str, granularity: str, per_token: bool) -> bool:
    """Backend choice of the residual functions (both granularities have a Triton kernel: the block rule in
    :mod:`.triton_kernels`, ``granularity="channel"`` in :mod:`.triton_channel`)."""
    _check_granularity(granularity, per_token)
    return _use_triton(x, backend)


def _residual(
    x: torch.Tensor, ratio: float, global_scale, amax, per_token: bool, score_weight, granularity: str, backend: str,
    check_finite: bool, qdq: bool,
):
    """The backend dispatch of :func:`residual_quantize` (``qdq=False``) and :func:`residual_fake_quantize`."""
    if _residual_use_triton(x, backend, granularity, per_token):
        if granularity in CHANNEL_GRANULARITIES:
            from verl_quads.nvfp4 import triton_channel

            fn = triton_channel.residual_fake_quantize if qdq else triton_channel.residual_quantize
            return fn(x, ratio, global_scale, amax=amax, score_weight=score_weight, check_finite=check_finite,
                      granularity=granularity)
        from verl_quads.nvfp4 import triton_kernels

        fn = triton_kernels.residual_fake_quantize if qdq else triton_kernels.residual_quantize
        return fn(x, ratio, _amax_to_global_scale(x, global_scale, amax), per_token=per_token,
                  score_weight=score_weight, check_finite=check_finite)
    r = _residual_quantize_ref(
        x, ratio, _amax_to_global_scale(x, global_scale, amax), per_token=per_token, score_weight=score_weight,
        granularity=granularity, check_finite=check_finite,
    )
    return r.dequantize(x.dtype) if qdq else r


def residual_quantize(
    x: torch.Tensor,
    ratio: float,
    global_scale: torch.Tensor | float | None = None,
    *,
    amax: torch.Tensor | str | None = None,
    per_token: bool = True,
    score_weight: torch.Tensor | None = None,
    granularity: str = "block",
    backend: str = "auto",
    check_finite: bool = True,
) -> ResidualNVFP4 | ChannelResidualNVFP4:
    """QUADS residual compensation of a 2-D activation; see :mod:`.residual`.

    ``per_token``: select the compensated 16-blocks per row (default; batch-invariant) or per call.
    ``score_weight``: optional float32 ``[K]`` per-channel weight of the residual energy score
    (e.g. the squared column norms of the layer's weight: output-aware selection).
    ``granularity``: ``"block"`` (default: 16-channel blocks, a :class:`ResidualNVFP4`) or ``"channel"``
    (single channels per token, second pass dense ``[M, K]``: a :class:`ChannelResidualNVFP4`; the triton
    backend runs :mod:`.triton_channel`, same bytes).
    ``amax`` (instead of ``global_scale``): as in :func:`quantize`; the same bytes as passing
    ``global_scale_from_amax(amax)``. ``amax="row"`` (each row's own scale, :func:`per_row_global_scale`: the
    rollout's activation convention) is derived inside the kernel on the triton backend with
    ``granularity="channel"`` (one launch, no separate amax kernels); elsewhere by torch first."""
    return _residual(x, ratio, global_scale, amax, per_token, score_weight, granularity, backend, check_finite,
                     qdq=False)


def residual_fake_quantize(
    x: torch.Tensor,
    ratio: float,
    global_scale: torch.Tensor | float | None = None,
    *,
    amax: torch.Tensor | str | None = None,
    per_token: bool = True,
    score_weight: torch.Tensor | None = None,
    granularity: str = "block",
    backend: str = "auto",
    check_finite: bool = True,
) -> torch.Tensor:
    """``Q(x) + Q(R_sel)`` in x's dtype; see :func:`residual_quantize` (incl. ``amax``) and :mod:`.residual`."""
    return _residual(x, ratio, global_scale, amax, per_token, score_weight, granularity, backend, check_finite,
                     qdq=True)


def quantize_guided(
    x: torch.Tensor, guidance: GuidanceRecord, *, backend: str = "auto", check_finite: bool = True
) -> NVFP4Tensor:
    """TRACE: quantize ``x`` under a rollout's guidance record; see :mod:`.guidance`."""
    if _use_triton(x, backend):
        from verl_quads.nvfp4 import triton_kernels

        return triton_kernels.quantize_guided(x, guidance, check_finite=check_finite)
    return _quantize_guided_ref(x, guidance, check_finite=check_finite)


def fake_quantize_guided(
    x: torch.Tensor, guidance: GuidanceRecord, *, backend: str = "auto", check_finite: bool = True
) -> torch.Tensor:
    """TRACE guided QDQ: ``dequantize(quantize_guided(x, guidance), x.dtype)`` bit for bit, x's shape
    and dtype (no autograd). The triton backend does it in one launch (nothing packed); the torch
    backend is that composition of the reference functions."""
    if _use_triton(x, backend):
        from verl_quads.nvfp4 import triton_kernels

        return triton_kernels.fake_quantize_guided(x, guidance, check_finite=check_finite)
    return _ref.dequantize(_quantize_guided_ref(x, guidance, check_finite=check_finite), x.dtype)


__all__ = [
    "BACKENDS",
    "BLOCK_SIZE",
    "CHANNEL_GRANULARITIES",
    "ChannelResidualNVFP4",
    "SampledChannelResidualNVFP4",
    "E2M1_VALUES",
    "E4M3_MAX",
    "FP4_MAX",
    "GuidanceRecord",
    "NVFP4Tensor",
    "ResidualNVFP4",
    "dequantize",
    "e2m1_table",
    "extract_guidance",
    "quantize_with_guidance",
    "fake_quantize",
    "fake_quantize_guided",
    "fake_quantize_ste",
    "from_compressed_tensors",
    "from_modelopt",
    "global_scale_from_amax",
    "num_selected_blocks",
    "num_selected_channels",
    "pack_bits",
    "pack_codes",
    "per_row_global_scale",
    "quantize",
    "quantize_guided",
    "RESIDUAL_GRANULARITIES",
    "residual_fake_quantize",
    "residual_quantize",
    "swizzle_block_scale",
    "to_compressed_tensors",
    "to_modelopt",
    "unpack_bits",
    "unpack_codes",
    "unswizzle_block_scale",
    "validate_input",
]

#: Fused NVFP4 dequantize + GEMM (the rollout's ``triton`` backend) and its MoE routing, imported on first use (needs
#: triton): name -> module.
_GEMM_EXPORTS = {"nvfp4_linear": "triton_gemm", "nvfp4_gemm": "triton_gemm", "moe_align": "moe_routing"}


def __getattr__(name: str):
    if name in _GEMM_EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"verl_quads.nvfp4.{_GEMM_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'verl_quads.nvfp4' has no attribute {name!r}")
