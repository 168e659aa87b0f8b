"""Triton fast path of the QUADS residual rule with ``granularity="channel"`` (per token; definition in
:mod:`.residual`, docs/quads_selection.md). Same bytes as :func:`verl_quads.nvfp4.residual.residual_quantize_channel`
(packed codes, E4M3 scale bytes, global scales, selected channels) and as its QDQ form.

One program per row of ``x`` ``[M, K]``, the whole row held on chip as a float32 ``[NBP, 16]`` tile (NB = K / 16
blocks padded to a power of two NBP; each 16-block one row of the tile, so the flattened tile is the channel order):

1. first pass ``Q(x)`` under the row's global scale (the shared helpers of :mod:`.triton_kernels`: E4M3 block
   scale ``_scales_inv``, E2M1 rounding ``_qdq_half`` / ``_packed_word``), ``R = x - deq(Q(x))`` in float32;
2. score ``R**2`` (times ``score_weight[c]``), float32 >= +0, so its int32 bit pattern orders like the value;
   the row's ``NSEL`` highest scores by the threshold search of ``_topn_threshold`` (MSB-first over the 31 value
   bits, stopped once the count is exact) over the ``NBP * 16`` channel bit patterns (padding -1 never counts),
   ties at the threshold to the lowest channel indices by a prefix count (``_tie_select``) -- the reference's
   stable descending sort, without a sort;
3. ``R_sel`` = R on the selected channels, ``+0.0`` elsewhere; its row amax gives the second-pass global scale
   (``_gs_from_amax`` = :func:`~verl_quads.nvfp4.global_scale_from_amax` bit for bit) when the first pass's is per
   row (``[M, 1]``) or M == 1; with a per-tensor first-pass scale and M > 1 the amax is over the whole tensor:
   a first launch writes each row's amax of R_sel (GS2 = 2), torch takes ``global_scale_from_amax`` of their max
   (the reference's ``r_sel.abs().amax()``), and a second launch uses it (GS2 = 1);
4. second pass ``Q(R_sel)`` dense over the original 16-blocks; PACK: both passes' words / scale bytes, the
   ascending channel indices ``[M, NSEL]`` (slot = prefix count of the selection) and the row's gs2; else the
   QDQ ``deq(Q(x)) + deq(Q(R_sel))`` summed in float32 over EVERY channel (an unselected one adds +0.0, as the
   reference's dense sum does) and cast once.

Rows longer than ``CHANNEL_CONFIG["max_k"]`` channels raise NotImplementedError (no tiled variant yet; never the
block rule, never a silent switch to torch). Kernels run with ``enable_fp_fusion=False`` and use no float negation
(triton 3.6 lowers ``-v`` to ``0.0 - v``), as :mod:`.triton_kernels`.
"""

from __future__ import annotations

import contextlib

import torch

from verl_quads.nvfp4.format import BLOCK_SIZE, NVFP4Tensor
from verl_quads.nvfp4.reference import global_scale_from_amax
from verl_quads.nvfp4.residual import ChannelResidualNVFP4, num_selected_channels
from verl_quads.nvfp4.residual import residual_quantize_channel as _ref_residual_quantize_channel
from verl_quads.nvfp4 import triton_kernels as tk

triton = tk.triton
tl = tk.tl

#: ``_channel_row_kernel`` launch: warps so that a thread holds about ``elems_per_thread`` channels of the row (the
#: tile is [NBP, 16] float32), clamped to [1, max_warps]; rows longer than ``max_k`` channels (padded to a power of
#: two of 16-blocks) are refused. Speed-only options (same bytes): ``search`` = "bits" (``_topn_threshold``: one
#: full-row count per threshold bit, ``early``: stopped once the count is exact) or "hist" (``_radix_threshold``: 8-bit
#: digits, one 256-bin histogram per digit, stopped once the count is exact); ``fast``: ``_hold_qdq_half``'s fused
#: E2M1 magic and the tie scan skipped when exactly NSEL scores are >= the threshold (``_select_top``); ``layout``:
#: "tile" (``_channel_row_kernel``, a [NBP, 16] tile) or "halves" (``_channel_halves_kernel``, one thread per block).
CHANNEL_CONFIG = {"elems_per_thread": 16, "max_warps": 16, "max_k": 32768, "early": True, "search": "bits",
                  "fast": False, "layout": "tile"}


