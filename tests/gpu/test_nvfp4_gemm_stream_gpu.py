"""W4A16 weight-streaming decode kernel (``StreamConfig``, verl_quads/nvfp4/triton_gemm.py) on a CUDA
GPU (the H200), every variant family at Qwen3-30B-A3B / dense decode shapes, against the rollout's torch
reference (verl_quads/rollout/emulation.py). Per element: |y - ref| <= 1 bf16 ulp(ref) + 4 K eps_f32
(|x| @ |w|.T) (see tests/unit/test_nvfp4_gemm_stream.py, which runs the same variants in the CPU
interpreter at small shapes).

The GPU-specific risks these cover: the ``bits`` decode makes float32 subnormals (codes 0/1 times
2**-126) and relies on the multiply keeping them (no flush-to-zero) -- the one-hot test compares
against the dequantized weight bit for bit; the bf16/fp16 tensor-core dots (the interpreter runs
them in float32); 16-byte vector loads and the split-K reduction kernel at real sizes; the ``f16x2``
decode's inline-PTX conversions (``late_scale``; the interpreter runs the plain Triton form) and the
``bf16x2`` decode's packed bf16 multiply of bf16 subnormals (the interpreter widens to float32 instead).
"""

import pytest
import torch

from _gemm_helpers import capture_graph
from _gemm_helpers import check_close as _check
from _gemm_helpers import rand_w as _w
from _gemm_helpers import rand_x as _x
from verl_quads.nvfp4 import gluon_dispatch as gd
from verl_quads.nvfp4 import moe_routing as mr
from verl_quads.nvfp4 import triton_gemm as tg
from verl_quads.nvfp4 import triton_stream as ts
from verl_quads.rollout import emulation as em

pytestmark = pytest.mark.gpu
DEV = "cuda"
SC = ts.StreamConfig

VARIANTS = [
    SC(block_m=1, block_n=128, block_kw=16, num_warps=4),
    SC(block_m=1, block_n=64, block_kw=32, num_warps=4, decode="f16", prefetch=False),
    SC(block_m=2, block_n=256, block_kw=8, num_warps=8, split_k=2, fixup=True),
    SC(block_m=4, block_n=64, block_kw=16, num_warps=4, split_k=1),
    SC(block_m=16, block_n=64, block_kw=16, mma=1, num_warps=4, fixup=True),
    SC(block_m=16, block_n=128, block_kw=32, mma=1, num_warps=4, num_stages=3, prefetch=False),
    SC(block_m=16, block_n=128, block_kw=16, mma=2, num_warps=4, decode="f16"),
    # software-pipelined K loop (asynchronous 16-byte weight copies to shared memory), split-K target 8/SM
    SC(block_m=1, block_n=128, block_kw=16, num_warps=4, prefetch=False, pipe=3, fixup=True),
    SC(block_m=2, block_n=64, block_kw=32, num_warps=4, prefetch=False, pipe=4, occ=8),
    SC(block_m=1, block_n=128, block_kw=8, num_warps=4, fixup=True, xperm=True),  # nibble-major activation
    # f16x2 pair decode (inline-PTX fp16 -> fp32 conversions on the GPU) + block scale per word (late_scale)
    SC(block_m=1, block_n=128, block_kw=16, num_warps=4, prefetch=False, pipe=3, fixup=True, decode="f16x2",
       late_scale=True),
    SC(block_m=4, block_n=64, block_kw=16, num_warps=4, split_k=1, decode="f16x2", late_scale=True),
    SC(block_m=2, block_n=128, block_kw=8, num_warps=4, fixup=True, xperm=True, decode="f16x2", late_scale=True),
    SC(block_m=16, block_n=128, block_kw=16, mma=2, num_warps=4, decode="f16x2"),  # pair decode, tensor cores
    # block scale per 16-element block (block_scale), whole-row tiles (issue #5 roofline candidates)
    SC(block_m=1, block_n=256, block_kw=16, num_warps=4, fixup=True, decode="f16x2", late_scale=True, block_scale=True),
    SC(block_m=1, block_n=16, block_kw=128, num_warps=4, fixup=True, decode="f16x2", late_scale=True),
    SC(block_m=2, block_n=16, block_kw=64, num_warps=2, decode="f16x2", late_scale=True, block_scale=True),
    # bf16 pair decode + packed bf16 scale multiply (bf16 subnormal codes), tensor cores
    SC(block_m=16, block_n=128, block_kw=16, mma=2, num_warps=4, decode="bf16x2"),
    SC(block_m=16, block_n=128, block_kw=32, mma=1, num_warps=4, num_stages=3, prefetch=False, decode="bf16x2"),
    # int32 activation pairs (x_pairs; issue #5 phase 2): prefetched, pipelined 2-row chunks, pipelined
    SC(block_m=1, block_n=16, block_kw=128, num_warps=4, fixup=True, decode="f16x2", late_scale=True, block_scale=True,
       x_pairs=True),
    SC(block_m=2, block_n=16, block_kw=128, num_warps=4, fixup=True, decode="f16x2", late_scale=True, block_scale=True,
       x_pairs=True, prefetch=False, pipe=3),
    SC(block_m=1, block_n=64, block_kw=32, num_warps=4, decode="f16x2", late_scale=True, block_scale=True,
       x_pairs=True, prefetch=False, pipe=3),
]
LATE = [c for c in VARIANTS if c.late_scale]
BF = [c for c in VARIANTS if c.decode == "bf16x2"]
X2 = [c for c in VARIANTS if c.x_pairs]


