"""Routing of a grouped MoE GEMM: token-slots sorted by expert and the M-tile table of ONE grouped launch.

Used by every grouped kernel of the rollout (:func:`verl_quads.nvfp4.triton_gemm.moe_forward`, the stream kernel, the
Gluon grouped kernel of :mod:`verl_quads.nvfp4.gluon_moe`). Token-slots (``slot = token * top_k + k``) are sorted by
expert, stably; slots routed to no local expert (id < 0, expert parallelism) sort last and belong to no tile. The
launch grid of a grouped GEMM has a fixed upper bound of M-tiles, ``T_max = cdiv(S, block_m) + min(E, S)``; each tile
reads its expert and sorted-row range ``[row0, row1)`` from the tile table (expert -1 and an empty range past the last
expert's tiles). Everything is built on the ids' device with small Triton launches and no host synchronization, so a
whole MoE layer can be captured in a CUDA graph and replayed with new routing.

- :func:`moe_align`: the product path (one launch up to :data:`MOE_ALIGN_ONE_LAUNCH_MAX` slots, two past it);
- :func:`moe_align_reference`: the same result with torch ops (the tests' reference);
- :class:`GroupedRouting`: what both return (int32 tensors, layouts in its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_quads.nvfp4.triton_kernels import check_available, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _moe_hist_kernel(ids_ptr, hist_ptr, S, E, C: tl.constexpr, EP: tl.constexpr):
        """Program p: histogram ``[EP]`` int32 of the expert keys of slots ``p*C .. p*C + C`` (key = expert
        id, E for an id < 0 (not local), EP - 1 for padding past S) -> ``hist[p, :]``."""
        p = tl.program_id(0)
        hist = tl.zeros([EP], tl.int32)
        for c0 in range(0, C, 128):
            i = p * C + c0 + tl.arange(0, 128)
            valid = i < S
            e = tl.load(ids_ptr + i, mask=valid, other=-1).to(tl.int32)
            key = tl.where(valid, tl.where(e < 0, E, e), EP - 1)
            hist += tl.histogram(key, EP)
        tl.store(hist_ptr + p * EP + tl.arange(0, EP), hist)

    @triton.jit
    def _moe_tile_table(tend, tiles, start, cloc, te_ptr, tr0_ptr, tr1_ptr, t_first, t_step, E, T_MAX,
                        BM: tl.constexpr, EP: tl.constexpr, TT: tl.constexpr):
        """Tile-table blocks ``t_first, t_first + t_step, ...`` (TT entries each) of ``T_MAX`` M-tiles of height
        BM: expert (searchsorted of the tile ends ``tend``), row range; tiles past the last expert's get expert -1
        and an empty range. ``tiles`` / ``start`` / ``cloc``: tiles, first sorted row and local count per key."""
        ee = tl.arange(0, EP)
        for t0 in range(t_first, T_MAX, t_step):
            t = t0 + tl.arange(0, TT)
            ex = tl.sum((tend[None, :] <= t[:, None]).to(tl.int32), axis=1)  # searchsorted(tend, t, right)
            live = ex < E
            oh = ee[None, :] == ex[:, None]
            first = tl.sum(tl.where(oh, (tend - tiles)[None, :], 0), axis=1)
            st = tl.sum(tl.where(oh, start[None, :], 0), axis=1)
            cnt = tl.sum(tl.where(oh, cloc[None, :], 0), axis=1)
            r0 = st + (t - first) * BM
            r1 = tl.minimum(st + cnt, r0 + BM)
            tm = t < T_MAX
            tl.store(te_ptr + t, tl.where(live, ex, -1), mask=tm)
            tl.store(tr0_ptr + t, tl.where(live, r0, 0), mask=tm)
            tl.store(tr1_ptr + t, tl.where(live, r1, 0), mask=tm)

    @triton.jit
    def _moe_scatter_run(ids_ptr, sorted_ptr, tok_ptr, run, p, S, E, TOPK, C: tl.constexpr, EP: tl.constexpr):
        """Program p's chunk of C slots (stable counting sort): slot i goes to sorted row ``run[key] + (slots of key
        earlier in its 64-slot step)``, ``run[key]`` (the next sorted row of each key: start + slots of the key in
        earlier chunks on entry) advanced by each step's histogram: ``sorted[row] = i``, ``tok[row] = i // TOPK``."""
        ee = tl.arange(0, EP)
        ii = tl.arange(0, 64)
        for c0 in range(0, C, 64):
            i = p * C + c0 + ii
            valid = i < S
            e = tl.load(ids_ptr + i, mask=valid, other=-1).to(tl.int32)
            key = tl.where(valid, tl.where(e < 0, E, e), EP - 1)
            rank = tl.sum(((key[:, None] == key[None, :]) & (ii[None, :] < ii[:, None])).to(tl.int32), axis=1)
            pos = tl.sum(tl.where(ee[None, :] == key[:, None], run[None, :], 0), axis=1) + rank
            run += tl.histogram(key, EP)
            tl.store(sorted_ptr + pos, i, mask=valid)
            tl.store(tok_ptr + pos, i // TOPK, mask=valid)

    @triton.jit
    def _moe_scan_scatter_kernel(ids_ptr, hist_ptr, te_ptr, tr0_ptr, tr1_ptr, sorted_ptr, tok_ptr, S, E, TOPK, P,
                                 T_MAX, C: tl.constexpr, EP: tl.constexpr, PP: tl.constexpr, BM: tl.constexpr,
                                 TT: tl.constexpr):
        """moe_align past MOE_ALIGN_ONE_LAUNCH_MAX slots, after :func:`_moe_hist_kernel`: ONE launch of P programs
        (the scan is tiny: every program redoes it from the P chunk histograms in registers instead of a separate
        one-program launch): program p takes ``start`` (first sorted row of each key) and the slots of each key in
        chunks before p, scatters its chunk (:func:`_moe_scatter_run`) and writes the tile-table blocks ``p, p + P,
        ...`` (:func:`_moe_tile_table`)."""
        p = tl.program_id(0)
        pp = tl.arange(0, PP)
        ee = tl.arange(0, EP)
        h = tl.load(hist_ptr + pp[:, None] * EP + ee[None, :], mask=(pp < P)[:, None], other=0)
        counts = tl.sum(h, axis=0)
        cl = tl.where(ee <= E, counts, 0)
        start = tl.cumsum(cl, axis=0) - cl
        cloc = tl.where(ee < E, counts, 0)
        tiles = (cloc + BM - 1) // BM
        _moe_tile_table(tl.cumsum(tiles, axis=0), tiles, start, cloc, te_ptr, tr0_ptr, tr1_ptr, p * TT, P * TT, E,
                        T_MAX, BM, EP, TT)
        run = start + tl.sum(tl.where((pp < p)[:, None], h, 0), axis=0)  # next sorted row of each key
        _moe_scatter_run(ids_ptr, sorted_ptr, tok_ptr, run, p, S, E, TOPK, C, EP)

    @triton.jit
    def _moe_table_part(e, q, te_ptr, tr0_ptr, tr1_ptr, T_MAX, EP: tl.constexpr, BM: tl.constexpr,
                        EB: tl.constexpr, MT: tl.constexpr, TD: tl.constexpr):
        """Part q of the tile table from all expert ids ``e`` (int32 [SP] in registers, < 0 = not local or padding):
        per-expert counts by a masked histogram ([EP], bins E .. EP-1 stay 0), tiles = ceil(count / BM), then the
        tiles of experts ``q*EB .. q*EB + EB`` scattered (tile j of expert x is entry ``first[x] + j``, ``first`` =
        exclusive cumsum of tiles: an [EB, MT] store, MT >= the most tiles of one expert; the block's counts read
        by ``tl.gather``) and the dead entries ``q*TD .. q*TD + TD`` at or past the experts' tiles (expert -1, empty
        range). Over the parts ``q = 0 .. EP/EB - 1`` (TD * EP/EB >= T_MAX) every entry is written exactly once, and
        no part searches: programs writing blocks of the searched table (:func:`_moe_tile_table`, [TT, EP]
        compare-sums) made the launch 1.6 / 1.5 / 1.8 / 6.6 us slower on the H200 at 512 / 2048 / 4096 / 8192 slots
        (session 11, helper A batch 2)."""
        loc = e >= 0
        counts = tl.histogram(tl.where(loc, e, 0), EP, mask=loc)
        tiles = (counts + BM - 1) // BM
        tend = tl.cumsum(tiles, axis=0)
        start = tl.cumsum(counts, axis=0) - counts
        eq = q * EB + tl.arange(0, EB)
        nq = tl.gather(tiles, eq, 0)
        fq = tl.gather(tend - tiles, eq, 0)
        sq = tl.gather(start, eq, 0)
        cq = tl.gather(counts, eq, 0)
        jt = tl.arange(0, MT)
        live = jt[None, :] < nq[:, None]  # [EB, MT]
        t = fq[:, None] + jt[None, :]
        r0 = sq[:, None] + jt[None, :] * BM
        tl.store(te_ptr + t, eq[:, None] + jt[None, :] * 0, mask=live)
        tl.store(tr0_ptr + t, r0, mask=live)
        tl.store(tr1_ptr + t, tl.minimum((sq + cq)[:, None], r0 + BM), mask=live)
        total = tl.sum(tiles, axis=0)
        td = q * TD + tl.arange(0, TD)
        dead = (td >= total) & (td < T_MAX)
        tl.store(te_ptr + td, tl.full([TD], -1, tl.int32), mask=dead)
        tl.store(tr0_ptr + td, tl.zeros([TD], tl.int32), mask=dead)
        tl.store(tr1_ptr + td, tl.zeros([TD], tl.int32), mask=dead)

    @triton.jit
    def _moe_align_fused_kernel(ids_ptr, te_ptr, tr0_ptr, tr1_ptr, sorted_ptr, tok_ptr, S, E, TOPK, T_MAX, P,
                                SP: tl.constexpr, C: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr,
                                EB: tl.constexpr, MT: tl.constexpr, TD: tl.constexpr):
        """moe_align in ONE launch with no global scratch (S <= SP slots, E <= EP experts, EP a power of two):
        programs ``0 .. P-1`` scatter chunk p (C slots), programs ``P .. P + EP/EB - 1`` write part ``p - P`` of the
        tile table (:func:`_moe_table_part`). Every program loads all S expert ids (int32 [SP] in registers) and
        histograms them itself instead of reading chunk histograms of an earlier launch. Scatter (stable): local
        slot i of chunk p (lo = p*C) goes to row ``run[e_i] + #(slots of e_i earlier in the chunk: a [C, C]
        compare-sum)``, ``run[x]`` = #(local slots of experts < x) + #(slots of x before lo) = the inclusive cumsum
        of ONE masked histogram of ``e_j + (j >= lo)`` (slot j counts for run[x] iff e_j < x, or e_j == x and
        j < lo), read by ``tl.gather``; a slot with id < 0 (not local) goes to row ``n_local + #(non-local slots
        before i)``. Int32 throughout; same outputs as :func:`moe_align_reference`; rows from counts, so the result
        does not depend on program order. (Two histograms instead, all slots + the slots before lo: 18.1-18.3 vs
        15.9-16.1 us at 8192 slots with the searched table, H200 batch 2.)"""
        pid = tl.program_id(0)
        ii = tl.arange(0, SP)
        e = tl.load(ids_ptr + ii, mask=ii < S, other=-1).to(tl.int32)
        loc = e >= 0
        if pid < P:
            lo = pid * C
            kp = tl.where(loc, e, 0) + (ii >= lo).to(tl.int32)
            run = tl.cumsum(tl.histogram(kp, EP, mask=loc & (kp < EP)), axis=0)
            nl_base = tl.sum(tl.where(loc, 1, (ii < lo).to(tl.int32)), axis=0)  # lo < S: slots before lo are valid
            cc = tl.arange(0, C)
            jj = lo + cc
            vj = jj < S
            ej = tl.load(ids_ptr + jj, mask=vj, other=-1).to(tl.int32)
            kj = tl.where(ej >= 0, ej, E)  # padding (j >= S) ranks after every valid slot: larger index
            rank = tl.sum(((kj[:, None] == kj[None, :]) & (cc[None, :] < cc[:, None])).to(tl.int32), axis=1)
            pos = tl.where(ej >= 0, tl.gather(run, tl.where(ej >= 0, ej, 0), 0), nl_base) + rank
            tl.store(sorted_ptr + pos, jj, mask=vj)
            tl.store(tok_ptr + pos, jj // TOPK, mask=vj)
        else:
            _moe_table_part(e, pid - P, te_ptr, tr0_ptr, tr1_ptr, T_MAX, EP, BM, EB, MT, TD)


@dataclass(frozen=True)
class GroupedRouting:
    """Token-slots sorted by expert, and the tile table of one grouped launch (all int32, on device).

    Attributes:
        sorted_slots: ``[S]`` slot index (``token * top_k + k``) of each sorted row; slots routed to
            no local expert (id < 0) sort last and belong to no tile.
        tile_expert / tile_row0 / tile_row1: ``[T_max]`` expert and sorted-row range ``[row0, row1)``
            of each M-tile (expert -1 and an empty range past the last expert's tiles).
        block_m: the M-tile height the table was built for (the GEMM's BLOCK_M).
        num_experts: E.
        sorted_tokens: ``[S]`` ``sorted_slots // top_k`` (the token of each sorted row), or None.
    """

    sorted_slots: torch.Tensor
    tile_expert: torch.Tensor
    tile_row0: torch.Tensor
    tile_row1: torch.Tensor
    block_m: int
    num_experts: int
    sorted_tokens: torch.Tensor | None = None


def moe_align_reference(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> GroupedRouting:
    """:func:`moe_align` with torch ops (sort, scatter_add, cumsum, searchsorted; ~15 launches): the
    reference its Triton kernels are tested against. ``expert_ids``: int ``[T, top_k]``, -1 = not local."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    s = flat.numel()
    dev = flat.device
    key = torch.where(flat < 0, torch.full_like(flat, num_experts), flat)
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    start = torch.cumsum(counts, 0) - counts
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    t_max = -(-s // block_m) + min(num_experts, s)
    t = torch.arange(t_max, device=dev)
    e = torch.searchsorted(tile_end, t, right=True)
    live = e < num_experts
    ec = e.clamp(max=num_experts - 1)
    local = t - (tile_end[ec] - tiles[ec])
    r0 = start[ec] + local * block_m
    r1 = start[ec] + counts[ec]
    zero = torch.zeros_like(r0)
    top_k = expert_ids.shape[-1] if expert_ids.dim() > 1 else 1
    return GroupedRouting(
        sorted_slots=order.to(torch.int32),
        tile_expert=torch.where(live, ec, torch.full_like(ec, -1)).to(torch.int32),
        tile_row0=torch.where(live, r0, zero).to(torch.int32),
        tile_row1=torch.where(live, torch.minimum(r1, r0 + block_m), zero).to(torch.int32),
        block_m=block_m,
        num_experts=num_experts,
        sorted_tokens=torch.div(order, top_k, rounding_mode="floor").to(torch.int32),
    )


#: token-slots up to which moe_align is ONE launch with no global scratch (:func:`_moe_align_one_launch`, decode
#: included, at any number of experts); past it the two launches, the histogram and
#: _moe_scan_scatter_kernel (every scatter program redoes the tiny scan from the chunk histograms; H200, 2048 slots,
#: session 10: 14.4-14.8 us vs 33.7-33.9 for histogram, scan and scatter as three launches). The one launch replaced
#: (session 12) the one-program kernel through global scratch that took S <= 256 slots with more than 256 experts:
#: H200, 512 experts, CUDA graph, us (session 11 helper A, tests/gpu/test_moe_align_one_launch_gpu.py): that kernel
#: 32.4-33.0 / 61.7-62.7 / 86.2-87.3 at S = 8 / 128 / 256, the one launch 4.0-5.2 / 4.2-11.3 / 4.3-11.4 (session 12
#: batches 1-3, test_moe_align_paths_timed: 4.0-4.1 / 5.4 / 5.6-5.8, the two launches 38.0-38.4 / 60.2-60.3 /
#: 60.5-60.9). H200, 128 experts, top-8, CUDA graph of one call, us (session 11, helper A batches 1-4;
#: tests/gpu/test_moe_align_one_launch_gpu.py sweep; each == moe_align_reference): one launch 3.4 / 3.9-4.2 /
#: 5.2-5.5 / 8.7-9.0 / 16.7-16.9 / 41.8-42.4 at S = 512 / 2048 / 4096 / 8192 / 16384 / 32768 vs the two launches
#: 14.1-14.3 / 12.5-13.0 / 12.7-13.1 / 13.0-13.5 / 18.0-18.4 / 28.3 (an empty launch: 3.3-6.3, it varies between
#: runs). Also measured there and dropped: one program sorting ``expert * S + slot`` keys with tl.sort (15 us at 2048
#: slots, 34-46 at 4096) and chunk programs that rank their slots against all slots by a [C, S] compare-sum (5.4 /
#: 8.0 / 16.5 us at 2048 / 4096 / 8192 with the scattered tile table). Removed in session 12: the register path
#: (one program ranking the slots in registers by an [S, S] compare-sum, no scratch; it took S <= 16 slots at <= 256
#: experts, S <= 128 until then). H200 (2026-12-01, session 12 helper A batches 1-3, tests/gpu
#: test_moe_align_paths_timed: top-8, CUDA graph of one call, min of 5 alternating, each == moe_align_reference;
#: docs/bench_rollout_h200_session12.txt A1-A3). The floor moves between runs (128 experts, S = 8: 3.4 / 5.5 / 6.1 us
#: in the three), so the paths are compared within a run, registers minus one launch, us: 128 experts +0.02 / -0.01
#: / -0.05 at S = 8, +0.11 / -0.02 at 16, +0.59 / 0.00 at 24, +0.41 / +0.06 at 32, +0.76 / +0.39 at 48, +1.0 at 64
#: (5.05-5.10 vs 4.03-4.15), +1.3-1.4 at 128, +3.5-4.2 at 256 (8.6-8.7 vs 4.4-5.3); 256 experts 0.00 / +0.40 at 8,
#: -0.09 / +0.31 at 16, +0.23 at 32, +1.2 at 64: a tie at 8-16 slots, slower past them, so one path is kept.
MOE_ALIGN_ONE_LAUNCH_MAX = 16384


def _moe_align_chunk(slots: int) -> int:
    """Scatter chunk of :func:`_moe_align_one_launch` at ``slots`` token-slots: ``slots / 64`` rounded up to a power
    of two, clamped to 32..128 (every scatter program histograms all slots, so more programs cost more; a [C, C]
    rank compare per program, so larger chunks cost more too). H200, 128 experts, CUDA graph (session 11, helper A
    batches 2-3), fastest chunk at 512 / 2048 / 4096 / 8192 / 16384 slots: 32 / 32 / 64 / 128 / 128 (16384: 16.9 us
    vs 18.1-18.3 with chunk 256 or 64)."""
    return min(128, max(32, triton.next_power_of_2(-(-slots // 64))))


def _moe_align_one_launch(flat: torch.Tensor, num_experts: int, top_k: int, block_m: int, outs,
                          chunk: int | None = None, num_warps: int = 8, eb: int = 16) -> None:
    """moe_align of the int ids ``flat`` [S] in ONE launch of :func:`_moe_align_fused_kernel` into ``outs`` =
    (tile_expert, tile_row0, tile_row1, sorted_slots, sorted_tokens) (int32, [T_max] x 3 and [S] x 2):
    S / ``chunk`` scatter programs (default :func:`_moe_align_chunk`) and EP / ``eb`` tile-table programs
    (``eb`` experts each; EP = E rounded up to a power of two >= 16)."""
    s = flat.numel()
    te, tr0, tr1, sorted_slots, sorted_tokens = outs
    t_max = te.numel()
    chunk = _moe_align_chunk(s) if chunk is None else chunk
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"moe_align: chunk must be a power of two >= 16, got {chunk}")
    if eb < 1 or eb & (eb - 1):
        raise ValueError(f"moe_align: eb (experts per tile-table program) must be a power of two, got {eb}")
    ep = max(16, triton.next_power_of_2(num_experts))
    eb = min(eb, ep)
    p, nq = -(-s // chunk), ep // eb
    _moe_align_fused_kernel[(p + nq,)](
        flat, te, tr0, tr1, sorted_slots, sorted_tokens, s, num_experts, top_k, t_max, p,
        SP=max(16, triton.next_power_of_2(s)), C=chunk, EP=ep, BM=block_m, EB=eb,
        MT=max(2, triton.next_power_of_2(-(-s // block_m))), TD=max(16, triton.next_power_of_2(-(-t_max // nq))),
        num_warps=num_warps)


def moe_align(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> GroupedRouting:
    """Sort token-slots by expert (stable) and build the tile table with small Triton launches on the ids' device,
    no host synchronization (graph-capturable): up to :data:`MOE_ALIGN_ONE_LAUNCH_MAX` slots, decode included (at
    S = 8 / 16 it ties the removed register path: H200, session 12), ONE launch of :func:`_moe_align_fused_kernel`
    (scatter programs and tile-table programs, each histogramming all ids, no scratch; any number of experts); past
    it two launches (chunk histograms; then scan + tile table + stable counting-sort scatter). ``expert_ids``: int
    ``[T, top_k]`` local expert ids, -1 = not local. Same result as :func:`moe_align_reference` (tested)."""
    flat = expert_ids.reshape(-1).contiguous()
    check_available(flat)
    s = flat.numel()
    dev = flat.device
    top_k = expert_ids.shape[-1] if expert_ids.dim() > 1 else 1
    t_max = -(-s // block_m) + min(num_experts, s)
    i32 = dict(dtype=torch.int32, device=dev)
    sorted_slots = torch.empty(s, **i32)
    sorted_tokens = torch.empty(s, **i32)
    te, tr0, tr1 = torch.empty(t_max, **i32), torch.empty(t_max, **i32), torch.empty(t_max, **i32)
    if 0 < s <= MOE_ALIGN_ONE_LAUNCH_MAX:
        _moe_align_one_launch(flat, num_experts, top_k, block_m, (te, tr0, tr1, sorted_slots, sorted_tokens))
    elif s > 0:
        ep = triton.next_power_of_2(num_experts + 2)  # keys 0..E-1, E (not local), EP-1 (padding)
        chunk = 128 * max(1, -(-s // (128 * 64)))  # <= 64 chunks
        p = -(-s // chunk)
        hist = torch.empty(p, ep, **i32)
        _moe_hist_kernel[(p,)](flat, hist, s, num_experts, C=chunk, EP=ep)
        _moe_scan_scatter_kernel[(p,)](flat, hist, te, tr0, tr1, sorted_slots, sorted_tokens, s, num_experts, top_k,
                                       p, t_max, C=chunk, EP=ep, PP=triton.next_power_of_2(p), BM=block_m, TT=32,
                                       num_warps=8)
    return GroupedRouting(sorted_slots=sorted_slots, tile_expert=te, tile_row0=tr0, tile_row1=tr1,
                          block_m=block_m, num_experts=num_experts, sorted_tokens=sorted_tokens)


__all__ = ["GroupedRouting", "MOE_ALIGN_ONE_LAUNCH_MAX", "moe_align", "moe_align_reference"]
