"""Measuring instruments for the W4A16 decode GEMV (issue #5, ``verl-quads bench rollout --gemv-roofline``).

Probe kernels that run the weight-streaming kernel's memory traffic (``_w4a16_stream_kernel`` in
verl_quads/nvfp4/triton_gemm.py) with less and less of its work, so that the time of each step can be
separated: ``stage`` 0 reads the packed weight words (int32, ``[BN, BKW]`` per K step) and the block-scale
bytes with the same addresses, grid and loop structure as the real kernel and folds them with XOR into an
int32 per program (nothing decoded: the memory floor of that tiling); 1 also decodes every nibble with the
product's own helpers (``_e2m1_word`` / ``_e2m1_pair``) and applies the block scale, summing the decoded values
(an FADD where the kernel has an FMA; no activation); 2 also reads the activation and does the kernel's FMAs
(the kernel minus its epilogue: no per-row reduction to partials, no split-K fixup / reduction). Every probe
writes ONE value per program (int32 bits, or float32 bits for stages 1 and 2) to ``out`` so the compiler
keeps every load; the values mean nothing and are checked against nothing (the kernels compute nothing).
:func:`probe_sass_counts` compiles a probe for sm_90 offline and counts its global loads (the unit tests
check that every weight-word load survives).

Read-only extras (stage 0, the tiling grid of the roofline): ``unroll`` independent K steps per loop
iteration (their loads are issued back to back: more bytes in flight per thread), ``tl.load`` cache /
eviction hints (``cache=".cg"``: L2 only; ``evict="evict_first"``). Units: sizes in int32 words (8 weight
elements, 4 packed bytes) along K, weight rows along N.

Not product code: nothing here is dispatched by the rollout.
"""

from __future__ import annotations

import os

import torch

from verl_quads.nvfp4 import triton_stream as ts
from verl_quads.nvfp4.triton_kernels import triton

