"""Triton fast paths for NVFP4: quantize, dequantize, QDQ, residual compensation, guided quantize.

Each kernel produces the same bytes as :mod:`.reference` (tests compare with ``torch.equal``, which takes
-0.0 == +0.0 on floats; the GPU tests of dequantize, plain and guided QDQ compare bytes, the residual ones not yet):

- float32 division uses ``tl.math.div_rn`` (IEEE round-to-nearest); Triton's plain ``/`` lowers
  to an approximate division on NVIDIA GPUs.
- the E4M3 block-scale cast is done in integer arithmetic (round-to-nearest-even on the
  mantissa bits, subnormals included), so it does not depend on a conversion instruction.
- kernels are launched with ``enable_fp_fusion=False``: a multiply feeding an add must not be
  contracted into an FMA, which would round differently from the reference.
- a sign is OR-ed into a value's bits (``_qdq_pairs``, ``_code_value``), never applied by a float
  negation: triton 3.6 lowers ``-v`` to ``0.0 - v``, which is +0.0 for v = +0.0 (the reference's code 8
  is -0.0; the interpreter and triton 3.9 negate exactly, so only the GPU showed it).

The residual path (QUADS, selection rule in :mod:`.residual`):

- per-token selection with a per-row global scale (the rollout's case, the default): one fused
  kernel, one program per row: first pass, residual scores, the row's top-k blocks by a bitwise
  threshold search (no sort), the row's second-pass global scale, and either ``Q(x) + Q(R_sel)``
  or both packed passes. ``_residual_row_kernel`` holds the whole row in registers;
  ``_residual_tiled_kernel`` walks it in tiles twice (scores first, then the output; the second
  read of the row comes from L2). ``KERNELS`` picks one;
- otherwise (per-call selection, or a per-tensor global scale, or rows longer than
  ``ROW_CONFIG["max_blocks"]`` blocks): a first-pass kernel that also writes each (row, 16-block)'s
  score and residual amax, the selection (per call: ``call_scores`` + ``_select_kernel``; per token:
  torch's stable sort), the second-pass scale kernel, and a second-pass / fused QDQ kernel.

Both paths produce the reference's bytes and block indices (``torch.equal``), ties included: the
block scores are summed in the reference's explicit pairwise order, and the per-call score is the
same torch reduction (``call_scores``) on the same per-row scores. Exception: an input whose
residual squared overflows float32 (|R| > 1.8e19) with a zero ``score_weight`` entry gives a NaN
score, whose ordering is not specified.

Quantize / QDQ: ``_quant_kernel`` (v1) or ``_quant2_kernel`` (v2: one thread per 16-block, loaded
as two 8-element halves; the global scale's reciprocal once per program; optional float-only E2M1
index), chosen by ``KERNELS``.

Layout: a contiguous ``[..., K]`` input is processed as ``R * K / 16`` consecutive 16-element
blocks (K % 16 == 0, so no block straddles a row); even and odd elements are loaded as two
tiles so that two codes pack into one byte without a register shuffle. Global scales are read
per row through a divisor (scalar, per row, per expert) without materializing them per row.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from verl_quads.nvfp4 import device_info as di
from verl_quads.nvfp4.format import BLOCK_SIZE, NVFP4Tensor
from verl_quads.nvfp4.guidance import GuidanceRecord, check_record_out, extract_guidance
from verl_quads.nvfp4.reference import (
    _check_amax,
    _check_global_scale,
    _gs_of_amax,
    global_scale_from_amax,
    per_row_global_scale,
    validate_input,
)
from verl_quads.nvfp4.residual import ResidualNVFP4, call_scores, check_score_weight, num_selected_blocks
from verl_quads.nvfp4.residual import residual_quantize as _ref_residual_quantize

try:
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as e:  # pragma: no cover - depends on the environment
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    _TRITON_IMPORT_ERROR = e

_OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def check_available(x: torch.Tensor) -> None:
    """Raise ``RuntimeError`` saying why the Triton backend cannot run for tensor ``x``."""
    if triton is None:
        raise RuntimeError(f"NVFP4 backend 'triton' requested but triton cannot be imported: {_TRITON_IMPORT_ERROR}")
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if x.is_cuda and interp:
        raise RuntimeError("NVFP4 backend 'triton': TRITON_INTERPRET=1 is set but the tensor is on CUDA")
    if not x.is_cuda and not interp:
        raise RuntimeError(
            f"NVFP4 backend 'triton' needs a CUDA tensor (got device {x.device}); on CPU it runs only under "
            "TRITON_INTERPRET=1 (tests). Use backend='torch' for CPU tensors."
        )


if triton is not None:

    @triton.jit
    def _e4m3_round(s):
        """Round positive float32 ``s`` (<= 448) to E4M3 (RNE). Returns (value as float32, byte as int32)."""
        bits = s.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127
        mant = (bits & 0x7FFFFF) | 0x800000
        normal = e >= -6
        drop = tl.where(normal, 20, tl.minimum(14 - e, 25))
        half = (1 << (drop - 1)) - 1
        q = (mant + half + ((mant >> drop) & 1)) >> drop
        exp = tl.where(normal, e - 3, -9)
        pow2 = ((exp + 127) << 23).to(tl.float32, bitcast=True)
        value = q.to(tl.float32) * pow2
        byte = tl.where(normal, (e + 6) * 8 + q, q)
        return value, byte

    @triton.jit
    def _e4m3_decode(byte):
        """E4M3 byte (int32, 0..126) -> float32 value (exact)."""
        exp = (byte >> 3) & 15
        man = byte & 7
        sub = man.to(tl.float32) * 0.001953125  # 2**-9
        pow2 = ((exp - 10 + 127) << 23).to(tl.float32, bitcast=True)
        nrm = (man + 8).to(tl.float32) * pow2
        return tl.where(exp == 0, sub, nrm)

    @triton.jit
    def _e2m1_round(a):
        """Round-to-nearest-even of |y| in [0, 6] onto the E2M1 grid, in 8 integer/float ops.
        Returns (magnitude index int32 0..7, rounded value float32).

        One magic add does the rounding: with ``e = max(exponent(a), 0)`` (0, 1 or 2 for
        a <= 6), ``magic = 2**(e + 22)`` has a float32 ulp of ``2**(e - 1)``, which is the E2M1
        grid step in a's binade (0.5 below 2, 1 in [2, 4), 2 in [4, 6]), so IEEE round-to-
        nearest-even of ``a + magic`` rounds a onto the grid with E2M1's tie rule (ties to the
        even code: .25->0, .75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4). The index is the number of
        grid steps above ``magic`` (``bits(a + magic) - bits(magic)``) plus ``2 e`` (the codes below
        the binade): ``(magic_bits >> 22) - 298`` = 2 e. The value is ``(a + magic) - magic``, exact.
        (Kernels run with FP fusion off; the add/sub pair is not folded.)"""
        mb = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000) + 0x0B000000
        magic = mb.to(tl.float32, bitcast=True)
        s = a + magic
        idx = (s.to(tl.int32, bitcast=True) - mb) + ((mb >> 22) - 298)
        return idx, s - magic

    @triton.jit
    def _e2m1_index(a):
        """Round-to-nearest-even E2M1 magnitude index (int32 0..7) of |y| in [0, 6]."""
        idx, _ = _e2m1_round(a)
        return idx

    @triton.jit
    def _e2m1_value(idx):
        """Magnitude of E2M1 index (int32 0..7) as float32."""
        e = idx >> 1
        m = (idx & 1).to(tl.float32)
        pow2 = ((tl.maximum(e, 1) - 1 + 127) << 23).to(tl.float32, bitcast=True)
        return tl.where(e == 0, m * 0.5, pow2 * (1.0 + 0.5 * m))

    @triton.jit
    def _signbit(y):
        return ((y.to(tl.int32, bitcast=True) >> 31) & 1).to(tl.int32)

    @triton.jit
    def _scales(vec_max, gs):
        """Per-block max |x| and global scale (same shape) -> (scale value, scale byte, output_scale)."""
        s = gs * (vec_max * 0.16666666666666666)
        s = tl.minimum(s, 448.0)
        sval, sbyte = _e4m3_round(s)
        return sval, sbyte, _output_scale(sval, gs)

    @triton.jit
    def _output_scale(sval, gs):
        """1 / (scale * (1 / gs)) with 1/0 := 0, IEEE divisions (the reference's order)."""
        inv_gs = tl.math.div_rn(tl.full(gs.shape, 1.0, tl.float32), gs)
        denom = sval * inv_gs
        safe = tl.where(denom == 0, 1.0, denom)
        return tl.where(denom == 0, 0.0, tl.math.div_rn(tl.full(denom.shape, 1.0, tl.float32), safe))

    @triton.jit
    def _load_pairs(ptr, b, bmask, SPLIT: tl.constexpr):
        """Even and odd elements of 16-element blocks ``b`` as two float32 [BLK, 8] tiles.
        SPLIT: one contiguous [BLK, 16] load split in registers; else two stride-2 loads."""
        if SPLIT:
            e = tl.arange(0, 16)
            x = tl.load(ptr + b[:, None] * 16 + e[None, :], mask=bmask[:, None], other=0.0).to(tl.float32)
            xe, xo = tl.split(tl.reshape(x, (x.shape[0], 8, 2)))
        else:
            j = tl.arange(0, 8)
            base = b[:, None] * 16 + 2 * j[None, :]
            xe = tl.load(ptr + base, mask=bmask[:, None], other=0.0).to(tl.float32)
            xo = tl.load(ptr + base + 1, mask=bmask[:, None], other=0.0).to(tl.float32)
        return xe, xo

    @triton.jit
    def _store_pairs(ptr, b, ve, vo, bmask, OUT: tl.constexpr):
        """Interleave even/odd float32 [BLK, 8] tiles back into blocks and store them contiguously."""
        v = tl.reshape(tl.join(ve, vo), (ve.shape[0], 16))
        e = tl.arange(0, 16)
        _store_out(ptr + b[:, None] * 16 + e[None, :], v, bmask[:, None], OUT)

    @triton.jit
    def _packed_word(xe, xo, os, j):
        """E2M1 codes of a block-pair tile under output scale ``os`` [BLK], packed per block
        into one int64 word (see ``_block_word``). ``clamp(p, -6, 6)`` of the reference is
        ``min(|p|, 6)`` with p's sign bit (code bit 3 = bit 31 of p >> 28)."""
        pe = xe * os[:, None]
        po = xo * os[:, None]
        ce = ((pe.to(tl.int32, bitcast=True) >> 28) & 8) | _e2m1_index(tl.minimum(tl.abs(pe), 6.0))
        co = ((po.to(tl.int32, bitcast=True) >> 28) & 8) | _e2m1_index(tl.minimum(tl.abs(po), 6.0))
        return _block_word(ce, co, j)

    @triton.jit
    def _qdq_pairs(xe, xo, sval, gs, os):
        """First-pass QDQ values (float32) of a block pair tile given its scale value and output
        scale: ``±e2m1(min(|x os|, 6)) * (sval / gs)`` (the sign of x os, -0.0 included)."""
        pe = xe * os[:, None]
        po = xo * os[:, None]
        factor = tl.math.div_rn(sval, gs)[:, None]
        _, re = _e2m1_round(tl.minimum(tl.abs(pe), 6.0))
        _, ro = _e2m1_round(tl.minimum(tl.abs(po), 6.0))
        ve = (re * factor).to(tl.int32, bitcast=True) | (pe.to(tl.int32, bitcast=True) & -2147483648)
        vo = (ro * factor).to(tl.int32, bitcast=True) | (po.to(tl.int32, bitcast=True) & -2147483648)
        return ve.to(tl.float32, bitcast=True), vo.to(tl.float32, bitcast=True)

    @triton.jit
    def _tree_energy(re, ro, we, wo, HAS_W: tl.constexpr):
        """Per-block score [BLK] of residual pair tiles [BLK, 8]: sum of r**2 (times the channel
        weight if HAS_W) as the reference's pairwise tree of adjacent pairs (16 -> 8 -> 4 -> 2 -> 1,
        ``v[0::2] + v[1::2]``); even/odd tiles hold elements 2j / 2j+1, so level one is se + so."""
        se = re * re
        so = ro * ro
        if HAS_W:
            se = se * we
            so = so * wo
        s8 = se + so
        a4, b4 = tl.split(tl.reshape(s8, (s8.shape[0], 4, 2)))
        s4 = a4 + b4
        a2, b2 = tl.split(tl.reshape(s4, (s4.shape[0], 2, 2)))
        a1, b1 = tl.split(a2 + b2)
        return a1 + b1

    @triton.jit
    def _block_word(ce, co, j):
        """The 8 packed bytes of each block ([BLK, 8] even/odd codes) as one int64 word, byte j =
        ce[:, j] | co[:, j] << 4 (little-endian), so a block is one 8-byte store. Built from two
        32-bit halves: 64-bit shifts cost several instructions each."""
        byte = ce | (co << 4)
        sh = 8 * (j % 4)
        lo = tl.sum(tl.where(j[None, :] < 4, byte << sh[None, :], 0), axis=1)
        hi = tl.sum(tl.where(j[None, :] >= 4, byte << sh[None, :], 0), axis=1)
        return (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)

    @triton.jit
    def _store_out(ptr, v, mask, OUT: tl.constexpr):
        if OUT == 0:
            tl.store(ptr, v, mask=mask)
        elif OUT == 1:
            # bfloat16 by integer round-to-nearest-even of the float32 bits into an int16 view of
            # the output (the interpreter's float->bf16 cast truncates; values here are finite)
            b = v.to(tl.int32, bitcast=True)
            r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            tl.store(ptr, r.to(tl.int16), mask=mask)
        elif OUT == 3:
            # bfloat16 by the GPU's float->bf16 conversion (cvt.rn: round-to-nearest-even, the same
            # bits as OUT == 1 for finite values) into the int16 view; not under the interpreter
            tl.store(ptr, v.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=mask)
        else:
            tl.store(ptr, v.to(tl.float16), mask=mask)

    @triton.jit
    def _quant_kernel(
        x_ptr, gs_ptr, packed_ptr, scale_ptr, out_ptr,
        NBLK, NBK, GS_DIV,
        BLK: tl.constexpr, MODE: tl.constexpr, OUT: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """Block layout: the input is NBLK = R * K / 16 consecutive 16-element blocks; a program
        handles BLK of them as even/odd [BLK, 8] tiles (``_load_pairs``), so two codes pack into
        one byte without a shuffle. Block b belongs to row b // NBK, whose global scale
        is gs[row // GS_DIV].

        MODE 0: write packed codes + E4M3 scale bytes. 1: write the QDQ result."""
        b = tl.program_id(0).to(tl.int64) * BLK + tl.arange(0, BLK)
        bmask = b < NBLK
        j = tl.arange(0, 8)
        xe, xo = _load_pairs(x_ptr, b, bmask, SPLIT)
        gs = tl.load(gs_ptr + (b // NBK) // GS_DIV, mask=bmask, other=1.0)
        vec_max = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
        sval, sbyte, out_scale = _scales(vec_max, gs)
        if MODE == 1:
            ve, vo = _qdq_pairs(xe, xo, sval, gs, out_scale)
            _store_pairs(out_ptr, b, ve, vo, bmask, OUT)
        else:
            tl.store(packed_ptr + b, _packed_word(xe, xo, out_scale, j), mask=bmask)
            tl.store(scale_ptr + b, sbyte.to(tl.uint8), mask=bmask)

    @triton.jit
    def _dequant_kernel(
        packed_ptr, scale_ptr, gs_ptr, out_ptr, NBLK, NBK, GS_DIV,
        BLK: tl.constexpr, OUT: tl.constexpr, SPLIT: tl.constexpr,  # SPLIT: unused (uniform launch)
    ):
        """Block layout as in ``_quant_kernel``: low nibbles are the even elements, high the odd."""
        b = tl.program_id(0).to(tl.int64) * BLK + tl.arange(0, BLK)
        bmask = b < NBLK
        j = tl.arange(0, 8)
        w = tl.load(packed_ptr + b, mask=bmask, other=0)
        p = ((w[:, None] >> (8 * j[None, :]).to(tl.int64)) & 0xFF).to(tl.int32)
        sb = tl.load(scale_ptr + b, mask=bmask, other=0).to(tl.int32)
        gs = tl.load(gs_ptr + (b // NBK) // GS_DIV, mask=bmask, other=1.0)
        factor = tl.math.div_rn(_e4m3_decode(sb), gs)[:, None]
        # the sign bit OR-ed in (_code_value): -0.0 for code 8 on the GPU too (a float negation is
        # 0.0 - v under triton 3.6, +0.0 there; seen on the H200 in session 5)
        _store_pairs(out_ptr, b, _code_value(p & 15, factor), _code_value(p >> 4, factor), bmask, OUT)

    @triton.jit
    def _residual_stats_kernel(
        x_ptr, gs_ptr, w_ptr, packed_ptr, scale_ptr, energy_ptr, ramax_ptr,
        M, NBK, GS_DIV,
        RT: tl.constexpr, CT: tl.constexpr, PACK: tl.constexpr, HAS_W: tl.constexpr, SPLIT: tl.constexpr,
        BLK: tl.constexpr,  # unused (uniform launch)
    ):
        """Residual first pass over a tile of RT rows x CT blocks: E4M3 scales (and packed codes
        if PACK), each block's residual amax and its score (``_tree_energy``, channel weights
        w [K] if HAS_W), both float32 [M, NBK]."""
        rows = tl.program_id(0) * RT + tl.arange(0, RT)
        cols = tl.program_id(1) * CT + tl.arange(0, CT)
        tmask = (rows[:, None] < M) & (cols[None, :] < NBK)
        b = tl.reshape(rows[:, None].to(tl.int64) * NBK + cols[None, :], (RT * CT,))
        bmask = tl.reshape(tmask, (RT * CT,))
        j = tl.arange(0, 8)
        xe, xo = _load_pairs(x_ptr, b, bmask, SPLIT)
        gs = tl.load(gs_ptr + (b // NBK) // GS_DIV, mask=bmask, other=1.0)
        vec_max = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
        sval, sbyte, out_scale = _scales(vec_max, gs)
        tl.store(scale_ptr + b, sbyte.to(tl.uint8), mask=bmask)
        if PACK:
            tl.store(packed_ptr + b, _packed_word(xe, xo, out_scale, j), mask=bmask)
        ve, vo = _qdq_pairs(xe, xo, sval, gs, out_scale)
        re = xe - ve
        ro = xo - vo
        tl.store(ramax_ptr + b, tl.maximum(tl.max(tl.abs(re), axis=1), tl.max(tl.abs(ro), axis=1)), mask=bmask)
        we = re
        wo = ro
        if HAS_W:
            we, wo = _load_pairs(w_ptr, b % NBK, bmask, SPLIT)
        tl.store(energy_ptr + b, _tree_energy(re, ro, we, wo, HAS_W), mask=bmask)

    @triton.jit
    def _residual_row_kernel(
        x_ptr, gs_ptr, w_ptr, out_ptr, packed1_ptr, scale1_ptr, packed2_ptr, scale2_ptr, idx_ptr, gs2_ptr,
        NB, NSEL, GS_DIV,
        NBP: tl.constexpr, HAS_W: tl.constexpr, PACK: tl.constexpr, OUT: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """Fused per-token QUADS residual compensation: one program per row of ``x`` [M, K], the
        whole row (NB = K / 16 blocks, padded to NBP) held as even/odd [NBP, 8] tiles.

        1. first pass: E4M3 scales and QDQ values under the row's global scale gs[row // GS_DIV];
        2. residual R = x - Q(x), per-block score ``_tree_energy`` (times channel weights w if HAS_W)
           and residual amax;
        3. selection of the row's NSEL highest scores, ties to the lower block index, without a
           sort: scores are non-negative float32, so their int32 bit patterns order like the
           values; a 31-step bitwise search finds the NSEL-th largest pattern T (the largest T with
           #(bits >= T) >= NSEL); blocks above T are selected, and of the blocks equal to T the
           first NSEL - #(bits > T) in index order (a cumulative count);
        4. second-pass global scale of the row: ``reciprocal(max(amax of R over selected blocks,
           tiny)) * 2688`` (1.0 if that overflows), as :func:`global_scale_from_amax`;
        5. PACK: write Q(x) (packed words + scale bytes at the block layout), and for the selected
           blocks, in ascending block order (slot = cumulative count), Q(R_sel) words, scale bytes,
           block indices [M, NSEL] and gs2 [M]. Else: write Q(x) + Q(R_sel) (float32 sum, one cast)."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, NBP)
        cmask = c < NB
        b = row * NB + c
        j = tl.arange(0, 8)
        xe, xo = _load_pairs(x_ptr, b, cmask, SPLIT)
        gs = tl.load(gs_ptr + row // GS_DIV + c * 0)  # the row's scale, broadcast to [NBP]
        vec_max = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
        sval, sbyte, out_scale = _scales(vec_max, gs)
        if PACK:
            tl.store(packed1_ptr + b, _packed_word(xe, xo, out_scale, j), mask=cmask)
            tl.store(scale1_ptr + b, sbyte.to(tl.uint8), mask=cmask)
        ve, vo = _qdq_pairs(xe, xo, sval, gs, out_scale)
        re = xe - ve
        ro = xo - vo
        we = re
        wo = ro
        if HAS_W:
            we, wo = _load_pairs(w_ptr, c, cmask, SPLIT)
        ebits = _tree_energy(re, ro, we, wo, HAS_W).to(tl.int32, bitcast=True)
        ebits = tl.where(cmask, ebits, -1)
        t = tl.max(ebits, axis=0) * 0
        for i in tl.static_range(31):
            cand = t | (1 << (30 - i))
            cnt = tl.sum((ebits >= cand).to(tl.int32), axis=0)
            t = tl.where(cnt >= NSEL, cand, t)
        gt = ebits > t
        eq = ebits == t
        need = NSEL - tl.sum(gt.to(tl.int32), axis=0)
        sel = (gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= need))) & cmask  # NSEL = 0: t = 0x7FFFFFFF, none
        ramax = tl.maximum(tl.max(tl.abs(re), axis=1), tl.max(tl.abs(ro), axis=1))
        amax = tl.max(tl.where(sel, ramax, 0.0), axis=0)
        a = tl.maximum(amax, 1.1754943508222875e-38)
        g2 = tl.math.div_rn(tl.full(a.shape, 1.0, tl.float32), a) * 2688.0
        g2 = tl.where(g2 == float("inf"), 1.0, g2)
        gs2 = tl.zeros([NBP], dtype=tl.float32) + g2
        s2, sb2, os2 = _scales(ramax, gs2)
        if PACK:
            slot = row * NSEL + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(packed2_ptr + slot, _packed_word(re, ro, os2, j), mask=sel)
            tl.store(scale2_ptr + slot, sb2.to(tl.uint8), mask=sel)
            tl.store(idx_ptr + slot, c.to(tl.int64), mask=sel)
            tl.store(gs2_ptr + row + c * 0, gs2, mask=c == 0)
        else:
            r2e, r2o = _qdq_pairs(re, ro, s2, gs2, os2)
            ve = tl.where(sel[:, None], ve + r2e, ve)
            vo = tl.where(sel[:, None], vo + r2o, vo)
            _store_pairs(out_ptr, b, ve, vo, cmask, OUT)

    @triton.jit
    def _select_kernel(score_ptr, mask_ptr, idx_ptr, NB, NSEL, NBP: tl.constexpr, CH: tl.constexpr):
        """One program: the NSEL highest scores of [NB] (ties: lower index first) as an int8 mask
        [NB] and ascending indices [NSEL]. A block's rank is the number of blocks ahead of it."""
        i = tl.arange(0, NBP)
        vi = i < NB
        si = tl.load(score_ptr + i, mask=vi, other=0.0)
        rank = tl.zeros([NBP], dtype=tl.int32)
        for start in range(0, NB, CH):
            jj = start + tl.arange(0, CH)
            vj = jj < NB
            sj = tl.load(score_ptr + jj, mask=vj, other=0.0)
            ahead = (sj[None, :] > si[:, None]) | ((sj[None, :] == si[:, None]) & (jj[None, :] < i[:, None]))
            rank += tl.sum((ahead & vj[None, :]).to(tl.int32), axis=1)
        sel = (rank < NSEL) & vi
        tl.store(mask_ptr + i, sel.to(tl.int8), mask=vi)
        pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(idx_ptr + pos, i.to(tl.int64), mask=sel)

    @triton.jit
    def _row_gs2_kernel(ramax_ptr, mask_ptr, amax_ptr, gs2_ptr, M, NBK, MASK_ROW, RB: tl.constexpr,
                        CH: tl.constexpr):
        """Per row: amax of the residual over its selected blocks and the second-pass encode scale
        ``reciprocal(max(amax, tiny)) * 2688`` (1.0 if not finite), as the reference computes it.
        The mask is per block ([NBK], MASK_ROW = 0) or per (row, block) (MASK_ROW = 1)."""
        rows = tl.program_id(0) * RB + tl.arange(0, RB)
        rmask = rows < M
        amax = tl.zeros([RB], dtype=tl.float32)
        for start in range(0, NBK, CH):
            c = start + tl.arange(0, CH)
            m2 = rmask[:, None] & (c[None, :] < NBK)
            ra = tl.load(ramax_ptr + rows[:, None].to(tl.int64) * NBK + c[None, :], mask=m2, other=0.0)
            sel = tl.load(mask_ptr + rows[:, None].to(tl.int64) * NBK * MASK_ROW + c[None, :], mask=m2, other=0)
            amax = tl.maximum(amax, tl.max(tl.where(sel != 0, ra, 0.0), axis=1))
        tl.store(amax_ptr + rows, amax, mask=rmask)
        a = tl.maximum(amax, 1.1754943508222875e-38)
        g = tl.math.div_rn(tl.full(a.shape, 1.0, tl.float32), a) * 2688.0
        g = tl.where(g == float("inf"), 1.0, g)
        tl.store(gs2_ptr + rows, g, mask=rmask)

    @triton.jit
    def _residual_second_kernel(
        x_ptr, gs1_ptr, scale1_ptr, idx_ptr, gs2_ptr, packed_ptr, scale_ptr,
        NSLOT, NSEL, NBK, GS1_DIV,
        BLK: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """Second pass over the NSLOT = M * NSEL selected (row, block) slots, BLK per program:
        recompute the first-pass QDQ of the block from x and its stored scale, take the residual,
        quantize it with the row's second-pass global scale gs2[row]."""
        s = tl.program_id(0).to(tl.int64) * BLK + tl.arange(0, BLK)
        smask = s < NSLOT
        row = s // NSEL
        blk = tl.load(idx_ptr + s, mask=smask, other=0)
        src = row * NBK + blk  # the source block's index in the block layout
        j = tl.arange(0, 8)
        xe, xo = _load_pairs(x_ptr, src, smask, SPLIT)
        gs1 = tl.load(gs1_ptr + row // GS1_DIV, mask=smask, other=1.0)
        s1 = _e4m3_decode(tl.load(scale1_ptr + src, mask=smask, other=0).to(tl.int32))
        ve, vo = _qdq_pairs(xe, xo, s1, gs1, _output_scale(s1, gs1))
        re = xe - ve
        ro = xo - vo
        gs2 = tl.load(gs2_ptr + row, mask=smask, other=1.0)
        vec_max = tl.maximum(tl.max(tl.abs(re), axis=1), tl.max(tl.abs(ro), axis=1))
        sval, sbyte, os2 = _scales(vec_max, gs2)
        tl.store(packed_ptr + s, _packed_word(re, ro, os2, j), mask=smask)
        tl.store(scale_ptr + s, sbyte.to(tl.uint8), mask=smask)

    @triton.jit
    def _residual_qdq_kernel(
        x_ptr, gs1_ptr, scale1_ptr, slot_ptr, gs2_ptr, out_ptr,
        NBLK, NBK, GS1_DIV, SLOT_DIV,
        BLK: tl.constexpr, OUT: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """Fused ``Q(x) + Q(R_sel)`` in one pass over x: each block's first-pass QDQ (from its
        stored E4M3 scale) plus, for a selected block, the QDQ of its residual under the row's
        second-pass global scale gs2[row]; summed in float32 and cast once. ``slot_ptr`` (int8)
        holds 1 for selected blocks: per block index ([NBK], SLOT_DIV = 0, per-call selection)
        or per (row, block) ([R * NBK], SLOT_DIV = 1, per-token selection)."""
        b = tl.program_id(0).to(tl.int64) * BLK + tl.arange(0, BLK)
        bmask = b < NBLK
        row = b // NBK
        xe, xo = _load_pairs(x_ptr, b, bmask, SPLIT)
        gs1 = tl.load(gs1_ptr + row // GS1_DIV, mask=bmask, other=1.0)
        s1 = _e4m3_decode(tl.load(scale1_ptr + b, mask=bmask, other=0).to(tl.int32))
        ve, vo = _qdq_pairs(xe, xo, s1, gs1, _output_scale(s1, gs1))
        sel = tl.load(slot_ptr + (b % NBK) + row * NBK * SLOT_DIV, mask=bmask, other=0) != 0
        re = xe - ve
        ro = xo - vo
        gs2 = tl.load(gs2_ptr + row, mask=bmask, other=1.0)
        vec_max = tl.maximum(tl.max(tl.abs(re), axis=1), tl.max(tl.abs(ro), axis=1))
        s2, _, os2 = _scales(vec_max, gs2)
        we, wo = _qdq_pairs(re, ro, s2, gs2, os2)
        ve = tl.where(sel[:, None], ve + we, ve)
        vo = tl.where(sel[:, None], vo + wo, vo)
        _store_pairs(out_ptr, b, ve, vo, bmask, OUT)

    @triton.jit
    def _guided_code(y, bit):
        """Guided E2M1 code of scaled value y (float32 in [-6, 6]) given the record's low magnitude bit
        (int32 0/1), as :func:`verl_quads.nvfp4.guidance.guided_codes`: from the nearest grid point
        (``_e2m1_round``: index n, value v) the floor index is ``lo = n - (v > |y|)``; on the grid
        (v == |y|) the code is n, else the one of lo, lo + 1 whose low bit is ``bit``, i.e.
        ``lo + ((lo ^ bit) & 1)`` (lo + 1 <= 7: |y| < 6 off the grid)."""
        a = tl.abs(y)
        n, v = _e2m1_round(a)
        lo = n - (v > a).to(tl.int32)
        return (_signbit(y) << 3) | tl.where(v == a, n, lo + ((lo ^ bit) & 1))

    @triton.jit
    def _code_value(c, factor):
        """float32 value of E2M1 codes ``c`` (int32 [BLK, 8]) times ``factor`` ([BLK, 1]):
        ``e2m1_value(c & 7) * factor`` (one float32 rounding) with the sign of code bit 3 OR-ed into the
        product's bits (code 8 -> -0.0 on every device, as the reference). Used by ``_dequant_kernel`` and
        ``_guided_kernel``'s QDQ. Not ``where(c >= 8, -v, v)``: triton 3.6 lowers a float negation to
        ``0.0 - v``, which gives +0.0 for code 8 on the GPU while the interpreter gives -0.0 (session 5,
        H200)."""
        v = _e2m1_value(c & 7) * factor
        return (v.to(tl.int32, bitcast=True) | ((c << 28) & -2147483648)).to(tl.float32, bitcast=True)

    @triton.jit
    def _guided_kernel(
        x_ptr, bits_ptr, scale_ptr, gs_ptr, packed_ptr, NBLK, NBK, GS_DIV,
        BLK: tl.constexpr, SPLIT: tl.constexpr, MODE: tl.constexpr = 0, OUT: tl.constexpr = 0,
    ):
        """Block layout as in ``_quant_kernel``; a block's 16 guidance bits are 2 bytes (LSB first),
        so even element 2j has bit 2j and odd element 2j+1 bit 2j+1 of that 16-bit word.

        MODE 0: write the packed codes (int64 word per block) through ``packed_ptr``. MODE 1 (guided
        QDQ): write the dequantized values instead, through ``packed_ptr`` as ``_store_out``'s OUT (x's
        dtype; bf16 as its int16 view): ``±e2m1_value(code) * div_rn(scale, gs)`` (one float32 rounding,
        then the store's), the sign from code bit 3 (-0.0 for code 8), i.e. the reference's dequantize of
        the codes MODE 0 packs."""
        b = tl.program_id(0).to(tl.int64) * BLK + tl.arange(0, BLK)
        bmask = b < NBLK
        j = tl.arange(0, 8)
        xe, xo = _load_pairs(x_ptr, b, bmask, SPLIT)
        sval = _e4m3_decode(tl.load(scale_ptr + b, mask=bmask, other=0).to(tl.int32))
        gs = tl.load(gs_ptr + (b // NBK) // GS_DIV, mask=bmask, other=1.0)
        os = _output_scale(sval, gs)[:, None]
        w = tl.load(bits_ptr + b, mask=bmask, other=0).to(tl.int32) & 0xFFFF
        be = (w[:, None] >> (2 * j[None, :])) & 1
        bo = (w[:, None] >> (2 * j[None, :] + 1)) & 1
        ce = _guided_code(tl.minimum(tl.maximum(xe * os, -6.0), 6.0), be)
        co = _guided_code(tl.minimum(tl.maximum(xo * os, -6.0), 6.0), bo)
        if MODE == 0:
            tl.store(packed_ptr + b, _block_word(ce, co, j), mask=bmask)
        else:
            factor = tl.math.div_rn(sval, gs)[:, None]
            _store_pairs(packed_ptr, b, _code_value(ce, factor), _code_value(co, factor), bmask, OUT)

    # ---- v2 kernels: one thread per 16-block (two 8-element halves), per-program global scale ----

    @triton.jit
    def _e2m1_code(p, FP: tl.constexpr):
        """E2M1 code (int32: sign << 3 | magnitude index) of a scaled float32 value ``p``, as the
        reference's ``encode_codes(clamp(p, -6, 6))``: round-to-nearest-even on |p| clamped to 6,
        sign = p's IEEE sign bit.

        FP=False: the magic add of ``_e2m1_round`` (integer ops). FP=True: the same index from float
        ops only: on a = min(|p|, 6) the index is round(2a) below 2, 4 + round(a - 2) in [2, 4] and
        6 + round((a - 4) / 2) above 4; each piece is exact (a * 2, a - 2 and a - 4 by Sterbenz, a
        halving) before ONE rounding, the add of ``2**23 + offset`` (float32 ulp 1 there, offsets
        even so ties stay even), and the pieces are monotone with the right one the smallest where
        it applies, so the index is the low 3 bits of min(pieces) (checked for every float32 in
        [0, 6] against the reference's thresholds)."""
        a = tl.minimum(tl.abs(p), 6.0)
        sgn = (p.to(tl.int32, bitcast=True) >> 28) & 8
        if FP:
            r1 = a * 2.0 + 8388608.0
            r2 = (a - 2.0) + 8388612.0
            r3 = (a - 4.0) * 0.5 + 8388614.0
            idx = tl.minimum(tl.minimum(r1, r2), r3).to(tl.int32, bitcast=True) & 7
        else:
            idx = _e2m1_index(a)
        return sgn | idx

    @triton.jit
    def _half_word(c):
        """Codes [BLK, 8] int32 of 8 consecutive elements -> their 4 packed bytes as one int32
        [BLK] (byte j = c[2j] | c[2j+1] << 4, little-endian)."""
        ce, co = tl.split(tl.reshape(c, (c.shape[0], 4, 2)))
        j = tl.arange(0, 4)
        return tl.sum((ce | (co << 4)) << (8 * j)[None, :], axis=1)

    @triton.jit
    def _tree8(v):
        """Sum of [BLK, 8] along axis 1 as the pairwise tree of adjacent pairs (8 -> 4 -> 2 -> 1)."""
        a, b = tl.split(tl.reshape(v, (v.shape[0], 4, 2)))
        s = a + b
        a, b = tl.split(tl.reshape(s, (s.shape[0], 2, 2)))
        a, b = tl.split(a + b)
        return a + b

    @triton.jit
    def _load_halves(ptr, b, bmask):
        """Elements 0..7 and 8..15 of 16-blocks ``b`` as two float32 [BLK, 8] tiles: each block half is
        one 16-byte vector for 16-bit inputs, so a thread holds whole blocks and the per-block
        reductions and scale math stay in registers."""
        return _load_halves_ev(ptr, b, bmask, "")

    @triton.jit
    def _load_halves_ev(ptr, b, bmask, EV: tl.constexpr):
        """``_load_halves`` with the L2 eviction policy EV ("" = tl.load's default, "evict_last", "evict_first";
        always given: a string constexpr default breaks triton 3.6). A re-load of the same tile under another
        policy stays a separate load (its asm differs), where a kernel reads x twice to hold fewer registers in
        between."""
        h = tl.arange(0, 8)
        off = b[:, None] * 16 + h[None, :]
        x0 = tl.load(ptr + off, mask=bmask[:, None], other=0.0, eviction_policy=EV).to(tl.float32)
        x1 = tl.load(ptr + off + 8, mask=bmask[:, None], other=0.0, eviction_policy=EV).to(tl.float32)
        return x0, x1

    @triton.jit
    def _store_halves(ptr, b, v0, v1, bmask, OUT: tl.constexpr):
        h = tl.arange(0, 8)
        off = b[:, None] * 16 + h[None, :]
        _store_out(ptr + off, v0, bmask[:, None], OUT)
        _store_out(ptr + off + 8, v1, bmask[:, None], OUT)

    @triton.jit
    def _scales_inv(vec_max, gs, inv_gs):
        """``_scales`` with the reciprocal of the global scale given (``div_rn(1, gs)``, computed once
        per program where the program has one global scale)."""
        s = gs * (vec_max * 0.16666666666666666)
        s = tl.minimum(s, 448.0)
        sval, sbyte = _e4m3_round(s)
        denom = sval * inv_gs
        safe = tl.where(denom == 0, 1.0, denom)
        os = tl.where(denom == 0, 0.0, tl.math.div_rn(tl.full(denom.shape, 1.0, tl.float32), safe))
        return sval, sbyte, os

    @triton.jit
    def _qdq_half(x, os, factor):
        """First-pass QDQ values of a [BLK, 8] tile: ±e2m1(min(|x os|, 6)) * factor (p's sign)."""
        p = x * os[:, None]
        _, r = _e2m1_round(tl.minimum(tl.abs(p), 6.0))
        v = (r * factor[:, None]).to(tl.int32, bitcast=True) | (p.to(tl.int32, bitcast=True) & -2147483648)
        return v.to(tl.float32, bitcast=True)

    @triton.jit
    def _row_gs(gs_ptr, r, bmask, GS_DIV, ROW_SCALAR: tl.constexpr, ONE_GS: tl.constexpr):
        """Global scale per block [BLK] and its reciprocal: one load and one division per program
        when the program's blocks share a scale (ONE_GS: a single scale; ROW_SCALAR: one row per
        program, ``r`` is then that row), else per block (row ``r // GS_DIV``)."""
        if ONE_GS:
            g = tl.load(gs_ptr)
            gs = tl.zeros(r.shape, tl.float32) + g
            inv = tl.zeros(r.shape, tl.float32) + tl.math.div_rn(g * 0.0 + 1.0, g)
        elif ROW_SCALAR:
            g = tl.load(gs_ptr + tl.program_id(0) // GS_DIV)
            gs = tl.zeros(r.shape, tl.float32) + g
            inv = tl.zeros(r.shape, tl.float32) + tl.math.div_rn(g * 0.0 + 1.0, g)
        else:
            gs = tl.load(gs_ptr + r // GS_DIV, mask=bmask, other=1.0)
            inv = tl.math.div_rn(tl.full(gs.shape, 1.0, tl.float32), gs)
        return gs, inv

    @triton.jit
    def _gs_from_amax(a):
        """:func:`verl_quads.nvfp4.global_scale_from_amax` of float32 ``a`` (any shape), bit for bit:
        ``div_rn(1, max(a, tiny)) * 2688`` (torch's ``2688 / a`` is reciprocal-then-multiply), 1.0 where
        that is not finite (amax 0 or denormal -> overflow; NaN). +Inf gives 0, as torch. The clamp is a
        compare-select so that a NaN stays NaN on every device (a GPU max drops NaN operands)."""
        a = tl.where(a < 1.1754943508222875e-38, 1.1754943508222875e-38, a)
        g = tl.math.div_rn(tl.full(a.shape, 1.0, tl.float32), a) * 2688.0
        return tl.where((g != g) | (g == float("inf")), 1.0, g)

    @triton.jit
    def _quant2_kernel(
        x_ptr, gs_ptr, packed_ptr, scale_ptr, out_ptr, bits_ptr, rsc_ptr, rgs_ptr,
        R, NBK, GS_DIV, BITS_RS, SC_RS, GS_RS,
        RT: tl.constexpr, CT: tl.constexpr, ONE_GS: tl.constexpr, MODE: tl.constexpr, OUT: tl.constexpr,
        FP: tl.constexpr, GSRC: tl.constexpr = 0, NG: tl.constexpr = 1, WRITE_GS: tl.constexpr = False,
        GUIDE: tl.constexpr = False, REC: tl.constexpr = False, SLOTS: tl.constexpr = 1,
    ):
        """Quantize (MODE 0: packed int64 word + E4M3 byte per block) or QDQ (MODE 1) of x viewed as
        [R, NBK, 16]; program (i, j) handles rows i*RT.. (RT of them) x blocks j*CT.. (CT of them).
        FP: ``_e2m1_code``'s float formulation.

        Global scale of row r (GSRC): 0: gs[r // GS_DIV] (ONE_GS: gs[0] for all), float32. 1:
        ``_gs_from_amax`` of amax[r // GS_DIV] (ONE_GS: of the max of amax[0..NG), NaN if any is NaN: a
        fused group's shared scale), amax in any float dtype. 2: ``_gs_from_amax`` of the row's own
        max |x|, computed here (the launch gives each program whole rows: CT >= NBK); the max is taken
        on the magnitudes' bit patterns (integer order = float order for |x|, NaN above Inf, so a NaN
        row gets scale 1.0 as torch's amax + nan_to_num give it). WRITE_GS (GSRC 1, 2, MODE 0, which
        has no QDQ output): also store the float32 global scale of each row's entry through out_ptr
        (at r // GS_DIV; 0 if ONE_GS; r for GSRC 2). GUIDE (MODE 0): also store each block's TRACE guidance bits
        (the low bit of its 16 codes, element j in bit j: :func:`verl_quads.nvfp4.guidance.extract_guidance`'s
        bytes) as one int16 through bits_ptr, row r's block c at ``(r // SLOTS) * BITS_RS + (r % SLOTS) * NBK + c``
        (int16 units; contiguous bits: SLOTS 1, BITS_RS = NBK). REC (GUIDE): the record's block scale bytes and
        global scales too, through rsc_ptr (uint8, token row stride SC_RS) and rgs_ptr (float32, one per row r
        at ``(r // SLOTS) * GS_RS + r % SLOTS``): a record laid out in TRACE's token rows (SLOTS rows of x per
        token: the routed slots of ``mlp.experts.w2``), written here instead of copied there afterwards."""
        i = tl.arange(0, RT * CT)
        r = tl.program_id(0) * RT + i // CT
        c = tl.program_id(1) * CT + i % CT
        bmask = (r < R) & (c < NBK)
        b = r.to(tl.int64) * NBK + c
        x0, x1 = _load_halves(x_ptr, b, bmask)
        if GSRC == 0:
            gs, inv = _row_gs(gs_ptr, r, bmask, GS_DIV, RT == 1, ONE_GS)
        else:
            if GSRC == 1:
                if ONE_GS:
                    gi = r * 0
                else:
                    gi = r // GS_DIV
                a = tl.load(gs_ptr + gi, mask=bmask, other=0.0).to(tl.float32)
                nan = a != a
                for t in tl.static_range(1, NG):
                    at = tl.load(gs_ptr + gi + t, mask=bmask, other=0.0).to(tl.float32)
                    nan = nan | (at != at)
                    a = tl.where(at > a, at, a)
                a = tl.where(nan, float("nan"), a)
            else:
                gi = r
                ab = tl.maximum(tl.max(tl.abs(x0).to(tl.int32, bitcast=True), axis=1),
                                tl.max(tl.abs(x1).to(tl.int32, bitcast=True), axis=1))
                rmax = tl.max(tl.reshape(ab, (RT, CT)), axis=1)
                a = tl.reshape(tl.broadcast_to(rmax[:, None], (RT, CT)), (RT * CT,)).to(tl.float32, bitcast=True)
            gs = _gs_from_amax(a)
            inv = tl.math.div_rn(tl.full(gs.shape, 1.0, tl.float32), gs)
            if WRITE_GS:
                tl.store(out_ptr + gi, gs, mask=bmask & (i % CT == 0))
        vec_max = tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1))
        sval, sbyte, os = _scales_inv(vec_max, gs, inv)
        if MODE == 1:
            factor = tl.math.div_rn(sval, gs)
            _store_halves(out_ptr, b, _qdq_half(x0, os, factor), _qdq_half(x1, os, factor), bmask, OUT)
        else:
            w0 = _half_word(_e2m1_code(x0 * os[:, None], FP))
            w1 = _half_word(_e2m1_code(x1 * os[:, None], FP))
            word = (w1.to(tl.int64) << 32) | (w0.to(tl.int64) & 0xFFFFFFFF)
            tl.store(packed_ptr + b, word, mask=bmask)
            tl.store(scale_ptr + b, sbyte.to(tl.uint8), mask=bmask)
            if GUIDE:  # element e's code is nibble e of the word: gather bit 4e to bit e by halving strides
                g = word & 0x1111111111111111
                g = (g | (g >> 3)) & 0x0303030303030303
                g = (g | (g >> 6)) & 0x000F000F000F000F
                g = (g | (g >> 12)) & 0x000000FF000000FF
                g = (g | (g >> 24)) & 0xFFFF
                tok = (r // SLOTS).to(tl.int64)
                slot = r % SLOTS
                tl.store(bits_ptr + tok * BITS_RS + slot * NBK + c, g.to(tl.int16), mask=bmask)
                if REC:
                    tl.store(rsc_ptr + tok * SC_RS + slot * NBK + c, sbyte.to(tl.uint8), mask=bmask)
                    tl.store(rgs_ptr + tok * GS_RS + slot, gs, mask=bmask & (c == 0))

    @triton.jit
    def _bits_threshold(eb, NSEL, NVALID):
        """Selection threshold of a row's score bits ``eb`` [N] int32 (non-negative for the NVALID real entries,
        -1 for padding): returns (th, cnt = #(eb >= th)). MSB first, step k accepts bit 30 - k when #(eb >= th |
        bit) >= NSEL, and the search stops as soon as the count of th is exactly NSEL (then the selection is
        ``eb >= th``: the NSEL highest scores); else, after the last bit, th = T, the largest value with #(eb >= T)
        >= NSEL, and the caller breaks the ties at T. NSEL = 0 stops at the first th no entry reaches. The
        early-stopped search of ``_residual_tiled_kernel`` (block scores) and of ``triton_channel._channel_row_kernel``
        (channel scores).

        Channel rule: bf16 inputs repeat R**2 values, so the count at T is rarely exact and the search usually
        runs all the way (numpy on the bench's rows: 26-31 of 31 bit steps). Fewer steps measured SLOWER on the H200
        (docs/bench_nvfp4_h200_channel_s6.txt): an exit once the candidates left are one value (~15 steps; 81 vs 68 us
        at 4096x2048), two bits per step with three counts in one reduction (16 steps; 81 vs 68 us), 8-bit digits by
        ``tl.histogram`` (<= 4 steps; 125 vs 76 us). The longer steps cost more than the barriers they save."""
        th = tl.full((), 0, tl.int32)  # a scalar without a reduction
        cnt = th + NVALID
        k = th
        while (k < 31) & (cnt != NSEL):
            cand = th | (1 << (30 - k))
            c = tl.sum((eb >= cand).to(tl.int32), axis=0)
            take = c >= NSEL
            th = tl.where(take, cand, th)
            cnt = tl.where(take, c, cnt)
            k += 1
        return th, cnt

    @triton.jit
    def _tile_qdq(x_ptr, b, m, gs, inv):
        """First pass of 16-blocks ``b`` ([CT] int64 indices in the block layout, mask ``m``) under the
        row's global scale ``gs`` [CT] and its reciprocal ``inv``: returns x's halves (float32 [CT, 8]),
        E4M3 scale bytes (int32 [CT]), output scales [CT] and the QDQ halves (float32 [CT, 8]), the latter by
        ``_hold_qdq_half``'s fused E2M1 magic (FAST; same values as ``_qdq_half``)."""
        x0, x1 = _load_halves(x_ptr, b, m)
        vec_max = tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1))
        sval, sbyte, os = _scales_inv(vec_max, gs, inv)
        factor = tl.math.div_rn(sval, gs)
        return x0, x1, sbyte, os, _hold_qdq_half(x0, os, factor, True), _hold_qdq_half(x1, os, factor, True)

    @triton.jit
    def _tile_word(x0, x1, os):
        """Packed E2M1 codes of [CT] blocks (halves x0, x1 float32 [CT, 8], output scales os [CT]) as one
        int64 word per block (low nibble of byte j = element 2j)."""
        w0 = _half_word(_e2m1_code(x0 * os[:, None], False))
        w1 = _half_word(_e2m1_code(x1 * os[:, None], False))
        return (w1.to(tl.int64) << 32) | (w0.to(tl.int64) & 0xFFFFFFFF)

    @triton.jit
    def _tile_second(x_ptr, b, m, gs, inv, gs2, inv2):
        """First pass, residual and second-pass scales of 16-blocks ``b`` (see ``_tile_qdq``): returns the
        QDQ halves v0, v1, residual halves r0, r1 (float32 [CT, 8]) and the residual's E4M3 scale value,
        byte and output scale [CT] under the row's second-pass global scale gs2 (reciprocal inv2)."""
        x0, x1, _, os, v0, v1 = _tile_qdq(x_ptr, b, m, gs, inv)
        r0 = x0 - v0
        r1 = x1 - v1
        ra = tl.maximum(tl.max(tl.abs(r0), axis=1), tl.max(tl.abs(r1), axis=1))
        s2, sb2, os2 = _scales_inv(ra, gs2, inv2)
        return v0, v1, r0, r1, s2, sb2, os2

    @triton.jit
    def _tiled_first(x_ptr, w_ptr, out_ptr, packed1_ptr, scale1_ptr, row, t, NB, gs, inv, ebits, ram,
                     CT: tl.constexpr, NTP: tl.constexpr, HAS_W: tl.constexpr, PACK: tl.constexpr,
                     OUT: tl.constexpr):
        """Step 1 of ``_residual_tiled_kernel`` for tile ``t`` of the row: returns ``ebits`` / ``ram``
        ([NTP, CT] int32 score bits / float32 residual amax) with row ``t`` filled in."""
        ci = tl.arange(0, CT)
        c = t * CT + ci
        cmask = c < NB
        b = row * NB + c
        x0, x1, sbyte, os, v0, v1 = _tile_qdq(x_ptr, b, cmask, gs, inv)
        if PACK:
            tl.store(packed1_ptr + b, _tile_word(x0, x1, os), mask=cmask)
            tl.store(scale1_ptr + b, sbyte.to(tl.uint8), mask=cmask)
        if not PACK:  # Q(x) of every block; the gather walk overwrites the selected ones
            _store_halves(out_ptr, b, v0, v1, cmask, OUT)
        r0 = x0 - v0
        r1 = x1 - v1
        s0 = r0 * r0
        s1 = r1 * r1
        if HAS_W:
            wv0, wv1 = _load_halves(w_ptr, c, cmask)
            s0 = s0 * wv0
            s1 = s1 * wv1
        e = (_tree8(s0) + _tree8(s1)).to(tl.int32, bitcast=True)
        ra = tl.maximum(tl.max(tl.abs(r0), axis=1), tl.max(tl.abs(r1), axis=1))
        here = tl.arange(0, NTP)[:, None] == t
        ebits = tl.where(here & cmask[None, :], e[None, :], ebits)
        ram = tl.where(here, ra[None, :], ram)
        return ebits, ram

    @triton.jit
    def _residual_tiled_kernel(
        x_ptr, gs_ptr, w_ptr, out_ptr, packed1_ptr, scale1_ptr, packed2_ptr, scale2_ptr, idx_ptr, gs2_ptr,
        NB, NSEL, GS_DIV,
        NTP: tl.constexpr, CT: tl.constexpr, HAS_W: tl.constexpr, PACK: tl.constexpr, OUT: tl.constexpr,
        STOP: tl.constexpr = 0,
    ):
        """Per-token QUADS residual compensation ("gather" kernel), one program per row of x [M, K] (NB = K / 16
        blocks) walking the row in tiles of CT blocks, so only a tile's data is in registers:

        1. per tile (``_tiled_first``): first pass (PACK: its codes and scales are written here; QDQ: Q(x) of every
           block is written here), residual, per-block score (``_tree8`` of the halves = the reference's pairwise
           order) and residual amax, kept for the whole row as [NTP, CT] vectors (NTP * CT >= NB, a power of two);
        2. the row's NSEL highest scores (ties to the lower block index): the early-stopped bitwise threshold
           search ``_bits_threshold`` (MSB first; stops once the count of the accepted prefix P is exactly NSEL,
           then the blocks >= P are the top NSEL) and ``_select_top`` (blocks above T, and of those equal to T the
           first NSEL - #(above T) in index order, a cumulative count; skipped when the stopped search already
           counts exactly NSEL); the row's second-pass global scale from the selected blocks' residual amax; the
           selected block indices are written (``idx_ptr``: the result's [M, NSEL] int64 when PACK, else an int32
           scratch [M, NSEL]);
        3. after a CTA barrier (the indices were written by other threads of this program) the selected blocks
           only, read back in chunks of CT (the row was just read: served by L2): first-pass QDQ and residual
           recomputed, Q(R); PACK: their words / scale bytes at their slot, else Q(x) + Q(R) (float32 sum, one
           cast) over the Q(x) written in step 1.

        The E2M1 rounding is ``_hold_qdq_half``'s fused magic (FAST: same values as ``_qdq_half``). Session 10
        removed the measured-slower speed options (radix-4 search, pipelined walks, the non-early search, the
        non-fast rounding, the all-blocks second walk "tiled", the one-walk ``_residual_hold_kernel``):
        docs/history/nvfp4_kernels.md.

        STOP (timing probe of ``bench nvfp4 --residual-probe`` only; QDQ launches; 0 = the kernel): return after
        step 1 (1), the threshold search (2), or the selection and its index store (3), storing one value per row that
        depends on the phase (``idx_ptr``'s row: NOT a result)."""
        row = tl.program_id(0).to(tl.int64)
        ci = tl.arange(0, CT)
        g = tl.load(gs_ptr + row // GS_DIV)
        gs = tl.zeros([CT], tl.float32) + g
        inv = tl.zeros([CT], tl.float32) + tl.math.div_rn(g * 0.0 + 1.0, g)
        ebits = tl.full([NTP, CT], -1, tl.int32)
        ram = tl.zeros([NTP, CT], tl.float32)
        nt = tl.cdiv(NB, CT)
        for t in tl.range(0, nt):
            ebits, ram = _tiled_first(x_ptr, w_ptr, out_ptr, packed1_ptr, scale1_ptr, row, t, NB, gs, inv, ebits, ram,
                                      CT, NTP, HAS_W, PACK, OUT)
        eb = tl.reshape(ebits, (NTP * CT,))
        if STOP == 1:
            tl.store(idx_ptr + row * NSEL, tl.max(eb, axis=0) + tl.max(tl.reshape(ram, (NTP * CT,)), axis=0).to(tl.int32))
            return
        # padding: bits -1, never counted nor selected
        th, _ = _bits_threshold(eb, NSEL, tl.sum((eb >= 0).to(tl.int32), axis=0))
        if STOP == 2:
            tl.store(idx_ptr + row * NSEL, th)
            return
        sel = _select_top(eb, th, NSEL)
        amax = tl.max(tl.where(sel, tl.reshape(ram, (NTP * CT,)), 0.0), axis=0)
        a = tl.maximum(amax, 1.1754943508222875e-38)
        g2 = tl.math.div_rn(a * 0.0 + 1.0, a) * 2688.0
        g2 = tl.where(g2 == float("inf"), 1.0, g2)
        gs2 = tl.zeros([CT], tl.float32) + g2
        inv2 = tl.zeros([CT], tl.float32) + tl.math.div_rn(g2 * 0.0 + 1.0, g2)
        fi = tl.arange(0, NTP * CT)
        slot = tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(idx_ptr + row * NSEL + slot, fi, mask=sel)  # cast to idx_ptr's int64 / int32
        if PACK:
            tl.store(gs2_ptr + row, g2)
        if STOP == 3:
            tl.store(idx_ptr + row * NSEL, tl.sum(sel.to(tl.int32), axis=0) + g2.to(tl.int32))
            return
        tl.debug_barrier()
        for s0 in tl.range(0, NSEL, CT):
            sl = s0 + ci
            smask = sl < NSEL
            blk = tl.load(idx_ptr + row * NSEL + sl, mask=smask, other=0)
            b = row * NB + blk
            v0, v1, r0, r1, s2, sb2, os2 = _tile_second(x_ptr, b, smask, gs, inv, gs2, inv2)
            if PACK:
                tl.store(packed2_ptr + row * NSEL + sl, _tile_word(r0, r1, os2), mask=smask)
                tl.store(scale2_ptr + row * NSEL + sl, sb2.to(tl.uint8), mask=smask)
            else:
                f2 = tl.math.div_rn(s2, gs2)
                _store_halves(out_ptr, b, v0 + _hold_qdq_half(r0, os2, f2, True),
                              v1 + _hold_qdq_half(r1, os2, f2, True), smask, OUT)

    @triton.jit
    def _hold_qdq_half(x, os, factor, FAST: tl.constexpr):
        """``_qdq_half`` (same values); FAST: the magic of ``_e2m1_round`` as ``max(e + 0x0B000000, 0x4A800000)``
        (add before max: one fused VIADDMNMX on sm_90 instead of max + add; the same integer for every
        a = min(|p|, 6) in [0, 6], so the same value; only a NaN a differs, whose value is NaN both ways)."""
        p = x * os[:, None]
        if FAST:
            a = tl.minimum(tl.abs(p), 6.0)
            mb = tl.maximum((a.to(tl.int32, bitcast=True) & 0x7F800000) + 0x0B000000, 0x4A800000)
            magic = mb.to(tl.float32, bitcast=True)
            r = (a + magic) - magic
        else:
            _, r = _e2m1_round(tl.minimum(tl.abs(p), 6.0))
        v = (r * factor[:, None]).to(tl.int32, bitcast=True) | (p.to(tl.int32, bitcast=True) & -2147483648)
        return v.to(tl.float32, bitcast=True)

    @triton.jit
    def _tie_select(eb, th, NSEL):
        """Selected blocks (bool [N]) of score bits ``eb`` [N] at threshold ``th``: all above it and, of
        those equal to it, the first NSEL - #(above) in index order (the rule of ``_residual_tiled_kernel``)."""
        gt = eb > th
        eq = eb == th
        need = NSEL - tl.sum(gt.to(tl.int32), axis=0)
        return gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= need))

    @triton.jit
    def _select_top(eb, th, NSEL):
        """:func:`_tie_select` of the early-stopped search's threshold ``th`` (``_bits_threshold``): when exactly
        NSEL scores are >= th (the early stop's usual case) those are the selection and the tie scan is skipped
        (same blocks; FAST)."""
        ge = eb >= th
        if tl.sum(ge.to(tl.int32), axis=0) == NSEL:
            sel = ge
        else:
            sel = _tie_select(eb, th, NSEL)
        return sel

#: Blocks (of 16 elements) per program, warps, and the load style of ``_load_pairs`` for the
#: elementwise kernels. Tuned on the H200 by ``verl-quads bench nvfp4 --sweep``.
TILE_CONFIG = {"blocks": 128, "num_warps": 2, "split": True}

#: Which kernel serves each entry point (all produce the reference's bytes; the choice is speed only):
#: quantize / fake_quantize: "v1" = ``_quant_kernel`` (a block's 16 elements spread over threads,
#: TILE_CONFIG) or "v2" = ``_quant2_kernel`` (one thread per block, global scale and its reciprocal
#: once per program, QUANT2_CONFIG); residual_per_token (per-row global scale): "row" =
#: ``_residual_row_kernel`` (whole row in registers, ROW_CONFIG), "gather" = ``_residual_tiled_kernel`` (row
#: walked in tiles, second walk over the selected blocks only; TILED_CONFIG["gather"]), "auto" (the
#: ``RESIDUAL_BY_BLOCKS`` variant of the gather kernel for the row's padded block count: the default) or
#: "gluon" (:mod:`.gluon_residual`: the row staged in shared
#: memory, bf16 QDQ only, per-row global scale, no score_weight; Gluon on a CUDA GPU, else a RuntimeError saying why:
#: an explicit choice never falls back; "auto" takes it where GLUON_RESIDUAL_AUTO says and it can run) -- see
#: RESIDUAL_PER_TOKEN_CHOICES ("tiled" and "hold" were removed in session 10: measured slower). ``verl-quads bench
#: nvfp4`` times every variant side by side; the defaults
#: are its H200 winners (docs/bench_nvfp4_h200_session3.txt: 8192x8192 quantize v2 76% of copy BW vs
#: v1 66%; per-token residual QDQ k=0.5 gather 2.4x plain QDQ vs row 4.8x). "bf16_store":
#: how v2 / tiled / gather write bfloat16 outputs on a GPU: "native" (one conversion instruction) or
#: "int" (integer rounding, as v1 and always under the interpreter, whose cast truncates).
KERNELS = {"quantize": "v2", "fake_quantize": "v2", "residual_per_token": "auto", "bf16_store": "native"}

#: The allowed values of ``KERNELS["residual_per_token"]`` (anything else is a ValueError naming these).
RESIDUAL_PER_TOKEN_CHOICES = ("auto", "gather", "row", "gluon")

#: ``_quant2_kernel``: 16-blocks per program, warps, and the float formulation of the E2M1 index
#: (``_e2m1_code`` FP=True) for quantize; tuned by ``verl-quads bench nvfp4 --sweep`` (values below:
#: its H200 choice, session 3; quantize's matched the SASS-count guess). SASS counts (bf16, per-row scale; Triton 3.9 on CPU, no GPU timing yet): instructions
#: per element v1 quantize 30.5 (128 blocks, 2 warps), v2 quantize 21.2 (512 blocks, 4 warps, integer
#: E2M1; 25.0 with the float one), v2 QDQ 19.6 (bf16 written by cvt.rn).
QUANT2_CONFIG = {"quantize": {"blocks": 512, "num_warps": 4, "fp": False}, "qdq": {"blocks": 256, "num_warps": 8}}

#: ``_residual_tiled_kernel`` ("gather"): 16-blocks per tile and warps per row program; rows longer than
#: ``max_blocks`` blocks use the multi-kernel path.
# "gather" early=True: H200 2026-11-30 (docs/bench_nvfp4_h200_residual_variants_s4.txt), same bytes, k=0.5 bf16
# residual QDQ 176 -> 151 us at 8192x8192, 28.2 -> 22.1 us at 4096x2048. The default ("auto") picks tile / warps
# per row length from RESIDUAL_BY_BLOCKS (session 5). Since session 10 the kernel always runs the early-stopped
# search and the FAST rounding / selection (every default did), so plain "gather" is "gather-early-fast".
TILED_CONFIG = {"gather": {"tile_blocks": 64, "num_warps": 2}, "max_blocks": 8192}

#: Named speed variants of the gather per-token residual kernel (kernel, TILED_CONFIG overrides): the ones
#: RESIDUAL_BY_BLOCKS uses, all bit-identical to the torch reference (tests/unit/test_nvfp4_triton.py,
#: tests/gpu/test_nvfp4_gpu.py); timed side by side by ``python -m verl_quads.bench.nvfp4 --residual-variants``.
# Removed in session 10 (never a default, measured slower on the H200 -- bf16 residual QDQ us at k=0.5, H200,
# docs/bench_nvfp4_h200_residual_variants_s4.txt / _s5.txt -- with the kernel options only they used):
#   "gather" (full 31-step search): 176 vs 151 (gather-early) at 8192x8192, 28.2 vs 22.1 at 4096x2048 (s4);
#   "gather-radix4" (radix-4 search): 278 / 36.7 (s4); "gather-early-stages2" (pipelined walks): 180 / 26.5 (s4);
#   "tiled" (second walk over every block): 192 / 31.2; "tiled-early-stages2": 192 / 28.7 (s4);
#   "gather-early-t64w1": 181 / 22.1; "-t128w2": 156 / 30.7; "-t256w4": 170 / 33.0 (s4; the defaults 142 / 19.3);
#   the non-FAST twins of the defaults, "gather-early" (t64w2) 152 vs 145, "gather-early-t128w4" 148 vs 142 at
#   8192x8192, "gather-early-t32w1" 20.3 vs 19.3 at 4096x2048 and 125 vs 119 at 32768x2048 (s5; the one point where
#   a non-FAST twin measured faster: packed residual_quantize at 32768x2048, t32w1 138-139 vs t32w1-fast 143 us);
#   "hold-b2-fast" / "hold-b4-fast" (``_residual_hold_kernel``: one walk, the row in registers): 229 / 239 vs 142 at
#   8192x8192, 22.1 / 21.8 vs 19.3 at 4096x2048, 150 / 135 vs 119 at 32768x2048 (s5).
# Tried and removed earlier (session 8, H200, docs/bench_nvfp4_h200_residual_probe_s8.txt, bytes == default): L2
# eviction hints (x evict_last in the first walk, evict_first in the gather walk) 142 -> 140 us at 8192x8192 k=0.5,
# 32.2 -> 32.2 / 19.5 -> 19.5 at 4096x2048; reusing the search's counts (two reductions fewer) 142 -> 146 / 19.5 -> 19.0
RESIDUAL_VARIANTS = {
    "gather-early-fast": ("gather", {}),
    # one warp per row: every reduction is warp shuffles only (no shared memory, no CTA barrier in the search)
    "gather-early-t32w1-fast": ("gather", {"tile_blocks": 32, "num_warps": 1}),
    "gather-early-t128w4-fast": ("gather", {"tile_blocks": 128, "num_warps": 4}),
}


#: ``KERNELS["residual_per_token"] == "auto"``: the RESIDUAL_VARIANTS entry that serves a row of ``nbp`` padded
#: 16-blocks: the first (largest nbp, name) with nbp <= largest (None: any length). All variants give the same
#: bytes; this is the measured fastest per row length.
# H200 2026-11-30 session 5 (docs/bench_nvfp4_h200_residual_variants_s5.txt, second run; bf16 residual QDQ us at
# k=0.5, same bytes, the default before this rule = gather-early t64w2): 64 blocks (4096x1024) t32w1-fast 11.2 vs
# 17.9; 128 (4096x2048) t32w1-fast 19.3 vs 22.1, (32768x2048) 119 vs 144; 256 (4096x4096) gather-early-fast 40.5 vs
# 42.9; 512 (8192x8192) t128w4-fast 142 vs 151. Longer rows: gather-early-fast (not timed; its GPU bit-exact test
# passed at K=16384). FAST is 3-4% slower than plain t32w1 for the packed residual_quantize at 32768x2048 (143 vs
# 138 us) and faster at every other measured point.
RESIDUAL_BY_BLOCKS = ((128, "gather-early-t32w1-fast"), (256, "gather-early-fast"), (512, "gather-early-t128w4-fast"),
                      (None, "gather-early-fast"))


#: ``KERNELS["residual_per_token"] == "auto"``: padded 16-blocks per row -> the fewest rows from which the Gluon kernel
#: (:mod:`.gluon_residual`, the row staged in shared memory) serves the QDQ, where it can: bf16, per-row global scale,
#: no score_weight, Gluon runs (``gluon_residual.check_supported``); else (and for the packed residual_quantize, which
#: it does not write) the RESIDUAL_BY_BLOCKS variant. Same bytes either way (tests/gpu/test_residual_gluon_gpu.py).
# H200 session 10 (CUDA-graph us, bytes checked against the default first; plain QDQ 71.9 / 68.7): call 3 at b506982
# 8192x8192 k=0.5 131 vs 142 (t128w4-fast; 1.82x vs 1.97x plain QDQ), k=0.25 109 vs 123; call 2 at 0977c5c 32768x2048
# k=0.5 109 vs 121 (t32w1-fast), k=0.25 95.7 vs 104. GPU tests of this path passed in call 3 (2 passed: 8192x8192 and
# 32768x2048 bytes == torch reference). Not taken where not measured faster: 4096x2048 (an earlier form of the
# kernel 20.7-22 vs 19.2), 4096x4096 (41-42 vs 40.8), fewer rows (not timed).
GLUON_RESIDUAL_AUTO = {512: 8192, 128: 32768}


def gluon_residual_measured_on(capability: tuple[int, int]) -> bool:
    """Whether GLUON_RESIDUAL_AUTO's entries hold on a GPU of this compute ``capability``: only where they were
    measured (the H200, sm_90). Elsewhere "auto" keeps the Triton kernels; an explicit "gluon" still runs."""
    return tuple(capability) == (9, 0)


def _auto_gluon(x: torch.Tensor, gs: torch.Tensor, w, nbp: int, packed: bool, stop: int) -> bool:
    """Whether the "auto" per-token path runs the Gluon kernel (GLUON_RESIDUAL_AUTO, a GPU where it was measured
    (:func:`gluon_residual_measured_on`) and what it can run)."""
    rows = GLUON_RESIDUAL_AUTO.get(nbp)
    if rows is None or packed or stop or x.shape[0] < rows or not x.is_cuda:
        return False
    if not gluon_residual_measured_on(di.capability(x.device)):
        return False
    from verl_quads.nvfp4 import gluon_residual as gr

    return gr.check_supported(x, gs, w) is None


def _auto_residual_variant(nbp: int) -> str:
    for most, name in RESIDUAL_BY_BLOCKS:
        if most is None or nbp <= most:
            return name
    raise ValueError(f"RESIDUAL_BY_BLOCKS has no entry for rows of {nbp} padded 16-blocks: {RESIDUAL_BY_BLOCKS}")


@contextlib.contextmanager
def residual_variant(name: str):
    """Run the per-token residual path as ``RESIDUAL_VARIANTS[name]`` (KERNELS and TILED_CONFIG restored after)."""
    kern, over = RESIDUAL_VARIANTS[name]
    old_k, old_c = KERNELS["residual_per_token"], TILED_CONFIG[kern]
    KERNELS["residual_per_token"] = kern
    TILED_CONFIG[kern] = dict(old_c, **over)
    try:
        yield
    finally:
        KERNELS["residual_per_token"] = old_k
        TILED_CONFIG[kern] = old_c


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, TILE_CONFIG["blocks"]),)


def _gs_rows(gs: torch.Tensor, lead: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """Global scales as a flat float32 vector plus GS_DIV, the number of consecutive rows of the
    2-D view that share one entry. Scalar, per-row and per-leading-prefix (e.g. per expert
    [E, 1, 1]) scales need no copy; any other broadcast pattern is expanded per row."""
    rows = 1
    for d in lead:
        rows *= d
    if gs.numel() == 1:
        return gs.reshape(1).contiguous(), max(rows, 1)
    g = gs.reshape(gs.shape[:-1])  # drop the trailing 1
    # leading dims of gs equal to x's, then only 1s: entries are per prefix of rows
    n = 0
    while n < len(lead) and g.shape[n] == lead[n]:
        n += 1
    if all(d == 1 for d in g.shape[n:]) and n > 0:
        per = rows // math.prod(lead[:n])
        return g.reshape(-1).contiguous(), per
    return gs.expand(*lead, 1).reshape(-1).contiguous(), 1


def _out_arg(out: torch.Tensor) -> torch.Tensor:
    """bf16 outputs are written as int16 bit patterns (see ``_store_out``)."""
    return out.view(torch.int16) if out.dtype == torch.bfloat16 else out


class _RecordTarget:
    """Where ``_quant2_kernel`` (GUIDE) writes a guidance record of x's ``rows`` rows of ``nbk`` blocks: bits as
    int16 ``bits`` (one per block), row r's block c at ``(r // slots) * bits_rs + (r % slots) * nbk + c``; with
    ``scale`` / ``gs`` (REC) also the block scale bytes (uint8, token stride ``sc_rs``) and the float32 global
    scale of each row (``(r // slots) * gs_rs + r % slots``). Built by :func:`_record_target`."""

    __slots__ = ("bits", "scale", "gs", "bits_rs", "sc_rs", "gs_rs", "slots")

    def __init__(self, bits, scale, gs, bits_rs: int, sc_rs: int, gs_rs: int, slots: int) -> None:
        self.bits, self.scale, self.gs = bits, scale, gs
        self.bits_rs, self.sc_rs, self.gs_rs, self.slots = bits_rs, sc_rs, gs_rs, slots


def _record_target(out: GuidanceRecord, x: torch.Tensor) -> _RecordTarget:
    """The kernel's view of ``out``, a record to fill for x (layouts: :func:`~verl_quads.nvfp4.guidance.
    check_record_out`, which raises on anything else)."""
    lead = check_record_out(out, x)
    if out.bits.stride(0) % 2 or out.bits.data_ptr() % 2:
        raise ValueError(f"NVFP4 guidance output: record.bits rows must start at even byte addresses (the kernel "
                         f"writes 2 bytes per block); row stride {out.bits.stride(0)}")
    slots = lead[1] if len(lead) == 2 else 1
    return _RecordTarget(out.bits.view(torch.int16), out.block_scale.view(torch.uint8), out.global_scale,
                         out.bits.stride(0) // 2, out.block_scale.stride(0), out.global_scale.stride(0), slots)


def _quant2(xc, g, div, a0, a1, a2, k, mode: int, out: int, gsrc: int = 0, ng: int = 1, gs_out=None,
            rec: _RecordTarget | None = None) -> None:
    """Launch ``_quant2_kernel`` on contiguous ``xc`` ``[..., K]`` (rows = numel / K): MODE 0 writes
    packed words ``a0`` (int64 view) and scale bytes ``a1``; MODE 1 the QDQ into ``a2``. ``gsrc``/``ng``:
    the kernel's GSRC/NG (``g`` holds global scales, amaxes, or nothing for 2); ``gs_out`` (MODE 0
    only, passed in a2's place): float32 buffer for the global scales the kernel derives (GSRC 1, 2),
    or None. GSRC 2 needs whole rows per program (:func:`_row_amax_fits`). ``rec`` (MODE 0 only): where the
    TRACE guidance bits of the codes go (GUIDE; with its ``scale`` also the record's scales: REC), or None."""
    assert gs_out is None or mode == 0
    assert rec is None or mode == 0
    cfg = QUANT2_CONFIG["quantize" if mode == 0 else "qdq"]
    nbk = k // BLOCK_SIZE
    rows = xc.numel() // k
    ct = min(cfg["blocks"], _pow2(nbk))
    rt = cfg["blocks"] // ct
    if rec is None:
        bits, rsc, rgs, bits_rs, sc_rs, gs_rs, slots, full = a1, a1, a1, 0, 0, 0, 1, False
    else:
        bits, rsc, rgs, slots = rec.bits, rec.scale, rec.gs, rec.slots
        bits_rs, sc_rs, gs_rs, full = rec.bits_rs, rec.sc_rs, rec.gs_rs, rec.scale is not None
        if not full:
            rsc = rgs = a1
    # plain integer grid math: triton.cdiv / next_power_of_2 are jit-callable objects (host time per call)
    _quant2_kernel[(-(-rows // rt), -(-nbk // ct))](
        xc, g, a0, a1, a2 if gs_out is None else gs_out, bits, rsc, rgs, rows, nbk, div, bits_rs, sc_rs, gs_rs,
        RT=rt, CT=ct, ONE_GS=gsrc != 2 and g.numel() == ng, MODE=mode, OUT=out, FP=cfg.get("fp", False),
        GSRC=gsrc, NG=ng, WRITE_GS=gs_out is not None, GUIDE=rec is not None, REC=full, SLOTS=slots,
        num_warps=cfg["num_warps"], enable_fp_fusion=False)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length()


def _row_amax_fits(k: int, mode: int) -> bool:
    """Whether one ``_quant2_kernel`` program holds whole rows of length ``k`` (GSRC 2 possible)."""
    return _pow2(k // BLOCK_SIZE) <= QUANT2_CONFIG["quantize" if mode == 0 else "qdq"]["blocks"]


def _out_code(x: torch.Tensor) -> int:
    """``_store_out``'s OUT for the v2 / tiled / gather kernels' output in x's dtype (see KERNELS["bf16_store"])."""
    if x.dtype == torch.bfloat16 and x.is_cuda and KERNELS["bf16_store"] == "native":
        return 3
    return _OUT_DTYPES[x.dtype]


def _launch(kernel, grid, *args, **meta):
    kernel[grid](*args, enable_fp_fusion=False, num_warps=TILE_CONFIG["num_warps"], BLK=TILE_CONFIG["blocks"],
                 SPLIT=TILE_CONFIG["split"], **meta)


def _prepare(x: torch.Tensor, global_scale, check_finite: bool, row_scale: bool = False):
    """Checks of x (and of ``global_scale``), x contiguous, and the global scale: ``global_scale`` itself, the
    tensor's from its amax (None), or with ``row_scale`` None: each row's scale is derived inside the kernel
    (``per_row_global_scale(x)`` for an empty x, where nothing launches)."""
    check_available(x)
    validate_input(x, check_finite=check_finite)
    if row_scale:
        gs = per_row_global_scale(x) if x.numel() == 0 else None
    elif global_scale is None:
        gs = global_scale_from_amax(x.abs().amax() if x.numel() else torch.tensor(0.0)).to(x.device)
    elif check_finite:
        gs = _check_global_scale(global_scale, x)
    else:  # hot path: shape/dtype checks only (no device sync)
        gs = global_scale if isinstance(global_scale, torch.Tensor) else torch.tensor(float(global_scale))
        if gs.dtype != torch.float32 or gs.dim() not in (0, x.dim()) or (gs.dim() and gs.shape[-1] != 1):
            _check_global_scale(gs, x)  # raises the full message
    return gs, x.contiguous()


def _amax_source(x: torch.Tensor, xc: torch.Tensor, am, ng: int, mode: int, want_gs: bool):
    """(g, div, gsrc, ng, gs_out) for ``_quant2`` with the global scale derived in the kernel, or None
    when this ``amax`` needs the torch route (a broadcast pattern whose entries are not one per prefix of
    rows, when the scales must be returned)."""
    lead = tuple(x.shape[:-1])
    if isinstance(am, str):  # per row, computed in the kernel when a program holds whole rows
        gs_out = torch.empty(*lead, 1, dtype=torch.float32, device=x.device) if want_gs else None
        if _row_amax_fits(x.shape[-1], mode):
            return xc, 1, 2, 1, gs_out
        am = torch.linalg.vector_norm(xc, ord=float("inf"), dim=-1, keepdim=True)  # one read, == abs().amax()
    if ng > 1:
        return am, 1, 1, ng, torch.empty((), dtype=torch.float32, device=x.device) if want_gs else None
    g, div = _gs_rows(am, lead)
    if want_gs and g.numel() != am.numel():
        return None
    return g, div, 1, 1, torch.empty(am.shape, dtype=torch.float32, device=x.device) if want_gs else None


def _prepare_amax(x: torch.Tensor, global_scale, amax, check_finite: bool, mode: int):
    """Common entry of :func:`quantize` / :func:`fake_quantize`: returns (xc, launch or None, gs), where
    ``launch`` = (g, div, gsrc, ng, gs_out) of the in-kernel scale route (``amax`` given, no finite
    checks, non-empty x) and ``gs`` the global-scale tensor otherwise."""
    if amax is None:
        gs, xc = _prepare(x, global_scale, check_finite)
        return xc, None, gs
    if global_scale is not None:
        raise ValueError("NVFP4: pass global_scale or amax, not both")
    check_available(x)
    validate_input(x, check_finite=check_finite)
    am, ng = _check_amax(amax, x)
    xc = x.contiguous()
    if not check_finite and xc.numel():
        launch = _amax_source(x, xc, am, ng, mode, want_gs=mode == 0)
        if launch is not None:
            return xc, launch, None
    gs, xc = _prepare(x, _gs_of_amax(x, am, ng), check_finite)
    return xc, None, gs


def quantize(x: torch.Tensor, global_scale=None, *, amax=None, check_finite: bool = True) -> NVFP4Tensor:
    """Triton :func:`verl_quads.nvfp4.quantize`. ``amax`` (instead of ``global_scale``): see
    :func:`fake_quantize`; the result's ``global_scale`` is the float32 scale the kernel derived (amax's
    shape; 0-d for a group; ``[..., 1]`` for "row")."""
    return _quantize(x, global_scale, amax, check_finite, None)[0]


def quantize_with_guidance(x: torch.Tensor, global_scale=None, *, amax=None, check_finite: bool = True,
                           out: GuidanceRecord | None = None) -> tuple[NVFP4Tensor, GuidanceRecord]:
    """Triton :func:`verl_quads.nvfp4.quantize_with_guidance`: :func:`quantize` whose kernel also writes the
    guidance bits (no launch of its own; the ``v1`` kernel has no such output: the bits come from
    :func:`~verl_quads.nvfp4.guidance.extract_guidance` there, the same bytes). ``out``: a record to fill
    instead of a new one (layouts: :func:`_record_target`; TRACE's token rows): the v2 kernel writes its bits,
    block scales and global scales there too (no copies); the returned record is ``out``."""
    if out is None:
        bits = torch.empty(*x.shape[:-1], x.shape[-1] // 8, dtype=torch.uint8, device=x.device)
        q, _ = _quantize(x, global_scale, amax, check_finite, bits, None)
        return q, GuidanceRecord(bits, q.block_scale, q.global_scale, q.shape)
    target = _record_target(out, x)
    q, written = _quantize(x, global_scale, amax, check_finite, None, target)
    if not written:  # the route had no record outputs: the same bytes, copied
        lead = out.bits.shape[:-1]
        target.scale.copy_(q.block_scale.view(torch.uint8).reshape(*lead, -1))
        out.global_scale.copy_(torch.broadcast_to(q.global_scale, (*x.shape[:-1], 1)).reshape(*lead, 1))
    return q, out


def _quantize(x: torch.Tensor, global_scale, amax, check_finite: bool, bits: torch.Tensor | None,
              target: _RecordTarget | None = None) -> tuple[NVFP4Tensor, bool]:
    """:func:`quantize`, and whether the kernel wrote ``target``'s scales. ``bits`` (uint8 ``[..., K/8]``,
    contiguous): also filled with the codes' guidance bits; ``target``: where the whole record goes instead (the
    bits always; the scales by the v2 kernel only, else the caller copies them)."""
    xc, launch, gs = _prepare_amax(x, global_scale, amax, check_finite, 0)
    k = x.shape[-1]
    lead = tuple(x.shape[:-1])
    nblk = xc.numel() // BLOCK_SIZE
    packed = torch.empty(*lead, k // 2, dtype=torch.uint8, device=x.device)
    scale = torch.empty(*lead, k // BLOCK_SIZE, dtype=torch.uint8, device=x.device)
    words = packed.view(torch.int64)  # one 8-byte word per block (see _block_word)
    rec = target
    if bits is not None:
        rec = _RecordTarget(bits.view(torch.int16), None, None, k // BLOCK_SIZE, 0, 0, 1)
    v2 = launch is not None or KERNELS["quantize"] == "v2"
    if launch is not None:
        g, div, gsrc, ng, gs = launch
        _quant2(xc, g, div, words, scale, words, k, 0, 0, gsrc, ng, gs, rec)
    elif nblk:
        g, div = _gs_rows(gs, lead)
        if v2:
            _quant2(xc, g, div, words, scale, words, k, 0, 0, rec=rec)
        else:
            _launch(_quant_kernel, _grid(nblk), xc, g, words, scale, words, nblk, k // BLOCK_SIZE, div,
                    MODE=0, OUT=0)
            if rec is not None:
                guide = extract_guidance(NVFP4Tensor(packed, scale.view(torch.float8_e4m3fn), gs, x.shape, x.dtype))
                dst = rec.bits.view(torch.uint8)
                dst.copy_(guide.bits.reshape(dst.shape))
    q = NVFP4Tensor(packed, scale.view(torch.float8_e4m3fn), gs, x.shape, x.dtype)
    return q, v2 and nblk > 0


def fake_quantize(x: torch.Tensor, global_scale=None, *, amax=None, check_finite: bool = True) -> torch.Tensor:
    """Triton :func:`verl_quads.nvfp4.fake_quantize` (one fused pass, nothing packed).

    ``amax`` (instead of ``global_scale``): the global scale is ``global_scale_from_amax(amax)``,
    derived inside the same kernel (no separate launches): a floating tensor shaped like a global
    scale (0-d, ``[E, 1, 1]``, ``[..., 1]``; any float dtype, e.g. the weight's own), a 1-D ``[G]`` (a
    fused group: the max of its entries, NaN if any is NaN), or ``"row"`` (each row's own max |x|, also
    computed in the kernel when a program holds whole rows, else by one torch reduction first). That
    route is the v2 kernel; with ``check_finite`` the scale is computed by torch first and checked.
    Bit-identical to passing ``global_scale_from_amax(amax)`` (tests/unit/test_qat_fused_scale.py)."""
    xc, launch, gs = _prepare_amax(x, global_scale, amax, check_finite, 1)
    out = torch.empty_like(xc)
    nblk = xc.numel() // BLOCK_SIZE
    if launch is not None:
        o = _out_arg(out)
        g, div, gsrc, ng, _ = launch
        _quant2(xc, g, div, o, o, o, x.shape[-1], 1, _out_code(x), gsrc, ng)
    elif nblk:
        o = _out_arg(out)
        g, div = _gs_rows(gs, tuple(x.shape[:-1]))
        if KERNELS["fake_quantize"] == "v2":
            _quant2(xc, g, div, o, o, o, x.shape[-1], 1, _out_code(x))
        else:
            _launch(_quant_kernel, _grid(nblk), xc, g, o, o, o, nblk, x.shape[-1] // BLOCK_SIZE, div,
                    MODE=1, OUT=_OUT_DTYPES[x.dtype])
    return out


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Triton :func:`verl_quads.nvfp4.dequantize`."""
    check_available(q.packed)
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"NVFP4 dequantize: dtype must be one of {list(_OUT_DTYPES)}, got {dtype}")
    out = torch.empty(q.shape, dtype=dtype, device=q.packed.device)
    nblk = out.numel() // BLOCK_SIZE
    if nblk:
        g, div = _gs_rows(q.global_scale, tuple(q.shape[:-1]))
        _launch(_dequant_kernel, _grid(nblk), q.packed.contiguous().view(torch.int64), q.block_scale.contiguous().view(torch.uint8),
                g, _out_arg(out), nblk, q.shape[-1] // BLOCK_SIZE, div,
                OUT=_OUT_DTYPES[dtype])
    return out


_STATS_TILE = (8, 16)  # rows x blocks per program of the residual statistics kernel

#: Fused per-token residual kernel (``_residual_row_kernel``): one program per row; warps chosen so
#: that each thread holds about ``elems_per_thread`` elements of the row; rows longer than
#: ``max_blocks`` 16-blocks (padded to a power of two) use the multi-kernel path (same bytes).
ROW_CONFIG = {"elems_per_thread": 64, "max_blocks": 2048}


def _row_warps(nbp: int) -> int:
    return int(min(16, max(1, triton.next_power_of_2(max(1, nbp * BLOCK_SIZE // (32 * ROW_CONFIG["elems_per_thread"]))))))


def _residual_choice() -> str:
    """``KERNELS["residual_per_token"]``, checked against RESIDUAL_PER_TOKEN_CHOICES."""
    choice = KERNELS["residual_per_token"]
    if choice not in RESIDUAL_PER_TOKEN_CHOICES:
        raise ValueError(f"triton_kernels.KERNELS['residual_per_token'] = {choice!r}: must be one of "
                         f"{list(RESIDUAL_PER_TOKEN_CHOICES)} (\"tiled\" and \"hold\" were removed in session 10; "
                         f"named gather variants: RESIDUAL_VARIANTS {list(RESIDUAL_VARIANTS)})")
    return choice


def _fused_rows_ok(gs: torch.Tensor, m: int, nb: int) -> bool:
    """A fused per-token kernel (``KERNELS["residual_per_token"]``) applies when the second-pass
    global scale is per row: a per-row first-pass scale ``[M, 1]`` (or a single row), and the padded
    row fits that kernel's config (ROW_CONFIG / TILED_CONFIG ``max_blocks``)."""
    choice = _residual_choice()
    if choice == "gluon":  # explicit: _residual_rows runs it or raises (no silent fallback)
        return m > 0 and nb > 0
    per_row = gs.dim() == 2 and gs.shape[0] == m and gs.shape[1] == 1
    cfg = TILED_CONFIG if choice in ("gather", "auto") else ROW_CONFIG
    return (per_row or m == 1) and m > 0 and nb > 0 and triton.next_power_of_2(nb) <= cfg["max_blocks"]


def _residual_rows(x: torch.Tensor, gs: torch.Tensor, xc: torch.Tensor, ratio: float, w, packed: bool,
                   stop: int = 0):
    """Fused per-token path (``_residual_row_kernel``, ``_residual_tiled_kernel`` or the Gluon kernel, see KERNELS):
    ResidualNVFP4 if ``packed`` else the QDQ tensor. Both kernels take the same arguments. ``stop`` > 0: the
    gather kernel's STOP timing probe (``bench nvfp4 --residual-probe``; QDQ only, the output is not a result)."""
    m, k = x.shape
    nb = k // BLOCK_SIZE
    n_sel = num_selected_blocks(k, ratio)
    dev = x.device
    g1, div1 = _gs_rows(gs, (m,))
    nbp = triton.next_power_of_2(nb)
    wt = w if w is not None else g1
    choice = _residual_choice()
    if choice == "gluon" or (choice == "auto" and _auto_gluon(x, gs, w, nbp, packed, stop)):
        return _residual_rows_gluon(x, gs, xc, w, g1, div1, nbp, n_sel, packed, stop)
    over = {}
    if choice == "auto":
        choice, over = RESIDUAL_VARIANTS[_auto_residual_variant(nbp)]
    scratch = None
    if choice == "gather":
        kernel = _residual_tiled_kernel
        cfg = dict(TILED_CONFIG[choice], **over)
        ct = min(cfg["tile_blocks"], nbp)
        meta = dict(NTP=triton.next_power_of_2(triton.cdiv(nb, ct)), CT=ct, HAS_W=w is not None,
                    enable_fp_fusion=False, num_warps=cfg["num_warps"])
        if not packed:  # selected block indices, read back by the same program
            scratch = torch.empty(m, max(n_sel, 1), dtype=torch.int32, device=dev)
        if stop:
            meta["STOP"] = int(stop)
    else:
        kernel = _residual_row_kernel
        meta = dict(NBP=nbp, HAS_W=w is not None, SPLIT=TILE_CONFIG["split"], enable_fp_fusion=False,
                    num_warps=_row_warps(nbp))
    if stop and (packed or choice != "gather"):
        raise ValueError(f"triton_kernels: the STOP timing probe runs the gather kernel's QDQ launch only (packed=False, "
                         f"variant 'gather'); got variant {choice!r}, packed={packed}")
    if not packed:
        out = torch.empty_like(xc)
        o = _out_arg(out)
        kernel[(m,)](xc, g1, wt, o, o, o, o, o, scratch if scratch is not None else o, o, nb, n_sel, div1, PACK=False,
                     OUT=_OUT_DTYPES[x.dtype] if kernel is _residual_row_kernel else _out_code(x), **meta)
        return out
    codes = torch.empty(m, k // 2, dtype=torch.uint8, device=dev)
    scale = torch.empty(m, nb, dtype=torch.uint8, device=dev)
    packed2 = torch.empty(m, n_sel * 8, dtype=torch.uint8, device=dev)
    scale2 = torch.empty(m, n_sel, dtype=torch.uint8, device=dev)
    # n_sel == 0: nothing is stored through packed2 / scale2 / idx, but the kernel is still compiled with
    # their types (the gather walk loads block indices from idx: it must be an integer pointer)
    idx_buf = torch.empty(m, max(n_sel, 1), dtype=torch.int64, device=dev)
    idx = idx_buf[:, :n_sel]
    gs2_rows = torch.empty(m, dtype=torch.float32, device=dev)
    p2 = packed2.view(torch.int64) if n_sel else codes.view(torch.int64)
    kernel[(m,)](xc, g1, wt, xc, codes.view(torch.int64), scale, p2, scale2 if n_sel else scale,
                 idx_buf, gs2_rows, nb, n_sel, div1, PACK=True, OUT=0, **meta)
    per_row = gs.dim() == 2 and gs.shape[0] == m and m > 1
    gs2 = gs2_rows.unsqueeze(-1) if per_row else gs2_rows.reshape(())  # the reference's shapes
    first = NVFP4Tensor(codes, scale.view(torch.float8_e4m3fn), gs, x.shape, x.dtype)
    second = NVFP4Tensor(packed2, scale2.view(torch.float8_e4m3fn), gs2, torch.Size((m, n_sel * 16)), torch.float32)
    return ResidualNVFP4(first, second, idx, ratio)


def _residual_rows_gluon(x, gs, xc, w, g1, div1, nbp: int, n_sel: int, packed: bool, stop: int):
    """``KERNELS["residual_per_token"] == "gluon"``: :func:`verl_quads.nvfp4.gluon_residual.residual_qdq` with its
    CONFIG for the padded row length, or a RuntimeError saying why it cannot run (explicitly chosen: no fallback)."""
    from verl_quads.nvfp4 import gluon_residual as gr

    why = gr.check_supported(x, gs, w)
    if why is None and packed:
        why = "the Gluon residual kernel writes the QDQ output only (no packed residual_quantize)"
    if why is not None:
        raise RuntimeError(f"triton_kernels.KERNELS['residual_per_token'] = 'gluon': {why}")
    nw, reuse, maxnreg = gr.CONFIG.get(nbp, (None, False, None))
    return gr.residual_qdq(xc, g1, div1, n_sel, nw, reuse, maxnreg, stop=stop)


def _residual_first_pass(x: torch.Tensor, gs: torch.Tensor, xc: torch.Tensor, ratio: float, per_token: bool,
                         w, packed: bool):
    """Multi-kernel path (per-call selection, or per-token with a per-tensor global scale): first
    pass + per-(row, block) scores and residual amax (``_residual_stats_kernel``), the selection
    (per token: torch's stable sort of the scores; per call: ``call_scores`` then
    ``_select_kernel``), and the second-pass global scale(s). Returns a dict of the pieces."""
    m, k = x.shape
    nb = k // BLOCK_SIZE
    n_sel = num_selected_blocks(k, ratio)
    dev = x.device
    rt, ct = _STATS_TILE
    codes = torch.empty(m, k // 2 if packed else 8, dtype=torch.uint8, device=dev)
    scale = torch.empty(m, nb, dtype=torch.uint8, device=dev)
    energy = torch.empty(m, nb, dtype=torch.float32, device=dev)
    ramax = torch.empty(m, nb, dtype=torch.float32, device=dev)
    g1, div1 = _gs_rows(gs, (m,))
    idx = torch.zeros(m if per_token else 1, n_sel, dtype=torch.int64, device=dev)
    mask = torch.zeros(m if per_token else 1, nb, dtype=torch.int8, device=dev)
    amax_rows = torch.zeros(m, dtype=torch.float32, device=dev)
    gs2_rows = torch.ones(m, dtype=torch.float32, device=dev)
    if m * nb:
        _launch(_residual_stats_kernel, (triton.cdiv(m, rt), triton.cdiv(nb, ct)), xc, g1, w if w is not None else g1,
                codes.view(torch.int64), scale, energy, ramax, m, nb, div1, RT=rt, CT=ct, PACK=packed,
                HAS_W=w is not None)
        if per_token:
            order = torch.sort(energy, dim=-1, descending=True, stable=True).indices
            idx = torch.sort(order[..., :n_sel], dim=-1).values
            mask.scatter_(1, idx, 1)
        elif n_sel:
            score = call_scores(energy)
            nbp = triton.next_power_of_2(nb)
            _select_kernel[(1,)](score, mask, idx, nb, n_sel, NBP=nbp, CH=max(1, min(64, 16384 // nbp)))
        rb = 16
        _row_gs2_kernel[(triton.cdiv(m, rb),)](ramax, mask, amax_rows, gs2_rows, m, nb, 1 if per_token else 0,
                                              RB=rb, CH=64)
    per_row = gs.dim() == 2 and gs.shape[0] == m and m > 1
    if per_row:
        gs2 = gs2_rows.unsqueeze(-1)
    else:  # per-tensor first pass: one second-pass scale from the amax over all selected blocks
        gs2 = global_scale_from_amax(amax_rows.amax() if m else torch.zeros((), device=dev))
        gs2_rows = gs2.expand(m).contiguous()
    return dict(g1=g1, div1=div1, codes=codes, scale=scale, idx=idx if per_token else idx[0],
                mask=mask, gs2=gs2, gs2_rows=gs2_rows, m=m, k=k, nb=nb, n_sel=n_sel)


def _residual_prepare(x: torch.Tensor, global_scale, score_weight, check_finite: bool, row_scale: bool = False):
    if x.dim() != 2:
        raise ValueError(f"residual_quantize: x must be 2-D [tokens, K], got shape {tuple(x.shape)}")
    gs, xc = _prepare(x, global_scale, check_finite, row_scale)
    return gs, xc, check_score_weight(score_weight, x.shape[-1], x.device, check_values=check_finite)


def residual_quantize(x: torch.Tensor, ratio: float, global_scale=None, *, per_token: bool = True,
                      score_weight: torch.Tensor | None = None, check_finite: bool = True) -> ResidualNVFP4:
    """Triton :func:`verl_quads.nvfp4.residual_quantize`: per-token selection with a per-row global
    scale runs as one fused kernel (``_residual_row_kernel``); otherwise the multi-kernel path."""
    num_selected_blocks(x.shape[-1] if x.dim() else 0, ratio)  # validates the ratio first
    gs, xc, w = _residual_prepare(x, global_scale, score_weight, check_finite)
    m, k = x.shape
    if m == 0:  # no rows: nothing to launch; the reference defines the (empty) result and its shapes
        return _ref_residual_quantize(x, ratio, gs, per_token=per_token, score_weight=w, check_finite=False)
    if per_token and _fused_rows_ok(gs, m, k // BLOCK_SIZE):
        return _residual_rows(x, gs, xc, ratio, w, packed=True)
    p = _residual_first_pass(x, gs, xc, ratio, per_token, w, packed=True)
    n_sel = p["n_sel"]
    packed2 = torch.empty(m, n_sel * 8, dtype=torch.uint8, device=x.device)
    scale2 = torch.empty(m, n_sel, dtype=torch.uint8, device=x.device)
    if m * n_sel:
        rows_idx = (p["idx"] if per_token else p["idx"].expand(m, -1)).contiguous()
        _launch(_residual_second_kernel, _grid(m * n_sel), xc, p["g1"], p["scale"], rows_idx,
                p["gs2_rows"], packed2.view(torch.int64), scale2, m * n_sel, n_sel, p["nb"], p["div1"])
    first = NVFP4Tensor(p["codes"], p["scale"].view(torch.float8_e4m3fn), gs, x.shape, x.dtype)
    second = NVFP4Tensor(packed2, scale2.view(torch.float8_e4m3fn), p["gs2"], torch.Size((m, n_sel * 16)),
                         torch.float32)
    return ResidualNVFP4(first, second, p["idx"], ratio)


def residual_fake_quantize(x: torch.Tensor, ratio: float, global_scale=None, *, per_token: bool = True,
                           score_weight: torch.Tensor | None = None, check_finite: bool = True) -> torch.Tensor:
    """Triton :func:`verl_quads.nvfp4.residual_fake_quantize`: per-token selection with a per-row
    global scale is one fused kernel; otherwise first pass, selection, then one fused kernel that
    writes ``Q(x) + Q(R_sel)`` without materializing either pass."""
    num_selected_blocks(x.shape[-1] if x.dim() else 0, ratio)
    if x.dtype not in _OUT_DTYPES:
        validate_input(x)
    gs, xc, w = _residual_prepare(x, global_scale, score_weight, check_finite)
    m, k = x.shape
    nb = k // BLOCK_SIZE
    if m == 0:
        return torch.empty_like(xc)
    if per_token and _fused_rows_ok(gs, m, nb):
        return _residual_rows(x, gs, xc, ratio, w, packed=False)
    p = _residual_first_pass(x, gs, xc, ratio, per_token, w, packed=False)
    out = torch.empty_like(xc)
    if m * nb:
        _launch(_residual_qdq_kernel, _grid(m * nb), xc, p["g1"], p["scale"], p["mask"], p["gs2_rows"], _out_arg(out),
                m * nb, nb, p["div1"], 1 if per_token else 0, OUT=_OUT_DTYPES[x.dtype])
    return out


def _guided_prepare(x: torch.Tensor, guidance: GuidanceRecord, check_finite: bool, what: str) -> None:
    check_available(x)
    validate_input(x, check_finite=check_finite)
    if tuple(x.shape) != tuple(guidance.shape):
        raise ValueError(
            f"{what}: x has shape {tuple(x.shape)} but the guidance record was made for "
            f"{tuple(guidance.shape)} (stale or foreign record)"
        )


def _guided_operands(x: torch.Tensor, guidance: GuidanceRecord):
    """(bits as int16 words, block-scale bytes, float32 global scales, GS_DIV) on x's device, contiguous."""
    g, div = _gs_rows(guidance.global_scale.to(x.device), tuple(x.shape[:-1]))
    bits = guidance.bits.to(x.device).contiguous().view(torch.int16)
    return bits, guidance.block_scale.to(x.device).contiguous().view(torch.uint8), g, div


def fake_quantize_guided(x: torch.Tensor, guidance: GuidanceRecord, *, check_finite: bool = True) -> torch.Tensor:
    """Triton :func:`verl_quads.nvfp4.fake_quantize_guided`: guided quantize and dequantize in one
    launch (``_guided_kernel`` MODE 1), nothing packed; x's shape and dtype."""
    _guided_prepare(x, guidance, check_finite, "fake_quantize_guided")
    xc = x.contiguous()
    out = torch.empty_like(xc)
    nblk = xc.numel() // BLOCK_SIZE
    if nblk:
        bits, scale, g, div = _guided_operands(x, guidance)
        _launch(_guided_kernel, _grid(nblk), xc, bits, scale, g, _out_arg(out), nblk, x.shape[-1] // BLOCK_SIZE, div,
                MODE=1, OUT=_out_code(x))
    return out


def quantize_guided(x: torch.Tensor, guidance: GuidanceRecord, *, check_finite: bool = True) -> NVFP4Tensor:
    """Triton :func:`verl_quads.nvfp4.quantize_guided`."""
    _guided_prepare(x, guidance, check_finite, "quantize_guided")
    k = x.shape[-1]
    lead = tuple(x.shape[:-1])
    xc = x.contiguous()
    gs = guidance.global_scale.to(x.device)
    packed = torch.empty(*lead, k // 2, dtype=torch.uint8, device=x.device)
    nblk = xc.numel() // BLOCK_SIZE
    if nblk:
        g, div = _gs_rows(gs, lead)
        _launch(_guided_kernel, _grid(nblk), xc, guidance.bits.to(x.device).contiguous().view(torch.int16),
                guidance.block_scale.to(x.device).contiguous().view(torch.uint8), g, packed.view(torch.int64), nblk, k // BLOCK_SIZE,
                div)
    return NVFP4Tensor(packed, guidance.block_scale.to(x.device), gs, x.shape, x.dtype)