if triton is not None:
    _scales_inv = tk._scales_inv
    _qdq_half = tk._qdq_half
    _packed_word = tk._packed_word
    _topn_threshold = tk._topn_threshold
    _tie_select = tk._tie_select
    _gs_from_amax = tk._gs_from_amax
    _store_out = tk._store_out
    _hold_qdq_half = tk._hold_qdq_half
    _select_top = tk._select_top

    @triton.jit
    def _radix_step(eb, th, cnt, k, NSEL):
        """Digit ``k`` (0..3: bits 30..23, 22..15, 14..7, 6..0) of ``_radix_threshold``: returns the new (th, cnt)."""
        bins = tl.arange(0, 256)
        lo = tl.maximum(23 - 8 * k, 0)
        dmask = (1 << (31 - 8 * k - lo)) - 1
        # th's bits below the prefix are 0: (eb >> lo) - (th >> lo) is the digit when eb's prefix equals th's,
        # >= 2**(digit width) when above (clamped to 255), < 0 when below or padding (clamped to 0)
        dig = tl.minimum(tl.maximum((eb >> lo) - (th >> lo), 0), 255)
        s = tl.cumsum(tl.histogram(dig, 256), axis=0, reverse=True)
        key = tl.max(tl.where((s >= NSEL) & (bins > 0) & (bins <= dmask), (bins << 16) | s, 0), axis=0)
        return th | ((key >> 16) << lo), tl.where(key > 0, key & 0xFFFF, cnt)

    @triton.jit
    def _radix_threshold(eb, NSEL, NVALID):
        """Selection threshold of a row by an MSB-first radix select over 8-bit digits (bits 30..23, 22..15, 14..7,
        then 6..0 of the score bits ``eb`` [N] int32, non-negative for the NVALID real entries, -1 for padding).
        Returns (th, cnt): th the accepted prefix (its lower digits zero) and cnt = #(eb >= th), with cnt == NSEL when
        the search stopped early (then the selection is exactly ``eb >= th``: the NSEL highest scores), else th = T,
        the largest value with #(eb >= T) >= NSEL (as ``_topn_threshold``; the caller breaks the ties at T).

        One step per digit (``_radix_step``): every entry is mapped to one of 256 bins -- its digit when its higher
        bits equal the accepted prefix, 255 when they are above it (already counted in, as every bin's suffix count
        includes it), 0 when below (and padding) -- one ``tl.histogram``, a reverse cumulative sum S[d] = #(eb >=
        prefix | d << lo) (exact for d >= 1; d = 0 keeps the prefix, whose count is the previous step's), and the
        largest d >= 1 with S[d] >= NSEL (else 0). Count and digit travel as one int32 key d << 16 | S[d] (S <= 32768)
        through a single max reduction. NSEL = 0 stops at the first step (no score has exponent byte 255 unless it is
        Inf/NaN). After two digits, if the candidates (entries whose bits 30..15 equal the prefix) are all one value v,
        T = v and the last two digits are skipped (count unchanged; #(> v) < NSEL): with bf16 inputs R**2 repeats, the
        count at T is rarely exact and this is the usual exit."""
        th = tl.full((), 0, tl.int32)  # a scalar without a reduction
        cnt = th + NVALID
        k = th
        while (k < 2) & (cnt != NSEL):
            th, cnt = _radix_step(eb, th, cnt, k, NSEL)
            k += 1
        if cnt != NSEL:
            cand = (eb >> 15) == (th >> 15)
            vmax = tl.max(tl.where(cand, eb, -1), axis=0)
            if tl.min(tl.where(cand, eb, 0x7FFFFFFF), axis=0) == vmax:
                th = vmax
                k = th * 0 + 4
        while (k < 4) & (cnt != NSEL):
            th, cnt = _radix_step(eb, th, cnt, k, NSEL)
            k += 1
        return th, cnt

    @triton.jit
    def _channel_row_kernel(
        x_ptr, gs_ptr, w_ptr, out_ptr, packed1_ptr, scale1_ptr, packed2_ptr, scale2_ptr, idx_ptr, gs2_ptr,
        NB, NSEL, GS_DIV,
        NBP: tl.constexpr, HAS_W: tl.constexpr, PACK: tl.constexpr, OUT: tl.constexpr, GS2: tl.constexpr,
        EARLY: tl.constexpr, SEARCH: tl.constexpr = 0, FAST: tl.constexpr = False,
    ):
        """Per-token channel-rule residual compensation of row ``program_id(0)`` of x [M, K] (module docstring).

        x: float32/bf16/fp16 [M, K] contiguous; gs_ptr: float32 first-pass encode scales, row r's at
        ``r // GS_DIV``; w_ptr: float32 [K] score weights (HAS_W); NB = K / 16; NSEL = channels selected per row.
        GS2 (second-pass global scale): 0 = from this row's amax of R_sel (written to gs2_ptr[row] when PACK);
        1 = gs2_ptr[0] (per tensor, computed by the caller); 2 = statistics only: write this row's amax of R_sel
        (float32) to gs2_ptr[row] and nothing else.
        PACK: packed1/packed2 int64 [M, NB] (one word per 16-block, byte j = code 2j | code 2j+1 << 4),
        scale1/scale2 uint8 [M, NB] (E4M3 bytes), idx int64 [M, NSEL] (ascending channels); else out [M, K] in
        x's dtype (OUT: ``_store_out`` code) = deq(Q(x)) + deq(Q(R_sel)).
        Speed only (same bytes): SEARCH 0 = ``_topn_threshold`` (bitwise; EARLY: stopped once exact), 1 =
        ``_radix_threshold`` (8-bit digits by histogram); FAST: ``_hold_qdq_half``'s fused magic and no tie scan
        when exactly NSEL scores are >= the threshold."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, NBP)
        e = tl.arange(0, 16)
        cmask = c < NB
        m2 = cmask[:, None]
        b = row * NB + c
        off = b[:, None] * 16 + e[None, :]
        x = tl.load(x_ptr + off, mask=m2, other=0.0).to(tl.float32)
        g = tl.load(gs_ptr + row // GS_DIV)
        gs = tl.zeros([NBP], tl.float32) + g
        inv = tl.zeros([NBP], tl.float32) + tl.math.div_rn(g * 0.0 + 1.0, g)
        sval, sbyte, os = _scales_inv(tl.max(tl.abs(x), axis=1), gs, inv)
        v = _hold_qdq_half(x, os, tl.math.div_rn(sval, gs), FAST)
        r = x - v
        s = r * r
        if HAS_W:
            s = s * tl.load(w_ptr + c[:, None] * 16 + e[None, :], mask=m2, other=0.0)
        eb = tl.reshape(tl.where(m2, s.to(tl.int32, bitcast=True), -1), (NBP * 16,))  # padding: never selected
        if SEARCH == 1:
            th, cnt = _radix_threshold(eb, NSEL, NB * 16)
            if cnt == NSEL:
                sel_f = eb >= th
            else:
                sel_f = _tie_select(eb, th, NSEL)
        else:
            th = _topn_threshold(eb, NSEL, 1, EARLY)
            sel_f = _select_top(eb, th, NSEL, FAST, EARLY)
        sel = tl.reshape(sel_f, (NBP, 16))
        rs = tl.where(sel, r, 0.0)
        ra = tl.max(tl.abs(rs), axis=1)
        amax = tl.zeros([NBP], tl.float32) + tl.max(ra, axis=0)
        if GS2 == 2:
            tl.store(gs2_ptr + row + c * 0, amax, mask=c == 0)
        else:
            if GS2 == 1:
                gs2 = tl.zeros([NBP], tl.float32) + tl.load(gs2_ptr)
            else:
                gs2 = _gs_from_amax(amax)
            inv2 = tl.math.div_rn(tl.full([NBP], 1.0, tl.float32), gs2)
            s2, sb2, os2 = _scales_inv(ra, gs2, inv2)
            if PACK:
                j = tl.arange(0, 8)
                xe, xo = tl.split(tl.reshape(x, (NBP, 8, 2)))
                re, ro = tl.split(tl.reshape(rs, (NBP, 8, 2)))
                tl.store(packed1_ptr + b, _packed_word(xe, xo, os, j), mask=cmask)
                tl.store(scale1_ptr + b, sbyte.to(tl.uint8), mask=cmask)
                tl.store(packed2_ptr + b, _packed_word(re, ro, os2, j), mask=cmask)
                tl.store(scale2_ptr + b, sb2.to(tl.uint8), mask=cmask)
                fi = tl.arange(0, NBP * 16)
                slot = tl.cumsum(sel_f.to(tl.int32), axis=0) - 1
                tl.store(idx_ptr + row * NSEL + slot, fi, mask=sel_f)  # cast to idx_ptr's int64
                if GS2 == 0:
                    tl.store(gs2_ptr + row + c * 0, gs2, mask=c == 0)
            else:
                out = v + _hold_qdq_half(rs, os2, tl.math.div_rn(s2, gs2), FAST)
                _store_out(out_ptr + off, out, m2, OUT)

    _load_halves = tk._load_halves
    _store_halves = tk._store_halves
    _tile_word = tk._tile_word

    @triton.jit
    def _half_ranks(q0, q1):
        """Inclusive ranks in channel order of the flags q0, q1 (int32 [NBP, 8]: elements 0..7 / 8..15 of each
        16-block, ``_load_halves`` layout): channel 16 b + 8 h + j gets #(flags set at channels <= it). The
        within-block counts are per thread; one cumulative sum runs over the NBP block totals."""
        n0 = tl.sum(q0, axis=1)
        n01 = n0 + tl.sum(q1, axis=1)
        before = tl.cumsum(n01, axis=0) - n01
        return before[:, None] + tl.cumsum(q0, axis=1), (before + n0)[:, None] + tl.cumsum(q1, axis=1)

    @triton.jit
    def _channel_halves_kernel(
        x_ptr, gs_ptr, w_ptr, out_ptr, packed1_ptr, scale1_ptr, packed2_ptr, scale2_ptr, idx_ptr, gs2_ptr,
        NB, NSEL, GS_DIV,
        NBP: tl.constexpr, HAS_W: tl.constexpr, PACK: tl.constexpr, OUT: tl.constexpr, GS2: tl.constexpr,
        EARLY: tl.constexpr, SEARCH: tl.constexpr = 0, FAST: tl.constexpr = False,
    ):
        """``_channel_row_kernel`` (same arguments, same bytes) with the row held as two float32 [NBP, 8] halves, one
        thread per 16-block (``_load_halves`` layout, as ``triton_kernels._residual_hold_kernel``): block maxima,
        scales, packed words (``_tile_word``) and QDQ stay in the thread; the selection counts every channel of
        both halves (the threshold depends on the multiset only), ties and index slots are ranked in channel order
        by ``_half_ranks``."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, NBP)
        cmask = c < NB
        b = row * NB + c
        x0, x1 = _load_halves(x_ptr, b, cmask)
        g = tl.load(gs_ptr + row // GS_DIV)
        gs = tl.zeros([NBP], tl.float32) + g
        inv = tl.zeros([NBP], tl.float32) + tl.math.div_rn(g * 0.0 + 1.0, g)
        sval, sbyte, os = _scales_inv(tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1)), gs, inv)
        factor = tl.math.div_rn(sval, gs)
        v0 = _hold_qdq_half(x0, os, factor, FAST)
        v1 = _hold_qdq_half(x1, os, factor, FAST)
        r0 = x0 - v0
        r1 = x1 - v1
        s0 = r0 * r0
        s1 = r1 * r1
        if HAS_W:
            w0, w1 = _load_halves(w_ptr, c, cmask)
            s0 = s0 * w0
            s1 = s1 * w1
        m2 = cmask[:, None]
        e0 = tl.where(m2, s0.to(tl.int32, bitcast=True), -1)  # padding: never selected
        e1 = tl.where(m2, s1.to(tl.int32, bitcast=True), -1)
        eb = tl.reshape(tl.join(e0, e1), (NBP * 16,))  # every channel once (not in channel order)
        if SEARCH == 1:
            th, cnt = _radix_threshold(eb, NSEL, NB * 16)
        else:
            th = _topn_threshold(eb, NSEL, 1, EARLY)
            cnt = tl.sum((eb >= th).to(tl.int32), axis=0)
        if cnt == NSEL:
            sel0 = e0 >= th
            sel1 = e1 >= th
        else:
            eq0 = e0 == th
            eq1 = e1 == th
            need = NSEL - tl.sum((eb > th).to(tl.int32), axis=0)
            k0, k1 = _half_ranks(eq0.to(tl.int32), eq1.to(tl.int32))
            sel0 = (e0 > th) | (eq0 & (k0 <= need))
            sel1 = (e1 > th) | (eq1 & (k1 <= need))
        rs0 = tl.where(sel0, r0, 0.0)
        rs1 = tl.where(sel1, r1, 0.0)
        ra = tl.maximum(tl.max(tl.abs(rs0), axis=1), tl.max(tl.abs(rs1), axis=1))
        amax = tl.zeros([NBP], tl.float32) + tl.max(ra, axis=0)
        if GS2 == 2:
            tl.store(gs2_ptr + row + c * 0, amax, mask=c == 0)
        else:
            if GS2 == 1:
                gs2 = tl.zeros([NBP], tl.float32) + tl.load(gs2_ptr)
            else:
                gs2 = _gs_from_amax(amax)
            inv2 = tl.math.div_rn(tl.full([NBP], 1.0, tl.float32), gs2)
            s2, sb2, os2 = _scales_inv(ra, gs2, inv2)
            if PACK:
                tl.store(packed1_ptr + b, _tile_word(x0, x1, os), mask=cmask)
                tl.store(scale1_ptr + b, sbyte.to(tl.uint8), mask=cmask)
                tl.store(packed2_ptr + b, _tile_word(rs0, rs1, os2), mask=cmask)
                tl.store(scale2_ptr + b, sb2.to(tl.uint8), mask=cmask)
                k0, k1 = _half_ranks(sel0.to(tl.int32), sel1.to(tl.int32))
                ch = c[:, None] * 16 + tl.arange(0, 8)[None, :]
                base = idx_ptr + row * NSEL - 1
                tl.store(base + k0, ch, mask=sel0)  # cast to idx_ptr's int64
                tl.store(base + k1, ch + 8, mask=sel1)
                if GS2 == 0:
                    tl.store(gs2_ptr + row + c * 0, gs2, mask=c == 0)
            else:
                f2 = tl.math.div_rn(s2, gs2)
                _store_halves(out_ptr, b, v0 + _hold_qdq_half(rs0, os2, f2, FAST),
                              v1 + _hold_qdq_half(rs1, os2, f2, FAST), cmask, OUT)


