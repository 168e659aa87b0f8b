"""Decode-once dense GEMM (verl_quads/nvfp4/dequant_gemm.py) on a CUDA GPU (the H200): block values bit-exact, the
cuBLAS float32-output GEMM within the GEMM tests' bound of the rollout's torch reference (tests/gpu/_gemm_helpers.py),
weight chunks, CUDA-graph capture, and the default dispatch from DEQUANT_MIN_ROWS rows on."""

import pytest
import torch

from _gemm_helpers import capture_graph, check_close, rand_w, rand_x
from verl_quads.nvfp4 import dequant_gemm as dg
from verl_quads.nvfp4 import triton_gemm as tg
from verl_quads.nvfp4.format import NVFP4Tensor
from verl_quads.nvfp4.reference import dequantize_to_float32
from verl_quads.rollout import emulation as em

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_block_values_exact_on_gpu(dtype):
    g = torch.Generator(device=DEV).manual_seed(0)
    packed = torch.randint(0, 256, (1000, 2056), device=DEV, generator=g, dtype=torch.uint8)  # K = 4112: 257 blocks
    scale = torch.randint(0, 127, (1000, 257), device=DEV, generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    one = torch.ones((), device=DEV)
    want = dequantize_to_float32(NVFP4Tensor(packed, scale, one, torch.Size((1000, 4112)), torch.float32)).to(dtype)
    got = dg.block_values(packed, scale, dtype)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def _case(m, n, k, mode, dtype, bias, cfg, seed=0):
    x = rand_x(m, k, seed, dtype)
    q = em.quantize_weight(rand_w((n, k), seed + 1))
    gs = q.global_scale.reshape(())
    b = (rand_w((n,), seed + 7) * 10).to(dtype) if bias else None
    act, _ = tg.quantize_activation(x, mode)
    xf, _ = em.quantize_activation(x, em.ActQuant(mode, 0.5, False, residual_granularity="block"))
    wf = em.weight_f32(q.packed, q.block_scale, gs)
    ref = em.gemm(xf, wf, b, dtype)
    y = tg.nvfp4_gemm(act, q.packed, q.block_scale, gs, b, config=cfg)
    assert y.shape == (m, n) and y.dtype == dtype
    check_close(y, ref, xf, wf, f"decode-once {mode} {dtype} M={m} N={n} K={k}{' bias' if b is not None else ''}")
    return y, (act, q, gs, b, ref, xf, wf)


@pytest.mark.parametrize("mode", ["w4a16", "naive", "trace"])
@pytest.mark.parametrize("m, n, k", [(64, 5120, 2048), (300, 2048, 4096), (4096, 8192, 8192), (1, 640, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequant_gemm_matches_reference(mode, m, n, k, dtype):
    _case(m, n, k, mode, dtype, True, dg.DequantConfig())


def test_chunks_within_the_bound():
    """128-row weight chunks (8 cuBLAS calls, the last one 104 rows) are within the same bound as one chunk (cuBLAS may
    pick another algorithm, i.e. summation order, for another N: bit equality is reported, not required)."""
    y1, (act, q, gs, b, ref, xf, wf) = _case(512, 1000, 2048, "w4a16", torch.bfloat16, True, dg.DequantConfig())
    y2 = tg.nvfp4_gemm(act, q.packed, q.block_scale, gs, b, config=dg.DequantConfig(scratch_bytes=1))
    check_close(y2, ref, xf, wf, "decode-once, 128-row chunks")
    print(f"chunked vs one piece: {float((y1 == y2).float().mean()):.2%} bit-equal")


def test_captured_in_cuda_graph():
    m, n, k = 512, 2048, 4096
    x = rand_x(m, k)
    q = em.quantize_weight(rand_w((n, k)))
    gs = q.global_scale.reshape(())
    cfg = dg.DequantConfig(scratch_bytes=1 << 20)  # several chunks inside the graph
    run = lambda: tg.nvfp4_linear(x, q.packed, q.block_scale, gs, None, "w4a16", config=cfg)  # noqa: E731
    graph, y = capture_graph(run)
    x.copy_(rand_x(m, k, seed=5))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, run())


@pytest.mark.parametrize("n, k", [(5120, 2048), (8192, 8192)])
def test_default_dispatch_takes_it_from_the_table(n, k):
    cap = tuple(torch.cuda.get_device_capability())
    q = em.quantize_weight(rand_w((n, k)))
    gs = q.global_scale.reshape(())
    for kind, mode in (("w4a16", "w4a16"), ("a4", "naive")):
        thr = dg.dequant_min_rows(kind, n, k, cap)
        if thr is None:
            pytest.skip(f"no DEQUANT_MIN_ROWS entry for sm_{cap[0]}{cap[1]}")
        for m, taken in ((thr, True), (thr - 1, False)):
            act, _ = tg.quantize_activation(rand_x(m, k), mode)
            cfg = dg.dequant_dense_config(act, q.packed)
            assert (cfg is not None) == taken, (kind, m)
            if taken:
                assert torch.equal(tg.nvfp4_gemm(act, q.packed, q.block_scale, gs),
                                   tg.nvfp4_gemm(act, q.packed, q.block_scale, gs, config=cfg))

