"""Fused NVFP4 dequantize + GEMM on bf16 tensor cores (Triton): the rollout's ``triton`` backend.

For GPUs without FP4 tensor cores (Hopper). The weight operand stays packed NVFP4 in memory and is
dequantized tile by tile inside the GEMM, so a GEMM reads 0.5625 bytes per weight element instead
of 2 (bf16): decode-sized GEMMs, which are bound by weight bytes, get faster; the arithmetic is the
one of an FP4 tensor-core GEMM:

- an NVFP4 element ``code_value * block_scale`` (E2M1 x E4M3: at most 6 significant bits, range
  2**-10 .. 2688) is EXACT in bf16 (and fp16), so tiles are dequantized WITHOUT the global scale
  and multiplied on bf16 tensor cores (``tl.dot``) with float32 accumulation: every product is
  exact, only the float32 accumulation order differs from the torch reference;
- the float32 accumulator is multiplied by ``1 / weight_global_scale`` (per tensor or per expert)
  and, for W4A4 operands, by ``1 / activation_global_scale`` of the row (one per token), then
  bias is added in float32 and the result is cast once to the output dtype;
- QUADS (``Q(x) + Q(R_sel)``): the residual operand has its own per-row global scale, so it is
  accumulated in a second float32 accumulator (second K-loop over the selected 16-blocks only:
  ``K' = K (1 + ratio)`` of work for per-call selection; for per-token selection a second pass
  over all K in which a weight block is read only if some row of the tile selected it, so a
  decode tile streams ~``ratio * K`` extra weight columns) and the two are combined in float32:
  ``y = (acc1 / gs1_row + acc2 / gs2_row) / gs_w``.
- QUADS, opt-in operand form ``residual_combine="bf16"`` (:data:`RESIDUAL_COMBINES`): the compensated
  activation is the core's QDQ form :func:`verl_quads.nvfp4.residual_fake_quantize` (``Q(x) + Q(R_sel)``
  summed in float32 and rounded ONCE to the activation dtype: one fused activation kernel), multiplied
  by the ``w4a16`` GEMM (the weight-streaming kernel at decode, the tensor-core kernel above at
  prefill: no second operand, no second accumulator). It differs from the default ``fp4x2`` by that one
  rounding of the activation (relative <= 2**-8 per element for bf16, 2**-11 for fp16; none for float32
  activations) plus float32 summation order.

Differences to the torch reference (:mod:`verl_quads.rollout.emulation`, ``x_f32 @ w_f32.T``):
the reference multiplies each element by ``fl(block_scale / global_scale)`` before summing, this
module divides the sum once; and the float32 summation order differs. Both are float32-rounding
effects (relative ~1e-7 of the sum's terms); after the cast to bf16 the outputs agree to within one
bf16 ulp of the output magnitude (tests measure and assert it).

Activation quantization is NOT done here: :func:`quantize_activation` calls the core
(:func:`verl_quads.nvfp4.quantize` / :func:`~verl_quads.nvfp4.residual_quantize`, backend
``"triton"``), so the rollout's codes are the trainer's bit for bit; the GEMM reads the packed
activation like an FP4 GEMM would.

Layouts (all contiguous, row-major):

- weight: ``w_packed`` uint8 ``[N, K/2]`` or ``[E, N, K/2]`` (element 2i in the LOW nibble),
  ``w_scale`` float8_e4m3fn ``[..., N, K/16]``, ``w_gs`` float32 encode scale, 0-d (per tensor) or
  ``[E]`` (per expert);
- activation (:class:`ActOperand`): ``values`` ``[M, K]`` bf16/fp16/fp32 (w4a16) or an
  :class:`NVFP4Tensor` ``[M, K]`` with per-row global scale ``[M, 1]`` (W4A4); the QUADS residual
  as packed ``[M, NSEL2 * 8]`` + e4m3 ``[M, NSEL2]`` + float32 ``[M]`` and a block table.

Grouped MoE GEMM (one launch for all experts): token-slots are sorted by expert (stable, see
:func:`verl_quads.nvfp4.moe_routing.moe_align`); the launch grid has a fixed upper bound of M-tiles
(``cdiv(S, BM) + min(E, S)``), each tile reads its expert and row range from a tile table built on the device (no
host sync, so the launch can be captured in a CUDA graph); tiles past the last expert's do no work. A tile's rows
are gathered through ``a_rows`` (e.g. slot -> token for the first expert GEMM) and written through
``out_rows`` (slot order).

Decode (small M): the GEMM is bound by weight bytes; :func:`pick_config` uses small BLOCK_M and
splits K across programs (``split_k``) until the grid fills the GPU; partial sums go to a float32
workspace ``[split_k, rows, N]`` and are summed in a fixed order (deterministic) by one reduction launch.

W4A16 decode, weight streaming (issue #5): :mod:`.triton_stream` (``_w4a16_stream_kernel``, :class:`StreamConfig`,
the measured :data:`DECODE_TABLE`); :func:`nvfp4_gemm` dispatches to it. Split-K reduction and the pieces both kernels
share: :mod:`.gemm_shared`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from verl_quads.nvfp4.custom_ops import linear_custom_op
from verl_quads.nvfp4.format import BLOCK_SIZE, NVFP4Tensor
from verl_quads.nvfp4.gemm_shared import interpreting, num_sms, splitk_reduce
from verl_quads.nvfp4.gluon_dispatch import (
    GLUON_MOE_ROUTING_BLOCK_M,
    gluon_dense_config,
    gluon_grouped_config,
    gluon_grouped_entry,
    gluon_moe_bucket,
)
from verl_quads.nvfp4.gluon_gemm import GluonConfig
from verl_quads.nvfp4.gluon_tma import TmaConfig, gluon_w4a16_tma
from verl_quads.nvfp4.guidance import GuidanceRecord
from verl_quads.nvfp4.moe_routing import GroupedRouting, moe_align
from verl_quads.nvfp4.residual import CHANNEL_GRANULARITIES, num_selected_channels
from verl_quads.nvfp4.triton_stream import StreamConfig, decode_config, stream_gemm
from verl_quads.nvfp4.triton_kernels import _OUT_DTYPES, check_available, triton

if triton is not None:
    import triton.language as tl

    from verl_quads.nvfp4.gemm_shared import _dot1
    from verl_quads.nvfp4.triton_kernels import _store_out

ACT_MODES = ("w4a16", "naive", "quads", "trace")
#: QUADS operand forms: two FP4 operands combined in float32 (default), or the QDQ activation in x's dtype
RESIDUAL_COMBINES = ("fp4x2", "bf16")


if triton is not None:

    @triton.jit
    def _fp4_decode(b, sv, DT: tl.constexpr):
        """NVFP4 bytes ``b`` (int32 ``[R, HB]``, element 2i in the LOW nibble) and the block scale of
        each byte ``sv`` (float32 ``[R, HB]``, E4M3 value * 2**14) -> ``(even, odd)``: the values
        E2M1(code) * block_scale of elements 2i and 2i+1, ``[R, HB]`` each, in the dot's operand type
        DT (0 float32, 1 bf16, 2 fp16); exact in all three (at most 6 significant bits, 2**-10..2688).

        E2M1 by bits, no table: the fp16 whose bits are ``((c & 7) << 9) | ((c & 8) << 12)`` equals
        E2M1(c) * 2**-14 exactly (exponent bits and mantissa bit land in place; code 1 = 0.5 is the
        fp16 subnormal 2**-15; bit 3 is the sign), so one multiply by ``block_scale * 2**14`` gives the
        value."""
        lo = ((b & 7) << 9) | ((b & 8) << 12)
        hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
        ve = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * sv
        vo = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * sv
        if DT == 1:
            return ve.to(tl.bfloat16), vo.to(tl.bfloat16)
        elif DT == 2:
            return ve.to(tl.float16), vo.to(tl.float16)
        else:
            return ve, vo

    @triton.jit
    def _fp4_pairs(p_ptr, s_ptr, prow, srow, rmask, kb0, kb_hi, R: tl.constexpr, G: tl.constexpr,
                   DT: tl.constexpr, KMASK: tl.constexpr, SC4: tl.constexpr):
        """Contiguous NVFP4 tile: rows with byte offsets ``prow`` (packed codes) / ``srow`` (e4m3
        scales), int64 ``[R]``; 16-blocks ``kb0 .. kb0 + G`` (blocks >= ``kb_hi`` and masked rows read
        as 0) -> ``(even, odd)`` ``[R, G * 8]`` (see :func:`_fp4_decode`): column j holds element
        ``k = kb0 * 16 + 2 j`` / ``2 j + 1``. One plain 2-D byte load (contiguous along K) and one scale
        byte per 16-block (E4M3 -> float by the hardware conversion; scale bytes are 0..126, never
        the NaN code), broadcast to its 8 bytes. KMASK False: the caller guarantees
        ``kb0 + G <= kb_hi`` (no K mask, so the loads vectorize to 16 bytes). SC4 True (needs KMASK
        False, ``G``, ``kb0`` and the scale row offsets multiples of 4): the scale bytes are loaded as
        int32 words (4 blocks each, little-endian) and split by shifts, so the load is asynchronous
        (pipelined with cp.async on sm_80+; a 1-byte load is not, and stalls every K step on the
        memory latency, which bounds decode)."""
        j = tl.arange(0, G * 8)
        g = tl.arange(0, G)
        if KMASK:
            bmask = rmask[:, None] & ((kb0 * 8 + j) < kb_hi * 8)[None, :]
            smask = rmask[:, None] & ((kb0 + g) < kb_hi)[None, :]
        else:
            bmask = rmask[:, None]
            smask = rmask[:, None]
        b = tl.load(p_ptr + prow[:, None] + (kb0 * 8 + j)[None, :], mask=bmask, other=0).to(tl.int32)
        if SC4:
            g4 = tl.arange(0, G // 4)
            t4 = tl.arange(0, 4)
            wp = (s_ptr + srow[:, None] + (kb0 + 4 * g4)[None, :]).to(tl.pointer_type(tl.int32))
            w4 = tl.load(wp, mask=smask, other=0)
            sc = tl.reshape((w4[:, :, None] >> (8 * t4)[None, None, :]) & 0xFF, (R, G)).to(tl.uint8)
        else:
            sc = tl.load(s_ptr + srow[:, None] + (kb0 + g)[None, :], mask=smask, other=0)
        sv = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
        sv = tl.reshape(tl.broadcast_to(sv[:, :, None], (R, G, 8)), (R, G * 8))
        return _fp4_decode(b, sv, DT)

    @triton.jit
    def _fp4_pairs_gathered(p_ptr, s_ptr, prow, srow, rmask, blk, bmask1, G: tl.constexpr, DT: tl.constexpr):
        """Like :func:`_fp4_pairs` for the 16-blocks ``blk`` (int ``[G * 8]``: the block of each byte
        column, i.e. each block index repeated 8 times; ``bmask1`` ``[G * 8]`` masks columns): the
        weight blocks a QUADS per-call residual selected (a gather, one scale load per byte)."""
        j = tl.arange(0, G * 8)
        m = rmask[:, None] & bmask1[None, :]
        b = tl.load(p_ptr + prow[:, None] + (blk * 8 + j % 8)[None, :], mask=m, other=0).to(tl.int32)
        sc = tl.load(s_ptr + srow[:, None] + blk[None, :], mask=m, other=0)
        return _fp4_decode(b, sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0, DT)

    @triton.jit
    def _a16_pairs(a_ptr, arow, rmask, kb0, kb_hi, K, G: tl.constexpr, DT: tl.constexpr, KMASK: tl.constexpr):
        """Unquantized activation rows ``arow`` (int64 ``[R]``) of ``[M, K]``: ``(even, odd)``
        ``[R, G * 8]`` columns ``k = kb0 * 16 + 2 j`` / ``2 j + 1`` (the K order of :func:`_fp4_pairs`),
        from one ``[R, G * 8, 2]`` load split on its last (per-thread) dimension."""
        j = tl.arange(0, G * 8)
        t = tl.arange(0, 2)
        k = kb0 * 16 + 2 * j
        if KMASK:
            m = rmask[:, None, None] & (k < kb_hi * 16)[None, :, None] & (t < 2)[None, None, :]
        else:
            m = rmask[:, None, None]
        a3 = tl.load(a_ptr + arow[:, None, None] * K + k[None, :, None] + t[None, None, :], mask=m, other=0.0)
        ae, ao = tl.split(a3)
        if DT == 1:
            return ae.to(tl.bfloat16), ao.to(tl.bfloat16)
        elif DT == 2:
            return ae.to(tl.float16), ao.to(tl.float16)
        else:
            return ae.to(tl.float32), ao.to(tl.float32)

    @triton.jit
    def _a16_tile(a_ptr, arow, rmask, kb0, kb_hi, K, G: tl.constexpr, DT: tl.constexpr, KMASK: tl.constexpr):
        """Unquantized activation rows ``arow`` (int64 ``[R]``) of ``[M, K]``: the tile ``[R, G * 16]``
        of columns ``k = kb0 * 16 + j`` in natural K order, one plain 2-D load contiguous along K (16-byte
        vectors; the operand goes to the MMA like a bf16 GEMM's), cast to DT."""
        j = tl.arange(0, G * 16)
        k = kb0 * 16 + j
        if KMASK:
            m = rmask[:, None] & (k < kb_hi * 16)[None, :]
        else:
            m = rmask[:, None]
        a = tl.load(a_ptr + arow[:, None] * K + k[None, :], mask=m, other=0.0)
        if DT == 1:
            return a.to(tl.bfloat16)
        elif DT == 2:
            return a.to(tl.float16)
        else:
            return a.to(tl.float32)

    @triton.jit
    def _fp4_tile(p_ptr, s_ptr, prow, srow, rmask, kb0, kb_hi, R: tl.constexpr, G: tl.constexpr,
                  DT: tl.constexpr, KMASK: tl.constexpr, SC4: tl.constexpr):
        """Like :func:`_fp4_pairs` but the tile ``[R, G * 16]`` in natural K order (column ``k - kb0 * 16``):
        the decoded (even, odd) halves interleaved in registers (``tl.join`` adds a per-thread dimension
        of 2, the reshape merges it into K)."""
        ve, vo = _fp4_pairs(p_ptr, s_ptr, prow, srow, rmask, kb0, kb_hi, R, G, DT, KMASK, SC4)
        return tl.reshape(tl.join(ve, vo), (R, G * 16))

    @triton.jit
    def _dot2(acc, ae, ao, we, wo, SWAP: tl.constexpr, DT: tl.constexpr):
        """``acc + ae @ we.T + ao @ wo.T`` (float32 accumulation; the even and odd halves of K), or
        with SWAP the transposed ``acc + we @ ae.T + wo @ ao.T`` (weight rows fill the MMA's M side:
        decode tiles have few activation rows)."""
        if SWAP:
            if DT == 0:
                acc = tl.dot(we, tl.trans(ae), acc, input_precision="ieee")
                acc = tl.dot(wo, tl.trans(ao), acc, input_precision="ieee")
            else:
                acc = tl.dot(we, tl.trans(ae), acc)
                acc = tl.dot(wo, tl.trans(ao), acc)
        else:
            if DT == 0:
                acc = tl.dot(ae, tl.trans(we), acc, input_precision="ieee")
                acc = tl.dot(ao, tl.trans(wo), acc, input_precision="ieee")
            else:
                acc = tl.dot(ae, tl.trans(we), acc)
                acc = tl.dot(ao, tl.trans(wo), acc)
        return acc

    @triton.jit
    def _nvfp4_gemm_kernel(
        a_ptr, as_ptr, ags_ptr, a2_ptr, a2s_ptr, a2gs_ptr, idx2_ptr,
        w_ptr, ws_ptr, wgs_ptr, bias_ptr, out_ptr,
        arow_ptr, orow_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
        M, N, K, KH, KB, NSEL2, OUT_ROWS, KB_PER_SPLIT, JB_PER_SPLIT,
        A4: tl.constexpr, DT: tl.constexpr, DT2: tl.constexpr, SECOND: tl.constexpr, GROUPED: tl.constexpr,
        HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, OUT: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, GK: tl.constexpr, G2: tl.constexpr, SWAP: tl.constexpr,
        EVEN_K: tl.constexpr, SC4: tl.constexpr, NAT: tl.constexpr = False,
    ):
        """One (BM rows x BN cols) output tile, K-range ``pid_k`` of ``SPLIT_K``.

        A4: 0 = A operand is values [M, K]; 1 = packed NVFP4 (codes [M, K/2], scales [M, K/16],
        per-row global scale [M]). DT / DT2: operand type of the first / residual dots (0 float32, 1
        bf16, 2 fp16). SECOND: QUADS residual operand, 0 none, 1 gathered blocks (block table idx2
        [E, NSEL2], own K loop), 2 dense (NSEL2 = K/16, accumulated in the first loop from the same
        decoded weight tile). GROUPED: rows come from the tile table (expert, row range) and are
        gathered/scattered through arow/orow; else rows are pid_m * BM + i, expert 0. GK/G2: 16-blocks
        per K step of the first/second loop. SPLIT_K > 1: write float32 partials to
        out[pid_k, row, col] (no bias). SWAP: accumulate the transposed tile [BN, BM] (decode).
        EVEN_K: every K step of the first loop is full (K/16 and KB_PER_SPLIT multiples of GK).
        SC4: the first loop loads block scales as int32 words (EVEN_K, and GK, K/16 multiples of 4).
        NAT: w4a16 with SWAP takes the natural-K-order tiles of the plain path (GemmConfig.natural).

        K is walked in the order (even elements of the step, odd elements of the step) on both
        operands (the sum is the same; the packed byte's two nibbles need no interleave)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        if GROUPED:
            e = tl.load(tile_e_ptr + pid_m)
            r0 = tl.load(tile_r0_ptr + pid_m)
            r1 = tl.load(tile_r1_ptr + pid_m)
            rows = r0 + tl.arange(0, BM)
            rmask = rows < r1
            arow = tl.load(arow_ptr + rows, mask=rmask, other=0).to(tl.int64)
            orow = tl.load(orow_ptr + rows, mask=rmask, other=0).to(tl.int64)
            live = e >= 0
            ec = tl.maximum(e, 0).to(tl.int64)
        else:
            rows = pid_m * BM + tl.arange(0, BM)
            rmask = rows < M
            arow = rows.to(tl.int64)
            orow = arow
            live = pid_m >= 0
            ec = (pid_m * 0).to(tl.int64)
        cols = pid_n * BN + tl.arange(0, BN)
        nmask = cols < N
        wrow = ec * N + cols.to(tl.int64)
        wprow = wrow * KH
        wsrow = wrow * KB

        kb_lo = pid_k * KB_PER_SPLIT
        kb_hi = tl.minimum(kb_lo + KB_PER_SPLIT, KB)
        kb_hi = tl.where(live, kb_hi, kb_lo)  # a tile past the last expert's: no work
        if SWAP:
            acc = tl.zeros([BN, BM], dtype=tl.float32)
        else:
            acc = tl.zeros([BM, BN], dtype=tl.float32)
        acc2 = tl.zeros_like(acc)
        for kb0 in range(kb_lo, kb_hi, GK):
            if A4:
                we, wo = _fp4_pairs(w_ptr, ws_ptr, wprow, wsrow, nmask, kb0, kb_hi, BN, GK, DT, not EVEN_K, SC4)
                ae, ao = _fp4_pairs(a_ptr, as_ptr, arow * KH, arow * KB, rmask, kb0, kb_hi, BM, GK, DT,
                                    not EVEN_K, SC4)
                acc = _dot2(acc, ae, ao, we, wo, SWAP, DT)
            elif SWAP and not NAT:
                # w4a16 decode: the weight tile goes to the MMA from registers in (even, odd) order (its
                # shared-memory copy is read straight into the dot layout); the few activation rows are split
                we, wo = _fp4_pairs(w_ptr, ws_ptr, wprow, wsrow, nmask, kb0, kb_hi, BN, GK, DT, not EVEN_K, SC4)
                ae, ao = _a16_pairs(a_ptr, arow, rmask, kb0, kb_hi, K, GK, DT, not EVEN_K)
                acc = _dot2(acc, ae, ao, we, wo, SWAP, DT)
            else:
                # w4a16 prefill: the activation tile loaded as is (natural K order, 16-byte async copies,
                # read by the MMA from shared memory like a bf16 GEMM's), the decoded weight interleaved in
                # registers (sm_90 offline compile: no layout conversion for the join; the strided
                # [BM, BK/2, 2] activation load took 4-byte copies and 2-byte shared loads)
                w = _fp4_tile(w_ptr, ws_ptr, wprow, wsrow, nmask, kb0, kb_hi, BN, GK, DT, not EVEN_K, SC4)
                a = _a16_tile(a_ptr, arow, rmask, kb0, kb_hi, K, GK, DT, not EVEN_K)
                acc = _dot1(acc, a, w, SWAP, DT)
            if SECOND == 2:
                # per-token residual: dense operand in the same K order, the same decoded weight tile
                re, ro = _fp4_pairs(a2_ptr, a2s_ptr, arow * NSEL2 * 8, arow * NSEL2, rmask, kb0, kb_hi, BM, GK, DT,
                                    not EVEN_K, SC4)
                acc2 = _dot2(acc2, re, ro, we, wo, SWAP, DT)
        if SECOND == 1:
            jb_lo = pid_k * JB_PER_SPLIT
            jb_hi = tl.minimum(jb_lo + JB_PER_SPLIT, NSEL2)
            jb_hi = tl.where(live, jb_hi, jb_lo)
            jcol = tl.arange(0, G2 * 8)
            # not software-pipelined: the pipeliner turns the gathered 1-byte weight loads of _fp4_pairs_gathered into
            # cp.async, which needs >= 4-byte transfers (sm_90 compile error at BM 32 / BN 128 / SWAP / 3 stages, the
            # MID_TABLE MoE M=256 W4A4 entries; triton 3.6 and 3.9; found by scripts/triton36_check.sh, session 9)
            for j0 in tl.range(jb_lo, jb_hi, G2, num_stages=1):
                jb1 = j0 + jcol // 8
                jm1 = jb1 < jb_hi
                blk = tl.load(idx2_ptr + ec * NSEL2 + jb1, mask=jm1, other=0)
                we2, wo2 = _fp4_pairs_gathered(w_ptr, ws_ptr, wprow, wsrow, nmask, blk, jm1, G2, DT2)
                re, ro = _fp4_pairs(a2_ptr, a2s_ptr, arow * NSEL2 * 8, arow * NSEL2, rmask, j0, jb_hi, BM, G2, DT2,
                                    True, False)
                acc2 = _dot2(acc2, re, ro, we2, wo2, SWAP, DT2)
        if SWAP:
            acc = tl.trans(acc)
            acc2 = tl.trans(acc2)

        gw = tl.load(wgs_ptr + ec)
        inv_w = tl.math.div_rn(tl.full([BN], 1.0, tl.float32), gw + tl.zeros([BN], tl.float32))
        if A4:
            g1 = tl.load(ags_ptr + arow, mask=rmask, other=1.0)
            y = acc * tl.math.div_rn(tl.full([BM], 1.0, tl.float32), g1)[:, None]
        else:
            y = acc
        if SECOND != 0:
            g2 = tl.load(a2gs_ptr + arow, mask=rmask, other=1.0)
            y += acc2 * tl.math.div_rn(tl.full([BM], 1.0, tl.float32), g2)[:, None]
        y = y * inv_w[None, :]
        omask = rmask[:, None] & nmask[None, :]
        if SPLIT_K > 1:
            tl.store(out_ptr + (pid_k * OUT_ROWS + orow)[:, None] * N + cols[None, :], y, mask=omask)
        else:
            if HAS_BIAS:
                y += tl.load(bias_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
            _store_out(out_ptr + orow[:, None] * N + cols[None, :], y, omask, OUT)


    # ----------------------------------------------------------------------------------------------
    # MoE decode tails (issue #5): the gate and the router-weighted combine.
    try:  # triton 3.x: the CUDA libdevice wrappers (accurate expf; not callable under the interpreter)
        from triton.language.extra.cuda import libdevice as _cuda_libdevice
    except ImportError:  # pragma: no cover - depends on the triton version
        from triton.language.extra import libdevice as _cuda_libdevice

    @triton.jit
    def _moe_silu_mul_kernel(h_ptr, out_ptr, ids_ptr, I, H_STRIDE, BLOCK: tl.constexpr, OUT: tl.constexpr,
                             ACC_EXP: tl.constexpr, IDS: tl.constexpr):
        """Gate of the routed experts: row ``pid(0)``, columns ``pid(1)*BLOCK ..`` of
        ``out [S, I] = cast(silu(float32(h[:, :I])) * float32(h[:, I:]))``, silu(g) = ``div_rn(g, 1 + exp(-g))``
        in float32 (torch's CUDA silu: accurate expf, IEEE division). ACC_EXP: libdevice's expf (GPU);
        else ``tl.exp`` (the interpreter, which cannot call libdevice: numpy's float32 exp). IDS: a row whose
        expert id ``ids[row]`` is < 0 is not read: gate = up = 0, so it is written as +0."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if IDS:
            m = cols < tl.where(tl.load(ids_ptr + row) >= 0, I, 0)
        else:
            m = cols < I
        g = tl.load(h_ptr + row * H_STRIDE + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + row * H_STRIDE + I + cols, mask=m, other=0.0).to(tl.float32)
        if ACC_EXP:
            ex = _cuda_libdevice.exp(-g)
        else:
            ex = tl.exp(-g)
        s = tl.math.div_rn(g, ex + 1.0)
        _store_out(out_ptr + row * I + cols, s * u, cols < I, OUT)

    @triton.jit
    def _moe_combine_kernel(y_ptr, w_ptr, out_ptr, ids_ptr, H, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                            OUT: tl.constexpr, IDS: tl.constexpr):
        """Router-weighted sum of a token's slots: ``out[t, cols] = cast(sum_j float32(y[t*TOPK + j, cols]) *
        w[t, j])`` for token ``pid(0)``, columns ``pid(1)*BLOCK ..``; float32 accumulation in the fixed
        order j = 0 .. TOPK-1 (deterministic; the multiply-add may be one FMA). IDS: a slot whose expert id is
        < 0 is not read (its y row counts as 0: adds 0 * w)."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < H
        acc = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(TOPK):
            w = tl.load(w_ptr + t * TOPK + j)
            if IDS:
                mj = cols < tl.where(tl.load(ids_ptr + t * TOPK + j) >= 0, H, 0)
            else:
                mj = m
            acc += tl.load(y_ptr + (t * TOPK + j) * H + cols, mask=mj, other=0.0).to(tl.float32) * w
        _store_out(out_ptr + t * H + cols, acc, m, OUT)

# --------------------------------------------------------------------------------------------------
# host side


@dataclass(frozen=True)
class GemmConfig:
    """Launch configuration of :func:`nvfp4_gemm`.

    Attributes:
        block_m / block_n: output tile (rows x cols); block_m >= 16 (tl.dot minimum).
        block_k: K elements per step of the first loop (a multiple of 16, power of 2).
        block_k2: K elements per step of the QUADS residual loop (gathered 16-blocks).
        split_k: K-ranges computed by separate programs (decode); 1 = no workspace.
        num_warps / num_stages: Triton launch options.
        swap: accumulate the transposed tile (weight rows on the MMA's M side; for decode tiles of
            few activation rows).
        natural: (w4a16 with ``swap``) load the activation tile in natural K order (one 2-D load, as the
            plain tile does) and interleave the decoded weight halves in registers, instead of splitting
            the activation into (even, odd) halves with a strided ``[BM, BK/2, 2]`` load (issue #5: the
            H200 sweep measured that swapped w4a16 tile 1.2-2x slower than the plain one; the natural one was
            1.1-1.6x faster than the plain one at 6 MID_TABLE points, which use it). No effect otherwise.
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    block_k2: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False
    natural: bool = False


def pick_block_m(rows_per_group: int) -> int:
    """BLOCK_M for a GEMM whose row groups (one per expert, or the whole M) hold ~``rows_per_group`` rows."""
    for bm in (16, 32, 64):
        if rows_per_group <= bm:
            return bm
    return 128


def pick_config(rows_per_group: int, m_tiles: int, n: int, k: int, device: torch.device,
                block_m: int | None = None, *, grouped: bool = False, a4: bool = False) -> GemmConfig:
    """Launch configuration of the tensor-core kernel: the :data:`MID_TABLE` entry of the shape if it has
    one (measured, ``verl-quads bench rollout --sweep-mid``) and ``block_m`` is None or its block_m (a grouped
    GEMM's routing fixes it), else a heuristic. ``grouped``: an expert GEMM (``rows_per_group`` = token-slots
    per expert); ``a4``: a W4A4 operand (naive / quads / trace; else w4a16).

    Heuristic, decode-sized tiles (<= 32 rows per group): W4A4 swaps the tile (weight rows on the MMA's M
    side, BLOCK_N 64, K steps of 128 = 64 bytes per weight row); w4a16 does not (H200 sweep: its swapped
    tile, which splits the bf16 activation into (even, odd) halves with a strided load, was 1.1-2x slower
    than the plain BLOCK_N 128 / BLOCK_K 64 tile at every measured point). K is split across programs
    until ~4 programs per SM (2 for BLOCK_M >= 64) are resident."""
    bm = block_m or pick_block_m(rows_per_group)
    entry = mid_config(rows_per_group, n, k, grouped, a4)
    if entry is not None and (block_m is None or entry.block_m == block_m):
        return entry
    return _heuristic_config(bm, a4, m_tiles, n, k, num_sms(device))


@functools.lru_cache(maxsize=4096)
def _heuristic_config(bm: int, a4: bool, m_tiles: int, n: int, k: int, sms: int) -> GemmConfig:
    """:func:`pick_config`'s heuristic (a pure function of its integers: cached, as an eager decode step asks it
    for every GEMM and building the config costs host time)."""
    if bm <= 32 and a4:
        cfg = GemmConfig(block_m=bm, block_n=64, block_k=128, block_k2=64, num_warps=4, num_stages=3, swap=True)
    elif bm <= 32:
        cfg = GemmConfig(block_m=bm, block_n=128, block_k=64, block_k2=64, num_warps=4, num_stages=3)
    elif bm == 64:
        cfg = GemmConfig(block_m=64, block_n=128, block_k=64, block_k2=64, num_warps=4, num_stages=3)
    else:
        cfg = GemmConfig(block_m=128, block_n=128, block_k=64, block_k2=64, num_warps=8, num_stages=3)
    tiles = m_tiles * -(-n // cfg.block_n)
    target = (4 if bm <= 32 else 2) * sms
    split = 1
    while tiles * split * 2 <= target and k // (cfg.block_k * split * 2) >= 2:
        split *= 2
    return replace(cfg, split_k=split)


# Mid-M dispatch of the tensor-core kernel (issue #5): (grouped, rows bucket, N, K, a4) -> GemmConfig. Rows = rows
# per group: M for a dense GEMM, token-slots per expert (S / min(E, S)) for a grouped one; a GEMM takes the entry of
# the smallest of MID_BUCKETS[grouped] >= its rows that has one (the bucket's block_m must be its routing's:
# grouped_block_m), past the last bucket pick_config's heuristic. From `verl-quads bench rollout --sweep-mid`,
# NVIDIA H200 (sm_90), torch 2.11.0+cu130, triton 3.6.0, 2026-11-30 session 5, cold L2
# (docs/bench_rollout_h200_mid_sweep_s5.txt; us: fastest correct config vs the old default). Only entries that beat
# the old default by > 3% (ties and naive dense stay on the heuristic); MoE: Qwen3-30B-A3B experts, 128 x top-8.
# Session 6: the w4a16 entries marked "sweep2" take the natural-K swapped tile (GemmConfig(swap=True, natural=True)),
# measured faster by the second --sweep-mid of session 5 (docs/bench_rollout_h200_mid_sweep2_s5.txt, commit dc28eea,
# same command; us: natural tile vs the entry it replaces). Not taken from sweep2: d8192 M=64 w4a16 (54.0 vs 54.7, a
# tie), MoE w2 M=16/64 w4a16 (the DECODE_TABLE stream entries: 66.2 = best, 97.8 vs 97.6 a tie) and the naive
# entries (within 3.4% of the current dispatch).
# Session 9 (docs/bench_rollout_h200_session9.txt, call 1 at 3769736, `--sweep-mid --shapes d8192,d4096 --m 4`, cold
# L2): dense bucket 4 added; d4096 M=4 w4a16 natural swapped tile k256 s4 13.2 us vs 21.4 for the DECODE_TABLE
# stream entry it replaces (removed) and 13.2 for cuBLAS BF16; d8192 M=4 keeps the bucket-16 entry (the sweep's best,
# 38.2 us), naive at M=4 keeps the heuristic (best at both shapes).
MID_BUCKETS = {True: (1, 4, 16), False: (4, 16, 64, 256)}
MID_GROUPED_BLOCK_M = {1: 16, 4: 16, 16: 32}  # grouped bucket -> the routing's block_m (moe_forward)
MID_TABLE: dict[tuple[bool, int, int, int, bool], GemmConfig] = {
    # MoE M=256 (16 slots per expert): block_m 32 (one tile for most experts) for both GEMMs and both modes
    (True, 16, 1536, 2048, False): GemmConfig(block_m=32, block_n=64, block_k=128, block_k2=64, split_k=1, num_warps=4, num_stages=4, swap=True, natural=True),  # sweep2: 216 vs 338 us (604 before session 5)
    (True, 16, 2048, 768, False): GemmConfig(block_m=32, block_n=128, block_k=64, block_k2=64, split_k=1, num_warps=4, num_stages=3, swap=True, natural=True),  # sweep2: 110 vs 175 (325)
    (True, 16, 1536, 2048, True): GemmConfig(block_m=32, block_n=128, block_k=64, block_k2=64, split_k=1, num_warps=4, num_stages=3, swap=True),  # 253 vs 308
    (True, 16, 2048, 768, True): GemmConfig(block_m=32, block_n=128, block_k=64, block_k2=64, split_k=1, num_warps=4, num_stages=3, swap=True),  # 131 vs 162
    # MoE M=64 (4 per expert); w2 w4a16 takes the stream kernel (DECODE_TABLE (True, 512, 2048, 768): 100 vs 227)
    (True, 4, 1536, 2048, False): GemmConfig(block_m=16, block_n=64, block_k=128, block_k2=64, split_k=1, num_warps=4, num_stages=3, swap=True, natural=True),  # sweep2: 189 vs 257 (411)
    (True, 4, 2048, 768, True): GemmConfig(block_m=16, block_n=128, block_k=64, block_k2=64, split_k=1, num_warps=4, num_stages=3, swap=True),  # 105 vs 111
    # MoE M=16 (1 per expert); w13 w4a16: tensor-core tile 175 vs the stream entry 219 (removed); w2 w4a16: stream
    (True, 1, 1536, 2048, False): GemmConfig(block_m=16, block_n=64, block_k=128, block_k2=64, split_k=1, num_warps=4, num_stages=3, swap=True, natural=True),  # sweep2: 127 vs 178 (stream 219)
    (True, 1, 2048, 768, True): GemmConfig(block_m=16, block_n=128, block_k=64, block_k2=64, split_k=1, num_warps=4, num_stages=3, swap=False),  # 73.7 vs 78.4
    # dense w4a16 (W4A4 dense: the heuristic was fastest or within 3%)
    (False, 4, 4096, 4096, False): GemmConfig(block_m=16, block_n=64, block_k=256, block_k2=64, split_k=4, num_warps=4, num_stages=3, swap=True, natural=True),  # session 9: 13.2 vs 21.4 (stream entry)
    (False, 16, 8192, 8192, False): GemmConfig(block_m=16, block_n=64, block_k=128, block_k2=64, split_k=8, num_warps=4, num_stages=3, swap=True, natural=True),  # sweep2: 43.3 vs 54.2 (stream 76.5)
    (False, 16, 4096, 4096, False): GemmConfig(block_m=16, block_n=64, block_k=64, block_k2=64, split_k=8, num_warps=8, num_stages=3, swap=False),  # 21.7 vs stream 24.0
    (False, 64, 8192, 8192, False): GemmConfig(block_m=64, block_n=128, block_k=128, block_k2=64, split_k=4, num_warps=4, num_stages=3, swap=False),  # 55.1 vs 60.6
    (False, 64, 4096, 4096, False): GemmConfig(block_m=64, block_n=64, block_k=64, block_k2=64, split_k=4, num_warps=4, num_stages=4, swap=False),  # 23.7 vs 26.0
    (False, 256, 8192, 8192, False): GemmConfig(block_m=128, block_n=64, block_k=128, block_k2=64, split_k=1, num_warps=4, num_stages=3, swap=True, natural=True),  # sweep2: 105 vs 118 (124)
    (False, 256, 4096, 4096, False): GemmConfig(block_m=128, block_n=64, block_k=64, block_k2=64, split_k=1, num_warps=4, num_stages=3, swap=False),  # 42.3 vs 46.5
}


def _mid_bucket(rows_per_group: int, grouped: bool) -> int | None:
    return next((b for b in MID_BUCKETS[grouped] if rows_per_group <= b), None)


def mid_config(rows_per_group: int, n: int, k: int, grouped: bool, a4: bool) -> GemmConfig | None:
    """The :data:`MID_TABLE` entry of the smallest bucket >= ``rows_per_group`` that has one, or None."""
    for b in MID_BUCKETS[grouped]:
        if rows_per_group <= b and (grouped, b, n, k, a4) in MID_TABLE:
            return MID_TABLE[(grouped, b, n, k, a4)]
    return None


def grouped_block_m(rows_per_group: int) -> int:
    """BLOCK_M (the routing's M-tile height, :func:`moe_align`) of a grouped GEMM with ~``rows_per_group``
    token-slots per expert: :data:`MID_GROUPED_BLOCK_M` of its bucket (the block_m of the measured
    :data:`MID_TABLE` entries: 32 at 5..16 slots per expert, so that most experts are one tile), else
    :func:`pick_block_m`."""
    b = _mid_bucket(rows_per_group, True)
    return MID_GROUPED_BLOCK_M.get(b, pick_block_m(rows_per_group)) if b is not None else pick_block_m(rows_per_group)



def moe_block_m(slots: int, n_exp: int, x: torch.Tensor | None = None, w13_packed: torch.Tensor | None = None,
                w2_packed: torch.Tensor | None = None) -> int:
    """The routing block_m (:func:`moe_align`'s M-tile height) :func:`moe_forward` builds for ``slots`` >= 1 token-slots
    over ``n_exp`` experts: :func:`grouped_block_m` of the slots per expert, except where GEMM1's activation ``x``
    (bf16 ``w4a16`` values; None: GEMM1 is no w4a16 operand) and both expert GEMMs (``w13_packed`` [E, 2I, H/2],
    ``w2_packed`` [E, H, I/2]) run on the grouped Gluon kernel with the :data:`GLUON_MOE_ROUTING_BLOCK_M` of the
    slots' bucket: then that one (ONE routing for both GEMMs; GEMM2's activation has x's device and dtype).
    The tile height changes which program computes a row, not its bytes (split 1, the same K loop per element).

    Session 13 (H200, Qwen3-30B-A3B MoE layer at M=1024: 8192 slots, 128 experts top-8; bench.rollout's layer rows,
    CUDA graph, us, two runs alternated in one process): block_m 32 with the T=256 entries vs block_m 64 with the
    session-12 64-row entries: w4a16 420 / 427 vs 464 / 464, quads-bf16 k=0.5 (channel) 512 / 510 vs 554 / 556 (naive:
    the same path, 695 / 693 vs 688 / 688); output torch.equal for all three modes. ``bench.rollout --shapes moe`` after:
    w4a16 413 us = 1.86x BF16 (session 12: 453, 1.68x), quads-bf16 505 (1.52x; was 546, 1.40x)."""
    bm = grouped_block_m(-(-slots // min(n_exp, slots)))
    gbm = GLUON_MOE_ROUTING_BLOCK_M.get(gluon_moe_bucket(slots))
    if x is None or gbm is None or gbm == bm or w13_packed is None or w2_packed is None:
        return bm
    inter = w2_packed.shape[-1] * 2
    if all(gluon_grouped_entry(x, w, k, slots, gbm) is not None
           for w, k in ((w13_packed, x.shape[1]), (w2_packed, inter))):
        return gbm
    return bm



@dataclass(frozen=True)
class ActOperand:
    """Activation operand of :func:`nvfp4_gemm`, rows ``[M, K]``.

    Attributes:
        mode: one of :data:`ACT_MODES` (``w4a16``: ``values`` is used; the others: ``first``). A QUADS
            operand with ``residual_combine="bf16"`` is a ``w4a16`` operand (its ``values`` are the
            compensated activation ``Q(x) + Q(R_sel)`` in x's dtype).
        dtype: the output dtype (the activation's original dtype).
        values: w4a16: the activation itself (or its QUADS QDQ form), bf16/fp16/fp32 ``[M, K]`` (contiguous).
        first: W4A4: ``Q(x)``, NVFP4 ``[M, K]`` with one float32 global scale per row.
        second_packed / second_scale / second_gs: QUADS residual ``Q(R_sel)``: uint8
            ``[M, NSEL2 * 8]``, e4m3 ``[M, NSEL2]``, float32 ``[M]`` (per row).
        block_idx: int32 ``[G, NSEL2]``: the K 16-block that residual block j multiplies, per row
            group (one group for a dense GEMM, one per expert for a grouped one); None with a
            residual operand means dense (NSEL2 = K/16, block j is block j; per-token selection).
    """

    mode: str
    dtype: torch.dtype
    values: torch.Tensor | None = None
    first: NVFP4Tensor | None = None
    second_packed: torch.Tensor | None = None
    second_scale: torch.Tensor | None = None
    second_gs: torch.Tensor | None = None
    block_idx: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape) if self.values is not None else tuple(self.first.shape)


def _row_gs(gs: torch.Tensor, m: int) -> torch.Tensor:
    """A global scale (0-d, [1, 1] or [M, 1]) as a contiguous float32 vector [M]."""
    return gs.reshape(-1).to(torch.float32).expand(m).contiguous() if gs.numel() == 1 else gs.reshape(m).contiguous()


def _residual_operand(r, mode: str, dtype: torch.dtype) -> ActOperand:
    """ActOperand of a :class:`~verl_quads.nvfp4.ResidualNVFP4` or :class:`~verl_quads.nvfp4.ChannelResidualNVFP4`
    of ``[M, K]`` (one row group)."""
    m, k = r.first.shape
    nb = k // BLOCK_SIZE
    gs1 = _row_gs(r.first.global_scale, m)
    first = NVFP4Tensor(r.first.packed, r.first.block_scale, gs1.unsqueeze(-1), r.first.shape, r.first.dtype)
    gs2 = _row_gs(r.second.global_scale, m)
    if r.granularity in CHANNEL_GRANULARITIES:  # the second pass is already dense [M, K] (+0 codes outside)
        if num_selected_channels(k, r.ratio) == 0:
            return ActOperand(mode, dtype, first=first)
        return ActOperand(mode, dtype, first=first, second_packed=r.second.packed.contiguous(),
                          second_scale=r.second.block_scale.contiguous(), second_gs=gs2)
    n_sel = r.block_idx.shape[-1]
    if n_sel == 0:
        return ActOperand(mode, dtype, first=first)
    if r.block_idx.dim() == 1:  # per call: one block table, the second pass reads only the selected blocks
        return ActOperand(mode, dtype, first=first, second_packed=r.second.packed.contiguous(),
                          second_scale=r.second.block_scale.contiguous(), second_gs=gs2,
                          block_idx=r.block_idx.to(torch.int32).reshape(1, n_sel).contiguous())
    # per token: scatter the selected blocks into a dense [M, K] operand (zero codes/scales elsewhere)
    idx = r.block_idx.to(torch.int64)
    packed = torch.zeros(m, nb, 8, dtype=torch.uint8, device=idx.device)
    packed.scatter_(1, idx.unsqueeze(-1).expand(-1, -1, 8), r.second.packed.reshape(m, n_sel, 8))
    scale = torch.zeros(m, nb, dtype=torch.uint8, device=idx.device)
    scale.scatter_(1, idx, r.second.block_scale.view(torch.uint8))
    return ActOperand(mode, dtype, first=first, second_packed=packed.reshape(m, nb * 8),
                      second_scale=scale.view(torch.float8_e4m3fn), second_gs=gs2)


def quantize_activation(
    x: torch.Tensor,
    mode: str,
    *,
    residual_ratio: float = 0.5,
    residual_per_token: bool = False,
    capture: bool = False,
    residual_combine: str = "fp4x2",
    residual_granularity: str = "block",
    record_out: GuidanceRecord | None = None,
) -> tuple[ActOperand, GuidanceRecord | None]:
    """Activation operand of one GEMM (``x`` ``[M, K]``), quantized by the NVFP4 core (backend
    ``"triton"``) with one global scale per token, and the guidance record (``trace`` with
    ``capture``, else None). Same codes as :func:`verl_quads.rollout.emulation.quantize_activation`.

    ``residual_combine`` (``quads`` only, :data:`RESIDUAL_COMBINES`): ``fp4x2`` -> ``Q(x)`` and
    ``Q(R_sel)`` as two FP4 operands; ``bf16`` -> a ``w4a16`` operand holding
    ``nvfp4.residual_fake_quantize(x, residual_ratio, per-token global scale)`` in x's dtype (the same
    bytes as the core's torch reference).

    ``residual_granularity`` (``quads``): ``block`` (default), ``channel`` or ``channel_sampled`` (per token only;
    the core's channel rules, :mod:`verl_quads.nvfp4.triton_channel`): ``bf16`` as above; ``fp4x2`` -> ``Q(x)`` and the rule's dense
    ``Q(R_sel)`` ``[M, K]`` as the second FP4 operand (the dense form the per-token block rule is scattered into;
    same GEMM cost).

    ``record_out`` (``trace`` with ``capture``): the record to fill (returned), e.g. rows of the rollout's TRACE
    buffer, which the quantize kernel then writes itself (:func:`verl_quads.nvfp4.quantize_with_guidance`'s
    ``out``)."""
    from verl_quads import nvfp4 as nv

    if mode not in ACT_MODES:
        raise ValueError(f"nvfp4 GEMM: act_mode must be one of {ACT_MODES}, got {mode!r}")
    if record_out is not None and not (mode == "trace" and capture):
        raise ValueError(f"nvfp4 GEMM: record_out needs act_mode 'trace' with capture=True (got {mode!r}, "
                         f"capture={capture})")
    if residual_combine not in RESIDUAL_COMBINES:
        raise ValueError(f"nvfp4 GEMM: residual_combine must be one of {RESIDUAL_COMBINES}, got {residual_combine!r}")
    if x.dim() != 2:
        raise ValueError(f"nvfp4 GEMM: activation must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _OUT_DTYPES:
        raise ValueError(f"nvfp4 GEMM: activation dtype {x.dtype}; allowed: float32, bfloat16, float16")
    if mode == "w4a16":
        return ActOperand(mode, x.dtype, values=x.contiguous()), None
    # amax="row": the per-token scale is derived inside the quantization kernel (the channel rule and the plain
    # quantize; the block rule computes it by torch first), not by ~6 separate torch launches (decode latency)
    if mode == "quads" and residual_combine == "bf16":
        xq = nv.residual_fake_quantize(x, residual_ratio, amax="row", per_token=residual_per_token,
                                       granularity=residual_granularity, backend="triton", check_finite=False)
        return ActOperand("w4a16", x.dtype, values=xq), None
    if mode == "quads":
        r = nv.residual_quantize(x, residual_ratio, amax="row", per_token=residual_per_token,
                                 granularity=residual_granularity, backend="triton", check_finite=False)
        return _residual_operand(r, mode, x.dtype), None
    if mode == "trace" and capture:  # the record's bits come out of the quantize kernel (no launch of their own)
        q, record = nv.quantize_with_guidance(x, amax="row", backend="triton", check_finite=False, out=record_out)
    else:
        q, record = nv.quantize(x, amax="row", backend="triton", check_finite=False), None
    first = NVFP4Tensor(q.packed, q.block_scale, _row_gs(q.global_scale, x.shape[0]).unsqueeze(-1), q.shape, q.dtype)
    return ActOperand(mode, x.dtype, first=first), record


def quads_grouped_operand(x_sorted: torch.Tensor, group_sizes: list[int], group_ids: list[int], num_groups: int,
                          ratio: float) -> ActOperand:
    """QUADS operand of rows sorted by group (expert) with residual block selection PER GROUP (the
    reference's per-expert-call selection): one :func:`verl_quads.nvfp4.residual_quantize` call per
    non-empty group (a Python loop over active experts; the core has no segmented selection yet).

    ``x_sorted`` ``[S, K]``: rows of group ``group_ids[i]`` are the ``group_sizes[i]`` consecutive
    rows after the previous groups'. Returns the operand in that row order with a block table
    ``[num_groups, NSEL]`` (rows of absent groups are 0)."""
    from verl_quads import nvfp4 as nv

    s, k = x_sorted.shape
    dev = x_sorted.device
    n_sel = nv.num_selected_blocks(k, ratio)
    packed1 = torch.empty(s, k // 2, dtype=torch.uint8, device=dev)
    scale1 = torch.empty(s, k // BLOCK_SIZE, dtype=torch.uint8, device=dev)
    gs1 = torch.ones(s, dtype=torch.float32, device=dev)
    packed2 = torch.zeros(s, n_sel * 8, dtype=torch.uint8, device=dev)
    scale2 = torch.zeros(s, n_sel, dtype=torch.uint8, device=dev)
    gs2 = torch.ones(s, dtype=torch.float32, device=dev)
    table = torch.zeros(num_groups, n_sel, dtype=torch.int32, device=dev)
    start = 0
    for g, n in zip(group_ids, group_sizes):
        if n == 0:
            continue
        xs = x_sorted[start:start + n]
        r = nv.residual_quantize(xs, ratio, nv.per_row_global_scale(xs), per_token=False, backend="triton",
                                 check_finite=False)
        packed1[start:start + n] = r.first.packed
        scale1[start:start + n] = r.first.block_scale.view(torch.uint8)
        gs1[start:start + n] = _row_gs(r.first.global_scale, n)
        if n_sel:
            packed2[start:start + n] = r.second.packed
            scale2[start:start + n] = r.second.block_scale.view(torch.uint8)
            gs2[start:start + n] = _row_gs(r.second.global_scale, n)
            table[g] = r.block_idx.to(torch.int32)
        start += n
    first = NVFP4Tensor(packed1, scale1.view(torch.float8_e4m3fn), gs1.unsqueeze(-1), torch.Size((s, k)),
                        x_sorted.dtype)
    if n_sel == 0:
        return ActOperand("quads", x_sorted.dtype, first=first)
    return ActOperand("quads", x_sorted.dtype, first=first, second_packed=packed2,
                      second_scale=scale2.view(torch.float8_e4m3fn), second_gs=gs2, block_idx=table)


def quads_grouped_values(x_sorted: torch.Tensor, group_sizes: list[int], ratio: float) -> ActOperand:
    """``residual_combine="bf16"`` form of :func:`quads_grouped_operand`: a ``w4a16`` operand ``[S, K]``
    (x's dtype, rows in ``x_sorted``'s order) holding, for each non-empty group's consecutive rows,
    :func:`verl_quads.nvfp4.residual_fake_quantize` with residual block selection over that group's rows
    (per-call selection per expert, as the reference). One core call per non-empty group (host loop)."""
    from verl_quads import nvfp4 as nv

    out = torch.empty_like(x_sorted)
    start = 0
    for n in group_sizes:
        if n == 0:
            continue
        xs = x_sorted[start:start + n]
        out[start:start + n] = nv.residual_fake_quantize(xs, ratio, nv.per_row_global_scale(xs), per_token=False,
                                                         backend="triton", check_finite=False)
        start += n
    return ActOperand("w4a16", x_sorted.dtype, values=out)


def _check_weight(w_packed: torch.Tensor, w_scale: torch.Tensor, w_gs: torch.Tensor, k: int, grouped: bool):
    want = 3 if grouped else 2
    if w_packed.dtype != torch.uint8 or w_packed.dim() != want or w_packed.shape[-1] * 2 != k:
        raise ValueError(
            f"nvfp4 GEMM: w_packed must be uint8 {'[E, N, K/2]' if grouped else '[N, K/2]'} with K = {k} "
            f"(the activation's), got {w_packed.dtype} {tuple(w_packed.shape)}"
        )
    if w_scale.dtype != torch.float8_e4m3fn or tuple(w_scale.shape) != (*w_packed.shape[:-1], k // BLOCK_SIZE):
        raise ValueError(
            f"nvfp4 GEMM: w_scale must be float8_e4m3fn {(*w_packed.shape[:-1], k // BLOCK_SIZE)}, got "
            f"{w_scale.dtype} {tuple(w_scale.shape)}"
        )
    n_gs = w_packed.shape[0] if grouped else 1
    if w_gs.dtype != torch.float32 or w_gs.numel() != n_gs:
        raise ValueError(
            f"nvfp4 GEMM: w_gs must be float32 with {n_gs} element(s) ({'one per expert' if grouped else 'per tensor'}), "
            f"got {w_gs.dtype} {tuple(w_gs.shape)}"
        )


def nvfp4_gemm(
    act: ActOperand,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    w_gs: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    routing: GroupedRouting | None = None,
    a_rows: torch.Tensor | None = None,
    out_rows: int | None = None,
    config: GemmConfig | None = None,
    zero_unrouted: bool = True,
) -> torch.Tensor:
    """``act @ dequant(W).T (+ bias)``: float32 accumulation, one cast to ``act.dtype``.

    Dense (``routing`` None): ``w_packed`` ``[N, K/2]``, ``w_gs`` 0-d; returns ``[M, N]``.
    Grouped (``routing`` from :func:`moe_align`): ``w_packed`` ``[E, N, K/2]``, ``w_gs`` ``[E]``; sorted
    row i (expert from the tile table) reads activation row ``a_rows[i]`` (int32 ``[S]``; default
    the sorted row itself) and is written to output row ``routing.sorted_slots[i]`` of a
    ``[out_rows, N]`` result (default S rows); rows of slots with no local expert are 0
    (``zero_unrouted=False``: left unset, no zero-fill launch, for callers that never read them).
    ``config``: launch configuration: a :class:`GemmConfig` (default :func:`pick_config`; its block_m
    must equal the routing's) or, for ``w4a16`` operands, a :class:`StreamConfig` (the weight-streaming
    decode kernel) or, bf16 only, a :class:`~verl_quads.nvfp4.gluon_gemm.GluonConfig` (the Gluon mma.sync
    kernels: dense ``gluon_w4a16_std``; grouped ``gluon_moe.gluon_w4a16_grouped``, e.g. a ``GroupedConfig``) or,
    dense only, a :class:`~verl_quads.nvfp4.gluon_tma.TmaConfig` (``gluon_tma.gluon_w4a16_tma``, sm_90+) or a
    :class:`~verl_quads.nvfp4.dequant_gemm.DequantConfig` (block values decoded once, then cuBLAS; bf16 / fp16,
    ``w4a16`` or W4A4 without a residual operand).
    Default on CUDA, dense: :func:`~verl_quads.nvfp4.dequant_gemm.dequant_dense_config` (from
    :data:`~verl_quads.nvfp4.dequant_gemm.DEQUANT_MIN_ROWS` rows on); then for ``w4a16`` the
    :data:`~.gluon_dispatch.GLUON_TABLE` (dense) / :data:`~.gluon_dispatch.GLUON_MOE_TABLE` (grouped) entry (sm_90,
    where Gluon runs), else the :data:`~.triton_stream.DECODE_TABLE` entry of the shape if any.
    """
    m, k = act.shape
    grouped = routing is not None
    _check_weight(w_packed, w_scale, w_gs, k, grouped)
    dev = w_packed.device
    check_available(w_packed)
    n = w_packed.shape[-2]
    if bias is not None and (grouped or bias.shape != (n,)):
        raise ValueError(f"nvfp4 GEMM: bias must be [{n}] (dense GEMMs only), got {tuple(bias.shape)}")
    if grouped:
        s = routing.sorted_slots.numel()
        rows_out = s if out_rows is None else out_rows
    else:
        rows_out = m
    if config is None and not grouped and dev.type == "cuda" and rows_out and n:
        from verl_quads.nvfp4.dequant_gemm import dequant_dense_config

        config = dequant_dense_config(act, w_packed)
    if config is None and act.mode == "w4a16" and dev.type == "cuda" and rows_out and n:
        if grouped:
            config = gluon_grouped_config(act.values, w_packed, routing)
        else:
            config = gluon_dense_config(act.values, w_packed)
        if config is None:
            config = decode_config(s if grouped else m, n, k, grouped, act.values.dtype)
    if not isinstance(config, (GemmConfig, StreamConfig, GluonConfig, TmaConfig, type(None))):
        from verl_quads.nvfp4.dequant_gemm import DequantConfig, dequant_gemm

        if not isinstance(config, DequantConfig):
            raise TypeError(f"nvfp4 GEMM: config must be a GemmConfig, StreamConfig, GluonConfig, TmaConfig or "
                            f"DequantConfig, got {type(config).__name__}")
        if grouped:
            raise ValueError("nvfp4 GEMM: a DequantConfig runs dense GEMMs only")
        return dequant_gemm(act, w_packed, w_scale, w_gs, bias, config)
    if isinstance(config, TmaConfig):  # raises where the TMA kernel cannot run this GEMM (no fallback)
        if act.mode != "w4a16" or grouped:
            raise ValueError("nvfp4 GEMM: a TmaConfig runs dense w4a16 GEMMs only")
        return gluon_w4a16_tma(act.values, w_packed, w_scale, w_gs, bias, config)
    if isinstance(config, GluonConfig):  # raises where the Gluon kernel cannot run this GEMM (no fallback)
        if act.mode != "w4a16":
            raise ValueError("nvfp4 GEMM: a GluonConfig runs w4a16 GEMMs only")
        if grouped:
            from verl_quads.nvfp4.gluon_moe import gluon_w4a16_grouped

            return gluon_w4a16_grouped(act.values, w_packed, w_scale, w_gs, routing, a_rows, rows_out, config,
                                       zero_unrouted)
        from verl_quads.nvfp4.gluon_gemm import gluon_w4a16_std

        return gluon_w4a16_std(act.values, w_packed, w_scale, w_gs, bias, config)
    if isinstance(config, StreamConfig):
        if rows_out == 0 or n == 0:
            return torch.zeros(rows_out, n, dtype=act.dtype, device=dev)
        return stream_gemm(act, w_packed, w_scale, w_gs, bias, routing, a_rows, rows_out, config, zero_unrouted)
    if grouped:
        t_max = routing.tile_expert.numel()
        if config is None:
            per = -(-s // max(1, min(routing.num_experts, s)))
            config = pick_config(per, t_max, n, k, dev, block_m=routing.block_m, grouped=True, a4=act.mode != "w4a16")
        elif config.block_m != routing.block_m:
            raise ValueError(f"nvfp4 GEMM: config.block_m {config.block_m} != routing.block_m {routing.block_m}")
        m_tiles = t_max
        arow_t = routing.sorted_slots if a_rows is None else a_rows.to(torch.int32).contiguous()
        orow_t = routing.sorted_slots
    else:
        config = config or pick_config(m, -(-m // pick_block_m(m)), n, k, dev, a4=act.mode != "w4a16")
        m_tiles = -(-m // config.block_m)
        arow_t = orow_t = None
    bm, bn, bk, bk2 = config.block_m, config.block_n, config.block_k, config.block_k2
    if bm < 16 or bn < 16 or bk % 16 or bk2 % 16:
        raise ValueError(f"nvfp4 GEMM: bad config {config} (block_m/block_n >= 16, block_k multiple of 16)")
    zero_rows = grouped and zero_unrouted  # rows of slots routed to no local expert stay 0
    split = config.split_k
    if rows_out == 0 or n == 0:
        return torch.zeros(rows_out, n, dtype=act.dtype, device=dev)
    if split > 1:  # float32 partials; grouped: rows of slots routed to no local expert must read as 0
        out = (torch.zeros if zero_rows else torch.empty)(split, rows_out, n, dtype=torch.float32, device=dev)
        out_arg = out
    else:
        alloc = torch.zeros if zero_rows else torch.empty
        out = alloc(rows_out, n, dtype=act.dtype, device=dev)
        out_arg = out.view(torch.int16) if act.dtype == torch.bfloat16 else out
    kb = k // BLOCK_SIZE
    gk, g2 = bk // BLOCK_SIZE, bk2 // BLOCK_SIZE
    kb_per = -(-kb // split)
    kb_per = -(-kb_per // gk) * gk
    a4 = act.mode != "w4a16"
    if a4:
        a, a_s, a_gs = act.first.packed, act.first.block_scale.view(torch.uint8), act.first.global_scale.reshape(-1)
        dt = 1
    else:
        a, a_s, a_gs = act.values, act.values, act.values
        dt = _OUT_DTYPES[act.values.dtype]
    if interpreting():
        dt = 0  # the interpreter's bf16/fp16 tl.dot is wrong (triton 3.9); float32 gives the same exact products
    dt2 = 0 if interpreting() else 1  # the residual operand and its weights are NVFP4: exact in bf16
    second = 0
    nsel2 = 0
    a2 = a2s = a2gs = idx2 = a
    jb_per = 0
    if act.second_packed is not None:
        second = 2 if act.block_idx is None else 1
        a2, a2s, a2gs = act.second_packed, act.second_scale.view(torch.uint8), act.second_gs
        nsel2 = act.second_scale.shape[-1]
        if second == 1:
            idx2 = act.block_idx
            if grouped and idx2.shape[0] == 1:  # one selection for all rows (e.g. the experts' shared input)
                idx2 = idx2.expand(routing.num_experts, -1).contiguous()
            if idx2.shape[0] != (routing.num_experts if grouped else 1) or idx2.shape[1] != nsel2:
                raise ValueError(f"nvfp4 GEMM: residual block table {tuple(idx2.shape)} does not fit "
                                 f"{routing.num_experts if grouped else 1} group(s) x {nsel2} blocks")
        jb_per = -(-nsel2 // split)
        jb_per = -(-jb_per // g2) * g2
    w_s = w_scale.view(torch.uint8)
    bias_t = bias if bias is not None else w_gs
    dummy = w_gs
    grid = (m_tiles, -(-n // bn), split)
    even_k = kb % gk == 0 and kb_per % gk == 0 and kb_per * split == kb
    _nvfp4_gemm_kernel[grid](
        a, a_s, a_gs, a2, a2s, a2gs, idx2,
        w_packed, w_s, w_gs.reshape(-1), bias_t, out_arg,
        arow_t if grouped else dummy, orow_t if grouped else dummy,
        routing.tile_expert if grouped else dummy, routing.tile_row0 if grouped else dummy,
        routing.tile_row1 if grouped else dummy,
        m, n, k, k // 2, kb, nsel2, rows_out, kb_per, jb_per,
        A4=a4, DT=dt, DT2=dt2, SECOND=second, GROUPED=grouped, HAS_BIAS=bias is not None, SPLIT_K=split,
        OUT=_OUT_DTYPES[act.dtype], BM=bm, BN=bn, GK=gk, G2=g2, SWAP=config.swap,
        EVEN_K=even_k, SC4=even_k and gk % 4 == 0 and kb % 4 == 0, NAT=config.natural and not a4,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split > 1:
        return splitk_reduce(out, bias, torch.empty(rows_out, n, dtype=act.dtype, device=dev))
    return out


def nvfp4_linear(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    w_gs: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_mode: str = "w4a16",
    *,
    residual_ratio: float = 0.5,
    residual_per_token: bool = False,
    config: GemmConfig | None = None,
    residual_combine: str = "fp4x2",
    residual_granularity: str = "block",
) -> torch.Tensor:
    """``x`` ``[M, K]`` (bf16/fp16/fp32) times an NVFP4 weight ``[N, K]`` (``w_packed`` uint8
    ``[N, K/2]``, ``w_scale`` e4m3 ``[N, K/16]``, ``w_gs`` float32 0-d encode scale), plus ``bias``
    ``[N]``: ``[M, N]`` in x's dtype. ``act_mode``: ``w4a16`` (x as is), ``naive``/``trace`` (x
    quantized to NVFP4 per token), ``quads`` (``Q(x) + Q(R_sel)``, ratio ``residual_ratio``; operand
    form ``residual_combine``, selection unit ``residual_granularity``, see :func:`quantize_activation`).
    Use :func:`quantize_activation` + :func:`nvfp4_gemm` to also get the trace guidance record."""
    act, _ = quantize_activation(x, act_mode, residual_ratio=residual_ratio, residual_per_token=residual_per_token,
                                 residual_combine=residual_combine, residual_granularity=residual_granularity)
    return nvfp4_gemm(act, w_packed, w_scale, w_gs, bias, config=config)


def moe_forward(
    x: torch.Tensor,
    slot_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_gs: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_gs: torch.Tensor,
    act_mode: str,
    *,
    residual_ratio: float = 0.5,
    residual_per_token: bool = False,
    on_record=None,
    residual_combine: str = "fp4x2",
    residual_granularity: str = "block",
    fuse_gate: bool | None = None,
    record_out=None,
) -> torch.Tensor:
    """Routed experts (gated silu) with ONE grouped launch per expert GEMM; ``[T, H]`` in x's dtype.

    ``x`` ``[T, H]``; ``slot_weights`` float32 ``[T, k]`` (router weights); ``expert_ids`` int
    ``[T, k]`` local expert ids (-1: not on this rank, contributes 0); ``w13_*``: ``[E, 2I, H/2]``
    uint8 (gate rows then up rows), e4m3 ``[E, 2I, H/16]``, float32 ``[E]``; ``w2_*``: ``[E, H, I/2]``,
    ``[E, H, I/16]``, ``[E]``. The arithmetic of the rollout's torch reference
    (``QuadsNVFP4MoEMethod.forward_reference``): x quantized once per token for all experts; GEMM1
    -> cast; ``silu(gate) * up`` in float32 -> cast; GEMM2's input quantized per token-slot row
    (``quads`` with per-call selection: one selection per expert, :func:`quads_grouped_operand`, a
    host-synchronizing loop over the active experts; every other mode has no host sync); GEMM2 ->
    cast; router-weighted sum over the k slots in float32, one cast. ``residual_combine`` (``quads``):
    see :func:`quantize_activation`; ``bf16`` makes both GEMMs ``w4a16`` GEMMs on the compensated
    activations (per-call selection: :func:`quads_grouped_values`). ``residual_granularity`` (``quads``): see
    :func:`quantize_activation` (``channel``: per token, ``bf16`` only).

    ``on_record(gemm, record)`` (trace): receives the guidance record of GEMM1's input
    (``"mlp.experts.w13"``, ``[T, H]``) and of GEMM2's input (``"mlp.experts.w2"``, ``[T * k, I]`` in
    slot order). ``record_out(gemm)`` (trace, instead of ``on_record``): returns the record to fill for
    that GEMM's input (``[T, H]``; ``[T, k, I]`` for ``"mlp.experts.w2"``, x's row ``t * k + s`` at ``[t, s]``),
    which the quantize kernel writes itself (the rollout's TRACE buffer rows: no copies).

    ``fuse_gate``: ``silu(gate) * up`` in GEMM1's epilogue (:func:`verl_quads.nvfp4.gluon_moe.gluon_w4a16_grouped`
    with ``silu_mul``: no separate gate launch, no ``[S, 2I]`` h; the same bytes). It applies where GEMM1 is a bf16
    ``w4a16`` operand (act_mode ``w4a16``, or ``quads`` with ``residual_combine="bf16"``) that the default dispatch
    runs on the grouped Gluon kernel (:func:`gluon_grouped_config`: a GLUON_MOE_TABLE entry, sm_90) and
    :func:`~verl_quads.nvfp4.gluon_moe.silu_mul_refusal` finds nothing against it. None (default): fused where it
    applies, else the two launches; True: fused, ValueError where it does not apply; False: never. Rows of
    unrouted slots (expert -1) of the gate output: act_mode ``w4a16`` leaves them unset (GEMM2 reads only the
    routed rows, the sorted slots; the combine skips them), ``quads`` zero-fills them first, as the unfused gate
    writes them (its activation quantization reads every row)."""
    t, hidden = x.shape
    k = expert_ids.shape[1]
    if t == 0:
        return torch.zeros(0, hidden, dtype=x.dtype, device=x.device)
    expert_ids = expert_ids.contiguous()  # flat views for the routing, the gate and the combine (one copy at most)
    n_exp = w13_packed.shape[0]
    s = t * k
    if on_record is not None and record_out is not None:
        raise ValueError("moe_forward: pass on_record or record_out, not both")
    capture = on_record is not None or record_out is not None
    op1, rec = quantize_activation(x, act_mode, residual_ratio=residual_ratio,
                                   residual_per_token=residual_per_token, capture=capture,
                                   residual_combine=residual_combine, residual_granularity=residual_granularity,
                                   record_out=_record_out(record_out, "mlp.experts.w13", act_mode))
    if rec is not None and on_record is not None:
        on_record("mlp.experts.w13", rec)
    # the routing's tile height depends on which kernels run the GEMMs (moe_block_m), hence after GEMM1's operand
    routing = moe_align(expert_ids, n_exp, moe_block_m(s, n_exp, op1.values if op1.mode == "w4a16" else None,
                                                       w13_packed, w2_packed))
    token_rows = routing.sorted_tokens
    # rows of slots with no local expert: h and y leave them unset (no zero-fill launches); the gate writes
    # them as 0 without reading h (what it computed from the zero rows before) and the combine skips them
    fused_cfg, why = None, "fuse_gate=False"
    if fuse_gate is not False:
        from verl_quads.nvfp4.gluon_moe import silu_mul_refusal

        why = f"GEMM1's operand is {op1.mode}, not a bf16 w4a16 one"
        if op1.mode == "w4a16":
            fused_cfg = gluon_grouped_config(op1.values, w13_packed, routing)
            why = ("the default dispatch does not run GEMM1 on the grouped Gluon kernel here (no GLUON_MOE_TABLE "
                   "entry, not sm_90, not bf16 or no Gluon)") if fused_cfg is None else silu_mul_refusal(
                w13_packed.shape[1], hidden, min(n_exp, s), fused_cfg, num_sms(x.device))
    if fuse_gate and why:
        raise ValueError(f"moe_forward: fuse_gate=True does not apply: {why}")
    if not why:  # GEMM1 + gate in one launch; unrouted rows of a: unset for w4a16 (never read), 0 for quads
        from verl_quads.nvfp4.gluon_moe import gluon_w4a16_grouped

        a = gluon_w4a16_grouped(op1.values, w13_packed, w13_scale, w13_gs, routing, token_rows, s, fused_cfg,
                                zero_unrouted=act_mode != "w4a16", silu_mul=True)
    else:
        h = nvfp4_gemm(op1, w13_packed, w13_scale, w13_gs, routing=routing, a_rows=token_rows, out_rows=s,
                       zero_unrouted=False)
        a = moe_silu_mul(h, expert_ids)  # (silu(h[:, :I].float()) * h[:, I:].float()).to(x.dtype), one launch
    if act_mode == "quads" and not residual_per_token:
        flat = expert_ids.reshape(-1)
        counts = torch.bincount(flat[flat >= 0], minlength=n_exp).tolist()  # host sync
        sorted_a = a[routing.sorted_slots[: sum(counts)].long()]
        if residual_combine == "bf16":
            op2 = quads_grouped_values(sorted_a, counts, residual_ratio)
        else:
            op2 = quads_grouped_operand(sorted_a, counts, list(range(n_exp)), n_exp, residual_ratio)
        a_rows = torch.arange(s, dtype=torch.int32, device=x.device)
    else:
        op2, rec2 = quantize_activation(a, act_mode, residual_ratio=residual_ratio,
                                        residual_per_token=residual_per_token, capture=capture,
                                        residual_combine=residual_combine, residual_granularity=residual_granularity,
                                        record_out=_record_out(record_out, "mlp.experts.w2", act_mode))
        if rec2 is not None and on_record is not None:
            on_record("mlp.experts.w2", rec2)
        a_rows = None
    y = nvfp4_gemm(op2, w2_packed, w2_scale, w2_gs, routing=routing, a_rows=a_rows, out_rows=s, zero_unrouted=False)
    return moe_combine(y, slot_weights, expert_ids)  # (y.reshape(t, k, H).float() * w[..., None]).sum(1).to(x.dtype)


def _record_out(record_out, gemm: str, act_mode: str) -> GuidanceRecord | None:
    """``record_out(gemm)`` where guidance is captured (act_mode ``trace``), else None."""
    return record_out(gemm) if record_out is not None and act_mode == "trace" else None


def moe_silu_mul(h: torch.Tensor, slot_experts: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' gate in one launch: ``h`` ``[S, 2I]`` (gate columns then up columns; bf16 / fp16
    / float32, row stride may exceed 2I) -> ``[S, I]`` in h's dtype, ``cast(silu(float32(gate)) *
    float32(up))``. On CUDA bit-identical to torch's ``(silu(h[:, :I].float()) * h[:, I:].float()).to(dtype)``
    (libdevice expf + IEEE division, as torch's CUDA silu; tests/gpu/test_nvfp4_gemm_gpu.py); under the
    interpreter the exp is numpy's float32 exp (libdevice cannot run there): within an ulp of torch's CPU
    silu before the product. ``slot_experts`` (optional, int ``[S]`` or ``[T, k]`` = S slot rows): rows whose
    expert id is < 0 (no local expert) are written as 0 without reading h (the value of an all-zero h row:
    h may leave them unset)."""
    check_available(h)
    if h.dim() != 2 or h.shape[1] % 2 or h.stride(1) != 1 or h.dtype not in _OUT_DTYPES:
        raise ValueError(f"moe_silu_mul: h must be [S, 2I] with unit column stride, dtype in "
                         f"{list(_OUT_DTYPES)}, got {h.dtype} {tuple(h.shape)} strides {h.stride()}")
    s, inter = h.shape[0], h.shape[1] // 2
    ids = None if slot_experts is None else slot_experts.reshape(-1).contiguous()
    if ids is not None and ids.numel() != s:
        raise ValueError(f"moe_silu_mul: slot_experts must have one id per row of h ({s}), got {ids.numel()}")
    out = torch.empty(s, inter, dtype=h.dtype, device=h.device)
    if s == 0 or inter == 0:
        return out
    interp = interpreting()
    code = _OUT_DTYPES[h.dtype]
    if code == 1 and not interp:
        code = 3  # the GPU's cvt.rn to bf16 (same bits as the integer rounding of OUT 1)
    block = min(1024, triton.next_power_of_2(inter))
    _moe_silu_mul_kernel[(s, -(-inter // block))](
        h, out.view(torch.int16) if h.dtype == torch.bfloat16 else out, ids if ids is not None else h, inter,
        h.stride(0), BLOCK=block, OUT=code, ACC_EXP=not interp, IDS=ids is not None, num_warps=4)
    return out


def moe_combine(y: torch.Tensor, slot_weights: torch.Tensor, slot_experts: torch.Tensor | None = None) -> torch.Tensor:
    """Router-weighted sum over each token's slots in one launch: ``y`` ``[T*k, H]`` in slot order
    (slot ``t*k + j``; bf16 / fp16 / float32), ``slot_weights`` ``[T, k]`` (float32; other float dtypes are
    converted, exactly as torch's type promotion would) -> ``[T, H]`` in y's dtype, ``cast(sum_j
    float32(y[t*k + j]) * w[t, j])`` accumulated in float32 in the fixed order j = 0..k-1 (deterministic,
    run to run); torch's ``(y.reshape(T, k, H).float() * w[..., None]).sum(1)`` agrees within float32
    summation error. ``slot_experts`` (optional, int ``[T, k]``): a slot whose expert id is < 0 (no local
    expert) is not read and adds ``0 * w`` (exactly what its all-zero row added: y may leave it unset)."""
    check_available(y)
    if slot_weights.dim() != 2 or y.dim() != 2 or y.shape[0] != slot_weights.numel() or y.dtype not in _OUT_DTYPES:
        raise ValueError(f"moe_combine: y must be [T*k, H] ({list(_OUT_DTYPES)}) and slot_weights [T, k], got y "
                         f"{y.dtype} {tuple(y.shape)}, slot_weights {tuple(slot_weights.shape)}")
    t, k = slot_weights.shape
    hidden = y.shape[1]
    ids = None if slot_experts is None else slot_experts.reshape(-1).contiguous()
    if ids is not None and ids.numel() != t * k:
        raise ValueError(f"moe_combine: slot_experts must be [T, k] = {(t, k)}, got {tuple(slot_experts.shape)}")
    out = torch.empty(t, hidden, dtype=y.dtype, device=y.device)
    if t == 0 or hidden == 0:
        return out
    y = y.contiguous()
    w = slot_weights.to(torch.float32).contiguous()
    code = _OUT_DTYPES[y.dtype]
    if code == 1 and not interpreting():
        code = 3
    block = min(1024, triton.next_power_of_2(hidden))
    _moe_combine_kernel[(t, -(-hidden // block))](
        y, w, out.view(torch.int16) if y.dtype == torch.bfloat16 else out, ids if ids is not None else w, hidden,
        TOPK=k, BLOCK=block, OUT=code, IDS=ids is not None, num_warps=4)
    return out


# --- torch custom ops: the same calls as opaque nodes for torch.compile (vLLM compiles the model;
# Dynamo must not trace the launch code). Without guidance capture: the rollout's capturing linear has its own op
# (verl_quads::nvfp4_linear_guided, rollout/linear.py).

def _linear_op(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, w_gs: torch.Tensor,
               bias: torch.Tensor | None, act_mode: str, residual_ratio: float,
               residual_per_token: bool, residual_combine: str = "fp4x2",
               residual_granularity: str = "block") -> torch.Tensor:
    return nvfp4_linear(x, w_packed, w_scale, w_gs, bias, act_mode, residual_ratio=residual_ratio,
                        residual_per_token=residual_per_token, residual_combine=residual_combine,
                        residual_granularity=residual_granularity)


def _moe_op(x: torch.Tensor, slot_weights: torch.Tensor, expert_ids: torch.Tensor, w13_packed: torch.Tensor,
            w13_scale: torch.Tensor, w13_gs: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor,
            w2_gs: torch.Tensor, act_mode: str, residual_ratio: float, residual_per_token: bool,
            residual_combine: str = "fp4x2", residual_granularity: str = "block") -> torch.Tensor:
    return moe_forward(x, slot_weights, expert_ids, w13_packed, w13_scale, w13_gs, w2_packed, w2_scale, w2_gs,
                       act_mode, residual_ratio=residual_ratio, residual_per_token=residual_per_token,
                       residual_combine=residual_combine, residual_granularity=residual_granularity)


linear_op = linear_custom_op(
    "nvfp4_linear", _linear_op,
    "(Tensor x, Tensor w_packed, Tensor w_scale, Tensor w_gs, Tensor? bias, str act_mode, "
    "float residual_ratio, bool residual_per_token, str residual_combine='fp4x2', "
    "str residual_granularity='block') -> Tensor",
)
moe_op = torch.library.custom_op(
    "verl_quads::nvfp4_moe", _moe_op, mutates_args=(),
    schema="(Tensor x, Tensor slot_weights, Tensor expert_ids, Tensor w13_packed, Tensor w13_scale, "
           "Tensor w13_gs, Tensor w2_packed, Tensor w2_scale, Tensor w2_gs, str act_mode, "
           "float residual_ratio, bool residual_per_token, str residual_combine='fp4x2', "
           "str residual_granularity='block') -> Tensor",
)


@moe_op.register_fake
def _(x, slot_weights, expert_ids, w13_packed, w13_scale, w13_gs, w2_packed, w2_scale, w2_gs, act_mode,
      residual_ratio, residual_per_token, residual_combine="fp4x2", residual_granularity="block"):
    return torch.empty_like(x)


__all__ = [
    "ACT_MODES",
    "ActOperand",
    "GemmConfig",
    "MID_TABLE",
    "grouped_block_m",
    "moe_block_m",
    "linear_op",
    "mid_config",
    "moe_forward",
    "moe_op",
    "nvfp4_gemm",
    "nvfp4_linear",
    "pick_block_m",
    "pick_config",
    "quads_grouped_operand",
    "quads_grouped_values",
    "quantize_activation",
    "RESIDUAL_COMBINES",
]
