"""Triton fast path of the QUADS residual rule with ``granularity="channel"`` (per token; definition in
:mod:`.residual`, docs/quads_selection.md). Same bytes as :func:`verl_quads.nvfp4.residual.residual_quantize_channel`
(packed codes, E4M3 scale bytes, global scales, selected channels) and as its QDQ form. Also ``granularity=
"channel_sampled"`` (the row's threshold from a fixed sample of its scores; SAMPLE launches of the same kernel,
``_sample_threshold``; same bytes as :func:`verl_quads.nvfp4.residual.residual_quantize_channel_sampled`); launches
of many rows run the sampled rule's threshold search in kernels of its own first (``CHANNEL_CONFIG``
sample_split_rows: ``_sample_scores_kernel``, ``_sample_search_kernel``).

One program per row of ``x`` ``[M, K]`` (``_channel_row_kernel``), the whole row held on chip as two float32
``[NBP, 8]`` halves (elements 0..7 / 8..15 of each 16-block; NB = K / 16 blocks padded to a power of two NBP), one
thread per block, so block maxima, scales, packed words and QDQ stay in the thread:

1. first pass ``Q(x)`` under the row's global scale (the shared helpers of :mod:`.triton_kernels`: E4M3 block
   scale ``_scales_inv``, E2M1 rounding ``_hold_qdq_half``, packed words ``_tile_word``), ``R = x - deq(Q(x))`` in
   float32;
2. score ``R**2`` (times ``score_weight[c]``), float32 >= +0, so its int32 bit pattern orders like the value
   (padding -1 never counts); the row's ``NSEL`` highest scores by the threshold search ``_bits_threshold``
   (MSB-first over the 31 value bits, one full-row count per bit, stopped once the count is exact). When exactly
   NSEL scores are >= the threshold they are the selection; else ties at the threshold T go to the lowest channel
   indices, ranked in channel order by ``_half_ranks`` (per-thread counts + one cumulative sum over the NBP blocks)
   -- the reference's stable descending sort, without a sort. Launches of rows with K >= ``compact_min_k``
   (``CHANNEL_CONFIG`` compact_*: decode rows since session 8, every row count since session 16) take
   ``_compact_threshold`` instead: ``compact_bits`` full-row steps, then the row's candidates (scores
   sharing the accepted prefix; at most ``compact_cap``, else the full-row search continues) copied in channel
   order to a scratch row and read back as one short tile, which takes the remaining bits and the tie cut (the
   channel of the need-th tie) -- same selection;
3. ``R_sel`` = R on the selected channels, ``+0.0`` elsewhere; its row amax gives the second-pass global scale
   (``_gs_from_amax`` = :func:`~verl_quads.nvfp4.global_scale_from_amax` bit for bit) when the first pass's is per
   row (``[M, 1]``) or M == 1; with a per-tensor first-pass scale and M > 1 the amax is over the whole tensor:
   a first launch writes each row's amax of R_sel (GS2 = 2), torch takes ``global_scale_from_amax`` of their max
   (the reference's ``r_sel.abs().amax()``), and a second launch uses it (GS2 = 1);
4. second pass ``Q(R_sel)`` dense over the original 16-blocks; PACK: both passes' words / scale bytes, the
   ascending channel indices ``[M, NSEL]`` (slot = rank of the channel in the selection) and the row's gs2; else
   the QDQ ``deq(Q(x)) + deq(Q(R_sel))`` summed in float32 over EVERY channel (an unselected one adds +0.0, as the
   reference's dense sum does) and cast once.

Speed (H200, bf16 k = 0.5, docs/bench_nvfp4_h200_channel_s6.txt, run 3): QDQ 65 us = 7.6x plain QDQ at 4096x2048
(session 5: 77 us), 640 us = 8.9x at 8192x8192 (was 925), 22.5 us = 5.2x at 2048x768, 10.6 us at 256x2048 (2.0-3.4x:
the plain kernel took 3.1-5.3 us there across runs); packed ``residual_quantize`` 99 us / 1010 us (was 121 / 1330).
The block rule costs ~2x. Decode (session 7, docs/bench_nvfp4_h200_channel_s7.txt: STOP probes at 16x8192, k = 0.5):
17.9 us = 5.8 load + first pass (this run's launch floor) + 10.1 search (31 steps, 0.33 us each) + 1.9 tie ranks /
selection / amax + 0.2 second pass; a step's cost grows with the entries per SM (16x2048, 4 warps: 0.07 us), so it
is per-entry work, not barriers. The row's threshold search (~28 dependent full-row counts for bf16 rows, which tie at the
threshold) is the floor of this design: every measured way to take fewer, longer steps was slower
(``_bits_threshold``), as were a [NBP, 16] tile layout and other warp counts (uncapped); what helped was this layout
(one thread per block) and the register caps of ``CHANNEL_CONFIG`` (more rows in flight per SM). Session 8
(docs/bench_nvfp4_h200_channel_s8.txt): fewer full-row steps by the compacted search (``_compact_threshold``, the
default at <= 256 rows, K >= 2048; 12 full-row bits, a 256-entry tile in every warp, two bits per tile step, 8
warps at K = 8192): 16x8192 11.3 us (full-row search 17.7), 64x8192 11.5, 16x2048 7.41, 256x8192 21.7. Session 9
(docs/bench_nvfp4_h200_channel_s9.txt): launches of more rows than SMs at K <= 4096 take 4 warps (two rows per SM:
256x4096 16.2 -> 10.7 us); wider search steps (2-3 bits per full-row or tile step) measured slower. Session 10
(``CHANNEL_CONFIG`` comment): at K = 4096 the warp tile counts only its chunks that hold candidates and R_sel's amax
comes from the first full-row step's reduction where the row's largest |R| is selected. Rows longer than
``CHANNEL_CONFIG["max_k"]`` channels raise NotImplementedError (no tiled variant yet; never the block rule, never a
silent switch to torch). Kernels run with ``enable_fp_fusion=False`` and use no float negation (triton 3.6 lowers
``-v`` to ``0.0 - v``), as :mod:`.triton_kernels`.
"""

from __future__ import annotations

import contextlib

import torch

from verl_quads.nvfp4.format import BLOCK_SIZE, NVFP4Tensor
from verl_quads.nvfp4.reference import global_scale_from_amax
from verl_quads.nvfp4.residual import (
    ChannelResidualNVFP4,
    SampledChannelResidualNVFP4,
    num_sampled_threshold_rank,
    num_selected_channels,
    samples_per_block,
)
from verl_quads.nvfp4.residual import residual_quantize_channel as _ref_residual_quantize_channel
from verl_quads.nvfp4.residual import residual_quantize_channel_sampled as _ref_residual_quantize_channel_sampled
from verl_quads.nvfp4 import triton_kernels as tk

triton = tk.triton
tl = tk.tl

