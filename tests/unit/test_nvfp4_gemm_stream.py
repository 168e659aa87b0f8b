"""W4A16 weight-streaming decode kernel (``StreamConfig`` in verl_quads/nvfp4/triton_gemm.py) against
the torch reference of the rollout (verl_quads/rollout/emulation.py: dequantize to float32,
``x_f32 @ w_f32.T``, one cast), every variant (CUDA-core FMA with 1/2/4-row chunks, tensor-core dot
swapped / not swapped, ``bits`` / ``f16`` / ``f16x2`` / ``bf16x2`` E2M1 decode, block scale per element or per word (``late_scale``),
prefetch on/off, split-K), dense and grouped.

Same bound as tests/unit/test_nvfp4_gemm.py: per element |y - ref| <= 1 ulp(ref) in the output dtype
+ 4 K eps_f32 (|x| @ |w|.T) (products exact on both sides, only the float32 summation order and
where the scales are applied differ). Plus an exact check of the decode itself: one-hot activation
rows make every output a single product, so y must equal the dequantized weight bit for bit.

On CPU the kernels run under TRITON_INTERPRET=1 at small shapes (the tensor-core variants' dots in
float32 there: the interpreter's bf16 tl.dot is wrong); tests/gpu/test_nvfp4_gemm_gpu.py runs the
variants on the H200 at real shapes.
"""

import os

import pytest
import torch

from verl_quads.nvfp4 import moe_routing as mr
from verl_quads.nvfp4 import triton_gemm as tg
from verl_quads.nvfp4 import gemm_shared
from verl_quads.nvfp4 import triton_stream as ts
from verl_quads.rollout import emulation as em

from sm90_compile import compile_for_sm90_in_subprocess

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (scripts/test.sh sets it on CPU)",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SC = ts.StreamConfig


def _x(m, k, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 5] *= 30.0
    return x.to(dtype).to(DEV)


