"""Dense NVFP4 GEMMs at large M (prefill, large decode batches): block values decoded once per call, then cuBLAS.

Why: the fused kernels (:mod:`verl_quads.nvfp4.triton_gemm`, the Gluon kernels) decode every weight tile inside the
K loop. At decode sizes that is what makes them fast (the GEMM is bound by weight bytes); from a few hundred rows on
the GEMM is bound by tensor-core work, and the in-loop decode with mma.sync tiles ran at 0.41-0.52x of cuBLAS BF16
on the H200 (session 16 call 1: 8192x8192 at M = 4096 1636 us vs 850). Here, per chunk of ``Nc`` weight rows:

1. :func:`block_values`: ``E2M1(code) * block_scale`` of the chunk (no global scale), decoded by the fused GEMM's
   own tile decode (``triton_gemm._fp4_tile``) into a scratch ``[Nc, K]`` in the activation's dtype. EXACT in
   bf16 and fp16 (at most 6 significant bits, range 2**-10 .. 2688);
2. cuBLAS: ``torch.mm(a, w_chunk.T, out_dtype=float32)``: tensor cores, float32 accumulation and float32 output
   (no rounding before the global scale is applied);
3. ``_scale_epilogue_kernel``: ``y = t [* 1/gs_a(row)] * 1/gs_w (+ bias)``, cast once to the output dtype, written
   to columns ``[n0, n0 + Nc)`` of the output.

So the arithmetic is the fused kernels' (exact products, float32 sums, ``1 / gs`` applied to the float32 sum by
``div_rn`` reciprocals, one cast); only the float32 summation order (cuBLAS's) differs. W4A4 operands without a
residual operand (``naive`` / ``trace``): the activation's block values are decoded the same way (``[M, K]``) and its
per-row global scale joins the epilogue. ``DequantConfig.scratch_bytes`` bounds each of the two scratch buffers
(the bf16 / fp16 weight chunk and the float32 product chunk); their memory comes from torch's caching allocator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from verl_quads.nvfp4 import device_info as di
from verl_quads.nvfp4.format import BLOCK_SIZE
from verl_quads.nvfp4.triton_gemm import _row_gs
from verl_quads.nvfp4.triton_kernels import _OUT_DTYPES as _OUT
from verl_quads.nvfp4.triton_kernels import _out_arg, check_available, triton

if triton is not None:
    import triton.language as tl

    from verl_quads.nvfp4.triton_gemm import _fp4_tile
    from verl_quads.nvfp4.triton_kernels import _store_out

_BV_ROWS, _BV_BLOCKS = 16, 16  # block_values tile: 16 rows x 16 blocks (256 elements) per program
_EP_ROWS, _EP_COLS = 32, 128  # epilogue tile


@dataclass(frozen=True)
class DequantConfig:
    """Launch configuration of :func:`dequant_gemm` (pass it as ``config=`` to
    :func:`~verl_quads.nvfp4.triton_gemm.nvfp4_gemm`; dense GEMMs, bf16 / fp16 activations).

    Attributes:
        scratch_bytes: upper bound, in bytes, of each scratch buffer: the decoded weight chunk ``[Nc, K]`` (2 bytes
            per element) and the float32 product chunk ``[M, Nc]``; ``Nc`` is the largest multiple of 128 rows that
            fits both (at least 128, at most N).
    """

    scratch_bytes: int = 64 << 20

    def check(self) -> None:
        if not isinstance(self.scratch_bytes, int) or self.scratch_bytes < 1:
            raise ValueError(f"DequantConfig.scratch_bytes must be a positive int, got {self.scratch_bytes!r}")

    def chunk_rows(self, m: int, n: int, k: int) -> int:
        """Weight rows per chunk for an ``[m, k] x [n, k]^T`` GEMM."""
        rows = min(self.scratch_bytes // (2 * max(k, 1)), self.scratch_bytes // (4 * max(m, 1)))
        return max(1, min(n, max(128, rows // 128 * 128)))


def mm_out_dtype_supported() -> bool:
    """Whether this torch has ``aten::mm.dtype`` (bf16 / fp16 inputs, float32 output on CUDA)."""
    return "dtype" in torch.ops.aten.mm.overloads()


if triton is not None:

    @triton.jit
    def _block_values_kernel(p_ptr, s_ptr, out_ptr, R, K, KH, KB, BR: tl.constexpr, G: tl.constexpr,
                             KMASK: tl.constexpr, OUT: tl.constexpr):
        """Rows ``pid0 * BR ..`` x 16-blocks ``pid1 * G ..`` of an NVFP4 tensor (``p_ptr`` uint8 ``[R, K/2]``, ``s_ptr``
        e4m3 bytes ``[R, K/16]``): ``E2M1(code) * block_scale`` in natural K order, stored to ``out_ptr`` ``[R, K]``
        (``_store_out`` code OUT). The tile decode is the fused GEMM's (float32 values, exact)."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < R
        r64 = rows.to(tl.int64)
        kb0 = tl.program_id(1) * G
        v = _fp4_tile(p_ptr, s_ptr, r64 * KH, r64 * KB, rmask, kb0, KB, BR, G, 0, KMASK, False)
        col = kb0 * 16 + tl.arange(0, G * 16)
        m = rmask[:, None] & (col < K)[None, :]
        _store_out(out_ptr + r64[:, None] * K + col[None, :], v, m, OUT)

    @triton.jit
    def _scale_epilogue_kernel(t_ptr, wgs_ptr, ags_ptr, bias_ptr, out_ptr, M, NC, LD, A4: tl.constexpr,
                               HAS_BIAS: tl.constexpr, OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """``out[r, c] = cast(t[r, c] [* 1/ags[r]] * 1/wgs (+ bias[c]))`` for ``t`` float32 ``[M, NC]``; ``out`` rows
        ``LD`` elements apart. Same operations, in the same order, as the fused GEMM's epilogue."""
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        rmask = rows < M
        nmask = cols < NC
        m = rmask[:, None] & nmask[None, :]
        r64 = rows.to(tl.int64)
        y = tl.load(t_ptr + r64[:, None] * NC + cols[None, :], mask=m, other=0.0)
        gw = tl.load(wgs_ptr)
        inv_w = tl.math.div_rn(tl.full([BN], 1.0, tl.float32), gw + tl.zeros([BN], tl.float32))
        if A4:
            g1 = tl.load(ags_ptr + rows, mask=rmask, other=1.0)
            y = y * tl.math.div_rn(tl.full([BM], 1.0, tl.float32), g1)[:, None]
        y = y * inv_w[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
        _store_out(out_ptr + r64[:, None] * LD + cols[None, :], y, m, OUT)


def block_values(packed: torch.Tensor, block_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``E2M1(code) * block_scale`` (NO global scale) of an NVFP4 matrix, ``dtype`` ``[R, K]`` (exact in float32,
    bf16 and fp16). ``packed`` uint8 ``[R, K/2]`` (element 2i in the low nibble), ``block_scale`` float8_e4m3fn
    ``[R, K/16]``; both may be row slices of a larger matrix (rows contiguous)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"block_values: packed must be uint8 [R, K/2], got {packed.dtype} {tuple(packed.shape)}")
    r, k = packed.shape[0], packed.shape[1] * 2
    if k % BLOCK_SIZE or block_scale.dtype != torch.float8_e4m3fn or tuple(block_scale.shape) != (r, k // BLOCK_SIZE):
        raise ValueError(f"block_values: block_scale must be float8_e4m3fn [{r}, {k // BLOCK_SIZE}] for packed "
                         f"{tuple(packed.shape)} (K a multiple of {BLOCK_SIZE}), got {block_scale.dtype} "
                         f"{tuple(block_scale.shape)}")
    if dtype not in _OUT:
        raise ValueError(f"block_values: dtype must be one of {list(_OUT)}, got {dtype}")
    check_available(packed)
    out = torch.empty(r, k, dtype=dtype, device=packed.device)
    if r and k:
        kb = k // BLOCK_SIZE
        grid = (triton.cdiv(r, _BV_ROWS), triton.cdiv(kb, _BV_BLOCKS))
        _block_values_kernel[grid](packed.contiguous(), block_scale.contiguous().view(torch.uint8), _out_arg(out),
                                   r, k, k // 2, kb, BR=_BV_ROWS, G=_BV_BLOCKS, KMASK=kb % _BV_BLOCKS != 0,
                                   OUT=_OUT[dtype], num_warps=4)
    return out


def _mm_f32(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w.T`` with float32 accumulation and float32 output (cuBLAS via ``aten::mm.dtype`` on CUDA; on CPU, where
    the kernels above run only under the Triton interpreter, the same exact products summed in float32)."""
    if a.is_cuda:
        return torch.mm(a, w.t(), out_dtype=torch.float32)
    return torch.mm(a.float(), w.float().t())


def dequant_gemm(act, w_packed: torch.Tensor, w_scale: torch.Tensor, w_gs: torch.Tensor,
                 bias: torch.Tensor | None, config: DequantConfig) -> torch.Tensor:
    """``act @ dequant(W).T (+ bias)`` for a dense NVFP4 weight (``w_packed`` uint8 ``[N, K/2]``, ``w_scale`` e4m3
    ``[N, K/16]``, ``w_gs`` float32 one element) and an :class:`~verl_quads.nvfp4.triton_gemm.ActOperand` ``[M, K]``
    (``w4a16``, or W4A4 without a residual operand) in bf16 / fp16: ``[M, N]`` in ``act.dtype`` (module docstring).
    Raises for operands this path does not run (float32 activations, a QUADS ``fp4x2`` residual operand)."""
    config.check()
    m, k = act.shape
    n = w_packed.shape[0]
    if act.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nvfp4 GEMM: a DequantConfig runs bf16 / fp16 activations (cuBLAS tensor cores), got "
                         f"{act.dtype}")
    if act.mode == "w4a16":
        a, row_gs = act.values, None
    elif act.second_packed is None:
        a = block_values(act.first.packed, act.first.block_scale, act.dtype)
        row_gs = _row_gs(act.first.global_scale, m)
    else:
        raise ValueError("nvfp4 GEMM: a DequantConfig does not run QUADS operands with a second FP4 operand "
                         "(residual_combine='fp4x2'); 'bf16' (one w4a16 operand) runs")
    if a.is_cuda and not mm_out_dtype_supported():
        raise RuntimeError(f"nvfp4 GEMM: a DequantConfig needs torch.mm(..., out_dtype=torch.float32) (aten::mm.dtype), "
                           f"which torch {torch.__version__} lacks")
    out = torch.empty(m, n, dtype=act.dtype, device=w_packed.device)
    if m == 0 or n == 0:
        return out
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"nvfp4 GEMM: bias must be [{n}], got {tuple(bias.shape)}")
    rows = config.chunk_rows(m, n, k)
    gw = w_gs.reshape(1)
    o = _out_arg(out)
    for n0 in range(0, n, rows):
        nc = min(rows, n - n0)
        w = block_values(w_packed[n0:n0 + nc], w_scale[n0:n0 + nc], a.dtype)
        t = _mm_f32(a, w)
        grid = (triton.cdiv(m, _EP_ROWS), triton.cdiv(nc, _EP_COLS))
        _scale_epilogue_kernel[grid](t, gw, row_gs if row_gs is not None else gw,
                                     bias[n0:n0 + nc] if bias is not None else gw, o[:, n0:], m, nc, n,
                                     A4=row_gs is not None, HAS_BIAS=bias is not None, OUT=_OUT[act.dtype],
                                     BM=_EP_ROWS, BN=_EP_COLS, num_warps=4)
    return out


#: Dense GEMMs that :func:`~verl_quads.nvfp4.triton_gemm.nvfp4_gemm`'s default dispatch runs through
#: :func:`dequant_gemm`: ``capability -> operand kind -> ((min weight elements N * K, min rows M), ...)``, the first pair
#: whose element count the weight reaches giving the rows from which it is taken (``a4``: ``naive`` / ``trace``
#: operands). Measured entries only. sm_90: H200, session 16 call 2 (``python -m verl_quads.bench.dequant_probe``, warm
#: L2, CUDA graphs, one run; fused = the dispatch before, us): w4a16 at the first M taken / the M below it -- 8192x8192
#: M=512 153 vs 204 (M=256: 134 vs 107, not taken), 24576x4096 M=512 240 vs 325 (M=256: 184 vs 186), 4096x4096 M=128
#: 30.8 vs 42.0 (M=64: 26.2 vs 19.0), qkv 5120x2048 M=128 18.4 vs 23.2 (M=64: 17.2 vs 18.6: a tie, not taken), o_proj
#: 2048x4096 M=128 18.8 vs 19.4 (M=64: 17.3 vs 15.0); naive at M=256: 134 vs 168, 186 vs 241, 37.1 vs 48.4, 26.0 vs
#: 49.3, 23.5 vs 30.8 (M=128: 117 vs 94, 166 vs 162, 33.4 vs 30.7, 20.1 vs 29.4, 20.3 vs 22.3). At M=4096: w4a16
#: 931 / 1437 / 219 / 168 / 112 vs 1637 / 2406 / 424 / 272 / 228 (cuBLAS BF16 811 / 1220 / 177 / 115 / 89).
DEQUANT_MIN_ROWS: dict[tuple[int, int], dict[str, tuple[tuple[int, int], ...]]] = {
    (9, 0): {"w4a16": ((48 << 20, 512), (0, 128)), "a4": ((0, 256),)},
}


def dequant_min_rows(kind: str, n: int, k: int, capability: tuple[int, int]) -> int | None:
    """Rows from which the default dispatch takes :func:`dequant_gemm` for an ``[n, k]`` weight and operand ``kind``
    (``w4a16`` / ``a4``) on a GPU of ``capability`` (:data:`DEQUANT_MIN_ROWS`), or None (never)."""
    rules = DEQUANT_MIN_ROWS.get(tuple(capability), {}).get(kind, ())
    return next((rows for elems, rows in rules if n * k >= elems), None)


_WARNED: list[str] = []


def dequant_dense_config(act, w_packed: torch.Tensor) -> DequantConfig | None:
    """The default dispatch's choice for a dense GEMM: a :class:`DequantConfig` when the rows reach the
    :data:`DEQUANT_MIN_ROWS` entry of this GPU for the operand kind and the path can run here (CUDA, not the Triton
    interpreter, bf16 / fp16, no residual operand, ``aten::mm.dtype``), else None (the fused kernels)."""
    x = act.values if act.values is not None else act.first.packed
    if not x.is_cuda or w_packed.dim() != 2 or act.dtype not in (torch.bfloat16, torch.float16):
        return None
    if act.mode != "w4a16" and act.second_packed is not None:
        return None
    rows = dequant_min_rows("w4a16" if act.mode == "w4a16" else "a4", w_packed.shape[0], act.shape[1],
                            di.capability(x.device))
    if rows is None or act.shape[0] < rows:
        return None
    if not mm_out_dtype_supported():
        if not _WARNED:
            _WARNED.append(torch.__version__)
            logging.getLogger(__name__).warning(
                "verl-quads: torch %s has no torch.mm(..., out_dtype=float32); dense NVFP4 GEMMs with many rows use "
                "the fused kernels (H200: ~0.5x cuBLAS BF16 instead of ~0.9x at M = 4096)", torch.__version__)
        return None
    return DequantConfig()


__all__ = ["DEQUANT_MIN_ROWS", "DequantConfig", "block_values", "dequant_dense_config", "dequant_gemm",
           "dequant_min_rows", "mm_out_dtype_supported"]
