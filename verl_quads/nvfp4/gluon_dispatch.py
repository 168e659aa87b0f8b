"""Which sm_90 Gluon kernel and config the default dispatch of :func:`verl_quads.nvfp4.triton_gemm.nvfp4_gemm` takes for
a bf16 W4A16 GEMM: the measured tables :data:`GLUON_TABLE` (dense decode GEMMs, M <= 16: the standard-layout kernel of
:mod:`.gluon_gemm` or the TMA-fed kernel of :mod:`.gluon_tma`) and :data:`GLUON_MOE_TABLE` (grouped expert GEMMs: the
kernel of :mod:`.gluon_moe`), and the lookups that take an entry only where it can run (CUDA, bf16, capability 9.0
where it was measured, Gluon in the installed triton; else None: the Triton kernels of :mod:`.triton_gemm` /
:mod:`.triton_stream`, with ONE logged warning per process when only the triton version stands in the way).

Every entry is a measurement (H200, ``python -m verl_quads.bench.gluon_probe`` / ``gluon_moe_probe``); the comments
above each table keep the numbers that chose it. Entries change only which kernel computes a GEMM within the stated
bound of the torch reference, never the format.
"""

from __future__ import annotations

import torch

from verl_quads.nvfp4 import device_info as di
from verl_quads.nvfp4.gemm_shared import interpreting
from verl_quads.nvfp4.gluon_gemm import GluonConfig
from verl_quads.nvfp4.gluon_moe import GroupedConfig
from verl_quads.nvfp4.gluon_tma import TmaConfig
from verl_quads.nvfp4.moe_routing import GroupedRouting
from verl_quads.nvfp4.triton_stream import DECODE_BUCKETS, decode_bucket