def _w(shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.05
    if w.dim() > 1:
        w[..., 3, :16] *= 1e-3  # a block with a tiny (subnormal E4M3) scale
    return w.to(DEV)


def _within(y, ref, xf, wf):
    """(max |diff| in output ulps, every element within 1 ulp + the float32 summation bound)."""
    r = ref.to(torch.float32)
    d = (y.to(torch.float32) - r).abs()
    eps = torch.finfo(y.dtype).eps
    ulp = torch.where(r.abs() > 0, 2.0 ** torch.floor(torch.log2(r.abs().clamp(min=1e-30))) * eps,
                      torch.full_like(r, torch.finfo(y.dtype).tiny))
    bound = ulp + 4 * xf.shape[1] * torch.finfo(torch.float32).eps * (xf.abs() @ wf.abs().t())
    return float((d / ulp).max()), bool((d <= bound).all())


DENSE = [
    # (M, N, K, dtype, bias, config)
    (1, 40, 256, torch.bfloat16, True, SC(block_m=1, block_n=16, block_kw=16, split_k=1)),
    (3, 24, 176, torch.bfloat16, False, SC(block_m=2, block_n=32, block_kw=8, split_k=2, decode="f16", prefetch=False)),
    (5, 24, 176, torch.float16, True, SC(block_m=4, block_n=32, block_kw=8, split_k=3)),  # K tail in every range
    (2, 24, 128, torch.float32, False, SC(block_m=4, block_n=32, block_kw=4, split_k=0, prefetch=False)),
    (17, 40, 256, torch.bfloat16, False, SC(block_m=16, block_n=16, block_kw=16, split_k=2, mma=1)),
    (9, 24, 384, torch.float32, True, SC(block_m=16, block_n=32, block_kw=16, split_k=1, mma=2, decode="f16")),
    # software-pipelined K loop (pipe; the interpreter runs it as a plain loop), K tail in every range; occ
    (5, 24, 176, torch.bfloat16, True, SC(block_m=2, block_n=32, block_kw=8, split_k=3, prefetch=False, pipe=3,
                                          fixup=True)),
    (1, 40, 256, torch.bfloat16, False, SC(block_m=1, block_n=16, block_kw=4, split_k=0, prefetch=False, pipe=4,
                                           occ=8)),
    # nibble-major activation copy (xperm), K tail in every range, fp16 and 4-row chunks
    (5, 24, 176, torch.float16, True, SC(block_m=4, block_n=32, block_kw=8, split_k=3, xperm=True)),
    # f16x2 pair decode + block scale applied to each word's 8-product sum (late_scale), 1/2/4-row chunks,
    # K tail in every range, pipelined loop; and the pair decode alone on the tensor-core path (FMA: one-hot test)
    (1, 40, 256, torch.bfloat16, True, SC(block_m=1, block_n=16, block_kw=16, split_k=1, decode="f16x2",
                                          late_scale=True)),
    (3, 24, 176, torch.bfloat16, False, SC(block_m=2, block_n=32, block_kw=8, split_k=3, decode="f16x2",
                                           late_scale=True, prefetch=False, pipe=3, fixup=True)),
    (5, 24, 176, torch.float16, True, SC(block_m=4, block_n=32, block_kw=8, split_k=2, decode="f16x2",
                                         late_scale=True, xperm=True)),
    (9, 24, 384, torch.bfloat16, True, SC(block_m=16, block_n=32, block_kw=16, split_k=1, mma=1, decode="f16x2")),
    # block scale per 16-element block (block_scale: [BN, BKW/2] scale tile), 1/4-row chunks, K tail in every
    # range (prefetch, pipelined), whole-row tile (block_kw > K/8 of a range)
    (1, 40, 256, torch.bfloat16, True, SC(block_m=1, block_n=16, block_kw=16, split_k=1, decode="f16x2",
                                          late_scale=True, block_scale=True, fixup=True)),
    (5, 24, 176, torch.float16, False, SC(block_m=4, block_n=16, block_kw=8, split_k=3, decode="f16x2",
                                          late_scale=True, block_scale=True)),
    (3, 24, 176, torch.bfloat16, True, SC(block_m=2, block_n=16, block_kw=4, split_k=2, decode="f16x2",
                                          late_scale=True, block_scale=True, prefetch=False, pipe=3, fixup=True)),
    (1, 24, 256, torch.bfloat16, False, SC(block_m=1, block_n=16, block_kw=64, split_k=1, decode="f16x2",
                                           late_scale=True, block_scale=True)),
    # activation pairs as int32 loads (x_pairs: bf16 bit placement, fp16 conversion), 1/2/4-row chunks (M=5 in 4-row
    # chunks: the second chunk has one valid row), K tail in every range
    (5, 24, 176, torch.bfloat16, True, SC(block_m=4, block_n=16, block_kw=8, split_k=3, decode="f16x2",
                                          late_scale=True, block_scale=True, x_pairs=True)),
    (3, 24, 176, torch.float16, False, SC(block_m=2, block_n=16, block_kw=4, split_k=2, decode="f16x2",
                                          late_scale=True, x_pairs=True, fixup=True)),
    (3, 24, 176, torch.bfloat16, True, SC(block_m=2, block_n=16, block_kw=8, split_k=2, decode="f16x2",
                                          late_scale=True, block_scale=True, x_pairs=True, prefetch=False, pipe=3)),
    (1, 40, 256, torch.bfloat16, False, SC(block_m=1, block_n=16, block_kw=16, split_k=2, decode="f16x2",
                                           late_scale=True, block_scale=True, x_pairs=True, fixup=True)),
    # few rows per program (block_n 4/8 on CUDA cores), whole rows, partial last row tile
    (1, 20, 256, torch.bfloat16, True, SC(block_m=1, block_n=8, block_kw=32, split_k=1, num_warps=1, decode="f16x2",
                                          late_scale=True, fixup=True)),
    (2, 20, 176, torch.bfloat16, False, SC(block_m=2, block_n=4, block_kw=16, split_k=0, num_warps=1)),
    # bf16 pair decode + packed bf16 scale multiply (tensor-core paths), K tail in every range
    (17, 40, 256, torch.bfloat16, False, SC(block_m=16, block_n=16, block_kw=16, split_k=2, mma=2, decode="bf16x2")),
    (9, 24, 352, torch.float16, True, SC(block_m=16, block_n=32, block_kw=16, split_k=2, mma=1, decode="bf16x2",
                                         fixup=True)),
]


@pytest.mark.parametrize("m, n, k, dtype, with_bias, cfg", DENSE, ids=[c[-1].label for c in DENSE])
def test_stream_dense_matches_reference(m, n, k, dtype, with_bias, cfg):
    x = _x(m, k, dtype)
    x[:, -1] *= 30.0  # the element the changed code below multiplies
    q_w = em.quantize_weight(_w((n, k)))
    gs = q_w.global_scale.reshape(())
    bias = (_w((n,), seed=3) * 10).to(dtype) if with_bias else None
    xf, _ = em.quantize_activation(x, em.ActQuant("w4a16", 0.5, False))
    wf = em.weight_f32(q_w.packed, q_w.block_scale, gs)
    ref = em.gemm(xf, wf, bias, dtype)
    y = tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, gs, bias, "w4a16", config=cfg)
    assert y.dtype == dtype and y.shape == (m, n)
    ulps, ok = _within(y, ref, xf, wf)
    print(f"stream {cfg.label} {dtype} M={m} N={n} K={k}: max |diff| = {ulps:.2f} ulp")
    assert ok, f"max diff {ulps:.2f} ulp"
    # one code changed in the last word of row 1 (nibble 7: the decode's no-shift case) must be seen
    bad = q_w.packed.clone()
    bad[1, -1] ^= 0x70
    y_bad = tg.nvfp4_linear(x, bad, q_w.block_scale, gs, bias, "w4a16", config=cfg)
    assert not _within(y_bad, ref, xf, wf)[1]
    assert torch.equal(y_bad[:, 0], y[:, 0]) and torch.equal(y_bad[:, 2:], y[:, 2:])