#: ``_channel_row_kernel`` launch: warps so that a thread holds about ``elems_per_thread`` channels of the row (16 =
#: one 16-block per thread), clamped to [1, max_warps]; rows longer than ``max_k`` channels (padded to a power of two
#: of 16-blocks) are refused. Register caps per thread on a GPU (speed only; the interpreter has no registers and
#: ignores them): ``qdq_maxnreg`` for the QDQ launches, ``pack_maxnreg`` for the packed ones when the program has at
#: least ``pack_maxnreg_min_warps`` warps (None: uncapped). Why (H200, docs/bench_nvfp4_h200_channel_s6.txt run 3):
#: uncapped the kernel takes 81-94 (QDQ) / 106-108 (packed) registers on sm_90, so a 16-warp program (K = 8192)
#: holds a whole SM's register file and one row is in flight per SM; at 64 it spills 24 B (QDQ) / ~220 B (packed).
#: QDQ capped at 64: 640 vs 863 us at 8192x8192, 65.4 vs 68.1 at 4096x2048, equal at 2048x768 and 256x2048; packed
#: capped at 64: 1010 vs 1160 us at 8192x8192 (16 warps) but slower with 1-4 warps (28.4 vs 24.7 us at 2048x768).
#: Compacted threshold search (``compact_*``, session 8, issue #5: decode rows): launches of at most
#: ``compact_max_rows`` rows with at least ``compact_min_k`` channels run ``_compact_threshold`` instead of the 31-step
#: full-row ``_bits_threshold``: ``compact_bits`` MSB-first steps over the full row, then the row's candidates (scores
#: whose top ``compact_bits`` bits equal the accepted prefix, in channel order, at most ``compact_cap``) are copied
#: to a scratch row and the remaining bits and the tie ranks are searched over that short tile only (a row with
#: more candidates continues over the full row: same bytes, old speed). 0 rows = off. ``compact_maxnreg``: the register
#: cap of those launches (None: uncapped; sm_90 then gives 128 registers to a 16-warp program, spills outside the
#: search loops; with a decode launch's few rows one program per SM is in flight anyway). ``compact_tile_bits``: bits
#: per tile step (2: three candidate counts in one reduction, rows with < 1024 candidates). ``compact_warps``: warps of
#: a compacted launch by padded block count NBP (others: ``elems_per_thread``): 8 at K = 8192 (32 channels per thread).
#: ``compact_warp_tile``: the tile steps in every warp (``_warp_tile_search``; needs compact_cap 256, two tile bits).
#: Why these values (H200, bf16, k = 0.5, QDQ us, docs/bench_nvfp4_h200_channel_s8.txt run 1, full-row search ->
#: compact): 1x8192 17.5 -> 13.8, 16x8192 17.7 -> 14.0, 64x8192 17.9 -> 14.2, 16x2048 9.7 -> 8.9, 256x8192 27.3 -> 26.6
#: (packed residual_quantize 23.4 -> 19.1 at 16x8192, 43.3 -> 39.3 at 256x8192); rows and K outside the measured
#: 1-256 rows / K >= 2048 keep the full-row search. 8 bits (tile 1024) 15.1-15.4 us and the 64-register cap 16.5-17.1
#: were slower than 10 bits uncapped; 12 bits (tile 512) equal. Run 2 (same doc; bytes == torch reference in the
#: bench): two bits per tile step and 8 warps at K = 8192 together 16x8192 14.2 -> 12.0 us (full-row search 17.8),
#: 1x8192 13.8 -> 11.9, 64x8192 14.6 -> 12.3, 256x8192 27.0 -> 22.8 (packed 39.4 -> 35.0); at 16x2048 two bits 8.92 ->
#: 8.35 but 2 warps instead of 4 slower (9.9), hence 8 warps only at K = 8192 (NBP 512; other K keep their warps).
#: Phases (STOP probes, 16x8192, two bits): first pass 3.8 us, 10 full-row bits +3.0, compaction (scan, scratch
#: stores, barrier, tile loads) +2.1, tile search +3.6 (11 reductions: CTA barrier latency), tie cut +0.5.
#: Run 3 (same doc): the warp tile (``compact_warp_tile``: a 256-entry tile in every warp, barrier-free counts) with 12
#: full-row bits, vs run 2's default (10 bits, 1024-entry CTA tile): 16x8192 11.8 -> 11.3 us, 64x8192 12.2 -> 11.5,
#: 16x2048 8.16 -> 7.41, 256x8192 22.9 -> 21.7, 1x8192 9.54 -> 9.33 (packed equal); 11 bits was slower at 256x8192.
#: 16x8192 phases: 12 full-row bits +2.8 us, compaction +1.8, tile search +2.0 (10 warp steps), tie cut +0.7; the
#: candidates per row 75 mean / 93 max (the tile holds 256; more -> the full-row continuation).
#: ``compact_many_rows`` (None = off): compacted launches of more rows than this (the H200's 132 SMs) take
#: ``compact_many_warps`` (by NBP; no entry: the values above) -- with more rows than SMs
#: the registers per program decide whether an SM runs two rows at once (one wave instead of two). Session 9
#: (docs/bench_nvfp4_h200_channel_s9.txt run 2, bf16 k = 0.5, QDQ / packed us): 4 warps at K = 4096 (254
#: registers x 128 threads: two programs per SM; 8 warps take 136 registers: one) 256x4096 16.2 -> 10.7 / 22.1 ->
#: 17.7, 192x4096 15.4 -> 10.5 / 20.7 -> 15.7; a 128-register cap at 8 warps 12.1 / 17.7 at 256x4096. K = 8192 keeps
#: its launch: 4 warps = the default (no entry), 128-register cap 21.4 / 42.1 vs 21.1 / 34.4 at 256x8192 (spills),
#: 16 warps capped at 64 26.7 / 46.8 (the per-NBP register-cap override
#: that timed these caps is gone: no entry used it). 1-132 rows are unchanged (one row per SM at most). Run 3 (the adopted default vs
#: "s8", bytes == torch reference on the device): 256x4096 10.8 / 17.7 vs 16.4 / 22.2, 192x4096 10.9 / 16.2 vs
#: 15.7 / 20.9, 4x4096 9.13 / 11.8 vs 9.17 / 11.8.
#: Session 10 (issue #5: QUADS-bf16 at dense d4096 M=16 was 1.11x naive W4A4; ``python -m verl_quads.bench.channel_probe``,
#: H200 call 1 at f000b13, warm L2 graph replay as bench rollout's main table, us): the whole quads-bf16 call 21.0-21.2
#: = channel kernel 9.2 + the bf16-operand w4a16 GEMM 12.6 (Gluon); naive 18.7 = activation quantize 3.7 + W4A4 GEMM
#: 15.5. Kernel phases at 16x4096 (STOP probes): load + first pass 3.06 (plain QDQ 2.94), 12 full-row bits +2.64,
#: compaction +0.67, warp-tile search +1.98 (10 steps, ~0.2 us each: eight 32-entry chunks per warp although the
#: rows have <= 62 candidates), tie cut / selection / amax +0.42, second pass +0.21. Hence ``compact_tile_chunks``
#: (count only the chunks holding candidates: 2 / 4 / 8 for <= 64 / 128 / 256) and ``compact_rmax`` (R_sel's amax from
#: the first full-row step's reduction when the row's largest |R| is selected; measured alone: kernel 8.9-9.2 vs
#: 9.0-9.6), both as True (every launch), False, or a collection of padded block counts NBP where they apply: (256,) =
#: K = 4096 rows only (where measured). H200 call 2 at cc9b7ef (same probe, the new default vs "s9" = the launches
#: before, bytes == torch reference on the device first): channel kernel 8.51 vs 9.57 us at 16x4096, 8.81 vs 9.64 at
#: 64x4096, 10.65 vs 11.58 at 256x4096 (4 warps); quads-bf16 / naive d4096 M=16 20.39 / 18.87 us = 1.081x (s9 21.56 =
#: 1.143x), M=64 26.60 / 25.73 = 1.034x (1.067x), M=256 53.79 / 52.85 = 1.018x (1.036x). Call 3 at b506982: GPU bytes
#: test tests/gpu test_channel_default_at_4096_bit_exact passed (1 / 4 / 16 / 64 / 192 rows, ties, underflow, fp32 +
#: weight); kernel 8.35 vs 9.55 us at 4x4096, 7.55 vs 7.40 at 1x4096 (a tie: whole call 14.01 vs 14.08 us); the main
#: bench (with session 10's GLUON_TABLE) d4096 quads-bf16 / naive 0.80 / 0.82 / 0.93 / 1.06 / 1.02x at M = 1 / 4 / 16 /
#: 64 / 256 (goal <= 1.10x: met at every M). 11 / 10 full-row bits, 16 warps at K = 4096: measured no
#: better (call 1: within 0.1-0.2 us of the default; 10 bits 11.1 us at 4x4096: rows past 256 candidates; 16 warps
#: 12.5 us). Measured and removed (session 10): ``compact_track_above`` (the candidate count from a tracked count
#: above the prefix, without its own reduction; call 1 at f000b13, d4096 channel kernel at M = 16 / 64 / 4 / 1: 'ta'
#: 9.18 / 9.34 / 9.13 / 9.11 us, 'ta ra' 9.15 / 9.55 / 9.11 / 8.94, the then-default's two runs 9.16-9.26 / 9.29-9.58
#: / 9.24-9.25 / 9.03-9.06: within noise) and ``compact_row_bits2`` (two full-row bits per reduction: never timed on
#: a GPU, 12 B of spills in the offline sm_90 compile).
#: Session 16 (issue #5, many rows: dense prefill / large batches, where naive's GEMM now runs the decode-once path of
#: :mod:`.dequant_gemm` and the channel kernel is most of what QUADS-bf16 adds; ``python -m verl_quads.bench.channel_probe
#: --shapes d4096,d8192 --ms 256,1024,4096``, H200 call 4, one run, every variant's bytes == the torch reference on the
#: device, kernel alone, us): the compacted search at every row count (``compact_max_rows`` was 256) with 4 warps at
#: K = 8192 past 132 rows (``compact_many_warps`` 512: 4; was 8): 4096x8192 270 vs 363 (the previous default, kept as
#: variant "s15"), 1024x8192 72.1 vs 102, 256x8192 20.4 vs 22.1, 4096x4096 127 vs 156, 1024x4096 32.4 vs 44.4, 256x4096
#: 10.1 vs 10.3. Also timed there: 2 warps at K = 4096 (117 at 4096 rows but 13.7 vs 10.1 at 256), the full-row search
#: with 32 / 64 channels per thread (8 / 4 warps at K = 8192: 338 / 333 at 4096 rows) -- not taken. Call 7 (STOP probes,
#: 4096x8192): load + first pass 47 us (plain QDQ 38.8), 12 full-row bits +53, candidate compaction +75, tile search +22,
#: tie cut / selection / R_sel amax +52, second pass +4. Call 8 (two runs each, bytes == torch reference at every point):
#: session 10's ``compact_rmax`` + ``compact_tile_chunks`` also at K = 8192 (NBP 512; variant "ra at" = both at every K):
#: kernel 262-264 vs 276-280 us at 4096x8192, 68.7-69.5 vs 73.3-75.2 at 1024, 19.3-19.6 vs 20.6-20.7 at 256, 10.8-11.2
#: vs 11.8 at 16, 11.0-11.3 vs 11.7-12.3 at 64, 9.8 vs 10.2 at 1 row: taken (STOP 3 phase +25 instead of +52 us).
#: Session 17 (issue #5, many rows; docs/bench_rollout_h200_session17.txt): the K = 8192 launch of > 132 rows held
#: 255 registers and spilled 616 B per thread (offline ``scripts/triton36_check.sh --resources``), 2 programs = 8 warps
#: per SM; ncu (call 1, 4096x8192): 116 M warp instructions in 255 us, an issue slot used 45% of cycles, 1.9 warps per
#: scheduler (stalls per issue: fixed-latency wait 1.05, long scoreboard 0.67, short scoreboard 0.45).
#: ``compact_many_regs`` {NBP: (rows, maxnreg)}: launches of more than ``rows`` rows read x again after the search
#: (kernel RX: x, Q(x) and R are dead during it and recomputed from the re-read, the same values; L2 policy
#: evict_last on the first read) under the register cap ``maxnreg``: K = 8192 with 8 warps (``compact_many_warps``) and
#: 128 registers = 2 programs of 8 warps per SM (240 B spills); K = 4096 with 4 warps and 128 = 4 programs per SM,
#: hence only past 264 rows (two programs per SM on 132 SMs: one wave already; at 256 rows it measured 11.5 vs 10.2 us).
#: Kernel alone (channel_probe, QDQ, bf16, k = 0.5, us; calls 1 / 2, bytes == torch reference): 4096x8192 234 / 246 vs
#: 267 / 261 (the launch before, variant "s16"), 1024x8192 63.2 / 63.8 vs 67.2 / 73.0, 256x8192 17.8 vs 19.4, 4096x4096
#: 102 vs 135, 1024x4096 28.3 vs 32.6; packed residual_quantize (bench nvfp4 --channel): 1024x8192 108 vs 205, 256x8192
#: 31.6 vs 52.1, 4096x4096 183 vs 190. Measured and not taken (call 2): the cap without the re-read (1024x8192 72.3,
#: 4096x4096 117), the re-read without the cap (4096x4096 140; K = 8192 4 warps: 252 at 4096 rows), 8 warps uncapped
#: with the re-read (197 registers, one program per SM: 309 at 4096x8192), 16 warps capped at 128 (310).
#: ncu of the adopted launch at 4096x8192 (call 4): 147 M warp instructions (~140 per element and thread: the 8 warps
#: each also run the warp tile), 230 us, 0.63 issued per scheduler and cycle. Two ways to cut instructions measured
#: slower and removed (calls 4-5, bytes == torch reference): (a) the candidate tile without ranks -- each candidate's
#: slot from a relaxed per-row atomic counter (ptxas aggregates them per warp), score << 16 | channel in one int64
#: store, the tie cut by a 2-bit search over the channel bits of the unordered tile: 151 M instructions, 271 us at
#: 4096x8192 (kernel in the probe 280 vs 251), slower at every M (decode +3-5 us); (b) the tile as one [256] tensor over
#: the program (CTA-wide counts, ``compact_warp_tile`` False) instead of a copy per warp: 141 M, 240 us (probe 258 vs
#: 241 at 4096x8192, 67.7 vs 64.1 at 1024x8192, +1-1.2 us at 16 / 256 rows). The instructions are spread over every
#: phase (first pass ~27 per element, the 12 full-row bits ~39, the rest: compaction, tile, selection, second pass).
#: ``sample_*`` (``granularity="channel_sampled"``, session 27, issue #5: QUADS at dense M >= 1024): ``sample_warps``
#: {NBP: warps} (else ``_warps``), ``sample_maxnreg`` {NBP: register cap} (else the QDQ / packed caps),
#: ``sample_rmax`` (bool or NBPs: R_sel's amax = the row's largest |R|, taken in the threshold's last reduction; the
#: largest score is always selected unless nothing is; not with a score weight), ``sample_step_bits`` (2 or 3 bits per
#: search step over the sample), ``sample_digit_counts`` / ``sample_pick_tree`` / ``sample_full_blocks`` (session 35,
#: below). H200
#: (``python -m verl_quads.bench.channel_probe --granularity channel_sampled``, docs/bench_rollout_h200_session27.txt,
#: bytes == torch reference at every point; kernel alone, us, warm L2): 4096x8192 130-140 (the exact rule's launch 274),
#: 1024x8192 34.7-35.9 (68.7), 256x8192 11.3, 16x8192 8.6-8.9, 1x8192 6.2-6.4 (10.0); 4096x4096 60-62 (109), 1024x4096
#: 18.7-18.9 (28.6), 256x4096 8.5-8.7, 16x4096 7.3-7.5, 1x4096 5.2-5.5 (7.1). Measured slower or equal: 16 warps at K =
#: 8192 with the 64-register QDQ cap (the first launch: 139-143 at 4096 rows, 38.3 at 1024), 8 warps at K = 4096 (92-101
#: at 4096 rows), 4 warps at K = 8192 (183-191), x re-read after the search (131-140 / 65-69; removed after the
#: measurement, as compact_many_regs' re-read it held only the sample during the search), three bits per step
#: (144 / 69: more compares per reduction), a 96-register cap. Where the time goes (STOP probes, call 3): at 4096x8192
#: load + first pass 43 us, threshold search +54, selection + amax +5.5, second pass + store +12; at 4096x4096 23 / +24 /
#: +3.4 / +7.9 -- the search's ~10 dependent CTA-wide reductions (two bits per step until exactly NSS samples are >= th).
#: ``sample_split_rows`` (session 28, issue #5; an int: every K, a dict {NBP: rows}, None: never): launches of more
#: rows take the split search -- ``_sample_scores_kernel`` (the sample, int32 [M, S]: x read once more), then
#: ``_sample_search_kernel`` (``sample_search_rows`` rows per program of ``sample_search_warps`` warps), then the row
#: kernel reading each row's threshold (TIN) -- so that the search's dependent reductions no longer hold the row
#: program's registers (two programs per SM at K = 8192). H200 (``channel_probe --granularity channel_sampled``, bytes
#: == torch reference at every point, docs/bench_rollout_h200_session28.txt; kernel alone, us): 1 row per 1-warp search
#: program (shuffle-only reductions, up to 32 programs per SM): 4096x8192 118-129 vs 134-139 fused, 2048x8192 66.6-67.9
#: vs 72.3-75.3, 1024x8192 33.9-34.6 vs 34.4-36.2; at K = 4096 equal or slower (4096 rows 65.8-66.5 vs 64.8-65.4, 2048
#: 32.7-33.0 vs 32.2-32.4, 1024 20.1-20.4 vs 18.7) -> the split at K = 8192 past 1024 rows only. Parts at 4096x8192:
#: scores 22.4 us (64 MB of x read again from HBM), search +15, row kernel +74 (at 4096x4096: 11 / +16 / +36). Measured
#: slower: 2 / 4 / 8 / 16 rows per search program (4096x8192 search 22-29 us with 2-4 warps, the count reduction over
#: warps; 256 rows +10 us: one program per SM, latency), 8 warps for the scores kernel, 16 warps capped at 64 / 8 warps
#: capped at 64 (spills) / uncapped for the row kernel (within noise or slower).
#: Session 35 (issue #5: QUADS at dense M >= 1024; offline sm_90 SASS of the K = 4096 launch first,
#: ``scripts/sass_channel.py``, then H200
#: ``channel_probe --granularity channel_sampled``, bytes == torch reference at every timed point,
#: docs/bench_rollout_h200_session35.txt): ``sample_digit_counts`` -- a search step's three counts from each sample's
#: digit ``clamp((s - th) >> sh, 0, 3)`` as one packed increment (``_digit_count3``; the search loop 79 -> 66 SASS
#: instructions per step, 3 CTA barriers each either way); ``sample_pick_tree`` -- the samples taken from the
#: thread's block halves by a select tree on the position's bits (``_sample_pick``) instead of 8 compares, 8 selects
#: and a max per half; ``sample_full_blocks`` -- launches where K / 16 is a power of two drop the block masks;
#: ``sample_mask_select`` -- R_sel = R's bits AND a mask from the sign of e - th, so that the 32 per-thread selection
#: predicates are not packed into bit masks around the second-pass scale's divisions (the kernel 1776 -> 1544 SASS
#: instructions with all four). Call 2, the first three (us, two runs; session 34's launch, variant "s34", in
#: brackets): 4096x4096 56.2-58.7 (62.8-63.4), 1024x4096 16.3-16.6 (18.3-18.6), 1024x8192 32.4-34.5 (35.0-35.6),
#: 16x4096 6.8-6.9 (7.4), 16x8192 8.3 (8.6-8.7); 1 row within noise (whole d4096 M = 1 call 10.6-10.8 vs 11.0-11.2);
#: each option alone helps (4096x4096 no digits 59.8-60.3, no pick 59.5-59.7, masked 57.3-57.6). Call 3, three runs
#: each, with / without the mask select (s34): 4096x4096 52.2-56.1 / 54.6-56.1 (61.5-67.3), 1024x4096 16.0 / 16.4-16.5
#: (18.4-18.7), 1024x8192 31.1-32.3 / 32.5-33.0 (35.4-36.2), 16x4096 6.6 / 6.8-7.0 (7.2-7.3). Digit counts with three
#: bits per step (a tuple reduction: shuffles instead of REDUX, 169 SASS per step) not timed; the split search with
#: digit counts at K = 4096 still slower (61 vs 58 us at 4096 rows).
CHANNEL_CONFIG = {"elems_per_thread": 16, "max_warps": 16, "max_k": 32768, "qdq_maxnreg": 64, "pack_maxnreg": 64,
                  "pack_maxnreg_min_warps": 16, "compact_max_rows": 1 << 30, "compact_min_k": 2048, "compact_bits": 12,
                  "compact_cap": 256, "compact_maxnreg": None, "compact_tile_bits": 2, "compact_warps": {512: 8},
                  "compact_warp_tile": True, "compact_many_rows": 132, "compact_many_warps": {256: 4, 512: 8},
                  "compact_rmax": (256, 512), "compact_tile_chunks": (256, 512),
                  "compact_many_regs": {256: (264, 128), 512: (132, 128)}, "sample_warps": {256: 4, 512: 8},
                  "sample_maxnreg": {256: 128, 512: 128}, "sample_rmax": (256, 512),
                  "sample_step_bits": 2, "sample_split_rows": {512: 1024}, "sample_search_rows": 1,
                  "sample_search_warps": 1, "sample_digit_counts": True, "sample_pick_tree": True,
                  "sample_full_blocks": True, "sample_mask_select": True}