#: Dense bf16 W4A16 decode GEMMs on sm_90 taken by the Gluon standard-layout kernel
#: (:func:`verl_quads.nvfp4.gluon_gemm.gluon_w4a16_std`: mma.sync tiles decoded from the plain packed layout) or,
#: for a :class:`~verl_quads.nvfp4.gluon_tma.TmaConfig` entry, the TMA-fed kernel (:mod:`verl_quads.nvfp4.gluon_tma`):
#: ``(bucket, n, k) -> GluonConfig | TmaConfig`` for M <= bucket (:data:`DECODE_BUCKETS`), checked before DECODE_TABLE /
#: MID_TABLE. Measured entries only: H200, session 10, gluon_probe cold / warm L2, us (every config checked against
#: the torch reference); call 2 timed each call-1 entry next to its xs twin (activation staged in shared memory once
#: per program: coalesced, instead of each warp's 4x-wavefront loads) in the same run; xs taken where it won:
#: d8192 M=2/4/8 16.6/16.9/18.2 cold, 15.5/15.5/16.1 warm (w4 rg2 pf1 d3 xs; call-1 entries w8 pf0 d3 / w4 rg2 pf1 d3:
#: 18.2/18.9/20.2, 16.7/17.2/17.9; session 9's w8 pf0 18.7/19.4/21.2); M=16 23.8 / 21.8 (w4 rg2 pf0 d3 xs; without xs
#: 24.3 / 23.1; session 9's w4 pf1 29.9 / 30.5): 2.05/2.05/1.87/1.45x cuBLAS BF16 (34.0-34.6 us).
#: d4096 M=2/4 7.8/8.0 (w4 kc2 pf0 d3, call 1: 7.7/7.9; xs 8.1/8.1: not taken); M=8/16 8.4/10.7 cold, 8.1/10.4 warm
#: (w4 pf0 d3 xs; w4 pf0 8.6/12.3, 8.8/13.0).
#: Qwen3-30B-A3B attention (the default dispatch before: stream / tensor-core kernels, 13.2-14.2 us at M=2..16,
#: slower than cuBLAS BF16): qkv_proj 5120x2048 M=2/4 6.4/6.7 (w8 pf0 d3; xs 6.5/6.6: ties), M=8/16 7.5/8.7 cold,
#: 7.2/8.7 warm (w4 pf0 d3 xs; w4 pf0 d3 7.7 / 7.8, w4 kc2 pf0 d3 9.5 / 10.2; cuBLAS 8.0 / 6.7-6.8); o_proj 2048x4096
#: M=2 6.0 (w4 pf1), M=4/8 6.3/7.0 (w4 kc2 pf0 d3; xs 6.3/6.9: ties), M=16 9.7 (w4 pf0 d3 occ 1: split 8; its xs twin
#: 9.2 cold but 20.0 warm in a run whose warm rows were noisy: not taken).
#: M=1 (all four shapes): the stream kernel (17.1 / 6.9 / 5.4 / 5.3 us) stays at least as fast as this kernel's best
#: (call 1: 17.1 / 7.3 / 5.9 / 5.4). d3 (mask + multiply decode), rg (row groups per warp), xs: same bytes as the
#: plain kernel at the same split.
#: Session 11 (H200 batch D1, gluon_probe, one run): d8192 M=16 w4 rg2 pf1 d3 xs 21.1 / 20.5 us (cold / warm) vs the
#: pf0 entry 24.1 / 22.2; d8192 M=1 the same config 17.0 / 15.1 vs the stream kernel 17.2 / 17.3 (cold: a tie; warm
#: 2.35x instead of 2.05x cuBLAS 35.0 / 35.5): both taken. d8192 through the grouped kernel as one expert
#: (gluon_probe --grp; W's cp.async weight ring 2-4, maxnreg 128, xsc2 xsb2): 18.0-20.9 cold at M=1 / 4, 22.5-30.1 at
#: M=16, slower than this kernel at every point; maxnreg 128 on this kernel: 17.1-21.1, no gain. Batch D2 (one run,
#: cold / warm): d8192 M=1 16.9 / 15.1 (stream kernel 17.3 / 17.5), M=16 21.1 / 20.3 (pf0 entry 24.2 / 21.5; pd2 27.8,
#: xsc4 xsb2 21.6, w8 pf1 xs 26.7 cold); the pf1 twin of the xs entries (w4 pf1 d3 xs) taken where it won: qkv M=4
#: 6.38 / 6.67 (w8 pf0 d3 6.67 / 7.24), M=16 7.91 / 7.68 (pf0 8.56 / 7.98); o_proj M=4 6.10 / 6.40 (w4 kc2 pf0 d3
#: 6.25 / 6.71; M=16 its 10.2 vs 9.65: not taken); d4096 M=8 7.64 / 7.76 (pf0 8.36 / 7.71), M=16 9.9 / 10.2 (10.7 /
#: 10.3). M=1 of qkv / o_proj / d4096: the stream kernel stays (5.43 / 5.29 / 6.9 vs 6.1 / 5.5 / 7.4 cold).
#: Batch D4 (one run; the D2 picks as "default dispatch" next to the entries they replaced): qkv M=4 6.41 / 6.76 (w8
#: pf0 d3 6.72 / 7.30), M=16 7.96 / 8.08 (pf0 xs 8.58 / 8.20); o_proj M=4 6.04 / 6.45 (kc2 6.20 / 6.68); d4096 M=8
#: 7.72 / 7.92 (pf0 xs 8.39 / 8.02), M=16 9.91 / 10.4 (10.7 / 10.2) -- and the pf1 xs twin taken at: qkv M=8 6.69 /
#: 6.91 (pf0 xs 7.46 / 7.00), o_proj M=8 6.60 / 6.62 (kc2 pf0 d3 6.91 / 7.85), d4096 M=2 7.27 / 7.81 (kc2 pf0 d3
#: 7.77 / 7.70), M=4 7.32 / 7.67 (7.94 / 7.99); not at qkv M=2 (6.35 / 6.64 vs w8 pf0 d3 6.41 / 6.84) or o_proj M=2
#: (5.90 / 6.35 vs w4 pf1 5.90 / 6.47): ties.
_G4_PF = GluonConfig(num_warps=4, kc=1, occ=2)
_G8_D3 = GluonConfig(num_warps=8, kc=1, occ=2, prefetch=False, dec=3)
#: Session 13 (H200 batch D1, gluon_probe, one run): split-K inside the program (GluonConfig.ks: 8 K slices of 4 chunks
#: summed in shared memory, one program per 16 rows covering all of K: no global partials / counter; the bytes of the
#: global split 8) at d4096 M=1: w8 ks8 pf1 d3 s1 6.89 / 6.77 us cold / warm vs the stream kernel 6.89 / 7.36
#: (rg2 7.73 / 6.94, w4 ks4 8.91 / 7.12); batch D3 (one run): the pf0 twin 6.78 / 6.06 vs pf1 6.94 / 6.93 and the
#: stream kernel 6.95 / 7.47: w8 ks8 pf0 d3 s1 taken; batch D5 (this entry): 6.74 / 6.26 vs the stream kernel
#: 6.93 / 7.40 and pf1 6.90 / 6.90; main bench d4096 M=1 6.52 us = 1.72x cuBLAS 11.2 (D3 with the pf1 entry: 6.96;
#: session 12's stream kernel 7.28); at M=2 it is slower (7.97 / 7.35 vs the xs entry 7.27 / 7.53): not
#: taken. Not taken elsewhere (activation straight from global instead of
#: the xs staging): d8192 M=1 / 4 / 16 ks8 rg2 17.5 / 15.4, 18.8 / 16.7, 30.3 / 27.8 vs the table's 17.0 / 15.2,
#: 17.6 / 15.4, 21.0 / 20.7 (ks8 rg4: 19.3 / 14.6, 20.9 / 17.2, 23.7 / 21.2; ks8 rg1, w4 ks4, w8 ks4 s2: slower);
#: d4096 M=4 / 16 ks8 8.17 / 8.16, 14.3 / 15.6 vs 7.34 / 7.68, 9.97 / 10.3. Also D3: d8192 M=16 xs with 256-row
#: programs (w8 rg2 xs, half the staged-activation traffic) 21.1 / 20.4 (split 8), 27.4 / 27.6 (split 16) vs the
#: entry's 21.0 / 20.3: the activation traffic is not what M=16 costs over M=4.
#: Session 36 (issue #5, H200 gluon_probe, cold / warm us, docs/bench_dense_floor_h200_session36.txt): ncu saw this
#: entry latency-bound at d4096 M=1 (0.38 instructions per scheduler and cycle, 62% of cycles no eligible warp): each
#: warp's 4 chunks were 4 loads-then-decode round trips. ``up=4`` loads all 4 before decoding the first (the same
#: bytes, torch.equal): call 5 6.45 / 6.12 vs 6.79 / 6.34 (M=4: 7.53 / 7.34, slower than the xs entry's 7.20 / 7.45;
#: d8192 ks8 s2 up4: slower than the TMA entry); call 6, twice alternated: 6.44 / 6.43 vs 6.80 / 6.82 cold; main
#: bench d4096 M=1 5.99 us = 1.98x cuBLAS (session 35: 6.65, 1.83x). Taken at M=1 (the entry before: the same, no up).
_G8_KS8_D3_UP4 = GluonConfig(num_warps=8, kc=1, split=1, occ=2, prefetch=False, dec=3, ks=8, up=4)
_G4_PF_D3_XS, _G4_RG2_PF_D3_XS = (GluonConfig(num_warps=4, kc=1, occ=2, dec=3, xs=True),
                                   GluonConfig(num_warps=4, kc=1, occ=2, rg=2, dec=3, xs=True))
