"""The QAT hot path's ``amax=`` route of the NVFP4 QDQ (global scale derived inside the v2 kernel from a
given amax, a fused group's amaxes, or each row's own max |x|) gives the same bytes as computing
``global_scale_from_amax`` with torch and passing it (torch.equal), edge amaxes included (0, denormal,
NaN, +Inf), on the triton backend (interpreter on CPU) and the torch reference."""

from __future__ import annotations

import os

import pytest
import torch

import verl_quads.nvfp4 as nv

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (scripts/test.sh sets it on CPU hosts)",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
EDGE = [0.0, 1e-39, 1.1754943508222875e-38, 3e-38, float("nan"), float("inf"), 1e-3, 448.0, 3.0e38]


def _x(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 4).to(dtype).to(DEV)


def test_kernel_global_scale_equals_global_scale_from_amax_on_edges_and_random():
    # a 1-row QDQ per amax value would be slow under the interpreter: use quantize's returned scales over
    # many per-expert amaxes at once ([E, 1, 1], one launch)
    g = torch.Generator().manual_seed(3)
    rnd = torch.exp(torch.randn(4096, generator=g) * 30).clamp(max=3e38)
    vals = torch.cat([torch.tensor(EDGE), rnd, torch.rand(64, generator=g) * 2e-38])
    amax = vals.reshape(-1, 1, 1).to(DEV)
    x = torch.zeros(amax.shape[0], 1, 16, device=DEV)
    q = nv.quantize(x, amax=amax, backend="triton", check_finite=False)
    want = nv.global_scale_from_amax(amax)
    assert q.global_scale.shape == want.shape
    assert torch.equal(q.global_scale.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_amax_routes_equal_torch_scales(dtype):
    x = _x((3, 40, 64), dtype)
    per_exp = x.abs().amax(dim=(1, 2), keepdim=True)
    per_exp[1] = 0.0  # edge: a zero amax (scale 1.0)
    cases = [
        (per_exp, nv.global_scale_from_amax(per_exp.float())),
        (x.abs().amax(), nv.global_scale_from_amax(x.abs().amax().float())),
        (torch.stack([x[0].abs().amax(), x[2].abs().amax(), x[1].abs().amax()]),
         nv.global_scale_from_amax(torch.stack([x[0].abs().amax(), x[2].abs().amax(), x[1].abs().amax()]).amax().float())),
        ("row", nv.per_row_global_scale(x)),
    ]
    for amax, gs in cases:
        want = nv.fake_quantize(x, gs, backend="torch", check_finite=False)
        got = nv.fake_quantize(x, amax=amax, backend="triton", check_finite=False)
        assert torch.equal(got, want), str(amax)[:40]
        assert torch.equal(nv.fake_quantize(x, amax=amax, backend="torch", check_finite=False), want)
        qt, qr = nv.quantize(x, amax=amax, backend="triton", check_finite=False), nv.quantize(x, gs, backend="torch")
        assert torch.equal(qt.packed, qr.packed) and torch.equal(qt.block_scale.view(torch.uint8), qr.block_scale.view(torch.uint8))
        assert torch.equal(qt.global_scale, qr.global_scale.expand_as(qt.global_scale)) and qt.global_scale.dtype == torch.float32


def test_row_amax_in_kernel_handles_zero_nan_inf_rows_and_the_long_row_route(monkeypatch):
    from verl_quads.nvfp4 import triton_kernels as tk

    x = _x((6, 128), torch.bfloat16, seed=1)
    x[1] = 0.0
    x[2, 5] = float("nan")
    x[3, 7] = float("inf")
    x[4, 3] = -float("inf")
    x[5] = 1e-39  # denormal fp32 -> bf16 denormal row
    want = tk.fake_quantize(x, nv.per_row_global_scale(x), check_finite=False)  # GSRC 0, torch scales
    assert torch.equal(tk.fake_quantize(x, amax="row", check_finite=False).view(torch.int16), want.view(torch.int16))
    q = tk.quantize(x, amax="row", check_finite=False)
    assert torch.equal(q.global_scale, nv.per_row_global_scale(x))
    # rows longer than one program: the row amax by one torch reduction, then the kernel (same bytes)
    assert tk._row_amax_fits(128, 1)
    monkeypatch.setitem(tk.QUANT2_CONFIG, "qdq", {"blocks": 4, "num_warps": 4})
    assert not tk._row_amax_fits(128, 1)
    assert torch.equal(tk.fake_quantize(x, amax="row", check_finite=False).view(torch.int16), want.view(torch.int16))


def test_group_amax_nan_member_gives_scale_one_as_torch():
    x = _x((4, 32), torch.bfloat16, seed=2)
    grp = torch.tensor([0.5, float("nan"), 2.0], dtype=torch.bfloat16, device=DEV)
    gs = nv.global_scale_from_amax(grp.amax().float())
    assert gs.item() == 1.0
    want = nv.fake_quantize(x, gs, backend="torch", check_finite=False)
    assert torch.equal(nv.fake_quantize(x, amax=grp, backend="triton", check_finite=False), want)


def test_amax_argument_errors_are_clear():
    x = _x((4, 32))
    with pytest.raises(ValueError, match="global_scale or amax"):
        nv.fake_quantize(x, torch.ones(()), amax="row", backend="triton")
    with pytest.raises(ValueError, match="'row'"):
        nv.fake_quantize(x, amax="col", backend="triton")
    with pytest.raises(ValueError, match="amax of shape"):
        nv.fake_quantize(x, amax=torch.ones(4, 2, device=DEV), backend="triton")
    # check_finite=True: the scale is computed by torch and checked (amax inf -> scale 0 -> refused)
    with pytest.raises(ValueError, match="finite and > 0"):
        nv.fake_quantize(x, amax=torch.tensor(float("inf"), device=DEV), backend="triton", check_finite=True)
