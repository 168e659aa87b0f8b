"""QUADS residual activation compensation (DESIGN.md §1, "our definition").

First pass: ``q1 = Q(x)``. Residual ``R = x - deq(q1)`` in float32. Each 16-channel block along
K gets a score, the sum of ``R**2`` over the rows that share a selection (all rows of the call
for ``per_token=False``, each row alone for ``per_token=True``). The ``n_sel = round(ratio *
K / 16)`` highest-scoring blocks are selected (ties: lower block index first; the selected
indices are returned sorted ascending), and ``R_sel`` (those blocks' columns, gathered) is
quantized in a second pass with its own global scale. The compensated activation is
``deq(q1) + scatter(deq(q2))``, summed in float32 and cast once.

Per-call selection keeps the second pass a plain FP4 GEMM over gathered columns (or fusable into
the first as K' = K (1 + ratio)); per-token selection makes each token's result independent of
the other tokens in the batch (a trainer can reproduce it), at the price of a dense second pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verl_quads.nvfp4.format import BLOCK_SIZE, NVFP4Tensor
from verl_quads.nvfp4.reference import (
    dequantize_to_float32,
    global_scale_from_amax,
    quantize,
    validate_input,
)


@dataclass(frozen=True)
class ResidualNVFP4:
    """Both passes of a residual-compensated quantization of ``x`` ``[M, K]``.

    Attributes:
        first: ``Q(x)``, logical shape ``[M, K]``.
        second: ``Q(R_sel)``, logical shape ``[M, n_sel * 16]``, float32 source dtype; blocks in
            the order of ``block_idx``.
        block_idx: int64 selected block indices (sorted ascending), ``[n_sel]`` for per-call
            selection or ``[M, n_sel]`` for per-token selection.
        ratio: the requested fraction of blocks.
    """

    first: NVFP4Tensor
    second: NVFP4Tensor
    block_idx: torch.Tensor
    ratio: float

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``deq(first) + scatter(deq(second))`` in float32, cast to ``dtype`` (default x's)."""
        from verl_quads.nvfp4 import dequantize  # the backend dispatcher (triton for CUDA tensors)

        out = dequantize(self.first, torch.float32)
        m, k = out.shape
        if self.block_idx.numel():
            sec = dequantize(self.second, torch.float32).unflatten(-1, (-1, BLOCK_SIZE))
            blocks = out.unflatten(-1, (-1, BLOCK_SIZE))
            idx = self.block_idx if self.block_idx.dim() == 2 else self.block_idx.expand(m, -1)
            blocks.scatter_add_(1, idx.unsqueeze(-1).expand(-1, -1, BLOCK_SIZE), sec)
            out = blocks.flatten(-2)
        return out.to(dtype or self.first.dtype)


def num_selected_blocks(k: int, ratio: float) -> int:
    """``round(ratio * K / 16)`` (half away from zero), the number of 16-blocks compensated."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"residual ratio must be in [0, 1], got {ratio}")
    return int(math.floor(ratio * (k // BLOCK_SIZE) + 0.5))


def select_blocks(residual: torch.Tensor, n_sel: int, per_token: bool) -> torch.Tensor:
    """Indices of the ``n_sel`` blocks with the largest residual energy (see module docstring)."""
    energy = residual.unflatten(-1, (-1, BLOCK_SIZE)).square().sum(-1)  # [M, nb]
    if not per_token:
        energy = energy.sum(0)
    order = torch.sort(energy, dim=-1, descending=True, stable=True).indices
    return torch.sort(order[..., :n_sel], dim=-1).values


def residual_quantize(
    x: torch.Tensor,
    ratio: float,
    global_scale: torch.Tensor | float | None = None,
    *,
    per_token: bool = False,
    check_finite: bool = True,
) -> ResidualNVFP4:
    """Residual-compensated NVFP4 of a 2-D activation ``x`` ``[M, K]``.

    ``global_scale`` is the first pass's (as in :func:`~verl_quads.nvfp4.quantize`); the second
    pass's global scale comes from the amax of ``R_sel`` (per tensor; per row if ``global_scale``
    is per row, i.e. shape ``[M, 1]``).
    """
    validate_input(x, check_finite=check_finite)
    if x.dim() != 2:
        raise ValueError(f"residual_quantize: x must be 2-D [tokens, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    first = quantize(x, global_scale, check_finite=False)
    residual = x.to(torch.float32) - dequantize_to_float32(first)
    n_sel = num_selected_blocks(k, ratio)
    idx = select_blocks(residual, n_sel, per_token)
    gather_idx = idx if per_token else idx.expand(m, -1)
    r_sel = torch.gather(
        residual.unflatten(-1, (-1, BLOCK_SIZE)), 1, gather_idx.unsqueeze(-1).expand(-1, -1, BLOCK_SIZE)
    ).flatten(-2)
    per_row = first.global_scale.dim() == 2 and first.global_scale.shape[0] == m and m > 1
    if r_sel.numel() == 0:
        amax = torch.zeros((m, 1) if per_row else (), dtype=torch.float32, device=x.device)
    else:
        amax = r_sel.abs().amax(dim=-1, keepdim=True) if per_row else r_sel.abs().amax()
    second = quantize(r_sel, global_scale_from_amax(amax), check_finite=False)
    return ResidualNVFP4(first, second, idx, ratio)


def residual_fake_quantize(
    x: torch.Tensor,
    ratio: float,
    global_scale: torch.Tensor | float | None = None,
    *,
    per_token: bool = False,
    check_finite: bool = True,
) -> torch.Tensor:
    """QDQ form ``Q(x) + Q(R_sel)`` of :func:`residual_quantize`, same shape and dtype as ``x``."""
    return residual_quantize(x, ratio, global_scale, per_token=per_token, check_finite=check_finite).dequantize(
        x.dtype
    )