@pytest.mark.parametrize("cfg", [SC(block_m=4, block_n=16, block_kw=16, split_k=1),
                                 SC(block_m=16, block_n=16, block_kw=16, split_k=1, mma=1, decode="f16"),
                                 SC(block_m=1, block_n=16, block_kw=8, split_k=1, prefetch=False, pipe=3),
                                 SC(block_m=2, block_n=16, block_kw=16, split_k=1, xperm=True),
                                 SC(block_m=4, block_n=16, block_kw=16, split_k=1, decode="f16x2", late_scale=True),
                                 SC(block_m=1, block_n=16, block_kw=8, split_k=2, decode="f16x2", late_scale=True,
                                    block_scale=True),
                                 SC(block_m=1, block_n=16, block_kw=8, split_k=1, decode="f16x2"),
                                 SC(block_m=16, block_n=16, block_kw=16, split_k=1, mma=1, decode="bf16x2")],
                         ids=lambda c: c.label)
def test_stream_decode_exact_one_hot(cfg):
    """x = one-hot rows (float32): y[r, n] = w[n, k_r] * x, one product per output, no summation, so it
    must equal the dequantized weight exactly; the rows hit all 8 nibble positions of a word and all
    16 codes (weights built from every code, scales incl. zero and E4M3 subnormals)."""
    n, k = 16, 128
    q_w = em.quantize_weight(_w((n, k)))
    codes = torch.arange(256, dtype=torch.uint8).reshape(4, 64).repeat(4, 1)  # every byte value
    packed = codes.to(DEV)
    scale = q_w.block_scale.view(torch.uint8).clone()
    scale[0, 0], scale[1, 1], scale[2, 2] = 0, 1, 7  # zero and E4M3 subnormal scales
    scale = scale.view(torch.float8_e4m3fn)
    gs = q_w.global_scale.reshape(())
    ks = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 15, 16, 17, 63, 64, 126, 127])
    x = torch.zeros(len(ks), k, dtype=torch.float32, device=DEV)
    x[torch.arange(len(ks)), ks.to(DEV)] = 3.0
    y = tg.nvfp4_gemm(tg.ActOperand("w4a16", torch.float32, values=x), packed, scale, gs, config=cfg)
    # E2M1 * block scale (exact in float32), times 3 (exact), times the rounded 1 / global scale: the
    # kernel's one rounding (it divides the sum once; the reference scales each element by
    # fl(block_scale / gs), which can differ in the last bit)
    wq = em.weight_f32(packed, scale, torch.ones((), device=DEV))
    want = (wq[:, ks.to(DEV)] * 3.0).t() * torch.reciprocal(gs.to(torch.float32))
    assert torch.equal(y, want), f"max diff {(y - want).abs().max()}"
    assert (wq != 0).sum() > 1000 and (wq[:, ks.to(DEV)] < 0).any()  # the test sees nonzero and negative codes


@pytest.mark.parametrize("cfg", [SC(block_m=2, block_n=16, block_kw=8, split_k=2, decode="f16"),
                                 SC(block_m=16, block_n=16, block_kw=16, split_k=1, mma=1),
                                 SC(block_m=1, block_n=16, block_kw=8, split_k=2, prefetch=False, pipe=3, fixup=True,
                                    xperm=True),
                                 SC(block_m=2, block_n=16, block_kw=8, split_k=2, decode="f16x2", late_scale=True,
                                    fixup=True),
                                 SC(block_m=1, block_n=16, block_kw=8, split_k=2, decode="f16x2", late_scale=True,
                                    block_scale=True, fixup=True),
                                 SC(block_m=4, block_n=16, block_kw=16, split_k=1, decode="f16x2", late_scale=True,
                                    block_scale=True, x_pairs=True)],
                         ids=lambda c: c.label)