_SEARCH_CODES = {"bits": 0, "hist": 1}

#: Named CHANNEL_CONFIG overrides timed side by side by ``python -m verl_quads.bench.nvfp4 --channel`` (same bytes).
CHANNEL_VARIANTS = {
    "bits": {"layout": "tile", "search": "bits", "fast": False},
    "bits-fast": {"layout": "tile", "search": "bits", "fast": True},
    "hist-fast": {"layout": "tile", "search": "hist", "fast": True},
    "halves-bits-fast": {"layout": "halves", "search": "bits", "fast": True},
    "halves-hist-fast": {"layout": "halves", "search": "hist", "fast": True},
}


@contextlib.contextmanager
def channel_config(**overrides):
    """``CHANNEL_CONFIG`` with ``overrides`` applied inside the block (restored after; keys must exist)."""
    bad = sorted(set(overrides) - set(CHANNEL_CONFIG))
    if bad:
        raise KeyError(f"unknown CHANNEL_CONFIG keys {bad}; allowed {sorted(CHANNEL_CONFIG)}")
    old = dict(CHANNEL_CONFIG)
    CHANNEL_CONFIG.update(overrides)
    try:
        yield CHANNEL_CONFIG
    finally:
        CHANNEL_CONFIG.clear()
        CHANNEL_CONFIG.update(old)


