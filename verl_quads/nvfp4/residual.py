"""QUADS residual activation compensation (DESIGN.md §1, "our definition"; docs/quads_selection.md).

First pass: ``q1 = Q(x)``. Residual ``R = x - deq(q1)`` in float32. Selection of 16-channel
blocks along K, fixed exactly (the Triton kernels reproduce it bit for bit):

- per-(row, block) energy ``e[m, b]`` = sum over the block's 16 elements of ``R**2`` (times
  ``score_weight[c]`` per channel ``c`` when given), summed as a pairwise tree of adjacent pairs:
  ``s = v[0::2] + v[1::2]`` repeated 16 -> 8 -> 4 -> 2 -> 1 (:func:`block_energy`);
- score: ``per_token=True`` (the default of :class:`verl_quads.config.QuantConfig`): the row's own
  ``e[m, :]``, so a token's result does not depend on the other tokens of the batch;
  ``per_token=False`` (per GEMM call): ``e.sum(0)``, one selection shared by all rows
  (:func:`call_scores`, the same torch reduction in both backends);
- the ``n_sel = round(ratio * K / 16)`` highest scores are selected; ties (equal float32 scores,
  e.g. all-zero rows) go to the lower block index (a stable descending sort); the selected indices
  are returned sorted ascending. ``-0.0`` cannot occur (scores are sums of non-negative terms
  starting from ``+0``).

``R_sel`` (the selected blocks' columns, gathered in ascending block order) is quantized in a
second pass with its own global scale. The compensated activation is
``deq(q1) + scatter(deq(q2))``, summed in float32 and cast once.

``score_weight`` (float32 ``[K]``, finite, >= 0; optional) makes the score output-aware: with
``score_weight = (W.float() ** 2).sum(0)`` for the layer's weight ``W`` ``[N, K]`` the block score
is the residual energy each block contributes to the GEMM output, ``sum_c R[c]**2 ||W[:, c]||**2``
(cross terms between channels ignored).

Per-call selection keeps the second pass a plain FP4 GEMM over gathered columns (or fusable into
the first as K' = K (1 + ratio)) but makes a token's activation depend on its batch mates (a
trainer cannot reproduce it, and generation is not batch-invariant); per-token selection makes
each token independent at the price of a per-row gathered second pass.

``granularity="channel"`` (per token only; :func:`residual_quantize_channel` is the reference, the Triton
kernel :mod:`verl_quads.nvfp4.triton_channel` gives the same bytes; docs/quads_selection.md), the rule over
single channels instead of 16-blocks:

- ``R = x - deq(Q(x))`` in float32 as above; score ``s[m, c] = R[m, c]**2`` (times
  ``score_weight[c]`` when given), float32;
- ``n_sel = round(ratio * K)`` channels per row, rounded half away from zero
  (``floor(ratio * K + 0.5)``, :func:`num_selected_channels`); the ``n_sel`` highest scores of each
  row are selected, ties (equal float32 scores, e.g. all-zero rows) to the lower channel index (a
  stable descending sort); the selection is returned as int64 indices ``[M, n_sel]`` sorted
  ascending (and as a bool mask ``[M, K]``, :attr:`ChannelResidualNVFP4.selected`);
- ``R_sel`` = ``R`` with the unselected channels set to ``+0.0`` (dense ``[M, K]``, float32);
- second pass ``Q(R_sel)`` over the ORIGINAL 16-blocks of K (dense ``[M, K]``), with its own global
  scale from the amax of ``R_sel``: per row when the first pass's is per row (``[M, 1]``, the
  rollout's convention), per tensor otherwise (as the block rule). A block with no selected channel
  is all zeros: block scale 0, codes 0 (an all-zero row gets global scale 1.0, see
  :func:`~verl_quads.nvfp4.global_scale_from_amax`), so it adds exactly 0;
- compensated activation ``deq(Q(x)) + deq(Q(R_sel))`` summed in float32, cast once.

``granularity="channel_sampled"`` (per token only; :func:`residual_quantize_channel_sampled`, the Triton kernel
:mod:`verl_quads.nvfp4.triton_channel` gives the same bytes): the channel rule with the row's threshold taken from a
fixed sample of its scores instead of an exact rank over all of them (docs/quads_selection.md, "Sampled threshold"):

- scores ``s[m, c]`` as in the channel rule; the sample of a row is ``P`` channels per 16-block, ``P = min(16,
  max(1, 512 // NBP))`` (``NBP`` = ``K / 16`` rounded up to a power of two: about 512 sampled channels, the whole row
  up to K = 512), channels ``16 b + ((b + i * 16 / P) mod 16)``, ``i < P``, of block ``b`` (:func:`sample_channels`;
  each position within a block equally often);
- ``n_s = round(ratio * S)`` (half away from zero; ``S = P * K / 16`` samples), clamped to ``[1, S]`` when
  ``n_sel > 0`` (:func:`num_sampled_threshold_rank`); the threshold ``T[m]`` is the ``n_s``-th highest sampled
  score of the row;
- selected: every channel with ``s[m, c] >= T[m]`` (ties at T all selected); ``n_sel = 0`` selects nothing and
  ``n_sel = K`` (ratio 1) everything, as the channel rule. The count per row is ``n_sel`` only on average (a row's
  count is a sample quantile: about ``ratio * K`` channels, within a few percent at K >= 2048), which is what makes
  the rule cheap: no exact rank over the whole row;
- ``R_sel``, the second pass and the compensated activation exactly as the channel rule; the selection is returned
  as a bool mask ``[M, K]`` (:class:`SampledChannelResidualNVFP4`).

At ``ratio = 1`` both rules select everything and give the same bytes. The channel rule's second
pass is a dense ``[M, K]`` FP4 operand, as the block rule's is in the GEMMs that run it as a second
``tl.dot`` over a dense operand (``residual_combine=fp4x2``) or sum the two QDQ operands
(``residual_combine=bf16``): the same GEMM FLOPs at equal ratio. For a GEMM over a COMPACT second
operand (``ratio * K`` columns) the equal-FLOP form regroups the selected channels into
``ratio * K / 16`` new blocks; on synthetic activations that measured the same error as the dense
form (relative GEMM output error / naive 0.256 vs 0.253 at k=0.5) but is not implemented here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from verl_quads.nvfp4.format import BLOCK_SIZE, NVFP4Tensor
from verl_quads.nvfp4.reference import (
    dequantize_to_float32,
    global_scale_from_amax,
    quantize,
    validate_input,
)

#: Residual selection granularities: 16-channel blocks (default) or single channels (per token only).
GRANULARITIES = ("block", "channel", "channel_sampled")

#: The granularities that select single channels per token (second pass dense ``[M, K]``).
CHANNEL_GRANULARITIES = ("channel", "channel_sampled")


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
    granularity: ClassVar[str] = "block"

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


def _dense_sum(first: NVFP4Tensor, second: NVFP4Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``deq(first) + deq(second)`` (both dense ``[M, K]``) summed in float32, cast once to ``dtype`` (default
    first's source dtype): the compensated activation of the channel rules."""
    from verl_quads.nvfp4 import dequantize  # the backend dispatcher (triton for CUDA tensors)

    out = dequantize(first, torch.float32) + dequantize(second, torch.float32)
    return out.to(dtype or first.dtype)