def test_stream_grouped_matches_per_expert_reference(cfg):
    """One grouped launch (tile table of moe_align, block_m 16 > the FMA chunk: rows looped in chunks)
    == the reference GEMM of each slot's row with its expert's weight; non-local slots give 0."""
    t, topk, e, n, k = 6, 2, 4, 24, 128
    x = _x(t, k)
    q_w = em.quantize_weight(_w((e, n, k)), reduce_dims=(1, 2))
    gs = q_w.global_scale.reshape(-1)
    ids = torch.tensor([[0, 3], [3, 1], [3, -1], [0, 3], [1, 3], [3, 0]], device=DEV)
    xf, _ = em.quantize_activation(x, em.ActQuant("w4a16", 0.5, False))
    routing = mr.moe_align(ids, e, 16)
    rows = torch.div(routing.sorted_slots, topk, rounding_mode="floor")
    op, _ = tg.quantize_activation(x, "w4a16")
    y = tg.nvfp4_gemm(op, q_w.packed, q_w.block_scale, gs, routing=routing, a_rows=rows, out_rows=t * topk,
                      config=cfg)
    for slot, ex in enumerate(ids.reshape(-1).tolist()):
        if ex < 0:
            assert not y[slot].any()
            continue
        wf = em.weight_f32(q_w.packed[ex], q_w.block_scale[ex], gs[ex])
        xr = xf[slot // topk: slot // topk + 1]
        ulps, ok = _within(y[slot: slot + 1], em.gemm(xr, wf, None, x.dtype), xr, wf)
        assert ok, f"slot {slot} expert {ex}: {ulps:.2f} ulp"


def test_stream_config_errors_and_dispatch_table(monkeypatch):
    x = _x(2, 64)
    q_w = em.quantize_weight(_w((16, 64)))
    gs = q_w.global_scale.reshape(())
    with pytest.raises(ValueError, match="w4a16 operands only"):
        tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, gs, None, "naive", config=SC())
    for bad in (SC(block_m=3), SC(block_m=8, mma=1), SC(block_m=16, mma=1, block_kw=8), SC(decode="lut"),
                SC(pipe=3), SC(prefetch=False, pipe=0), SC(occ=0), SC(block_m=16, mma=1, xperm=True),
                SC(late_scale=True), SC(decode="f16", late_scale=True),  # late_scale needs the f16x2 decode
                SC(block_m=16, mma=1, decode="f16x2", late_scale=True), SC(decode="bf16x2"),  # bf16x2: mma only  # pipe > 1 with the manual prefetch: refused
                SC(x_pairs=True), SC(decode="f16x2", late_scale=True, x_pairs=True, xperm=True)):  # x_pairs: late, no xperm
        with pytest.raises(ValueError, match="bad StreamConfig"):
            tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, gs, None, "w4a16", config=bad)
    with pytest.raises(ValueError, match="x_pairs=True reads 16-bit activation pairs.*float32"):
        tg.nvfp4_linear(x.float(), q_w.packed, q_w.block_scale, gs, None, "w4a16",
                        config=SC(decode="f16x2", late_scale=True, x_pairs=True))
    # the table: (grouped, power-of-two rows bucket, N, K); the smallest bucket >= rows that has an entry
    c4, c16 = SC(block_m=2, block_n=32), SC(block_m=4)
    monkeypatch.setitem(ts.DECODE_TABLE, (False, 4, 16, 64), c4)
    monkeypatch.setitem(ts.DECODE_TABLE, (False, 16, 16, 64), c16)
    assert ts.decode_config(1, 16, 64, False) is c4 and ts.decode_config(4, 16, 64, False) is c4
    assert ts.decode_config(5, 16, 64, False) is c16 and ts.decode_config(16, 16, 64, False) is c16
    assert ts.decode_config(17, 16, 64, False) is None
    assert ts.decode_config(3, 16, 64, True) is None and ts.decode_config(3, 32, 64, False) is None
    assert ts.decode_bucket(1) == 1 and ts.decode_bucket(24) == 32 and ts.decode_bucket(129) == 256
    assert ts.decode_bucket(513) is None
    # an entry measured with x_pairs (16-bit activation pairs): the same tiling without it for float32 activations
    cx = SC(block_m=1, block_n=16, decode="f16x2", late_scale=True, x_pairs=True)
    monkeypatch.setitem(ts.DECODE_TABLE, (True, 8, 16, 64), cx)
    assert ts.decode_config(8, 16, 64, True, torch.bfloat16) is cx and ts.decode_config(8, 16, 64, True) is cx
    assert ts.decode_config(8, 16, 64, True, torch.float32) == tg.replace(cx, x_pairs=False)


