"""Grouped Gluon W4A16 kernel (verl_quads/nvfp4/gluon_moe.py) on a CUDA GPU (sm_80+, triton >= 3.6 with Gluon).

Qwen3-30B-A3B expert GEMMs (128 experts, top-8 random routing; w13 [128, 1536, 2048], w2 [128, 2048, 768]) at 4 / 16 /
64 / 256 tokens, routing built as moe_forward builds it (moe_align, grouped_block_m / moe_block_m), against the rollout's torch
reference per active expert with the bound of tests/gpu/test_nvfp4_gemm_gpu.py::test_grouped_experts_real_shapes
(|y - ref| <= 1 bf16 ulp(ref) + 4 K eps_f32 (|x| @ |w|.T)); odd shapes (N not a multiple of the tile, 3 chunks of K,
several tiles per expert, slots routed to no local expert, block_m 8 / 16 / 32); each expert's rows bit for bit equal
to the dense Gluon kernel (gluon_w4a16_std, same split) on the gathered rows; the split-K fixup deterministic over
many launches and under CUDA-graph replay; the rejections. The gate fused into the w13 epilogue (silu_mul) bit for
bit equal to moe_silu_mul of the unfused GEMM, and moe_forward fused == unfused."""

import dataclasses

import pytest
import torch

from _gemm_helpers import capture_graph
from verl_quads.nvfp4 import gluon_dispatch as gd
from verl_quads.nvfp4 import gluon_gemm as gg
from verl_quads.nvfp4 import gluon_moe as gm
from verl_quads.nvfp4 import moe_routing as mr
from verl_quads.nvfp4 import triton_gemm as tg
from verl_quads.rollout import emulation as em

pytestmark = pytest.mark.gpu
DEV = "cuda"
G = gm.GroupedConfig

if gg.gluon is None:
    pytest.skip("triton.experimental.gluon not available", allow_module_level=True)

CFGS = [G(4, 1, 0, 2), G(4, 1, 0, 2, prefetch=False), G(4, 1, 1, 2), G(4, 1, 0, 4), G(8, 1, 0, 2), G(4, 2, 0, 2),
        G(4, 1, 0, 2, nt=1), G(4, 1, 2, 2, nt=1), G(4, 2, 0, 2, nt=1), G(4, 1, 0, 2, maxnreg=96)]
#: the wide kernel (_w4a16_moe_wide_kernel): RG row groups per warp, activation staged in shared memory (xs)
#: and adaptive n-tiles (nts), activation K stages (xsc) with two buffers (xsb)
WIDE = [G(4, 1, 0, 2, prefetch=False, nt=2, rg=2), G(4, 2, 0, 2, nt=2, rg=2), G(2, 1, 0, 2, prefetch=False, nt=2, rg=4),
        G(4, 1, 0, 2, nt=2, xs=True), G(4, 1, 0, 2, prefetch=False, xs=True), G(4, 1, 0, 2, nt=1, xs=True, pfd=2),
        G(4, 1, 0, 2, nt=2, rg=2, xs=True, pfd=2), G(8, 1, 0, 2, nt=2, xs=True),
        G(4, 1, 0, 2, nts=2, xs=True, xsc=4, xsb=2), G(4, 1, 0, 2, nts=2, rg=2, xs=True, xsc=4, xsb=2, pfd=2),
        G(4, 1, 0, 2, prefetch=False, nts=2, rg=2), G(8, 1, 0, 2, nts=1, xs=True, xsc=3),
        # GLUON_MOE_TABLE's T=256 entries and the candidates timed next to them (session 10 call 2)
        G(8, 1, 0, 2, xs=True, nts=2, xsc=4, xsb=2), G(4, 1, 0, 2, xs=True), G(8, 1, 0, 2, pfd=2, xs=True, nts=2, xsc=4, xsb=2),
        G(4, 1, 0, 2, rg=2, xs=True, nts=2, xsc=4, xsb=2), G(4, 1, 0, 2, rg=2, nt=2, xs=True), G(4, 1, 0, 2, pfd=2, xs=True),
        G(8, 1, 0, 2, dec=3, xs=True, nts=2, xsc=4, xsb=2), G(4, 1, 0, 2, rg=2, dec=3, xs=True, nts=2, xsc=4, xsb=2),
        G(4, 1, 0, 2, dec=3, xs=True), G(4, 1, 0, 2, rg=2, dec=3, nt=2, xs=True), G(4, 1, 0, 2, prefetch=False, dec=3)]


