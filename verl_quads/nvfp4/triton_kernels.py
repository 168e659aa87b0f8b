"""Triton fast paths for NVFP4: quantize, dequantize, QDQ, residual compensation, guided quantize.

Each kernel produces the same bytes as :mod:`.reference` (tests compare with ``torch.equal``):

- float32 division uses ``tl.math.div_rn`` (IEEE round-to-nearest); Triton's plain ``/`` lowers
  to an approximate division on NVIDIA GPUs.
- the E4M3 block-scale cast is done in integer arithmetic (round-to-nearest-even on the
  mantissa bits, subnormals included), so it does not depend on a conversion instruction.
- kernels are launched with ``enable_fp_fusion=False``: a multiply feeding an add must not be
  contracted into an FMA, which would round differently from the reference.

The residual path (QUADS) runs in three steps: a first-pass kernel that also writes each
(row, 16-block)'s residual energy and residual amax; the block selection in torch on those small
``[M, K / 16]`` tensors; a second-pass kernel over the selected blocks. Given the same selection
every byte equals the reference; the selection itself can differ from the reference only where
two blocks' energies are equal up to float32 summation order (the 16-element sums are reduced
in a different order), which on continuous data does not occur in practice.

Layout assumptions: inputs are viewed as 2-D ``[R, K]`` row-major contiguous (leading dims
flattened); global scales are expanded to one float32 per row.
"""

from __future__ import annotations

import os

import torch

