"""The TMA-fed dense W4A16 kernel (verl_quads/nvfp4/gluon_tma.py) on an sm_90+ GPU (triton >= 3.6 with Gluon): dense
decode shapes M = 1..16 (+ row-group tails, K tails inside a stage, bias) against the rollout's torch reference
(verl_quads/rollout/emulation.py) with the bound of the other W4A16 kernels (1 bf16 ulp + 4 K eps_f32 |x| @ |w|.T);
one-hot rows bit for bit (every product exact); repeated launches and CUDA-graph replay bit for bit; clear errors."""

import pytest
import torch

from _gemm_helpers import rand_w as _w
from _gemm_helpers import rand_x as _x
from _gemm_helpers import w4a16_case
from verl_quads.bench.gluon_probe import TMA_CONFIGS
from verl_quads.nvfp4 import gluon_gemm as gg
from verl_quads.nvfp4 import gluon_tma as gt
from verl_quads.rollout import emulation as em

pytestmark = pytest.mark.gpu
DEV = "cuda"
T = gt.TmaConfig

if gt.gluon is None or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs triton Gluon and an sm_90+ GPU (TMA)", allow_module_level=True)


def _tma_run(cfg):
    """The TMA kernel as ``run(x, packed, block_scale, gs, bias)``; decodes 2 / 4 read the codes as spread_std's /
    adjacent_std's words."""
    def run(x, p, s, gs, b):
        return gt.gluon_w4a16_tma(x, gg.std_words(p, cfg.dec), s, gs, b, cfg)
    return run


def _tma_case(m, n, k, cfg, seed=0, bias=False):
    return w4a16_case(_tma_run(cfg), m, n, k, cfg.label, seed, bias)


@pytest.mark.parametrize("m", [1, 4, 9, 16])
@pytest.mark.parametrize("n, k", [(8192, 8192), (4096, 4096), (5120, 2048), (2048, 4096)])
def test_tma_dense_decode(m, n, k):
    _tma_case(m, n, k, T(), seed=m, bias=m == 4)


@pytest.mark.parametrize("cfg", TMA_CONFIGS, ids=lambda c: c.label)
@pytest.mark.parametrize("m, n, k, bias", [(3, 4096, 4096, True), (16, 8192, 8192, False), (5, 1040, 2304, True),
                                           (11, 4112, 768, False), (1, 16, 256, True), (2, 48, 1280, False)])
def test_tma_configs_and_tails(cfg, m, n, k, bias):
    """Row-group tails (N = 16 x odd: a program's last groups past N read TMA zeros, not stored) and K tails (chunks
    past K inside the last stage: zero words, zero scales, zero activation)."""
    _tma_case(m, n, k, cfg, seed=m + 3, bias=bias)


@pytest.mark.parametrize("m, n, k", [(1, 8192, 8192), (16, 4096, 4096), (5, 1040, 2304)])
def test_tma_spread_words_bit_equal(m, n, k):
    """Decode 2 on spread_std's words builds the same registers as decode 3 on the plain codes: the same bytes. Decode 4
    (adjacent_std's words) pairs other columns in the MMA's k order: bounded like the others (checked by _tma_case)."""
    y, (x, p, s, gs, b) = _tma_case(m, n, k, T(ks=2, nwr=2, u=4, ns=3, dec=2), seed=m + 11, bias=True)
    assert torch.equal(y, gt.gluon_w4a16_tma(x, p, s, gs, b, T(ks=2, nwr=2, u=4, ns=3, dec=3)))
    _tma_case(m, n, k, T(ks=2, nwr=2, u=4, ns=3, dec=4), seed=m + 11, bias=True)


def test_tma_floor_streams_without_computing():
    """TmaConfig(floor=True) (benchmarks only) launches the same pipeline with no decode / MMA: its output is the bias
    alone -- never mistaken for a GEMM result."""
    q = em.quantize_weight(_w((256, 1024)))
    b = (_w((256,), seed=9) * 10).to(torch.bfloat16)
    y = gt.gluon_w4a16_tma(_x(3, 1024), q.packed, q.block_scale, q.global_scale.reshape(()), b, T(floor=True))
    assert torch.equal(y, b.expand(3, 256))


def test_tma_one_hot_exact():
    from test_gluon_gemm_gpu import _one_hot_case

    _one_hot_case(lambda p, s, gs, x: gt.gluon_w4a16_tma(x, p, s, gs, None, T()), "tma")


def test_tma_deterministic_and_graph():
    y, (x, p, s, gs, _) = _tma_case(16, 4096, 4096, T(), seed=2)
    bad = sum(not torch.equal(gt.gluon_w4a16_tma(x, p, s, gs, None, T()), y) for _ in range(50))
    assert bad == 0, f"{bad} of 50 launches differ"
    xs = torch.zeros_like(x[:4])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gt.gluon_w4a16_tma(xs, p, s, gs, None, T())
    for seed in (5, 6):
        x2 = _x(4, 4096, seed)
        xs.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gt.gluon_w4a16_tma(x2, p, s, gs, None, T()))


def test_tma_rejects():
    q = em.quantize_weight(_w((64, 384)))
    gs = q.global_scale.reshape(())
    with pytest.raises(RuntimeError, match="K % 256 == 0"):
        gt.gluon_w4a16_tma(_x(2, 384), q.packed, q.block_scale, gs)
    q = em.quantize_weight(_w((40, 512)))
    with pytest.raises(RuntimeError, match="N % 16 == 0"):
        gt.gluon_w4a16_tma(_x(2, 512), q.packed, q.block_scale, q.global_scale.reshape(()))
    q = em.quantize_weight(_w((64, 512)))
    with pytest.raises(RuntimeError, match=r"bf16 activation \[1..16"):
        gt.gluon_w4a16_tma(_x(17, 512), q.packed, q.block_scale, q.global_scale.reshape(()))
    with pytest.raises(ValueError, match="shared memory"):
        gt.gluon_w4a16_tma(_x(16, 512), q.packed, q.block_scale, q.global_scale.reshape(()), None,
                           T(ks=4, nwr=4, u=2, ns=6))