def _x(m, k, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g)
    x[:, ::293] *= 30.0
    return x.to(torch.bfloat16)


def _w(shape, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, device=DEV, generator=g) * 0.02


def _ids(tokens, e, topk, seed=2):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.rand(tokens, e, device=DEV, generator=g).argsort(-1)[:, :topk]  # random routing, distinct experts


def _check_experts(y, x, q_w, gs, ids, rows_of, what):
    """Per active expert: the rows of its slots within the reference bound; slots of no local expert are 0."""
    k = x.shape[1]
    xf, _ = em.quantize_activation(x, em.ActQuant("w4a16", 0.5, False))
    flat = ids.reshape(-1)
    worst = 0.0
    for ex in flat[flat >= 0].unique().tolist():
        slots = (flat == ex).nonzero().squeeze(-1)
        wf = em.weight_f32(q_w.packed[ex], q_w.block_scale[ex], gs[ex])
        xr = xf[rows_of(slots)]
        ref = em.gemm(xr, wf, None, x.dtype).float()
        ulp = torch.where(ref.abs() > 0, 2.0 ** torch.floor(torch.log2(ref.abs().clamp(min=1e-30))) * 2.0 ** -7,
                          torch.full_like(ref, 1e-38))
        bound = ulp + 4 * k * torch.finfo(torch.float32).eps * (xr.abs() @ wf.abs().t())
        d = (y[slots].float() - ref).abs()
        worst = max(worst, float((d / ulp).max()))
        assert bool((d <= bound).all()), f"{what}: expert {ex}: {float((d / ulp).max()):.2f} ulp"
    dead = (flat < 0).nonzero().squeeze(-1)
    if dead.numel():
        assert bool((y[dead] == 0).all()), f"{what}: rows of unrouted slots not zero"
    print(f"{what}: max |diff| {worst:.2f} bf16 ulp")