def _search_code() -> int:
    try:
        return _SEARCH_CODES[CHANNEL_CONFIG["search"]]
    except KeyError:
        raise ValueError(f"CHANNEL_CONFIG['search'] = {CHANNEL_CONFIG['search']!r}: allowed {tuple(_SEARCH_CODES)}") from None


def _layout_kernel():
    layouts = {"tile": "_channel_row_kernel", "halves": "_channel_halves_kernel"}
    if CHANNEL_CONFIG["layout"] not in layouts:
        raise ValueError(f"CHANNEL_CONFIG['layout'] = {CHANNEL_CONFIG['layout']!r}: allowed {tuple(layouts)}")
    return globals()[layouts[CHANNEL_CONFIG["layout"]]]


def _warps(nbp: int) -> int:
    n = nbp * BLOCK_SIZE // (32 * CHANNEL_CONFIG["elems_per_thread"])
    return int(min(CHANNEL_CONFIG["max_warps"], max(1, tk._pow2(max(1, n)))))


def _check_row(k: int) -> int:
    nbp = tk._pow2(max(1, k // BLOCK_SIZE))
    if nbp * BLOCK_SIZE > CHANNEL_CONFIG["max_k"]:
        raise NotImplementedError(
            f"NVFP4 residual granularity='channel' on the triton backend holds a row on chip: K = {k} (padded to "
            f"{nbp * BLOCK_SIZE}) exceeds CHANNEL_CONFIG['max_k'] = {CHANNEL_CONFIG['max_k']}; use backend='torch'"
        )
    return nbp


def _run(x: torch.Tensor, ratio: float, global_scale, score_weight, check_finite: bool, packed: bool):
    num_selected_channels(x.shape[-1] if x.dim() else 0, ratio)  # validates the ratio first
    gs, xc, w = tk._residual_prepare(x, global_scale, score_weight, check_finite)
    m, k = x.shape
    if m == 0 or k == 0:  # nothing to launch; the reference defines the (empty) result and its shapes
        r = _ref_residual_quantize_channel(x, ratio, gs, score_weight=w, check_finite=False)
        return r if packed else r.dequantize(x.dtype)
    nb = k // BLOCK_SIZE
    nbp = _check_row(k)
    n_sel = num_selected_channels(k, ratio)
    dev = x.device
    g1, div1 = tk._gs_rows(gs, (m,))
    per_row = gs.dim() == 2 and gs.shape[0] == m and m > 1  # the reference's _second_pass_scale rule
    wt = w if w is not None else g1
    meta = dict(NB=nb, NSEL=n_sel, GS_DIV=div1, NBP=nbp, HAS_W=w is not None, EARLY=CHANNEL_CONFIG["early"],
                SEARCH=_search_code(), FAST=bool(CHANNEL_CONFIG["fast"]), num_warps=_warps(nbp),
                enable_fp_fusion=False)
    kern = _layout_kernel()
    gs2_mode, gs2_arg = 0, None
    if not per_row and m > 1:  # per-tensor second-pass scale: amax of R_sel over all rows first
        amax_rows = torch.empty(m, dtype=torch.float32, device=dev)
        kern[(m,)](xc, g1, wt, xc, xc, xc, xc, xc, xc, amax_rows, PACK=False, OUT=0, GS2=2, **meta)
        gs2_mode, gs2_arg = 1, global_scale_from_amax(amax_rows.amax())
    if not packed:
        out = torch.empty_like(xc)
        o = tk._out_arg(out)
        kern[(m,)](xc, g1, wt, o, o, o, o, o, o, gs2_arg if gs2_arg is not None else g1, PACK=False,
                   OUT=tk._out_code(x), GS2=gs2_mode, **meta)
        return out
    codes1 = torch.empty(m, k // 2, dtype=torch.uint8, device=dev)
    scale1 = torch.empty(m, nb, dtype=torch.uint8, device=dev)
    codes2 = torch.empty(m, k // 2, dtype=torch.uint8, device=dev)
    scale2 = torch.empty(m, nb, dtype=torch.uint8, device=dev)
    idx_buf = torch.empty(m, max(n_sel, 1), dtype=torch.int64, device=dev)  # n_sel = 0: nothing stored
    gs2_rows = torch.empty(m, dtype=torch.float32, device=dev) if gs2_arg is None else gs2_arg
    kern[(m,)](xc, g1, wt, xc, codes1.view(torch.int64), scale1, codes2.view(torch.int64), scale2,
               idx_buf, gs2_rows, PACK=True, OUT=0, GS2=gs2_mode, **meta)
    if gs2_arg is not None:
        gs2 = gs2_arg
    else:
        gs2 = gs2_rows.unsqueeze(-1) if per_row else gs2_rows.reshape(())  # the reference's shapes
    first = NVFP4Tensor(codes1, scale1.view(torch.float8_e4m3fn), gs, x.shape, x.dtype)
    second = NVFP4Tensor(codes2, scale2.view(torch.float8_e4m3fn), gs2, torch.Size((m, k)), torch.float32)
    return ChannelResidualNVFP4(first, second, idx_buf[:, :n_sel], ratio)


def residual_quantize(x: torch.Tensor, ratio: float, global_scale=None, *, score_weight: torch.Tensor | None = None,
                      check_finite: bool = True) -> ChannelResidualNVFP4:
    """Triton :func:`verl_quads.nvfp4.residual_quantize` with ``granularity="channel"`` (per token): x 2-D
    ``[M, K]`` float32/bf16/fp16; returns a :class:`ChannelResidualNVFP4` with the reference's bytes."""
    return _run(x, ratio, global_scale, score_weight, check_finite, packed=True)


def residual_fake_quantize(x: torch.Tensor, ratio: float, global_scale=None, *,
                           score_weight: torch.Tensor | None = None, check_finite: bool = True) -> torch.Tensor:
    """Triton :func:`verl_quads.nvfp4.residual_fake_quantize` with ``granularity="channel"``: ``deq(Q(x)) +
    deq(Q(R_sel))`` in x's dtype and shape ``[M, K]``, one launch (two with a per-tensor scale and M > 1)."""
    return _run(x, ratio, global_scale, score_weight, check_finite, packed=False)