#: Session 13 (issue #5: d8192 M=16 ~5 us slower than M=4; H200 batch E1, one run, cold / warm us): the split-K fixup
#: at 16 rows was it -- floor probe (gluon_floor emptyfM - empty, d8192 grid 64 x 8) 2.1 us at 1 row, 7.5 at 16. The
#: dense kernels now use gluon_gemm.split_fixup_v (16-byte accesses, partial loads unrolled; the same bytes, checked
#: with torch.equal at d8192 M=1/4/9/16 and d4096 M=4/16, with and without bias): 16-row chain 4.0 us. Its unrolled
#: loads raise this entry's kernel at 16 rows (BN 128, NT 2) from 113 to 138 registers (4 -> 3 programs per SM: 25.6 /
#: 23.4 us) unless capped: maxnreg 128 (no spills) 19.6 / 19.1 vs the old fixup's 21.0 / 20.3 (M=1: 17.1 / 15.1 vs
#: 17.2 / 15.2, M=4: 17.7 / 15.6 vs 17.9 / 15.7). d4096 M=16 (this fixup, no cap needed: 66 -> 72 registers) 8.84 /
#: 8.78 vs 9.87 / 10.3; M=4 7.16 / 7.36 vs 7.27 / 7.49. Also E1 at d8192 M=8 / 9 / 16 (NT 1 -> 2 at M=9), old
#: fixup unless noted: split 4 21.2 / 15.7, 25.2 / 18.7, 26.2 / 19.7; split 16 26.1 / 21.9, 26.0 / 24.5, 29.4 / 27.0;
#: w4 rg4 xs 30.2 / 25.9, 29.1 / 27.7, 33.6 / 33.9; w2 rg4 xs 21.4 / 17.8, 22.7 / 20.5, 23.7 / 21.1, with the new
#: fixup 19.8 / 16.0, 21.9 / 18.6, 21.9 / 18.3 (its kernel at 255 registers: 64-thread programs keep 4 per SM).
#: Batch E2 (this tree, one run): d8192 M=1 / 4 / 9 / 16 entries 17.1 / 15.3, 17.4 / 15.8, 19.2 / 18.2, 19.7 / 19.4
#: (uncapped twin at M=9 / 16: 24.7 / 21.9, 25.6 / 23.8; w2 rg4 xs 22.0 / 18.8, 22.1 / 19.6); main bench d8192 M=16
#: 18.7 us = 1.88x cuBLAS (was 20.3 = 1.71x). d4096 M=16 with the new fixup 8.81 / 8.93, its maxnreg-128 twin 8.14 /
#: 8.36 (E1: 8.84 / 8.78 vs 8.19 / 8.43; 72 registers either way, ptxas schedules differently under the cap): taken.
#: Same run, not taken (one run each): qkv M=16 entry 7.52 / 7.32 vs its r128 twin 6.86 / 7.48; o_proj M=16 entry
#: (w4 pf0 d3 o1) 8.04 / 7.73 vs w4 pf1 d3 xs r128 6.53 / 7.09. Session 14 (call 1, gluon_probe, two runs): o_proj M=16
#: w4 pf1 d3 xs r128 6.52 / 7.33 and 6.51 / 7.20 vs the entry w4 pf0 d3 o1 7.98 / 7.82 and 7.99 / 7.97 (cuBLAS 8.7-8.8
#: / 8.2-8.3): taken (the third run that agrees).
_G4_RG2_PF_D3_XS_R128 = GluonConfig(num_warps=4, kc=1, occ=2, rg=2, dec=3, xs=True, maxnreg=128)
_G4_PF_D3_XS_R128 = GluonConfig(num_warps=4, kc=1, occ=2, dec=3, xs=True, maxnreg=128)
#: Session 14 (issue #5): the TMA-fed kernel (verl_quads.nvfp4.gluon_tma: one program per 32 weight rows over all of
#: K, 3-stage shared-memory ring filled by the TMA unit, 2 K slices summed in shared memory; no split-K fixup) at
#: d8192 M <= 8. H200 gluon_probe, cold / warm L2 us, vs the previous entry (w4 rg2 pf1 d3 xs) in the same runs --
#: call 3: M=1 15.3 / 15.4 vs 16.9 / 15.4, M=4 15.3 / 15.4 vs 17.2 / 15.3; call 4: M=1 15.2 vs 16.5, M=4 14.8 vs
#: 16.6 (cold); call 5: M=1 15.1 / 15.7 vs 16.5 / 15.7, M=4 14.8 / 14.8 vs 16.6 / 15.5; M=16 (u2 ns4) 18.7-19.5 vs
#: 19.4-19.5: not taken. ncu (call 4, d8192 M=1): both kernels issue-bound at ~0.55 instructions per cycle and
#: scheduler (TMA kernel 6.8 M warp instructions, 2.46 TB/s; std 7.4 M, 2.12 TB/s): the pair decode + scale multiply
#: is ~136 of ~200 SASS instructions per 16 x 128 weight chunk and warp.
_T_KS2_W2_U4_NS3 = TmaConfig(ks=2, nwr=2, u=4, ns=3)
GLUON_TABLE: dict[tuple[int, int, int], GluonConfig | TmaConfig] = {
    (1, 8192, 8192): _T_KS2_W2_U4_NS3, (2, 8192, 8192): _T_KS2_W2_U4_NS3, (4, 8192, 8192): _T_KS2_W2_U4_NS3,
    (8, 8192, 8192): _T_KS2_W2_U4_NS3, (16, 8192, 8192): _G4_RG2_PF_D3_XS_R128,
    (1, 4096, 4096): _G8_KS8_D3_UP4, (2, 4096, 4096): _G4_PF_D3_XS, (4, 4096, 4096): _G4_PF_D3_XS, (8, 4096, 4096): _G4_PF_D3_XS,
    (16, 4096, 4096): _G4_PF_D3_XS_R128,
    (2, 5120, 2048): _G8_D3, (4, 5120, 2048): _G4_PF_D3_XS, (8, 5120, 2048): _G4_PF_D3_XS,
    (16, 5120, 2048): _G4_PF_D3_XS,
    (2, 2048, 4096): _G4_PF, (4, 2048, 4096): _G4_PF_D3_XS, (8, 2048, 4096): _G4_PF_D3_XS, (16, 2048, 4096): _G4_PF_D3_XS_R128,
}