#: Named CHANNEL_CONFIG overrides timed side by side by ``python -m verl_quads.bench.nvfp4 --channel`` and run against
#: the reference by tests/gpu (same bytes): the default and the kernel without register caps. Tried at decode sizes in
#: session 7 and removed (H200, docs/bench_nvfp4_h200_channel_s7.txt): 32 warps per row, 8 warps per row, and three
#: other threshold searches (2 / 3 bits per step by a histogram of 16-bit fields in int64 words, and a search that
#: tracks min / max bounds of the candidates to skip bits and stop at one value): none was >= 10% faster at
#: 1-64 x 8192 or 16 x 2048, most were slower (up to 1.5x). Session 8 (the compacted search, ``compact_*`` above):
#: "full" = the 31-step full-row search at every M, "compact" = the compacted one at every M (= the default since
#: session 16), "compact cta" = run 2's
#: default (10 full-row bits, a 1024-entry tile counted by CTA-wide reductions), "compact r1 w16" = run 1's default
#: (the same with one bit per tile step and 16 warps at K = 8192), and "compact fallback"
#: (2 bits, 16-entry tile: nearly every row takes the full-row continuation; for the bytes tests, not a speed
#: candidate). Removed after run 1: 8 full-row bits, the 64-register cap (both slower); after run 2 (adopted in the
#: default): two bits per tile step, 8 warps at K = 8192; after run 3: the warp tile with 11 / 12 bits (12 adopted).
#: Session 9 (docs/bench_nvfp4_h200_channel_s9.txt; removed code in commits ca819a5, f0d4d22): "s8" = session 8's launches at every M
#: (no compact_many_* routing). Removed after run 1 / 2 (slower or equal at 1-64 rows, QDQ us vs the default): 3 / 2
#: bits per full-row step by one reduction of all digit counts (3: 12.1-12.3 vs 11.4-11.5 at 4-64 x 8192, 8.82 vs
#: 8.93 at 4x4096; 2: 13.0-13.2), 3 bits per warp-tile step (11.6-11.9 vs 11.4-11.5 at 4-64 x 8192, 9.3 vs 8.9 at
#: 4x4096), the candidate tile as int64 words (equal: 11.5 / 9.15 vs 11.3-11.5 / 8.92-8.98).
CHANNEL_VARIANTS = {"default": {}, "uncapped": {"qdq_maxnreg": None, "pack_maxnreg": None},
                    "full": {"compact_max_rows": 0}, "compact": {"compact_max_rows": 1 << 30},
                    "compact cta": {"compact_bits": 10, "compact_cap": 1024, "compact_warp_tile": False},
                    "compact r1 w16": {"compact_bits": 10, "compact_cap": 1024, "compact_warp_tile": False,
                                       "compact_tile_bits": 1, "compact_warps": {}},
                    "compact fallback": {"compact_max_rows": 1 << 30, "compact_min_k": 16, "compact_bits": 2,
                                         "compact_cap": 16, "compact_warp_tile": False},
                    "s8": {"compact_many_rows": None},
                    # session 10 (issue #5: dense d4096 M=16; python -m verl_quads.bench.channel_probe, H200 call 1):
                    # "s9" = the launches before session 10's compact_tile_chunks / compact_rmax defaults; opt-in
                    # options: ra = R_sel's amax without its own reduction, at = the warp tile's candidate chunks only
                    # (both at every K). 11 full-row bits ("b11") measured within 0.1-0.2 us of the default: removed
                    "s9": {"compact_tile_chunks": False, "compact_rmax": False},
                    "ra": {"compact_rmax": True, "compact_tile_chunks": False},
                    "at": {"compact_tile_chunks": True, "compact_rmax": False},
                    # session 16: the launches before (the compacted search up to 256 rows, 8 warps at K = 8192,
                    # ra / at at K = 4096 only); "ra at" = both options at every K (the default has them at 4096 / 8192)
                    "s15": {"compact_max_rows": 256, "compact_many_warps": {256: 4}, "compact_rmax": (256,),
                            "compact_tile_chunks": (256,)},
                    "ra at": {"compact_rmax": True, "compact_tile_chunks": True},
                    # session 17: the many-row launches before (4 warps at K = 8192, no re-read of x, uncapped)
                    "s16": {"compact_many_warps": {256: 4, 512: 4}, "compact_many_regs": {}},
                    # session 27 (granularity="channel_sampled" launches; the default: 8 warps at K = 8192, 4 at
                    # K = 4096, 128-register caps there, R_sel's amax from the row's largest |R|): the first launch
                    # (_warps, the QDQ cap, R_sel's amax by its own reduction), three bits per search step, 8 / 16
                    # warps at K = 4096 / 8192 (all measured slower or equal)
                    "sampled first": {"sample_warps": {}, "sample_maxnreg": {}, "sample_rmax": False},
                    "sampled b3": {"sample_step_bits": 3},
                    "sampled w8 w16": {"sample_warps": {256: 8, 512: 16}},
                    # session 28: the split search at every row count / never
                    "sampled split": {"sample_split_rows": 0}, "sampled fused": {"sample_split_rows": None},
                    # session 35 (the default has all four): "s34" = the launches before (three compares per sample
                    # and step, the samples picked by compares + max, the block masks computed at every K, R_sel by
                    # selects); one option off each; "s34 b3": three bits per step by compares ("sampled b3": by
                    # digits)
                    "s34": {"sample_digit_counts": False, "sample_pick_tree": False, "sample_full_blocks": False,
                            "sample_mask_select": False},
                    "sampled no digits": {"sample_digit_counts": False},
                    "sampled no pick": {"sample_pick_tree": False},
                    "sampled masked": {"sample_full_blocks": False},
                    "s34 b3": {"sample_digit_counts": False, "sample_step_bits": 3},
                    "sampled where": {"sample_mask_select": False}}
# Session 33 (issue #5; docs/bench_rollout_h200_session33.txt, entries removed after the call, they are in commit
# 904f3a5): sample_warps {256: 2}, sample_maxnreg {256: 96 / 168} (also with 2 warps), 4 warps or a 168-register cap
# at K = 8192: all slower than the default at 16 / 1024 / 4096 rows.