def test_stream_x_pairs_is_bit_identical():
    """x_pairs (activation values loaded as int32 pairs and split exactly) changes no value, product or summation
    order: the same bits as without it (bf16 and fp16 activations, K tail in every range, dense M=5 in 1-, 2- and
    4-row chunks: every chunk row's pair loads, incl. chunks with invalid rows)."""
    q_d = em.quantize_weight(_w((24, 176)))
    gs = q_d.global_scale.reshape(())
    for bm in (1, 2, 4):
        cfg = SC(block_m=bm, block_n=16, block_kw=8, split_k=1, decode="f16x2", late_scale=True, block_scale=True)
        for dtype in (torch.bfloat16, torch.float16):
            x = _x(5, 176, dtype)
            y0, y1 = (tg.nvfp4_linear(x, q_d.packed, q_d.block_scale, gs, None, "w4a16", config=c)
                      for c in (cfg, tg.replace(cfg, x_pairs=True)))
            assert torch.equal(y0, y1) and bool(y0.ne(0).all()), (bm, dtype)


def test_stream_split_k_fixup_is_bit_identical_to_reduction_launch():
    """fixup=True (the last program of a tile sums the split-K partials; one launch) gives the same bits as
    the reduction launch (same fixed order), dense with bias and grouped; the per-tile counters are left 0."""
    x = _x(3, 176)
    q_w = em.quantize_weight(_w((24, 176)))
    gs = q_w.global_scale.reshape(())
    bias = (_w((24,), seed=3) * 10).to(x.dtype)
    base = SC(block_m=4, block_n=16, block_kw=8, split_k=3, prefetch=False)
    y = tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, gs, bias, "w4a16", config=base)
    y_fx = tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, gs, bias, "w4a16", config=tg.replace(base, fixup=True))
    assert torch.equal(y, y_fx)
    piped = tg.replace(base, pipe=3)  # the software-pipelined loop / nibble-major activation: same order, same bits
    for c in (piped, tg.replace(piped, fixup=True), tg.replace(base, xperm=True)):
        assert torch.equal(tg.nvfp4_linear(x, q_w.packed, q_w.block_scale, gs, bias, "w4a16", config=c), y)
    e, topk, k = 3, 2, 128
    q_e = em.quantize_weight(_w((e, 24, k)), reduce_dims=(1, 2))
    ids = torch.tensor([[0, 2], [2, -1], [1, 2]], device=DEV)
    routing = mr.moe_align(ids, e, 16)
    op, _ = tg.quantize_activation(_x(3, k), "w4a16")
    rows = torch.div(routing.sorted_slots, topk, rounding_mode="floor")
    cfg = SC(block_m=16, block_n=16, block_kw=16, split_k=2, mma=1)
    ys = [tg.nvfp4_gemm(op, q_e.packed, q_e.block_scale, q_e.global_scale.reshape(-1), routing=routing, a_rows=rows,
                        out_rows=6, config=c) for c in (cfg, tg.replace(cfg, fixup=True))]
    assert torch.equal(ys[0], ys[1]) and not ys[1][3].any()  # slot 3 is not local: 0
    assert not gemm_shared._TILE_COUNTERS[("stream", str(torch.device(DEV)))].any()


_SM90_STREAM = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from verl_quads.nvfp4 import triton_gemm as tg
from verl_quads.nvfp4 import triton_stream as ts

ptrs = {"x_ptr": "*bf16", "w_ptr": "*i32", "ws_ptr": "*u8", "wgs_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*i16",
        "part_ptr": "*fp32", "cnt_ptr": "*i32", "arow_ptr": "*i32", "orow_ptr": "*i32", "tile_e_ptr": "*i32",
        "tile_r0_ptr": "*i32", "tile_r1_ptr": "*i32"}