_GLUON_WARNED: list[str] = []


def gluon_table_entry(m: int, n: int, k: int, capability: tuple[int, int]) -> GluonConfig | TmaConfig | None:
    """The :data:`GLUON_TABLE` entry for a dense bf16 w4a16 GEMM ``[m, k] x [n, k]^T`` on a CUDA device of
    ``capability``, or None: M <= 16, K % 128 == 0 and capability 9.0 (where the entries were measured) only."""
    bucket = decode_bucket(m)
    cfg = GLUON_TABLE.get((bucket, n, k)) if bucket is not None else None
    if cfg is None or m > 16 or k % 128 or tuple(capability) != (9, 0):
        return None
    return cfg


def gluon_dense_config(x: torch.Tensor, w_packed: torch.Tensor) -> GluonConfig | TmaConfig | None:
    """The default dispatch's Gluon choice for a dense w4a16 GEMM of activation ``x`` [M, K] and weight
    ``w_packed`` [N, K/2]: the :func:`gluon_table_entry` when the Gluon kernel can run here (CUDA tensor, bf16
    ``x``, not under the Triton interpreter, :func:`~verl_quads.nvfp4.gluon_gemm.gluon_available`: Gluon in a
    triton >= 3.6), else None (the Triton kernels, as before). An entry that cannot run because of the installed
    triton logs ONE warning per process (the version and the cost). Explicit GluonConfig requests do not come
    here: they raise where the kernel cannot run."""
    if interpreting() or x.device.type != "cuda" or x.dtype != torch.bfloat16 or w_packed.dim() != 2:
        return None
    cfg = gluon_table_entry(x.shape[0], w_packed.shape[0], x.shape[1], di.capability(x.device))
    if cfg is None:
        return None
    return cfg if _gluon_runs(_GLUON_WARNED, "decode kernel", "dense W4A16 decode GEMMs at M <= 16", "8192x8192 at "
                                "M=4: 0.9x cuBLAS BF16 instead of 1.8x") else None