if triton is not None:
    _scales_inv = tk._scales_inv
    _gs_from_amax = tk._gs_from_amax
    _hold_qdq_half = tk._hold_qdq_half
    _load_halves = tk._load_halves
    _load_halves_ev = tk._load_halves_ev
    _store_halves = tk._store_halves
    _tile_word = tk._tile_word
    _bits_threshold = tk._bits_threshold

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
    def _below(e, cand):
        """1 where e < cand else 0 (int32), for e in [-1, 2**31) and cand in [1, 2**31): the sign bit of e - cand."""
        return ((e - cand).to(tl.uint32, bitcast=True) >> 31).to(tl.int32, bitcast=True)

    @triton.jit
    def _at_least(e, cand):
        """1 where e >= cand else 0 (int32), for e in [-1, 2**31) and cand in [1, 2**31): the sign bit of
        cand - 1 - e (no overflow)."""
        return ((cand - 1 - e).to(tl.uint32, bitcast=True) >> 31).to(tl.int32, bitcast=True)

    @triton.jit
    def _count_ge(e0, e1, cand, NBP: tl.constexpr):
        """#(entries >= cand) of the score bits e0, e1 (int32 [NBP, 8], real entries in [0, 2**31), padding -1;
        cand in [1, 2**31)): e - cand cannot overflow and its sign bit (1 where e < cand, a logical shift) is summed
        per thread first, then over the row (sm_90: a subtract and a shift-accumulate per entry; a sum of compare
        flags compiles to predicate bits + popc, ~5 instructions per entry)."""
        return NBP * 16 - tl.sum(tl.sum(_below(e0, cand) + _below(e1, cand), axis=1), axis=0)

    @triton.jit
    def _row_bits(e0, e1, th, cnt, k, KEND: tl.constexpr, NSEL, NBP: tl.constexpr):
        """MSB-first full-row steps of the threshold search over the score bits e0, e1 (``_count_ge``): from step k
        (bit 30 - k) while k < KEND and #(e >= th) != NSEL, accept bit 30 - k when the count of th | bit reaches NSEL.
        Returns (th, cnt = #(e >= th), k). ``_compact_threshold``'s first J bits (KEND = J) and its full-row
        continuation (KEND = 31)."""
        while (k < KEND) & (cnt != NSEL):
            cand = th | (1 << (30 - k))
            n = _count_ge(e0, e1, cand, NBP)
            take = n >= NSEL
            th = tl.where(take, cand, th)
            cnt = tl.where(take, n, cnt)
            k += 1
        return th, cnt, k

    @triton.jit
    def _sum_max(a, b, c, d):
        return a + c, tl.maximum(b, d)

    @triton.jit
    def _count_ge_max(e0, e1, cand, rpart, NBP: tl.constexpr):
        """(``_count_ge`` (e0, e1, cand), max of rpart) in ONE two-operand reduction over the row (rpart: int32 [NBP])."""
        part = tl.sum(_below(e0, cand) + _below(e1, cand), axis=1)
        tot, mx = tl.reduce((part, rpart), 0, _sum_max)
        return NBP * 16 - tot, mx

    @triton.jit
    def _row_ties(e0, e1, th, NSEL):
        """Full-row tie cut at the threshold th (#(e >= th) > NSEL): flags (int1 [NBP, 8], ``_load_halves`` layout)
        of the entries == th ranked <= need = NSEL - #(e > th) in channel order (``_half_ranks``), i.e. the ties the
        reference's stable descending sort takes. The full-row search's selection and ``_compact_threshold``'s
        full-row continuation."""
        eq0 = e0 == th
        eq1 = e1 == th
        need = NSEL - tl.sum(tl.sum((e0 > th).to(tl.int32), axis=1) + tl.sum((e1 > th).to(tl.int32), axis=1), axis=0)
        q0, q1 = _half_ranks(eq0.to(tl.int32), eq1.to(tl.int32))
        return eq0 & (q0 <= need), eq1 & (q1 <= need)

    @triton.jit
    def _wt_load(scr, j: tl.constexpr, ncand, CAP: tl.constexpr):
        """Chunk j of the candidate tile as [32] tensors (scores, padding -1; channels): a [32] tensor is one warp's
        (every warp holds a copy), so its reductions need no barrier."""
        i = j * 32 + tl.arange(0, 32)
        return tl.load(scr + i, mask=i < ncand, other=-1), tl.load(scr + CAP + i, mask=i < ncand, other=0)

    @triton.jit
    def _wt3(t, c1, c2, c3):
        """#(t >= c1) | #(t >= c2) << 10 | #(t >= c3) << 20 per element (summed: three counts < 1024)."""
        return _at_least(t, c1) + (_at_least(t, c2) << 10) + (_at_least(t, c3) << 20)

    @triton.jit
    def _wt_tie(t, tch, th, need, base, cstar):
        """Tie cut over one [32] chunk (channel order): ties before it ``base``; returns (base + its ties, cstar
        raised to the channel of its last tie ranked <= need)."""
        tie = (t == th).to(tl.int32)
        r = tl.cumsum(tie, axis=0) + base
        cstar = tl.maximum(cstar, tl.max(tl.where((tie != 0) & (r <= need), tch, -1), axis=0))
        return base + tl.sum(tie, axis=0), cstar

    @triton.jit
    def _wt_sum(t0, t1, t2, t3, t4, t5, t6, t7, c1, c2, c3, NCH: tl.constexpr):
        """Sum over the tile's first NCH (2, 4 or 8) chunks of ``_wt3`` (one warp reduction)."""
        s = _wt3(t0, c1, c2, c3) + _wt3(t1, c1, c2, c3)
        if NCH >= 4:
            s = s + _wt3(t2, c1, c2, c3) + _wt3(t3, c1, c2, c3)
        if NCH >= 8:
            s = s + _wt3(t4, c1, c2, c3) + _wt3(t5, c1, c2, c3) + _wt3(t6, c1, c2, c3) + _wt3(t7, c1, c2, c3)
        return tl.sum(s, axis=0)

    @triton.jit
    def _wt_sum1(t0, t1, t2, t3, t4, t5, t6, t7, cand, NCH: tl.constexpr):
        s = _at_least(t0, cand) + _at_least(t1, cand)
        if NCH >= 4:
            s = s + _at_least(t2, cand) + _at_least(t3, cand)
        if NCH >= 8:
            s = s + _at_least(t4, cand) + _at_least(t5, cand) + _at_least(t6, cand) + _at_least(t7, cand)
        return tl.sum(s, axis=0)

    @triton.jit
    def _wt_gt(t0, t1, t2, t3, t4, t5, t6, t7, th, NCH: tl.constexpr):
        s = (t0 > th).to(tl.int32) + (t1 > th).to(tl.int32)
        if NCH >= 4:
            s = s + (t2 > th).to(tl.int32) + (t3 > th).to(tl.int32)
        if NCH >= 8:
            s = s + (t4 > th).to(tl.int32) + (t5 > th).to(tl.int32) + (t6 > th).to(tl.int32) + (t7 > th).to(tl.int32)
        return tl.sum(s, axis=0)

    @triton.jit
    def _warp_tile_search(scr, ncand, th, cnt, k, above, NSEL, CAP: tl.constexpr, PHASE: tl.constexpr,
                          NCH: tl.constexpr = 8):
        """``_compact_threshold``'s tile steps (two bits per step, then the tie cut) over a 256-entry tile held by
        EVERY warp as eight [32] chunks: each warp counts the whole tile itself (redundant, barrier-free warp
        reductions) instead of one CTA-wide reduction per step. NCH (2 / 4 / 8): only the first NCH chunks, for
        ncand <= 32 * NCH (fewer entries per lane and step: the caller picks it per row). Returns (th, cnt, k,
        cstar)."""
        t0, h0 = _wt_load(scr, 0, ncand, CAP)
        t1, h1 = _wt_load(scr, 1, ncand, CAP)
        t2, h2 = t0, h0  # chunks past NCH: never read
        t3, h3 = t0, h0
        t4, h4 = t0, h0
        t5, h5 = t0, h0
        t6, h6 = t0, h0
        t7, h7 = t0, h0
        if NCH >= 4:
            t2, h2 = _wt_load(scr, 2, ncand, CAP)
            t3, h3 = _wt_load(scr, 3, ncand, CAP)
        if NCH >= 8:
            t4, h4 = _wt_load(scr, 4, ncand, CAP)
            t5, h5 = _wt_load(scr, 5, ncand, CAP)
            t6, h6 = _wt_load(scr, 6, ncand, CAP)
            t7, h7 = _wt_load(scr, 7, ncand, CAP)
        cstar = th * 0 + 0x7FFFFFFF
        if PHASE == 2:
            hm = tl.maximum(tl.maximum(tl.maximum(h0, h1), tl.maximum(h2, h3)),
                            tl.maximum(tl.maximum(h4, h5), tl.maximum(h6, h7)))
            tm_ = tl.maximum(tl.maximum(tl.maximum(t0, t1), tl.maximum(t2, t3)),
                             tl.maximum(tl.maximum(t4, t5), tl.maximum(t6, t7)))
            cstar = tl.max(tl.maximum(hm, tm_), axis=0)
            k = k + 31  # no tile search
        while (k < 31) & (cnt != NSEL):
            if k < 30:
                c1 = th | (1 << (29 - k))
                c2 = th | (2 << (29 - k))
                c3 = th | (3 << (29 - k))
                sp = _wt_sum(t0, t1, t2, t3, t4, t5, t6, t7, c1, c2, c3, NCH)
                n1 = above + (sp & 1023)
                n2 = above + ((sp >> 10) & 1023)
                n3 = above + (sp >> 20)
                th = tl.where(n3 >= NSEL, c3, tl.where(n2 >= NSEL, c2, tl.where(n1 >= NSEL, c1, th)))
                cnt = tl.where(n3 >= NSEL, n3, tl.where(n2 >= NSEL, n2, tl.where(n1 >= NSEL, n1, cnt)))
                k += 2
            else:
                cand = th | 1
                n = above + _wt_sum1(t0, t1, t2, t3, t4, t5, t6, t7, cand, NCH)
                take = n >= NSEL
                th = tl.where(take, cand, th)
                cnt = tl.where(take, n, cnt)
                k += 1
        if (cnt != NSEL) & (PHASE == 0):
            need = NSEL - above - _wt_gt(t0, t1, t2, t3, t4, t5, t6, t7, th, NCH)
            base = th * 0
            cs = base - 1
            base, cs = _wt_tie(t0, h0, th, need, base, cs)
            base, cs = _wt_tie(t1, h1, th, need, base, cs)
            if NCH >= 4:
                base, cs = _wt_tie(t2, h2, th, need, base, cs)
                base, cs = _wt_tie(t3, h3, th, need, base, cs)
            if NCH >= 8:
                base, cs = _wt_tie(t4, h4, th, need, base, cs)
                base, cs = _wt_tie(t5, h5, th, need, base, cs)
                base, cs = _wt_tie(t6, h6, th, need, base, cs)
                base, cs = _wt_tie(t7, h7, th, need, base, cs)
            cstar = cs
        return th, cnt, k, cstar

    @triton.jit
    def _compact_threshold(e0, e1, c, NSEL, NVALID, scr, NBP: tl.constexpr, J: tl.constexpr, CAP: tl.constexpr,
                           TR: tl.constexpr = 1, PHASE: tl.constexpr = 0, WT: tl.constexpr = False,
                           rpart=None, RA: tl.constexpr = False, AT: tl.constexpr = False):
        """Threshold of the row's NSEL highest scores and its tie cut: returns (th, cstar) int32 scalars such that
        the selection is ``e > th | (e == th & channel <= cstar)`` -- the NSEL highest scores, ties to the lower
        channels (the reference's stable descending sort), the same set as ``_bits_threshold`` + ``_half_ranks``.

        e0, e1: int32 [NBP, 8] score bits (``_load_halves`` layout: channel 16 b + j / 16 b + 8 + j of block b = c[b]),
        padding -1; scr: this row's int32 scratch, 2 * CAP entries (candidate scores, then their channels).
        1. MSB-first bitwise steps over the full row for bits 30 .. 31 - J (stop once #(e >= th) == NSEL: then every
           entry >= th is selected, cstar = 2**31 - 1);
        2. the candidates (entries whose top J bits equal th's: the threshold lies among them; #(above) = the count
           of th minus theirs) in channel order (``_half_ranks`` of their flags) are stored to scr, and after a
           barrier read back as one [CAP] tile (padding -1); the remaining 31 - J bits are searched over the tile
           (counts: above + the tile's), with the same early stop; TR = 2: two bits per step while two remain
           (3 candidate counts packed as 10-bit fields in one reduction; needs < 1024 candidates);
        3. ties at the final T (count > NSEL): need = NSEL - #(> T); the tile's cumulative count of entries == T
           (channel order) gives cstar = the channel of the need-th tie.
        More than CAP candidates: steps 2-3 over the full row instead (the full-row ranks of ``_half_ranks``).
        WT (CAP = 256): steps 2-3 by ``_warp_tile_search`` (every warp holds the whole tile; two bits per step).
        PHASE (the kernel's STOP 4 / 5 timing probes; 0 = all): 1 returns after step 1's full-row bits, 2 after the
        tile is stored and read back (cstar = the tile's largest channel, to keep the load); not a selection.
        RA (rpart: int32 [NBP], per thread the largest |R| bits): the first full-row step's reduction also takes
        rpart's max, returned as rmx (the row's largest |R| bits; else 0). AT (WT): the warp tile's chunks past the
        candidates are not counted (2 / 4 / 8 chunks for <= 64 / 128 / 256 candidates). Returns (th, cstar, rmx)."""
        th = tl.full((), 0, tl.int32)
        cnt = th + NVALID
        k = th * 0
        rmx = th * 0
        if RA:  # step 0 by hand (its count and the row's max |R| in one reduction); a no-op once cnt == NSEL
            n0, rmx = _count_ge_max(e0, e1, th | (1 << 30), rpart, NBP)
            take = (n0 >= NSEL) & (cnt != NSEL)
            th = tl.where(take, th | (1 << 30), th)
            cnt = tl.where(take, n0, cnt)
            k = k + 1
        th, cnt, k = _row_bits(e0, e1, th, cnt, k, J, NSEL, NBP)
        cstar = th * 0 + 0x7FFFFFFF
        if (cnt != NSEL) & (PHASE != 1):
            f0 = ((e0 >> (31 - J)) == (th >> (31 - J))).to(tl.int32)  # padding -1 >> s = -1 never equals th's
            f1 = ((e1 >> (31 - J)) == (th >> (31 - J))).to(tl.int32)
            ncand = tl.sum(tl.sum(f0, axis=1) + tl.sum(f1, axis=1), axis=0)
            ch0 = c[:, None] * 16 + tl.arange(0, 8)[None, :]
            ch1 = ch0 + 8
            if (ncand <= CAP) & ((TR == 1) | (ncand < 1024)):  # TR 2: a count must fit 10 bits
                p0, p1 = _half_ranks(f0, f1)
                tl.store(scr + p0 - 1, e0, mask=f0 != 0)
                tl.store(scr + p1 - 1, e1, mask=f1 != 0)
                tl.store(scr + CAP + p0 - 1, ch0, mask=f0 != 0)
                tl.store(scr + CAP + p1 - 1, ch1, mask=f1 != 0)
                tl.debug_barrier()  # the row's stores are visible to the whole program
                above = cnt - ncand
                if WT and AT:  # the tile in every warp, only the chunks that hold candidates
                    if ncand <= 64:
                        th, cnt, k, cstar = _warp_tile_search(scr, ncand, th, cnt, k, above, NSEL, CAP, PHASE, 2)
                    elif ncand <= 128:
                        th, cnt, k, cstar = _warp_tile_search(scr, ncand, th, cnt, k, above, NSEL, CAP, PHASE, 4)
                    else:
                        th, cnt, k, cstar = _warp_tile_search(scr, ncand, th, cnt, k, above, NSEL, CAP, PHASE, 8)
                elif WT:  # the tile in every warp (CAP = 256): barrier-free counts
                    th, cnt, k, cstar = _warp_tile_search(scr, ncand, th, cnt, k, above, NSEL, CAP, PHASE)
                else:
                    i = tl.arange(0, CAP)
                    tv = tl.load(scr + i, mask=i < ncand, other=-1)
                    tch = tl.load(scr + CAP + i, mask=i < ncand, other=0)
                    if PHASE == 2:
                        cstar = tl.max(tch, axis=0)
                        k = k + 31  # no tile search
                    while (k < 31) & (cnt != NSEL):
                        if (TR == 2) & (k < 30):  # two bits: 3 candidates' tile counts, 10-bit fields of one sum
                            c1 = th | (1 << (29 - k))
                            c2 = th | (2 << (29 - k))
                            c3 = th | (3 << (29 - k))
                            sp = tl.sum(_at_least(tv, c1) + (_at_least(tv, c2) << 10) + (_at_least(tv, c3) << 20),
                                        axis=0)
                            n1 = above + (sp & 1023)
                            n2 = above + ((sp >> 10) & 1023)
                            n3 = above + (sp >> 20)  # n1 >= n2 >= n3: the largest digit whose count reaches NSEL
                            th = tl.where(n3 >= NSEL, c3, tl.where(n2 >= NSEL, c2, tl.where(n1 >= NSEL, c1, th)))
                            cnt = tl.where(n3 >= NSEL, n3, tl.where(n2 >= NSEL, n2, tl.where(n1 >= NSEL, n1, cnt)))
                            k += 2
                        else:
                            cand = th | (1 << (30 - k))
                            n = above + CAP - tl.sum(_below(tv, cand), axis=0)
                            take = n >= NSEL
                            th = tl.where(take, cand, th)
                            cnt = tl.where(take, n, cnt)
                            k += 1
                    if (cnt != NSEL) & (PHASE == 0):
                        tie = tv == th
                        need = NSEL - above - tl.sum((tv > th).to(tl.int32), axis=0)
                        rk = tl.cumsum(tie.to(tl.int32), axis=0)
                        cstar = tl.max(tl.where(tie & (rk <= need), tch, -1), axis=0)
            else:
                th, cnt, k = _row_bits(e0, e1, th, cnt, k, 31, NSEL, NBP)
                if cnt != NSEL:
                    t0, t1 = _row_ties(e0, e1, th, NSEL)
                    cstar = tl.maximum(tl.max(tl.max(tl.where(t0, ch0, -1), axis=1), axis=0),
                                       tl.max(tl.max(tl.where(t1, ch1, -1), axis=1), axis=0))
        return th, cstar, rmx

    @triton.jit
    def _sample_pos(e0, e1, c, OFF: tl.constexpr):
        """Per block b the score of channel 16 b + ((b + OFF) mod 16) ([NBP]; padding blocks -1)."""
        j = tl.arange(0, 8)[None, :]
        p = ((c + OFF) % 16)[:, None]
        return tl.maximum(tl.max(tl.where(j == p, e0, -1), axis=1), tl.max(tl.where(j + 8 == p, e1, -1), axis=1))

    @triton.jit
    def _pick_half(h, p):
        """h[b, p[b] mod 8] of h [NBP, 8] (a thread's 8 entries of one block half) by a binary tree of selects on
        the bits of p (three halvings: 4 + 2 + 1 selects) instead of 8 compares, 8 selects and a max."""
        lo, hi = tl.split(tl.reshape(h, (h.shape[0], 4, 2)))
        h4 = tl.where(((p & 1) != 0)[:, None], hi, lo)
        lo, hi = tl.split(tl.reshape(h4, (h.shape[0], 2, 2)))
        h2 = tl.where(((p & 2) != 0)[:, None], hi, lo)
        lo, hi = tl.split(h2)
        return tl.where((p & 4) != 0, hi, lo)

    @triton.jit
    def _sample_pick(e0, e1, c, OFF: tl.constexpr):
        """``_sample_pos`` (the same entries; padding blocks hold -1 in both halves) by ``_pick_half``."""
        p = (c + OFF) % 16
        return tl.where(p >= 8, _pick_half(e1, p), _pick_half(e0, p))

    @triton.jit
    def _sample_at(e0, e1, c, OFF: tl.constexpr, PK: tl.constexpr):
        """The per-block sample at offset OFF ([NBP]): ``_sample_pick`` (PK) or ``_sample_pos``, the same entries."""
        if PK:
            return _sample_pick(e0, e1, c, OFF)
        else:
            return _sample_pos(e0, e1, c, OFF)

    @triton.jit
    def _min_max(a, b, c, d):
        return tl.minimum(a, c), tl.maximum(b, d)

    @triton.jit
    def _sum3(a, b, c, d, e, f):
        return a + d, b + e, c + f

    @triton.jit
    def _pick(n, cand, th, cnt, NSS):
        """(th, cnt) raised to (cand, n) where n >= NSS (candidates tried in increasing order)."""
        return tl.where(n >= NSS, cand, th), tl.where(n >= NSS, n, cnt)

    @triton.jit
    def _count3(samp, c1, c2, c3, AXIS: tl.constexpr, WIDE: tl.constexpr):
        """#(samp >= c1), #(samp >= c2), #(samp >= c3) along AXIS (c broadcast against samp, entries in [-1, 2**31))
        by one reduction: 10-bit fields of an int32 (at most 1023 entries per search), WIDE 16-bit fields of an
        int64 (at most 65535)."""
        if WIDE:
            sp = tl.sum(_at_least(samp, c1).to(tl.int64) + (_at_least(samp, c2).to(tl.int64) << 16)
                        + (_at_least(samp, c3).to(tl.int64) << 32), axis=AXIS)
            return (sp & 65535).to(tl.int32), ((sp >> 16) & 65535).to(tl.int32), (sp >> 32).to(tl.int32)
        else:
            sp = tl.sum(_at_least(samp, c1) + (_at_least(samp, c2) << 10) + (_at_least(samp, c3) << 20), axis=AXIS)
            return sp & 1023, (sp >> 10) & 1023, sp >> 20

    @triton.jit
    def _digit_fields(d):
        """For digits d in 0..3 (int32): an int32 whose 10-bit fields 1..d hold 1 (field f at bits 10 (f - 1)), the
        packed increment of #(digit >= 1), #(digit >= 2), #(digit >= 3)."""
        return (d * 0 + 0x100401) >> (30 - 10 * d)

    @triton.jit
    def _digit_count3(samp, th, sh, AXIS: tl.constexpr, WIDE: tl.constexpr):
        """``_count3`` of the candidates th | d << sh (d = 1, 2, 3; th's bits below sh + 2 are 0, so th | d << sh =
        th + d << sh) from each entry's digit dd = clamp((samp - th) >> sh, 0, 3) (arithmetic shift: entries below
        th give 0, entries above the 2-bit bucket 3): entry >= th | d << sh exactly when dd >= d, so one packed
        increment per entry, the fields 1..dd set (``_digit_fields``; WIDE: 16-bit fields of an int64),
        instead of three compares. Same counts (samp in [-1, 2**31), th in [0, 2**31): no overflow)."""
        dd = tl.minimum(tl.maximum((samp - th) >> sh, 0), 3)
        if WIDE:
            sp = tl.sum((dd.to(tl.int64) * 0 + 0x100010001) >> (48 - 16 * dd).to(tl.int64), axis=AXIS)
            return (sp & 65535).to(tl.int32), ((sp >> 16) & 65535).to(tl.int32), (sp >> 32).to(tl.int32)
        else:
            sp = tl.sum(_digit_fields(dd), axis=AXIS)
            return sp & 1023, (sp >> 10) & 1023, sp >> 20

    @triton.jit
    def _search_step2(samp, th, cnt, sh, NSS, ROWS: tl.constexpr, WIDE: tl.constexpr, DG: tl.constexpr = False):
        """One two-bit step of the MSB-first search for the NSS-th highest entry of samp: (th, cnt = #(samp >= th))
        raised to the highest th | d << sh (d = 1, 2, 3) with at least NSS entries at or above it (``_count3``; DG:
        ``_digit_count3``, the same counts). ROWS: samp [R, N], th and cnt [R] (one search per row, reduced along
        axis 1); else samp [N], scalars."""
        c1 = th | (1 << sh)
        c2 = th | (2 << sh)
        c3 = th | (3 << sh)
        if DG:
            if ROWS:
                n1, n2, n3 = _digit_count3(samp, th[:, None], sh, 1, WIDE)
            else:
                n1, n2, n3 = _digit_count3(samp, th, sh, 0, WIDE)
        elif ROWS:
            n1, n2, n3 = _count3(samp, c1[:, None], c2[:, None], c3[:, None], 1, WIDE)
        else:
            n1, n2, n3 = _count3(samp, c1, c2, c3, 0, WIDE)
        th2 = tl.where(n3 >= NSS, c3, tl.where(n2 >= NSS, c2, tl.where(n1 >= NSS, c1, th)))
        cnt2 = tl.where(n3 >= NSS, n3, tl.where(n2 >= NSS, n2, tl.where(n1 >= NSS, n1, cnt)))
        return th2, cnt2

    @triton.jit
    def _search_step1(samp, th, cnt, NSS, ROWS: tl.constexpr):
        """The search's last bit (bit 0), as ``_search_step2`` with one candidate."""
        cand = th | 1
        if ROWS:
            n = tl.sum(_at_least(samp, cand[:, None]), axis=1)
        else:
            n = tl.sum(_at_least(samp, cand), axis=0)
        return tl.where(n >= NSS, cand, th), tl.where(n >= NSS, n, cnt)

    @triton.jit
    def _search_step(samp, th, cnt, k, NSS, ROWS: tl.constexpr, WIDE: tl.constexpr, DG: tl.constexpr = False):
        """Step k of the sample search (k bits decided): bits 30 - k and 29 - k by ``_search_step2`` (DG: digit
        counts) while two remain, else bit 0 by ``_search_step1``. Returns (th, cnt, k after the step)."""
        if k < 30:
            th, cnt = _search_step2(samp, th, cnt, 29 - k, NSS, ROWS, WIDE, DG)
            k += 2
        else:
            th, cnt = _search_step1(samp, th, cnt, NSS, ROWS)
            k += 1
        return th, cnt, k

    @triton.jit
    def _sample_threshold(e0, e1, c, NSS, NB, NBP: tl.constexpr, SP: tl.constexpr, rpart=None,
                          RA: tl.constexpr = False, SB: tl.constexpr = 2, DG: tl.constexpr = False,
                          PK: tl.constexpr = False):
        """The row's threshold under ``granularity="channel_sampled"`` (int32 score bits; select ``e >= T``): the
        NSS-th highest of the sampled scores (SP per block: channels 16 b + ((b + i 16 / SP) mod 16), taken from the
        thread's own block, no data movement), NSS > 0; 0x7FFFFFFF (nothing) for NSS == 0, 0 (everything) for
        NSS < 0. MSB-first search over the sample, two bits per step (three counts packed in one reduction: 10-bit
        fields while NBP <= 512, i.e. <= 512 samples, else 16-bit fields of an int64), stopped once exactly NSS
        samples are >= th; T = the least sample >= th. RA (rpart: int32 [NBP], per thread the largest |R| bits): that
        last reduction also takes rpart's max (SP == 1; else its own), returned as rmx (the row's largest |R| bits;
        else 0). SB = 3 (NBP <= 512): three bits per step while three remain (seven counts as 10-bit fields of three
        int32 sums in one tuple reduction). DG: the counts from each sample's digit (``_digit_count3``); PK (SP 1 or
        2): the samples taken by ``_sample_pick``. Returns (T, rmx)."""
        if SP == 1:
            samp = _sample_at(e0, e1, c, 0, PK)
        elif SP == 2:
            samp = tl.reshape(tl.join(_sample_at(e0, e1, c, 0, PK), _sample_at(e0, e1, c, 8, PK)), (NBP * 2,))
        else:  # the sampled entries of the row tile, the others -1 (never counted)
            j = tl.arange(0, 8)[None, :]
            cc = c[:, None]
            m0 = ((j - cc) % (16 // SP)) == 0  # (q - b) mod 16 is a multiple of 16 / SP (q = position in block)
            m1 = ((j + 8 - cc) % (16 // SP)) == 0
            samp = tl.reshape(tl.join(tl.where(m0, e0, -1), tl.where(m1, e1, -1)), (NBP * 16,))
        th = tl.full((), 0, tl.int32)
        if NSS > 0:
            cnt = th + NB * SP
            k = th * 0
            while (k < 31) & (cnt != NSS):
                if (SB == 3) & (NBP <= 512) & (k < 29):
                    d1 = th | (1 << (28 - k))
                    d2 = th | (2 << (28 - k))
                    d3 = th | (3 << (28 - k))
                    d4 = th | (4 << (28 - k))
                    d5 = th | (5 << (28 - k))
                    d6 = th | (6 << (28 - k))
                    d7 = th | (7 << (28 - k))
                    if DG:  # digit dd in 0..7 (d1 .. d7 = th + dd << (28 - k)); fields d1..d3, d4..d6, d7
                        dd = tl.minimum(tl.maximum((samp - th) >> (28 - k), 0), 7)
                        pa, pb, pc = tl.reduce((_digit_fields(tl.minimum(dd, 3)),
                                                _digit_fields(tl.minimum(tl.maximum(dd - 3, 0), 3)),
                                                (dd >= 7).to(tl.int32)), 0, _sum3)
                    else:
                        pa, pb, pc = tl.reduce((_at_least(samp, d1) + (_at_least(samp, d2) << 10)
                                                + (_at_least(samp, d3) << 20),
                                                _at_least(samp, d4) + (_at_least(samp, d5) << 10)
                                                + (_at_least(samp, d6) << 20),
                                                _at_least(samp, d7)), 0, _sum3)
                    th, cnt = _pick(pa & 1023, d1, th, cnt, NSS)  # counts fall as the candidate rises
                    th, cnt = _pick((pa >> 10) & 1023, d2, th, cnt, NSS)
                    th, cnt = _pick(pa >> 20, d3, th, cnt, NSS)
                    th, cnt = _pick(pb & 1023, d4, th, cnt, NSS)
                    th, cnt = _pick((pb >> 10) & 1023, d5, th, cnt, NSS)
                    th, cnt = _pick(pb >> 20, d6, th, cnt, NSS)
                    th, cnt = _pick(pc, d7, th, cnt, NSS)
                    k += 3
                else:
                    th, cnt, k = _search_step(samp, th, cnt, k, NSS, False, NBP > 512, DG)
            if RA and SP == 1:  # samp and rpart are both [NBP]: one reduction
                th, rmx = tl.reduce((tl.where(samp >= th, samp, 0x7FFFFFFF), rpart), 0, _min_max)
            else:
                th = tl.min(tl.where(samp >= th, samp, 0x7FFFFFFF), axis=0)
                rmx = th * 0
                if RA:
                    rmx = tl.max(rpart, axis=0)
        else:
            rmx = th * 0
            if RA:
                rmx = tl.max(rpart, axis=0)
            if NSS == 0:
                th = th + 0x7FFFFFFF
        return th, rmx

    @triton.jit
    def _row_scale(bmax, gs_ptr, row, GS_DIV, NBP: tl.constexpr, ROW_GS: tl.constexpr):
        """The first pass's global scale of ``row`` and its reciprocal (float32 [NBP], the same in every entry):
        ROW_GS from the row's amax (the max of its block maxima bmax; padding blocks hold +0.0), else
        ``gs_ptr[row // GS_DIV]``."""
        if ROW_GS:
            gs = _gs_from_amax(tl.zeros([NBP], tl.float32) + tl.max(bmax, axis=0))
            inv = tl.math.div_rn(tl.full([NBP], 1.0, tl.float32), gs)
        else:
            g = tl.load(gs_ptr + row // GS_DIV)
            gs = tl.zeros([NBP], tl.float32) + g
            inv = tl.zeros([NBP], tl.float32) + tl.math.div_rn(g * 0.0 + 1.0, g)
        return gs, inv

    @triton.jit
    def _sample_scores_kernel(x_ptr, gs_ptr, w_ptr, samp_ptr, NB, GS_DIV, NBP: tl.constexpr, SP: tl.constexpr,
                              HAS_W: tl.constexpr, ROW_GS: tl.constexpr):
        """Split search, kernel 1 (``granularity="channel_sampled"``, many rows): the sampled scores of row
        ``program_id(0)`` of x [M, K] as int32 score bits to samp_ptr [M, NB * SP] (block b's i-th sample, channel
        16 b + ((b + i 16 / SP) mod 16), at b * SP + i). The row is read whole for its block maxima (the scales);
        only the sampled channels are rounded (a gather of them, from L1). Same scores as ``_channel_row_kernel``
        (its first pass, ``R**2`` times the weight)."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, NBP)
        cmask = c < NB
        b = row * NB + c
        x0, x1 = _load_halves(x_ptr, b, cmask)
        bmax = tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1))
        gs, inv = _row_scale(bmax, gs_ptr, row, GS_DIV, NBP, ROW_GS)
        sval, _, os = _scales_inv(bmax, gs, inv)
        factor = tl.math.div_rn(sval, gs)
        i = tl.arange(0, SP)[None, :]
        q = (c[:, None] + i * (16 // SP)) % 16
        m2 = cmask[:, None]
        xs = tl.load(x_ptr + b[:, None] * 16 + q, mask=m2, other=0.0).to(tl.float32)
        r = xs - _hold_qdq_half(xs, os, factor, True)
        s = r * r
        if HAS_W:
            s = s * tl.load(w_ptr + c[:, None] * 16 + q, mask=m2, other=0.0)
        tl.store(samp_ptr + b[:, None] * SP + i, s.to(tl.int32, bitcast=True), mask=m2)

    @triton.jit
    def _sample_search_kernel(samp_ptr, th_ptr, M, S, NSS, SPAD: tl.constexpr, ROWS: tl.constexpr,
                              DG: tl.constexpr = False):
        """Split search, kernel 2: the thresholds of ROWS rows per program (``_sample_threshold``'s search with
        NSS > 0, one reduction per step for all of them): th_ptr[r] = the NSS-th highest of samp_ptr's row r
        (int32 [M, S], S <= SPAD; two bits per step, 16-bit count fields past 512 samples). A row whose count is
        exact keeps its threshold through the later steps of its batch mates (a higher candidate with the same
        count admits no new entry), so T = the least sample >= th is the single-row search's."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rmask = rows < M
        j = tl.arange(0, SPAD)
        samp = tl.load(samp_ptr + rows.to(tl.int64)[:, None] * S + j[None, :], mask=rmask[:, None] & (j < S)[None, :],
                       other=-1)
        th = tl.zeros([ROWS], tl.int32)
        cnt = tl.where(rmask, S, NSS)  # rows past M: done
        k = tl.full((), 0, tl.int32)
        while (k < 31) & (tl.max((cnt != NSS).to(tl.int32), axis=0) > 0):
            th, cnt, k = _search_step(samp, th, cnt, k, NSS, True, SPAD > 512, DG)
        tl.store(th_ptr + rows, tl.min(tl.where(samp >= th[:, None], samp, 0x7FFFFFFF), axis=1), mask=rmask)

    @triton.jit
    def _channel_row_kernel(
        x_ptr, gs_ptr, w_ptr, out_ptr, packed1_ptr, scale1_ptr, packed2_ptr, scale2_ptr, idx_ptr, gs2_ptr,
        NB, NSEL, GS_DIV,
        NBP: tl.constexpr, HAS_W: tl.constexpr, PACK: tl.constexpr, OUT: tl.constexpr, GS2: tl.constexpr,
        ROW_GS: tl.constexpr = False, STOP: tl.constexpr = 0, scr_ptr=None, COMPACT: tl.constexpr = 0,
        CAP: tl.constexpr = 1, TR: tl.constexpr = 1, WT: tl.constexpr = False, RA: tl.constexpr = False,
        AT: tl.constexpr = False, RX: tl.constexpr = False, SAMPLE: tl.constexpr = False, NSS=0,
        SP: tl.constexpr = 1, SB: tl.constexpr = 2, TIN: tl.constexpr = False, th_ptr=None, DG: tl.constexpr = False,
        PK: tl.constexpr = False, FULLB: tl.constexpr = False, MS: tl.constexpr = False,
    ):
        """Per-token channel-rule residual compensation of row ``program_id(0)`` of x [M, K] (module docstring).

        x: float32/bf16/fp16 [M, K] contiguous; gs_ptr: float32 first-pass encode scales, row r's at
        ``r // GS_DIV``; ROW_GS: instead, the row's own scale ``_gs_from_amax(max |x_row|)`` (=
        :func:`~verl_quads.nvfp4.per_row_global_scale` bit for bit: no separate amax launches), written to
        gs_ptr[row] when PACK; w_ptr: float32 [K] score weights (HAS_W); NB = K / 16; NSEL = channels selected per row.
        GS2 (second-pass global scale): 0 = from this row's amax of R_sel (written to gs2_ptr[row] when PACK);
        1 = gs2_ptr[0] (per tensor, computed by the caller); 2 = statistics only: write this row's amax of R_sel
        (float32) to gs2_ptr[row] and nothing else.
        PACK: packed1/packed2 int64 [M, NB] (one word per 16-block, byte j = code 2j | code 2j+1 << 4),
        scale1/scale2 uint8 [M, NB] (E4M3 bytes), idx int64 [M, NSEL] (ascending channels); else out [M, K] in
        x's dtype (OUT: ``_store_out`` code) = deq(Q(x)) + deq(Q(R_sel)).
        STOP (timing probe for ``bench nvfp4 --channel-probe`` only; QDQ launches; 0 = the kernel): return after a
        phase, storing one full row that depends on it (its bytes mean nothing): 1 = load + first pass (out =
        deq(Q(x))), 2 = + threshold search (out = deq(Q(x)) where the score >= th, else 0), 3 = + selection with the
        tie ranks and R_sel's amax (out = deq(Q(x)) where selected, else amax); COMPACT > 0 only: 4 = load, first
        pass, the J full-row bits, 5 = + the candidate tile stored and read back (``_compact_threshold`` PHASE).
        COMPACT = J > 0: the selection by ``_compact_threshold`` (J full-row bits, then a [CAP] candidate tile in
        scr_ptr: int32 [M, 2 * CAP] scratch, row r's at r * 2 * CAP; TR: bits per tile step, 1 or 2; WT: the tile
        in every warp, CAP = 256); 0:
        ``_bits_threshold`` + ``_row_ties``. RA (COMPACT > 0, no HAS_W): R_sel's row amax without its own reduction
        where the row's largest |R| is selected (its score fl(|R|**2) is the row's largest: selected when > th, or
        == th with every entry >= th selected); else the reduction. RX (``compact_many_regs``): x is read again after
        the threshold search and Q(x), R recomputed from it (the same values), so the search holds only the scores.
        SAMPLE: ``granularity="channel_sampled"``: the selection is ``e >= _sample_threshold(NSS)`` (SP samples per
        block, :func:`~verl_quads.nvfp4.residual.samples_per_block`; NSS = the
        threshold's rank in the sample, 0 = none, -1 = all; NSEL unused), and PACK stores it as a uint8 [M, K] mask to
        idx_ptr instead of channel indices; with TIN the threshold is th_ptr[row] (int32 score bits, the split
        search: ``_sample_scores_kernel``, ``_sample_search_kernel``; RA must be off). Speed-only options of SAMPLE
        launches (``CHANNEL_CONFIG`` sample_*; the same bytes): DG digit counts, PK sample pick tree, FULLB (NB ==
        NBP) no block masks, MS R_sel by a bit mask."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, NBP)
        cmask = c < (NBP if FULLB else NB)  # FULLB: NB == NBP, every block real (the compiler drops the masks)
        b = row * NB + c
        if RX:  # x is read again after the search (L2): keep it there
            x0, x1 = _load_halves_ev(x_ptr, b, cmask, "evict_last")
        else:
            x0, x1 = _load_halves(x_ptr, b, cmask)
        bmax = tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1))
        gs, inv = _row_scale(bmax, gs_ptr, row, GS_DIV, NBP, ROW_GS)
        if ROW_GS and PACK:
            tl.store(gs_ptr + row + c * 0, gs, mask=c == 0)
        sval, sbyte, os = _scales_inv(bmax, gs, inv)
        factor = tl.math.div_rn(sval, gs)
        v0 = _hold_qdq_half(x0, os, factor, True)
        v1 = _hold_qdq_half(x1, os, factor, True)
        if STOP == 1:
            _store_halves(out_ptr, b, v0, v1, cmask, OUT)
            return
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
        if SAMPLE:
            if TIN:  # the split search's threshold (RA is off: no row max here)
                th = tl.load(th_ptr + row)
            else:
                rpart = tl.zeros([NBP], tl.int32)
                if RA and not HAS_W:
                    rpart = tl.max(tl.maximum(tl.abs(r0), tl.abs(r1)).to(tl.int32, bitcast=True), axis=1)
                th, rmx = _sample_threshold(e0, e1, c, NSS, NB, NBP, SP, rpart, RA and not HAS_W, SB, DG, PK)
            if STOP == 2:
                _store_halves(out_ptr, b, tl.where(e0 >= th, v0, 0.0), tl.where(e1 >= th, v1, 0.0), cmask, OUT)
                return
            sel0 = e0 >= th
            sel1 = e1 >= th
            if MS:  # all-ones where e >= th (e - th >= 0: no overflow, e in [-1, 2**31), th in [0, 2**31))
                ms0 = ~((e0 - th) >> 31)
                ms1 = ~((e1 - th) >> 31)
        elif COMPACT > 0:
            rpart = tl.zeros([NBP], tl.int32)
            if RA and not HAS_W:
                rpart = tl.max(tl.maximum(tl.abs(r0), tl.abs(r1)).to(tl.int32, bitcast=True), axis=1)
            th, cstar, rmx = _compact_threshold(e0, e1, c, NSEL, NB * 16, scr_ptr + row * (2 * CAP), NBP, COMPACT,
                                                CAP, TR, 1 if STOP == 4 else (2 if STOP == 5 else 0), WT, rpart,
                                                RA and not HAS_W, AT)
            ch0 = c[:, None] * 16 + tl.arange(0, 8)[None, :]
            if (STOP == 2) | (STOP == 4) | (STOP == 5):
                _store_halves(out_ptr, b, tl.where((e0 >= th) | (ch0 <= cstar), v0, 0.0),
                              tl.where((e1 >= th) | (ch0 + 8 <= cstar), v1, 0.0), cmask, OUT)
                return
            sel0 = (e0 > th) | ((e0 == th) & (ch0 <= cstar))
            sel1 = (e1 > th) | ((e1 == th) & (ch0 + 8 <= cstar))
        else:
            eb = tl.reshape(tl.join(e0, e1), (NBP * 16,))  # every channel once (not in channel order)
            th, cnt = _bits_threshold(eb, NSEL, NB * 16)
            if STOP == 2:
                _store_halves(out_ptr, b, tl.where(e0 >= th, v0, 0.0), tl.where(e1 >= th, v1, 0.0), cmask, OUT)
                return
            if cnt == NSEL:
                sel0 = e0 >= th
                sel1 = e1 >= th
            else:
                t0, t1 = _row_ties(e0, e1, th, NSEL)
                sel0 = (e0 > th) | t0
                sel1 = (e1 > th) | t1
        if RX:  # x, Q(x) and R were dead during the search (fewer registers held): the same values again
            x0, x1 = _load_halves_ev(x_ptr, b, cmask, "evict_first")
            v0 = _hold_qdq_half(x0, os, factor, True)
            v1 = _hold_qdq_half(x1, os, factor, True)
            r0 = x0 - v0
            r1 = x1 - v1
        if SAMPLE and MS:  # R_sel by a bit mask: no per-channel predicates to keep across the gs2 divisions
            rs0 = (r0.to(tl.int32, bitcast=True) & ms0).to(tl.float32, bitcast=True)
            rs1 = (r1.to(tl.int32, bitcast=True) & ms1).to(tl.float32, bitcast=True)
        else:
            rs0 = tl.where(sel0, r0, 0.0)
            rs1 = tl.where(sel1, r1, 0.0)
        ra = tl.maximum(tl.max(tl.abs(rs0), axis=1), tl.max(tl.abs(rs1), axis=1))
        if SAMPLE and RA and not HAS_W and not TIN:  # the row's largest score is selected unless nothing is (NSS == 0)
            amax = tl.zeros([NBP], tl.float32) + tl.where(NSS == 0, 0.0, rmx.to(tl.float32, bitcast=True))
        elif (COMPACT > 0) and RA and not HAS_W:
            rmf = rmx.to(tl.float32, bitcast=True)
            emax = (rmf * rmf).to(tl.int32, bitcast=True)  # = the largest score (squaring is monotone)
            if (emax > th) | ((emax == th) & (cstar == 0x7FFFFFFF)):
                amax = tl.zeros([NBP], tl.float32) + rmf
            else:
                amax = tl.zeros([NBP], tl.float32) + tl.max(ra, axis=0)
        else:
            amax = tl.zeros([NBP], tl.float32) + tl.max(ra, axis=0)
        if STOP == 3:
            _store_halves(out_ptr, b, tl.where(sel0, v0, amax[:, None]), tl.where(sel1, v1, amax[:, None]), cmask, OUT)
            return
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
                if SAMPLE:  # the mask, uint8 [M, K]
                    off = b[:, None] * 16 + tl.arange(0, 8)[None, :]
                    tl.store(idx_ptr + off, sel0.to(tl.uint8), mask=cmask[:, None])
                    tl.store(idx_ptr + off + 8, sel1.to(tl.uint8), mask=cmask[:, None])
                else:
                    k0, k1 = _half_ranks(sel0.to(tl.int32), sel1.to(tl.int32))
                    ch = c[:, None] * 16 + tl.arange(0, 8)[None, :]
                    base = idx_ptr + row * NSEL - 1
                    tl.store(base + k0, ch, mask=sel0)  # cast to idx_ptr's int64
                    tl.store(base + k1, ch + 8, mask=sel1)
                if GS2 == 0:
                    tl.store(gs2_ptr + row + c * 0, gs2, mask=c == 0)
            else:
                f2 = tl.math.div_rn(s2, gs2)
                _store_halves(out_ptr, b, v0 + _hold_qdq_half(rs0, os2, f2, True),
                              v1 + _hold_qdq_half(rs1, os2, f2, True), cmask, OUT)


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


def _many(m: int) -> bool:
    """A compacted-search launch of ``m`` rows takes the ``compact_many_*`` overrides (more rows than
    ``compact_many_rows``, the SMs: then an SM must hold more than one row's program at once)."""
    r = CHANNEL_CONFIG["compact_many_rows"]
    return r is not None and m > int(r)


def _on(key: str, nbp: int) -> bool:
    """A CHANNEL_CONFIG option that is a bool (every launch) or a collection of padded block counts NBP (launches of
    those rows only: where it was measured)."""
    v = CHANNEL_CONFIG[key]
    return bool(v) if isinstance(v, bool) or v is None else nbp in v


def _many_regs(m: int, nbp: int) -> int | None:
    """The register cap of a compacted-search launch of ``m`` rows of NBP padded blocks under ``compact_many_regs``
    (more rows than its entry's row count; such a launch also reads x again after the search), or None."""
    e = CHANNEL_CONFIG["compact_many_regs"].get(nbp)
    return None if e is None or m <= int(e[0]) else int(e[1])


def _maxnreg(packed: bool, num_warps: int, compact: bool = False, many_cap: int | None = None) -> int | None:
    """The register cap of a launch (``CHANNEL_CONFIG``): for the compacted search ``many_cap`` (``_many_regs``) when
    given, else compact_maxnreg; otherwise qdq_maxnreg, or pack_maxnreg from pack_maxnreg_min_warps warps on; None =
    uncapped."""
    if compact and many_cap is not None:
        cap = many_cap
    elif compact:
        cap = CHANNEL_CONFIG["compact_maxnreg"]
    elif not packed:
        cap = CHANNEL_CONFIG["qdq_maxnreg"]
    else:
        cap = CHANNEL_CONFIG["pack_maxnreg"] if num_warps >= CHANNEL_CONFIG["pack_maxnreg_min_warps"] else None
    return None if cap is None else int(cap)


def _warps(nbp: int) -> int:
    n = nbp * BLOCK_SIZE // (32 * CHANNEL_CONFIG["elems_per_thread"])
    return int(min(CHANNEL_CONFIG["max_warps"], max(1, tk._pow2(max(1, n)))))


def _launch_warps(m: int, k: int, nbp: int) -> int:
    """Warps of a launch of ``m`` rows of ``k`` channels: for a compacted-search launch ``compact_many_warps[nbp]``
    (more than compact_many_rows rows) or ``compact_warps[nbp]`` where they have an entry, else ``_warps``."""
    if _compact_args(m, k, nbp) is not None:
        if _many(m) and nbp in CHANNEL_CONFIG["compact_many_warps"]:
            return int(CHANNEL_CONFIG["compact_many_warps"][nbp])
        if nbp in CHANNEL_CONFIG["compact_warps"]:
            return int(CHANNEL_CONFIG["compact_warps"][nbp])
    return _warps(nbp)


def _check_row(k: int) -> int:
    nbp = tk._pow2(max(1, k // BLOCK_SIZE))
    if nbp * BLOCK_SIZE > CHANNEL_CONFIG["max_k"]:
        raise NotImplementedError(
            f"NVFP4 residual granularity='channel' on the triton backend holds a row on chip: K = {k} (padded to "
            f"{nbp * BLOCK_SIZE}) exceeds CHANNEL_CONFIG['max_k'] = {CHANNEL_CONFIG['max_k']}; use backend='torch'"
        )
    return nbp


def _compact_args(m: int, k: int, nbp: int) -> tuple[int, int, int, bool] | None:
    """(COMPACT bits J, CAP, TR tile bits per step, WT warp tile) of the compacted search for a launch of ``m`` rows of ``k`` channels (``CHANNEL_CONFIG``
    compact_*), or None for the full-row search. J in [1, 30]; CAP a power of two <= the padded row."""
    c = CHANNEL_CONFIG
    if m > c["compact_max_rows"] or k < c["compact_min_k"]:
        return None
    bits = int(c["compact_bits"])
    if not 1 <= bits <= 30:
        raise ValueError(f"CHANNEL_CONFIG['compact_bits'] must be in [1, 30], got {bits}")
    if c["compact_tile_bits"] not in (1, 2):
        raise ValueError(f"CHANNEL_CONFIG['compact_tile_bits'] must be 1 or 2, got {c['compact_tile_bits']!r}")
    cap = int(min(tk._pow2(max(1, int(c["compact_cap"]))), nbp * BLOCK_SIZE))
    wt = bool(c["compact_warp_tile"])
    if wt and (int(c["compact_cap"]) != 256 or c["compact_tile_bits"] != 2):
        raise ValueError("CHANNEL_CONFIG['compact_warp_tile'] needs compact_cap = 256 and compact_tile_bits = 2, got "
                         f"{c['compact_cap']!r} / {c['compact_tile_bits']!r}")
    if wt and cap != 256:  # a row shorter than the warp tile: the full-row search (same bytes)
        return None
    return bits, cap, int(c["compact_tile_bits"]), wt


def _split(m: int, nbp: int) -> bool:
    """A ``granularity="channel_sampled"`` launch of ``m`` rows of NBP padded blocks takes the split search: more
    rows than ``sample_split_rows`` (an int: every K; a dict: its entry for NBP, none = never; None = never)."""
    r = CHANNEL_CONFIG["sample_split_rows"]
    if isinstance(r, dict):
        r = r.get(nbp)
    return r is not None and m > int(r)


def _split_thresholds(xc: torch.Tensor, g1: torch.Tensor, w: torch.Tensor | None, nb: int, nbp: int, sp: int,
                      nss: int, div1: int, row_gs: bool, search: bool = True) -> torch.Tensor:
    """The split search's thresholds, int32 ``[M]`` score bits (``_sample_scores_kernel`` into an int32 ``[M, NB *
    SP]`` sample, then ``_sample_search_kernel`` over ``sample_search_rows`` rows per program). ``search=False``
    (the probe's phase timing): the sample, after the first kernel only."""
    m = xc.shape[0]
    cfg = CHANNEL_CONFIG
    rows = int(cfg["sample_search_rows"])
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"CHANNEL_CONFIG['sample_search_rows'] must be a power of two >= 1, got {rows}")
    s = nb * sp
    samp = torch.empty(m, s, dtype=torch.int32, device=xc.device)
    th = torch.empty(m, dtype=torch.int32, device=xc.device)
    _sample_scores_kernel[(m,)](xc, g1, w if w is not None else g1, samp, nb, div1, NBP=nbp, SP=sp,
                                HAS_W=w is not None, ROW_GS=row_gs, enable_fp_fusion=False, num_warps=_warps(nbp))
    if not search:
        return samp
    _sample_search_kernel[(triton.cdiv(m, rows),)](samp, th, m, s, nss, SPAD=tk._pow2(s), ROWS=rows,
                                                   DG=bool(cfg["sample_digit_counts"]),
                                                   num_warps=int(cfg["sample_search_warps"]))
    return th


def _run(x: torch.Tensor, ratio: float, global_scale, amax, score_weight, check_finite: bool, packed: bool,
         stop: int = 0, sampled: bool = False):
    """Both entry points; ``stop`` > 0: the kernel's STOP timing probe (QDQ only; the output is not a result);
    ``sampled``: ``granularity="channel_sampled"`` (else "channel")."""
    if stop and packed:
        raise ValueError("triton_channel: the STOP timing probe runs the QDQ launch only (packed=False)")
    num_selected_channels(x.shape[-1] if x.dim() else 0, ratio)  # validates the ratio first
    row_gs = False
    if amax is not None:
        if global_scale is not None:
            raise ValueError("NVFP4: pass global_scale or amax, not both")
        am, ng = tk._check_amax(amax, x)
        row_gs = isinstance(am, str)  # "row": derived in the kernel (one launch)
        if not row_gs:
            global_scale = tk._gs_of_amax(x, am, ng)
    gs, xc, w = tk._residual_prepare(x, global_scale, score_weight, check_finite, row_scale=row_gs)
    m, k = x.shape
    if m == 0 or k == 0:  # nothing to launch; the reference defines the (empty) result and its shapes
        ref = _ref_residual_quantize_channel_sampled if sampled else _ref_residual_quantize_channel
        r = ref(x, ratio, gs, score_weight=w, check_finite=False)
        return r if packed else r.dequantize(x.dtype)
    nb = k // BLOCK_SIZE
    nbp = _check_row(k)
    n_sel = num_selected_channels(k, ratio)
    dev = x.device
    if row_gs:  # the kernel writes each row's scale here (PACK) or ignores it (QDQ)
        gs = torch.empty(m, 1, dtype=torch.float32, device=dev)
    g1, div1 = tk._gs_rows(gs, (m,))
    per_row = gs.dim() == 2 and gs.shape[0] == m and m > 1  # the reference's _second_pass_scale rule
    wt = w if w is not None else g1
    meta = dict(NB=nb, NSEL=n_sel, GS_DIV=div1, NBP=nbp, HAS_W=w is not None, ROW_GS=row_gs, num_warps=_launch_warps(m, k, nbp),
                enable_fp_fusion=False, **({"STOP": int(stop)} if stop else {}))
    comp = None if sampled else _compact_args(m, k, nbp)
    many_cap = _many_regs(m, nbp) if comp is not None else None
    split = False
    if sampled:
        nss = -1 if n_sel == k else num_sampled_threshold_rank(k, ratio)
        sp = samples_per_block(k)
        split = nss > 0 and _split(m, nbp)
        cfg = CHANNEL_CONFIG
        meta.update(SAMPLE=True, NSS=nss, SP=sp, RA=_on("sample_rmax", nbp) and not split,
                    num_warps=int(cfg["sample_warps"].get(nbp, _warps(nbp))), SB=int(cfg["sample_step_bits"]),
                    DG=bool(cfg["sample_digit_counts"]), PK=bool(cfg["sample_pick_tree"]),
                    FULLB=bool(cfg["sample_full_blocks"]) and nb == nbp, MS=bool(cfg["sample_mask_select"]))
        if split:
            meta.update(TIN=True, th_ptr=_split_thresholds(xc, g1, w, nb, nbp, sp, nss, div1, row_gs))
    if comp is not None:
        bits, cap, tr, warp_tile = comp
        meta.update(COMPACT=bits, CAP=cap, TR=tr, WT=warp_tile, RA=_on("compact_rmax", nbp),
                    AT=_on("compact_tile_chunks", nbp), RX=many_cap is not None,
                    scr_ptr=torch.empty(m, 2 * cap, dtype=torch.int32, device=dev))
    kern = _channel_row_kernel
    gs2_mode, gs2_arg = 0, None
    if not per_row and m > 1:  # per-tensor second-pass scale: amax of R_sel over all rows first
        amax_rows = torch.empty(m, dtype=torch.float32, device=dev)
        kern[(m,)](xc, g1, wt, xc, xc, xc, xc, xc, xc, amax_rows, PACK=False, OUT=0, GS2=2, **meta)
        gs2_mode, gs2_arg = 1, global_scale_from_amax(amax_rows.amax())
    cap = _maxnreg(packed, meta["num_warps"], compact=comp is not None, many_cap=many_cap)
    if sampled and nbp in CHANNEL_CONFIG["sample_maxnreg"]:
        cap = int(CHANNEL_CONFIG["sample_maxnreg"][nbp])
    if cap is not None and xc.is_cuda:  # the interpreter has no registers
        meta["maxnreg"] = cap
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
    if sampled:
        idx_buf = torch.empty(m, k, dtype=torch.uint8, device=dev)  # the selection mask
    else:
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
    if sampled:
        return SampledChannelResidualNVFP4(first, second, idx_buf.view(torch.bool), ratio)
    return ChannelResidualNVFP4(first, second, idx_buf[:, :n_sel], ratio)


def residual_quantize(x: torch.Tensor, ratio: float, global_scale=None, *, amax=None,
                      score_weight: torch.Tensor | None = None, check_finite: bool = True,
                      granularity: str = "channel") -> ChannelResidualNVFP4 | SampledChannelResidualNVFP4:
    """Triton :func:`verl_quads.nvfp4.residual_quantize` with ``granularity="channel"`` (per token): x 2-D
    ``[M, K]`` float32/bf16/fp16; returns a :class:`ChannelResidualNVFP4` with the reference's bytes.
    ``amax="row"``: the first pass's global scale is each row's :func:`~verl_quads.nvfp4.per_row_global_scale`,
    derived inside the kernel (returned as ``first.global_scale`` ``[M, 1]``); another ``amax`` tensor: its
    :func:`~verl_quads.nvfp4.global_scale_from_amax` by torch first. ``granularity="channel_sampled"``: that rule
    (a :class:`SampledChannelResidualNVFP4`)."""
    return _run(x, ratio, global_scale, amax, score_weight, check_finite, packed=True,
                sampled=_sampled(granularity))


def residual_fake_quantize(x: torch.Tensor, ratio: float, global_scale=None, *, amax=None,
                           score_weight: torch.Tensor | None = None, check_finite: bool = True,
                           granularity: str = "channel") -> torch.Tensor:
    """Triton :func:`verl_quads.nvfp4.residual_fake_quantize` with ``granularity="channel"``: ``deq(Q(x)) +
    deq(Q(R_sel))`` in x's dtype and shape ``[M, K]``, one launch (two with a per-tensor scale and M > 1;
    one with ``amax="row"``, see :func:`residual_quantize`; ``granularity`` as there)."""
    return _run(x, ratio, global_scale, amax, score_weight, check_finite, packed=False,
                sampled=_sampled(granularity))


def _sampled(granularity: str) -> bool:
    if granularity not in ("channel", "channel_sampled"):
        raise ValueError(f"triton_channel: granularity must be 'channel' or 'channel_sampled', got {granularity!r}")
    return granularity == "channel_sampled"