ints = ["M", "N", "K", "KW", "KB", "OUT_ROWS", "KW_PER_SPLIT", "SPLIT"]
for cfg, grouped in ((ts.StreamConfig(block_m=1, block_n=128, block_kw=16, prefetch=False, pipe=3, fixup=True,
                                      decode="f16x2", late_scale=True), False),
                     (ts.StreamConfig(block_m=4, block_n=64, block_kw=16, decode="f16x2", late_scale=True), True),
                     (ts.StreamConfig(block_m=16, block_n=128, block_kw=16, mma=2, decode="bf16x2"), False),
                     (ts.StreamConfig(block_m=1, block_n=256, block_kw=16, fixup=True, decode="f16x2", late_scale=True,
                                      block_scale=True), False),
                     (ts.StreamConfig(block_m=1, block_n=16, block_kw=64, num_warps=2, decode="f16x2", late_scale=True,
                                      block_scale=True), True),
                     (ts.StreamConfig(block_m=4, block_n=16, block_kw=64, decode="f16x2", late_scale=True,
                                      block_scale=True, x_pairs=True), True),
                     (ts.StreamConfig(block_m=2, block_n=16, block_kw=128, num_warps=8, decode="f16x2", late_scale=True,
                                      block_scale=True, x_pairs=True), False),
                     (ts.StreamConfig(block_m=1, block_n=16, block_kw=128, decode="f16x2", late_scale=True,
                                      block_scale=True, x_pairs=True, prefetch=False, pipe=3, fixup=True), True)):
    const = ts.stream_constexprs(cfg, grouped=grouped, tm=16 if grouped else cfg.block_m, partial=True,
                                  fixup=cfg.fixup, has_bias=False, out_code=1, dt=1, even=True, interpreting=False)
    sig = dict(ptrs, **{i: "i32" for i in ints}, **{c: "constexpr" for c in const})
    # as the JIT specializes: pointers and N, K, ... divisible by 16 carry tt.divisibility=16
    attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(sig)
             if sig[nm][0] == "*" or nm in ("N", "K", "KW", "KB", "KW_PER_SPLIT")}
    k = triton.compile(ASTSource(fn=ts._w4a16_stream_kernel, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps})
    # the GPU-only forms are in the code: the inline fp16 -> fp32 conversions, the packed bf16 scale multiply
    assert k.asm["cubin"] and ("cvt.f32.f16" if cfg.late_scale else "mul.bf16x2") in k.asm["ptx"], cfg.label