def _gluon_runs(warned: list[str], kernel: str, gemms: str, cost: str) -> bool:
    """Whether the Gluon kernels can run with the installed triton
    (:func:`~verl_quads.nvfp4.gluon_gemm.gluon_available`); if not, logs ONE warning per ``warned`` list (per
    process): which ``kernel``, which ``gemms`` take the Triton kernels instead, and the measured ``cost`` (H200)."""
    from verl_quads.nvfp4.gluon_gemm import gluon_available

    ok, why = gluon_available()
    if not ok and not warned:
        warned.append(why)
        import logging

        logging.getLogger(__name__).warning(
            "verl-quads: the Gluon W4A16 %s is unavailable (%s); %s on this Hopper GPU use the Triton kernels instead "
            "(H200, %s). Install triton >= 3.6 for the fast path.", kernel, why, gemms, cost)
    return ok


#: Grouped (MoE expert) bf16 W4A16 GEMMs on sm_90 taken by the grouped Gluon kernel
#: (:func:`verl_quads.nvfp4.gluon_moe.gluon_w4a16_grouped`: the dense standard-layout kernel's tiles over moe_align's
#: tile table): ``(slots bucket, n, k) -> GroupedConfig`` for token-slots S with :func:`gluon_moe_bucket` (S) == bucket
#: exactly (an unmeasured bucket keeps the current dispatch), checked before DECODE_TABLE / MID_TABLE. H200, cold L2,
#: us (session 9 call 6 at fb1d1d2, ``python -m verl_quads.bench.gluon_moe_probe``; Qwen3-30B-A3B experts, 128 x top-8
#: random routing, block_m 16, every config within the reference bound), entry vs the default dispatch it replaces:
#: w13 [1536, 2048] T=4 (S=32) 25.8 vs 30.1, T=16 (S=128) 62.5 vs 106, T=64 (S=512) 91.8 vs 190; w2 [2048, 768]
#: 13.7 vs 17.2, 31.9 vs 53.0, 46.3 vs 96.0. Layer (probe, cold): 106 vs 168 us at T=16 (3.11x BF16), 172 vs 314 at
#: T=64 (2.83x), 50.6 vs 56.2 at T=4. Not taken: T=1..2.
#: T=256 (S=2048, bucket 2048, routing block_m 32): the wide kernel (gluon_moe: activation staged in shared memory,
#: ``xs``; 2 row groups per warp, ``rg`` 2; gluon_gemm's mask + multiply decode, ``dec`` 3). Session 10 call 2 at
#: cc9b7ef (same probe, cold / warm, one run): w13 4 warps, adaptive n-tiles (tiles of <= 16 rows 2 n-tiles, else 4;
#: ``nts`` 2), K staged 4 chunks at a time in 2 buffers: 137.3 / 138.1 us vs 212 / 213 for the dispatch it replaces
#: (BF16 torch._grouped_mm 268; call 1's entry, 8 warps rg 1: 157 / 158; 8 warps d3: 168). w2 4 warps, 2 n-tiles, the
#: whole K staged once: 69.0 / 69.9 vs 106 / 107 (BF16 150; call 1's entry, rg 1 d1 4 n-tiles: 77.7 / 78.8). Layer
#: (probe, cold): 233.6 us with these two (2.26x BF16 528.4) vs 361.4 before (MID_TABLE kernels + 3-launch moe_align)
#: and 257.2 with call 1's entries. Same bytes as the one-group kernel (GPU tests). T=1024 (block_m 64) and 1024 /
#: 4096 slots: not measured.
#: Session 11 (H200, gluon_moe_probe, cold / warm us; each in one run with the entry it replaces): T=256 w13 with x
#: staged one chunk at a time (``xsc`` 1, 2 buffers: 16 KB of shared memory instead of 64) and a 128-register cap
#: (``maxnreg``: 4 CTAs / SM instead of 3, no spills in the K loop): 107 / 111 vs 137 / 138 (batch 3; batch 2: 106.3 /
#: 108 vs 136.7 / 137.5; xsc 2 r128: 109; 8 warps: 111; deeper prefetch, L2 prefetch-size hints: no faster). T=256 w2
#: with adaptive n-tiles (``nts`` 2: the 17..32-row tiles in one pass instead of two, each pass decoding the weights
#: again), x staged once, r128: 56.6 / 57.6 vs 69.5 / 70.4 (batch 4; a cp.async ring K loop measured ~2% faster
#: twice, not kept). T=64 (block_m 16), both GEMMs, one-chunk x stages, r128, ``nts`` 1: w13 88.8 / 89.2 vs 90.0 /
#: 90.3, w2 44.4 / 45.2 vs 45.4 / 46.3 (batch 4; batch 3: 88.9 vs 91.1, 44.7 vs 46.1). T=16: no option faster than _GM.
#: Layer (batch 4, default moe_forward, gate fused): T=256 175 / 181 us (3.01x BF16 528; session-10 entries: 218 in
#: batch 2), T=64 140 / 141 (3.48x BF16 488). Same bytes as the explicit kernel (GPU tests, default dispatch).
_GM, _GM_K2 = (GroupedConfig(num_warps=4, kc=1, occ=2, prefetch=False, nt=1), GroupedConfig(num_warps=4, kc=2, occ=2, nt=1))
_GM_XS64 = GroupedConfig(num_warps=4, kc=1, occ=2, maxnreg=128, rg=2, dec=3, xs=True, nts=1, xsc=1, xsb=2)
_GM_XS13 = GroupedConfig(num_warps=4, kc=1, occ=2, maxnreg=128, rg=2, dec=3, xs=True, nts=2, xsc=1, xsb=2)
_GM_XS2 = GroupedConfig(num_warps=4, kc=1, occ=2, maxnreg=128, rg=2, dec=3, xs=True, nts=2)
#: Session 12 (helper M, H200, cold / warm us, one run each, every Gluon row torch.equal the block_m-32 baseline):
#: T=1024 (8192 slots, 64 per expert: grouped_block_m 64). The Gluon kernel on routing block_m 64 (64-row tiles), best
#: configs: w13 8 n-tiles in one pass, rg 2, nts 4, one-chunk x stages, no register cap: 291 / 292 unfused, 298 / 299
#: fused (other 64-row candidates 299-312 fused); w2 the T=256 entry in two passes of 4 n-tiles (nt 4): 143 / 150
#: (one-pass 64-row candidates 162-171); the Triton default dispatch on block_m 64: w13 363 / 364, w2 181 / 183; BF16
#: torch._grouped_mm 260 / 267 and 148 / 151. The T=256 entries on block_m-32 routing of the same ids were faster
#: still: w13 266 / 274, fused 276 / 277; w2 140 / 145. Session 12 kept the 64-row entries (moe_forward built block_m
#: 64 there; layer 461 / 462 us vs 552 / 555 without them, BF16 770). Session 13: moe_forward builds block_m 32 at this
#: bucket where both GEMMs run on the Gluon kernel (GLUON_MOE_ROUTING_BLOCK_M) and the bucket takes the T=256 entries;
#: the 64-row entries are gone (measured slower than the 32-row ones on the same ids).
GLUON_MOE_TABLE: dict[tuple[int, int, int], GluonConfig] = {
    (32, 1536, 2048): _GM_K2, (32, 2048, 768): _GM,  # T=4
    (128, 1536, 2048): _GM, (128, 2048, 768): _GM,  # T=16
    (512, 1536, 2048): _GM_XS64, (512, 2048, 768): _GM_XS64,  # T=64
    (2048, 1536, 2048): _GM_XS13, (2048, 2048, 768): _GM_XS2,  # T=256
    (8192, 1536, 2048): _GM_XS13, (8192, 2048, 768): _GM_XS2,  # T=1024 (routing block_m 32: GLUON_MOE_ROUTING_BLOCK_M)
}
#: slot buckets of GLUON_MOE_TABLE: DECODE_BUCKETS, then powers of two to 8192 slots
GLUON_MOE_BUCKETS = DECODE_BUCKETS + (1024, 2048, 4096, 8192)
#: bucket -> the routing block_m moe_forward builds (:func:`moe_block_m`) where both expert GEMMs run on the grouped
#: Gluon kernel, when it differs from grouped_block_m: the tile height the bucket's GLUON_MOE_TABLE entries were
#: measured fastest on. T=1024 (8192 slots, ~64 per expert, grouped_block_m 64): 32-row tiles (per-GEMM times in the
#: session-12 note above; layer times in :func:`moe_block_m`). The Triton kernels keep grouped_block_m (their MID_TABLE
#: / heuristic configs are per block_m).
GLUON_MOE_ROUTING_BLOCK_M: dict[int, int] = {8192: 32}


