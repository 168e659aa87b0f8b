"""``verl-quads bench rollout --sweep-mid`` (issue #5, 16..256 rows): its candidate launch configs, its
parallel-precompile worker and one end-to-end pass of the sweep at tiny shapes on CPU (TRITON_INTERPRET=1:
the kernels run in the interpreter; the TIMING is faked there, so that test checks the code path, the
reference check of every config and the tables, not speed), plus the sm_90 ahead-of-time compile of the
extreme candidates (triton's bundled ptxas; shared memory within the H200's 227 KB per block)."""

import os

import pytest
import torch

from verl_quads.bench import rollout as br
from verl_quads.nvfp4 import triton_gemm as tg

from sm90_compile import compile_for_sm90_in_subprocess

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (scripts/test.sh sets it on CPU)",
)


def _default(per, grouped, n, k, groups):
    bm = tg.pick_block_m(per)
    tiles = sum(-(-r // bm) for r in groups)
    return tg.pick_config(per, tiles, n, k, torch.device("cpu"), block_m=bm if grouped else None)


@pytest.mark.parametrize("per, grouped, n, k", [(16, True, 1536, 2048), (1, True, 2048, 768), (4, True, 1536, 2048),
                                                (16, False, 8192, 8192), (64, False, 4096, 4096),
                                                (256, False, 8192, 8192)])
def test_mid_candidates(per, grouped, n, k):
    """Stage 1 starts with the default, has <= 25 distinct configs, both MMA orientations, the block_m of
    pick_block_m (and twice it at ~full 16-row expert tiles), split_k by pick_config's rule, shared memory
    within the estimate; W4A4 gets fewer; stage 2 varies split / stages / warps of one config only."""
    groups = [per] * 128 if grouped else [per]
    d = _default(per, grouped, n, k, groups)
    for a4 in (False, True):
        c1 = br._mid_stage1(per, grouped, groups, n, k, 132, a4, d)
        assert c1[0] == d and len(c1) == len(set(c1)) and len(c1) <= 25
        assert {c.swap for c in c1} == {True, False}
        assert tg.pick_block_m(per) in {c.block_m for c in c1}
        assert all(br._mid_smem_ok(c, a4) for c in c1[1:])
        for c in c1[1:]:
            tiles = sum(-(-r // c.block_m) for r in groups) * -(-n // c.block_n)
            occ = 4 if c.block_m <= 32 else 2
            assert tiles * c.split_k <= occ * 132 or c.split_k == 1
            assert tiles * c.split_k * 2 > occ * 132 or k // (c.block_k * c.split_k * 2) < 2
    assert len(br._mid_stage1(per, grouped, groups, n, k, 132, True, d)) < len(
        br._mid_stage1(per, grouped, groups, n, k, 132, False, d))
    if grouped and per == 16:
        assert 32 in {c.block_m for c in br._mid_stage1(per, grouped, groups, n, k, 132, False, d)}
    for c2 in br._mid_stage2(d, k):
        diff = {f for f in ("split_k", "num_stages", "num_warps") if getattr(c2, f) != getattr(d, f)}
        assert len(diff) == 1 and (c2.block_m, c2.block_n, c2.block_k, c2.swap) == (d.block_m, d.block_n, d.block_k,
                                                                                      d.swap)
    assert not br._mid_smem_ok(tg.GemmConfig(block_m=128, block_n=256, block_k=128, num_warps=8, num_stages=4), False)


@needs_kernels
def test_mid_compile_worker_runs_each_job():
    """The precompile worker launches each (point, mode, config) once; a config the GEMM rejects is
    returned as a failure line, not raised."""
    jobs = [("moe w13", True, 32, 64, 2, "w4a16", tg.GemmConfig(block_m=16, block_n=16, block_k=32, swap=True)),
            ("moe w13", True, 32, 64, 2, "naive", tg.GemmConfig(block_m=16, block_n=32, block_k=32)),
            ("d", False, 32, 64, 3, "w4a16", tg.StreamConfig(block_m=16, block_n=16, block_kw=16, mma=2)),
            ("d", False, 32, 64, 3, "naive", tg.GemmConfig(block_m=8, block_n=16, block_k=32))]  # block_m < 16
    failed = br._mid_compile_jobs(jobs, 4, 2, DEV)
    assert len(failed) == 1 and "naive" in failed[0] and "bad config" in failed[0], failed


@needs_kernels
def test_sweep_mid_end_to_end_tiny_shapes(monkeypatch):
    """One --sweep-mid pass (MoE w13/w2 with 4 experts top-2 and a dense GEMM, M=8) with 1 stage-1
    config, 1 stage-2 and 1 stream variant per point: every config passes the torch-reference check
    (the table would say WRONG), the summary has a row per point and the MID_TABLE an entry per point and
    mode; the configs are first run by one spawned precompile worker (stage 1, then stage 2). Timing is
    faked (interpreter)."""
    monkeypatch.setattr(br, "DEVICE", DEV)
    monkeypatch.setattr(br, "SHAPES", {"w13": (True, 32, 32), "w2": (True, 32, 16), "d4096": (False, 16, 32)})
    monkeypatch.setattr(br, "NUM_EXPERTS", 4)
    monkeypatch.setattr(br, "TOP_K", 2)
    monkeypatch.setattr(br, "L2_FLUSH_BYTES", 1)
    if DEV == "cpu":
        monkeypatch.setattr(br, "median_time_s", lambda fn, *a, **k: 1e-3)  # each config still runs once (check)
    s1, s2, st = br._mid_stage1, br._mid_stage2, br._mid_stream
    monkeypatch.setattr(br, "_mid_stage1", lambda *a: list(dict.fromkeys(
        [tg.replace(c, block_n=16, block_k=32, num_stages=2) for c in s1(*a)[:2]])))
    monkeypatch.setattr(br, "_mid_stage2", lambda c, k: s2(c, k)[:1])
    monkeypatch.setattr(br, "_mid_stream", lambda rows, cur: [tg.StreamConfig(block_m=16, block_n=16, block_kw=16,
                                                                              mma=2)])
    text = br.run_sweep_mid(["moe", "d4096"], [8], profile=False, workers=1)
    assert "WRONG" not in text and "failed:" not in text
    assert text.count("in 1 processes in") == 2 and text.count("; 0 failed") == 2  # stage 1 and stage 2 precompiled
    summary = text[text.index("--sweep-mid summary"):]
    for point in ("moe w13", "moe w2", "d4096"):
        assert f"\n{point}" in summary
    assert text.count("w4a16 default = ") == 3 and text.count("naive default = ") == 3
    assert text.count("'w4a16'): ") == 3 and text.count("'naive'): ") == 3
    assert "StreamConfig(" in text or "GemmConfig(" in text


_SM90_MID = r"""
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from verl_quads.bench import rollout as br
from verl_quads.nvfp4 import triton_gemm as tg

# every --sweep-mid candidate at the H200's shapes (132 SMs); compile the largest of each kind
cands = set()
for grouped, n, k in (br.SHAPES["w13"], br.SHAPES["w2"], br.SHAPES["d8192"], br.SHAPES["d4096"]):
    for per, groups in ((1, [1] * 128), (4, [4] * 128), (16, [16, 17] * 64)) if grouped else ((16, [16]), (64, [64]), (256, [256])):
        bm = tg.pick_block_m(per)
        d = tg.pick_config(per, sum(-(-r // bm) for r in groups), n, k, torch.device("cpu"), block_m=bm if grouped else None)
        for a4 in (False, True):
            for c in br._mid_stage1(per, grouped, groups, n, k, 132, a4, d):
                cands.add((c, a4, grouped, k))
                if not a4:
                    cands.update((c2, a4, grouped, k) for c2 in br._mid_stage2(c, k))
ext = {}
for c, a4, grouped, k in cands:
    act = c.block_m * c.block_k * (1 if a4 else 4) // 2
    val = (c.num_stages * (act + c.block_n * c.block_k // 2) + c.block_n * c.block_k * 2, c.block_n, c.block_m)
    key = (c.swap, a4, grouped) if not a4 else (None, a4, None)  # w4a16: per orientation and kind; W4A4: one
    if key not in ext or val > ext[key][0]:
        ext[key] = (val, c, k, grouped)
assert len(ext) == 5 and sum(c.num_stages == 4 and 256 in (c.block_n, c.block_k) for _, c, _, _ in ext.values()) >= 3
for key, (_, c, k, grouped) in sorted(ext.items(), key=str):
    a4 = key[1] is True
    kb, gk = k // 16, c.block_k // 16
    kb_per = -(-(-(-kb // c.split_k)) // gk) * gk
    even = kb % gk == 0 and kb_per % gk == 0 and kb_per * c.split_k == kb
    act = "*u8" if a4 else "*bf16"
    rows = "*i32" if grouped else "*fp32"
    sig = {"a_ptr": act, "as_ptr": act, "ags_ptr": "*fp32" if a4 else act, "a2_ptr": act, "a2s_ptr": act,
           "a2gs_ptr": act, "idx2_ptr": act, "w_ptr": "*u8", "ws_ptr": "*u8", "wgs_ptr": "*fp32", "bias_ptr": "*fp32",
           "out_ptr": "*fp32" if c.split_k > 1 else "*i16", "arow_ptr": rows, "orow_ptr": rows, "tile_e_ptr": rows,
           "tile_r0_ptr": rows, "tile_r1_ptr": rows}
    sig.update({i: "i32" for i in ("M", "N", "K", "KH", "KB", "NSEL2", "OUT_ROWS", "KB_PER_SPLIT", "JB_PER_SPLIT")})
    const = dict(A4=a4, DT=1, DT2=1, SECOND=0, GROUPED=grouped, HAS_BIAS=False, SPLIT_K=c.split_k, OUT=1,
                 BM=c.block_m, BN=c.block_n, GK=gk, G2=c.block_k2 // 16, SWAP=c.swap, EVEN_K=even,
                 SC4=even and gk % 4 == 0 and kb % 4 == 0)
    sig.update({nm: "constexpr" for nm in const})
    # as the JIT specializes for aligned tensors: pointers and ints divisible by 16 carry tt.divisibility=16
    attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(sig)
             if sig[nm][0] == "*" or nm in ("M", "N", "K", "KH", "KB", "OUT_ROWS", "KB_PER_SPLIT")}
    kern = triton.compile(ASTSource(fn=tg._nvfp4_gemm_kernel, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": c.num_warps, "num_stages": c.num_stages})
    # a launch needs its shared memory within sm_90's 227 KB per block (else "out of resources" on the GPU)
    assert kern.asm["cubin"] and kern.metadata.shared <= 232448, (key, c, kern.metadata.shared)
    print(key, c, kern.metadata.shared)
print("compiled")
"""


def test_sweep_mid_extreme_candidates_compile_for_sm90_without_a_gpu():
    """The largest --sweep-mid candidates (by staged bytes: w4a16 per orientation and dense / grouped, all
    of them block 256 with 4 stages at these shapes, and the largest W4A4 one) compile for sm_90 with
    triton's bundled ptxas and fit the H200's shared memory. Compiles only."""
    compile_for_sm90_in_subprocess(_SM90_MID, "on a GPU --sweep-mid itself compiles and runs the candidates")
