"""Issue #5: a dense W4A16 decode GEMM (M = 1..16, Hopper) whose operands stream in by TMA, one program per weight tile.

Why: the standard-layout kernel (:func:`verl_quads.nvfp4.gluon_gemm.gluon_w4a16_std`) loads its weights into
registers, one or two 128-element chunks ahead; to keep enough bytes in flight it needs many programs and a split-K
across programs, whose fixup chain (partials, counter, the last program's re-reads) costs 1.8-4.0 us of a 15-19 us
d8192 GEMM (H200, session 13). Here the TMA unit fetches whole stages into a ring of ``NS`` shared-memory buffers
(mbarrier completion), so ONE program per ``16 NWR`` weight rows covers all of K with ``NS - 1`` stages in flight: no
split across programs, no fixup.

Program ``pid_n``: weight rows ``16 NWR pid_n + [0, 16 NWR)``, ``KS * NWR`` warps; warp ``(s, w)`` takes row group w and
K slice s, i.e. chunks ``j KS U + u KS + s`` (u < U) of every stage j (a stage: ``CPS = KS U`` 128-element chunks). The
K slices are the batch dimension of the 3-D mma.sync of the in-program split-K kernel
(:func:`~verl_quads.nvfp4.gluon_gemm._ks_chunk_mma`: the same decode, the same k order inside a chunk) and are summed
at the end in the fixed order 0, 1, .. (:func:`~verl_quads.nvfp4.gluon_gemm.ks_reduce`). The summation order differs
from the other kernels' (slices interleaved by chunk, not contiguous K ranges): the result has the same bound vs the
torch reference (exact products, float32 sums), not their bytes. Deterministic (a fixed order; no atomics).

TMA views (tensor descriptors, built per call: the activation's depends on M), all boxes of whole 16-row groups:

- weight words: the packed codes as int32 ``[N, K/8]`` viewed 5-D ``[N/16, 2, 8, K/256, 32]`` (row group, rb3, g,
  chunk pair, word), box ``[NWR, 2, 8, CPS/2, 32]`` (128-byte rows: two chunks of a weight row), unswizzled (the
  swizzled layouts cannot be sliced per chunk pair in Gluon); thread (g, t) of slice s = 2 p + h reads the 16 bytes
  of rows g / g + 8 at word ``16 h + 4 t`` of pair p.
- scales: e4m3 ``[N, K/16]`` viewed ``[N/16, 2, 8, K/16]``, box ``[NWR, 2, 8, 8 CPS]`` (one byte per row and 16 elements).
- activation: bf16 ``[M, K]`` viewed ``[C, 1, M, 2, 64]`` (chunk, -, row, half, element), box ``[CPS, 1, MX, 2, 64]``
  with MX = M rounded up to a power of two (rows >= M zero-filled by the TMA unit); MMA column g reads staged row
  g % MX (columns >= M are never stored). 128-byte swizzle where a slice's chunks span whole 8-row swizzle periods.

H200 (session 14, ``verl_quads.bench.gluon_probe --tma``; docs/bench_rollout_h200_session14.txt): at d8192 M <= 8
ks2 w2 u4 ns3 is 14.8-15.3 us cold vs the std kernel's 16.5-17.6 (GLUON_TABLE takes it there); at M = 16 and at
d4096 / Qwen3-30B-A3B attention shapes it ties or loses. ncu (d8192 M=1): issue-bound like the std kernel (~0.55
instructions per cycle and scheduler, 6.8 M warp instructions, 2.46 TB/s): ~136 of its ~200 SASS instructions per
16 x 128 chunk and warp are the pair decode and the scale multiply. Tried and removed (slower or equal): the
activation from global memory (each warp its slice's chunks: 19-25 us at d8192 M <= 4), weights boxed as 64-byte
rows (chunk-major; 16.1-19.0 us), the activation staged as 8 NT rows whatever M (TMA zero-fill: no gain), register
prefetch of the next chunk inside a stage (equal), the stage's activation pair-permuted once in shared memory by the
whole program (4.5% fewer SASS instructions in the loop, 806 -> 770 per stage and warp, but one more CTA barrier per
stage: d8192 M=1 / 4 / 16 15.7 / 15.7 / 28.7 vs 15.2 / 14.9 / 22.7 us cold), two accumulators per warp (even / odd
chunks: 15.4 / 15.1 / 23.2): fewer instructions alone do not make it faster.

Session 15 (docs/bench_rollout_h200_session15.txt): the pipeline alone (``TmaConfig.floor``: stages stream in, no
decode / MMA) takes 10.9 / 7.7 us cold / warm at d8192 M=1 (ncu: 68% of DRAM peak, SM clock 1.97 GHz) and 4.4 us at
d4096, so ~3.5 us of the d8192 GEMM is compute that does not overlap the stream (ncu of decode 2: 46% issue-active,
1.88 warps per scheduler, stalls per issue: wait 0.88, long scoreboard 0.63, short scoreboard 0.37, math throttle
0.32; SM clock 1.80 GHz; ptxas keeps ~42 registers whatever the source order). Re-encoded words cut the instructions:
decode 2 (:func:`~verl_quads.nvfp4.gluon_gemm.spread_std`: 678 SASS per stage and warp vs 806) 14.8 / 14.4-14.5 us
at M = 1 / 4; decode 4 (:func:`~verl_quads.nvfp4.gluon_gemm.adjacent_std`, also no activation permutes: 631) 14.3 /
14.0-14.1 cold, 14.1 / 14.0 warm (2.46-2.50x cuBLAS), and ks2 w2 u2 ns4 d4 16.9 us at M = 16 (std entry 19.4). Not in the
dispatch: the rollout stores plain codes (every dense consumer would have to read the re-encoded words). A
warp-specialized variant (TMA producer partition + one-warp consumers with full / empty mbarriers) measured 54-76 us
(u4) / 19.7 us (u2 ns4): removed.

Needs sm_90 (TMA), triton >= 3.6 with Gluon, N % 16 == 0, K % 256 == 0 (whole chunk pairs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from verl_quads.nvfp4 import device_info as di
from verl_quads.nvfp4.format import BLOCK_SIZE
from verl_quads.nvfp4.gluon_gemm import ROWS, STD_CHUNK, gluon, gluon_available

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    from verl_quads.nvfp4.gluon_gemm import (_cta_barrier, _ks_chunk_mma, ks_mma_layout, ks_pair_layout, ks_reduce,
                                             ks_store, ks_x_layout)

    @gluon.jit
    def _tma_stage(w_desc, s_desc, x_desc, w_s, s_s, x_s, bars, buf, j, r0, CPS: gl.constexpr, NBYTES: gl.constexpr,
                   pred):
        """Stage ``j`` (chunks ``[j CPS, (j + 1) CPS)``) of the program's row groups ``r0 ..`` into ring buffer ``buf``:
        the weight words, scales and activation, one mbarrier (``bars[buf]``) expecting all NBYTES."""
        bar = bars.index(buf)
        mbarrier.expect(bar, NBYTES, pred=pred)
        tma.async_copy_global_to_shared(w_desc, [r0, 0, 0, j * (CPS // 2), 0], bar, w_s.index(buf), pred=pred)
        tma.async_copy_global_to_shared(s_desc, [r0, 0, 0, j * (CPS * 8)], bar, s_s.index(buf), pred=pred)
        tma.async_copy_global_to_shared(x_desc, [j * CPS, 0, 0, 0, 0], bar, x_s.index(buf), pred=pred)

    @gluon.jit
    def _u_loads(wb, sb, xb, u, KS: gl.constexpr, NWR: gl.constexpr, NT: gl.constexpr, MX: gl.constexpr):
        """Chunk ``u`` of every K slice of a landed stage (``wb`` / ``sb`` / ``xb``: its weight words, scales and
        activation buffers), in the 3-D mma.sync operand layouts of :func:`~verl_quads.nvfp4.gluon_gemm._ks_chunk_mma`:
        (words ``[KS, R, 2, 8, 4, 2, 2]``, scales ``[KS, R, 2, 8, 4, 2]``, activation ``[KS, NT, 8, 4, 32]``). Loaded
        as words ``[R, 2, 8, KS / 2 pairs, 32]`` (word 16 h + 4 t + i of slice s = 2 p + h: h and p are warp bits),
        scales ``[R, 2, 8, 8 KS]`` (byte 8 s + 2 t + ib), activation ``[KS, 1, MX, 2, 64]`` (thread (g, t): half
        t // 2, elements 32 (t % 2) + [0, 32) of staged row g % MX; the row-group warps of a slice hold the same
        copy)."""
        R: gl.constexpr = NWR
        H: gl.constexpr = KS // 2
        RX: gl.constexpr = 8 // MX if MX < 8 else 1  # copies of the MX staged rows in the MMA's 8 NT columns
        LW5: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 4], [1, 1, 8, 1, 4], [NWR, 1, 1, H, 2], [0, 4, 2, 3, 1])
        LS4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2], [1, 1, 8, 4], [NWR, 1, 1, KS], [0, 3, 2, 1])
        LX5: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 32], [1, RX, 8 // RX, 2, 2], [KS, 1, 1, 1, NWR],
                                             [4, 3, 2, 1, 0])
        wd = wb.slice(u * H, H, dim=3).load(LW5)
        wd = gl.permute(gl.reshape(wd, (R, 2, 8, H, 2, 4, 4)), (3, 4, 0, 1, 2, 5, 6))
        wd = gl.convert_layout(gl.reshape(wd, (KS, R, 2, 8, 4, 2, 2)), ks_pair_layout(KS, NWR), assert_trivial=True)
        sc = sb.slice(u * KS * 8, KS * 8, dim=3).load(LS4)
        sc = gl.permute(gl.reshape(sc, (R, 2, 8, KS, 4, 2)), (3, 0, 1, 2, 4, 5))
        sc = gl.convert_layout(sc, gl.SliceLayout(6, ks_pair_layout(KS, NWR)), assert_trivial=True)
        xv = xb.slice(u * KS, KS).load(LX5)  # [KS, 1, MX, 2, 64]
        if RX > 1:  # MMA column g reads staged row g % MX (columns >= M are not stored)
            xv, _ = gl.broadcast(xv, gl.zeros([KS, RX, MX, 2, 64], gl.bfloat16, LX5))
        xv = gl.convert_layout(gl.reshape(xv, (KS, NT, 8, 4, 32)), ks_x_layout(KS, NWR), assert_trivial=True)
        return wd, sc, xv

    @gluon.jit
    def _w4a16_tma_kernel(w_desc, s_desc, x_desc, gs_ptr, bias_ptr, out_ptr, M, N, NJ,
                          KS: gl.constexpr, NWR: gl.constexpr, NT: gl.constexpr, U: gl.constexpr, NS: gl.constexpr,
                          HAS_BIAS: gl.constexpr, DEC: gl.constexpr, MX: gl.constexpr,
                          FLOOR: gl.constexpr = False):
        """Module docstring: program ``pid_n`` = weight rows ``16 NWR pid_n + [0, 16 NWR)`` over all NJ stages of
        ``KS U`` chunks; output bf16 ``[M, N]`` (+ bias ``[N]``); MX activation rows staged (M rounded up to a power of
        two). FLOOR (:attr:`TmaConfig.floor`, benchmarks only): the stages stream in and are waited for, but nothing is
        read from them (no decode, no MMA): the output is the bias alone."""
        R: gl.constexpr = NWR
        BN: gl.constexpr = R * 16
        NW: gl.constexpr = KS * NWR
        CPS: gl.constexpr = KS * U
        NBYTES: gl.constexpr = CPS * R * 1024 + CPS * R * 128 + CPS * MX * 256
        pid_n = gl.program_id(0)
        r0 = pid_n * R

        w_s = gl.allocate_shared_memory(gl.int32, [NS, R, 2, 8, CPS // 2, 32], w_desc.layout)
        s_s = gl.allocate_shared_memory(gl.uint8, [NS, R, 2, 8, CPS * 8], s_desc.layout)
        x_s = gl.allocate_shared_memory(gl.bfloat16, [NS, CPS, 1, MX, 2, 64], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NS):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()  # the barriers' init is visible to the TMA unit
        for i in gl.static_range(NS - 1):  # NS - 1 stages in flight; the last buffer is filled in iteration 0
            _tma_stage(w_desc, s_desc, x_desc, w_s, s_s, x_s, bars, i, i, r0, CPS, NBYTES, i < NJ)

        acc = gl.zeros([KS, BN, NT * 8], gl.float32, ks_mma_layout(KS, NWR))
        for j in range(NJ):
            # every warp is done with iteration j - 1's buffer (its smem reads fed that iteration's MMAs): refill it
            # with stage j + NS - 1 (the buffers of stages j .. j + NS - 2 are in flight or landed)
            _cta_barrier()
            jn = j + NS - 1
            _tma_stage(w_desc, s_desc, x_desc, w_s, s_s, x_s, bars, jn % NS, jn, r0, CPS, NBYTES, jn < NJ)
            buf = j % NS
            mbarrier.wait(bars.index(buf), (j // NS) & 1)
            wb = w_s.index(buf)
            sb = s_s.index(buf)
            xb = x_s.index(buf)
            if not FLOOR:
                for u in gl.static_range(U):
                    wd, sc, xv = _u_loads(wb, sb, xb, u, KS, NWR, NT, MX)
                    acc = _ks_chunk_mma(acc, wd, sc, xv, KS, NWR, R, NT, DEC)
        for i in gl.static_range(NS):
            mbarrier.invalidate(bars.index(i))

        z = ks_reduce(acc, gs_ptr, KS, NWR, BN, NT)
        ks_store(z, out_ptr, out_ptr, out_ptr, bias_ptr, M, N, pid_n, 0, BN, NT, NW, 1, HAS_BIAS)  # no split-K


@dataclass(frozen=True)
class TmaConfig:
    """The TMA kernel's shape: ``ks`` K slices (even) x ``nwr`` row groups = ``ks * nwr`` warps per program (16 nwr
    weight rows), ``u`` chunks per slice and stage (a stage: ``ks * u`` 128-element chunks), ``ns`` ring stages
    (``ns - 1`` in flight), ``dec`` the pair decode (1 shifts, 3 mask + multiply: plain codes; 2 rotation + mask: the
    codes must be :func:`~verl_quads.nvfp4.gluon_gemm.spread_std`'s words; 4 the same on
    :func:`~verl_quads.nvfp4.gluon_gemm.adjacent_std`'s words, no activation pair permutes), ``maxnreg`` a ptxas
    register cap (0: none), ``floor`` (benchmarks only) the pipeline without decode / MMA."""

    ks: int = 2
    nwr: int = 4
    u: int = 2
    ns: int = 4
    dec: int = 3
    maxnreg: int = 0
    floor: bool = False  # benchmarks only: the TMA pipeline with no decode / MMA (wrong output: the bias alone)

    def __post_init__(self):
        if self.ks not in (2, 4) or self.nwr not in (1, 2, 4, 8) or self.ks * self.nwr > 16 or self.u < 1 or (
                self.ns < 2) or self.dec not in (1, 2, 3, 4) or self.maxnreg < 0:
            raise ValueError(f"TmaConfig: ks must be 2 or 4, nwr 1, 2, 4 or 8 (ks * nwr <= 16 warps), u >= 1, ns >= 2, "
                             f"dec 1 to 4, maxnreg >= 0; got {self}")

    @property
    def label(self) -> str:
        return (f"tma ks{self.ks} w{self.nwr} u{self.u} ns{self.ns} d{self.dec}"
                f"{f' r{self.maxnreg}' if self.maxnreg else ''}{' FLOOR' if self.floor else ''}")

    def smem_bytes(self, m: int) -> int:
        """Shared memory of the ring (bytes) for an activation of ``m`` rows (:func:`staged_rows` of them staged)."""
        cps = self.ks * self.u
        return self.ns * cps * (self.nwr * (1024 + 128) + staged_rows(m) * 256)


def staged_rows(m: int) -> int:
    """Activation rows the kernel stages for ``m`` rows (its TMA box height, MX): m rounded up to a power of two (the
    rows past m are zero-filled by the TMA unit)."""
    return 1 << (m - 1).bit_length()


def tma_plan(n: int, k: int, cfg: TmaConfig) -> tuple[int, int, int, bool]:
    """(programs, stages per program, chunks per stage, every stage full) of a launch for an ``[n, k]`` weight: one
    program per ``16 cfg.nwr`` rows over all of K (``k / 128`` chunks in stages of ``cfg.ks * cfg.u``)."""
    c, cps = k // STD_CHUNK, cfg.ks * cfg.u
    return -(-(n // ROWS) // cfg.nwr), -(-c // cps), cps, c % cps == 0


#: The H200's shared memory per block (opt-in maximum, bytes).
SMEM_LIMIT = 227 * 1024


def tma_supported(x: torch.Tensor, w_packed: torch.Tensor) -> tuple[bool, str]:
    """Whether :func:`gluon_w4a16_tma` can run this GEMM, and why not."""
    import os

    ok, why = gluon_available()
    if not ok:
        return False, why
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False, "the Triton interpreter cannot run TMA kernels"
    if not x.is_cuda or di.capability(x.device)[0] < 9:
        return False, "needs a CUDA GPU of compute capability 9.0+ (TMA)"
    if x.dtype != torch.bfloat16 or x.dim() != 2 or not 1 <= x.shape[0] <= 16:
        return False, f"needs a bf16 activation [1..16, K], got {x.dtype} {tuple(x.shape)}"
    n, k = w_packed.shape[0], x.shape[1]
    if w_packed.dim() != 2 or n % ROWS or k % (2 * STD_CHUNK):
        return False, f"needs N % 16 == 0 and K % 256 == 0, got weight {tuple(w_packed.shape)}, K {k}"
    return True, ""


@functools.cache
def _nvmma(swizzle_bytes: int, bits: int, rank: int):
    """The shared-memory layout of a descriptor (immutable; built once per kind: each build validates its fields,
    host time an eager call pays three times)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle_bytes, element_bitwidth=bits, rank=rank)