print("compiled")
"""


def test_stream_gpu_only_decode_forms_compile_for_sm90_without_a_gpu():
    """GPU-only code of the f16x2 / bf16x2 decodes (the interpreter takes the float32 forms): late_scale's
    inline PTX (fp16 -> fp32 conversions of both halves of a register) and bf16x2's packed bf16 scale
    multiply feeding a bf16 tensor-core dot: compile them for sm_90 with triton's bundled ptxas in a
    subprocess without TRITON_INTERPRET (dense pipelined, grouped 4-row, tensor-core, per-block scale dense and
    grouped whole-row tile, x_pairs' int32 activation loads: grouped 4-row chunks, dense 2-row chunks of an 8-warp
    tile, grouped pipelined as the DECODE_TABLE entries). Compiles only."""
    compile_for_sm90_in_subprocess(
        _SM90_STREAM, "on a GPU the kernels are compiled and run by tests/gpu/test_nvfp4_gemm_stream_gpu.py")


# --- the roofline probes of `verl-quads bench rollout --gemv-roofline` (verl_quads/bench/gemv_probe.py) ------


def _probe_expected(w32, ws_u8, wdq, x, e, a, info, bn, bkw, stage, scales=1):
    """Each probe program's value by an independent torch computation: stage 0 the int32 sum over its
    [BN, BKW] lanes of the XOR over its K steps of (word ^ scale byte of the word); stages 1/2 the float sum of
    E2M1 * block scale (``wdq``: float32 [E, N, K], global scale 1; times the activation for 2) over its rows
    and K range."""
    live, n_tiles, split = info["grid"]
    kw_per = info["kw_per"]
    n, kwn = w32.shape[-2:]
    exp = []
    for pm in range(live):
        ex = int(e[pm])
        for pn in range(n_tiles):
            rows = slice(pn * bn, min(n, (pn + 1) * bn))
            for pk in range(split):
                lo, hi = pk * kw_per, min(kwn, (pk + 1) * kw_per)
                if stage == 0:
                    lanes = torch.zeros(rows.stop - rows.start, bkw, dtype=torch.int64)
                    for s0 in range(lo, hi, bkw):
                        kk = torch.arange(s0, min(hi, s0 + bkw))
                        v = w32[ex, rows][:, kk].long()
                        if scales == 1:  # each word's block byte
                            v = v ^ ws_u8[ex, rows][:, kk // 2].long()
                        elif scales == 2:  # the row's sum of the step's block bytes, into every word
                            v = v ^ ws_u8[ex, rows][:, kk[0] // 2:(kk[-1] // 2) + 1].long().sum(1, keepdim=True)
                        lanes[:, :kk.numel()] ^= v
                    tot = int(lanes.sum()) & 0xFFFFFFFF
                    exp.append(tot - (1 << 32) if tot >= 1 << 31 else tot)
                else:
                    v = wdq[ex, rows, lo * 8:hi * 8]
                    if stage == 2:
                        v = v * x[int(a[pm]), lo * 8:hi * 8].float()[None, :]
                    exp.append(float(v.double().sum()))
    return exp


@pytest.mark.parametrize("stage,cfg,unroll,hint", [
    (0, SC(split_k=2, block_n=16, block_kw=8, prefetch=True), 1, {"scales": 2}),
    (0, SC(split_k=2, block_n=16, block_kw=16, prefetch=False), 1, {"scales": 0}),
    (0, SC(split_k=2, block_n=32, block_kw=8, decode="f16x2", late_scale=True, fixup=True), 1, {}),
    (0, SC(split_k=2, block_n=16, block_kw=4, prefetch=False), 2, {"cache": ".cg"}),
    (0, SC(split_k=2, block_n=16, block_kw=8, prefetch=False, pipe=3), 1, {"evict": "evict_first"}),
    (1, SC(split_k=2, block_n=32, block_kw=8, decode="f16x2", late_scale=True, fixup=True), 1, {}),
    (2, SC(split_k=2, block_n=32, block_kw=8, decode="f16x2", late_scale=True, fixup=True), 1, {}),
    (2, SC(split_k=2, block_n=16, block_kw=4, decode="bits", prefetch=False), 1, {}),
    (1, SC(split_k=2, block_n=16, block_kw=8, decode="f16x2", late_scale=True, block_scale=True), 1, {}),
    (2, SC(split_k=2, block_n=16, block_kw=8, decode="f16x2", late_scale=True, block_scale=True), 1, {}),
    (0, SC(split_k=2, block_n=16, block_kw=8, decode="f16x2", late_scale=True, block_scale=True), 1, {})],
    ids=lambda v: v.label if isinstance(v, SC) else str(v))
def test_gemv_probe_reads_every_word_interpreter(stage, cfg, unroll, hint):
    """The roofline probes (measuring instruments, not product kernels) at small shapes: dense (split_k 2: K
    ranges of 32 + 16 words) and grouped (3 of 4 experts, one activation row each): each program's
    folded value equals an independent torch computation (stage 0: XOR of every word and scale byte, so a
    dropped or misaddressed load changes it; stages 1/2: sum of the decoded values, times the activation)."""
    from verl_quads.bench import gemv_probe as gp

    for grouped in (False, True):
        e = 4 if grouped else 1
        n, k = 48, 384  # 48 rows: a partial last column tile at BN 32; 48 words: K ranges of 32 + 16 words
        q = em.quantize_weight(_w((e, n, k)))
        wp, wsc = q.packed, q.block_scale
        wdq = em.weight_f32(wp, wsc, torch.ones(e, device=wp.device)).cpu()
        x = _x(3, k)
        experts = torch.tensor([3, 0, 2] if grouped else [0], dtype=torch.int32, device=DEV)
        arows = torch.tensor([2, 0, 1] if grouped else [0], dtype=torch.int32, device=DEV)
        launch, info = gp.make_probe(cfg, stage, wp if grouped else wp[0], wsc if grouped else wsc[0], x, experts,
                                     arows, unroll=unroll, **hint)
        got = launch().cpu()
        exp = _probe_expected(wp.view(torch.int32).cpu(), wsc.view(torch.uint8).cpu(), wdq, x.cpu(), experts.cpu(),
                              arows.cpu(), info, cfg.block_n, cfg.block_kw, stage,
                              hint.get("scales", 2 if cfg.block_scale else 1))
        assert info["programs"] == len(exp) and (info["split"] == 2 or grouped), info
        if stage == 0:
            assert got.tolist() == exp, (cfg.label, grouped)
        else:
            gf = got.view(torch.float32).double()
            # decode "bits" carries E2M1 * scale * 2**-9 (its epilogue multiplies by 512; _stream_load's docstring)
            ef = torch.tensor(exp, dtype=torch.float64) * (2.0 ** -9 if cfg.decode == "bits" else 1.0)
            assert torch.allclose(gf, ef, rtol=1e-5, atol=1e-6 * float(ef.abs().max())), (cfg.label, grouped, gf, ef)


def test_gemv_flat_read_probe_interpreter():
    """The linear-read probe: each program's value is the int32 sum over lanes of the XOR of its chunk's words
    (independent torch fold), with a partial last chunk."""
    from verl_quads.bench import gemv_probe as gp

    g = torch.Generator().manual_seed(5)
    w = torch.randint(-2**31, 2**31 - 1, (1000,), generator=g, dtype=torch.int64).to(torch.int32).to(DEV)
    for programs, block, unroll in ((3, 64, 2), (4, 128, 1)):
        launch, wpp = gp.make_flat_read(w, programs, block, unroll)
        got = launch().cpu().tolist()
        exp = []
        for lo in range(0, 1000, wpp):
            chunk = w.cpu()[lo:lo + wpp].long()
            lanes = torch.zeros(block, dtype=torch.int64)
            for o in range(0, chunk.numel(), block):
                part = chunk[o:o + block]
                lanes[:part.numel()] ^= part
            t = int(lanes.sum()) & 0xFFFFFFFF
            exp.append(t - (1 << 32) if t >= 1 << 31 else t)
        assert got == exp, (programs, block, unroll)


def test_gemv_probe_config_errors():
    from verl_quads.bench import gemv_probe as gp

    with pytest.raises(ValueError, match="tensor-core"):
        gp.probe_constexprs(SC(block_m=16, mma=1), 0, True)
    with pytest.raises(ValueError, match="unroll"):
        gp.probe_constexprs(SC(), 0, True, unroll=2)  # prefetch=True
    with pytest.raises(ValueError, match="hints"):
        gp.probe_constexprs(SC(prefetch=False), 1, True, cache=".cg")
    with pytest.raises(ValueError, match="scales"):
        gp.probe_constexprs(SC(prefetch=False), 2, True, scales=2)


_SM90_PROBE = r"""
from verl_quads.bench import gemv_probe as gp
from verl_quads.nvfp4 import triton_gemm as tg
from verl_quads.nvfp4 import triton_stream as ts
entry = ts.DECODE_TABLE[(False, 1, 8192, 8192)]
cases = [(entry, 0, 1, {}), (entry, 1, 1, {}), (entry, 2, 1, {})]
for u in (1, 2, 4):
    cases.append((ts.StreamConfig(block_n=256, block_kw=16, prefetch=False), 0, u, {}))
