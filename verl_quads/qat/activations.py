"""Activation (GEMM input) fake quantization for the W4A4 trainer modes.

- ``rtn`` (``w4a4_qat``): per-token NVFP4 QDQ, round-to-nearest, global scale per row
  ``global_scale_from_amax(amax(|row|))`` (``QuantConfig``: activations one scale per token),
  straight-through gradient.
- ``guided`` (``trace``): the same per-row quantization, but rounding follows the rollout's
  :class:`~verl_quads.nvfp4.GuidanceRecord` (its block and global scales, its codeword choice) via
  :func:`verl_quads.nvfp4.fake_quantize_guided` (``dequantize(quantize_guided(...))`` bit for bit; one
  kernel launch on the triton backend); straight-through gradient. Rows the record does not
  cover (padding, the one trailing position, see :mod:`.guidance`) are given their own
  round-to-nearest guidance, so they quantize exactly as ``rtn``.

Inputs are ``[..., K]`` in bf16/fp16/fp32, K % 16 == 0; outputs have the input's shape and dtype.
"""

from __future__ import annotations

import torch

from verl_quads.nvfp4 import (
    GuidanceRecord,
    extract_guidance,
    fake_quantize_guided,
    fake_quantize_ste,
    per_row_global_scale,
    quantize,
)


#: Activations get one global scale per token (row): the core's definition, shared with the rollout.
per_token_global_scale = per_row_global_scale


def qdq_rtn(x: torch.Tensor, backend: str = "auto", check_finite: bool = True) -> torch.Tensor:
    """Per-token round-to-nearest NVFP4 QDQ with STE (scale ``per_token_global_scale(x)``; on the triton
    backend the row amax and scale are computed inside the QDQ kernel: one launch)."""
    return fake_quantize_ste(x, amax="row", backend=backend, check_finite=check_finite)


class _GuidedQDQ(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, record: GuidanceRecord, backend: str, check_finite: bool):  # type: ignore[override]
        return fake_quantize_guided(x, record, backend=backend, check_finite=check_finite)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None, None, None


def merged_record(
    x: torch.Tensor,
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    covered: torch.Tensor,
    backend: str = "auto",
    check_finite: bool = True,
    uncovered_rows: torch.Tensor | None = None,
) -> GuidanceRecord:
    """One record for ``x`` ``[M, ..., K]``: the rollout's rows where ``covered`` (bool ``[M]``),
    the round-to-nearest guidance of ``x`` itself elsewhere.

    ``uncovered_rows``: int64 ``[U]`` on ``x``'s device, the rows where ``covered`` is False, if the
    caller knows them (:meth:`TraceBatch.gather <verl_quads.qat.guidance.TraceBatch.gather>` does; U is
    host metadata): only those U rows are quantized for their own guidance (a row's quantization does
    not depend on other rows: per-token global scale) and copied in, with no device sync. None: read
    ``covered`` on the host (one sync) and quantize all of ``x`` if any row is uncovered."""
    bits, bscale, gscale = (p.to(x.device) for p in parts)
    if uncovered_rows is not None:
        if uncovered_rows.numel() == 0:
            return GuidanceRecord(bits, bscale, gscale, x.shape)
        xs = x.detach().index_select(0, uncovered_rows)
        own = extract_guidance(quantize(xs, amax="row", backend=backend, check_finite=check_finite))
        bits = bits.index_copy(0, uncovered_rows, own.bits)
        bscale = bscale.view(torch.uint8).index_copy(0, uncovered_rows, own.block_scale.view(torch.uint8)).view(
            torch.float8_e4m3fn
        )
        gscale = gscale.index_copy(0, uncovered_rows, own.global_scale.to(gscale.dtype))
        return GuidanceRecord(bits, bscale, gscale, x.shape)
    if not bool(covered.all()):
        own = extract_guidance(quantize(x.detach(), amax="row", backend=backend, check_finite=check_finite))
        c = covered.to(x.device)
        shape = (-1,) + (1,) * (x.dim() - 1)
        bits = torch.where(c.view(shape), bits, own.bits)
        bscale = torch.where(c.view(shape), bscale.view(torch.uint8), own.block_scale.view(torch.uint8)).view(
            torch.float8_e4m3fn
        )
        gscale = torch.where(c.view(shape), gscale, own.global_scale)
    return GuidanceRecord(bits, bscale, gscale, x.shape)


def qdq_guided(
    x: torch.Tensor, record: GuidanceRecord, backend: str = "auto", check_finite: bool = True
) -> torch.Tensor:
    """NVFP4 QDQ of ``x`` under ``record`` (shape must match), with STE."""
    return _GuidedQDQ.apply(x, record, backend, check_finite)


__all__ = ["per_token_global_scale", "qdq_rtn", "merged_record", "qdq_guided"]
