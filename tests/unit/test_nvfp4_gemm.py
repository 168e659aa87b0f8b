"""Fused NVFP4 dequantize + GEMM (verl_quads/nvfp4/triton_gemm.py) against the torch reference of the
rollout (verl_quads/rollout/emulation.py: dequantize to float32, x_f32 @ w_f32.T, one cast).

Products are exact on both sides; what differs is the float32 summation order and where the global
scales are applied (the reference scales every element by fl(block_scale / gs), the kernel scales
the sum once). So the check per output element is

    |y - ref| <= 1 ulp(ref) in the output dtype + 4 * K * eps_f32 * (|x_f32| @ |w_f32|.T)

(the second term is the float32 error bound of either summation; it matters only where terms
cancel). The observed maximum difference in output ulps is printed (pytest -s).

On CPU the kernels run under TRITON_INTERPRET=1 at small shapes; there the dots run in float32
(the interpreter's bf16 tl.dot is wrong in triton 3.9) on the same exact dequantized values; the
bf16 tensor-core path runs in tests/gpu/test_nvfp4_gemm_gpu.py on the H200.
"""

import os

import pytest
import torch

from verl_quads import nvfp4 as nv
from verl_quads.nvfp4 import moe_routing as mr
from verl_quads.nvfp4 import triton_gemm as tg
from verl_quads.rollout import emulation as em

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (scripts/test.sh sets it on CPU)",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _x(m, k, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 5] *= 30.0  # an outlier channel (QUADS selects its block)
    return x.to(dtype).to(DEV)


def _w(shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.05).to(DEV)


def _ulps(y, ref, bound_extra):
    """Max over elements of |y - ref| / (1 ulp of ref in y's dtype), and whether every element is
    within 1 ulp + the float32 summation bound."""
    r = ref.to(torch.float32)
    d = (y.to(torch.float32) - r).abs()
    eps = torch.finfo(y.dtype).eps
    ulp = torch.where(r.abs() > 0, 2.0 ** torch.floor(torch.log2(r.abs().clamp(min=1e-30))) * eps,
                      torch.full_like(r, torch.finfo(y.dtype).tiny))
    ok = bool((d <= ulp + bound_extra).all())
    return float((d / ulp).max()), ok


def _reference(x, q_w, mode, bias=None, ratio=0.5, per_token=False):
    # triton_gemm's default QUADS rule is the core's 16-channel block rule (the product's default is channels)
    act = em.ActQuant(mode, ratio, per_token, residual_granularity="block")
    xf, _ = em.quantize_activation(x, act)
    wf = em.weight_f32(q_w.packed, q_w.block_scale, q_w.global_scale.reshape(()))
    ref = em.gemm(xf, wf, bias, x.dtype)
    bound = 4 * x.shape[1] * torch.finfo(torch.float32).eps * (xf.abs() @ wf.abs().t())
    return ref, bound


CASES = [
    # (M, N, K, mode, dtype, per_token, bias, split_k)
    (1, 48, 64, "w4a16", torch.bfloat16, False, False, 1),
    (7, 40, 96, "w4a16", torch.float16, False, True, 1),
    (5, 24, 48, "w4a16", torch.float32, False, False, 1),
    (7, 40, 112, "w4a16", torch.bfloat16, False, False, 1),  # natural-K-order tile, masked K tail (7 blocks)
    (33, 80, 176, "w4a16", torch.bfloat16, False, True, 2),  # swapped, split-K, masked K tail
    (1, 48, 64, "naive", torch.bfloat16, False, False, 1),
    (33, 80, 160, "naive", torch.bfloat16, False, True, 2),
    (7, 40, 96, "trace", torch.bfloat16, False, False, 1),
    (7, 40, 96, "quads", torch.bfloat16, False, True, 1),
    (1, 48, 128, "quads", torch.bfloat16, False, False, 2),
    (9, 40, 96, "quads", torch.bfloat16, True, False, 1),
    (1, 48, 128, "quads", torch.bfloat16, True, True, 1),  # per-token, M=1: unselected weight blocks skipped
]


