"""Fused NVFP4 GEMMs (verl_quads/nvfp4/triton_gemm.py) on a CUDA GPU (the H200) at Qwen3-30B-A3B
shapes, against the torch reference of the rollout (verl_quads/rollout/emulation.py; no vLLM
needed): hidden 2048, q/k/v 2048 -> (32 + 4 + 4) * 128, o_proj 4096 -> 2048, 128 experts top-8 with
expert intermediate 768 (w13 [128, 1536, 2048], w2 [128, 2048, 768]).

Per output element: |y - ref| <= 1 bf16 ulp(ref) + 4 K eps_f32 (|x| @ |w|.T) (products exact on
both sides, float32 summation order differs; see tests/unit/test_nvfp4_gemm.py). The observed
maximum in ulps is printed (pytest -s).
"""

import pytest
import torch

from _gemm_helpers import capture_graph
from _gemm_helpers import rand_w as _w
from _gemm_helpers import rand_x as _x
from verl_quads.nvfp4 import moe_routing as mr
from verl_quads.nvfp4 import triton_gemm as tg
from verl_quads.nvfp4 import triton_stream as ts
from verl_quads.rollout import emulation as em

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _check(y, ref, xf, wf, what):
    r = ref.float()
    d = (y.float() - r).abs()
    eps = torch.finfo(ref.dtype).eps if ref.dtype in (torch.bfloat16, torch.float16) else 2.0 ** -7  # 1 ulp at 1.0
    ulp = torch.where(r.abs() > 0, 2.0 ** torch.floor(torch.log2(r.abs().clamp(min=1e-30))) * eps,
                      torch.full_like(r, 1e-38))
    bound = ulp + 4 * xf.shape[1] * torch.finfo(torch.float32).eps * (xf.abs() @ wf.abs().t())
    worst = float((d / ulp).max())
    equal = float((y == ref).float().mean())
    print(f"{what}: max |diff| {worst:.2f} bf16 ulp, {equal:.2%} bit-equal")
    assert bool((d <= bound).all()), f"{what}: {worst:.2f} ulp"


@pytest.mark.parametrize("mode, per_token", [("w4a16", False), ("naive", False), ("quads", False), ("quads", True)])
@pytest.mark.parametrize("name, n, k", [("qkv", 5120, 2048), ("o_proj", 2048, 4096)])
@pytest.mark.parametrize("m", [1, 16, 64, 4096])
def test_dense_real_shapes(mode, per_token, name, n, k, m):
    x = _x(m, k)
    q_w = em.quantize_weight(_w((n, k)))
    bias = None
    xf, _ = em.quantize_activation(x, em.ActQuant(mode, 0.5, per_token, residual_granularity="block"))
    wf = em.weight_f32(q_w.packed, q_w.block_scale, q_w.global_scale.reshape(()))
    ref = em.gemm(xf, wf, bias, x.dtype)
    y = tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, q_w.global_scale.reshape(()), bias, mode,
                        residual_per_token=per_token)
    _check(y, ref, xf, wf, f"{name} M={m} {mode} per_token={per_token}")


@pytest.mark.parametrize("mode, per_token", [("w4a16", False), ("naive", False)])
@pytest.mark.parametrize("n", [4096, 8192])
@pytest.mark.parametrize("m", [2, 3, 4, 8, 16, 64, 100, 256])
def test_dense_mid_table_shapes(monkeypatch, mode, per_token, n, m):
    """Square d4096 / d8192 linears at the MID_TABLE's rows (4, 16, 64, 256), between buckets (3, 8, 100: the
    next bucket's entry) and at the d8192 M=2 DECODE_TABLE entry by the default dispatch, against the torch
    reference. With DEQUANT_MIN_ROWS emptied: the fused kernels these rows take where torch lacks mm's out_dtype
    (tests/gpu/test_dequant_gemm_gpu.py covers the decode-once path the dispatch takes here from its rows on)."""
    from verl_quads.nvfp4 import dequant_gemm as dg

    monkeypatch.setattr(dg, "DEQUANT_MIN_ROWS", {})
    x = _x(m, n)
    q_w = em.quantize_weight(_w((n, n)))
    xf, _ = em.quantize_activation(x, em.ActQuant(mode, 0.5, per_token, residual_granularity="block"))
    wf = em.weight_f32(q_w.packed, q_w.block_scale, q_w.global_scale.reshape(()))
    y = tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, q_w.global_scale.reshape(()), None, mode,
                        residual_per_token=per_token)
    _check(y, em.gemm(xf, wf, None, x.dtype), xf, wf, f"d{n} M={m} {mode} per_token={per_token}")


