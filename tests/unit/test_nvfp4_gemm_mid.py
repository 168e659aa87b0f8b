"""``verl-quads bench rollout --sweep-mid`` (issue #5, 16..256 rows): its candidate launch configs, its
parallel-precompile worker and one end-to-end pass of the sweep at tiny shapes on CPU (TRITON_INTERPRET=1:
the kernels run in the interpreter; the TIMING is faked there, so that test checks the code path, the
reference check of every config and the tables, not speed), plus the sm_90 ahead-of-time compile of the
extreme candidates (triton's bundled ptxas; shared memory within the H200's 227 KB per block)."""

import os

import pytest
import torch

from verl_quads.bench import rollout as br
from verl_quads.nvfp4 import moe_routing as mr
from verl_quads.nvfp4 import triton_gemm as tg
from verl_quads.nvfp4 import triton_stream as ts

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
            ("d", False, 32, 64, 3, "w4a16", ts.StreamConfig(block_m=16, block_n=16, block_kw=16, mma=2)),
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
    s1, s2 = br._mid_stage1, br._mid_stage2
    monkeypatch.setattr(br, "_mid_stage1", lambda *a: list(dict.fromkeys(
        [tg.replace(c, block_n=16, block_k=32, num_stages=2) for c in s1(*a)[:2]])))
    monkeypatch.setattr(br, "_mid_stage2", lambda c, k: s2(c, k)[:1])
    monkeypatch.setattr(br, "_mid_stream", lambda rows, cur: [ts.StreamConfig(block_m=16, block_n=16, block_kw=16,
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
from verl_quads.nvfp4 import moe_routing as mr
from verl_quads.nvfp4 import triton_gemm as tg
from verl_quads.nvfp4 import triton_stream as ts

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
    key = (c.swap, a4)  # w4a16 swapped (natural tiles) / plain, W4A4 swapped / plain
    if key not in ext or val > ext[key][0]:
        ext[key] = (val, c, k, grouped)
assert len(ext) == 4 and sum(c.num_stages == 4 and 256 in (c.block_n, c.block_k) for _, c, _, _ in ext.values()) >= 2
assert any(c.natural for _, c, _, _ in ext.values())
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
                 SC4=even and gk % 4 == 0 and kb % 4 == 0, NAT=c.natural and not a4)
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
    """The largest --sweep-mid candidates (by staged bytes, per tile orientation, w4a16 and W4A4: the w4a16
    ones are block 256 with 4 stages, the swapped one with natural-K-order tiles) compile for sm_90 with
    triton's bundled ptxas and fit the H200's shared memory. Compiles only."""
    compile_for_sm90_in_subprocess(_SM90_MID, "on a GPU --sweep-mid itself compiles and runs the candidates")


def test_mid_table_dispatch_and_grouped_block_m():
    """MID_TABLE (the measured --sweep-mid configs): bucket lookup, pick_config takes an entry only when the
    routing's block_m is its own, each grouped bucket's entries share MID_GROUPED_BLOCK_M (one routing serves
    both expert GEMMs and every mode), every entry fits the shared-memory estimate; the heuristic no longer
    swaps w4a16 tiles (measured slower) and still swaps W4A4 ones; the DECODE_TABLE entries the sweep
    measured slower are gone and the MoE w2 stream entry covers 129..512 slots."""
    cpu = torch.device("cpu")
    w13 = tg.MID_TABLE[(True, 16, 1536, 2048, False)]
    assert tg.mid_config(16, 1536, 2048, True, False) is w13 and tg.mid_config(5, 1536, 2048, True, False) is w13
    assert tg.mid_config(17, 1536, 2048, True, False) is None and tg.mid_config(16, 1536, 2048, False, False) is None
    assert tg.pick_config(16, 200, 1536, 2048, cpu, block_m=32, grouped=True) is w13
    fallback = tg.pick_config(16, 200, 1536, 2048, cpu, block_m=16, grouped=True)  # a routing built for 16 rows
    assert fallback.block_m == 16 and not fallback.swap and fallback.block_n == 128
    assert tg.pick_config(16, 200, 1536, 2048, cpu, block_m=16, grouped=True, a4=True).swap
    assert tg.pick_config(100, 1, 8192, 8192, cpu) is tg.MID_TABLE[(False, 256, 8192, 8192, False)]
    assert tg.pick_config(300, 3, 8192, 8192, cpu).block_m == 128  # past the last bucket: heuristic
    assert [tg.grouped_block_m(r) for r in (1, 3, 4, 5, 16, 17, 40)] == [16, 16, 16, 32, 32, 32, 64]
    for (grouped, b, n, k, a4), c in tg.MID_TABLE.items():
        assert b in tg.MID_BUCKETS[grouped] and br._mid_smem_ok(c, a4)
        if grouped:
            assert c.block_m == tg.MID_GROUPED_BLOCK_M[b], (b, n, k, a4)
    for gone in ((False, 16, 8192, 8192), (False, 16, 4096, 4096), (False, 4, 8192, 8192), (False, 4, 4096, 4096)):
        assert gone not in ts.DECODE_TABLE
    # session 9: dense M <= 4 d4096 takes the bucket-4 tile (13.2 us vs 21.4 for the removed stream entry); d8192 has
    # no bucket-4 entry and keeps its bucket-16 one; d8192 M=2 takes the block_m=2 stream entry, M=3 does not
    d4 = tg.MID_TABLE[(False, 4, 4096, 4096, False)]
    assert tg.pick_config(4, 1, 4096, 4096, cpu) is d4 and tg.pick_config(2, 1, 4096, 4096, cpu) is d4
    assert tg.pick_config(5, 1, 4096, 4096, cpu) is tg.MID_TABLE[(False, 16, 4096, 4096, False)]
    assert tg.pick_config(4, 1, 8192, 8192, cpu) is tg.MID_TABLE[(False, 16, 8192, 8192, False)]
    assert ts.decode_config(4, 4096, 4096, False) is None and ts.decode_config(3, 8192, 8192, False) is None
    assert ts.decode_config(2, 8192, 8192, False) is ts.DECODE_TABLE[(False, 2, 8192, 8192)]
    assert ts.decode_config(512, 2048, 768, True) is ts.DECODE_TABLE[(True, 512, 2048, 768)]
    # session 8: the block_scale stream entry beat the MID_TABLE tile for MoE w13 at 128 slots (109 vs 125 us)
    assert ts.decode_config(128, 1536, 2048, True) is ts.DECODE_TABLE[(True, 128, 1536, 2048)]
    assert ts.decode_config(16, 8192, 8192, False) is None and ts.decode_config(4, 8192, 8192, False) is None


@needs_kernels
@pytest.mark.parametrize("mode", ["w4a16", "naive"])
def test_grouped_default_dispatch_with_a_mid_entry(monkeypatch, mode):
    """A grouped GEMM whose experts get ~12 slots each takes its MID_TABLE entry (block_m 32 from
    grouped_block_m, the measured tile kind: plain for w4a16, swapped for W4A4) by default, and moe_forward
    builds its routing with that block_m; outputs match the per-expert torch reference (1 bf16 ulp + the
    float32 summation bound, as the other GEMM tests) and the layer the torch reference of the rollout
    (relative 2**-6: GEMM1 rounding can flip a GEMM2 activation code)."""
    from verl_quads.rollout import emulation as em

    e, topk, tokens, hidden, inter = 4, 2, 24, 64, 32
    entry = tg.GemmConfig(block_m=32, block_n=32, block_k=32, block_k2=32, split_k=1, num_warps=4, num_stages=2,
                          swap=mode != "w4a16")
    monkeypatch.setitem(tg.MID_TABLE, (True, 16, 2 * inter, hidden, mode != "w4a16"), entry)
    monkeypatch.setitem(tg.MID_TABLE, (True, 16, hidden, inter, mode != "w4a16"), entry)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(tokens, hidden, generator=g) * 2).to(torch.bfloat16).to(DEV)
    ids = torch.rand(tokens, e, generator=g).argsort(-1)[:, :topk].to(DEV)
    sw = torch.softmax(torch.randn(tokens, topk, generator=g), -1).to(DEV)
    q13 = em.quantize_weight((torch.randn(e, 2 * inter, hidden, generator=g) * 0.05).to(DEV), reduce_dims=(1, 2))
    q2 = em.quantize_weight((torch.randn(e, hidden, inter, generator=g) * 0.05).to(DEV), reduce_dims=(1, 2))
    q13 = (q13.packed, q13.block_scale, q13.global_scale.reshape(-1))
    q2 = (q2.packed, q2.block_scale, q2.global_scale.reshape(-1))
    seen, launched = [], []
    align, gemm = tg.moe_align, tg.nvfp4_gemm
    monkeypatch.setattr(tg, "moe_align", lambda ids_, e_, bm: (seen.append(bm), align(ids_, e_, bm))[1])
    monkeypatch.setattr(tg, "pick_config", lambda *a, **kw: (launched.append(tg.mid_config(a[0], a[2], a[3],
                                                                                           kw["grouped"], kw["a4"])),
                                                             _pick(*a, **kw))[1])
    y = tg.moe_forward(x, sw, ids, *q13, *q2, mode)
    assert seen == [32] and launched == [entry, entry]
    # GEMM1 alone against the per-expert reference
    routing = align(ids, e, tg.grouped_block_m(tokens * topk // e))
    op, _ = tg.quantize_activation(x, mode)
    h = gemm(op, *q13, routing=routing, a_rows=routing.sorted_tokens, out_rows=tokens * topk)
    xf, _ = em.quantize_activation(x, em.ActQuant(mode, 0.5, True))
    for slot, ex in enumerate(ids.reshape(-1).tolist()):
        wf = em.weight_f32(q13[0][ex], q13[1][ex], q13[2][ex])
        xr = xf[slot // topk: slot // topk + 1]
        ref = em.gemm(xr, wf, None, x.dtype).float()
        ulp = 2.0 ** torch.floor(torch.log2(ref.abs().clamp(min=1e-30))) * 2.0 ** -7
        bound = ulp + 4 * hidden * torch.finfo(torch.float32).eps * (xr.abs() @ wf.abs().t())
        assert bool(((h[slot].float() - ref).abs() <= bound).all()), f"slot {slot}"
    # the layer against the rollout's torch arithmetic (per expert, float32 GEMMs)
    act = em.ActQuant(mode, 0.5, True)
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=DEV)
    for ex in ids.unique().tolist():
        tok, slot = (ids == ex).nonzero(as_tuple=True)
        hh = em.gemm(xf[tok], em.weight_f32(q13[0][ex], q13[1][ex], q13[2][ex]), None, x.dtype)
        a = (torch.nn.functional.silu(hh[:, :inter].float()) * hh[:, inter:].float()).to(x.dtype)
        yy = em.gemm(em.quantize_activation(a, act)[0], em.weight_f32(q2[0][ex], q2[1][ex], q2[2][ex]), None, x.dtype)
        out.index_add_(0, tok, yy.float() * sw[tok, slot].unsqueeze(-1))
    ref = out.to(x.dtype).float()
    assert float((y.float() - ref).abs().max() / ref.abs().max()) <= 2 ** -6


_pick = tg.pick_config


@needs_kernels
@pytest.mark.parametrize("grouped", [False, True])
def test_w4a16_swapped_natural_tile_matches_reference(grouped):
    """GemmConfig.natural (w4a16, swapped tile with natural-K-order activation / interleaved weight tiles):
    within 1 bf16 ulp + the float32 summation bound of the torch reference, dense (masked K tail, split-K)
    and grouped; a weight code changed must be seen; W4A4 ignores the flag (same bits)."""
    from verl_quads.rollout import emulation as em

    g = torch.Generator().manual_seed(7)
    cfg = tg.GemmConfig(block_m=16, block_n=16, block_k=32, block_k2=32, split_k=1 if grouped else 2, num_warps=4,
                        num_stages=2, swap=True, natural=True)
    n, k = 24, 112 if not grouped else 64  # dense: 7 16-blocks (masked tail)
    if grouped:
        e, topk, tokens = 3, 2, 5
        q = em.quantize_weight((torch.randn(e, n, k, generator=g) * 0.05).to(DEV), reduce_dims=(1, 2))
        ids = torch.tensor([[0, 2], [2, 1], [1, 0], [2, 0], [0, 1]], device=DEV)
        routing = mr.moe_align(ids, e, 16)
        x = torch.randn(tokens, k, generator=g).to(torch.bfloat16).to(DEV)
        gs = q.global_scale.reshape(-1)

        def run(packed, c=cfg, mode="w4a16"):
            op, _ = tg.quantize_activation(x, mode)
            return tg.nvfp4_gemm(op, packed, q.block_scale, gs, routing=routing, a_rows=routing.sorted_tokens,
                                 out_rows=tokens * topk, config=c)
        rows = [(slot, ex, slot // topk) for slot, ex in enumerate(ids.reshape(-1).tolist())]
    else:
        q = em.quantize_weight((torch.randn(n, k, generator=g) * 0.05).to(DEV))
        x = torch.randn(5, k, generator=g).to(torch.bfloat16).to(DEV)
        gs = q.global_scale.reshape(())

        def run(packed, c=cfg, mode="w4a16"):
            op, _ = tg.quantize_activation(x, mode)
            return tg.nvfp4_gemm(op, packed, q.block_scale, gs, config=c)
        rows = [(r, None, r) for r in range(5)]

    def ok(y):
        good = True
        for out_row, ex, x_row in rows:
            wf = em.weight_f32(q.packed[ex], q.block_scale[ex], gs[ex]) if grouped else em.weight_f32(q.packed, q.block_scale, gs)
            xr = x[x_row: x_row + 1].float()
            ref = em.gemm(xr, wf, None, x.dtype).float()
            ulp = 2.0 ** torch.floor(torch.log2(ref.abs().clamp(min=1e-30))) * 2.0 ** -7
            bound = ulp + 4 * k * torch.finfo(torch.float32).eps * (xr.abs() @ wf.abs().t())
            good &= bool(((y[out_row: out_row + 1].float() - ref).abs() <= bound).all())
        return good

    assert ok(run(q.packed))
    bad = q.packed.clone()
    bad.view(-1)[3] ^= 0x07
    assert not ok(run(bad))
    plain = tg.replace(cfg, natural=False)
    assert torch.equal(run(q.packed, cfg, "naive"), run(q.packed, plain, "naive"))


def _mid_table_cases():
    """Each distinct (config, grouped) of MID_TABLE that uses the swapped tile (natural-K or not), with the
    mode the table gives it: natural tiles (w4a16) are run as w4a16 and as naive (which ignores the flag)."""
    seen = {}
    for (grouped, _b, _n, _k, a4), c in sorted(tg.MID_TABLE.items(), key=str):
        if c.swap:
            seen.setdefault((c, grouped), "naive" if a4 else "w4a16")
    return [pytest.param(c, grouped, mode, id=f"{'grouped' if grouped else 'dense'}-{mode}-{br._cfg_label(c)}")
            for (c, grouped), mode in seen.items()]


@needs_kernels
@pytest.mark.parametrize("cfg, grouped, mode", _mid_table_cases())
def test_mid_table_swapped_configs_match_reference(cfg, grouped, mode):
    """Every swapped-tile MID_TABLE config, as the table launches it (its own block_m / block_n / block_k /
    split_k / stages; grouped entries with a routing of that block_m), at small shapes (2 N tiles, the last
    partial; K a multiple of the K step: the EVEN_K / int32-scale path of the real shapes, split-K included),
    bf16 and fp16 activations: within 1 ulp of the output dtype + the float32 summation bound of the torch
    reference at every element. Natural-K (w4a16) entries also run as naive, where the flag must change no bit."""
    from verl_quads.rollout import emulation as em

    g = torch.Generator().manual_seed(11)
    n = cfg.block_n + 16
    k = cfg.block_k * max(2, cfg.split_k)
    modes = [mode] + (["naive"] if cfg.natural else [])
    for dtype in (torch.bfloat16, torch.float16):
        if grouped:
            e, topk, tokens = 3, 2, 6
            q = em.quantize_weight((torch.randn(e, n, k, generator=g) * 0.05).to(DEV), reduce_dims=(1, 2))
            gs = q.global_scale.reshape(-1)
            ids = torch.tensor([[0, 2], [2, 1], [1, 0], [2, 0], [0, 1], [2, 1]], device=DEV)
            routing = mr.moe_align(ids, e, cfg.block_m)
            x = (torch.randn(tokens, k, generator=g) * 2).to(dtype).to(DEV)
            rows = [(slot, ex, slot // topk) for slot, ex in enumerate(ids.reshape(-1).tolist())]

            def run(md, c):
                op, _ = tg.quantize_activation(x, md)
                return tg.nvfp4_gemm(op, q.packed, q.block_scale, gs, routing=routing, a_rows=routing.sorted_tokens,
                                     out_rows=tokens * topk, config=c)
        else:
            q = em.quantize_weight((torch.randn(n, k, generator=g) * 0.05).to(DEV))
            gs = q.global_scale.reshape(())
            x = (torch.randn(5, k, generator=g) * 2).to(dtype).to(DEV)
            rows = [(r, None, r) for r in range(5)]

            def run(md, c):
                op, _ = tg.quantize_activation(x, md)
                return tg.nvfp4_gemm(op, q.packed, q.block_scale, gs, config=c)
        for md in modes:
            y = run(md, cfg)
            assert y.dtype == dtype
            xf, _ = em.quantize_activation(x, em.ActQuant(md, 0.5, True))
            for out_row, ex, x_row in rows:
                wf = em.weight_f32(q.packed[ex], q.block_scale[ex], gs[ex]) if grouped else \
                    em.weight_f32(q.packed, q.block_scale, gs)
                xr = xf[x_row: x_row + 1].float()
                ref = em.gemm(xr, wf, None, dtype).float()
                ulp = 2.0 ** torch.floor(torch.log2(ref.abs().clamp(min=1e-30))) * torch.finfo(dtype).eps
                bound = ulp + 4 * k * torch.finfo(torch.float32).eps * (xr.abs() @ wf.abs().t())
                d = (y[out_row: out_row + 1].float() - ref).abs()
                assert bool((d <= bound).all()), (md, dtype, out_row, float((d / ulp).max()))
        if cfg.natural:
            assert torch.equal(run("naive", cfg), run("naive", tg.replace(cfg, natural=False)))


_SM90_TABLE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from verl_quads.nvfp4 import triton_gemm as tg

# every natural-K MID_TABLE entry as nvfp4_gemm launches it at its real shape, bf16 and fp16 activations
done = 0
for (grouped, b, n, k, a4), c in sorted(tg.MID_TABLE.items(), key=str):
    if not c.natural:
        continue
    for dt, act in ((1, "*bf16"), (2, "*fp16")):
        kb, gk = k // 16, c.block_k // 16
        kb_per = -(-(-(-kb // c.split_k)) // gk) * gk
        even = kb % gk == 0 and kb_per % gk == 0 and kb_per * c.split_k == kb
        rows = "*i32" if grouped else "*fp32"
        sig = {"a_ptr": act, "as_ptr": act, "ags_ptr": act, "a2_ptr": act, "a2s_ptr": act, "a2gs_ptr": act,
               "idx2_ptr": act, "w_ptr": "*u8", "ws_ptr": "*u8", "wgs_ptr": "*fp32", "bias_ptr": "*fp32",
               "out_ptr": "*fp32" if c.split_k > 1 else "*i16", "arow_ptr": rows, "orow_ptr": rows,
               "tile_e_ptr": rows, "tile_r0_ptr": rows, "tile_r1_ptr": rows}
        sig.update({i: "i32" for i in ("M", "N", "K", "KH", "KB", "NSEL2", "OUT_ROWS", "KB_PER_SPLIT", "JB_PER_SPLIT")})
        const = dict(A4=False, DT=dt, DT2=dt, SECOND=0, GROUPED=grouped, HAS_BIAS=False, SPLIT_K=c.split_k, OUT=dt,
                     BM=c.block_m, BN=c.block_n, GK=gk, G2=c.block_k2 // 16, SWAP=c.swap, EVEN_K=even,
                     SC4=even and gk % 4 == 0 and kb % 4 == 0, NAT=True)
        sig.update({nm: "constexpr" for nm in const})
        attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(sig)
                 if sig[nm][0] == "*" or nm in ("M", "N", "K", "KH", "KB", "OUT_ROWS", "KB_PER_SPLIT")}
        kern = triton.compile(ASTSource(fn=tg._nvfp4_gemm_kernel, signature=sig, constexprs=const, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": c.num_warps, "num_stages": c.num_stages})
        assert kern.asm["cubin"] and kern.metadata.shared <= 232448, (c, kern.metadata.shared)
        print((grouped, b, n, k), dt, c, kern.metadata.shared)
        done += 1
assert done >= 2
print("compiled")
"""


def test_mid_table_natural_entries_compile_for_sm90_without_a_gpu():
    """Every natural-K swapped MID_TABLE entry (w4a16), at its real shape's constexprs (EVEN_K, int32 scales,
    split-K, grouped or not), bf16 and fp16, compiles for sm_90 with triton's bundled ptxas within the H200's
    shared memory. Compiles only."""
    compile_for_sm90_in_subprocess(_SM90_TABLE, "tests/gpu/test_nvfp4_gemm_gpu.py runs the MID_TABLE configs there")


@needs_kernels
def test_bench_rollout_rows_follow_the_default_rule_tiny_shapes(monkeypatch):
    """``bench rollout`` (run) at tiny shapes on CPU (interpreter; timing faked: every call 1 ms): the
    quads rows name and use QuantConfig()'s default selection rule, each point has one quads-bf16 comparison row
    per other rule, every quads-bf16 operand equals the torch reference's bytes for its own rule, the goal lines
    judge the default rule's quads and quads-bf16 rows and mark the comparison row as not the goal;
    ``--variants`` keeps only the asked kinds and rejects unknown ones by name."""
    from verl_quads.config import RESIDUAL_GRANULARITIES, QuantConfig

    if DEV != "cpu":
        pytest.skip("timing is faked on CPU only (the PASS lines assume equal times); on a GPU run the bench itself")
    monkeypatch.setattr(br, "DEVICE", DEV)
    monkeypatch.setattr(br, "SHAPES", {**br.SHAPES, "w13": (True, 32, 32), "w2": (True, 32, 16),
                                       "d4096": (False, 16, 64)})
    monkeypatch.setattr(br, "NUM_EXPERTS", 4)
    monkeypatch.setattr(br, "TOP_K", 2)
    calls = []

    def fake_time(fn, eager=False):
        calls.append(fn)
        fn()
        return 1e-3, "fake"
    monkeypatch.setattr(br, "_time", fake_time)
    gran = QuantConfig().residual_granularity
    others = [o for o in RESIDUAL_GRANULARITIES if o != gran]
    text = br.run(["moe", "d4096"], [3], [0.5], False)
    for tag in ("moe layer M=3", "d4096 M=3"):
        got = [ln.split("|")[1].strip() for ln in text.splitlines()
               if ln.startswith(tag) and ln.split("|")[1].strip().startswith("triton ")]
        want = ["w4a16", "naive", f"quads k=0.5 ({gran})", f"quads-bf16 k=0.5 ({gran})",
                *[f"quads-bf16 k=0.5 ({o})" for o in others]]
        assert [g.removeprefix("triton ").removesuffix(" layer") for g in got] == want, got
    assert f"residual_granularity={gran!r}" in text
    same = [ln for ln in text.splitlines() if "operand == torch reference bytes" in ln]
    assert len(same) == 2 * (1 + len(others)) and all(ln.endswith("True") for ln in same), same
    assert sum("(no fp4x2 row of this rule)" in ln for ln in same) == 2 * len(others)
    goals = text[text.index("goals (issue #5"):]
    for shape in ("moe", "d4096"):
        assert f"PASS {shape}: quads k=0.5 ({gran}) time / naive time" in goals
        assert f"PASS {shape}: quads-bf16 k=0.5 ({gran}) time / naive time" in goals
        for o in others:
            assert f"(comparison, not the goal: pass) {shape}: quads-bf16 k=0.5 ({o})" in goals
    n_all = len(calls)
    calls.clear()
    text = br.run(["d4096"], [3], [0.5], False, ("naive", "quads"))
    table = text[:text.index("goals (issue #5")]
    assert "triton quads k=0.5" in table and "triton naive" in table
    assert "triton w4a16" not in table and "quads-bf16" not in table
    with pytest.raises(ValueError, match="unknown \\['fp8'\\]"):
        br.run(["d4096"], [3], [0.5], False, ("naive", "fp8"))
    with pytest.raises(SystemExit, match="unknown --variants"):
        br.main(["--variants", "naive,bogus"])
    assert n_all > len(calls) > 0


def test_bench_rollout_model_graph_tiny_shapes(monkeypatch):
    """``bench rollout --model-graph`` at tiny shapes on CPU (interpreter; timing faked as 1 ms per GEMM launched
    inside the timed callable): the C-call timing walks C DISTINCT weight copies once each (C from
    model_graph_copies: >= the flush bytes per replay), the per-call time is the replay time / C for both the
    BF16 baseline and our GEMM (so equal fake costs give 1.00x), the 1-call timing uses one weight, and the goal
    line judges the C-call ratios (FAIL here: 1.00x < 2.5x); grouped shapes are refused by name."""
    if DEV != "cpu":
        pytest.skip("timing is faked on CPU only; on a GPU run the bench itself")
    assert br.model_graph_copies(10, 95) == 10 and br.model_graph_copies(10, 100) == 10
    assert br.model_graph_copies(10, 101) == 11 and br.model_graph_copies(1000, 10) == 2
    assert br.model_graph_copies(1, 10**9) == br.MODEL_GRAPH_MAX_COPIES
    monkeypatch.setattr(br, "DEVICE", DEV)
    monkeypatch.setattr(br, "SHAPES", {**br.SHAPES, "d4096": (False, 16, 64)})
    seen: list = []
    gemm = tg.nvfp4_gemm
    monkeypatch.setattr(tg, "nvfp4_gemm", lambda op, wp, *a, **kw: (seen.append(wp.data_ptr()), gemm(op, wp, *a, **kw))[1])
    mm = br._bf16_matmul
    monkeypatch.setattr(br, "_bf16_matmul", lambda x, w: (seen.append(w.data_ptr()), mm(x, w))[1])

    def fake_time(fn, eager=False):
        seen.clear()
        fn()
        return 1e-3 * max(1, len(seen)), "fake"
    monkeypatch.setattr(br, "_time", fake_time)
    flush = 576 * 5  # five FP4 copies (16 x 64 weight: 512 code bytes + 64 scale bytes each), 2048 bf16 bytes: 2
    text = br.run_model_graph(["d4096"], [1, 3], [0.5], ("w4a16",), flush_bytes=flush)
    rows = [ln for ln in text.splitlines() if ln.startswith("d4096 M=")]
    assert len(rows) == 4, rows
    c4 = br.model_graph_copies(16 * 64 // 2 + 16 * 64 // 16, flush)
    assert c4 == 5
    for ln in rows:
        cells = [c.strip() for c in ln.split("|")]
        if cells[1] == "triton w4a16":
            assert cells[2] == str(c4) and float(cells[4]) == 1000.0 and float(cells[7]) == 1000.0, cells
        else:
            assert cells[1] == "bf16 torch.matmul" and cells[2] == str(br.model_graph_copies(16 * 64 * 2, flush)) == "2"
            assert float(cells[4]) == 1000.0 and float(cells[7]) == 1000.0, cells
    # each C-call callable walked its C distinct weight copies, one call each
    calls = []

    def record_time(fn, eager=False):
        seen.clear()
        fn()
        calls.append(list(seen))
        return 1e-3, "fake"
    monkeypatch.setattr(br, "_time", record_time)
    br.run_model_graph(["d4096"], [1], [0.5], ("w4a16",), flush_bytes=flush)
    walks = [c for c in calls if len(c) > 1]
    assert [len(c) for c in walks] == [2, c4] and all(len(set(c)) == len(c) for c in walks), calls
    assert "FAIL d4096: M=1: 1.00x" in text
    monkeypatch.setattr(br, "SHAPES", {**br.SHAPES, "w13": (True, 32, 32)})
    with pytest.raises(ValueError, match="dense shapes only, not 'w13'"):
        br.run_model_graph(["w13"], [1], [0.5], ("w4a16",))