@pytest.mark.parametrize("m, n, k, mode, dtype, per_token, with_bias, split", CASES)
def test_dense_matches_reference(m, n, k, mode, dtype, per_token, with_bias, split):
    x = _x(m, k, dtype)
    q_w = em.quantize_weight(_w((n, k)))
    bias = (_w((n,), seed=3) * 10).to(dtype) if with_bias else None
    ref, bound = _reference(x, q_w, mode, bias, per_token=per_token)
    bm = tg.pick_block_m(m)
    # swapped (transposed-accumulator) tiles for some cases: decode's layout
    cfg = tg.GemmConfig(block_m=bm, block_n=32, block_k=32, block_k2=32, split_k=split, num_warps=4, num_stages=2,
                        swap=(m == 1 or split > 1 or per_token))
    y = tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, q_w.global_scale.reshape(()), bias, mode,
                        residual_per_token=per_token, config=cfg)
    assert y.dtype == dtype and y.shape == (m, n)
    ulps, ok = _ulps(y, ref, bound)
    print(f"dense {mode} {dtype} M={m} N={n} K={k} split={split}: max |diff| = {ulps:.2f} ulp")
    assert ok, f"max diff {ulps:.2f} ulp"
    # a weight off by one code must be seen (the test can fail)
    bad = q_w.packed.clone()
    bad[0, 0] ^= 0x07
    y_bad = tg.nvfp4_linear(x, bad, q_w.block_scale, q_w.global_scale.reshape(()), bias, mode,
                            residual_per_token=per_token, config=cfg)
    assert not _ulps(y_bad, ref, bound)[1]


def test_default_config_and_tails():
    """pick_config's launch (whatever it chooses on this device), N and K not multiples of the tile."""
    x = _x(3, 208)
    q_w = em.quantize_weight(_w((72, 208)))
    ref, bound = _reference(x, q_w, "naive")
    y = tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, q_w.global_scale.reshape(()), None, "naive")
    assert _ulps(y, ref, bound)[1]


@pytest.mark.parametrize("mode, per_token", [("w4a16", False), ("naive", False), ("quads", True)])
@pytest.mark.parametrize("swap, split", [(False, 1), (True, 2)])
def test_word_scale_loads(mode, per_token, swap, split):
    """K steps of 4 or 8 16-blocks with K/16 a multiple of 4: the block scales are loaded as int32 words
    (4 scales each) and split by shifts; a scale byte in the middle of a word changed must be seen."""
    m, n, k = 5, 48, 512
    x = _x(m, k)
    q_w = em.quantize_weight(_w((n, k)))
    ref, bound = _reference(x, q_w, mode, per_token=per_token)
    for bk in (64, 128):
        cfg = tg.GemmConfig(block_m=16, block_n=32, block_k=bk, block_k2=32, split_k=split, num_warps=4,
                            num_stages=2, swap=swap)
        y = tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, q_w.global_scale.reshape(()), None, mode,
                            residual_per_token=per_token, config=cfg)
        ulps, ok = _ulps(y, ref, bound)
        assert ok, f"block_k {bk}: max diff {ulps:.2f} ulp"
        bad = q_w.block_scale.view(torch.uint8).clone()
        bad[3, 6] += 8  # byte 2 of the second scale word of row 3
        y_bad = tg.nvfp4_linear(x, q_w.packed, bad.view(torch.float8_e4m3fn), q_w.global_scale.reshape(()), None,
                                mode, residual_per_token=per_token, config=cfg)
        assert not _ulps(y_bad, ref, bound)[1]
        assert torch.equal(y_bad[:, :3], y[:, :3]) and torch.equal(y_bad[:, 4:], y[:, 4:])


def test_activation_codes_are_the_cores():
    """The GEMM's activation operand is the core's quantization (same bytes as the torch backend)."""
    x = _x(6, 64)
    op, rec = tg.quantize_activation(x, "trace", capture=True)
    ref = nv.quantize(x, nv.per_row_global_scale(x), backend="torch")
    assert torch.equal(op.first.packed, ref.packed)
    assert torch.equal(op.first.block_scale.view(torch.uint8), ref.block_scale.view(torch.uint8))
    assert torch.equal(rec.bits, nv.extract_guidance(ref).bits)