def gluon_w4a16_tma(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, w_gs: torch.Tensor,
                    bias: torch.Tensor | None = None, cfg: TmaConfig = TmaConfig()) -> torch.Tensor:
    """``x`` bf16 ``[M, K]`` (M <= 16) times the NVFP4 weight in the standard layout (``w_packed`` uint8 ``[N, K/2]``,
    ``w_scale`` e4m3 ``[N, K/16]``, ``w_gs`` float32 one element), plus ``bias`` ``[N]``: bf16 ``[M, N]``. With
    ``cfg.dec == 2`` / ``4`` ``w_packed`` holds :func:`~verl_quads.nvfp4.gluon_gemm.spread_std`'s /
    :func:`~verl_quads.nvfp4.gluon_gemm.adjacent_std`'s words (the same codes, bits moved inside each int32 word).
    Raises where it cannot run (:func:`tma_supported`; no fallback here)."""
    ok, why = tma_supported(x, w_packed)
    if not ok:
        raise RuntimeError(f"gluon_w4a16_tma cannot run this GEMM: {why}")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    m, k = x.shape
    n = w_packed.shape[0]
    if tuple(w_packed.shape) != (n, k // 2) or tuple(w_scale.shape) != (n, k // BLOCK_SIZE) or (
            w_packed.dtype != torch.uint8) or w_gs.numel() != 1:
        raise ValueError(f"gluon_w4a16_tma: weight uint8 [{n}, {k // 2}], scales [{n}, {k // BLOCK_SIZE}], one global "
                         f"scale; got {w_packed.dtype} {tuple(w_packed.shape)}, {tuple(w_scale.shape)}, {w_gs.numel()}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"gluon_w4a16_tma: bias must be [{n}], got {tuple(bias.shape)}")
    nt = 1 if m <= 8 else 2
    if cfg.smem_bytes(m) > SMEM_LIMIT:
        raise ValueError(f"gluon_w4a16_tma: {cfg.label} needs {cfg.smem_bytes(m)} bytes of shared memory at M={m} "
                         f"(limit {SMEM_LIMIT})")
    x = x.contiguous()
    c = k // STD_CHUNK
    kw, kb = k // 8, k // BLOCK_SIZE
    grid_n, stages, cps, _ = tma_plan(n, k, cfg)
    r = cfg.nwr
    wd = TensorDescriptor(w_packed.view(torch.int32), [n // ROWS, 2, 8, kw // 32, 32], [16 * kw, 8 * kw, kw, 32, 1],
                          [r, 2, 8, cps // 2, 32], _nvmma(0, 32, 5))
    sd = TensorDescriptor(w_scale.view(torch.uint8), [n // ROWS, 2, 8, kb], [16 * kb, 8 * kb, kb, 1], [r, 2, 8, cps * 8],
                          _nvmma(0, 8, 4))
    mx = staged_rows(m)
    # 128-byte swizzle where a slice's KS chunks span whole 8-row swizzle periods (else unswizzled: M = 1 at KS 2)
    xd = TensorDescriptor(x, [c, 1, m, 2, 64], [STD_CHUNK, m * k, k, 64, 1], [cps, 1, mx, 2, 64],
                          _nvmma(128 if cfg.ks * mx * 2 >= 8 else 0, 16, 5))
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    gs = w_gs.reshape(1)
    _w4a16_tma_kernel[(grid_n,)](wd, sd, xd, gs, bias if bias is not None else gs, out, m, n, stages,
                            KS=cfg.ks, NWR=r, NT=nt, U=cfg.u, NS=cfg.ns, HAS_BIAS=bias is not None, DEC=cfg.dec,
                            MX=mx, FLOOR=bool(cfg.floor), num_warps=cfg.ks * r,
                            **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    return out


__all__ = ["TmaConfig", "staged_rows", "tma_plan", "tma_supported", "gluon_w4a16_tma", "SMEM_LIMIT"]