@pytest.mark.parametrize("mode, per_token", [("w4a16", False), ("naive", False), ("quads", True), ("quads", False)])
@pytest.mark.parametrize("gemm", ["w13", "w2"])
@pytest.mark.parametrize("tokens", [1, 4, 16, 64, 256, 512])
def test_grouped_experts_real_shapes(mode, per_token, gemm, tokens):
    """The default dispatch (MID_TABLE / DECODE_TABLE / heuristic) of one expert GEMM at Qwen3-30B-A3B width,
    routing built as moe_forward builds it (grouped_block_m: block_m 32 at 16 slots per expert)."""
    e, topk = 128, 8
    n, k = (1536, 2048) if gemm == "w13" else (2048, 768)
    q_w = em.quantize_weight(_w((e, n, k)), reduce_dims=(1, 2))
    gs = q_w.global_scale.reshape(-1)
    g = torch.Generator(device=DEV).manual_seed(2)
    ids = torch.rand(tokens, e, device=DEV, generator=g).argsort(-1)[:, :topk]  # random routing, distinct experts
    s = tokens * topk
    if gemm == "w13":  # rows = tokens, gathered per slot
        x = _x(tokens, k)
        rows_of = lambda slots: torch.div(slots, topk, rounding_mode="floor")  # noqa: E731
    else:  # rows = token-slots
        x = _x(s, k)
        rows_of = lambda slots: slots  # noqa: E731
    op, _ = tg.quantize_activation(x, mode, residual_per_token=per_token)
    xf, _ = em.quantize_activation(x, em.ActQuant(mode, 0.5, per_token, residual_granularity="block"))
    routing = mr.moe_align(ids, e, tg.grouped_block_m(-(-s // min(e, s))))
    y = tg.nvfp4_gemm(op, q_w.packed, q_w.block_scale, gs, routing=routing,
                      a_rows=rows_of(routing.sorted_slots), out_rows=s)
    flat = ids.reshape(-1)
    ys = []
    for ex in flat.unique().tolist():
        slots = (flat == ex).nonzero().squeeze(-1)
        wf = em.weight_f32(q_w.packed[ex], q_w.block_scale[ex], gs[ex])
        xr = xf[rows_of(slots)]
        # per expert: the same check as the dense GEMMs (prints the worst expert last if -s)
        r = ref = em.gemm(xr, wf, None, x.dtype)
        ulp = torch.where(r.abs() > 0, 2.0 ** torch.floor(torch.log2(r.float().abs().clamp(min=1e-30))) * 2.0 ** -7,
                          torch.full_like(r.float(), 1e-38))
        bound = ulp + 4 * k * torch.finfo(torch.float32).eps * (xr.abs() @ wf.abs().t())
        d = (y[slots].float() - ref.float()).abs()
        ys.append(float((d / ulp).max()))
        assert bool((d <= bound).all()), f"{gemm} T={tokens} expert {ex} {mode}: {ys[-1]:.2f} ulp"
    print(f"{gemm} T={tokens} {mode} per_token={per_token}: {len(ys)} experts, max |diff| {max(ys):.2f} bf16 ulp")


def _natural_entries():
    return [pytest.param(key, c, id=f"{'moe' if key[0] else 'dense'}-b{key[1]}-{key[2]}x{key[3]}")
            for key, c in sorted(tg.MID_TABLE.items(), key=str) if c.natural]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("key, cfg", _natural_entries())
def test_mid_table_natural_tiles_real_shapes(key, cfg, dtype):
    """Each natural-K swapped MID_TABLE entry (w4a16) at the real shape and M of its bucket (MoE
    Qwen3-30B-A3B experts, 128 x top-8 random routing: M = 16 * rows per expert; dense: M = the bucket), bf16
    and fp16 activations: nvfp4_gemm's default dispatch picks exactly that entry (grouped: passed explicitly where a
    DECODE_TABLE stream entry takes the routing's slot count first) and its output is within
    1 ulp of the output dtype + the float32 summation bound of the torch reference at every element (dense)
    / for every active expert (grouped)."""
    grouped, b, n, k, a4 = key
    assert not a4
    dev = torch.device(DEV)
    if not grouped:
        m = b
        x = _x(m, k).to(dtype)
        q_w = em.quantize_weight(_w((n, k)))
        gs = q_w.global_scale.reshape(())
        assert ts.decode_config(m, n, k, False) is None
        assert tg.pick_config(m, -(-m // tg.pick_block_m(m)), n, k, dev) is cfg
        wf = em.weight_f32(q_w.packed, q_w.block_scale, gs)
        xf, _ = em.quantize_activation(x, em.ActQuant("w4a16", 0.5, True))
        y = tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, gs, None, "w4a16")
        _check(y, em.gemm(xf, wf, None, dtype), xf, wf, f"d{n} M={m} w4a16 {dtype} {cfg}")
        return
    e, topk = 128, 8
    tokens = b * e // topk
    s = tokens * topk
    q_w = em.quantize_weight(_w((e, n, k)), reduce_dims=(1, 2))
    gs = q_w.global_scale.reshape(-1)
    g = torch.Generator(device=DEV).manual_seed(2)
    ids = torch.rand(tokens, e, device=DEV, generator=g).argsort(-1)[:, :topk]
    w13 = (n, k) == (1536, 2048)  # else w2 (2048, 768): rows are token-slots
    x = _x(tokens if w13 else s, k).to(dtype)
    rows_of = (lambda sl: torch.div(sl, topk, rounding_mode="floor")) if w13 else (lambda sl: sl)  # noqa: E731
    per = -(-s // min(e, s))
    assert per == b
    routing = mr.moe_align(ids, e, tg.grouped_block_m(per))
    t_max = routing.tile_expert.numel()
    assert tg.pick_config(per, t_max, n, k, dev, block_m=routing.block_m, grouped=True) is cfg
    # session 8: a DECODE_TABLE stream entry can take this routing's slot count first (w13 at 128 slots: measured
    # faster); the tile is then checked when passed explicitly (it still serves other expert counts, e.g. 256
    # experts at 1 slot per expert)
    shadowed = ts.decode_config(s, n, k, True, dtype) is not None
    op, _ = tg.quantize_activation(x, "w4a16")
    y = tg.nvfp4_gemm(op, q_w.packed, q_w.block_scale, gs, routing=routing, a_rows=rows_of(routing.sorted_slots),
                      out_rows=s, config=cfg if shadowed else None)
    xf, _ = em.quantize_activation(x, em.ActQuant("w4a16", 0.5, True))
    flat = ids.reshape(-1)
    worst = 0.0
    for ex in flat.unique().tolist():
        slots = (flat == ex).nonzero().squeeze(-1)
        wf = em.weight_f32(q_w.packed[ex], q_w.block_scale[ex], gs[ex])
        xr = xf[rows_of(slots)]
        ref = em.gemm(xr, wf, None, dtype).float()
        ulp = torch.where(ref.abs() > 0, 2.0 ** torch.floor(torch.log2(ref.abs().clamp(min=1e-30)))
                          * torch.finfo(dtype).eps, torch.full_like(ref, 1e-38))
        bound = ulp + 4 * k * torch.finfo(torch.float32).eps * (xr.abs() @ wf.abs().t())
        d = (y[slots].float() - ref).abs()
        worst = max(worst, float((d / ulp).max()))
        assert bool((d <= bound).all()), f"{key} {dtype} expert {ex}: {float((d / ulp).max()):.2f} ulp"
    print(f"MID_TABLE {key} {dtype} T={tokens}: {flat.unique().numel()} experts, max |diff| {worst:.2f} ulp")


@pytest.mark.parametrize("tokens, block_m", [(1, 16), (64, 16), (4096, 128)])
def test_moe_align_triton_equals_torch_reference(tokens, block_m):
    """The Triton moe_align == the torch reference at Qwen3-30B-A3B routing sizes (128 experts, top-8; some slots
    not local): the one launch at T = 1 and 64, the two launches at 4096 tokens."""
    e, topk = 128, 8
    g = torch.Generator(device=DEV).manual_seed(7)
    ids = torch.rand(tokens, e, device=DEV, generator=g).argsort(-1)[:, :topk]
    ids[torch.rand(tokens, topk, device=DEV, generator=g) > 0.9] = -1
    got, ref = mr.moe_align(ids, e, block_m), mr.moe_align_reference(ids, e, block_m)
    for f in ("sorted_slots", "tile_expert", "tile_row0", "tile_row1", "sorted_tokens"):
        assert torch.equal(getattr(got, f), getattr(ref, f)), f


def test_swapped_and_plain_tiles_agree():
    """The decode layout (swap=True, split-K) and the plain tile give the same bf16 outputs up to the
    float32 summation order (same bound as above)."""
    x = _x(16, 2048)
    q_w = em.quantize_weight(_w((5120, 2048)))
    gs = q_w.global_scale.reshape(())
    xf, _ = em.quantize_activation(x, em.ActQuant("naive", 0.5, True))
    wf = em.weight_f32(q_w.packed, q_w.block_scale, gs)
    ref = em.gemm(xf, wf, None, x.dtype)
    for cfg in (tg.GemmConfig(block_m=16, block_n=64, block_k=128, split_k=4, num_stages=3, swap=True),
                tg.GemmConfig(block_m=16, block_n=64, block_k=64, split_k=1, num_stages=2, swap=False),
                tg.GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)):
        y = tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, gs, None, "naive", residual_per_token=True, config=cfg)
        _check(y, ref, xf, wf, f"naive M=16 {cfg}")


def test_grouped_launch_replays_in_a_cuda_graph():
    """moe_align + quantize + grouped GEMM need no host sync: captured once, replayed with new routing."""
    e, topk, tokens, n, k = 128, 8, 16, 1536, 2048
    q_w = em.quantize_weight(_w((e, n, k)), reduce_dims=(1, 2))
    gs = q_w.global_scale.reshape(-1)
    x = _x(tokens, k)
    ids = torch.randint(0, e, (tokens, topk), device=DEV)

    def run():
        r = mr.moe_align(ids, e, 16)
        op, _ = tg.quantize_activation(x, "naive")
        return tg.nvfp4_gemm(op, q_w.packed, q_w.block_scale, gs, routing=r,
                             a_rows=torch.div(r.sorted_slots, topk, rounding_mode="floor"), out_rows=tokens * topk)

    graph, y_graph = capture_graph(run)
    ids.copy_(torch.randint(0, e, (tokens, topk), device=DEV))
    x.copy_(_x(tokens, k, seed=5))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, run())


def _moe_reference(x, sw, ids, q13, q2, mode, per_token):
    """The rollout's torch reference of the routed experts (forward_reference of
    verl_quads/rollout/moe.py, which imports vLLM and so cannot run here), per expert, float32 GEMMs."""
    t, hidden = x.shape
    k = ids.shape[1]
    act = em.ActQuant(mode, 0.5, per_token, residual_granularity="block")
    xf, _ = em.quantize_activation(x, act)
    inter = q2[0].shape[-1] * 2
    a_all = torch.zeros(t, k, inter, dtype=x.dtype, device=x.device)
    rows = {}
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        rows[e] = (tok, slot)
        h = em.gemm(xf[tok], em.weight_f32(q13[0][e], q13[1][e], q13[2][e]), None, x.dtype)
        a_all[tok, slot] = (torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()).to(x.dtype)
    out = torch.zeros(t, hidden, dtype=torch.float32, device=x.device)
    flat_f = em.quantize_activation(a_all.reshape(t * k, inter), act)[0].reshape(t, k, inter)
    for e, (tok, slot) in rows.items():
        a_f = em.quantize_activation(a_all[tok, slot], act)[0] if mode == "quads" else flat_f[tok, slot]
        y = em.gemm(a_f, em.weight_f32(q2[0][e], q2[1][e], q2[2][e]), None, x.dtype)
        out.index_add_(0, tok, y.float() * sw[tok, slot].unsqueeze(-1))
    return out.to(x.dtype)


def _qwen3_moe_weights(e, hidden, inter):
    """Routed-expert weights (w13 ``[E, 2I, H]``, w2 ``[E, H, I]``, one global scale per expert) as moe_forward's
    ``(packed, block_scale, global_scale [E])`` triples."""
    q13 = em.quantize_weight(_w((e, 2 * inter, hidden)), reduce_dims=(1, 2))
    q2 = em.quantize_weight(_w((e, hidden, inter), seed=3), reduce_dims=(1, 2))
    return ((q13.packed, q13.block_scale, q13.global_scale.reshape(-1)),
            (q2.packed, q2.block_scale, q2.global_scale.reshape(-1)))


@pytest.mark.parametrize("mode, per_token, tokens", [
    ("w4a16", True, 1), ("naive", True, 1), ("quads", True, 1), ("quads", False, 1),
    ("w4a16", True, 64), ("naive", True, 64), ("quads", True, 64), ("quads", True, 1024),
    ("w4a16", True, 16), ("w4a16", True, 256), ("naive", True, 256), ("quads", True, 256),  # MID_TABLE points
    ("w4a16", True, 4),  # DECODE_TABLE (True, 32, *) entries (session 8)
])
def test_moe_layer_real_shape(mode, per_token, tokens):
    """moe_forward (two grouped launches) == the per-expert torch reference, Qwen3-30B-A3B experts.
    GEMM1 outputs that round differently can flip a GEMM2 activation code, so the bound is relative:
    max |diff| <= 2**-6 max |ref| (the fraction of bit-equal outputs is printed)."""
    e, topk, hidden, inter = 128, 8, 2048, 768
    q13, q2 = _qwen3_moe_weights(e, hidden, inter)
    x = _x(tokens, hidden)
    g = torch.Generator(device=DEV).manual_seed(4)
    ids = torch.rand(tokens, e, device=DEV, generator=g).argsort(-1)[:, :topk]
    sw = torch.softmax(torch.randn(tokens, topk, device=DEV, generator=g), -1)
    y = tg.moe_forward(x, sw, ids, *q13, *q2, mode, residual_ratio=0.5, residual_per_token=per_token)
    ref = _moe_reference(x, sw, ids, q13, q2, mode, per_token)
    rel = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
    print(f"moe layer T={tokens} {mode} per_token={per_token}: max |diff| / max |ref| = {rel:.2e}, "
          f"{float((y == ref).float().mean()):.2%} bit-equal")
    assert rel <= 2 ** -6


# --- issue #5: the MoE layer's decode kernels (moe_align at decode sizes, gate, combine) ----------------


def _graph_us(fn):
    """Device time of one call in microseconds, CUDA-graph replays (what vLLM runs; as the bench's rows)."""
    from verl_quads.bench.timing import graph_time_s

    t = graph_time_s(fn)
    assert t is not None, "not capturable in a CUDA graph"
    return t * 1e6


@pytest.mark.parametrize("tokens, e, block_m", [(1, 128, 16), (2, 128, 16), (2, 128, 32), (1, 128, 64),
                                                (2, 256, 16), (2, 100, 16), (1, 512, 16)])
def test_moe_align_decode_real_sizes(tokens, e, block_m):
    """Decode routing (top-8, S = 8 / 16 slots) through moe_align's default dispatch (the one launch since session
    12) == the torch reference bit for bit, also replayed from a CUDA graph with new ids."""
    topk = 8
    assert tokens * topk <= mr.MOE_ALIGN_ONE_LAUNCH_MAX
    g = torch.Generator(device=DEV).manual_seed(tokens + e)
    ids = torch.rand(tokens, e, device=DEV, generator=g).argsort(-1)[:, :topk]
    ids[torch.rand(tokens, topk, device=DEV, generator=g) > 0.9] = -1
    got, ref = mr.moe_align(ids, e, block_m), mr.moe_align_reference(ids, e, block_m)
    for f in ("sorted_slots", "tile_expert", "tile_row0", "tile_row1", "sorted_tokens"):
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cap = mr.moe_align(ids, e, block_m)
    ids.copy_(torch.rand(tokens, e, device=DEV, generator=g).argsort(-1)[:, :topk])
    graph.replay()
    torch.cuda.synchronize()
    ref = mr.moe_align_reference(ids, e, block_m)
    for f in ("sorted_slots", "tile_expert", "tile_row0", "tile_row1", "sorted_tokens"):
        assert torch.equal(getattr(cap, f), getattr(ref, f)), f


#: moe_align's paths, forced by MOE_ALIGN_ONE_LAUNCH_MAX
_ALIGN_PATHS = {"one launch": 1 << 14, "two launches": 0}


@pytest.mark.parametrize("e, slots", [(128, (8, 16, 32, 64, 128, 256)), (256, (8, 16, 64)), (512, (8, 128, 256))])
def test_moe_align_paths_timed(monkeypatch, e, slots):
    """Each moe_align path (the one launch, no scratch; two launches: histogram, then scan + scatter) at ``slots``
    token-slots, ``e`` experts, top-8 (block_m as moe_forward picks it): == the torch reference, then 5 alternating
    CUDA-graph timings of one call each (us; min / median printed; informational: where MOE_ALIGN_ONE_LAUNCH_MAX
    belongs at decode sizes), and which path the default dispatch takes."""
    topk = 8
    default = mr.MOE_ALIGN_ONE_LAUNCH_MAX
    rows = []
    for s in slots:
        tokens = s // topk
        bm = tg.grouped_block_m(-(-s // min(e, s)))
        g = torch.Generator(device=DEV).manual_seed(s + e)
        ids = torch.rand(tokens, e, device=DEV, generator=g).argsort(-1)[:, :topk]
        ids[torch.rand(tokens, topk, device=DEV, generator=g) > 0.9] = -1
        ref = mr.moe_align_reference(ids, e, bm)
        for name, limit in _ALIGN_PATHS.items():
            monkeypatch.setattr(mr, "MOE_ALIGN_ONE_LAUNCH_MAX", limit)
            got = mr.moe_align(ids, e, bm)
            for f in ("sorted_slots", "tile_expert", "tile_row0", "tile_row1", "sorted_tokens"):
                assert torch.equal(getattr(got, f), getattr(ref, f)), (s, e, name, f)
        times = {name: [] for name in _ALIGN_PATHS}
        for _ in range(5):
            for name, limit in _ALIGN_PATHS.items():
                monkeypatch.setattr(mr, "MOE_ALIGN_ONE_LAUNCH_MAX", limit)
                times[name].append(_graph_us(lambda: mr.moe_align(ids, e, bm)))
        monkeypatch.setattr(mr, "MOE_ALIGN_ONE_LAUNCH_MAX", default)
        took = "one launch" if s <= default else "two launches"
        rows.append(f"S={s:4d} bm={bm:3d} (default: {took:12s}): " + " | ".join(
            f"{name} {min(t):6.2f} / {sorted(t)[2]:6.2f}" for name, t in times.items()))
    print(f"\nmoe_align, {e} experts, top-8, CUDA-graph replay of one call, us (min / median of 5):\n"
          + "\n".join(rows), flush=True)


def _gate_input(s, inter, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    h = torch.randn(s, 2 * inter, device=DEV, generator=g)
    h = h * torch.exp2(torch.randint(-12, 12, (s, 2 * inter), device=DEV, generator=g).float())
    special = [-0.0, 0.0, -100.0, 100.0, -88.5, 88.5, -87.5, 87.5, -20.0, 20.0, 3e4, -3e4, 6e4, -6e4, 1e-6, -1e-6]
    if dtype == torch.bfloat16:
        special += [3e38, -3e38, 1e-39, -1e-39, 1e-30, -1e-30]  # bf16 extremes, fp32-subnormal gates
    h[0, : len(special)] = torch.tensor(special, device=DEV)
    h[1, inter: inter + len(special)] = torch.tensor(special, device=DEV)  # as the up operand too
    return h.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("s, inter", [(8, 768), (128, 768), (4096, 768), (3, 100)])
def test_moe_silu_mul_bit_identical_to_torch_cuda(dtype, s, inter):
    """The gate kernel (libdevice expf, IEEE division, one cast) == torch's CUDA
    ``(silu(h[:, :I].float()) * h[:, I:].float()).to(dtype)`` bit for bit (torch.equal; signed zeros,
    overflowing/underflowing exp, bf16 subnormal gates included). Prints CUDA-graph times (bf16)."""
    h = _gate_input(s, inter, dtype, seed=s)
    a = tg.moe_silu_mul(h)
    ref = (torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()).to(dtype)
    bad = (a != ref) & ~(a.isnan() & ref.isnan())
    if bad.any():
        i = bad.nonzero()[:5].tolist()
        pytest.fail(f"{int(bad.sum())} of {a.numel()} differ, e.g. at {i}: h gate "
                    f"{[float(h[r, c]) for r, c in i]}, up {[float(h[r, inter + c]) for r, c in i]}, "
                    f"got {[float(a[r, c]) for r, c in i]}, torch {[float(ref[r, c]) for r, c in i]}")
    assert torch.equal(torch.signbit(a), torch.signbit(ref))
    if inter == 768 and s <= 128 and dtype == torch.bfloat16:
        t_k = _graph_us(lambda: tg.moe_silu_mul(h))
        t_t = _graph_us(lambda: (torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()).to(dtype))
        print(f"gate S={s} I={inter} {dtype}: kernel {t_k:.1f} us, torch expression {t_t:.1f} us (CUDA graph)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 16, 2048])
def test_moe_combine_cuda(dtype, t):
    """The combine kernel: the same bits run to run (fixed order j = 0..k-1), within the float32 summation
    bound of torch's ``(y.reshape(T, k, H).float() * w[..., None]).sum(1)`` plus 1 ulp of the output dtype;
    a slot of no local expert (zero row) contributes 0. Prints CUDA-graph times (bf16, T <= 16)."""
    k, hidden = 8, 2048
    g = torch.Generator(device=DEV).manual_seed(t)
    y = (torch.randn(t * k, hidden, device=DEV, generator=g) * 3).to(dtype)
    y[1] = 0
    w = torch.softmax(torch.randn(t, k, device=DEV, generator=g), -1)
    out = tg.moe_combine(y, w)
    for _ in range(3):
        assert torch.equal(out, tg.moe_combine(y, w))
    yf = y.float().reshape(t, k, hidden)
    ref = (yf * w.unsqueeze(-1)).sum(1)
    bound = 2 * k * torch.finfo(torch.float32).eps * (yf.abs() * w.unsqueeze(-1)).sum(1)
    r = ref.to(dtype).float()
    ulp = torch.where(r.abs() > 0, 2.0 ** torch.floor(torch.log2(r.abs().clamp(min=1e-38))), 0.0) * torch.finfo(dtype).eps
    d = (out.float() - ref).abs()
    print(f"combine T={t} {dtype}: {float((out == ref.to(dtype)).float().mean()):.2%} bit-equal to torch's expression")
    assert bool((d <= ulp + bound).all())
    if t <= 16 and dtype == torch.bfloat16:
        t_k = _graph_us(lambda: tg.moe_combine(y, w))
        t_t = _graph_us(lambda: (y.reshape(t, k, hidden).float() * w.unsqueeze(-1)).sum(1).to(dtype))
        print(f"combine T={t} {dtype}: kernel {t_k:.1f} us, torch expression {t_t:.1f} us (CUDA graph)")


@pytest.mark.parametrize("mode, tokens", [("w4a16", 1), ("w4a16", 16), ("naive", 1), ("naive", 16)])
def test_moe_forward_unrouted_slots_unset_equals_zero_filled(mode, tokens):
    """moe_forward leaves the GEMM outputs' rows of slots with no local expert unset (no zero-fill launches;
    the gate writes them as 0, the combine skips them): == the same steps with zero-filled GEMM outputs and no
    ids, bit for bit, at Qwen3-30B-A3B width with ~25% of the slots not local (stream and tensor-core GEMMs)."""
    e, topk, hidden, inter = 128, 8, 2048, 768
    w13, w2 = _qwen3_moe_weights(e, hidden, inter)
    x = _x(tokens, hidden)
    g = torch.Generator(device=DEV).manual_seed(9)
    ids = torch.rand(tokens, e, device=DEV, generator=g).argsort(-1)[:, :topk]
    ids[torch.rand(tokens, topk, device=DEV, generator=g) > 0.75] = -1
    ids[0, 0] = -1
    sw = torch.softmax(torch.randn(tokens, topk, device=DEV, generator=g), -1)
    torch.full((64, 2 * inter * topk), float("nan"), device=DEV)  # leave NaN in the caching allocator's blocks
    got = tg.moe_forward(x, sw, ids, *w13, *w2, mode)
    s = tokens * topk
    routing = mr.moe_align(ids, e, tg.grouped_block_m(-(-s // min(e, s))))
    op1, _ = tg.quantize_activation(x, mode)
    h = tg.nvfp4_gemm(op1, *w13, routing=routing, a_rows=routing.sorted_tokens, out_rows=s)
    op2, _ = tg.quantize_activation(tg.moe_silu_mul(h), mode)
    y = tg.nvfp4_gemm(op2, *w2, routing=routing, out_rows=s)
    assert torch.equal(got, tg.moe_combine(y, sw))
    assert not got.isnan().any()