def test_bad_inputs_fail_clearly():
    x = _x(2, 64)
    q_w = em.quantize_weight(_w((16, 64)))
    with pytest.raises(ValueError, match="act_mode"):
        tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, q_w.global_scale, None, "w4a8")
    with pytest.raises(ValueError, match="w_packed"):
        tg.nvfp4_linear(_x(2, 32), q_w.packed, q_w.block_scale, q_w.global_scale, None, "naive")
    with pytest.raises(ValueError, match="w_gs"):
        tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, q_w.global_scale.double(), None, "naive")
    with pytest.raises(ValueError, match="bias"):
        tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, q_w.global_scale, torch.zeros(3, device=DEV), "naive")


def test_moe_align_tile_table():
    ids = torch.tensor([[2, 0], [2, -1], [1, 2], [2, 0], [2, 2]], device=DEV)
    r = mr.moe_align(ids, 4, 2)
    flat = ids.reshape(-1)
    slots = r.sorted_slots.long()
    assert flat[slots].tolist() == [0, 0, 1, 2, 2, 2, 2, 2, 2, -1]
    assert slots[:3].tolist() == [1, 7, 4]  # stable: slot order within an expert
    tiles = [(int(e), int(a), int(b)) for e, a, b in zip(r.tile_expert, r.tile_row0, r.tile_row1) if e >= 0]
    assert tiles == [(0, 0, 2), (1, 2, 3), (2, 3, 5), (2, 5, 7), (2, 7, 9)]
    assert r.tile_expert.numel() == 5 + 4  # cdiv(10, 2) + min(E, S): fixed, no host sync
    assert r.sorted_tokens.tolist() == [s // 2 for s in slots.tolist()]


@pytest.mark.parametrize("tokens, top_k, e, block_m, local_frac", [
    (1, 8, 128, 16, 1.0), (3, 2, 5, 16, 0.7), (64, 8, 128, 16, 1.0), (300, 8, 128, 64, 0.8),
    (1200, 8, 128, 128, 1.0),  # 9600 slots: several chunks of 256 slots (two 128-slot passes each)
])
def test_moe_align_triton_equals_torch_reference(tokens, top_k, e, block_m, local_frac):
    """The three-launch Triton moe_align == the torch reference (stable sort, same tile table)."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, e, (tokens, top_k), generator=g)
    ids[torch.rand(tokens, top_k, generator=g) > local_frac] = -1
    ids = ids.to(DEV)
    got, ref = mr.moe_align(ids, e, block_m), mr.moe_align_reference(ids, e, block_m)
    for f in ("sorted_slots", "tile_expert", "tile_row0", "tile_row1", "sorted_tokens"):
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    # and the reference is right: rows sorted by expert, stable
    flat = ids.reshape(-1).long()
    key = torch.where(flat < 0, e, flat)[ref.sorted_slots.long()]
    assert bool((key[1:] >= key[:-1]).all())


@pytest.mark.parametrize("mode, per_token", [("w4a16", False), ("naive", False), ("quads", False), ("quads", True)])
def test_grouped_matches_per_expert_reference(mode, per_token):
    """One grouped launch == the reference GEMM of each slot's row with its expert's weight (slot
    order output; a slot routed to no local expert gives 0)."""
    t, topk, e, n, k = 6, 2, 4, 40, 64
    x = _x(t, k)
    w = _w((e, n, k))
    q_w = em.quantize_weight(w, reduce_dims=(1, 2))
    gs = q_w.global_scale.reshape(-1)
    ids = torch.tensor([[0, 3], [3, 1], [3, -1], [0, 3], [1, 3], [3, 0]], device=DEV)
    act = em.ActQuant(mode, 0.5, per_token, residual_granularity="block")  # triton_gemm's default rule: blocks
    xf, _ = em.quantize_activation(x, act)  # one call over all tokens (the experts' shared input)
    op, _ = tg.quantize_activation(x, mode, residual_per_token=per_token)
    routing = mr.moe_align(ids, e, 16)
    rows = torch.div(routing.sorted_slots, topk, rounding_mode="floor")
    cfg = tg.GemmConfig(block_m=16, block_n=32, block_k=32, block_k2=32, split_k=1, num_warps=4, num_stages=2)
    y = tg.nvfp4_gemm(op, q_w.packed, q_w.block_scale, gs, routing=routing, a_rows=rows, out_rows=t * topk,
                      config=cfg)
    worst = 0.0
    for slot, ex in enumerate(ids.reshape(-1).tolist()):
        if ex < 0:
            assert not y[slot].any()
            continue
        wf = em.weight_f32(q_w.packed[ex], q_w.block_scale[ex], gs[ex])
        xr = xf[slot // topk: slot // topk + 1]
        ref = em.gemm(xr, wf, None, x.dtype)
        bound = 4 * k * torch.finfo(torch.float32).eps * (xr.abs() @ wf.abs().t())
        ulps, ok = _ulps(y[slot: slot + 1], ref, bound)
        worst = max(worst, ulps)
        assert ok, f"slot {slot} expert {ex}: {ulps:.2f} ulp"
    print(f"grouped {mode} per_token={per_token}: max |diff| = {worst:.2f} ulp")


def test_grouped_quads_per_expert_selection_and_split_k():
    """quads_grouped_operand selects residual blocks per expert (the reference's per-expert call);
    split-K over a grouped launch."""
    e, n, k = 3, 32, 96
    sizes = [4, 0, 3]
    xs = _x(sum(sizes), k)
    xs[4:, 80:96] *= 50  # expert 2's rows: a different block dominates
    q_w = em.quantize_weight(_w((e, n, k)), reduce_dims=(1, 2))
    gs = q_w.global_scale.reshape(-1)
    op = tg.quads_grouped_operand(xs, sizes, [0, 1, 2], e, 0.25)
    ids = torch.tensor([[0], [0], [0], [0], [2], [2], [2]], device=DEV)
    routing = mr.moe_align(ids, e, 16)
    cfg = tg.GemmConfig(block_m=16, block_n=16, block_k=32, block_k2=32, split_k=2, num_warps=4, num_stages=2)
    y = tg.nvfp4_gemm(op, q_w.packed, q_w.block_scale, gs, routing=routing,
                      a_rows=torch.arange(7, dtype=torch.int32, device=DEV), out_rows=7, config=cfg)
    start = 0
    for ex, cnt in enumerate(sizes):
        if not cnt:
            continue
        xr, _ = em.quantize_activation(xs[start:start + cnt], em.ActQuant("quads", 0.25, False, residual_granularity="block"))
        wf = em.weight_f32(q_w.packed[ex], q_w.block_scale[ex], gs[ex])
        ref = em.gemm(xr, wf, None, xs.dtype)
        bound = 4 * k * torch.finfo(torch.float32).eps * (xr.abs() @ wf.abs().t())
        assert _ulps(y[start:start + cnt], ref, bound)[1]
        start += cnt
    assert not torch.equal(op.block_idx[0], op.block_idx[2])  # the selection is per expert


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dense_split_k_partials_are_summed_in_one_launch(dtype):
    """A dense tensor-core GEMM with split_k = 3 (odd; uneven K ranges) and a bias: the float32 partials are summed
    in the fixed order s = 0, 1, 2 plus the bias by ``_splitk_reduce_kernel`` (one launch) and cast once; the
    result is within the float32 summation bound of the torch reference, in x's dtype, and the same bits on every
    call (deterministic)."""
    m, n, k = 5, 48, 160
    x = _x(m, k, dtype=dtype, seed=3)
    q_w = em.quantize_weight(_w((n, k)))
    bias = _w((n,), seed=4).to(dtype)
    cfg = tg.GemmConfig(block_m=16, block_n=16, block_k=32, block_k2=32, split_k=3, num_warps=4, num_stages=2)
    op, _ = tg.quantize_activation(x, "w4a16")
    y = tg.nvfp4_gemm(op, q_w.packed, q_w.block_scale, q_w.global_scale, bias, config=cfg)
    assert y.dtype == dtype and y.shape == (m, n)
    wf = em.weight_f32(q_w.packed, q_w.block_scale, q_w.global_scale)
    ref = em.gemm(x.to(torch.float32), wf, bias, dtype)
    bound = 4 * k * torch.finfo(torch.float32).eps * (x.to(torch.float32).abs() @ wf.abs().t())
    worst, ok = _ulps(y, ref, bound)
    assert ok, f"{worst:.2f} ulp"
    assert torch.equal(y, tg.nvfp4_gemm(op, q_w.packed, q_w.block_scale, q_w.global_scale, bias, config=cfg))