def _routed_inputs(tokens, e, topk, n, k, per_token, block_m=None, dead_frac=0.0, seed=0):
    """Quantized experts ``[e, n, k]``, routing ids (a ``dead_frac`` share of slots -1: not local), the activation
    (``per_token``: one row per token, as w13 reads it; else one per token-slot, as w2) and the routing of block_m
    (default: moe_forward's pick): ``(q_w, gs, ids, s, x, bm, routing)``, s = tokens * topk."""
    q_w = em.quantize_weight(_w((e, n, k), seed=seed + 1), reduce_dims=(1, 2))
    gs = q_w.global_scale.reshape(-1)
    ids = _ids(tokens, e, topk, seed + 2)
    if dead_frac:
        g = torch.Generator(device=DEV).manual_seed(seed + 3)
        ids = torch.where(torch.rand(ids.shape, device=DEV, generator=g) < dead_frac, -1, ids)
    s = tokens * topk
    x = _x(tokens if per_token else s, k, seed)
    bm = block_m or tg.grouped_block_m(-(-s // min(e, s)))
    return q_w, gs, ids, s, x, bm, mr.moe_align(ids, e, bm)


def _gemm_case(gemm, tokens, cfg, e=128, topk=8, n=None, k=None, block_m=None, dead_frac=0.0, seed=0):
    n0, k0 = (1536, 2048) if gemm == "w13" else (2048, 768)
    n, k = n or n0, k or k0
    q_w, gs, ids, s, x, bm, routing = _routed_inputs(tokens, e, topk, n, k, gemm == "w13", block_m, dead_frac, seed)
    if gemm == "w13":
        rows_of = lambda slots: torch.div(slots, topk, rounding_mode="floor")  # noqa: E731
    else:
        rows_of = lambda slots: slots  # noqa: E731
    a_rows = routing.sorted_tokens if gemm == "w13" else None
    y = gm.gluon_w4a16_grouped(x, q_w.packed, q_w.block_scale, gs, routing, a_rows=a_rows, out_rows=s, cfg=cfg)
    assert y.shape == (s, n) and y.dtype == torch.bfloat16
    _check_experts(y, x, q_w, gs, ids, rows_of, f"{gemm} T={tokens} N={n} K={k} bm={bm} {cfg.label}")
    return y, x, q_w, gs, ids, routing


@pytest.mark.parametrize("tokens", [4, 16, 64, 256])
@pytest.mark.parametrize("gemm", ["w13", "w2"])
def test_grouped_real_shapes(gemm, tokens):
    _gemm_case(gemm, tokens, CFGS[0])


@pytest.mark.parametrize("cfg", CFGS[1:], ids=lambda c: c.label)
@pytest.mark.parametrize("gemm, tokens", [("w13", 16), ("w2", 64), ("w13", 256)])
def test_grouped_configs(gemm, tokens, cfg):
    _gemm_case(gemm, tokens, cfg)


@pytest.mark.parametrize("cfg", [CFGS[0], CFGS[2], G(4, 1, 3, 2), G(4, 1, 3, 2, nt=1), G(4, 1, 3, 2, rg=2, xs=True),
                                 G(4, 1, 0, 2, nt=1, rg=2), G(8, 1, 0, 2, nt=1, xs=True, pfd=2),
                                 G(4, 1, 2, 2, nts=1, rg=2, xs=True, xsc=2, xsb=2),
                                 gd.GLUON_MOE_TABLE[(2048, 1536, 2048)], gd.GLUON_MOE_TABLE[(2048, 2048, 768)]],
                         ids=lambda c: c.label.replace(" ", "_"))
@pytest.mark.parametrize("n, k, block_m, e, topk, tokens", [
    (200, 384, 8, 8, 2, 40),  # N % 64 != 0, 3 chunks, ~10 rows per expert in 8-row tiles (2 tiles per expert)
    (1536, 2048, 16, 16, 4, 37),  # ~9 rows per expert, 16-row tiles (some experts 2 tiles)
    (2048, 768, 32, 8, 2, 100),  # ~25 rows per expert, 32-row tiles
    (96, 128, 16, 4, 1, 3),  # one chunk, 1.5 row groups
])
def test_grouped_odd_shapes(cfg, n, k, block_m, e, topk, tokens):
    if cfg.nt and (block_m // 8) % cfg.nt:
        pytest.skip(f"nt {cfg.nt} does not divide block_m / 8 = {block_m // 8} (the kernel raises; the dispatch skips)")
    _gemm_case("w13", tokens, cfg, e=e, topk=topk, n=n, k=k, block_m=block_m, dead_frac=0.2, seed=tokens)


@pytest.mark.parametrize("gemm, tokens", [("w13", 16), ("w2", 64)])
def test_grouped_equals_dense_per_expert(gemm, tokens):
    """Each expert's rows equal the dense standard-layout kernel on that expert's gathered rows, bit for bit (same
    config and split: the same loads, decode, MMA and summation order; only the row gather / scatter differ)."""
    cfg = G(4, 1, 2, 2)
    y, x, q_w, gs, ids, routing = _gemm_case(gemm, tokens, cfg)
    flat = ids.reshape(-1)
    topk = ids.shape[1]
    for ex in flat.unique().tolist():
        slots = (flat == ex).nonzero().squeeze(-1)
        rows = torch.div(slots, topk, rounding_mode="floor") if gemm == "w13" else slots
        yd = gg.gluon_w4a16_std(x[rows].contiguous(), q_w.packed[ex], q_w.block_scale[ex], gs[ex], None, cfg)
        assert torch.equal(y[slots], yd), f"expert {ex}"


@pytest.mark.parametrize("cfg, tokens", [(G(4, 1, 4, 2), 16), (G(4, 1, 4, 2, nt=1), 64),
                                         (G(4, 1, 4, 2, nt=1, rg=2, xs=True), 64)], ids=["one-pass", "passes", "wide-xs"])
def test_grouped_split_deterministic_and_graph(cfg, tokens):
    e, n, k, topk = 128, 1536, 2048, 8
    q_w = em.quantize_weight(_w((e, n, k)), reduce_dims=(1, 2))
    gs = q_w.global_scale.reshape(-1)
    ids = _ids(tokens, e, topk)
    routing = mr.moe_align(ids, e, 16)
    x = _x(tokens, k)
    assert gm.grouped_plan(n, k, e, cfg)[1] == 4

    def run(xx):
        return gm.gluon_w4a16_grouped(xx, q_w.packed, q_w.block_scale, gs, routing, a_rows=routing.sorted_tokens,
                                      out_rows=tokens * topk, cfg=cfg)

    ref = run(x)
    bad = sum(not torch.equal(run(x), ref) for _ in range(50))
    assert bad == 0, f"{bad} of 50 launches differ"
    xs = x.clone()
    graph, out = capture_graph(lambda: run(xs))
    x2 = _x(tokens, k, seed=5)
    for xx in (x, x2, x):
        xs.copy_(xx)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(xx))


@pytest.mark.parametrize("cfg", WIDE, ids=lambda c: c.label.replace(" ", "_"))
@pytest.mark.parametrize("gemm, tokens", [("w13", 256), ("w2", 256), ("w2", 64)])
def test_grouped_wide_equals_base(gemm, tokens, cfg):
    """The wide kernel (rg row groups per warp, xs activation staging, prefetch depth) within the reference bound and
    bit for bit equal to the one-row-group kernel of the same kc / nt / split (the same loads, decode, mma.sync and
    summation order per output element; only which warp / program computes it and where x is read from differ)."""
    y, x, q_w, gs, ids, routing = _gemm_case(gemm, tokens, cfg)
    n, k = q_w.packed.shape[1], x.shape[1]
    split = gm.grouped_plan(n, k, min(128, ids.numel()), cfg)[1]
    base = G(4, cfg.kc, split, cfg.occ, prefetch=cfg.prefetch, nt=cfg.nt)
    yb = gm.gluon_w4a16_grouped(x, q_w.packed, q_w.block_scale, gs, routing,
                                a_rows=routing.sorted_tokens if gemm == "w13" else None, out_rows=ids.numel(), cfg=base)
    assert torch.equal(y, yb)


#: routing block_m 64 (T=1024 at Qwen3-30B-A3B: ~64 slots per expert): one pass of 8 n-tiles (the one-group kernel,
#: the wide kernel with rg 1 / 2 and staged x), adaptive n-tiles (nts 4: a tile of <= 32 rows runs 4), passes of nt 4
#: / 2, split-K over passes
BM64 = [G(4, 1, 0, 2, maxnreg=128, dec=3, xs=True, nts=4, xsc=1, xsb=2),
        G(8, 1, 0, 2, maxnreg=128, dec=3, xs=True, nts=4, xsc=1, xsb=2),
        G(4, 1, 0, 2, rg=2, dec=3, xs=True, nts=4, xsc=1, xsb=2),
        G(4, 1, 0, 2, maxnreg=128, rg=2, dec=3, xs=True, nt=4, nts=2, xsc=1, xsb=2),
        G(4, 1, 0, 2), G(4, 1, 0, 2, nt=2), G(4, 1, 2, 2, nt=4, rg=2)]


@pytest.mark.parametrize("cfg", BM64, ids=lambda c: c.label.replace(" ", "_"))
@pytest.mark.parametrize("gemm, tokens, e, dead", [("w13", 1024, 128, 0.0), ("w2", 1024, 128, 0.0),
                                                   ("w13", 64, 8, 0.1)])
def test_block_m64_equals_block_m32(gemm, tokens, e, dead, cfg):
    """Routing block_m 64: within the reference bound per active expert, and bit for bit the same config on block_m
    32 routing of the same ids (nt capped at 4; same kc / split / decode: the same loads, mma.sync and summation
    order per output element -- only which program computes a row, in how many n-tiles, differs)."""
    y, x, q_w, gs, ids, routing = _gemm_case(gemm, tokens, cfg, e=e, block_m=64, dead_frac=dead, seed=tokens)
    assert routing.block_m == 64
    r32 = mr.moe_align(ids, e, 32)
    y32 = gm.gluon_w4a16_grouped(x, q_w.packed, q_w.block_scale, gs, r32,
                                 a_rows=r32.sorted_tokens if gemm == "w13" else None, out_rows=ids.numel(),
                                 cfg=dataclasses.replace(cfg, nt=min(cfg.nt, 4)))
    assert torch.equal(y, y32)


@pytest.mark.parametrize("cfg", BM64, ids=lambda c: c.label.replace(" ", "_"))
@pytest.mark.parametrize("tokens, e, dead", [(1024, 128, 0.0), (64, 8, 0.1)])
def test_fused_gate_block_m64(tokens, e, dead, cfg):
    """The fused gate on block_m 64 routing: ``a`` bit for bit moe_silu_mul of the unfused GEMM's h (each config with
    split 1: the fused epilogue has no split-K fixup, and 8 experts' plan would split K)."""
    cfg = dataclasses.replace(cfg, split=1)
    assert not gm.silu_mul_refusal(1536, 2048, min(e, tokens * 8), cfg)
    a, ref, _ = _fused_vs_unfused(tokens, cfg, e=e, block_m=64, dead_frac=dead, seed=tokens)
    assert torch.equal(a, ref)


def test_grouped_rejects_unsupported():
    e, n, k = 4, 64, 1024
    q_w = em.quantize_weight(_w((e, n, k)), reduce_dims=(1, 2))
    gs = q_w.global_scale.reshape(-1)
    ids = _ids(3, e, 2)
    with pytest.raises(ValueError):  # block_m 128
        gm.gluon_w4a16_grouped(_x(3, k), q_w.packed, q_w.block_scale, gs, mr.moe_align(ids, e, 128))
    with pytest.raises(ValueError):  # float32 activation
        gm.gluon_w4a16_grouped(_x(3, k).float(), q_w.packed, q_w.block_scale, gs, mr.moe_align(ids, e, 16))
    with pytest.raises(ValueError):  # nt 4 does not divide block_m / 8 = 2
        gm.gluon_w4a16_grouped(_x(3, k), q_w.packed, q_w.block_scale, gs, mr.moe_align(ids, e, 16), cfg=G(nt=4))
    with pytest.raises(ValueError):  # nt 8 does not divide block_m / 8 = 4
        gm.gluon_w4a16_grouped(_x(3, k), q_w.packed, q_w.block_scale, gs, mr.moe_align(ids, e, 32), cfg=G(nt=8))
    for bad in (G(kc=2, xs=True), G(rg=3), G(pfd=2), G(xsb=2), G(nts=3), G(nt=3), G(dec=2), G(wev=1)):
        with pytest.raises(ValueError):
            gm.gluon_w4a16_grouped(_x(3, k), q_w.packed, q_w.block_scale, gs, mr.moe_align(ids, e, 16), cfg=bad)
    with pytest.raises(ValueError, match="ks .split-K inside the program. is a dense-kernel option"):
        gm.gluon_w4a16_grouped(_x(3, k), q_w.packed, q_w.block_scale, gs, mr.moe_align(ids, e, 16), cfg=G(ks=8))
    with pytest.raises(ValueError):  # K % 128 != 0
        q2 = em.quantize_weight(_w((e, n, 1040)), reduce_dims=(1, 2))
        gm.gluon_w4a16_grouped(_x(3, 1040), q2.packed, q2.block_scale, q2.global_scale.reshape(-1),
                               mr.moe_align(ids, e, 16))


@pytest.mark.parametrize("key", sorted(gd.GLUON_MOE_TABLE), ids=lambda k: f"S{k[0]}-{k[1]}x{k[2]}")
def test_default_dispatch_takes_the_table(key):
    """Each GLUON_MOE_TABLE entry at its measured point (Qwen3-30B-A3B experts, T = slots / 8 tokens, routing as
    moe_forward builds it): nvfp4_gemm's default dispatch picks it (on this sm_90 GPU) and returns the explicit
    kernel's bytes, within the reference bound per active expert."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("GLUON_MOE_TABLE entries are for sm_90")
    slots, n, k = key
    gemm = "w13" if (n, k) == (1536, 2048) else "w2"
    tokens = slots // 8
    # routing as moe_forward builds it where both GEMMs run on this kernel (moe_block_m)
    y, x, q_w, gs, ids, routing = _gemm_case(gemm, tokens, gd.GLUON_MOE_TABLE[key],
                                             block_m=gd.GLUON_MOE_ROUTING_BLOCK_M.get(slots))
    assert gd.gluon_grouped_config(x, q_w.packed, routing) is gd.GLUON_MOE_TABLE[key]
    op, _ = tg.quantize_activation(x, "w4a16")
    yd = tg.nvfp4_gemm(op, q_w.packed, q_w.block_scale, gs, routing=routing,
                       a_rows=routing.sorted_tokens if gemm == "w13" else None, out_rows=tokens * 8)
    assert torch.equal(yd, y)


# ---- the gate fused into the w13 GEMM's epilogue (gluon_w4a16_grouped(silu_mul=True), moe_forward's fuse_gate)

def _fused_vs_unfused(tokens, cfg, e=128, topk=8, inter=768, k=2048, block_m=None, dead_frac=0.0, seed=0,
                      zero_unrouted=True):
    """``a`` of the fused launch and moe_silu_mul(h) of the unfused one (same config, routing, inputs)."""
    q_w, gs, ids, s, x, _, routing = _routed_inputs(tokens, e, topk, 2 * inter, k, True, block_m, dead_frac, seed)
    args = (x, q_w.packed, q_w.block_scale, gs, routing)
    h = gm.gluon_w4a16_grouped(*args, a_rows=routing.sorted_tokens, out_rows=s, cfg=cfg)
    ref = tg.moe_silu_mul(h, ids)
    a = gm.gluon_w4a16_grouped(*args, a_rows=routing.sorted_tokens, out_rows=s, cfg=cfg, silu_mul=True,
                               zero_unrouted=zero_unrouted)
    assert a.shape == (s, inter) and a.dtype == torch.bfloat16
    return a, ref, ids


#: T=1 has no GLUON_MOE_TABLE entry: an explicit one-K-range config (the planned split of G(4, 1, 0, 2) is > 1 there)
FUSED_POINTS = [(1, G(4, 1, 1, 2, nt=1))] + [(key[0] // 8, cfg) for key, cfg in sorted(gd.GLUON_MOE_TABLE.items())
                                              if key[1:] == (1536, 2048)]


@pytest.mark.parametrize("tokens, cfg", FUSED_POINTS, ids=lambda v: str(v) if isinstance(v, int) else v.label)
def test_fused_gate_equals_unfused(tokens, cfg):
    """Qwen3-30B-A3B w13 at T = 1 and each GLUON_MOE_TABLE w13 entry's point: the fused epilogue's ``a`` is bit for
    bit moe_silu_mul of the unfused GEMM's h."""
    a, ref, _ = _fused_vs_unfused(tokens, cfg)
    assert torch.equal(a, ref)


@pytest.mark.parametrize("cfg", [G(4, 1, 1, 2), G(4, 1, 1, 2, nt=1), G(4, 2, 1, 2, prefetch=False), G(8, 1, 1, 2),
                                 G(1, 1, 1, 2, nt=1),
                                 G(2, 1, 1, 4, nt=1), G(4, 1, 1, 2, nt=2, rg=2), G(2, 1, 1, 2, nt=2, rg=4),
                                 G(4, 1, 1, 2, nts=1, rg=2, xs=True, xsc=2, xsb=2),
                                 G(4, 1, 1, 2, rg=2, dec=3, xs=True, nts=2, xsc=4, xsb=2),
                                 G(4, 1, 1, 2, rg=2, dec=3, nt=2, xs=True), G(8, 1, 1, 2, nt=1, xs=True, pfd=2)],
                         ids=lambda c: c.label.replace(" ", "_"))
@pytest.mark.parametrize("inter, k, block_m, e, topk, tokens", [
    (192, 384, 8, 8, 2, 40),  # 3 chunks, ~10 rows per expert in 8-row tiles (2 tiles per expert)
    (128, 2048, 16, 16, 4, 37),  # ~9 rows per expert, 16-row tiles (some experts 2 tiles)
    (768, 768, 32, 8, 2, 100),  # ~25 rows per expert, 32-row tiles (nts passes)
])
def test_fused_gate_odd_shapes(cfg, inter, k, block_m, e, topk, tokens):
    """Several programs along I, passes, adaptive n-tiles, slots of no local expert (rows 0, as moe_silu_mul writes
    them): fused == unfused bit for bit; zero_unrouted=False leaves the unrouted rows and writes the same routed
    rows."""
    if cfg.nt and (block_m // 8) % cfg.nt:
        pytest.skip(f"nt {cfg.nt} does not divide block_m / 8 = {block_m // 8}")
    a, ref, ids = _fused_vs_unfused(tokens, cfg, e=e, topk=topk, inter=inter, k=k, block_m=block_m, dead_frac=0.2,
                                    seed=tokens)
    assert torch.equal(a, ref)
    flat = ids.reshape(-1)
    assert bool((flat < 0).any()) and bool((a[flat < 0] == 0).all())
    a2, _, _ = _fused_vs_unfused(tokens, cfg, e=e, topk=topk, inter=inter, k=k, block_m=block_m, dead_frac=0.2,
                                 seed=tokens, zero_unrouted=False)
    assert torch.equal(a2[flat >= 0], ref[flat >= 0])


def test_fused_gate_rejects():
    e, k, inter = 8, 256, 96
    q_w, gs, _, _, x, _, routing = _routed_inputs(3, e, 2, 2 * inter, k, True, block_m=16)
    args = (x, q_w.packed, q_w.block_scale, gs, routing)
    with pytest.raises(ValueError, match="multiple of BN / 2"):  # I = 96, BN / 2 = 64 (4 warps, rg 2)
        gm.gluon_w4a16_grouped(*args, cfg=G(4, 1, 1, 2, rg=2), silu_mul=True)
    with pytest.raises(ValueError, match="split"):  # two K ranges: no fused split-K fixup
        gm.gluon_w4a16_grouped(*args, cfg=G(4, 1, 2, 2), silu_mul=True)
    with pytest.raises(ValueError, match="multiple of BN / 2"):  # 8 warps: BN / 2 = 64
        gm.gluon_w4a16_grouped(*args, cfg=G(8, 1, 1, 2), silu_mul=True)


def _moe_weights(e=128, hidden=2048, inter=768, seed=11):
    q13 = em.quantize_weight(_w((e, 2 * inter, hidden), seed=seed), reduce_dims=(1, 2))
    q2 = em.quantize_weight(_w((e, hidden, inter), seed=seed + 1), reduce_dims=(1, 2))
    return (q13.packed, q13.block_scale, q13.global_scale.reshape(-1), q2.packed, q2.block_scale,
            q2.global_scale.reshape(-1))


@pytest.mark.parametrize("mode, pt, comb, gran", [("w4a16", False, "fp4x2", "block"),
                                                  ("quads", True, "bf16", "channel"), ("quads", False, "bf16", "block")])
@pytest.mark.parametrize("tokens, dead", [(4, 0.0), (16, 0.0), (64, 0.0), (256, 0.0), (16, 0.3), (256, 0.3)])
def test_moe_forward_fused_gate_equals_unfused(tokens, dead, mode, pt, comb, gran):
    """moe_forward (Qwen3-30B-A3B experts) with the gate fused (default where it applies; fuse_gate=True must not
    raise here: each T has GLUON_MOE_TABLE entries) == fuse_gate=False, bit for bit, for every act_mode that takes the
    fused path; with slots of no local expert (expert parallelism) too."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("GLUON_MOE_TABLE entries are for sm_90")
    w = _moe_weights()
    ids = _ids(tokens, 128, 8, seed=tokens)
    if dead:
        g = torch.Generator(device=DEV).manual_seed(7)
        ids = torch.where(torch.rand(ids.shape, device=DEV, generator=g) < dead, -1, ids)
    sw = torch.softmax(torch.randn(tokens, 8, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3)), -1)
    x = _x(tokens, 2048, seed=tokens)
    kw = dict(residual_per_token=pt, residual_combine=comb, residual_granularity=gran)
    y_u = tg.moe_forward(x, sw, ids, *w, mode, fuse_gate=False, **kw)
    y_f = tg.moe_forward(x, sw, ids, *w, mode, fuse_gate=True, **kw)
    y_d = tg.moe_forward(x, sw, ids, *w, mode, **kw)
    assert torch.equal(y_f, y_u) and torch.equal(y_d, y_u)


#: the session-12 GLUON_MOE_TABLE entries at T=1024 on routing block_m 64 (moe_forward's routing there until session 13)
S12_BM64 = {"w13": G(4, 1, 0, 2, rg=2, dec=3, xs=True, nts=4, xsc=1, xsb=2),
            "w2": G(4, 1, 0, 2, maxnreg=128, rg=2, dec=3, xs=True, nt=4, nts=2)}


@pytest.mark.parametrize("mode, pt, comb, gran", [("w4a16", False, "fp4x2", "block"),
                                                  ("quads", True, "bf16", "channel")])
def test_moe_forward_t1024_block_m32_equals_session12_block_m64(mode, pt, comb, gran):
    """T=1024 (8192 slots, ~64 per expert: grouped_block_m 64): moe_forward builds routing block_m 32 where both GEMMs
    run on the Gluon kernel (GLUON_MOE_ROUTING_BLOCK_M; not for an FP4 GEMM1 operand) and returns the bytes of the
    session-12 path, the 64-row entries on block_m-64 routing (gate fused, then w2, then the combine): the tile height
    and n-tiling change which program computes a row, not its K loop (split 1, kc 1)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("GLUON_MOE_TABLE entries are for sm_90")
    t, e, s = 1024, 128, 8192
    w = _moe_weights()
    ids = _ids(t, e, 8, seed=t)
    sw = torch.softmax(torch.randn(t, 8, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3)), -1)
    x = _x(t, 2048, seed=t)
    kw = dict(residual_ratio=0.5, residual_per_token=pt, residual_combine=comb, residual_granularity=gran)
    op1, _ = tg.quantize_activation(x, mode, **kw)
    assert op1.mode == "w4a16" and tg.grouped_block_m(s // e) == 64
    assert tg.moe_block_m(s, e, op1.values, w[0], w[3]) == 32 and tg.moe_block_m(s, e, None, w[0], w[3]) == 64
    y = tg.moe_forward(x, sw, ids, *w, mode, **kw)
    r64 = mr.moe_align(ids, e, 64)
    a = gm.gluon_w4a16_grouped(op1.values, *w[:3], r64, a_rows=r64.sorted_tokens, out_rows=s, cfg=S12_BM64["w13"],
                               zero_unrouted=mode != "w4a16", silu_mul=True)  # as moe_forward
    op2, _ = tg.quantize_activation(a, mode, **kw)
    y2 = gm.gluon_w4a16_grouped(op2.values, *w[3:], r64, out_rows=s, cfg=S12_BM64["w2"], zero_unrouted=False)
    assert torch.equal(y, tg.moe_combine(y2, sw, ids))


def test_moe_forward_fuse_gate_true_refuses():
    """fuse_gate=True where the fused path does not apply raises (no silent unfused run): T=1 (no GLUON_MOE_TABLE
    entry) and an FP4 GEMM1 operand (naive)."""
    w = _moe_weights()
    sw = torch.full((1, 8), 0.125, device=DEV)
    with pytest.raises(ValueError, match="fuse_gate"):
        tg.moe_forward(_x(1, 2048), sw, _ids(1, 128, 8), *w, "w4a16", fuse_gate=True)
    sw = torch.full((16, 8), 0.125, device=DEV)
    with pytest.raises(ValueError, match="fuse_gate"):
        tg.moe_forward(_x(16, 2048), sw, _ids(16, 128, 8), *w, "naive", fuse_gate=True)
