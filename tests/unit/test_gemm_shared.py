"""verl_quads/nvfp4/gemm_shared.py (issue #5): the split-K reduction launch and the fixup's tile counters that the
stream kernel and the Gluon kernels share. The reduction runs under TRITON_INTERPRET=1 on CPU; the counters' capture
rule is checked with torch.cuda's capture query answered by the test (no GPU here)."""

import os

import pytest
import torch

from verl_quads.nvfp4 import gemm_shared

needs_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (scripts/test.sh sets it on CPU)",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_splitk_reduce_is_the_fixed_order_float32_sum(dtype, with_bias):
    """out = cast(((part[0] + part[1]) + part[2]) + bias): float32 sums in split order, one round-to-nearest cast
    (torch's float32 adds in the same order give the same bits); rows * N not a multiple of the launch's 1024."""
    g = torch.Generator().manual_seed(0)
    part = (torch.randn(3, 37, 29, generator=g) * torch.exp2(torch.randint(-8, 8, (3, 37, 29), generator=g))).to(DEV)
    bias = torch.randn(29, generator=g).to(DEV).to(dtype) if with_bias else None
    want = part[0] + part[1] + part[2]
    if bias is not None:
        want = want + bias.float()
    out = torch.full((37, 29), 7.0, dtype=dtype, device=DEV)
    got = gemm_shared.splitk_reduce(part, bias, out)
    assert got is out
    assert torch.equal(got, want.to(dtype))


@needs_kernels
def test_splitk_reduce_rejects_a_mismatched_output():
    part = torch.zeros(2, 4, 8, device=DEV)
    with pytest.raises(ValueError, match=r"out must be \[4, 8\]"):
        gemm_shared.splitk_reduce(part, None, torch.zeros(4, 9, device=DEV))
    with pytest.raises(ValueError, match="out must be"):
        gemm_shared.splitk_reduce(part, None, torch.zeros(4, 8, dtype=torch.float64, device=DEV))


def test_tile_counters_zeroed_grown_per_owner(monkeypatch):
    monkeypatch.setattr(gemm_shared, "_TILE_COUNTERS", {})
    dev = torch.device("cpu")
    a = gemm_shared.tile_counters(dev, 10, "stream")
    assert a.dtype == torch.int32 and a.numel() == 4096 and not a.any()
    assert gemm_shared.tile_counters(dev, 4096, "stream") is a  # big enough: reused as it is
    b = gemm_shared.tile_counters(dev, 10, "gluon_dense")
    assert b is not a  # kernel families never share counters
    c = gemm_shared.tile_counters(dev, 5000, "stream")
    assert c.numel() == 5000 and not c.any() and gemm_shared.tile_counters(dev, 1, "stream") is c
    assert gemm_shared.tile_counters(dev, 3, "gluon_grouped", min_size=1 << 16).numel() == 1 << 16


def test_tile_counters_refuse_to_grow_inside_graph_capture(monkeypatch):
    """While a CUDA graph is captured, a buffer that must grow is not allocated (its zero-fill would be recorded in
    the graph, not run): None, and the caller takes the reduction launch or raises. A large enough buffer is
    returned as usual."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(gemm_shared, "_TILE_COUNTERS", {("stream", str(cuda)): torch.zeros(64, dtype=torch.int32)})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert gemm_shared.tile_counters(cuda, 65, "stream") is None
    assert gemm_shared.tile_counters(cuda, 1, "gluon_dense") is None  # no buffer yet for this family
    assert gemm_shared.tile_counters(cuda, 64, "stream").numel() == 64