from verl_quads.nvfp4.format import BLOCK_SIZE, NVFP4Tensor
from verl_quads.nvfp4.guidance import GuidanceRecord
from verl_quads.nvfp4.reference import _check_global_scale, global_scale_from_amax, validate_input
from verl_quads.nvfp4.residual import ResidualNVFP4, num_selected_blocks

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
    def _e2m1_index(a):
        """Round-to-nearest-even E2M1 magnitude index (int32 0..7) of |y| in [0, 6]."""
        idx = (a > 0.25).to(tl.int32)
        idx += (a >= 0.75).to(tl.int32)
        idx += (a > 1.25).to(tl.int32)
        idx += (a >= 1.75).to(tl.int32)
        idx += (a > 2.5).to(tl.int32)
        idx += (a >= 3.5).to(tl.int32)
        idx += (a > 5.0).to(tl.int32)
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
    def _scales(xb, gs):
        """xb [BR, NB, 16] float32, gs [BR] -> (scale value [BR, NB], scale byte, output_scale [BR, NB])."""
        vec_max = tl.max(tl.abs(xb), axis=2)
        s = gs[:, None] * (vec_max * 0.16666666666666666)
        s = tl.minimum(s, 448.0)
        sval, sbyte = _e4m3_round(s)
        inv_gs = tl.math.div_rn(tl.full(gs.shape, 1.0, tl.float32), gs)
        denom = sval * inv_gs[:, None]
        safe = tl.where(denom == 0, 1.0, denom)
        out_scale = tl.where(denom == 0, 0.0, tl.math.div_rn(tl.full(denom.shape, 1.0, tl.float32), safe))
        return sval, sbyte, out_scale

    @triton.jit
    def _pack(codes, BR: tl.constexpr, BK: tl.constexpr):
        c = tl.reshape(codes, (BR, BK // 2, 2))
        lo, hi = tl.split(c)
        return (lo | (hi << 4)).to(tl.uint8)

    @triton.jit
    def _unpack(p, BR: tl.constexpr, BK: tl.constexpr):
        p = p.to(tl.int32)
        lo = p & 15
        hi = p >> 4
        return tl.reshape(tl.join(lo, hi), (BR, BK))

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
        else:
            tl.store(ptr, v.to(tl.float16), mask=mask)

    @triton.jit
    def _quant_kernel(
        x_ptr, gs_ptr, packed_ptr, scale_ptr, out_ptr, energy_ptr, ramax_ptr,
        R, K,
        BR: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr, OUT: tl.constexpr,
    ):
        """MODE 0: write packed + scales. 1: write the QDQ result to out_ptr. 2: MODE 0 + residual
        energy and residual amax per (row, block) (float32 [R, K/16])."""
        NB: tl.constexpr = BK // 16
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BK + tl.arange(0, BK)
        rmask = rows < R
        mask = rmask[:, None] & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gs = tl.load(gs_ptr + rows, mask=rmask, other=1.0)
        xb = tl.reshape(x, (BR, NB, 16))
        sval, sbyte, out_scale = _scales(xb, gs)
        y = xb * out_scale[:, :, None]
        y = tl.minimum(tl.maximum(y, -6.0), 6.0)
        idx = _e2m1_index(tl.abs(y))
        bcols = tl.program_id(1) * NB + tl.arange(0, NB)
        bmask = rmask[:, None] & (bcols[None, :] < K // 16)
        if MODE == 1:
            factor = tl.math.div_rn(sval, gs[:, None])
            v = _e2m1_value(idx) * factor[:, :, None]
            v = tl.where(_signbit(y) == 1, -v, v)
            _store_out(out_ptr + rows[:, None] * K + cols[None, :], tl.reshape(v, (BR, BK)), mask, OUT)
        else:
            codes = tl.reshape((_signbit(y) << 3) | idx, (BR, BK))
            pcols = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
            pmask = rmask[:, None] & (pcols[None, :] < K // 2)
            tl.store(packed_ptr + rows[:, None] * (K // 2) + pcols[None, :], _pack(codes, BR, BK), mask=pmask)
            tl.store(scale_ptr + rows[:, None] * (K // 16) + bcols[None, :], sbyte.to(tl.uint8), mask=bmask)
            if MODE == 2:
                factor = tl.math.div_rn(sval, gs[:, None])
                v = _e2m1_value(idx) * factor[:, :, None]
                v = tl.where(_signbit(y) == 1, -v, v)
                r = xb - v
                tl.store(energy_ptr + rows[:, None] * (K // 16) + bcols[None, :], tl.sum(r * r, axis=2), mask=bmask)
                tl.store(ramax_ptr + rows[:, None] * (K // 16) + bcols[None, :], tl.max(tl.abs(r), axis=2), mask=bmask)

    @triton.jit
    def _dequant_kernel(
        packed_ptr, scale_ptr, gs_ptr, out_ptr, R, K,
        BR: tl.constexpr, BK: tl.constexpr, OUT: tl.constexpr,
    ):
        NB: tl.constexpr = BK // 16
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < R
        pcols = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
        p = tl.load(packed_ptr + rows[:, None] * (K // 2) + pcols[None, :],
                    mask=rmask[:, None] & (pcols[None, :] < K // 2), other=0)
        codes = tl.reshape(_unpack(p, BR, BK), (BR, NB, 16))
        bcols = tl.program_id(1) * NB + tl.arange(0, NB)
        sb = tl.load(scale_ptr + rows[:, None] * (K // 16) + bcols[None, :],
                     mask=rmask[:, None] & (bcols[None, :] < K // 16), other=0).to(tl.int32)
        gs = tl.load(gs_ptr + rows, mask=rmask, other=1.0)
        factor = tl.math.div_rn(_e4m3_decode(sb), gs[:, None])
        v = _e2m1_value(codes & 7) * factor[:, :, None]
        v = tl.where((codes >> 3) == 1, -v, v)
        cols = tl.program_id(1) * BK + tl.arange(0, BK)
        _store_out(out_ptr + rows[:, None] * K + cols[None, :], tl.reshape(v, (BR, BK)),
                   rmask[:, None] & (cols[None, :] < K), OUT)

    @triton.jit
    def _residual_second_kernel(
        x_ptr, gs1_ptr, scale1_ptr, idx_ptr, gs2_ptr, packed_ptr, scale_ptr,
        R, K, NSEL,
        BR: tl.constexpr, BS: tl.constexpr,
    ):
        """Second pass over BS selected blocks per program: recompute the first-pass QDQ of those
        blocks from x and its stored scales, take the residual, quantize it with gs2."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < R
        sel = tl.program_id(1) * BS + tl.arange(0, BS)
        smask = rmask[:, None] & (sel[None, :] < NSEL)
        blk = tl.load(idx_ptr + rows[:, None] * NSEL + sel[None, :], mask=smask, other=0)
        e = tl.arange(0, 16)
        m3 = smask[:, :, None]
        x = tl.load(x_ptr + rows[:, None, None] * K + blk[:, :, None] * 16 + e[None, None, :], mask=m3, other=0.0)
        x = x.to(tl.float32)
        gs1 = tl.load(gs1_ptr + rows, mask=rmask, other=1.0)
        s1 = _e4m3_decode(tl.load(scale1_ptr + rows[:, None] * (K // 16) + blk, mask=smask, other=0).to(tl.int32))
        inv_gs = tl.math.div_rn(tl.full(gs1.shape, 1.0, tl.float32), gs1)
        denom = s1 * inv_gs[:, None]
        safe = tl.where(denom == 0, 1.0, denom)
        out_scale = tl.where(denom == 0, 0.0, tl.math.div_rn(tl.full(denom.shape, 1.0, tl.float32), safe))
        y = tl.minimum(tl.maximum(x * out_scale[:, :, None], -6.0), 6.0)
        v = _e2m1_value(_e2m1_index(tl.abs(y))) * tl.math.div_rn(s1, gs1[:, None])[:, :, None]
        v = tl.where(_signbit(y) == 1, -v, v)
        r = x - v
        gs2 = tl.load(gs2_ptr + rows, mask=rmask, other=1.0)
        sval, sbyte, out2 = _scales(r, gs2)
        y2 = tl.minimum(tl.maximum(r * out2[:, :, None], -6.0), 6.0)
        codes = tl.reshape((_signbit(y2) << 3) | _e2m1_index(tl.abs(y2)), (BR, BS * 16))
        pcols = tl.program_id(1) * (BS * 8) + tl.arange(0, BS * 8)
        tl.store(packed_ptr + rows[:, None] * (NSEL * 8) + pcols[None, :], _pack(codes, BR, BS * 16),
                 mask=rmask[:, None] & (pcols[None, :] < NSEL * 8))
        tl.store(scale_ptr + rows[:, None] * NSEL + sel[None, :], sbyte.to(tl.uint8), mask=smask)

    @triton.jit
    def _guided_kernel(
        x_ptr, bits_ptr, scale_ptr, gs_ptr, packed_ptr, R, K,
        BR: tl.constexpr, BK: tl.constexpr,
    ):
        NB: tl.constexpr = BK // 16
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < R
        cols = tl.program_id(1) * BK + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=rmask[:, None] & (cols[None, :] < K), other=0.0)
        xb = tl.reshape(x.to(tl.float32), (BR, NB, 16))
        bcols = tl.program_id(1) * NB + tl.arange(0, NB)
        bmask = rmask[:, None] & (bcols[None, :] < K // 16)
        s = _e4m3_decode(tl.load(scale_ptr + rows[:, None] * (K // 16) + bcols[None, :], mask=bmask, other=0).to(tl.int32))
        gs = tl.load(gs_ptr + rows, mask=rmask, other=1.0)
        inv_gs = tl.math.div_rn(tl.full(gs.shape, 1.0, tl.float32), gs)
        denom = s * inv_gs[:, None]
        safe = tl.where(denom == 0, 1.0, denom)
        out_scale = tl.where(denom == 0, 0.0, tl.math.div_rn(tl.full(denom.shape, 1.0, tl.float32), safe))
        y = tl.reshape(tl.minimum(tl.maximum(xb * out_scale[:, :, None], -6.0), 6.0), (BR, BK))
        a = tl.abs(y)
        # floor index on the grid and whether |y| is a grid point
        lo = (a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32) + (a >= 2.0).to(tl.int32)
        lo += (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32) + (a >= 6.0).to(tl.int32)
        on_grid = _e2m1_value(lo) == a
        # guidance bit of element c: byte c // 8, bit c % 8
        bcol8 = tl.program_id(1) * (BK // 8) + tl.arange(0, BK // 8)
        gb = tl.load(bits_ptr + rows[:, None] * (K // 8) + bcol8[None, :],
                     mask=rmask[:, None] & (bcol8[None, :] < K // 8), other=0).to(tl.int32)
        shifts = tl.arange(0, 8)
        bit = tl.reshape((gb[:, :, None] >> shifts[None, None, :]) & 1, (BR, BK))
        hi = tl.minimum(lo + 1, 7)
        pick = tl.where((lo & 1) == bit, lo, hi)
        mag = tl.where(on_grid, lo, pick)
        codes = (_signbit(y) << 3) | mag
        pcols = tl.program_id(1) * (BK // 2) + tl.arange(0, BK // 2)
        tl.store(packed_ptr + rows[:, None] * (K // 2) + pcols[None, :], _pack(codes, BR, BK),
                 mask=rmask[:, None] & (pcols[None, :] < K // 2))


def _tiles(r: int, k: int) -> tuple[int, int]:
    bk = 16
    while bk < 256 and bk * 2 <= k:
        bk *= 2
    br = max(1, min(64, 4096 // bk))
    while br > 1 and br // 2 >= r:
        br //= 2
    return br, bk


def _rows_gs(gs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One float32 global scale per row of the 2-D view of ``x``."""
    return gs.expand(*x.shape[:-1], 1).reshape(-1).contiguous()


def _prepare(x: torch.Tensor, global_scale, check_finite: bool):
    check_available(x)
    validate_input(x, check_finite=check_finite)
    if global_scale is None:
        gs = global_scale_from_amax(x.abs().amax() if x.numel() else torch.tensor(0.0)).to(x.device)
    else:
        gs = _check_global_scale(global_scale, x)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    return gs, x2


def _out_arg(out: torch.Tensor) -> torch.Tensor:
    """bf16 outputs are written as int16 bit patterns (see ``_store_out``)."""
    return out.view(torch.int16) if out.dtype == torch.bfloat16 else out


def _launch(kernel, grid, *args, **meta):
    kernel[grid](*args, enable_fp_fusion=False, **meta)


def quantize(x: torch.Tensor, global_scale=None, *, check_finite: bool = True) -> NVFP4Tensor:
    """Triton :func:`verl_quads.nvfp4.quantize`."""
    gs, x2 = _prepare(x, global_scale, check_finite)
    r, k = x2.shape
    packed = torch.empty(r, k // 2, dtype=torch.uint8, device=x.device)
    scale = torch.empty(r, k // BLOCK_SIZE, dtype=torch.uint8, device=x.device)
    if r and k:
        br, bk = _tiles(r, k)
        _launch(_quant_kernel, (triton.cdiv(r, br), triton.cdiv(k, bk)), x2, _rows_gs(gs, x), packed, scale,
                packed, packed, packed, r, k, BR=br, BK=bk, MODE=0, OUT=0)
    lead = tuple(x.shape[:-1])
    return NVFP4Tensor(packed.reshape(*lead, k // 2), scale.view(torch.float8_e4m3fn).reshape(*lead, k // 16),
                       gs, x.shape, x.dtype)


def fake_quantize(x: torch.Tensor, global_scale=None, *, check_finite: bool = True) -> torch.Tensor:
    """Triton :func:`verl_quads.nvfp4.fake_quantize` (one fused pass, nothing packed)."""
    gs, x2 = _prepare(x, global_scale, check_finite)
    r, k = x2.shape
    out = torch.empty_like(x2)
    if r and k:
        br, bk = _tiles(r, k)
        o = _out_arg(out)
        _launch(_quant_kernel, (triton.cdiv(r, br), triton.cdiv(k, bk)), x2, _rows_gs(gs, x), o, o, o,
                o, o, r, k, BR=br, BK=bk, MODE=1, OUT=_OUT_DTYPES[x.dtype])
    return out.reshape(x.shape)


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Triton :func:`verl_quads.nvfp4.dequantize`."""
    check_available(q.packed)
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"NVFP4 dequantize: dtype must be one of {list(_OUT_DTYPES)}, got {dtype}")
    k = q.shape[-1]
    p2 = q.packed.reshape(-1, k // 2).contiguous()
    r = p2.shape[0]
    out = torch.empty(r, k, dtype=dtype, device=q.packed.device)
    if r and k:
        br, bk = _tiles(r, k)
        gs_rows = q.global_scale.expand(*q.shape[:-1], 1).reshape(-1).contiguous()
        sc = q.block_scale.reshape(r, k // 16).contiguous().view(torch.uint8)
        _launch(_dequant_kernel, (triton.cdiv(r, br), triton.cdiv(k, bk)), p2, sc, gs_rows, _out_arg(out), r, k,
                BR=br, BK=bk, OUT=_OUT_DTYPES[dtype])
    return out.reshape(q.shape)


def residual_quantize(x: torch.Tensor, ratio: float, global_scale=None, *, per_token: bool = False,
                      check_finite: bool = True) -> ResidualNVFP4:
    """Triton :func:`verl_quads.nvfp4.residual_quantize` (see the module docstring for the steps)."""
    if x.dim() != 2:
        raise ValueError(f"residual_quantize: x must be 2-D [tokens, K], got shape {tuple(x.shape)}")
    gs, x2 = _prepare(x, global_scale, check_finite)
    m, k = x2.shape
    nb = k // BLOCK_SIZE
    n_sel = num_selected_blocks(k, ratio)
    packed = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    scale = torch.empty(m, nb, dtype=torch.uint8, device=x.device)
    energy = torch.empty(m, nb, dtype=torch.float32, device=x.device)
    ramax = torch.empty(m, nb, dtype=torch.float32, device=x.device)
    gs1 = _rows_gs(gs, x)
    if m and k:
        br, bk = _tiles(m, k)
        _launch(_quant_kernel, (triton.cdiv(m, br), triton.cdiv(k, bk)), x2, gs1, packed, scale, packed,
                energy, ramax, m, k, BR=br, BK=bk, MODE=2, OUT=0)
    first = NVFP4Tensor(packed, scale.view(torch.float8_e4m3fn), gs, x.shape, x.dtype)
    score = energy if per_token else energy.sum(0)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    idx = torch.sort(order[..., :n_sel], dim=-1).values
    rows_idx = (idx if per_token else idx.expand(m, -1)).contiguous()
    per_row = gs.dim() == 2 and gs.shape[0] == m and m > 1
    sel_amax = torch.gather(ramax, 1, rows_idx)
    if n_sel == 0:
        amax = torch.zeros((m, 1) if per_row else (), dtype=torch.float32, device=x.device)
    else:
        amax = sel_amax.amax(-1, keepdim=True) if per_row else sel_amax.amax()
    gs2 = global_scale_from_amax(amax)
    packed2 = torch.empty(m, n_sel * 8, dtype=torch.uint8, device=x.device)
    scale2 = torch.empty(m, n_sel, dtype=torch.uint8, device=x.device)
    if m and n_sel:
        bs = 16
        while bs > 1 and bs // 2 >= n_sel:
            bs //= 2
        br = max(1, min(64, 256 // bs))
        _launch(_residual_second_kernel, (triton.cdiv(m, br), triton.cdiv(n_sel, bs)), x2, gs1, scale,
                rows_idx, gs2.expand(m, 1).reshape(-1).contiguous(), packed2, scale2, m, k, n_sel, BR=br, BS=bs)
    second = NVFP4Tensor(packed2, scale2.view(torch.float8_e4m3fn), gs2, torch.Size((m, n_sel * 16)), torch.float32)
    return ResidualNVFP4(first, second, idx, ratio)


def residual_fake_quantize(x: torch.Tensor, ratio: float, global_scale=None, *, per_token: bool = False,
                           check_finite: bool = True) -> torch.Tensor:
    """Triton :func:`verl_quads.nvfp4.residual_fake_quantize`."""
    r = residual_quantize(x, ratio, global_scale, per_token=per_token, check_finite=check_finite)
    return r.dequantize(x.dtype)

def quantize_guided(x: torch.Tensor, guidance: GuidanceRecord, *, check_finite: bool = True) -> NVFP4Tensor:
    """Triton :func:`verl_quads.nvfp4.quantize_guided`."""
    check_available(x)
    validate_input(x, check_finite=check_finite)
    if tuple(x.shape) != tuple(guidance.shape):
        raise ValueError(
            f"quantize_guided: x has shape {tuple(x.shape)} but the guidance record was made for "
            f"{tuple(guidance.shape)} (stale or foreign record)"
        )
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    r = x2.shape[0]
    gs = guidance.global_scale.to(x.device)
    packed = torch.empty(r, k // 2, dtype=torch.uint8, device=x.device)
    if r and k:
        br, bk = _tiles(r, k)
        _launch(_guided_kernel, (triton.cdiv(r, br), triton.cdiv(k, bk)), x2,
                guidance.bits.to(x.device).reshape(r, k // 8).contiguous(),
                guidance.block_scale.to(x.device).reshape(r, k // 16).contiguous().view(torch.uint8),
                _rows_gs(gs, x), packed, r, k, BR=br, BK=bk)
    lead = tuple(x.shape[:-1])
    return NVFP4Tensor(packed.reshape(*lead, k // 2), guidance.block_scale.to(x.device), gs, x.shape, x.dtype)
