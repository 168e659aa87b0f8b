"""W4A16 decode GEMMs by weight streaming (issue #5): ``_w4a16_stream_kernel``, its :class:`StreamConfig`, the measured
:data:`DECODE_TABLE` and the launcher :func:`stream_gemm` (reached through :func:`.triton_gemm.nvfp4_gemm`).

The packed weight is read as int32 words (8 codes; 16-byte vector loads), each code decoded with 3 integer ops
into float32 bits (no conversion instruction), the block scale applied with one multiply, and the products
accumulated on CUDA cores (float32 FMA, 1-4 activation rows per chunk) or per nibble position on tensor cores;
split-K partials are summed in a fixed order by a reduction launch or by the last program of each tile (``fixup``,
:mod:`.gemm_shared`). Same bound vs the torch reference as the tensor-core kernel of :mod:`.triton_gemm` (exact
products, float32 summation order). Other decodes (``StreamConfig.decode``): ``f16x2`` (nibbles J and J+4 of a word
built together as fp16 halves; with ``late_scale`` the block scale multiplies each word's 8-product sum) and
``bf16x2`` (tensor cores: bf16 halves scaled by a packed bf16 multiply); ``verl-quads bench rollout --sass-count``
counts their K-loop instructions offline. Chosen for w4a16 on CUDA by :data:`DECODE_TABLE` (shape -> config, filled
from ``verl-quads bench rollout --sweep-decode``); shapes not in it use the tensor-core kernel (and on sm_90 the Gluon
tables of :mod:`.gluon_dispatch` come first).

Layouts: weight ``w_packed`` uint8 ``[N, K/2]`` or ``[E, N, K/2]`` viewed as int32 words ``[..., N, K/8]`` (element
``8w + j`` in nibble j of word w, low nibble first), ``w_scale`` float8_e4m3fn ``[..., N, K/16]``, ``w_gs`` float32
0-d or ``[E]``; activation bf16 / fp16 / float32 ``[M, K]``; grouped launches take the tile table of
:func:`verl_quads.nvfp4.moe_routing.moe_align`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from verl_quads.nvfp4.format import BLOCK_SIZE
from verl_quads.nvfp4.gemm_shared import interpreting, num_sms, splitk_reduce, tile_counters
from verl_quads.nvfp4.triton_kernels import _OUT_DTYPES, triton

if TYPE_CHECKING:
    from verl_quads.nvfp4.moe_routing import GroupedRouting
    from verl_quads.nvfp4.triton_gemm import ActOperand

if triton is not None:
    import triton.language as tl

    from verl_quads.nvfp4.gemm_shared import _dot1
    from verl_quads.nvfp4.triton_kernels import _store_out

    # The GEMM at M <= 16 is bound by reading the packed weight; triton_gemm's tensor-core kernel
    # decodes 1 byte (2 elements) at a time into the tensor-core operand layout, ~13 instructions
    # per element. These kernels read the packed weight as int32 WORDS (8
    # codes, 16-byte vector loads of 4 words), decode a word's 8 nibbles with 3 integer ops each
    # (see _e2m1_word), multiply by the block scale once per element, and accumulate either on CUDA
    # cores (FMA: one float32 FMA per element and activation row; M <= 4 per row chunk) or on tensor
    # cores (one tl.dot per nibble position J: K-slice = the J-th element of every word).

    @triton.jit
    def _e2m1_word(wd, J: tl.constexpr, DEC: tl.constexpr, WIDE: tl.constexpr = False):
        """Nibble ``J`` (0..7) of int32 words ``wd`` (the word's element J: bytes little-endian, low
        nibble first) as float32, ``E2M1(code) * 2**-126`` (DEC 0) or ``E2M1(code) * 2**-14`` (DEC 1).

        DEC 0 (bits, 3 integer ops, no conversion instruction): shift the nibble to bits 28..31 (sign at
        31), arithmetic shift right by 6 (the 3 magnitude bits land on bits 22..24 = the two low exponent
        bits and the top mantissa bit of a float32) and AND 0x81C00000: a float32 equal to E2M1 * 2**-126
        exactly (codes 0/1 are float32 zero/subnormal 2**-127: needs subnormal-preserving multiplies,
        which Triton's non-ftz fmul is). DEC 1 (the fp16 trick of :func:`_fp4_decode` + a hardware
        fp16 -> fp32 conversion). DEC 2 (``f16x2``, same values as DEC 1: E2M1 * 2**-14, every code a
        normal float32): nibbles J and J + 4 of a word are 16 bits apart, so ONE pair of shifts and
        masks builds both as the two fp16 halves of an int32 (magnitude bits -> 9..11 / 25..27, sign
        -> 15 / 31); J and J + 4 share that computation (the compiler merges the identical
        expressions), then one fp16 -> fp32 conversion per element: ~2.9 integer/convert
        instructions per element, like DEC 0, but the result is in the normal range, so a product
        with an activation needs no scale first (``late_scale``). DEC 3 (``bf16x2``, tensor-core paths): the
        same pairing for bf16 (magnitude bits -> 6..8 / 22..24, sign -> 15 / 31), returned as bf16
        ``E2M1 * 2**-126`` (code 1 is a bf16 subnormal), no conversion instruction; the block scale is
        applied by a packed bf16 multiply (:func:`_stream_load`: ``scale * 2**118`` in bf16; the product
        ``E2M1 * scale * 2**-8`` is exact: <= 6 significant bits, >= 2**-18; needs a multiply that keeps
        bf16 subnormal inputs: the PTX is ``mul.bf16x2``, which has no flush-to-zero form). WIDE (float32 dots,
        which the interpreter always uses: its bf16 conversion flushes subnormals and its bf16 multiply
        is wrong, triton 3.9): the same values widened to float32 by a shift / mask, scaled in float32."""
        if DEC == 0:
            if J == 7:
                t = wd
            else:
                t = wd << (28 - 4 * J)
            return ((t >> 6) & -2118123520).to(tl.float32, bitcast=True)  # -2118123520 = 0x81C00000
        elif DEC == 2:
            if J % 4 == 0:
                a = wd << 9
                b = wd << 12
            elif J % 4 == 1:
                a = wd << 5
                b = wd << 8
            elif J % 4 == 2:
                a = wd << 1
                b = wd << 4
            else:
                a = wd >> 3
                b = wd
            h = (a & 234884608) | (b & -2147450880)  # 0x0E000E00 magnitudes, 0x80008000 signs
            if J >= 4:
                h = h >> 16
            return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        elif DEC == 3:  # bf16 E2M1 * 2**-126 (code 1: bf16 subnormal); nibbles J, J + 4 share the int32
            if J % 4 == 0:
                h = ((wd << 6) & 29360576) | ((wd << 12) & -2147450880)  # 0x01C001C0 magnitudes, 0x80008000 signs
            elif J % 4 == 1:
                h = ((wd << 2) & 29360576) | ((wd << 8) & -2147450880)
            elif J % 4 == 2:
                h = ((wd >> 2) & 29360576) | ((wd << 4) & -2147450880)
            else:
                h = ((wd >> 6) & 29360576) | (wd & -2147450880)
            # one return per constexpr branch: triton 3.6 type-checks a return after a static early return
            if WIDE:  # the same value as float32: bf16 bits are the top half of its float32 bits
                if J >= 4:
                    h = h & -65536
                else:
                    h = h << 16
                return h.to(tl.float32, bitcast=True)
            else:
                if J >= 4:
                    h = h >> 16
                return h.to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            t = wd >> (4 * J)
            h = ((t & 7) << 9) | ((t & 8) << 12)
            return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _e2m1_pair(wd, PJ: tl.constexpr, ASM: tl.constexpr):
        """Nibbles ``PJ`` and ``PJ + 4`` (PJ 0..3) of int32 words ``wd`` as float32 ``E2M1 * 2**-14`` (the
        values of :func:`_e2m1_word` DEC 2): 2 shifts + 2 masks build both as the fp16 halves of one
        int32, then one fp16 -> fp32 conversion each. ASM (GPU only, not the interpreter): the two
        conversions as inline PTX on the halves of the register (Triton's own fp16 -> fp32 lowering
        first re-packs halves of different words with a byte permute per element pair); same exact
        conversion, same values."""
        if PJ == 0:
            h = ((wd << 9) & 234884608) | ((wd << 12) & -2147450880)  # 0x0E000E00 magnitudes, 0x80008000 signs
        elif PJ == 1:
            h = ((wd << 5) & 234884608) | ((wd << 8) & -2147450880)
        elif PJ == 2:
            h = ((wd << 1) & 234884608) | ((wd << 4) & -2147450880)
        else:
            h = ((wd >> 3) & 234884608) | (wd & -2147450880)
        if ASM:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
                "=r,=r,r", [h], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        else:
            lo = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (h >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi

    @triton.jit
    def _stream_load(w_ptr, ws_ptr, wrow, nmask, kw, kw_hi, KW, KB, DEC: tl.constexpr, EVEN: tl.constexpr,
                     WIDE: tl.constexpr = False, BS: tl.constexpr = False, kw0=0):
        """Words ``kw`` (int ``[BKW]``) of weight rows ``wrow`` (int64 ``[BN]``, row index into the
        int32 view ``[rows, K/8]``) and each word's block-scale multiplier, float32 ``[BN, BKW]``:
        ``scale * 2**117`` (DEC 0), ``scale * 2**14`` (DEC 1, 2) or bf16 ``scale * 2**118`` (DEC 3), so that ``_e2m1_word * multiplier =
        E2M1 * scale * 2**-9`` resp. ``E2M1 * scale`` (exact; the 2**9 goes into the epilogue). The
        scale byte of word kw is block ``kw // 2`` (one per 16 elements; L1 hits after the first).
        BS (``block_scale``): the multipliers per 16-element block instead, ``[BN, BKW // 2]`` for blocks
        ``kw0 // 2 + [0, BKW // 2)`` (``kw = kw0 + [0, BKW)``, kw0 even), loaded as one byte tile (vector loads
        of a row's consecutive block bytes; the per-word form is one byte load per 2 words and row, a gather
        over rows: on the H200 the old d8192 entry's read-only probe took 39.8 us with per-word scale loads,
        18.3 us with the tile, 13.4 us with none). The tile has a load layout of its own: the kernel's
        per-block sums are converted to it each K step (shared memory; offline sm_90 TTGIR)."""
        if EVEN:
            m = nmask[:, None]
        else:
            m = nmask[:, None] & (kw < kw_hi)[None, :]
        wd = tl.load(w_ptr + wrow[:, None] * KW + kw[None, :], mask=m, other=0)
        if BS:
            kb = kw0 // 2 + tl.arange(0, kw.shape[0] // 2)
            if EVEN:
                mb = nmask[:, None]
            else:
                mb = nmask[:, None] & (2 * kb < kw_hi)[None, :]
            sc = tl.load(ws_ptr + wrow[:, None] * KB + kb[None, :], mask=mb, other=0)
        else:
            sc = tl.load(ws_ptr + wrow[:, None] * KB + (kw // 2)[None, :], mask=m, other=0)
        s = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if DEC == 0:
            s = s * 1.6615349947311448e35  # 2**117
        elif DEC == 3:
            s = s * 3.3230699894622896e35  # 2**118
            if not WIDE:
                s = s.to(tl.bfloat16)  # exact
        else:
            s = s * 16384.0
        return wd, s

    @triton.jit
    def _stream_x(x_ptr, arow, kw, kw_hi, K, J: tl.constexpr, EVEN: tl.constexpr, XP: tl.constexpr = False):
        """Activation row ``arow`` (int64 scalar, always a valid row: an invalid row of a chunk reads row
        0 and is not stored), elements ``8 kw + J`` (``[BKW]``, a stride-8 gather that hits L1/L2: the
        row is tiny), as float32. XP: ``x_ptr`` is the nibble-major copy ``[rows, 8, K/8]`` (element
        ``8 kw + J`` of a row at ``J * K/8 + kw``): the gather becomes contiguous (vector loads)."""
        if XP:
            off = arow * K + J * (K // 8) + kw
        else:
            off = arow * K + kw * 8 + J
        if EVEN:
            return tl.load(x_ptr + off).to(tl.float32)
        else:
            return tl.load(x_ptr + off, mask=kw < kw_hi, other=0.0).to(tl.float32)

    @triton.jit
    def _stream_late_row(p, dl, dh, x_ptr, arow, kw, kw_hi, K, PJ: tl.constexpr, EVEN: tl.constexpr,
                         XP: tl.constexpr):
        """``p + dl * x[8 kw + PJ] + dh * x[8 kw + PJ + 4]`` for activation row ``arow``: one row's late-scale
        products of nibbles PJ, PJ + 4 (``dl, dh``: :func:`_e2m1_pair`, float32 ``[BN, BKW]``)."""
        p += dl * _stream_x(x_ptr, arow, kw, kw_hi, K, PJ, EVEN, XP)[None, :]
        p += dh * _stream_x(x_ptr, arow, kw, kw_hi, K, PJ + 4, EVEN, XP)[None, :]
        return p

    @triton.jit
    def _stream_xq(x_ptr, arow, kw, kw_hi, K, Q: tl.constexpr, EVEN: tl.constexpr):
        """x_pairs: int32 word ``Q`` (0..3) of each weight word's 8 activation values of row ``arow`` (int64
        scalar), i.e. the 16-bit elements ``8 kw + 2Q`` (low half) and ``8 kw + 2Q + 1`` (high half), ``[BKW]``
        int32: one 4-byte load per 2 activation values instead of one 2-byte load each."""
        off = arow * (K // 2) + kw * 4 + Q
        xq_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        if EVEN:
            q = tl.load(xq_ptr + off)
        else:
            q = tl.load(xq_ptr + off, mask=kw < kw_hi, other=0)
        return q

    @triton.jit
    def _stream_xq4(x_ptr, arow, kw, kw_hi, K, EVEN: tl.constexpr):
        """x_pairs: the 4 int32 words (:func:`_stream_xq` Q 0..3) of row ``arow``'s 8 activation values per weight
        word, loaded once per K step for :func:`_stream_late_row_q`."""
        qa = _stream_xq(x_ptr, arow, kw, kw_hi, K, 0, EVEN)
        qb = _stream_xq(x_ptr, arow, kw, kw_hi, K, 1, EVEN)
        qc = _stream_xq(x_ptr, arow, kw, kw_hi, K, 2, EVEN)
        qd = _stream_xq(x_ptr, arow, kw, kw_hi, K, 3, EVEN)
        return qa, qb, qc, qd

    @triton.jit
    def _xq_half(q, HI: tl.constexpr, XD: tl.constexpr):
        """The low (HI 0) or high (HI 1) 16-bit half of int32 ``q`` as float32, exactly: bf16 (XD 1) by
        placing its bits in the top half of a float32, fp16 (XD 2) by an fp16 -> fp32 conversion."""
        if XD == 1:
            if HI:
                v = (q & -65536).to(tl.float32, bitcast=True)
            else:
                v = (q << 16).to(tl.float32, bitcast=True)
        else:
            if HI:
                v = (q >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            else:
                v = q.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return v

    @triton.jit
    def _stream_late_row_q(p, dl, dh, qa, qb, qc, qd, PJ: tl.constexpr, XD: tl.constexpr):
        """:func:`_stream_late_row` from the row's x_pairs words ``qa..qd`` (:func:`_stream_xq` Q 0..3): element
        PJ is in word PJ // 2, element PJ + 4 in word 2 + PJ // 2, both in half PJ % 2."""
        if PJ < 2:
            xl = _xq_half(qa, PJ % 2, XD)
            xh = _xq_half(qc, PJ % 2, XD)
        else:
            xl = _xq_half(qb, PJ % 2, XD)
            xh = _xq_half(qd, PJ % 2, XD)
        p += dl * xl[None, :]
        p += dh * xh[None, :]
        return p

    @triton.jit
    def _stream_rows(arow_ptr, orow_ptr, r, r1, GROUPED: tl.constexpr):
        """(activation row int64, output row int64, valid) of sorted/tile row ``r`` (valid: r < r1; an
        invalid row gets activation row 0, so its loads need no mask; its output is not stored)."""
        valid = r < r1
        if GROUPED:
            a = tl.load(arow_ptr + r, mask=valid, other=0).to(tl.int64)
            o = tl.load(orow_ptr + r, mask=valid, other=0).to(tl.int64)
        else:
            o = r + tl.zeros([], tl.int64)  # (r is a Python int in the interpreter's loops)
            a = tl.where(valid, o, 0)
        return a, o, valid

    @triton.jit
    def _stream_store(out_ptr, bias_ptr, acc, post, orow, valid, cols, nmask, pid_k, N, OUT_ROWS,
                      PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, OUT: tl.constexpr):
        """Row ``orow`` of the result: ``acc`` float32 ``[BN]`` times ``post`` ``[BN]``; PARTIAL (split-K):
        float32 partial at ``out[pid_k, orow, cols]`` (bias and cast in :func:`_splitk_reduce_kernel`)."""
        y = acc * post
        m = nmask & ((0 * cols + valid.to(tl.int32)) > 0)  # [BN] form: the interpreter's bool & 0-d bool is int32
        if PARTIAL:
            tl.store(out_ptr + (pid_k * OUT_ROWS + orow) * N + cols, y, mask=m)
        else:
            if HAS_BIAS:
                y += tl.load(bias_ptr + cols, mask=nmask, other=0.0).to(tl.float32)
            _store_out(out_ptr + orow * N + cols, y, m, OUT)

    @triton.jit
    def _w4a16_stream_kernel(
        x_ptr, w_ptr, ws_ptr, wgs_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr,
        arow_ptr, orow_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
        M, N, K, KW, KB, OUT_ROWS, KW_PER_SPLIT, SPLIT,
        BM: tl.constexpr, TM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, PARTIAL: tl.constexpr,
        GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, OUT: tl.constexpr, DEC: tl.constexpr,
        MMA: tl.constexpr, DT: tl.constexpr, EVEN: tl.constexpr, PREFETCH: tl.constexpr, FIXUP: tl.constexpr,
        PIPE: tl.constexpr = None, XP: tl.constexpr = False, LATE: tl.constexpr = False,
        ASM: tl.constexpr = False, BS: tl.constexpr = False, XQ: tl.constexpr = False,
    ):
        """W4A16 weight-streaming GEMM: program (M-tile, BN output columns, K-range ``pid_k``).

        Rows of the M-tile (dense: ``TM`` rows from ``pid_m * TM``; grouped: the tile table's row range
        of one expert) are processed in chunks of BM rows; for each chunk the program streams its BN
        weight rows over its K range, BKW int32 words (8 * BKW elements) per step, PREFETCH: the next
        step's words and scales are loaded before this step's arithmetic (manual double buffering).

        MMA 0 (CUDA cores, BM in 1, 2, 4): float32 accumulators ``[BN, BKW]`` per row, one FMA per
        weight element and row; summed over the word axis once at the end. PIPE (None or > 1): the K loop is
        a ``tl.range(num_stages=PIPE)`` (Triton's software pipeliner: asynchronous weight copies to shared
        memory PIPE - 1 steps ahead). XP: ``x_ptr`` is the nibble-major activation copy (see
        :func:`_stream_x`). LATE (MMA 0, DEC 2): the block scale multiplies each word's sum of its 8
        products ``sum_j E2M1_j 2**-14 x_j`` (nibble order 0, 4, 1, 5, 2, 6, 3, 7; one FFMA per word and
        row) instead of each decoded element (one FMUL per element saved; one more rounding per 8
        products); BS (LATE): per 16-element block (the 2 words' sums added, then one multiply by the
        block's scale; scales and accumulators ``[BN, BKW / 2]``); ASM: :func:`_e2m1_pair`'s inline-PTX
        conversion (GPU only). XQ (``x_pairs``, LATE, 16-bit activations: OUT 1 bf16 / 2 fp16): the
        activation values are loaded as int32 words of 2 (:func:`_stream_xq4`) and split exactly. MMA 1 (tensor
        cores, BM >= 16): per nibble position J ``acc[BN, BM] += W_J[BN, BKW] @ X_J[BM, BKW].T`` (swapped: weight rows
        on the MMA's M side) in the operand type DT (0 float32, 1 bf16, 2 fp16; the decoded values
        E2M1 * scale * 2**-9 are exact in all three). MMA 2: the same, not swapped ``X_J @ W_J.T``.
        PARTIAL (split-K): write float32 partials ``part[pid_k, row, col]`` (no bias); then either the
        reduction kernel sums them, or (FIXUP) the last of the SPLIT programs of an output tile to finish
        (a per-tile counter ``cnt``: atomic add with acquire-release at GPU scope after a barrier; the
        counter is reset to 0 by that program) sums them in the same fixed order s = 0, 1, ... (L1
        bypassed), adds bias and writes the output: one launch, bit-identical to the reduction kernel.

        Epilogue: ``acc * 2**9 (DEC 0) / weight_global_scale`` (per expert), + bias, one cast; or float32
        partials for the split-K reduction."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        if GROUPED:
            e = tl.load(tile_e_ptr + pid_m)
            r0 = tl.load(tile_r0_ptr + pid_m)
            r1 = tl.load(tile_r1_ptr + pid_m)
            r1 = tl.where(e >= 0, r1, r0)  # a tile past the last expert's: no rows
            ec = tl.maximum(e, 0).to(tl.int64)
        else:
            r0 = pid_m * TM
            r1 = tl.minimum(r0 + TM, M)
            ec = (pid_m * 0).to(tl.int64)
        cols = pid_n * BN + tl.arange(0, BN)
        nmask = cols < N
        wrow = ec * N + cols.to(tl.int64)
        kw_lo = pid_k * KW_PER_SPLIT
        kw_hi = tl.minimum(kw_lo + KW_PER_SPLIT, KW)
        gw = tl.load(wgs_ptr + ec)
        post = tl.math.div_rn(tl.full([BN], 1.0, tl.float32), gw + tl.zeros([BN], tl.float32))
        if DEC == 0:
            post = post * 512.0  # undo the 2**-9 of the decoded values (exact)
        elif DEC == 3:
            post = post * 256.0  # undo the 2**-8 (bf16 pair decode times scale * 2**118)
        i = tl.arange(0, BKW)
        for c0 in range(r0, r1, BM):
            if MMA == 0:
                a0, o0, v0 = _stream_rows(arow_ptr, orow_ptr, c0, r1, GROUPED)
                a1, o1, v1 = _stream_rows(arow_ptr, orow_ptr, c0 + 1, r1, GROUPED)
                a2, o2, v2 = _stream_rows(arow_ptr, orow_ptr, c0 + 2, r1, GROUPED)
                a3, o3, v3 = _stream_rows(arow_ptr, orow_ptr, c0 + 3, r1, GROUPED)
                acc0 = tl.zeros([BN, BKW // 2 if BS else BKW], tl.float32)
                acc1 = tl.zeros([BN, BKW // 2 if BS else BKW], tl.float32)
                acc2 = tl.zeros([BN, BKW // 2 if BS else BKW], tl.float32)
                acc3 = tl.zeros([BN, BKW // 2 if BS else BKW], tl.float32)
            else:
                rr = c0 + tl.arange(0, BM)
                rv = rr < r1
                if GROUPED:
                    ar = tl.load(arow_ptr + rr, mask=rv, other=0).to(tl.int64)
                    orr = tl.load(orow_ptr + rr, mask=rv, other=0).to(tl.int64)
                else:
                    ar = rr.to(tl.int64)
                    orr = ar
                if MMA == 1:
                    acc = tl.zeros([BN, BM], tl.float32)
                else:
                    acc = tl.zeros([BM, BN], tl.float32)
            if PREFETCH:
                wd_n, s_n = _stream_load(w_ptr, ws_ptr, wrow, nmask, kw_lo + i, kw_hi, KW, KB, DEC, EVEN, DT == 0, BS,
                                         kw_lo)
            for kw0 in tl.range(kw_lo, kw_hi, BKW, num_stages=PIPE):
                kw = kw0 + i
                if PREFETCH:
                    wd, s = wd_n, s_n
                    # next step in range: a mask along N only (constant along K, so the loads stay 16-byte
                    # vectors; the [BN] form also avoids the interpreter's int32 result of bool & 0-d bool)
                    nxt = nmask & ((kw_hi - kw0 + 0 * cols) > BKW)
                    wd_n, s_n = _stream_load(w_ptr, ws_ptr, wrow, nxt, kw + BKW, kw_hi, KW, KB, DEC, EVEN, DT == 0,
                                             BS, kw0 + BKW)
                else:
                    wd, s = _stream_load(w_ptr, ws_ptr, wrow, nmask, kw, kw_hi, KW, KB, DEC, EVEN, DT == 0, BS, kw0)
                if LATE:  # MMA 0: per-word sums of unscaled products, then one FFMA with the scale
                    p0 = tl.zeros([BN, BKW], tl.float32)
                    p1 = tl.zeros([BN, BKW], tl.float32)
                    p2 = tl.zeros([BN, BKW], tl.float32)
                    p3 = tl.zeros([BN, BKW], tl.float32)
                    if XQ:  # x_pairs: each row's 8 activation values per word as 4 int32 loads, once per step
                        q0a, q0b, q0c, q0d = _stream_xq4(x_ptr, a0, kw, kw_hi, K, EVEN)
                        if BM > 1:
                            q1a, q1b, q1c, q1d = _stream_xq4(x_ptr, a1, kw, kw_hi, K, EVEN)
                        if BM > 2:
                            q2a, q2b, q2c, q2d = _stream_xq4(x_ptr, a2, kw, kw_hi, K, EVEN)
                            q3a, q3b, q3c, q3d = _stream_xq4(x_ptr, a3, kw, kw_hi, K, EVEN)
                    for pj in tl.static_range(4):
                        dl, dh = _e2m1_pair(wd, pj, ASM)
                        if XQ:
                            p0 = _stream_late_row_q(p0, dl, dh, q0a, q0b, q0c, q0d, pj, OUT)
                            if BM > 1:
                                p1 = _stream_late_row_q(p1, dl, dh, q1a, q1b, q1c, q1d, pj, OUT)
                            if BM > 2:
                                p2 = _stream_late_row_q(p2, dl, dh, q2a, q2b, q2c, q2d, pj, OUT)
                                p3 = _stream_late_row_q(p3, dl, dh, q3a, q3b, q3c, q3d, pj, OUT)
                        else:
                            p0 = _stream_late_row(p0, dl, dh, x_ptr, a0, kw, kw_hi, K, pj, EVEN, XP)
                            if BM > 1:
                                p1 = _stream_late_row(p1, dl, dh, x_ptr, a1, kw, kw_hi, K, pj, EVEN, XP)
                            if BM > 2:
                                p2 = _stream_late_row(p2, dl, dh, x_ptr, a2, kw, kw_hi, K, pj, EVEN, XP)
                                p3 = _stream_late_row(p3, dl, dh, x_ptr, a3, kw, kw_hi, K, pj, EVEN, XP)
                    if BS:  # per 16-element block: the sum of its 2 words' products, then its scale
                        acc0 += tl.sum(tl.reshape(p0, [BN, BKW // 2, 2]), axis=2) * s
                        if BM > 1:
                            acc1 += tl.sum(tl.reshape(p1, [BN, BKW // 2, 2]), axis=2) * s
                        if BM > 2:
                            acc2 += tl.sum(tl.reshape(p2, [BN, BKW // 2, 2]), axis=2) * s
                            acc3 += tl.sum(tl.reshape(p3, [BN, BKW // 2, 2]), axis=2) * s
                    else:
                        acc0 += p0 * s
                        if BM > 1:
                            acc1 += p1 * s
                        if BM > 2:
                            acc2 += p2 * s
                            acc3 += p3 * s
                else:
                    for j in tl.static_range(8):
                        v = _e2m1_word(wd, j, DEC, DT == 0) * s
                        if MMA == 0:
                            acc0 += v * _stream_x(x_ptr, a0, kw, kw_hi, K, j, EVEN, XP)[None, :]
                            if BM > 1:
                                acc1 += v * _stream_x(x_ptr, a1, kw, kw_hi, K, j, EVEN, XP)[None, :]
                            if BM > 2:
                                acc2 += v * _stream_x(x_ptr, a2, kw, kw_hi, K, j, EVEN, XP)[None, :]
                                acc3 += v * _stream_x(x_ptr, a3, kw, kw_hi, K, j, EVEN, XP)[None, :]
                        else:
                            if EVEN:
                                xm = rv[:, None]
                            else:
                                xm = rv[:, None] & (kw < kw_hi)[None, :]
                            xj = tl.load(x_ptr + ar[:, None] * K + (kw * 8 + j)[None, :], mask=xm, other=0.0)
                            if DT == 1:
                                vd = v.to(tl.bfloat16)
                                xj = xj.to(tl.bfloat16)
                            elif DT == 2:
                                vd = v.to(tl.float16)
                                xj = xj.to(tl.float16)
                            else:
                                vd = v.to(tl.float32)
                                xj = xj.to(tl.float32)
                            acc = _dot1(acc, xj, vd, MMA == 1, DT)
            if MMA == 0:
                dst = part_ptr if PARTIAL else out_ptr
                _stream_store(dst, bias_ptr, tl.sum(acc0, axis=1), post, o0, v0, cols, nmask, pid_k, N, OUT_ROWS,
                              PARTIAL, HAS_BIAS, OUT)
                if BM > 1:
                    _stream_store(dst, bias_ptr, tl.sum(acc1, axis=1), post, o1, v1, cols, nmask, pid_k, N,
                                  OUT_ROWS, PARTIAL, HAS_BIAS, OUT)
                if BM > 2:
                    _stream_store(dst, bias_ptr, tl.sum(acc2, axis=1), post, o2, v2, cols, nmask, pid_k, N,
                                  OUT_ROWS, PARTIAL, HAS_BIAS, OUT)
                    _stream_store(dst, bias_ptr, tl.sum(acc3, axis=1), post, o3, v3, cols, nmask, pid_k, N,
                                  OUT_ROWS, PARTIAL, HAS_BIAS, OUT)
            else:
                if MMA == 1:
                    y = tl.trans(acc) * post[None, :]
                else:
                    y = acc * post[None, :]
                om = rv[:, None] & nmask[None, :]
                if PARTIAL:
                    tl.store(part_ptr + (pid_k * OUT_ROWS + orr)[:, None] * N + cols[None, :], y, mask=om)
                else:
                    if HAS_BIAS:
                        y += tl.load(bias_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
                    _store_out(out_ptr + orr[:, None] * N + cols[None, :], y, om, OUT)
        if FIXUP:
            tl.debug_barrier()  # every thread's partial stores precede the release below
            tid = pid_m * tl.num_programs(1) + pid_n
            done = tl.atomic_add(cnt_ptr + tid, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT - 1:  # the last K range of this tile: sum the partials, fixed order
                for r in range(r0, r1):
                    if GROUPED:
                        orow = tl.load(orow_ptr + r).to(tl.int64)
                    else:
                        orow = r + tl.zeros([], tl.int64)
                    y = tl.load(part_ptr + orow * N + cols, mask=nmask, other=0.0, cache_modifier=".cg")
                    for sk in range(1, SPLIT):
                        y += tl.load(part_ptr + (sk * OUT_ROWS + orow) * N + cols, mask=nmask, other=0.0,
                                     cache_modifier=".cg")
                    if HAS_BIAS:
                        y += tl.load(bias_ptr + cols, mask=nmask, other=0.0).to(tl.float32)
                    _store_out(out_ptr + orow * N + cols, y, nmask, OUT)
                tl.store(cnt_ptr + tid, 0)  # ready for the next launch (stream order)


@dataclass(frozen=True)
class StreamConfig:
    """Launch configuration of the W4A16 weight-streaming (decode) kernel ``_w4a16_stream_kernel``;
    pass it as ``config=`` to :func:`nvfp4_gemm` (``w4a16`` operands only) or list it in
    :data:`DECODE_TABLE`.

    Attributes:
        block_m: activation rows per chunk: 1, 2 or 4 on CUDA cores (``mma=0``; a dense GEMM gets one
            program row-tile per chunk, a grouped tile loops over its rows in chunks); >= 16 (power of
            2) on tensor cores (``mma`` 1/2).
        block_n: output columns (weight rows) per program (power of 2, >= 16; >= 4 on CUDA cores, ``mma=0``:
            few rows with a long ``block_kw`` read long contiguous runs of each row).
        block_kw: int32 words (8 weight elements, 4 packed bytes) per K step and weight row (power of 2;
            >= 16 with ``mma``: one tl.dot per nibble position has K = block_kw).
        split_k: K ranges computed by separate programs (float32 partials, then one reduction launch
            summing them in a fixed order); 0 = choose so the grid has ~``occ`` programs per SM.
        num_warps / num_stages: Triton launch options (num_stages matters for ``mma`` only: the
            pipeliner stages loads that feed a dot; ``prefetch`` is the manual equivalent).
        mma: 0 CUDA-core FMAs (float32), 1 tensor cores with the weight tile on the MMA's M side
            (swapped), 2 tensor cores not swapped.
        decode: ``"bits"`` (3 integer ops per element, float32 subnormals; :func:`_e2m1_word` DEC 0)
            or ``"f16"`` (fp16 bits + conversion instruction; DEC 1) or ``"f16x2"`` (nibbles J and J+4 of
            a word decoded together as the two fp16 halves of one int32, then converted; DEC 2) or
            ``"bf16x2"`` (``mma`` 1/2 only: the same pairing as bf16 halves, scaled by a packed bf16
            multiply, no conversion instruction; DEC 3; offline sm_90 K-loop count of the d8192 M=16
            entry 8.41 -> 6.85 SASS instructions per weight element).
        prefetch: load the next K step's words and scales before this step's arithmetic.
        fixup: split-K partials summed by the last program of each output tile (per-tile counters,
            one launch) instead of a second reduction launch; same fixed summation order, so the
            result is bit-identical.
        occ: ``split_k=0`` target: split K until the grid has ~``occ`` programs per SM (was fixed 4).
        pipe: stages of Triton's software pipeliner on the K loop (``tl.range(num_stages=pipe)``); > 1
            turns the weight-word loads into 16-byte asynchronous copies to shared memory issued
            ``pipe - 1`` steps ahead (offline sm_90 compile: LDGSTS.128; the manual ``prefetch`` keeps
            only one step in flight in registers); needs ``prefetch=False``.
        xperm: (``mma=0``) the kernel reads a nibble-major copy of the activation, ``[M, 8, K/8]`` (one
            small torch copy per call), so the activation values of nibble position j of BKW
            consecutive words are contiguous (vector loads) instead of a stride-8 gather of 2-byte
            loads (the offline sm_90 compile of the d8192 table entry: 48 of its ~55 loads per K step
            are such activation gathers; a likely limit is the load/store unit, not DRAM).
        late_scale: (``mma=0``, decode ``"f16x2"``) multiply each word's sum of 8 unscaled
            products (E2M1 * 2**-14 * x, exact) by its block scale (one FFMA per word and row) instead of
            scaling every decoded element (one FMUL per element): the offline sm_90 count of the K loop
            drops by ~1 instruction per weight element; numerics: one extra float32 rounding per 8
            products, inside the tests' bound (1 ulp + 4 K eps_f32 |x| @ |w|.T). Not with ``"bits"``:
            its decoded values are ~2**-126 (products with x would be float32 subnormals). On a GPU the
            fp16 -> fp32 conversions are inline PTX (the interpreter runs the plain Triton form, same
            values).
        block_scale: (``late_scale``) the block scale multiplies the sum of a 16-element block's two word
            sums (one FFMA per block and row instead of per word; one more float32 rounding per 16 products,
            inside the same bound), the scales loaded as a ``[block_n, block_kw / 2]`` byte tile (vector
            loads) instead of one byte load per word pair and row. Why (H200 roofline, session 7): the per-word
            scale byte gathers, not DRAM, bound the reads (old d8192 entry read-only probe 39.8 us, 13.4 us
            without scale loads, 18.3 us with the tile). Offline sm_90 (triton 3.9), the old d8192 entry with
            it: 128 instead of 249 registers, K loop 1252 vs 1392 SASS, 42 vs 56 loads, plus a shared-memory
            conversion of the block sums per K step (4 LDS, 8 BAR). (An earlier form, the per-word bytes reduced
            per block in registers, measured 1.7x slower on the H200 at a5e6a17 and is gone.)
        x_pairs: (``late_scale``, not ``xperm``; bf16 / fp16 activations only) the activation values are loaded
            as int32 words of two 16-bit values (4 loads per weight word and row instead of 8 two-byte loads)
            and split exactly (bf16: bit placement; fp16: conversion). Same values, products and order as
            without it (bit-identical). Why: the offline sm_90 K loop of the d8192 M=1 entry issues 8
            two-byte activation gathers per step and converts each through shared memory (20 BAR per step);
            with pairs there are half as many loads and conversions. H200 (session 8): d8192 M=1 19.6 -> 18.0 us,
            17.3 with the pipelined loop (``pipe=3``: the activation via cp.async, no conversion); in DECODE_TABLE.

    Removed after measuring slower on the H200 (session 8, cold L2): multi-row chunks whose invalid rows skipped their
    products by a runtime branch (``row_skip``; MoE w13 M=16 bm2 136 us vs bm1 109), weight loads two K steps ahead
    (``prefetch2``; d8192 M=1 24.7 us vs 19.6) and one int32 weight word per thread and row (``word_lanes``; d8192 M=1
    30.0 us vs 19.6, MoE w2 M=1 28.3 vs 8.61).
    """

    block_m: int = 1
    block_n: int = 64
    block_kw: int = 16
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 1
    mma: int = 0
    decode: str = "bits"
    prefetch: bool = True
    fixup: bool = False
    occ: int = 4
    pipe: int = 1
    xperm: bool = False
    late_scale: bool = False
    block_scale: bool = False
    x_pairs: bool = False

    @property
    def label(self) -> str:
        """Short name for tables, e.g. ``fma bm1 n64 kw16 s4 w4 st1 bits pf``."""
        kind = ("fma", "mma-swap", "mma")[self.mma]
        return (f"{kind} bm{self.block_m} n{self.block_n} kw{self.block_kw} s{self.split_k or 'auto'} "
                f"w{self.num_warps} st{self.num_stages} {self.decode}{' pf' if self.prefetch else ''}"
                f"{' fx' if self.fixup else ''}{'' if self.occ == 4 else f' o{self.occ}'}{f' p{self.pipe}' if self.pipe > 1 else ''}{' xp' if self.xperm else ''}{' ls' if self.late_scale else ''}{' bs' if self.block_scale else ''}{' x2' if self.x_pairs else ''}")

    def check(self) -> None:
        def pow2(v):
            return v > 0 and v & (v - 1) == 0

        ok = (self.mma in (0, 1, 2) and self.decode in ("bits", "f16", "f16x2", "bf16x2") and pow2(self.block_n) and self.block_n >= (4 if self.mma == 0 else 16)
              and pow2(self.block_kw) and self.split_k >= 0 and pow2(self.num_warps) and self.num_stages >= 1
              and self.occ >= 1 and self.pipe >= 1 and (self.pipe == 1 or not self.prefetch)
              and (not self.xperm or self.mma == 0)
              and (not self.late_scale or (self.mma == 0 and self.decode == "f16x2"))
              and (not self.block_scale or (self.late_scale and self.block_kw >= 2))
              and (not self.x_pairs or (self.late_scale and not self.xperm))
              and (self.decode != "bf16x2" or self.mma != 0))
        if self.mma == 0:
            ok = ok and self.block_m in (1, 2, 4)
        else:
            ok = ok and pow2(self.block_m) and self.block_m >= 16 and self.block_kw >= 16
        if not ok:
            raise ValueError(
                f"nvfp4 GEMM: bad StreamConfig {self}: mma 0 needs block_m in 1/2/4; mma 1/2 need block_m >= 16 "
                "and block_kw >= 16; block_n >= 16 (>= 4 with mma 0), block_kw, num_warps powers of 2; decode 'bits', 'f16', "
                "'f16x2' or 'bf16x2'; occ >= 1; pipe >= 1, pipe > 1 needs prefetch=False; xperm needs mma 0; late_scale needs "
                "mma 0 and decode 'f16x2'; block_scale needs late_scale and block_kw >= 2; x_pairs needs late_scale "
                "and not xperm; decode 'bf16x2' needs mma 1 or 2")


# Decode dispatch (w4a16, CUDA): (grouped, rows bucket, N, K) -> StreamConfig. Rows = M for a dense GEMM,
# the number of token-slots S (= tokens * top_k) for a grouped one; buckets are powers of two up to
# 128 and a GEMM takes the entry of the smallest bucket >= its rows that has one (e.g. with entries at
# 1, 4 and 16 a dense M=2 uses the M=4 entry, M=17 none). Shapes without an entry use pick_config's
# tensor-core kernel. Filled from ``verl-quads bench rollout --sweep-decode`` on the H200 (it prints a
# paste-ready table: the fastest variant that passed the reference check and beat the tensor-core kernel).
# From `verl-quads bench rollout --sweep-decode`, NVIDIA H200 (sm_90), torch 2.11.0+cu130, triton 3.6.0, 2026-11-29
# (docs/bench_rollout_h200_decode_sweep.txt); the (False, 1, 8192, 8192) and (True, 8, 1536, 2048) entries from the
# follow-up `--sweep-decode --focus --shapes moe,d8192 --m 1` run (docs/bench_rollout_h200_decode_focus.txt).
# Session 4 (2026-11-30, `--sweep-decode --focus --shapes moe,d8192 --m 1,16`, docs/bench_rollout_h200_decode_focus_s4.txt):
# (False, 1, 8192, 8192), (True, 8, *) -> f16x2 + late_scale; (True, 128, 1536, 2048) -> bf16x2 (225 vs 235 us).
# Session 5 (`--sweep-mid`, docs/bench_rollout_h200_mid_sweep_s5.txt): (False, 16, *) and (True, 128, 1536, 2048) removed
# (the tensor-core kernel's MID_TABLE tiles measured faster: 54.2 vs 76.5 us d8192, 21.7 vs 24.0 d4096, 175 vs 219 MoE
# w13 M=16); (True, 512, 2048, 768) added (MoE w2 at 129..512 slots, M=64: 100 vs 227 us for the old default).
# Session 7 (issue #5 roofline, `--sweep-decode --focus --shapes d8192,moe --m 1,16` at a5e6a17, H200, cold L2,
# docs/bench_rollout_h200_gemv_roofline_s7.txt): (False, 1, 8192, 8192) and (True, 8, 1536, 2048) -> n128 kw16 w4
# (34.3 vs 37.6 us d8192 = 1.00x cuBLAS; 19.3 vs 23.0 us w13 = 1.57x torch._grouped_mm; both within the reference
# bound); w2 unchanged (occ 2 9.86 vs 9.89 us: noise). The roofline shows why all tilings stay near 25-27% of
# copy BW: the per-word block-scale byte loads (read-only probe of the old d8192 entry 39.8 us with them, 13.4 us
# without; a linear Triton read of the code bytes reaches 80-82% at 4-8 programs/SM). Then block_scale (the scales as a
# per-block byte tile) at 74b53d7, same command at --m 1 (G3 in the doc; every variant within the bound): d8192 M=1 ->
# n16 kw128 w4 bs 19.5 us (n128 kw16 34.3; = 1.79x cuBLAS 34.8 us, 46% of copy BW), MoE w13 M=1 -> n16 kw128 w4 bs
# 12.2 us (19.2; 2.49x torch._grouped_mm), MoE w2 M=1 -> n64 kw32 w4 bs 8.49 us (9.82; 2.38x); the MoE layer at M=1
# with them 23.7 us = 3.8x the BF16 layer (warm L2, one routing, as the main bench).
# Session 8 (`--sweep-decode --focus --shapes moe,d8192 --m 16,4,64` and `--shapes qkv,o_proj,d4096 --m 1` at d088976,
# H200, cold L2, every variant within the reference bound; docs/bench_rollout_h200_session8.txt): the block_scale tiling
# at more points. MoE w13 M=4 (32 slots) n16 kw128 33.2 us (tensor-core 50.9; old stream entry 113), w2 M=4 n64 kw32
# 19.6 (35.7); w13 M=16 (128 slots) n16 kw128 109 (tensor-core MID_TABLE tile 125), w2 M=16 n64 kw32 57.3 (old entry
# 64.8); the MoE layer with them 59.7 us = 2.91x BF16 at M=4, 175 us = 1.97x at M=16 (warm L2). Dense M=1: d4096 n8
# kw128 w2 8.29 us (old entry 17.1; cuBLAS 13.4), qkv 5120x2048 n16 kw128 5.96 (cuBLAS 8.14; tensor-core 13.7),
# o_proj 2048x4096 n8 kw128 w2 6.21 (cuBLAS 9.28). (False, 4, 8192, 8192) removed: 65.7 us vs 38.2 for the
# tensor-core kernel's pick_config (the best CUDA-core variant at M=4: 54.5).
# Session 8 phase 2 (helper G, H200 at 7f3745b, `--sweep-decode --focus --shapes d8192 --m 1` and `--shapes moe --m 1,16`,
# cold L2, every variant within the reference bound; GPU stream tests of the new options 54 passed): x_pairs (int32
# activation pairs) and the pipelined loop with them (p3 x2: cp.async, no shared-memory conversion of the activation
# per nibble) win; one weight word per thread (4-byte weight loads: d8192 30.0 us, w2 M=16 390) and weight loads two
# K steps ahead (d8192 24.7) lose, as do session 8 phase 1's multi-row chunks with runtime row skipping (G1 at cd62c4a:
# w13 M=16 bm2 136 vs 109 us); those three options were removed in session 9. d8192 M=1 n16 kw128
# p3 x2 17.3 us (entry 19.6; x2 alone 18.0; = 2.00x cuBLAS 34.6, 52% of copy BW); MoE w13 M=1 p3 x2 11.2 (12.2; x2
# 11.2), w2 M=1 x2 7.36 (8.61); w13 M=16 p3 x2 107 (109), w2 M=16 x2 53.5 (57.4); MoE layer with them 22.4 us = 3.83x
# BF16 at M=1, 169 us = 2.02x at M=16 (warm L2). Then G3 at 0cd88e7 (same commands, `--shapes qkv,o_proj,d4096 --m 1`
# and `--shapes moe --m 4`; all within the bound; GPU default-dispatch tests of the MoE entries 17 passed): qkv 5120x2048
# x2 5.45 us (5.96; cuBLAS 8.05), o_proj 2048x4096 n16 kw256 w8 p3 x2 5.33 (6.21; cuBLAS 9.22), d4096 n8 kw128 w2 p3 x2
# 6.95 (8.34; cuBLAS 13.5), MoE w13 M=4 p3 x2 31.6 (32.8), w2 M=4 x2 18.6 (19.8); MoE layer M=4 58.5 us = 2.89x BF16.
# G4 at 0fd1859 (`--shapes d8192,moe --m 1`, twins of the M=1 entries; GPU default-dispatch qkv / o_proj tests 8 passed):
# no change -- d8192 entry 17.3 us again (occ 8 18.4, 2 stages 18.6, n8 kw128 w2 p3 x2 17.3 tie, n32 kw128 w8 22.1),
# w13 M=1 entry 11.2 (pf x2 11.1: noise), w2 M=1 entry 7.95 (7.36 in G2: run-to-run spread); MoE layer M=1 22.1 us = 4.0x.
DECODE_TABLE: dict[tuple[bool, int, int, int], StreamConfig] = {
    (False, 1, 2048, 4096): StreamConfig(block_m=1, block_n=16, block_kw=256, split_k=0, num_warps=8, num_stages=1, mma=0, decode='f16x2', prefetch=False, fixup=True, pipe=3, late_scale=True, block_scale=True, x_pairs=True),
    (False, 1, 4096, 4096): StreamConfig(block_m=1, block_n=8, block_kw=128, split_k=0, num_warps=2, num_stages=1, mma=0, decode='f16x2', prefetch=False, fixup=True, pipe=3, late_scale=True, block_scale=True, x_pairs=True),
    (False, 1, 5120, 2048): StreamConfig(block_m=1, block_n=16, block_kw=128, split_k=0, num_warps=4, num_stages=1, mma=0, decode='f16x2', prefetch=True, fixup=True, late_scale=True, block_scale=True, x_pairs=True),
    (False, 1, 8192, 8192): StreamConfig(block_m=1, block_n=16, block_kw=128, split_k=0, num_warps=4, num_stages=1, mma=0, decode='f16x2', prefetch=False, fixup=True, pipe=3, late_scale=True, block_scale=True, x_pairs=True),
    (False, 2, 8192, 8192): StreamConfig(block_m=2, block_n=16, block_kw=128, split_k=0, num_warps=4, num_stages=1, mma=0, decode='f16x2', prefetch=True, fixup=True, late_scale=True, block_scale=True),  # session 9: 33.6 vs 37.9 us (tensor-core)
    (True, 8, 1536, 2048): StreamConfig(block_m=1, block_n=16, block_kw=128, split_k=0, num_warps=4, num_stages=1, mma=0, decode='f16x2', prefetch=False, fixup=True, pipe=3, late_scale=True, block_scale=True, x_pairs=True),
    (True, 8, 2048, 768): StreamConfig(block_m=1, block_n=64, block_kw=32, split_k=0, num_warps=4, num_stages=1, mma=0, decode='f16x2', prefetch=True, fixup=False, late_scale=True, block_scale=True, x_pairs=True),
    (True, 32, 1536, 2048): StreamConfig(block_m=1, block_n=16, block_kw=128, split_k=0, num_warps=4, num_stages=1, mma=0, decode='f16x2', prefetch=False, fixup=True, pipe=3, late_scale=True, block_scale=True, x_pairs=True),
    (True, 32, 2048, 768): StreamConfig(block_m=1, block_n=64, block_kw=32, split_k=0, num_warps=4, num_stages=1, mma=0, decode='f16x2', prefetch=True, fixup=True, late_scale=True, block_scale=True, x_pairs=True),
    (True, 128, 1536, 2048): StreamConfig(block_m=1, block_n=16, block_kw=128, split_k=0, num_warps=4, num_stages=1, mma=0, decode='f16x2', prefetch=False, fixup=True, pipe=3, late_scale=True, block_scale=True, x_pairs=True),
    (True, 128, 2048, 768): StreamConfig(block_m=1, block_n=64, block_kw=32, split_k=0, num_warps=4, num_stages=1, mma=0, decode='f16x2', prefetch=True, fixup=True, late_scale=True, block_scale=True, x_pairs=True),
    (True, 512, 2048, 768): StreamConfig(block_m=16, block_n=128, block_kw=16, split_k=0, num_warps=4, num_stages=1, mma=2, decode='bits', prefetch=False, fixup=False),
}
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def decode_bucket(rows: int) -> int | None:
    """The smallest of :data:`DECODE_BUCKETS` >= ``rows`` (None past the last)."""
    return next((b for b in DECODE_BUCKETS if rows <= b), None)


def decode_config(rows: int, n: int, k: int, grouped: bool, x_dtype: torch.dtype | None = None) -> StreamConfig | None:
    """The :data:`DECODE_TABLE` entry for a w4a16 GEMM of ``rows`` rows (dense: M; grouped: token-slots),
    or None (use the tensor-core kernel). ``x_dtype`` (the activation dtype, when known): an entry measured with
    ``x_pairs`` (16-bit activation pairs) is returned with ``x_pairs=False`` for float32 activations (the same
    tiling and values; x_pairs reads 16-bit pairs only)."""
    for b in DECODE_BUCKETS:
        if rows <= b and (grouped, b, n, k) in DECODE_TABLE:
            cfg = DECODE_TABLE[(grouped, b, n, k)]
            if cfg.x_pairs and x_dtype is not None and x_dtype not in (torch.bfloat16, torch.float16):
                cfg = replace(cfg, x_pairs=False)
            return cfg
    return None


def stream_constexprs(cfg: StreamConfig, *, grouped: bool, tm: int, partial: bool, fixup: bool, has_bias: bool,
                       out_code: int, dt: int, even: bool, interpreting: bool) -> dict:
    """The compile-time arguments of ``_w4a16_stream_kernel`` for a launch of ``cfg`` (used by
    :func:`stream_gemm` and by the offline sm_90 instruction count of ``verl-quads bench rollout
    --sass-count``)."""
    return dict(BM=cfg.block_m, TM=tm, BN=cfg.block_n, BKW=cfg.block_kw, PARTIAL=partial, GROUPED=grouped,
                HAS_BIAS=has_bias, OUT=out_code, DEC=("bits", "f16", "f16x2", "bf16x2").index(cfg.decode), MMA=cfg.mma,
                DT=dt, EVEN=even, PREFETCH=cfg.prefetch, FIXUP=fixup, PIPE=cfg.pipe if cfg.pipe > 1 else None,
                XP=cfg.xperm, LATE=cfg.late_scale, ASM=cfg.late_scale and not interpreting, BS=cfg.block_scale,
                XQ=cfg.x_pairs)


def stream_split(cfg: StreamConfig, kw: int, live: int, n_tiles: int, dev: torch.device) -> tuple[int, int, bool]:
    """K partition of a stream-kernel launch: ``(split, kw_per_split, even)`` for ``kw`` int32 words per
    weight row, ``live`` M-tiles (grouped: active experts at most) and ``n_tiles`` column tiles.
    ``split_k=0``: double the split while the grid stays <= ``occ`` programs per SM and each K range keeps
    >= 2 steps of ``block_kw``; ranges are rounded up to multiples of 16 words where possible (Triton
    specializes integer arguments divisible by 16: the word loads stay 16-byte vectors), no empty range.
    ``even``: every range is full (no K mask). Shared by :func:`stream_gemm` and the bench's probes
    (verl_quads/bench/gemv_probe.py), so both launch the same grid."""
    split = cfg.split_k
    if split == 0:
        target = cfg.occ * num_sms(dev)
        split = 1
        while live * n_tiles * split * 2 <= target and kw // (cfg.block_kw * split * 2) >= 2:
            split *= 2
    kw_per = -(-kw // split)
    align = max(cfg.block_kw, 16) if kw % 16 == 0 else cfg.block_kw
    kw_per = -(-kw_per // align) * align
    split = -(-kw // kw_per)  # no empty K ranges
    return split, kw_per, kw % kw_per == 0


def stream_gemm(act: ActOperand, w_packed: torch.Tensor, w_scale: torch.Tensor, w_gs: torch.Tensor,
                 bias: torch.Tensor | None, routing: GroupedRouting | None, a_rows: torch.Tensor | None,
                 rows_out: int, cfg: StreamConfig, zero_unrouted: bool = True) -> torch.Tensor:
    """:func:`nvfp4_gemm` for a ``w4a16`` operand with the weight-streaming kernel (arguments checked
    by the caller). Weight words: ``w_packed`` viewed as int32 ``[..., N, K/8]`` (K is a multiple of
    16, so rows stay word-aligned)."""
    cfg.check()
    if act.mode != "w4a16":
        raise ValueError(f"nvfp4 GEMM: the streaming (StreamConfig) kernel takes w4a16 operands only, got "
                         f"act_mode {act.mode!r}; use a GemmConfig for W4A4 modes")
    x = act.values
    m, k = x.shape
    n = w_packed.shape[-2]
    dev = w_packed.device
    grouped = routing is not None
    if cfg.x_pairs and x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nvfp4 GEMM: StreamConfig x_pairs=True reads 16-bit activation pairs; the activation is "
                         f"{x.dtype} (allowed: torch.bfloat16, torch.float16): use x_pairs=False")
    if w_packed.storage_offset() % 4 or not w_packed.is_contiguous():
        raise ValueError("nvfp4 GEMM: streaming kernel needs a contiguous w_packed starting at a 4-byte boundary")
    w32 = w_packed.view(torch.int32)
    kw, kb = k // 8, k // BLOCK_SIZE
    x_arg = x.view(m, kw, 8).transpose(1, 2).contiguous() if cfg.xperm else x  # [M, 8, K/8] nibble-major
    if grouped:
        m_tiles = routing.tile_expert.numel()
        arow_t = routing.sorted_slots if a_rows is None else a_rows.to(torch.int32).contiguous()
        orow_t = routing.sorted_slots
        tm = routing.block_m
    else:
        tm = cfg.block_m
        m_tiles = -(-m // tm)
        arow_t = orow_t = None
    n_tiles = -(-n // cfg.block_n)
    live = m_tiles if not grouped else min(routing.num_experts, rows_out)  # grouped: active experts at most
    split, kw_per, even = stream_split(cfg, kw, live, n_tiles, dev)
    dt = _OUT_DTYPES[x.dtype]
    if interpreting():
        dt = 0  # the interpreter's bf16/fp16 tl.dot is wrong (triton 3.9); float32 gives the same exact products
    dummy = w_gs
    counters = tile_counters(dev, m_tiles * n_tiles, "stream") if (cfg.fixup and split > 1) else None
    fixup = counters is not None
    # grouped: rows of slots with no local expert belong to no tile and are never written -> zeros
    # (zero_unrouted=False: left unset, for callers that never read them: moe_forward)
    y = (torch.zeros if grouped and zero_unrouted else torch.empty)(rows_out, n, dtype=x.dtype, device=dev)
    y_arg = y.view(torch.int16) if x.dtype == torch.bfloat16 else y
    part = None
    if split > 1:  # the reduction kernel reads every row; the fixup only the rows of its own tile
        part = (torch.zeros if grouped and zero_unrouted and not fixup else torch.empty)(
            split, rows_out, n, dtype=torch.float32, device=dev)
    _w4a16_stream_kernel[(m_tiles, n_tiles, split)](
        x_arg, w32, w_scale.view(torch.uint8), w_gs.reshape(-1), bias if bias is not None else dummy, y_arg,
        part if part is not None else dummy, counters if fixup else dummy,
        arow_t if grouped else dummy, orow_t if grouped else dummy,
        routing.tile_expert if grouped else dummy, routing.tile_row0 if grouped else dummy,
        routing.tile_row1 if grouped else dummy,
        m, n, k, kw, kb, rows_out, kw_per, split,
        **stream_constexprs(cfg, grouped=grouped, tm=tm, partial=split > 1, fixup=fixup, has_bias=bias is not None,
                             out_code=_OUT_DTYPES[x.dtype], dt=dt, even=even, interpreting=interpreting()),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split == 1 or fixup:
        return y
    return splitk_reduce(part, bias, y)


__all__ = ["DECODE_BUCKETS", "DECODE_TABLE", "StreamConfig", "decode_bucket", "decode_config", "stream_gemm",
           "stream_split"]