def gluon_moe_bucket(slots: int) -> int | None:
    """The smallest of :data:`GLUON_MOE_BUCKETS` >= ``slots`` (None past the last)."""
    return next((b for b in GLUON_MOE_BUCKETS if slots <= b), None)


_GLUON_MOE_WARNED: list[str] = []


def gluon_moe_table_entry(slots: int, n: int, k: int, block_m: int, capability: tuple[int, int]) -> GluonConfig | None:
    """The :data:`GLUON_MOE_TABLE` entry for a grouped bf16 w4a16 GEMM of ``slots`` token-slots and ``[E, n, k]``
    experts with routing ``block_m`` on a CUDA device of ``capability``, or None: the bucket of ``slots`` itself must
    have an entry, K % 128 == 0, block_m 8 / 16 / 32 (a multiple of 8 times the entry's ``nt``; not 64: every entry
    was measured on 8..32-row tiles, the 64-row entries of session 12 were slower than 32-row routing of the same ids)
    and capability 9.0 (where the entries were measured) only."""
    from verl_quads.nvfp4.gluon_moe import BLOCK_M_NT

    bucket = gluon_moe_bucket(slots)
    cfg = GLUON_MOE_TABLE.get((bucket, n, k)) if bucket is not None else None
    if cfg is None or k % 128 or block_m not in BLOCK_M_NT or tuple(capability) != (9, 0):
        return None
    if block_m == 64:  # 64-row tiles: 8 n-tiles per pass, a register budget none of the entries was measured with
        return None
    if getattr(cfg, "nt", 0) and BLOCK_M_NT[block_m] % cfg.nt:  # the entry's n-tiles do not fit this routing's tiles
        return None
    return cfg