@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: c.label)
@pytest.mark.parametrize("m, n, k", [(1, 8192, 8192), (4, 5120, 2048), (16, 2048, 4096), (3, 4096, 4096)])
def test_stream_dense(cfg, m, n, k):
    x = _x(m, k)
    q_w = em.quantize_weight(_w((n, k)))
    gs = q_w.global_scale.reshape(())
    bias = (_w((n,), seed=3) * 10).to(torch.bfloat16) if m == 3 else None
    xf, _ = em.quantize_activation(x, em.ActQuant("w4a16", 0.5, False))
    wf = em.weight_f32(q_w.packed, q_w.block_scale, gs)
    ref = em.gemm(xf, wf, bias, x.dtype)
    y = tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, gs, bias, "w4a16", config=cfg)
    _check(y, ref, xf, wf, f"{cfg.label} M={m} N={n} K={k}")


@pytest.mark.parametrize("cfg", [VARIANTS[0], VARIANTS[3], VARIANTS[4], VARIANTS[6], LATE[0], LATE[1], BF[0], BF[1]],
                         ids=lambda c: c.label)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_stream_one_hot_exact(cfg, dtype):
    """One-hot activation rows: each output is one product, so it must equal the dequantized weight
    (E2M1 * block scale, times the rounded 1 / global scale) bit for bit -- incl. codes 0/1 (float32
    subnormals in the ``bits`` decode, fp16 subnormal 2**-15 in ``f16x2``, bf16 subnormal 2**-127 times the
    scale in a packed bf16 multiply in ``bf16x2``), zero and E4M3-subnormal block scales, every nibble
    position."""
    n, k = 256, 1024
    q_w = em.quantize_weight(_w((n, k)))
    packed = torch.arange(256, dtype=torch.uint8, device=DEV).repeat(n, k // 2 // 256)
    packed = packed.roll(1, 1).contiguous()  # every byte value (both nibbles: all 16 codes at every position)
    scale = q_w.block_scale.view(torch.uint8).clone()
    scale[:, ::7] = 0
    scale[:, 1::7] = 1  # E4M3 subnormals 2**-9 .. 7 * 2**-9
    scale[:, 2::7] = 7
    scale = scale.view(torch.float8_e4m3fn)
    gs = q_w.global_scale.reshape(())
    ks = torch.arange(0, 16, device=DEV) * 37 % k  # 16 columns, all nibble positions
    x = torch.zeros(16, k, dtype=dtype, device=DEV)
    x[torch.arange(16, device=DEV), ks] = 3.0
    y = tg.nvfp4_gemm(tg.ActOperand("w4a16", dtype, values=x), packed, scale, gs, config=cfg)
    wq = em.weight_f32(packed, scale, torch.ones((), device=DEV))
    want = ((wq[:, ks] * 3.0).t() * torch.reciprocal(gs.float())).to(dtype)
    assert torch.equal(y, want), f"{cfg.label} {dtype}: {int((y != want).sum())} outputs differ"
    assert bool((wq[:, ks] != 0).any()) and bool((wq[:, ks] < 0).any())


@pytest.mark.parametrize("cfg", [VARIANTS[0], VARIANTS[2], VARIANTS[4], LATE[0], LATE[1], BF[1], *X2],
                         ids=lambda c: c.label)
@pytest.mark.parametrize("gemm", ["w13", "w2"])
@pytest.mark.parametrize("tokens", [1, 16])
def test_stream_grouped(cfg, gemm, tokens):
    e, topk = 128, 8
    n, k = (1536, 2048) if gemm == "w13" else (2048, 768)
    q_w = em.quantize_weight(_w((e, n, k)), reduce_dims=(1, 2))
    gs = q_w.global_scale.reshape(-1)
    g = torch.Generator(device=DEV).manual_seed(2)
    ids = torch.rand(tokens, e, device=DEV, generator=g).argsort(-1)[:, :topk]
    ids[0, 0] = -1  # a slot routed to no local expert: its row stays 0
    s = tokens * topk
    x = _x(tokens if gemm == "w13" else s, k)
    rows_of = (lambda sl: torch.div(sl, topk, rounding_mode="floor")) if gemm == "w13" else (lambda sl: sl)
    routing = mr.moe_align(ids, e, tg.pick_block_m(-(-s // min(e, s))))
    op, _ = tg.quantize_activation(x, "w4a16")
    y = tg.nvfp4_gemm(op, q_w.packed, q_w.block_scale, gs, routing=routing, a_rows=rows_of(routing.sorted_slots),
                      out_rows=s, config=cfg)
    flat = ids.reshape(-1)
    assert not y[0].any()
    xf = x.float()
    for ex in flat[flat >= 0].unique().tolist():
        slots = (flat == ex).nonzero().squeeze(-1)
        wf = em.weight_f32(q_w.packed[ex], q_w.block_scale[ex], gs[ex])
        xr = xf[rows_of(slots)]
        _check(y[slots], em.gemm(xr, wf, None, x.dtype), xr, wf, f"{gemm} T={tokens} expert {ex} {cfg.label}")


@pytest.mark.parametrize("grouped", [False, True])
def test_stream_fixup_bit_identical_over_many_runs(grouped):
    """The split-K fixup (last program of a tile sums the partials after an acquire-release counter)
    == the reduction launch bit for bit, over 200 back-to-back launches with many tiles racing (a missing
    fence or a stale L1 read would show as a differing run)."""
    if grouped:
        e, topk, tokens, n, k = 128, 8, 16, 1536, 2048
        q_w = em.quantize_weight(_w((e, n, k)), reduce_dims=(1, 2))
        gs = q_w.global_scale.reshape(-1)
        ids = torch.rand(tokens, e, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3)).argsort(-1)[:, :topk]
        routing = mr.moe_align(ids, e, 16)
        op, _ = tg.quantize_activation(_x(tokens, k), "w4a16")
        kw = dict(routing=routing, a_rows=routing.sorted_tokens, out_rows=tokens * topk)
    else:
        n, k = 8192, 8192
        q_w = em.quantize_weight(_w((n, k)))
        gs = q_w.global_scale.reshape(())
        op, _ = tg.quantize_activation(_x(4, k), "w4a16")
        kw = {}
    cfg = SC(block_m=4, block_n=64, block_kw=16, split_k=8)
    ref = tg.nvfp4_gemm(op, q_w.packed, q_w.block_scale, gs, config=cfg, **kw)
    fx = tg.replace(cfg, fixup=True)
    outs = [tg.nvfp4_gemm(op, q_w.packed, q_w.block_scale, gs, config=fx, **kw) for _ in range(200)]
    bad = sum(not torch.equal(o, ref) for o in outs)
    assert bad == 0, f"{bad} of 200 fixup runs differ from the reduction launch"


def test_stream_replays_in_a_cuda_graph_and_dispatch(monkeypatch):
    """The streaming path (split-K + reduction kernel) needs no host sync: captured once, replayed with
    new inputs; and DECODE_TABLE dispatch picks it for w4a16 by default (same result as passing it)."""
    m, n, k = 1, 4096, 4096
    q_w = em.quantize_weight(_w((n, k)))
    gs = q_w.global_scale.reshape(())
    cfg = SC(block_m=1, block_n=64, block_kw=16, split_k=4)
    monkeypatch.setitem(ts.DECODE_TABLE, (False, 1, n, k), cfg)
    # GLUON_TABLE is checked first and has had a (1, 4096, 4096) entry since session 13 (77052b6): without it the
    # default dispatch reaches DECODE_TABLE, the lookup this test is about
    monkeypatch.delitem(gd.GLUON_TABLE, (1, n, k), raising=False)
    assert ts.decode_config(1, n, k, False) is cfg
    x = _x(m, k)
    y_direct = tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, gs, None, "w4a16", config=cfg)
    assert torch.equal(tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, gs, None, "w4a16"), y_direct)

    def run():
        return tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, gs, None, "w4a16")

    graph, y_graph = capture_graph(run)
    x.copy_(_x(m, k, seed=5))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, run())