cases += [(ts.StreamConfig(block_n=128, block_kw=32, num_warps=8), 0, 1, {"cache": ".cg"}),
          (ts.StreamConfig(block_n=128, block_kw=32, num_warps=8), 0, 1, {"evict": "evict_first"}),
          (ts.StreamConfig(block_n=128, block_kw=16, prefetch=False, pipe=3), 0, 1, {}),
          (ts.StreamConfig(block_n=16, block_kw=128, prefetch=True), 0, 1, {"scales": 0}),
          (ts.StreamConfig(block_n=16, block_kw=128, prefetch=True), 0, 1, {"scales": 2})]
for cfg, stage, u, hint in cases:
    c = gp.probe_sass_counts(cfg, stage, u, **hint)
    want = gp.expected_word_vectors(cfg, u)
    print(cfg.label, stage, u, hint, c, "want", want)
    if cfg.pipe > 1:  # the pipeliner turns the word loads into asynchronous copies
        assert c["ldgsts"] >= want, c
    else:  # every 16-byte word vector of a K step is in the loop (none dropped by the compiler)
        assert c["loop_ldg128"] == want, (cfg.label, c, want)
print("compiled")
"""


def test_gemv_probe_keeps_every_load_sm90_without_a_gpu():
    """The probes compute nothing, so the compiler must be shown to keep their loads: compile them for sm_90
    offline (triton's ptxas) and count the 16-byte global loads in the K loop's SASS: BN * BKW * unroll / (4 *
    threads) per iteration (the table entry at stages 0-2, unroll 1/2/4, load hints; LDGSTS for pipe 3)."""
    compile_for_sm90_in_subprocess(_SM90_PROBE, "on a GPU the probes run in verl-quads bench rollout --gemv-roofline")