if triton is not None:
    import triton.language as tl

    from verl_quads.nvfp4.triton_stream import _e2m1_pair, _e2m1_word, _stream_load, _stream_x

    @triton.jit
    def _probe_words(w_ptr, ws_ptr, wrow, rmask, kw0, kw_hi, KW, KB, BKW: tl.constexpr, EVEN: tl.constexpr,
                     CACHE: tl.constexpr, EVICT: tl.constexpr, SCALES: tl.constexpr):
        """Raw words ``kw0 + [0, BKW)`` (int32 ``[BN, BKW]``) of rows ``wrow`` (``rmask``: valid rows; EVEN: no K
        mask) XOR their block-scale bytes: SCALES 1 byte ``kw // 2`` of each row per word (the stream kernel's
        addresses, ``_stream_load`` without the scale conversion), 0 no scale loads, 2 one byte per 16-element
        block (a ``[BN, BKW // 2]`` tile; the row's sum of them XOR-ed into every word), with load hints."""
        kw = kw0 + tl.arange(0, BKW)
        if EVEN:
            m = rmask[:, None]
        else:
            m = rmask[:, None] & (kw < kw_hi)[None, :]
        wd = tl.load(w_ptr + wrow[:, None] * KW + kw[None, :], mask=m, other=0, cache_modifier=CACHE,
                     eviction_policy=EVICT)
        if SCALES == 1:
            sc = tl.load(ws_ptr + wrow[:, None] * KB + (kw // 2)[None, :], mask=m, other=0, cache_modifier=CACHE,
                         eviction_policy=EVICT)
            wd = wd ^ sc.to(tl.int32)
        elif SCALES == 2:
            kb = kw0 // 2 + tl.arange(0, BKW // 2)
            if EVEN:
                mb = rmask[:, None]
            else:
                mb = rmask[:, None] & (2 * kb < kw_hi)[None, :]
            sb = tl.load(ws_ptr + wrow[:, None] * KB + kb[None, :], mask=mb, other=0, cache_modifier=CACHE,
                         eviction_policy=EVICT)
            wd = wd ^ tl.sum(sb.to(tl.int32), axis=1)[:, None]
        return wd

    @triton.jit
    def _flat_read_kernel(w_ptr, out_ptr, NW, WPP, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
        """Program p reads int32 words ``[p * WPP, min((p + 1) * WPP, NW))`` (``WPP`` a multiple of
        ``BLOCK * UNROLL``), ``BLOCK`` contiguous words per load (``UNROLL`` loads back to back), XOR-folded;
        one int32 per program: the Triton floor of reading the same bytes linearly (the copy's pattern)."""
        p = tl.program_id(0)
        lo = p.to(tl.int64) * WPP
        hi = tl.minimum(lo + WPP, NW)
        i = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.int32)
        for o in range(lo, hi, BLOCK * UNROLL):
            for u in tl.static_range(UNROLL):
                off = o + u * BLOCK + i
                acc = acc ^ tl.load(w_ptr + off, mask=off < hi, other=0)
        tl.store(out_ptr + p, tl.sum(acc, axis=0))

    @triton.jit
    def _gemv_probe_kernel(x_ptr, w_ptr, ws_ptr, e_ptr, a_ptr, out_ptr, N, K, KW, KB, KW_PER_SPLIT,
                           BN: tl.constexpr, BKW: tl.constexpr, STAGE: tl.constexpr, DEC: tl.constexpr,
                           LATE: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr, PIPE: tl.constexpr,
                           UNROLL: tl.constexpr, CACHE: tl.constexpr, EVICT: tl.constexpr, EVEN: tl.constexpr,
                           SCALES: tl.constexpr = 1, BS: tl.constexpr = False):
        """Program (expert ``e[pid_m]``, BN weight rows ``pid_n``, K range ``pid_k`` of KW_PER_SPLIT words):
        the stream kernel's K loop at ``STAGE`` 0 / 1 / 2 (module docstring); activation row ``a[pid_m]``
        (stage 2). Writes one int32 per program at ``out[(pid_m * grid_n + pid_n) * grid_k + pid_k]``."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        ec = tl.load(e_ptr + pid_m).to(tl.int64)
        arow = tl.load(a_ptr + pid_m).to(tl.int64)
        cols = pid_n * BN + tl.arange(0, BN)
        nmask = cols < N
        wrow = ec * N + cols.to(tl.int64)
        kw_lo = pid_k * KW_PER_SPLIT
        kw_hi = tl.minimum(kw_lo + KW_PER_SPLIT, KW)
        i = tl.arange(0, BKW)
        lin = (pid_m * tl.num_programs(1) + pid_n) * tl.num_programs(2) + pid_k
        if STAGE == 0:
            accw = tl.zeros([BN, BKW], tl.int32)
            if PREFETCH:  # (UNROLL 1) the kernel's manual double buffer
                wd_n = _probe_words(w_ptr, ws_ptr, wrow, nmask, kw_lo, kw_hi, KW, KB, BKW, EVEN, CACHE, EVICT, SCALES)
            for kw0 in tl.range(kw_lo, kw_hi, BKW * UNROLL, num_stages=PIPE):
                for u in tl.static_range(UNROLL):
                    if PREFETCH:
                        wd = wd_n
                        nxt = nmask & ((kw_hi - kw0 + 0 * cols) > BKW)  # constant along K: 16-byte vectors
                        wd_n = _probe_words(w_ptr, ws_ptr, wrow, nxt, kw0 + BKW, kw_hi, KW, KB, BKW, EVEN, CACHE,
                                            EVICT, SCALES)
                    else:
                        wd = _probe_words(w_ptr, ws_ptr, wrow, nmask, kw0 + u * BKW, kw_hi, KW, KB, BKW, EVEN, CACHE,
                                          EVICT, SCALES)
                    accw = accw ^ wd
            tl.store(out_ptr + lin, tl.sum(tl.sum(accw, axis=1), axis=0))
        else:
            acc = tl.zeros([BN, BKW // 2 if BS else BKW], tl.float32)
            if PREFETCH:
                wd_n, s_n = _stream_load(w_ptr, ws_ptr, wrow, nmask, kw_lo + i, kw_hi, KW, KB, DEC, EVEN, False, BS, kw_lo)
            for kw0 in tl.range(kw_lo, kw_hi, BKW, num_stages=PIPE):
                kw = kw0 + i
                if PREFETCH:
                    wd, s = wd_n, s_n
                    nxt = nmask & ((kw_hi - kw0 + 0 * cols) > BKW)
                    wd_n, s_n = _stream_load(w_ptr, ws_ptr, wrow, nxt, kw + BKW, kw_hi, KW, KB, DEC, EVEN, False, BS,
                                             kw0 + BKW)
                else:
                    wd, s = _stream_load(w_ptr, ws_ptr, wrow, nmask, kw, kw_hi, KW, KB, DEC, EVEN, False, BS, kw0)
                if LATE:
                    p = tl.zeros([BN, BKW], tl.float32)
                    for pj in tl.static_range(4):
                        dl, dh = _e2m1_pair(wd, pj, ASM)
                        if STAGE == 1:
                            p += dl + dh
                        else:
                            p += dl * _stream_x(x_ptr, arow, kw, kw_hi, K, pj, EVEN)[None, :]
                            p += dh * _stream_x(x_ptr, arow, kw, kw_hi, K, pj + 4, EVEN)[None, :]
                    if BS:  # the kernel's block_scale: per 16-element block
                        acc += tl.sum(tl.reshape(p, [BN, BKW // 2, 2]), axis=2) * s
                    else:
                        acc += p * s
                else:
                    for j in tl.static_range(8):
                        v = _e2m1_word(wd, j, DEC) * s
                        if STAGE == 1:
                            acc += v
                        else:
                            acc += v * _stream_x(x_ptr, arow, kw, kw_hi, K, j, EVEN)[None, :]
            tot = tl.sum(tl.sum(acc, axis=1), axis=0)
            tl.store(out_ptr + lin, tot.to(tl.int32, bitcast=True))


STAGES = {0: "read-only", 1: "read+decode", 2: "read+decode+FMA"}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def probe_constexprs(cfg: "ts.StreamConfig", stage: int, even: bool, unroll: int = 1, cache: str = "",
                     evict: str = "", interpreting: bool = False, scales: int = 1) -> dict:
    """Compile-time arguments of ``_gemv_probe_kernel`` for the tiling / loop of ``cfg`` (a CUDA-core
    StreamConfig, ``mma=0``; its ``block_m`` is ignored: one activation row per program)."""
    if cfg.mma != 0:
        raise ValueError(f"gemv probe: StreamConfig {cfg.label} is a tensor-core config (mma={cfg.mma}); the probes "
                         "model the CUDA-core kernel (mma=0) only")
    if stage not in STAGES:
        raise ValueError(f"gemv probe: stage {stage} not in {list(STAGES)}")
    if unroll < 1 or (unroll > 1 and (cfg.prefetch or stage != 0)):
        raise ValueError(f"gemv probe: unroll={unroll} needs stage 0 and prefetch=False (got stage {stage}, "
                         f"prefetch={cfg.prefetch})")
    if (cache or evict) and stage != 0:
        raise ValueError("gemv probe: cache/eviction hints are for stage 0 (read-only) only")
    if scales not in (0, 1, 2) or (scales != 1 and stage != 0):
        raise ValueError(f"gemv probe: scales={scales}: 0 (none), 1 (per word, the kernel's) or 2 (per block) and "
                         "other than 1 for stage 0 (read-only) only")
    dec = ("bits", "f16", "f16x2", "bf16x2").index(cfg.decode) if stage else 0  # stage 0 decodes nothing
    late = cfg.late_scale and stage > 0
    bs = cfg.block_scale and stage > 0
    return dict(BN=cfg.block_n, BKW=cfg.block_kw, STAGE=stage, DEC=dec, LATE=late, ASM=late and not interpreting,
                PREFETCH=cfg.prefetch,
                PIPE=cfg.pipe if cfg.pipe > 1 else None, UNROLL=unroll, CACHE=cache, EVICT=evict, EVEN=even,
                SCALES=scales, BS=bs)


def make_probe(cfg: "ts.StreamConfig", stage: int, w_packed: torch.Tensor, w_scale: torch.Tensor, x: torch.Tensor,
               experts: torch.Tensor, a_rows: torch.Tensor, unroll: int = 1, cache: str = "", evict: str = "",
               scales: int | None = None):
    """A zero-argument launcher of the probe over weight ``w_packed`` (uint8 ``[N, K/2]`` or ``[E, N, K/2]``,
    contiguous) / ``w_scale`` (float8_e4m3 or uint8 ``[..., N, K/16]``), activation ``x`` (bf16 ``[rows, K]``),
    one program row per entry of ``experts`` (int32, expert index; 0 for a dense weight) reading activation row
    ``a_rows[i]`` (int32). ``scales`` (stage 0): None = the config's form (2, a per-block tile, with
    ``block_scale``; else 1, per word). Grid and K ranges as the stream kernel's launch (:func:`triton_stream.stream_split` with
    ``live = len(experts)``). Returns ``(launch, info)``: ``launch()`` runs it and returns the int32 ``out``
    (one value per program); ``info`` has ``grid``, ``programs``, ``split``, ``kw_per``."""
    if triton is None:
        raise RuntimeError("gemv probe: triton is not available")
    n, kh = w_packed.shape[-2:]
    k = 2 * kh
    kw, kb = k // 8, k // 16
    w32 = w_packed.view(torch.int32)
    ws = w_scale.view(torch.uint8)
    dev = w_packed.device
    live = experts.numel()
    n_tiles = -(-n // cfg.block_n)
    split, kw_per, even = ts.stream_split(cfg, kw, live, n_tiles, dev)
    even = even and kw_per % (cfg.block_kw * unroll) == 0
    if scales is None:
        scales = 2 if (cfg.block_scale and stage == 0) else 1
    const = probe_constexprs(cfg, stage, even, unroll, cache, evict, _interpreting(), scales)
    grid = (live, n_tiles, split)
    out = torch.empty(live * n_tiles * split, dtype=torch.int32, device=dev)

    def launch():
        _gemv_probe_kernel[grid](x, w32, ws, experts, a_rows, out, n, k, kw, kb, kw_per, **const,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out

    return launch, dict(grid=grid, programs=live * n_tiles * split, split=split, kw_per=kw_per)


def probe_sass_counts(cfg: "ts.StreamConfig", stage: int, unroll: int = 1, cache: str = "", evict: str = "",
                      scales: int = 1) -> dict:
    """Offline (no GPU): compile the probe for sm_90 with triton's bundled ptxas (aligned sizes as the JIT
    specializes them, full K ranges), disassemble it with the wheel's ``cuobjdump`` and count global loads.
    Returns ``{"ldg": all LDG, "ldg128": 16-byte LDG (the weight words), "ldgsts": asynchronous copies,
    "loop_ldg128": 16-byte LDG in the longest backward-branch loop, "ptx_ld_global": ld.global in the PTX}``."""
    import re

    from verl_quads.bench.sass import compile_sm90, sass_and_loop

    const = probe_constexprs(cfg, stage, True, unroll, cache, evict, interpreting=False, scales=scales)
    ptrs = ["x_ptr", "w_ptr", "ws_ptr", "e_ptr", "a_ptr", "out_ptr"]
    types = ["*bf16", "*i32", "*u8", "*i32", "*i32", "*i32"]
    sig = dict(zip(ptrs, types))
    sig.update({nm: "i32" for nm in ("N", "K", "KW", "KB", "KW_PER_SPLIT")})
    sig.update({c: "constexpr" for c in const})
    kern = compile_sm90(_gemv_probe_kernel, sig, const, ("N", "K", "KW", "KB", "KW_PER_SPLIT"), cfg.num_warps,
                        cfg.num_stages)
    texts, body = sass_and_loop(kern)

    def n_ldg(ts, wide=False):
        return sum(1 for t in ts if re.search(r"\bLDG\.", t) and (not wide or ".128" in t))

    return dict(ldg=n_ldg(texts), ldg128=n_ldg(texts, True), ldgsts=sum("LDGSTS" in t for t in texts),
                loop_ldg128=n_ldg(body, True), loop_ldg=n_ldg(body),
                ptx_ld_global=len(re.findall(r"\bld\.global", kern.asm["ptx"])))


def make_flat_read(words: torch.Tensor, programs: int, block: int, unroll: int = 1, num_warps: int = 4):
    """A zero-argument launcher of ``_flat_read_kernel`` over the int32 view of ``words`` (any contiguous tensor of
    a multiple of 4 bytes) split into ``programs`` contiguous chunks (multiples of ``block * unroll`` words);
    returns ``(launch, words per program)``; ``launch()`` returns the int32 ``out`` (one value per program)."""
    if triton is None:
        raise RuntimeError("gemv probe: triton is not available")
    w32 = words.reshape(-1).view(torch.int32)
    nw = w32.numel()
    step = block * unroll
    wpp = -(-(-(-nw // programs)) // step) * step
    progs = -(-nw // wpp)
    out = torch.empty(progs, dtype=torch.int32, device=words.device)

    def launch():
        _flat_read_kernel[(progs,)](w32, out, nw, wpp, BLOCK=block, UNROLL=unroll, num_warps=num_warps)
        return out

    return launch, wpp


def expected_word_vectors(cfg: "ts.StreamConfig", unroll: int = 1) -> int:
    """16-byte weight-word loads per thread per loop iteration: ``block_n * block_kw * unroll`` words over
    ``32 * num_warps`` threads, 4 words per vector (what an LDG count of a probe must reach)."""
    return max(1, cfg.block_n * cfg.block_kw * unroll // (4 * 32 * cfg.num_warps))