@dataclass(frozen=True)
class ChannelResidualNVFP4:
    """Both passes of a ``granularity="channel"`` residual compensation of ``x`` ``[M, K]`` (module docstring).

    Attributes:
        first: ``Q(x)``, logical shape ``[M, K]``.
        second: ``Q(R_sel)``, DENSE logical shape ``[M, K]`` in the original 16-blocks (unselected
            channels are +0 in ``R_sel``), float32 source dtype; global scale ``[M, 1]`` when the
            first pass's is per row, else per tensor.
        channel_idx: int64 ``[M, n_sel]``, each row's selected channels sorted ascending.
        ratio: the requested fraction of channels.
    """

    first: NVFP4Tensor
    second: NVFP4Tensor
    channel_idx: torch.Tensor
    ratio: float
    granularity: ClassVar[str] = "channel"

    @property
    def selected(self) -> torch.Tensor:
        """Bool mask ``[M, K]`` of the selected channels (``channel_idx`` scattered)."""
        m, k = self.first.shape
        mask = torch.zeros((m, k), dtype=torch.bool, device=self.channel_idx.device)
        return mask.scatter_(1, self.channel_idx, True)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``deq(first) + deq(second)`` summed in float32, cast once to ``dtype`` (default x's)."""
        return _dense_sum(self.first, self.second, dtype)


@dataclass(frozen=True)
class SampledChannelResidualNVFP4:
    """Both passes of a ``granularity="channel_sampled"`` residual compensation of ``x`` ``[M, K]`` (module
    docstring): as :class:`ChannelResidualNVFP4`, with the selection as a mask (its count varies per row).

    Attributes:
        first: ``Q(x)``, logical shape ``[M, K]``.
        second: ``Q(R_sel)``, dense logical shape ``[M, K]`` (as the channel rule's).
        selected: bool ``[M, K]``, the channels whose residual is compensated.
        ratio: the requested fraction of channels.
    """

    first: NVFP4Tensor
    second: NVFP4Tensor
    selected: torch.Tensor
    ratio: float
    granularity: ClassVar[str] = "channel_sampled"

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``deq(first) + deq(second)`` summed in float32, cast once to ``dtype`` (default x's)."""
        return _dense_sum(self.first, self.second, dtype)


def check_granularity(granularity: str, per_token: bool) -> None:
    """``granularity`` must be one of :data:`GRANULARITIES`; ``"channel"`` is per token only."""
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"residual granularity must be one of {GRANULARITIES} (block: 16-channel blocks; channel: single "
            f"channels, per token; channel_sampled: single channels over a sampled threshold, per token), got "
            f"{granularity!r}"
        )
    if granularity in CHANNEL_GRANULARITIES and not per_token:
        raise ValueError(
            f"residual granularity={granularity!r} selects channels per token (row) only; per_token=False (one "
            "selection per GEMM call) is defined for granularity='block' only"
        )


def num_selected_channels(k: int, ratio: float) -> int:
    """``round(ratio * K)`` (half away from zero: ``floor(ratio * K + 0.5)``), channels compensated per row."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"residual ratio must be in [0, 1], got {ratio}")
    return int(math.floor(ratio * k + 0.5))


def _channel_scores(residual: torch.Tensor, score_weight: torch.Tensor | None) -> torch.Tensor:
    """Float32 ``R**2`` per channel (times ``score_weight``): the channel rules' score."""
    score = residual.to(torch.float32).square()
    return score if score_weight is None else score * score_weight


def select_channels(residual: torch.Tensor, n_sel: int, score_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, the ``n_sel`` channels with the highest float32 score ``R**2`` (times ``score_weight``),
    ties to the lower channel index; int64 ``[M, n_sel]`` sorted ascending."""
    score = _channel_scores(residual, score_weight)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    return torch.sort(order[..., :n_sel], dim=-1).values


def samples_per_block(k: int) -> int:
    """``P``, the sampled channels per 16-block under ``granularity="channel_sampled"``: ``min(16, max(1, 512 //
    NBP))`` with ``NBP`` = the block count ``K / 16`` rounded up to a power of two (a sample of about 512 channels;
    the whole row up to 512 channels)."""
    nbp = 1 << max(0, (k // BLOCK_SIZE - 1).bit_length())
    return min(BLOCK_SIZE, max(1, 512 // nbp))


def sample_channels(k: int, device=None) -> torch.Tensor:
    """The sampled channels of a row of ``K`` channels (``granularity="channel_sampled"``), int64 ``[K / 16 * P]``
    (``P`` = :func:`samples_per_block`): of block ``b``, channels ``16 b + ((b + i * 16 / P) mod 16)``,
    ``i = 0 .. P - 1`` (each position within a block equally often)."""
    p = samples_per_block(k)
    b = torch.arange(k // BLOCK_SIZE, dtype=torch.int64, device=device)[:, None]
    i = torch.arange(p, dtype=torch.int64, device=device)[None, :] * (BLOCK_SIZE // p)
    return (b * BLOCK_SIZE + (b + i) % BLOCK_SIZE).flatten()


def num_sampled_threshold_rank(k: int, ratio: float) -> int:
    """``n_s``: the rank (1 = highest) of the sampled score that is a row's threshold under
    ``granularity="channel_sampled"``: ``round(ratio * S)`` half away from zero (``S = K / 16 * P`` sampled
    channels, :func:`samples_per_block`), clamped to ``[1, S]``; 0 when no channel is selected
    (``num_selected_channels(K, ratio) == 0``)."""
    if num_selected_channels(k, ratio) == 0:
        return 0
    n = k // BLOCK_SIZE * samples_per_block(k)
    return min(n, max(1, int(math.floor(ratio * n + 0.5))))


def select_channels_sampled(residual: torch.Tensor, ratio: float,
                            score_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask ``[M, K]`` of the channels selected by ``granularity="channel_sampled"`` (module docstring): per
    row, score ``>=`` the ``n_s``-th highest score of the sample (all channels at ratio 1, none at n_sel = 0)."""
    score = _channel_scores(residual, score_weight)
    m, k = score.shape
    n_sel = num_selected_channels(k, ratio)
    if n_sel == 0 or n_sel == k:
        return torch.full((m, k), n_sel == k, dtype=torch.bool, device=score.device)
    n_s = num_sampled_threshold_rank(k, ratio)
    sample = score[:, sample_channels(k, score.device)]
    threshold = torch.topk(sample, n_s, dim=-1, largest=True, sorted=True).values[:, -1:]
    return score >= threshold


def _second_pass_scale(r_sel: torch.Tensor, first: NVFP4Tensor) -> torch.Tensor:
    """Global scale of ``Q(R_sel)``: from R_sel's amax, per row if the first pass's scale is per row."""
    m = r_sel.shape[0]
    per_row = first.global_scale.dim() == 2 and first.global_scale.shape[0] == m and m > 1
    if r_sel.numel() == 0:
        amax = torch.zeros((m, 1) if per_row else (), dtype=torch.float32, device=r_sel.device)
    else:
        amax = r_sel.abs().amax(dim=-1, keepdim=True) if per_row else r_sel.abs().amax()
    return global_scale_from_amax(amax)


def _channel_passes(x, ratio, global_scale, score_weight, check_finite, select):
    """The two passes of a channel rule over a 2-D ``x`` ``[M, K]``: ``Q(x)``, the residual in float32, the
    selection ``select(residual, w)`` -> (its result, the bool mask ``[M, K]`` or None = every channel), ``R_sel``
    and ``Q(R_sel)``. Returns (first, second, the selection's result)."""
    validate_input(x, check_finite=check_finite)
    if x.dim() != 2:
        raise ValueError(f"residual_quantize: x must be 2-D [tokens, K], got shape {tuple(x.shape)}")
    first = quantize(x, global_scale, check_finite=False)
    residual = x.to(torch.float32) - dequantize_to_float32(first)
    num_selected_channels(x.shape[1], ratio)  # validates the ratio
    w = check_score_weight(score_weight, x.shape[1], x.device, check_values=check_finite)
    result, mask = select(residual, w)
    if mask is None:
        r_sel = residual
    else:
        r_sel = torch.where(mask, residual, torch.zeros((), dtype=torch.float32, device=x.device))
    second = quantize(r_sel, _second_pass_scale(r_sel, first), check_finite=False)
    return first, second, result


def residual_quantize_channel(
    x: torch.Tensor,
    ratio: float,
    global_scale: torch.Tensor | float | None = None,
    *,
    score_weight: torch.Tensor | None = None,
    check_finite: bool = True,
) -> ChannelResidualNVFP4:
    """``granularity="channel"`` residual compensation of a 2-D ``x`` ``[M, K]`` (module docstring)."""

    def select(residual, w):
        m, k = residual.shape
        n_sel = num_selected_channels(k, ratio)
        idx = select_channels(residual, n_sel, w)
        if n_sel == k:
            return idx, None
        return idx, torch.zeros((m, k), dtype=torch.bool, device=residual.device).scatter_(1, idx, True)

    first, second, idx = _channel_passes(x, ratio, global_scale, score_weight, check_finite, select)
    return ChannelResidualNVFP4(first, second, idx, ratio)


def residual_quantize_channel_sampled(
    x: torch.Tensor,
    ratio: float,
    global_scale: torch.Tensor | float | None = None,
    *,
    score_weight: torch.Tensor | None = None,
    check_finite: bool = True,
) -> SampledChannelResidualNVFP4:
    """``granularity="channel_sampled"`` residual compensation of a 2-D ``x`` ``[M, K]`` (module docstring)."""

    def select(residual, w):
        mask = select_channels_sampled(residual, ratio, w)
        return mask, mask

    first, second, mask = _channel_passes(x, ratio, global_scale, score_weight, check_finite, select)
    return SampledChannelResidualNVFP4(first, second, mask, ratio)


def num_selected_blocks(k: int, ratio: float) -> int:
    """``round(ratio * K / 16)`` (half away from zero), the number of 16-blocks compensated."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"residual ratio must be in [0, 1], got {ratio}")
    return int(math.floor(ratio * (k // BLOCK_SIZE) + 0.5))


def check_score_weight(
    score_weight: torch.Tensor | None, k: int, device, check_values: bool = True
) -> torch.Tensor | None:
    """Validate ``score_weight`` (float32 ``[K]``, finite, >= 0; the value check syncs the device
    and is skipped with ``check_values=False``) and move it to ``device``; ``-0.0`` becomes ``+0.0``
    (scores must be non-negative floats, see the module docstring)."""
    if score_weight is None:
        return None
    w = score_weight
    if not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or tuple(w.shape) != (k,):
        raise ValueError(
            f"residual score_weight must be a float32 tensor of shape [K] = [{k}] (one weight per input channel), got "
            f"{type(w).__name__} {getattr(w, 'dtype', '')} {tuple(getattr(w, 'shape', ()))}"
        )
    if check_values and (not bool(torch.isfinite(w).all()) or bool((w < 0).any())):
        raise ValueError(f"residual score_weight (shape {tuple(w.shape)}) must be finite and >= 0")
    return w.to(device).abs().contiguous()


def block_energy(residual: torch.Tensor, score_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Per-(row, block) score ``[M, K // 16]`` float32: sum of ``R**2`` (times ``score_weight``)
    over each 16-block, as the pairwise tree of adjacent pairs described in the module docstring."""
    v = residual.to(torch.float32).unflatten(-1, (-1, BLOCK_SIZE)).square()
    if score_weight is not None:
        v = v * score_weight.unflatten(-1, (-1, BLOCK_SIZE))
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v.squeeze(-1).contiguous()


def call_scores(energy: torch.Tensor) -> torch.Tensor:
    """Per-call block scores ``[K // 16]``: ``energy.sum(0)`` (one torch reduction shared by both backends)."""
    return energy.sum(0)


def select_blocks(
    residual: torch.Tensor, n_sel: int, per_token: bool, score_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Indices of the ``n_sel`` highest-scoring blocks (see module docstring), sorted ascending:
    ``[M, n_sel]`` per token, ``[n_sel]`` per call."""
    energy = block_energy(residual, score_weight)  # [M, nb]
    if not per_token:
        energy = call_scores(energy)
    order = torch.sort(energy, dim=-1, descending=True, stable=True).indices
    return torch.sort(order[..., :n_sel], dim=-1).values


def residual_quantize(
    x: torch.Tensor,
    ratio: float,
    global_scale: torch.Tensor | float | None = None,
    *,
    per_token: bool = True,
    score_weight: torch.Tensor | None = None,
    granularity: str = "block",
    check_finite: bool = True,
) -> ResidualNVFP4 | ChannelResidualNVFP4 | SampledChannelResidualNVFP4:
    """Residual-compensated NVFP4 of a 2-D activation ``x`` ``[M, K]`` (float32/bf16/fp16).

    ``global_scale`` is the first pass's (as in :func:`~verl_quads.nvfp4.quantize`); the second
    pass's global scale comes from the amax of ``R_sel`` (per tensor; per row if ``global_scale``
    is per row, i.e. shape ``[M, 1]``). ``per_token`` / ``score_weight`` / ``granularity``: the
    selection rule (see the module docstring; ``"channel"`` returns a :class:`ChannelResidualNVFP4`,
    per token only). Per-token selection is batch-invariant only with a per-row
    ``global_scale`` (a per-tensor one couples the rows through its amax).
    """
    check_granularity(granularity, per_token)
    if granularity == "channel":
        return residual_quantize_channel(x, ratio, global_scale, score_weight=score_weight, check_finite=check_finite)
    if granularity == "channel_sampled":
        return residual_quantize_channel_sampled(x, ratio, global_scale, score_weight=score_weight,
                                                 check_finite=check_finite)
    validate_input(x, check_finite=check_finite)
    if x.dim() != 2:
        raise ValueError(f"residual_quantize: x must be 2-D [tokens, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    first = quantize(x, global_scale, check_finite=False)
    residual = x.to(torch.float32) - dequantize_to_float32(first)
    n_sel = num_selected_blocks(k, ratio)
    w = check_score_weight(score_weight, k, x.device, check_values=check_finite)
    idx = select_blocks(residual, n_sel, per_token, w)
    gather_idx = idx if per_token else idx.expand(m, -1)
    r_sel = torch.gather(
        residual.unflatten(-1, (-1, BLOCK_SIZE)), 1, gather_idx.unsqueeze(-1).expand(-1, -1, BLOCK_SIZE)
    ).flatten(-2)
    second = quantize(r_sel, _second_pass_scale(r_sel, first), check_finite=False)
    return ResidualNVFP4(first, second, idx, ratio)


def residual_fake_quantize(
    x: torch.Tensor,
    ratio: float,
    global_scale: torch.Tensor | float | None = None,
    *,
    per_token: bool = True,
    score_weight: torch.Tensor | None = None,
    granularity: str = "block",
    check_finite: bool = True,
) -> torch.Tensor:
    """QDQ form ``Q(x) + Q(R_sel)`` of :func:`residual_quantize`, same shape and dtype as ``x``."""
    return residual_quantize(
        x, ratio, global_scale, per_token=per_token, score_weight=score_weight, granularity=granularity,
        check_finite=check_finite,
    ).dequantize(x.dtype)
