"""Gluon W4A16 kernel for the GROUPED MoE expert GEMMs (issue #5: 4..1024 tokens, ~1..64 slots per expert), Hopper.

The grouped twin of :func:`verl_quads.nvfp4.gluon_gemm.gluon_w4a16_std` (the dense standard-layout kernel): same
weight layout (the standard packed NVFP4 ``[E, N, K/2]`` uint8 + e4m3 ``[E, N, K/16]`` + float32 ``[E]``), the same
offsets, loads, decode, ``mma.sync m16n8k16`` and K loop (weights on the MMA's M side, the tile's activation rows on
its N side; :func:`~verl_quads.nvfp4.gluon_gemm.std_weight_offsets` / :func:`~verl_quads.nvfp4.gluon_gemm.k_loop`
called as they are, on the expert's weight pointers), the same numerics (exact products, float32 sums, ``* (256 / gs_e)`` once, one bf16 cast):
the same bound vs the torch reference as every other kernel.

Routing: the tile table of :func:`verl_quads.nvfp4.moe_routing.moe_align` (``GroupedRouting``, as the stream and
tensor-core kernels get it). One launch per GEMM, grid ``(N tiles, M-tiles T_max, split)``: program (n, t, k) reads
expert ``tile_expert[t]`` (tiles with expert -1, past the last expert's, do nothing) and its sorted rows
``[tile_row0[t], tile_row1[t])`` (at most ``block_m`` rows: 8, 16, 32 or 64) in passes of 8 NT rows (the MMA's N;
``GroupedConfig.nt``, default block_m / 8: one pass; each further pass re-reads the weight tile), activation row
``a_rows[r]`` of sorted row r (rows past the tile's end read the tile's last row; not stored), output row
``sorted_slots[r]``.
Split-K (``split`` > 1): float32 partials ``[split, out_rows, N]``; the last program of each (tile, N tile) (per-tile
counter, acq_rel atomic) sums them in the fixed order 0, 1, ... (deterministic), as the dense kernel.

Wide variant (``_w4a16_moe_wide_kernel``, taken for ``GroupedConfig.rg`` > 1 or ``xs``; for ~16+ slots per expert, where
the activation tile rivals the weight tile): each warp computes ``rg`` 16-row groups (a program 16 num_warps rg weight
rows) on one load of its activation fragments; ``xs`` stages the pass's activation rows in shared memory once per
program (cp.async, swizzled) and the warps read their fragments from there (one L2 read of the activation per program
instead of one per warp), with weight prefetch depth ``pfd`` (2: two iterations ahead). Same loads / decode / mma.sync
per row group and the same summation order as the kernel above: the same bytes at the same kc / nt / split. ``dec`` 3
(the wide kernel): gluon_gemm's mask + multiply pair decode (the same registers as the shifts).

Fused gate (``silu_mul``, the MoE w13 GEMM; ``FUSE``): a program reads BN / 2 gate rows and the matching BN / 2 up
rows of w13 (instead of BN consecutive rows; in each 16-row MMA group 8 gate rows and their 8 up rows, which land in
the same threads' accumulator registers) and its epilogue writes ``a = bf16(silu(g) * u)`` [S, I] from the bf16 GEMM
outputs g / u (moe_silu_mul's float32 arithmetic: the same bytes), not h [S, 2I]. Split 1 only
(:func:`silu_mul_refusal`).

Needs triton >= 3.6 with Gluon and an sm_80+ GPU; never runs under the Triton interpreter (no fallback here:
:func:`gluon_w4a16_grouped` raises where it cannot run). tests/gpu/test_gluon_moe_gpu.py checks it;
``python -m verl_quads.bench.gluon_moe_probe`` times it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from verl_quads.nvfp4 import device_info as di
from verl_quads.nvfp4.format import BLOCK_SIZE
from verl_quads.nvfp4.gemm_shared import tile_counters
from verl_quads.nvfp4.gluon_gemm import ROWS, STD_CHUNK, GluonConfig, _num_sms, _plan, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl

    from triton.experimental.gluon.language.extra import libdevice

    from verl_quads.nvfp4.gluon_gemm import (_iota, _k_range, _std_chunk_loads, _std_chunk_mma, dot_layout, k_loop,
                                             mma_layout, split_fixup, std_pair_layout, std_weight_offsets,
                                             std_word_layout, std_x_offsets, std_x_rows, xs_k_loop, xs_layout,
                                             xs_slots)

    @gluon.jit
    def _moe_scaled_rows(acc, gw, orow_ptr, n0, r0, r1, MMA: gl.constexpr, BN: gl.constexpr, NT: gl.constexpr,
                         ROUND: gl.constexpr):
        """The grouped epilogues' common part (both call it, so the fused gate reads exactly the values the unfused
        path stores): acc float32 [BN weight rows, 8 NT sorted rows from r0] (MMA layout) times ``256 / gs_e``
        (``gw``: gs_e per weight row, float32 [BN]; ``div_rn(1, gs_e) * 256`` per row, then one multiply per element:
        the numerics of every kernel) -> ``y`` float32 [BN, 8 NT] (ROUND: ``float32(bf16(y))``, the bf16 h the
        unfused split-1 path stores, for the fused gate's arithmetic); ``cols`` int32 [BN]: ``n0 + [0, BN)`` (the
        caller's column of each accumulator row); ``valid`` [8 NT]: sorted rows ``r0 + j < r1``; ``o`` int32 [8 NT]:
        their output rows ``sorted_slots[r0 + j]`` (0 where not valid). The ops in this order: the order of the
        two epilogues before they shared this (the same PTX)."""
        LR: gl.constexpr = gl.SliceLayout(1, MMA)
        post = gl.div_rn(gl.full([BN], 1.0, gl.float32, LR), gw) * 256.0
        y = acc * gl.expand_dims(post, 1)
        if ROUND:
            y = y.to(gl.bfloat16).to(gl.float32)
        cols = n0 + gl.arange(0, BN, layout=LR)
        r = r0 + gl.arange(0, NT * 8, layout=gl.SliceLayout(0, MMA))
        valid = r < r1
        o = gl.load(orow_ptr + r, mask=valid, other=0)
        return y, cols, valid, o

    @gluon.jit
    def _moe_epilogue(acc, gw, out_ptr, part_ptr, cnt_ptr, orow_ptr, r0, r1, N, OUT_ROWS, pid_n, pid_k, ci,
                      MMA: gl.constexpr, BN: gl.constexpr, NT: gl.constexpr, SPLIT: gl.constexpr):
        """acc [BN weight rows, 8 NT sorted rows from r0] times ``256 / gs_e`` (:func:`_moe_scaled_rows`) ->
        out[sorted_slots[r0 + j], n] in bf16 (rows < r1); SPLIT > 1: float32 partials at ``part[pid_k, out row, n]``,
        the last program of the (tile, N tile, row pass) -- counter ``ci`` -- sums them in the fixed order 0, 1, ..."""
        y, cols, valid, o = _moe_scaled_rows(acc, gw, orow_ptr, pid_n * BN, r0, r1, MMA, BN, NT, False)
        ncol = gl.expand_dims(cols, 1)
        orow = gl.expand_dims(o, 0)
        om = (ncol < N) & gl.expand_dims(valid, 0)
        if SPLIT == 1:
            gl.store(out_ptr + orow * N + ncol, y.to(gl.bfloat16), mask=om)
        else:  # partials [SPLIT, OUT_ROWS, N]: the dense kernel's fixup (no bias)
            split_fixup(y, part_ptr, orow, ncol, OUT_ROWS, N, pid_k, om, out_ptr, orow * N + ncol, cnt_ptr, ci, out_ptr,
                        cols, SPLIT, False)

    @gluon.jit
    def _gate_up_offsets(pid_n, N, KW, KB, NW: gl.constexpr, KC: gl.constexpr, WPT: gl.constexpr,
                         RG: gl.constexpr = 1):
        """:func:`~verl_quads.nvfp4.gluon_gemm.std_weight_offsets` of a fused gate program: in each of its R = NW RG
        16-row groups r, rows 8 rb3 + g (the MMA accumulator's rows g and 8 + g: one thread's registers) read the gate
        row ``8 (R pid_n + r) + g`` (rb3 0) and its up row ``N/2 + 8 (R pid_n + r) + g`` (rb3 1) of w13 (gate rows
        then up rows, N = 2I; the host checks I % (8 R) == 0, so no row is clamped)."""
        woff, kcw, soff, kcs = std_weight_offsets(0, N, KW, KB, NW, KC, WPT, RG)
        R: gl.constexpr = NW * RG
        L6: gl.constexpr = std_word_layout(NW, WPT)
        LS: gl.constexpr = gl.SliceLayout(6, std_pair_layout(NW, WPT))
        # std_weight_offsets(0, ...) reads row 16 r + 8 rb3 + g: shift it to 8 (R pid_n + r) + g + rb3 N/2
        shift_w = pid_n * (8 * R) - _iota(R, 0, 6, L6) * 8 + _iota(2, 1, 6, L6) * (N // 2 - 8)
        shift_s = pid_n * (8 * R) - _iota(R, 0, 6, LS) * 8 + _iota(2, 1, 6, LS) * (N // 2 - 8)
        return woff + shift_w * KW, kcw, soff + shift_s * KB, kcs

    @gluon.jit
    def _row_halves(v, BN: gl.constexpr, C: gl.constexpr):
        """[BN, C] (MMA accumulator layout) -> its rows 16 q + j and 16 q + 8 + j (j < 8) as two [BN / 16, 8, C]
        tensors: row bit 3 is a register bit of the layout, so this is a relabeling of each thread's registers."""
        return gl.split(gl.permute(gl.reshape(v, [BN // 16, 2, 8, C]), [0, 2, 3, 1]))

    @gluon.jit
    def _moe_silu_epilogue(acc, gw, out_ptr, orow_ptr, r0, r1, I, pid_n, MMA: gl.constexpr, BN: gl.constexpr,
                           NT: gl.constexpr):
        """Fused gate: acc [BN weight rows, 8 NT sorted rows from r0], row ``16 q + j`` the gate row ``n0 + 8 q + j``
        and row ``16 q + 8 + j`` its up row (:func:`_gate_up_offsets`, n0 = BN/2 pid_n, j < 8) -> ``a[sorted_slots[r0
        + c], n0 + 8 q + j] = bf16(silu(float32(g)) * float32(u))`` (``a`` bf16 [out rows, I]; rows < r1), g / u =
        bf16(acc * 256 / gs_e): GEMM1's bf16 output as the unfused path stores it in h, then moe_silu_mul's arithmetic
        (silu(g) = div_rn(g, 1 + libdevice expf(-g)), the float32 product, one cast). Gate and up values are the same
        thread's registers (:func:`_row_halves`): no shared memory, no barrier. The scaling, rounding and output rows:
        :func:`_moe_scaled_rows`, as the unfused epilogue's."""
        C: gl.constexpr = NT * 8
        hf, rows, valid, o = _moe_scaled_rows(acc, gw, orow_ptr, 0, r0, r1, MMA, BN, NT, True)
        off = gl.expand_dims(o, 0) * I + gl.expand_dims(pid_n * (BN // 2) + (rows // 16) * 8 + rows % 8, 1)
        live = gl.expand_dims(valid.to(gl.int32), 0) + gl.zeros([BN, C], gl.int32, MMA)
        g, u = _row_halves(hf, BN, C)
        off, _ = _row_halves(off, BN, C)
        live, _ = _row_halves(live, BN, C)
        a = gl.div_rn(g, libdevice.exp(-g) + 1.0) * u
        gl.store(out_ptr + off, a.to(gl.bfloat16), mask=live != 0)

    @gluon.jit
    def _w4a16_moe_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr,
                          arow_ptr, orow_ptr, te_ptr, tr0_ptr, tr1_ptr,
                          N, K, KW, KB, C, CPS, OUT_ROWS, GRID_N,
                          NW: gl.constexpr, KC: gl.constexpr, NT: gl.constexpr, PASSES: gl.constexpr,
                          SPLIT: gl.constexpr, EVEN: gl.constexpr, PF: gl.constexpr, WPT: gl.constexpr,
                          FUSE: gl.constexpr):
        """Grouped standard-layout W4A16: program (pid_n, pid_m, pid_k) computes rows ``16 (pid_n NW + w) + [0, 16)``
        of expert ``tile_expert[pid_m]``'s output for the tile's sorted rows, in passes of 8 NT rows (at most PASSES
        = block_m / (8 NT); each pass runs the K loop, later passes re-read the weight tile, mostly from L2), chunks
        ``[pid_k CPS, ...)``; ``w_ptr`` int32 ``[E, N, KW]``, ``s_ptr`` uint8 ``[E, N, KB]``, ``x_ptr`` bf16 ``[rows, K]``. Offsets, loads, decode, MMA and K loop: the dense kernel's (gluon_gemm
        std_weight_offsets / k_loop) on the expert's weight pointers and the pass's gathered activation rows.
        FUSE (w13, SPLIT 1): the program's rows are NW 8 gate rows and their up rows (:func:`_gate_up_offsets`)
        and the epilogue writes ``silu(gate) * up`` to ``out`` bf16 [OUT_ROWS, N / 2] (:func:`_moe_silu_epilogue`)."""
        MMA: gl.constexpr = mma_layout(NW)
        BN: gl.constexpr = NW * 16
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        e = gl.load(te_ptr + pid_m)
        if e >= 0:  # tiles past the last expert's: nothing
            r0 = gl.load(tr0_ptr + pid_m)
            r1 = gl.load(tr1_ptr + pid_m)
            c_lo, c_hi = _k_range(pid_k, CPS, C)
            e64 = e.to(gl.int64)
            w_e = w_ptr + e64 * N * KW
            s_e = s_ptr + e64 * N * KB
            if FUSE:
                woff, kcw, soff, kcs = _gate_up_offsets(pid_n, N, KW, KB, NW, KC, WPT)
            else:
                woff, kcw, soff, kcs = std_weight_offsets(pid_n, N, KW, KB, NW, KC, WPT)
            gw = gl.load(gs_ptr + e + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA)) * 0)
            slot = std_x_rows(NT, NW, WPT)
            for p in gl.static_range(PASSES):
                rs = r0 + p * (NT * 8)
                if rs < r1:
                    # the pass's activation rows (sorted rows past r1 read row r1 - 1: not stored)
                    xoff, kcx = std_x_offsets(gl.load(arow_ptr + gl.minimum(rs + slot, r1 - 1)), K, NW, KC, WPT)
                    acc = k_loop(gl.zeros([BN, NT * 8], gl.float32, MMA), w_e, s_e, x_ptr, woff, soff, xoff, kcw, kcs,
                                 kcx, c_lo, c_hi, K, NW, KC, NT, EVEN, PF, True, WPT)
                    if FUSE:
                        _moe_silu_epilogue(acc, gw, out_ptr, orow_ptr, rs, r1, N // 2, pid_n, MMA, BN, NT)
                    else:
                        _moe_epilogue(acc, gw, out_ptr, part_ptr, cnt_ptr, orow_ptr, rs, r1, N, OUT_ROWS, pid_n,
                                      pid_k, (pid_m * GRID_N + pid_n) * PASSES + p, MMA, BN, NT, SPLIT)


    # ---- wide variant: RG row groups per warp, optional activation staging in shared memory (XS)

    @gluon.jit
    def _wide_mma(acc, wd, sc, xv, NW: gl.constexpr, RG: gl.constexpr, KC: gl.constexpr, NT: gl.constexpr,
                  WPT: gl.constexpr, DEC: gl.constexpr):
        """The dense kernel's decode + mma.sync of one iteration (gluon_gemm._std_chunk_mma) over NW RG row groups."""
        wd = gl.convert_layout(gl.reshape(wd, (NW * RG, 2, 8, 4, KC, WPT // 2, 2)), std_pair_layout(NW, WPT),
                               assert_trivial=True)
        return _std_chunk_mma(acc, wd, sc, xv, dot_layout(NW, 0), dot_layout(NW, 1), NW * RG, KC, NT, WPT, DEC)

    @gluon.jit
    def _wide_k_loop(acc, w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kcx, c_lo, c_hi, NW: gl.constexpr,
                     RG: gl.constexpr, KC: gl.constexpr, NT: gl.constexpr, EVEN: gl.constexpr, PF: gl.constexpr,
                     WPT: gl.constexpr, DEC: gl.constexpr):
        """gluon_gemm.k_loop (standard layout) over NW RG row groups: each warp's activation fragments (loaded
        once per iteration, from global) feed its RG row groups' MMAs."""
        c_last = c_hi - KC
        if PF:
            nxt = _std_chunk_loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kcx, c_lo, c_hi, EVEN, WPT)
        for c0 in range(c_lo, c_hi, KC):
            if PF:
                cur = nxt
                cn = c0 + KC
                if EVEN:
                    cn = gl.minimum(cn, c_last)
                nxt = _std_chunk_loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kcx, cn, c_hi, EVEN, WPT)
            else:
                cur = _std_chunk_loads(w_ptr, s_ptr, x_ptr, woff, soff, xoff, kcw, kcs, kcx, c0, c_hi, EVEN, WPT)
            wd, sc, xv = cur
            acc = _wide_mma(acc, wd, sc, xv, NW, RG, KC, NT, WPT, DEC)
        return acc

    @gluon.jit
    def _wide_pass(x_s, x_ptr, w_e, s_e, gw, out_ptr, part_ptr, cnt_ptr, arow_ptr, orow_ptr, woff, kcw, soff, kcs,
                   rs, r1, K, N, OUT_ROWS, c_lo, c_hi, pid_n, pid_k, ci, NW: gl.constexpr, RG: gl.constexpr,
                   KC: gl.constexpr, NT: gl.constexpr, SPLIT: gl.constexpr, EVEN: gl.constexpr, PF: gl.constexpr,
                   WPT: gl.constexpr, XS: gl.constexpr, XC: gl.constexpr, XB: gl.constexpr, DEC: gl.constexpr,
                   FUSE: gl.constexpr):
        """One pass of 8 NT sorted rows from ``rs``: K loop (activation from global, or staged in smem: XS) and the
        epilogue (FUSE: the fused gate, :func:`_moe_silu_epilogue`)."""
        MMA: gl.constexpr = mma_layout(NW)
        BN: gl.constexpr = NW * RG * 16
        acc = gl.zeros([BN, NT * 8], gl.float32, MMA)
        if XS:  # the dense kernel's staged K loop on the pass's rows (rows >= r1 not read, their outputs not stored)
            j = rs + xs_slots(NT, NW)
            acc = xs_k_loop(acc, w_e, s_e, x_s, x_ptr, gl.load(arow_ptr + gl.minimum(j, r1 - 1)), j < r1, K, woff, soff,
                            c_lo, c_hi, NW, NT, PF, XC, XB, RG, DEC, 0, True)
        else:
            xoff, kcx = std_x_offsets(gl.load(arow_ptr + gl.minimum(rs + std_x_rows(NT, NW, WPT), r1 - 1)), K, NW, KC,
                                      WPT)
            acc = _wide_k_loop(acc, w_e, s_e, x_ptr, woff, soff, xoff, kcw, kcs, kcx, c_lo, c_hi, NW, RG, KC, NT, EVEN,
                               PF, WPT, DEC)
        if FUSE:
            _moe_silu_epilogue(acc, gw, out_ptr, orow_ptr, rs, r1, N // 2, pid_n, MMA, BN, NT)
        else:
            _moe_epilogue(acc, gw, out_ptr, part_ptr, cnt_ptr, orow_ptr, rs, r1, N, OUT_ROWS, pid_n, pid_k, ci, MMA,
                          BN, NT, SPLIT)

    @gluon.jit
    def _w4a16_moe_wide_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr,
                               arow_ptr, orow_ptr, te_ptr, tr0_ptr, tr1_ptr,
                               N, K, KW, KB, C, CPS, OUT_ROWS, GRID_N,
                               NW: gl.constexpr, RG: gl.constexpr, KC: gl.constexpr, NT: gl.constexpr,
                               NTS: gl.constexpr, PASSES: gl.constexpr, SPLIT: gl.constexpr, EVEN: gl.constexpr,
                               PF: gl.constexpr, WPT: gl.constexpr, XS: gl.constexpr, XC: gl.constexpr,
                               XB: gl.constexpr, DEC: gl.constexpr, FUSE: gl.constexpr):
        """:func:`_w4a16_moe_kernel` with RG 16-row groups per warp (``GroupedConfig.rg``): program (pid_n, pid_m,
        pid_k) computes rows ``16 NW RG pid_n + [0, 16 NW RG)``, warp w the row groups w, w + NW, ..., each with the
        dense kernel's loads, decode and mma.sync, on the same activation fragments (RG times fewer activation
        loads per weight byte). NTS > 0 (``nts``): a pass with at most 8 NTS rows left runs NTS n-tiles (else NT).
        XS (``xs``; KC 1, WPT 4): the pass's activation rows are staged in shared memory by cp.async, XC chunks per
        stage (``xsc``), XB (``xsb``) stage buffers, and the warps read their fragments from there (one global / L2
        read of the activation per program instead of one per warp); PF 0 / 1 / 2 weight prefetch depth. FUSE: the
        fused gate, as :func:`_w4a16_moe_kernel`'s (NW RG 8 gate rows + their up rows per program)."""
        MMA: gl.constexpr = mma_layout(NW)
        BN: gl.constexpr = NW * RG * 16
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        if XS:
            gl.static_assert(KC == 1 and WPT == 4, "activation staging: KC 1, WPT 4")
            x_s = gl.allocate_shared_memory(gl.bfloat16, [XB * XC, NT * 32, 8 * WPT], xs_layout())
        else:
            x_s = 0
        e = gl.load(te_ptr + pid_m)
        if e >= 0:  # tiles past the last expert's: nothing
            r0 = gl.load(tr0_ptr + pid_m)
            r1 = gl.load(tr1_ptr + pid_m)
            c_lo, c_hi = _k_range(pid_k, CPS, C)
            e64 = e.to(gl.int64)
            w_e = w_ptr + e64 * N * KW
            s_e = s_ptr + e64 * N * KB
            if FUSE:
                woff, kcw, soff, kcs = _gate_up_offsets(pid_n, N, KW, KB, NW, KC, WPT, RG)
            else:
                woff, kcw, soff, kcs = std_weight_offsets(pid_n, N, KW, KB, NW, KC, WPT, RG)
            gw = gl.load(gs_ptr + e + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA)) * 0)
            for p in gl.static_range(PASSES):
                rs = r0 + p * (NT * 8)
                ci = (pid_m * GRID_N + pid_n) * PASSES + p
                if rs < r1:
                    if NTS > 0:
                        if r1 - rs <= NTS * 8:
                            _wide_pass(x_s, x_ptr, w_e, s_e, gw, out_ptr, part_ptr, cnt_ptr, arow_ptr, orow_ptr, woff,
                                       kcw, soff, kcs, rs, r1, K, N, OUT_ROWS, c_lo, c_hi, pid_n, pid_k, ci, NW, RG,
                                       KC, NTS, SPLIT, EVEN, PF, WPT, XS, XC, XB, DEC, FUSE)
                        else:
                            _wide_pass(x_s, x_ptr, w_e, s_e, gw, out_ptr, part_ptr, cnt_ptr, arow_ptr, orow_ptr, woff,
                                       kcw, soff, kcs, rs, r1, K, N, OUT_ROWS, c_lo, c_hi, pid_n, pid_k, ci, NW, RG,
                                       KC, NT, SPLIT, EVEN, PF, WPT, XS, XC, XB, DEC, FUSE)
                    else:
                        _wide_pass(x_s, x_ptr, w_e, s_e, gw, out_ptr, part_ptr, cnt_ptr, arow_ptr, orow_ptr, woff, kcw,
                                   soff, kcs, rs, r1, K, N, OUT_ROWS, c_lo, c_hi, pid_n, pid_k, ci, NW, RG, KC, NT,
                                   SPLIT, EVEN, PF, WPT, XS, XC, XB, DEC, FUSE)

# ----------------------------------------------------------------------------------------------- host

#: routing block_m (the tile's row count) -> NT (8-row MMA n-tiles) of a one-pass launch
BLOCK_M_NT = {8: 1, 16: 2, 32: 4, 64: 8}


@dataclass(frozen=True)
class GroupedConfig(GluonConfig):
    """:class:`~verl_quads.nvfp4.gluon_gemm.GluonConfig` plus ``nt``: 8-row MMA n-tiles per pass over a tile's rows
    (0: block_m / 8, one pass; fewer: the tile's rows in passes of 8 nt, each pass re-reading the weight tile --
    cheaper MMA / activation work per pass where tiles hold few rows, e.g. 1 token-slot per expert)."""

    nt: int = 0
    # inherited: rg (16-row groups per warp: BN = 16 num_warps rg weight rows per program; > 1: the wide kernel),
    # pfd (xs only here: weight prefetch depth; 0: 1 if prefetch else 0; 2: two iterations ahead)
    xs: bool = False  # stage the pass's activation rows in shared memory once per program (the wide kernel; kc 1)
    nts: int = 0  # the wide kernel: a pass with <= 8 nts rows left runs nts n-tiles (0, or nts >= nt: always nt)
    xsc: int = 0  # xs: chunks (128 K elements) staged at a time (0: the program's whole K range)
    xsb: int = 1  # xs: stage buffers (2: the next stage is copied while this one is used)

    @property
    def label(self) -> str:
        """Built here field by field (not from GluonConfig.label, which grows options of the dense kernel, some
        with the same names): stable labels for the probe's picks and the GPU tests' ids."""
        rg, wev, dec, pfd = (getattr(self, "rg", 1), getattr(self, "wev", 0), getattr(self, "dec", 1),
                             getattr(self, "pfd", 0))
        return (f"w{self.num_warps} kc{self.kc} s{self.split or 'a'}{self.occ} pf{int(self.prefetch)}"
                f"{f' r{self.maxnreg}' if self.maxnreg else ''}{'' if self.asm else ' noasm'}"
                f"{f' rg{rg}' if rg != 1 else ''}{f' ev{wev}' if wev else ''}{f' d{dec}' if dec != 1 else ''}"
                f"{f' pd{pfd}' if pfd else ''}{f' nt{self.nt}' if self.nt else ''}{' xs' if self.xs else ''}"
                f"{f' nts{self.nts}' if self.nts else ''}{f' xsc{self.xsc}' if self.xsc else ''}"
                f"{f' xsb{self.xsb}' if self.xsb != 1 else ''}")


def _nt(cfg: GluonConfig, block_m: int) -> int:
    full = BLOCK_M_NT[block_m]
    nt = getattr(cfg, "nt", 0) or full
    if nt not in (1, 2, 4, 8) or full % nt:
        raise ValueError(f"gluon_w4a16_grouped: nt {nt} must be 1, 2, 4 or 8 and divide block_m / 8 = {full}")
    return nt


def grouped_supported(x: torch.Tensor, w_packed: torch.Tensor, block_m: int) -> bool:
    """Whether :func:`gluon_w4a16_grouped` can run this GEMM: Gluon importable, not under the Triton interpreter,
    bf16 activation ``[rows, K]`` on a CUDA device of compute capability 8.0+, a ``[E, N, K/2]`` weight,
    K % 128 == 0, routing block_m in :data:`BLOCK_M_NT`."""
    return (gluon is not None and os.environ.get("TRITON_INTERPRET") != "1" and x.is_cuda
            and x.dtype == torch.bfloat16 and x.dim() == 2 and w_packed.dim() == 3
            and x.shape[1] % STD_CHUNK == 0 and block_m in BLOCK_M_NT
            and di.capability(x.device)[0] >= 8)


def grouped_plan(n: int, k: int, live: int, cfg: GluonConfig, sms: int = 132) -> tuple[int, int, int, bool]:
    """(grid_n, split, chunks per split, even) of a grouped launch for ``[E, n, k]`` weights with ~``live`` live
    M-tiles (the host does not know how many experts are active: min(E, slots), as the stream kernel's split)."""
    nw = cfg.num_warps
    grid_n = -(-(-(-n // ROWS)) // (nw * getattr(cfg, "rg", 1)))
    _, split, cps, even = _plan(max(1, live) * grid_n * nw, k // STD_CHUNK, cfg, sms)
    return grid_n, split, cps, even


def silu_mul_refusal(n: int, k: int, live: int, cfg: GluonConfig, sms: int = 132) -> str:
    """Why :func:`gluon_w4a16_grouped` cannot fuse the gate (``silu_mul=True``) into a w13 GEMM of ``[E, n, k]``
    experts (n = 2I: gate rows then up rows) with ~``live`` live M-tiles under ``cfg``; "" where it can: a program
    pairs BN / 2 gate rows with their up rows (BN = 16 num_warps rg weight rows), so I % (BN / 2) == 0; and one K
    range (split 1: the fused epilogue has no split-K fixup)."""
    bn = 16 * cfg.num_warps * getattr(cfg, "rg", 1)
    if n % 2 or (n // 2) % (bn // 2):
        return (f"I = N / 2 = {n / 2:g} must be a multiple of BN / 2 = {bn // 2} (BN = 16 num_warps rg = {bn} "
                f"weight rows per program)")
    split = grouped_plan(n, k, live, cfg, sms)[1]
    if split != 1:
        return f"the config's plan splits K in {split} (the fused epilogue needs split 1: no split-K fixup)"
    return ""


def gluon_w4a16_grouped(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, w_gs: torch.Tensor,
                        routing, a_rows: torch.Tensor | None = None, out_rows: int | None = None,
                        cfg: GluonConfig = GluonConfig(kc=1, occ=2), zero_unrouted: bool = True,
                        silu_mul: bool = False) -> torch.Tensor:
    """Grouped W4A16: ``x`` bf16 ``[rows, K]``, NVFP4 experts ``w_packed`` uint8 ``[E, N, K/2]``, ``w_scale`` e4m3
    ``[E, N, K/16]``, ``w_gs`` float32 ``[E]``; ``routing`` a :class:`~verl_quads.nvfp4.moe_routing.GroupedRouting`
    (block_m 8, 16, 32 or 64); sorted row i reads ``x[a_rows[i]]`` (default ``routing.sorted_slots[i]``, as
    :func:`~verl_quads.nvfp4.triton_gemm.nvfp4_gemm`) and is written to row ``routing.sorted_slots[i]`` of the bf16
    ``[out_rows, N]`` result (default S rows); rows of slots with no local expert are 0 (``zero_unrouted=False``:
    left unset). Raises where the kernel cannot run (no fallback).

    ``silu_mul`` (the MoE w13 GEMM, ``w_packed`` rows = I gate rows then I up rows): returns ``a`` bf16 ``[out_rows,
    I]`` = ``cast(silu(float32(h[:, :I])) * float32(h[:, I:]))`` of the bf16 result h this call would return
    otherwise -- bit for bit :func:`~verl_quads.nvfp4.triton_gemm.moe_silu_mul` (h) -- without writing h (the gate
    in the GEMM's epilogue, one launch); ``zero_unrouted`` as above (rows of unrouted slots: 0, as moe_silu_mul
    writes them). Raises ValueError where :func:`silu_mul_refusal` says why it cannot."""
    if gluon is None:
        raise RuntimeError("gluon_w4a16_grouped needs triton >= 3.6 (triton.experimental.gluon)")
    if x.dim() != 2 or w_packed.dim() != 3:
        raise ValueError(f"gluon_w4a16_grouped: x [rows, K] and w [E, N, K/2], got {tuple(x.shape)} / "
                         f"{tuple(w_packed.shape)}")
    m, k = x.shape
    e, n, kh = w_packed.shape
    bm = routing.block_m
    if not grouped_supported(x, w_packed, bm) or kh * 2 != k or w_packed.dtype != torch.uint8 or tuple(
            w_scale.shape) != (e, n, k // BLOCK_SIZE) or w_scale.dtype != torch.float8_e4m3fn or w_gs.numel() != e:
        raise ValueError(f"gluon_w4a16_grouped: needs bf16 x [rows, K % 128 == 0] on CUDA (no interpreter), uint8 "
                         f"[E, N, K/2] / e4m3 [E, N, K/16] / float32 [E] weights and routing block_m in "
                         f"{tuple(BLOCK_M_NT)}; got x {x.dtype} {tuple(x.shape)}, w {tuple(w_packed.shape)}, "
                         f"block_m {bm}")
    nt = _nt(cfg, bm)
    rg, xs, pfd = getattr(cfg, "rg", 1), getattr(cfg, "xs", False), getattr(cfg, "pfd", 0)
    nts, xsc, xsb = getattr(cfg, "nts", 0), getattr(cfg, "xsc", 0), getattr(cfg, "xsb", 1)
    if (rg not in (1, 2, 4) or (xs and cfg.kc != 1) or pfd not in (0, 1, 2) or xsb not in (1, 2) or xsc < 0
            or ((pfd or xsc or xsb != 1) and not xs) or nts not in (0, 1, 2, 4)
            or getattr(cfg, "wev", 0) or getattr(cfg, "dec", 1) not in (1, 3)):
        raise ValueError(f"gluon_w4a16_grouped: rg 1 / 2 / 4, xs with kc 1 only, pfd 0..2 / xsc / xsb 1..2 with xs "
                         f"only, nts 0 / 1 / 2 / 4, dec 1 / 3 (the dense kernel's wev not taken); got {cfg}")
    if nts >= nt:  # tiles of this routing never hold more than 8 nts rows per pass: plain nt passes
        nts = 0
    passes = BLOCK_M_NT[bm] // nt
    s = routing.sorted_slots.numel()
    if getattr(cfg, "ks", 1) != 1:  # GroupedConfig inherits the dense kernel's in-program split-K; this kernel has none
        raise ValueError(f"gluon_w4a16_grouped: ks (split-K inside the program) is a dense-kernel option; got ks "
                         f"{cfg.ks} in {cfg}; use split for split-K here")
    rows_out = s if out_rows is None else out_rows
    if m * k >= 2**31 or e * n * k >= 2**33 or max(1, rows_out) * n * 64 >= 2**31:
        raise ValueError("gluon_w4a16_grouped: int32 offsets overflow at this size")
    dev = x.device
    x = x.contiguous()
    arow = routing.sorted_slots if a_rows is None else a_rows.to(torch.int32).contiguous()
    orow = routing.sorted_slots
    t_max = routing.tile_expert.numel()
    if t_max >= 65536:
        raise ValueError(f"gluon_w4a16_grouped: {t_max} M-tiles exceed the grid's y dimension")
    live = min(routing.num_experts, s)
    if silu_mul:
        why = silu_mul_refusal(n, k, live, cfg, _num_sms(dev))
        if why:
            raise ValueError(f"gluon_w4a16_grouped: silu_mul=True cannot run: {why}; got {cfg}")
    out = (torch.zeros if zero_unrouted else torch.empty)(rows_out, n // 2 if silu_mul else n, dtype=torch.bfloat16,
                                                          device=dev)
    if rows_out == 0 or n == 0 or t_max == 0:
        return out
    grid_n, split, cps, even = grouped_plan(n, k, live, cfg, _num_sms(dev))
    if split > 1:
        part = torch.empty(split, rows_out, n, dtype=torch.float32, device=dev)
        cnt = tile_counters(dev, t_max * grid_n * passes, "gluon_grouped", min_size=1 << 16)
        if cnt is None:
            raise RuntimeError("gluon_w4a16_grouped: first use of a larger grid inside CUDA-graph capture")
    else:
        part, cnt = out, arow
    args = (x, w_packed.view(torch.int32), w_scale.view(torch.uint8), w_gs.reshape(-1), out, part, cnt,
            arow, orow, routing.tile_expert, routing.tile_row0, routing.tile_row1,
            n, k, k // 8, k // BLOCK_SIZE, k // STD_CHUNK, cps, rows_out, grid_n)
    opts = dict(num_warps=cfg.num_warps, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    dec = getattr(cfg, "dec", 1)
    if rg == 1 and not xs and not nts and dec == 1:
        _w4a16_moe_kernel[(grid_n, t_max, split)](
            *args, NW=cfg.num_warps, KC=cfg.kc, NT=nt, PASSES=passes, SPLIT=split, EVEN=even, PF=int(cfg.prefetch),
            WPT=4, FUSE=bool(silu_mul), **opts)
    else:
        _w4a16_moe_wide_kernel[(grid_n, t_max, split)](
            *args, NW=cfg.num_warps, RG=rg, KC=cfg.kc, NT=nt, NTS=nts, PASSES=passes, SPLIT=split, EVEN=even,
            PF=(pfd or int(cfg.prefetch)) if xs else int(cfg.prefetch), WPT=4, XS=bool(xs),
            XC=min(xsc or cps, cps) if xs else 1, XB=xsb if xs else 1, DEC=dec, FUSE=bool(silu_mul), **opts)
    return out


__all__ = ["BLOCK_M_NT", "GroupedConfig", "grouped_supported", "grouped_plan", "silu_mul_refusal",
           "gluon_w4a16_grouped"]