def gluon_grouped_config(x: torch.Tensor, w_packed: torch.Tensor, routing: GroupedRouting) -> GluonConfig | None:
    """The default dispatch's Gluon choice for a grouped w4a16 GEMM of activation ``x`` [rows, K], experts
    ``w_packed`` [E, N, K/2] and ``routing``: the :func:`gluon_moe_table_entry` when the Gluon kernel can run here
    (CUDA tensor, bf16 ``x``, not under the Triton interpreter, :func:`~verl_quads.nvfp4.gluon_gemm.gluon_available`),
    else None (the Triton kernels, as before; an entry that cannot run because of the installed triton logs ONE
    warning per process). Explicit GroupedConfig requests do not come here: they raise where the kernel cannot run."""
    return gluon_grouped_entry(x, w_packed, x.shape[1], routing.sorted_slots.numel(), routing.block_m)


def gluon_grouped_entry(x: torch.Tensor, w_packed: torch.Tensor, k: int, slots: int,
                         block_m: int) -> GluonConfig | None:
    """:func:`gluon_grouped_config` of a GEMM with reduction dim ``k`` (``x``: an activation of its device and
    dtype, any width), ``slots`` token-slots and routing ``block_m``, before the routing exists (moe_block_m)."""
    if interpreting() or x.device.type != "cuda" or x.dtype != torch.bfloat16 or w_packed.dim() != 3:
        return None
    cfg = gluon_moe_table_entry(slots, w_packed.shape[1], k, block_m, di.capability(x.device))
    if cfg is None:
        return None
    return cfg if _gluon_runs(_GLUON_MOE_WARNED, "MoE kernel", "grouped W4A16 expert GEMMs at 4..256 tokens",
                              "Qwen3-30B-A3B MoE layer at 16 tokens: 168 us instead of 106") else None


__all__ = ["GLUON_MOE_BUCKETS", "GLUON_MOE_ROUTING_BLOCK_M", "GLUON_MOE_TABLE", "GLUON_TABLE", "gluon_dense_config",
           "gluon_grouped_config", "gluon_grouped_entry", "gluon_moe_bucket", "gluon_moe_table_entry",
           "gluon_table_entry"]
