"""QUADS residual compensation with ``granularity="channel"`` (per-token top-k% channels by R**2,
second pass dense over the original 16-blocks): torch reference (verl_quads/nvfp4/residual.py) and its Triton
kernel (verl_quads/nvfp4/triton_channel.py, compared bit for bit with the reference; on CPU under TRITON_INTERPRET=1).

Expected selections and values below are worked out by hand from the E2M1 grid (row amax 6 makes the
block scale 448 and the encode factor 1, so x is quantized on the grid directly), or come from an
independent Python selection loop; none is computed by the code under test."""

from __future__ import annotations

import pytest
import torch

import verl_quads.nvfp4 as nv
from verl_quads.nvfp4.residual import ChannelResidualNVFP4, select_channels

# one 16-block: values on the E2M1 scale (row amax 6 -> global scale 448, block scale 448, y = x)
# residual x - Q(x): 6 -> 0, 5.5 -> 6 (-0.5), 2.75 -> 3 (-0.25), 1.25 -> 1 (+0.25), 0.125 -> 0 (+0.125),
# 3.75 -> 4 (-0.25), 0 -> 0
_BLOCK = [6.0, 5.5, 2.75, 1.25, 0.125, 3.75] + [0.0] * 10
_HAND_X = torch.tensor([_BLOCK + _BLOCK], dtype=torch.float32)  # [1, 32], both blocks equal: ties across blocks
_HAND_R = torch.tensor([[0.0, -0.5, -0.25, 0.25, 0.125, -0.25] + [0.0] * 10] * 1).repeat(1, 2)


def _q(x, ratio, gran="channel", gs="row", **kw):
    g = nv.per_row_global_scale(x) if gs == "row" else gs
    return nv.residual_quantize(x, ratio, g, granularity=gran, backend="torch", **kw)


def _fq(x, ratio, gran="channel", gs="row", **kw):
    g = nv.per_row_global_scale(x) if gs == "row" else gs
    return nv.residual_fake_quantize(x, ratio, g, granularity=gran, backend="torch", **kw)


def test_hand_made_residual_and_ties_go_to_the_lower_channel():
    r = _q(_HAND_X, 0.25)
    assert isinstance(r, ChannelResidualNVFP4) and r.granularity == "channel"
    first = nv.dequantize(r.first, torch.float32, backend="torch")
    assert torch.equal(_HAND_X - first, _HAND_R)  # the hand residual (the first pass is exact RTN on the grid)
    # scores .25 (ch 1, 17), .0625 (2, 3, 5, 18, 19, 21), .015625 (4, 20), 0 (the rest)
    assert r.channel_idx.tolist() == [[1, 2, 3, 5, 17, 18, 19, 21]]  # round(0.25 * 32) = 8
    assert _q(_HAND_X, 3 / 32).channel_idx.tolist() == [[1, 2, 17]]  # 1, 17 (.25), then the lower of the .0625 ties
    # 0.5 -> 16: the 10 non-zero scores, then six zero-score channels, lowest index first: 0, 6, 7, 8, 9, 10
    assert _q(_HAND_X, 0.5).channel_idx.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 17, 18, 19, 20, 21]]
    assert r.channel_idx.dtype == torch.int64
    mask = r.selected
    assert mask.dtype == torch.bool and mask.shape == (1, 32) and mask.nonzero()[:, 1].tolist() == r.channel_idx[0].tolist()
    # second pass: dense [1, 32]; R_sel amax 0.5 -> the selected residuals land on the grid (-6, -3, 3, 1.5 of 1/12)
    assert tuple(r.second.shape) == (1, 32) and r.second.dtype == torch.float32
    comp = r.dequantize(torch.float32)
    assert torch.allclose(comp[mask], _HAND_X[mask], rtol=0, atol=1e-6)  # compensated channels: x (to float32 rounding)
    assert torch.equal(comp[~mask], first[~mask])  # unselected channels: exactly the first pass
    # the block rule on the same row at 0.25 of 2 blocks = 0.5 -> 1 block: block 0 (tie with block 1)
    assert _q(_HAND_X, 0.25, "block").block_idx.tolist() == [[0]]


def test_select_channels_by_hand_with_score_weight():
    res = torch.tensor([[1.0, -2.0, 2.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    assert select_channels(res, 2).tolist() == [[1, 2], [0, 1]]
    w = torch.tensor([4.0, 1.0, 0.0, 1.0])  # scores row 0: 4, 4, 0, .25
    assert select_channels(res, 2, w).tolist() == [[0, 1], [0, 1]]
    assert select_channels(res, 0).shape == (2, 0)


def test_all_zero_rows_give_finite_scales_and_zeros():
    x = torch.zeros(3, 48, dtype=torch.bfloat16)
    x[1] = torch.linspace(-3, 3, 48).to(torch.bfloat16)
    r = _q(x, 0.5)
    for t in (r.first, r.second):
        assert torch.isfinite(t.global_scale).all() and torch.isfinite(t.block_scale.float()).all()
    for row in (0, 2):
        assert r.channel_idx[row].tolist() == list(range(24))  # all scores 0: the lowest channels
        assert torch.equal(r.second.packed[row], torch.zeros_like(r.second.packed[row]))
        assert float(r.second.global_scale[row]) == 1.0
    out = r.dequantize()
    assert out.dtype == torch.bfloat16 and torch.equal(out[0], torch.zeros(48, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("gs", ["row", "tensor", None])
def test_ratio_one_equals_block_rule_and_ratio_zero_equals_naive(dtype, gs):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 96, generator=g) * torch.exp(torch.randn(96, generator=g))).to(dtype)
    if gs == "tensor":
        gs = nv.global_scale_from_amax(x.abs().amax().float())
    chan, blk = _q(x, 1.0, gs=gs), _q(x, 1.0, "block", gs=gs)
    assert torch.equal(chan.second.packed, blk.second.packed) and torch.equal(chan.second.block_scale, blk.second.block_scale)
    assert torch.equal(chan.second.global_scale, blk.second.global_scale)
    assert torch.equal(_fq(x, 1.0, gs=gs), _fq(x, 1.0, "block", gs=gs))
    z = _fq(x, 0.0, gs=gs)
    g0 = nv.per_row_global_scale(x) if gs == "row" else gs
    assert z.dtype == dtype and torch.equal(z, nv.fake_quantize(x, g0, backend="torch"))
    assert _q(x, 0.0, gs=gs).channel_idx.shape == (7, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_channel_rule_matches_its_definition_with_an_independent_selection(dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 64, generator=g) * 3).to(dtype)
    x[2, 17] = 40.0  # an outlier
    gs = nv.per_row_global_scale(x)
    r = _q(x, 0.3)
    n = 19  # round(0.3 * 64 = 19.2)
    res = x.float() - nv.dequantize(nv.quantize(x, gs, backend="torch"), torch.float32, backend="torch")
    score = res.square()
    mask = torch.zeros(5, 64, dtype=torch.bool)
    for m in range(5):
        s = score[m].tolist()
        want = sorted(sorted(range(64), key=lambda c: (-s[c], c))[:n])
        assert r.channel_idx[m].tolist() == want
        mask[m, want] = True
    r_sel = torch.where(mask, res, 0.0)
    q2 = nv.quantize(r_sel, nv.global_scale_from_amax(r_sel.abs().amax(-1, keepdim=True)), backend="torch")
    assert torch.equal(r.second.packed, q2.packed) and torch.equal(r.second.block_scale, q2.block_scale)
    want = (nv.dequantize(r.first, torch.float32, backend="torch") + nv.dequantize(q2, torch.float32, backend="torch")).to(dtype)
    out = _fq(x, 0.3)
    assert out.dtype == dtype and torch.equal(out, want)
    naive = nv.fake_quantize(x, gs, backend="torch")
    assert (out.float() - x.float()).norm() < (naive.float() - x.float()).norm()


def test_rows_are_independent_and_leading_dims_are_refused():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 32, generator=g).to(torch.bfloat16)
    full = _fq(x, 0.5)
    for m in range(6):  # per-row global scale + per-row selection: a row's result does not depend on its batch mates
        assert torch.equal(_fq(x[m : m + 1], 0.5), full[m : m + 1])
    with pytest.raises(ValueError, match=r"2-D \[tokens, K\], got shape \(2, 3, 32\)"):
        _fq(x.reshape(2, 3, 32), 0.5)
    # the caller flattens leading dims (as the rollout does): same result as the 2-D call
    assert torch.equal(_fq(x.reshape(2, 3, 32).reshape(-1, 32), 0.5), full)


def test_errors_name_the_option_and_the_allowed_values(monkeypatch):
    x = torch.randn(4, 32)
    with pytest.raises(ValueError,
                       match=r"granularity must be one of \('block', 'channel', 'channel_sampled'\).*'row'"):
        _q(x, 0.5, "row")
    with pytest.raises(ValueError, match="per token.*per_token=False"):
        _q(x, 0.5, per_token=False)
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\]"):
        _q(x, 1.5)
    with pytest.raises(ValueError, match="score_weight"):
        _q(x, 0.5, score_weight=torch.ones(31))
    from verl_quads.nvfp4 import triton_channel

    # the triton kernel holds a row on chip: a longer row is refused naming the config key (never the block rule,
    # never torch). Checked before anything launches, so no interpreter is needed.
    monkeypatch.setitem(triton_channel.CHANNEL_CONFIG, "max_k", 16)
    monkeypatch.setattr(triton_channel.tk, "check_available", lambda t: None)
    for fn in (nv.residual_quantize, nv.residual_fake_quantize):
        with pytest.raises(NotImplementedError, match=r"granularity='channel'.*K = 32.*CHANNEL_CONFIG\['max_k'\] = 16"):
            fn(x, 0.5, granularity="channel", backend="triton")


# ---- the Triton kernel (verl_quads/nvfp4/triton_channel.py): the reference's bytes -----------------------------

_needs_interp = pytest.mark.skipif(
    not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (scripts/test.sh sets it on CPU)",
)
_DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _bytes_eq(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _same_channel_result(x, ratio, gs, **kw):
    """Triton vs torch reference: packed codes, E4M3 scale bytes, global scales (values and shapes), selected
    channels, and the QDQ output, all bit for bit."""
    t = nv.residual_quantize(x, ratio, gs, granularity="channel", backend="triton", **kw)
    r = nv.residual_quantize(x, ratio, gs, granularity="channel", backend="torch", **kw)
    assert isinstance(t, ChannelResidualNVFP4)
    for a, b in ((t.first, r.first), (t.second, r.second)):
        assert torch.equal(a.packed, b.packed), (ratio, (a.packed != b.packed).nonzero()[:5].tolist())
        assert _bytes_eq(a.block_scale, b.block_scale) and _bytes_eq(a.global_scale, b.global_scale)
        assert a.shape == b.shape and a.dtype == b.dtype
    assert t.channel_idx.dtype == torch.int64 and torch.equal(t.channel_idx, r.channel_idx), ratio
    ft = nv.residual_fake_quantize(x, ratio, gs, granularity="channel", backend="triton", **kw)
    fr = nv.residual_fake_quantize(x, ratio, gs, granularity="channel", backend="torch", **kw)
    assert _bytes_eq(ft, fr), (ratio, x.dtype)
    if x.shape[-1] <= 256 and gs is not None and gs.dim() == 2 and gs.shape[0] == x.shape[0]:
        _same_with_row_scale_in_kernel(x, ratio, gs, r, fr, **kw)
    return t


def _same_with_row_scale_in_kernel(x, ratio, gs, r, fr, **kw):
    """amax="row" (each row's scale derived inside the kernel) == the reference given per_row_global_scale(x)."""
    assert torch.equal(gs, nv.per_row_global_scale(x))  # the callers' per-row scale is that convention
    t = nv.residual_quantize(x, ratio, amax="row", granularity="channel", backend="triton", check_finite=False, **kw)
    for a, b in ((t.first, r.first), (t.second, r.second)):
        assert torch.equal(a.packed, b.packed) and _bytes_eq(a.block_scale, b.block_scale)
        assert _bytes_eq(a.global_scale, b.global_scale), (a.global_scale.shape, b.global_scale.shape)
    assert torch.equal(t.channel_idx, r.channel_idx)
    ft = nv.residual_fake_quantize(x, ratio, amax="row", granularity="channel", backend="triton", **kw)
    assert _bytes_eq(ft, fr), (ratio, x.dtype)


def _rows(m, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) / torch.rand(m, k, generator=g).clamp(min=0.05)
    x[0] = 0.0  # an all-zero row: every score ties at +0
    if k >= 32:
        x[-1, :16] *= 1e-5  # a block scale in the E4M3 subnormal range
        x[-1, 16:32] = -0.0
    return x.to(dtype).to(_DEV)


@_needs_interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_channel_kernel_matches_reference(dtype):
    # ratios 0 and 1 (nothing / everything selected) at the small K only: the interpreter's time goes to K = 2048
    for k, m, ratios in ((16, 3, (0.0, 0.125, 0.5, 1.0)), (32, 3, (0.0, 0.125, 0.5, 1.0)), (2048, 2, (0.125, 0.5))):
        x = _rows(m, k, dtype, seed=k)
        gs = nv.per_row_global_scale(x)
        for ratio in ratios:
            _same_channel_result(x, ratio, gs)


@_needs_interp
def test_triton_channel_kernel_ties_weights_and_scale_layouts():
    # hand-made ties straddling the threshold: _HAND_X's scores are .25 (ch 1, 17), .0625 (2, 3, 5, 18, 19, 21),
    # .015625 (4, 20), 0; n_sel = 3 cuts through the six .0625 ties (the reference takes 1, 17 then 2), n_sel = 12
    # through the zero-score channels
    x = _HAND_X.to(_DEV)
    assert _same_channel_result(x, 3 / 32, nv.per_row_global_scale(x)).channel_idx.tolist() == [[1, 2, 17]]
    for ratio in (5 / 32, 0.25, 12 / 32, 0.5):
        _same_channel_result(x, ratio, nv.per_row_global_scale(x))
    # several rows of equal |R| in every channel (x constant 1.25 -> R = +.25 everywhere): all 64 scores tie
    xt = torch.full((3, 64), 1.25, device=_DEV)
    xt[0, ::16] = 6.0  # row amax 6: the grid is exact (block scales 448)
    xt[1] = torch.tensor([1.25, -1.25] * 32)
    t = _same_channel_result(xt, 0.3, nv.per_row_global_scale(xt))
    assert t.channel_idx[1].tolist() == list(range(19))  # round(.3 * 64) = 19 ties -> the lowest 19 channels
    # score weights (zeros make ties among non-zero residuals), per-tensor first-pass scale (the second pass's
    # scale is then per tensor: two launches), no scale at all, a single row
    x = _rows(5, 96, torch.bfloat16, seed=7)
    w = torch.rand(96).to(_DEV)
    w[::3] = 0.0
    _same_channel_result(x, 0.4, nv.per_row_global_scale(x), score_weight=w)
    t = _same_channel_result(x, 0.4, nv.global_scale_from_amax(x.float().abs().amax()))
    assert t.second.global_scale.dim() == 0
    _same_channel_result(x, 0.25, None)
    _same_channel_result(x[1:2], 0.25, nv.per_row_global_scale(x[1:2]))
    _same_channel_result(x[:0], 0.5, nv.per_row_global_scale(x[:0]))  # no rows: nothing launched


@_needs_interp
def test_triton_channel_leading_dims_and_batch_invariance():
    x = _rows(6, 48, torch.bfloat16, seed=3)
    gs = nv.per_row_global_scale(x)
    full = nv.residual_fake_quantize(x, 0.5, gs, granularity="channel", backend="triton")
    part = nv.residual_fake_quantize(x[2:4], 0.5, gs[2:4], granularity="channel", backend="triton")
    assert _bytes_eq(full[2:4], part)
    with pytest.raises(ValueError, match=r"2-D \[tokens, K\], got shape \(2, 3, 48\)"):
        nv.residual_fake_quantize(x.reshape(2, 3, 48), 0.5, granularity="channel", backend="triton")
    # the caller flattens leading dims (as the rollout does)
    assert _bytes_eq(nv.residual_fake_quantize(x.reshape(2, 3, 48).reshape(-1, 48), 0.5, gs, granularity="channel",
                                               backend="triton"), full)


@_needs_interp
@pytest.mark.parametrize("combine", ["fp4x2", "bf16"])
def test_rollout_triton_backend_runs_the_channel_rule(monkeypatch, combine):
    """The vLLM methods with backend="triton" (constructed directly: bypasses resolve_backend's device check, as
    tests/unit/test_rollout_triton_backend.py does) and residual_granularity="channel": the GEMM operand is the
    core's channel-rule result bit for bit (fp4x2: Q(x) + the rule's dense Q(R_sel) as the second FP4 operand; bf16:
    the QDQ form as a w4a16 operand), the output matches the torch backend (the emulated GEMM; accumulation order
    differs) for a linear layer and the routed experts, and differs from the block rule."""
    pytest.importorskip("vllm")
    from test_rollout_triton_backend import _close, _linear_layer, _moe_layer

    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.rollout.emulation import ActQuant
    from verl_quads.rollout.linear import QuadsNVFP4LinearMethod
    from verl_quads.rollout.moe import QuadsNVFP4MoEMethod

    layer = _linear_layer()
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    x[..., 7] *= 20
    act = ActQuant("quads", 0.25, True, residual_combine=combine, residual_granularity="channel")
    y = {b: QuadsNVFP4LinearMethod(act, b).apply(layer, x, None) for b in ("torch", "triton")}
    _close(y["triton"], y["torch"], f"linear channel combine={combine}")
    x2 = x.reshape(-1, 96)
    gs = nv.per_row_global_scale(x2)
    w = (layer.weight_packed, layer.weight_scale, layer.weight_global_scale)
    if combine == "bf16":
        op = tg.ActOperand("w4a16", x.dtype, values=nv.residual_fake_quantize(x2, 0.25, gs, granularity="channel",
                                                                             backend="torch"))
    else:
        r = nv.residual_quantize(x2, 0.25, gs, granularity="channel", backend="torch")
        op = tg.ActOperand("quads", x.dtype, first=nv.NVFP4Tensor(r.first.packed, r.first.block_scale, gs, r.first.shape,
                                                                  r.first.dtype),
                           second_packed=r.second.packed, second_scale=r.second.block_scale,
                           second_gs=r.second.global_scale.reshape(-1))
        got, _ = tg.quantize_activation(x2, "quads", residual_ratio=0.25, residual_per_token=True,
                                        residual_granularity="channel")
        assert torch.equal(got.second_packed, r.second.packed) and torch.equal(got.first.packed, r.first.packed)
    assert torch.equal(y["triton"], tg.nvfp4_gemm(op, *w, None).reshape(2, 3, -1))
    blk = QuadsNVFP4LinearMethod(ActQuant("quads", 0.25, True, residual_combine=combine, residual_granularity="block"),
                                 "triton").apply(layer, x, None)
    assert not torch.equal(y["triton"], blk)
    mlayer, cfg = _moe_layer()
    xm = torch.randn(5, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [1, 3], [2, 0], [3, 2], [0, 1]])
    tw = torch.softmax(torch.randn(5, 2, generator=torch.Generator().manual_seed(6)), -1)
    ym = {b: QuadsNVFP4MoEMethod(cfg, act, b).apply(mlayer, xm, tw, ids, None, None) for b in ("torch", "triton")}
    _close(ym["triton"], ym["torch"], f"moe channel combine={combine}")


def _low_bit_ties(m=3, k=64):
    """Rows whose scores differ only in their lowest mantissa bits: x = +-1.25 with one 6.0 per 16-block (the grid
    is exact, R = +-0.25 on the other channels, R**2 = 1/16), score weights 1 + j * 2**-23 (j = 0..7 repeating, so
    eight distinct scores a few ulps apart, each tied eight times per 64 channels; a radix select needs its last
    digit, the ties the lowest-index rule); row 1 has alternating signs (same scores)."""
    x = torch.full((m, k), 1.25)
    x[:, ::16] = 6.0
    x[1, 1::2] = -1.25
    w = 1.0 + (torch.arange(k) % 8).float() * 2.0**-23
    return x.to(_DEV), w.to(_DEV)


@_needs_interp
def test_triton_channel_kernel_edge_cases_and_ulp_apart_scores():
    """The channel kernel gives the reference's bytes at K = 16 and non-power-of-two block counts (K = 48, 96), ratios
    0 / 1 (nothing / everything), all-zero rows (every score ties at +0), hand-made ties across the threshold, scores
    a few ulps apart (``_low_bit_ties``: the search's last bits), a score weight, a per-tensor scale with M > 1 (two
    launches), one row. (``CHANNEL_VARIANTS`` differ only by GPU register caps and warps, which the interpreter ignores; the
    caps are compiled by the sm_90 test below and run against the reference by tests/gpu.)"""
    for k, m, ratios in ((16, 3, (0.0, 0.125, 0.5, 1.0)), (48, 2, (0.0, 0.3, 1.0))):
        x = _rows(m, k, torch.bfloat16, seed=k)
        for ratio in ratios:
            _same_channel_result(x, ratio, nv.per_row_global_scale(x))
    xh = _HAND_X.to(_DEV)
    assert _same_channel_result(xh, 3 / 32, nv.per_row_global_scale(xh)).channel_idx.tolist() == [[1, 2, 17]]
    _same_channel_result(xh, 12 / 32, nv.per_row_global_scale(xh))
    xl, wl = _low_bit_ties()
    want = {3 / 64: [7, 15, 23],  # round(3): the lowest three of the eight top scores (j = 7)
            0.3: sorted([c for c in range(64) if c % 8 >= 6] + [5, 13, 21]),  # 19: j = 7, 6, then 3 of j = 5
            0.5: [c for c in range(64) if c % 8 >= 4]}  # 32: j = 7..4 exactly
    for ratio, chans in want.items():
        t = _same_channel_result(xl, ratio, nv.per_row_global_scale(xl), score_weight=wl)
        assert t.channel_idx.tolist() == [chans] * 3, ratio
    x = _rows(5, 96, torch.float16, seed=7)
    w = torch.rand(96).to(_DEV)
    w[::3] = 0.0
    _same_channel_result(x, 0.4, nv.per_row_global_scale(x), score_weight=w)
    assert _same_channel_result(x, 0.4, nv.global_scale_from_amax(x.float().abs().amax())).second.global_scale.dim() == 0
    _same_channel_result(x[1:2], 0.25, nv.per_row_global_scale(x[1:2]))


@_needs_interp
@pytest.mark.parametrize("bits, cap, tr, wt", [(10, 64, 1, False), (2, 16, 2, False), (10, 64, 2, False),
                                              (11, 256, 2, True)])
def test_triton_channel_compacted_search_matches_reference(bits, cap, tr, wt):
    """The compacted threshold search (``CHANNEL_CONFIG`` compact_*: ``bits`` full-row steps, then the candidates in a
    ``cap``-entry tile, ``tr`` bits per tile step; forced here at K >= 16) gives the reference's bytes. (10, 64): the
    tile (hand ties cut inside it, scores a few ulps apart: the last bits, an early stop inside it) and the full-row
    continuation (an all-zero row: every score is a candidate), a per-tensor scale (two launches); (2, 16): the
    continuation on nearly every row, ratios 0 / 1, a score weight with zeros; wt: the warp tile (256 entries in
    every warp, K >= 256 rows: the hand ties repeated 8 times, the K = 256 rows). amax='row' too (K <= 256)."""
    from verl_quads.nvfp4 import triton_channel as tc

    with tc.channel_config(compact_max_rows=1 << 30, compact_min_k=16, compact_bits=bits, compact_cap=cap,
                           compact_tile_bits=tr, compact_warp_tile=wt):
        if wt:
            xh = _HAND_X.repeat(1, 8).to(_DEV)  # [1, 256]: 16 scores .25, 48 .0625, 16 .015625, the rest 0
            assert tc._compact_args(1, 256, 16) == (bits, 256, 2, True)
            t = _same_channel_result(xh, 24 / 256, nv.per_row_global_scale(xh))  # 16 of .25 + the first 8 of .0625
            assert t.channel_idx[0, :9].tolist() == [1, 2, 3, 5, 17, 18, 19, 21, 33]
            x = _rows(3, 256, torch.bfloat16, seed=3)
            _same_channel_result(x, 0.25, nv.per_row_global_scale(x))
            _same_channel_result(x, 0.5, nv.global_scale_from_amax(x.float().abs().amax()))
            return
        xh = _HAND_X.to(_DEV)
        assert _same_channel_result(xh, 3 / 32, nv.per_row_global_scale(xh)).channel_idx.tolist() == [[1, 2, 17]]
        if bits == 10:
            # torch replay of the search on these rows (k = 0.25): row 0 (all zero) has 256 candidates (the
            # continuation), row 1 ends in the tile with ties (14 candidates), row 2 stops early in the tile
            x = _rows(3, 256, torch.bfloat16, seed=3)
            _same_channel_result(x, 0.25, nv.per_row_global_scale(x))
            xl, wl = _low_bit_ties()
            t = _same_channel_result(xl, 0.3, nv.per_row_global_scale(xl), score_weight=wl)
            assert t.channel_idx.tolist() == [sorted([c for c in range(64) if c % 8 >= 6] + [5, 13, 21])] * 3
            if tr == 1:
                _same_channel_result(x, 0.5, nv.global_scale_from_amax(x.float().abs().amax()))
        else:
            x = _rows(2, 16, torch.bfloat16, seed=16)
            for ratio in (0.0, 0.5, 1.0):
                _same_channel_result(x, ratio, nv.per_row_global_scale(x))
            x = _rows(2, 96, torch.float16, seed=7)
            w = torch.rand(96).to(_DEV)
            w[::3] = 0.0
            _same_channel_result(x, 0.4, nv.per_row_global_scale(x), score_weight=w)


@_needs_interp
@pytest.mark.parametrize("ra, at, rx", [(True, False, False), (False, True, False), (True, True, False),
                                         (True, True, True), (False, False, True)])
def test_triton_channel_compact_fewer_reductions_match_reference(ra, at, rx):
    """CHANNEL_CONFIG compact_rmax (R_sel's amax = the row's largest |R| where that entry is selected, else the
    reduction) keeps the reference's bytes in the warp-tile search (K = 256, forced at K >= 16): random rows (the
    shortcut), hand ties cut by channel, all-zero rows, rows whose residuals square to +0 (every score ties at 0, the
    largest |R| is NOT selected at k = 0.25: the reduction must run; a shortcut taken there changes the second-pass
    scale), ratios 0 / 1, a score weight (compact_rmax does not apply), a per-tensor scale (two launches), fp32 rows.
    compact_tile_chunks (at): rows whose tie runs put 60 / 120 / 180 candidates in the tile (its 2-, 4- and 8-chunk
    searches). Both together: the options of the K = 4096 default. rx: compact_many_regs (launches of more rows than
    its entry's, here 1 at K = 256) read x again after the search and recompute Q(x), R (the same values)."""
    from verl_quads.nvfp4 import triton_channel as tc

    many = dict(compact_many_regs={16: (1, 128)}) if rx else {}
    with tc.channel_config(compact_max_rows=1 << 30, compact_min_k=16, compact_rmax=ra, compact_tile_chunks=at,
                           **many):
        # blocks of |x| = 1.25 with one 6.0 (R = +-0.25: 15 tied scores per block) in 4 / 8 / 12 of 16 blocks, the
        # others zero (score 0): with k = 0.125 / 0.3 / 0.5 the threshold lies in the ties
        for nblk, ratio in ((4, 0.125), (8, 0.3), (12, 0.5)):
            xr = torch.zeros(2, 256)
            xr[:, : nblk * 16] = 1.25
            xr[:, : nblk * 16 : 16] = 6.0
            xr[1, 1 : nblk * 16 : 2] = -1.25
            xr = xr.to(torch.bfloat16).to(_DEV)
            t = _same_channel_result(xr, ratio, nv.per_row_global_scale(xr))
            assert t.channel_idx.shape[1] < nblk * 15 and int((t.channel_idx % 16 == 0).sum()) == 0
        assert tc._compact_args(3, 256, 16) == (12, 256, 2, True)
        x = _rows(3, 256, torch.bfloat16, seed=31)
        for ratio in (0.0, 0.25, 0.5, 1.0):
            _same_channel_result(x, ratio, nv.per_row_global_scale(x))
        _same_channel_result(x, 0.5, nv.global_scale_from_amax(x.float().abs().amax()))
        _same_channel_result(x, 0.4, nv.per_row_global_scale(x), score_weight=torch.rand(256).to(_DEV))
        xh = _HAND_X.repeat(1, 8).to(_DEV)
        t = _same_channel_result(xh, 24 / 256, nv.per_row_global_scale(xh))
        assert t.channel_idx[0, :9].tolist() == [1, 2, 3, 5, 17, 18, 19, 21, 33]
        g = torch.Generator().manual_seed(32)
        xt = (torch.randn(2, 256, generator=g) * 1e-25).to(torch.bfloat16).to(_DEV)  # R**2 underflows to +0
        xt[1, :8] = 0.0  # the first channels (the tie cut's) have R = 0: their R_sel amax is 0
        r = xt.float() - nv.fake_quantize(xt, nv.per_row_global_scale(xt), backend="torch").float()
        assert bool(((r * r) == 0).all()) and bool((r != 0).any())
        for ratio in (0.25, 0.5):
            _same_channel_result(xt, ratio, nv.per_row_global_scale(xt))
        _same_channel_result(torch.zeros(2, 256, device=_DEV, dtype=torch.bfloat16), 0.5,
                             torch.ones(2, 1, device=_DEV))
        xf = _rows(2, 256, torch.float32, seed=33)
        _same_channel_result(xf, 0.5, nv.per_row_global_scale(xf))


def test_triton_channel_compact_dispatch():
    """CHANNEL_CONFIG chooses the compacted search per launch: rows <= compact_max_rows and K >= compact_min_k (the
    default since session 16: any number of rows, K >= 2048); its tile is a power of two no longer than the padded row;
    bad bit counts are refused, naming the key."""
    from verl_quads.nvfp4 import triton_channel as tc

    assert tc._compact_args(16, 8192, 512) == (12, 256, 2, True) == tc._compact_args(256, 2048, 128)
    assert tc._compact_args(4096, 8192, 512) == (12, 256, 2, True)
    assert tc._compact_args(16, 1536, 128) is None
    with tc.channel_config(**tc.CHANNEL_VARIANTS["s15"]):
        assert tc._compact_args(257, 8192, 512) is None and tc._launch_warps(257, 8192, 512) == 16
    # 8 warps for a compacted launch at K = 8192 (measured), the elems_per_thread warps elsewhere
    assert tc._launch_warps(16, 8192, 512) == 8
    assert tc._launch_warps(16, 2048, 128) == 4 and tc._launch_warps(16, 16384, 1024) == 16
    with tc.channel_config(compact_max_rows=64, compact_min_k=1024, compact_bits=10, compact_cap=1000,
                           compact_tile_bits=1, compact_warp_tile=False):
        assert tc._compact_args(64, 8192, 512) == (10, 1024, 1, False)
        assert tc._compact_args(65, 8192, 512) is None and tc._compact_args(16, 768, 64) is None
    with tc.channel_config(compact_max_rows=64, compact_min_k=16, compact_cap=4096, compact_tile_bits=2,
                           compact_warp_tile=False, compact_bits=10):
        assert tc._compact_args(2, 48, 4) == (10, 64, 2, False)  # 4 padded blocks: 64 channels
    with tc.channel_config(compact_bits=31):
        with pytest.raises(ValueError, match=r"CHANNEL_CONFIG\['compact_bits'\] must be in \[1, 30\], got 31"):
            tc._compact_args(1, 8192, 512)
    with tc.channel_config(compact_tile_bits=3):
        with pytest.raises(ValueError, match=r"CHANNEL_CONFIG\['compact_tile_bits'\] must be 1 or 2, got 3"):
            tc._compact_args(1, 8192, 512)
    # more rows than compact_many_rows (the H200's SMs): 4 warps at K = 4096, 8 at 8192 (measured), other K as below
    assert tc._launch_warps(133, 4096, 256) == 4 and tc._launch_warps(132, 4096, 256) == 8
    assert tc._launch_warps(256, 8192, 512) == 8 == tc._launch_warps(132, 8192, 512)
    # compact_many_regs (session 17): x re-read + a 128-register cap past 264 rows at K = 4096, 132 at K = 8192
    assert tc._many_regs(264, 256) is None and tc._many_regs(265, 256) == 128
    assert tc._many_regs(132, 512) is None and tc._many_regs(133, 512) == 128 and tc._many_regs(4096, 128) is None
    assert tc._maxnreg(False, 8, compact=True, many_cap=128) == 128 == tc._maxnreg(True, 8, True, 128)
    assert tc._maxnreg(False, 8, compact=True) is None  # compact_maxnreg: uncapped
    with tc.channel_config(**tc.CHANNEL_VARIANTS["s16"]):
        assert tc._launch_warps(256, 8192, 512) == 4 and tc._many_regs(4096, 512) is None
    assert tc._launch_warps(4096, 4096, 256) == 4 and tc._launch_warps(4096, 2048, 128) == 4
    with tc.channel_config(**tc.CHANNEL_VARIANTS["s8"]):
        assert tc._launch_warps(133, 4096, 256) == 8
    with tc.channel_config(compact_max_rows=0):
        assert tc._compact_args(1, 8192, 512) is None
    with tc.channel_config(compact_min_k=16):
        assert tc._compact_args(16, 128, 8) is None  # shorter than the warp tile: the full-row search
    with tc.channel_config(compact_cap=1024):
        with pytest.raises(ValueError, match="compact_warp_tile'\\] needs compact_cap = 256"):
            tc._compact_args(16, 8192, 512)


from verl_quads.nvfp4 import triton_channel as _tc  # noqa: E402

if _tc.triton is not None:
    tl = _tc.tl

    @_tc.triton.jit
    def _search_kernel(eb_ptr, nsel_ptr, out_ptr, NVALID, N: tl.constexpr):
        """(th, cnt) of the channel kernel's threshold search ``_bits_threshold`` on row program_id(0) of eb int32
        [rows, N] (test only)."""
        row = tl.program_id(0)
        eb = tl.load(eb_ptr + row * N + tl.arange(0, N))
        nsel = tl.load(nsel_ptr + row)
        th, cnt = _tc._bits_threshold(eb, nsel, NVALID)
        tl.store(out_ptr + row * 2, th)
        tl.store(out_ptr + row * 2 + 1, cnt)


def _search_rows(n=64, nvalid=48, seed=0):
    """int32 score rows for the threshold search (entries >= 0, padding -1 after ``nvalid``) and each row's NSEL:
    random 31-bit values, a few values with many ties, values a few ulps apart around a random base, values around
    a carry (2**k - 1, 2**k, 2**k + 1), all zero, all one large value, the largest int32; NSEL random in
    [0, nvalid] plus 0, 1 and nvalid."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for kind in range(8):
        for _ in range(4):
            if kind == 0:
                v = torch.randint(0, 2**31 - 1, (nvalid,), generator=g)
            elif kind == 1:
                v = torch.randint(0, 4, (nvalid,), generator=g) * int(torch.randint(1, 2**20, (1,), generator=g))
            elif kind == 2:
                v = int(torch.randint(0, 2**30, (1,), generator=g)) + torch.randint(0, 6, (nvalid,), generator=g)
            elif kind == 3:
                k = int(torch.randint(1, 31, (1,), generator=g))
                v = 2**k + torch.randint(-1, 2, (nvalid,), generator=g)
            elif kind == 4:
                v = torch.zeros(nvalid, dtype=torch.int64)
            elif kind == 5:
                v = torch.full((nvalid,), int(torch.randint(1, 2**31 - 1, (1,), generator=g)))
            elif kind == 6:
                v = torch.randint(2**31 - 3, 2**31, (nvalid,), generator=g)
            else:  # float32 bit patterns of squares of bf16-like residuals (the kernel's scores)
                r = torch.randn(nvalid, generator=g).to(torch.bfloat16).float() * 2.0 ** -6
                v = (r * r).view(torch.int32).to(torch.int64)
            rows.append(torch.cat([v, torch.full((n - nvalid,), -1, dtype=torch.int64)]))
    eb = torch.stack(rows).to(torch.int32)
    nsel = torch.randint(0, nvalid + 1, (eb.shape[0],), generator=g, dtype=torch.int32)
    nsel[::4], nsel[1::4], nsel[2::4] = 0, 1, nvalid
    return eb, nsel


def test_triton_channel_threshold_search_keeps_its_contract():
    """The channel kernel's threshold search (``_bits_threshold``, early-stopped MSB-first; shared with the block
    rule) on adversarial int32 rows (``_search_rows``) returns (th, cnt) with cnt = #(eb >= th), and the kernel's
    selection from it (cnt == NSEL: eb >= th; else eb > th plus NSEL - #(eb > th) entries == th, which must exist)
    holds the NSEL highest values -- checked against a sort in Python."""
    if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1")
    eb, nsel = _search_rows()
    ebd, nseld = eb.to(_DEV), nsel.to(_DEV)
    out = torch.empty(eb.shape[0], 2, dtype=torch.int32, device=_DEV)
    _search_kernel[(eb.shape[0],)](ebd, nseld, out, 48, N=64)
    for r in range(eb.shape[0]):
        e, n = eb[r].tolist(), int(nsel[r])
        th, cnt = out[r].tolist()
        assert cnt == sum(v >= th for v in e), (r, th, cnt)
        if cnt == n:  # the caller's selection: eb >= th, else eb > th and the lowest `need` entries == th
            sel = [v for v in e if v >= th]
        else:
            need = n - sum(v > th for v in e)
            assert 0 <= need <= e.count(th), (r, n, th, cnt)
            sel = [v for v in e if v > th] + [th] * need
        assert sorted(sel) == sorted(e, reverse=True)[:n][::-1], (r, n, th, cnt)


_SM90_CHANNEL = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from verl_quads.nvfp4 import triton_channel as tc

sig = {"x_ptr": "*bf16", "gs_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*i16", "packed1_ptr": "*i64",
       "scale1_ptr": "*u8", "packed2_ptr": "*i64", "scale2_ptr": "*u8", "idx_ptr": "*i64", "gs2_ptr": "*fp32",
       "NB": "i32", "NSEL": "i32", "GS_DIV": "i32", "NBP": "constexpr", "HAS_W": "constexpr", "PACK": "constexpr",
       "OUT": "constexpr", "GS2": "constexpr", "ROW_GS": "constexpr", "STOP": "constexpr", "scr_ptr": "*i32",
       "COMPACT": "constexpr", "CAP": "constexpr", "TR": "constexpr", "WT": "constexpr", "RA": "constexpr",
       "AT": "constexpr", "RX": "constexpr", "SAMPLE": "constexpr", "NSS": "i32", "SP": "constexpr", "SB": "constexpr",
       "TIN": "constexpr", "th_ptr": "*i32", "DG": "constexpr", "PK": "constexpr", "FULLB": "constexpr",
       "MS": "constexpr"}
OFF35 = {"DG": False, "PK": False, "FULLB": False, "MS": False}  # session 35's channel_sampled options, off / on
ON35 = {"DG": True, "PK": True, "FULLB": True, "MS": True}
# the last fields: (COMPACT bits, CAP) of the compacted search (0, 1: the full-row search; 8 bits: with 2 tile bits per
# step, TR = 2; 11 bits: the warp tile, WT, with session 10's candidate chunks (AT) and R_sel amax (RA); 12 bits: the
# same with session 17's many-row form, x re-read after the search (RX))
for xt, ot, pack, out, gs2, has_w, nbp, nw, maxnreg, row_gs, stop, comp, cap in (
        ("*bf16", "*i16", False, 3, 0, False, 128, 4, 64, False, 0, 0, 1),
        ("*bf16", "*i64", True, 0, 0, True, 512, 16, 64, False, 0, 0, 1),
        ("*fp16", "*fp16", False, 2, 1, True, 1, 1, None, False, 0, 0, 1),
        ("*fp32", "*fp32", False, 0, 2, False, 64, 2, 64, False, 0, 0, 1),
        ("*bf16", "*i64", True, 0, 0, False, 64, 2, None, False, 0, 0, 1),
        ("*bf16", "*i16", False, 3, 0, False, 512, 16, 64, True, 0, 0, 1),
        ("*bf16", "*i64", True, 0, 0, False, 128, 4, None, True, 0, 0, 1),
        ("*bf16", "*i16", False, 3, 0, False, 512, 16, 64, False, 3, 0, 1),  # a timing probe (bench --channel-probe)
        ("*bf16", "*i16", False, 3, 0, False, 512, 16, None, True, 0, 10, 1024),  # the compacted search (decode)
        ("*bf16", "*i64", True, 0, 0, True, 512, 16, 64, True, 0, 8, 1024),
        ("*fp32", "*fp32", False, 0, 2, False, 128, 4, None, False, 0, 12, 512),
        ("*bf16", "*i16", False, 3, 0, False, 512, 8, None, True, 5, 11, 256),  # the warp tile (WT), a probe
        ("*bf16", "*i64", True, 0, 0, True, 512, 8, None, True, 0, 11, 256),
        ("*bf16", "*i16", False, 3, 0, False, 512, 16, None, True, 2, 10, 1024),
        ("*bf16", "*i16", False, 3, 0, False, 512, 8, 128, True, 0, 12, 256),
        ("*bf16", "*i64", True, 0, 0, False, 256, 4, 128, True, 0, 12, 256)):
    s = dict(sig, x_ptr=xt, out_ptr=ot)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(s) if s[n][0] == "*" or n == "NB"}
    k = triton.compile(ASTSource(fn=tc._channel_row_kernel, signature=s, attrs=attrs, constexprs={
        "NBP": nbp, "HAS_W": has_w, "PACK": pack, "OUT": out, "GS2": gs2, "ROW_GS": row_gs, "STOP": stop,
        "COMPACT": comp, "CAP": cap, "TR": 2 if comp in (8, 11, 12) else 1, "WT": comp in (11, 12),
        "RA": comp in (11, 12) and not has_w, "AT": comp in (11, 12), "RX": comp == 12, "SAMPLE": False, "SP": 1,
        "SB": 2, "TIN": False, **OFF35}),
        target=GPUTarget("cuda", 90, 32), options={"num_warps": nw, "enable_fp_fusion": False, "maxnreg": maxnreg})
    assert k.asm["cubin"]
    # the compacted search's tile round trip: scratch stores, a barrier, scratch loads
    assert not comp or ("bar.sync" in k.asm["ptx"] and "st.global.b32" in k.asm["ptx"]), (comp, cap)
    # values and codes carry signs by OR-ing bits: a float negation would be 0.0 - v under triton 3.6 (+0.0 for -0.0)
    neg = re.findall(r"fneg|fsub (?:<\d+ x )?float>? (?:zeroinitializer|-?0\.000000e\+00)", k.asm["llir"])
    assert not neg, (xt, pack, maxnreg, neg[:3])
# granularity="channel_sampled" (SAMPLE): one / two / four / sixteen samples per block, 2 or 3 bits per search step,
# the int64 counts past 512 blocks, R_sel's amax from the row's largest |R| (RA); session 35's options (digit counts,
# the sample pick tree, no block masks, R_sel by a bit mask) on and off
for xt, ot, pack, nbp, nw, maxnreg, sp, sb, ra, opts in (
        ("*bf16", "*i16", False, 512, 8, 128, 1, 2, True, ON35),
        ("*bf16", "*i16", False, 512, 8, 128, 1, 2, True, OFF35),
        ("*bf16", "*i16", False, 256, 4, 128, 2, 2, True, ON35),
        ("*bf16", "*i16", False, 256, 4, 128, 2, 3, True, ON35),
        ("*bf16", "*i16", False, 256, 4, 128, 2, 3, True, OFF35),
        ("*bf16", "*i64", True, 128, 4, None, 4, 2, False, ON35),
        ("*fp32", "*fp32", False, 4, 1, None, 16, 2, False, OFF35),
        ("*bf16", "*i16", False, 1024, 16, 64, 1, 2, True, ON35)):
    s = dict(sig, x_ptr=xt, out_ptr=ot, idx_ptr="*u8" if pack else "*i64")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(s) if s[n][0] == "*" or n == "NB"}
    k = triton.compile(ASTSource(fn=tc._channel_row_kernel, signature=s, attrs=attrs, constexprs={
        "NBP": nbp, "HAS_W": False, "PACK": pack, "OUT": 0 if pack else 3, "GS2": 0, "ROW_GS": True, "STOP": 0,
        "COMPACT": 0, "CAP": 1, "TR": 1, "WT": False, "RA": ra, "AT": False, "RX": False, "SAMPLE": True, "SP": sp,
        "SB": sb, "TIN": False, **opts}), target=GPUTarget("cuda", 90, 32),
        options={"num_warps": nw, "enable_fp_fusion": False, "maxnreg": maxnreg})
    assert k.asm["cubin"]
    neg = re.findall(r"fneg|fsub (?:<\d+ x )?float>? (?:zeroinitializer|-?0\.000000e\+00)", k.asm["llir"])
    assert not neg, (xt, pack, nbp, neg[:3])
# the split search (session 28): the sampled scores, the batched search (10-bit / 16-bit count fields), the row kernel
# reading the thresholds (TIN)
for xt, nbp, sp, has_w, row_gs, nw in (("*bf16", 512, 1, False, True, 8), ("*fp32", 256, 2, True, False, 4),
                                       ("*fp16", 4, 16, False, True, 1)):
    s = {"x_ptr": xt, "gs_ptr": "*fp32", "w_ptr": "*fp32", "samp_ptr": "*i32", "NB": "i32", "GS_DIV": "i32",
         "NBP": "constexpr", "SP": "constexpr", "HAS_W": "constexpr", "ROW_GS": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(s) if s[n][0] == "*" or n == "NB"}
    k = triton.compile(ASTSource(fn=tc._sample_scores_kernel, signature=s, attrs=attrs, constexprs={
        "NBP": nbp, "SP": sp, "HAS_W": has_w, "ROW_GS": row_gs}), target=GPUTarget("cuda", 90, 32),
        options={"num_warps": nw, "enable_fp_fusion": False})
    assert k.asm["cubin"]
    neg = re.findall(r"fneg|fsub (?:<\d+ x )?float>? (?:zeroinitializer|-?0\.000000e\+00)", k.asm["llir"])
    assert not neg, (xt, nbp, neg[:3])
for spad, rows, nw, dg in ((512, 8, 4, False), (2048, 4, 4, True), (64, 1, 1, False), (512, 1, 1, True)):
    s = {"samp_ptr": "*i32", "th_ptr": "*i32", "M": "i32", "S": "i32", "NSS": "i32", "SPAD": "constexpr",
         "ROWS": "constexpr", "DG": "constexpr"}
    k = triton.compile(ASTSource(fn=tc._sample_search_kernel, signature=s,
                                 constexprs={"SPAD": spad, "ROWS": rows, "DG": dg}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})
    assert k.asm["cubin"]
for pack in (False, True):
    s = dict(sig, out_ptr="*i64" if pack else "*i16", idx_ptr="*u8" if pack else "*i64")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(s) if s[n][0] == "*" or n == "NB"}
    k = triton.compile(ASTSource(fn=tc._channel_row_kernel, signature=s, attrs=attrs, constexprs={
        "NBP": 512, "HAS_W": False, "PACK": pack, "OUT": 0 if pack else 3, "GS2": 0, "ROW_GS": True, "STOP": 0,
        "COMPACT": 0, "CAP": 1, "TR": 1, "WT": False, "RA": False, "AT": False, "RX": False, "SAMPLE": True, "SP": 1,
        "SB": 2, "TIN": True, **(ON35 if pack else OFF35)}), target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 8, "enable_fp_fusion": False, "maxnreg": 128})
    assert k.asm["cubin"]
print("compiled")
"""


def test_triton_channel_register_caps_per_launch_kind():
    """CHANNEL_CONFIG's caps: QDQ launches capped, packed launches only from pack_maxnreg_min_warps warps (the H200
    measured the packed cap slower with 1-4 warps); the "uncapped" variant and None leave the compiler's choice."""
    from verl_quads.nvfp4 import triton_channel as tc

    c = tc.CHANNEL_CONFIG
    assert tc._maxnreg(False, 4) == c["qdq_maxnreg"] == 64
    assert tc._maxnreg(True, c["pack_maxnreg_min_warps"]) == c["pack_maxnreg"] == 64
    assert tc._maxnreg(True, c["pack_maxnreg_min_warps"] // 2) is None
    with tc.channel_config(**tc.CHANNEL_VARIANTS["uncapped"]):
        assert tc._maxnreg(False, 16) is None and tc._maxnreg(True, 16) is None
    with pytest.raises(KeyError, match="unknown CHANNEL_CONFIG keys"):
        with tc.channel_config(maxnreg=64):
            pass


def test_triton_channel_kernel_compiles_for_sm90_without_a_gpu():
    from sm90_compile import compile_for_sm90_in_subprocess

    compile_for_sm90_in_subprocess(_SM90_CHANNEL, "on a GPU the channel kernel is compiled and run by the other tests")


def _rel_gemm_err(xq, x, w):
    return float(((xq.float() - x.float()) @ w.T).norm() / (x.float() @ w.T).norm())


def test_channel_rule_beats_the_block_rule_on_gaussian_activations():
    """Relative GEMM output error at equal ratio (the same number of compensated channels per row)."""
    g = torch.Generator().manual_seed(0)
    m, k, n = 128, 1024, 256
    w = torch.randn(n, k, generator=g) / k**0.5
    x = torch.randn(m, k, generator=g)
    gs = nv.per_row_global_scale(x)
    naive = _rel_gemm_err(nv.fake_quantize(x, gs, backend="torch"), x, w)
    for ratio in (0.25, 0.5):
        blk = _rel_gemm_err(_fq(x, ratio, "block"), x, w) / naive
        ch = _rel_gemm_err(_fq(x, ratio), x, w) / naive
        # measured (this seed, error / naive): k=0.25 block 0.759 / channel 0.458; k=0.5 block 0.558 / channel 0.251
        assert ch < 0.85 * blk < 1.0, (ratio, blk, ch)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=_needs_interp)])
@pytest.mark.parametrize("gran", ["block", "channel"])
def test_residual_amax_row_is_per_row_global_scale(backend, gran):
    """``amax="row"`` (the rollout's per-token convention; in the channel kernel derived on chip) gives the bytes of
    passing ``per_row_global_scale(x)``, for both rules and backends; ``global_scale`` and ``amax`` together or an
    unknown amax string are errors naming the argument."""
    x = _rows(4, 64, torch.bfloat16, seed=21)
    gs = nv.per_row_global_scale(x)
    a = nv.residual_quantize(x, 0.5, amax="row", granularity=gran, backend=backend)
    b = nv.residual_quantize(x, 0.5, gs, granularity=gran, backend="torch")
    for p, q in ((a.first, b.first), (a.second, b.second)):
        assert torch.equal(p.packed, q.packed) and _bytes_eq(p.block_scale, q.block_scale)
        assert _bytes_eq(p.global_scale, q.global_scale)
    assert _bytes_eq(nv.residual_fake_quantize(x, 0.5, amax="row", granularity=gran, backend=backend),
                     nv.residual_fake_quantize(x, 0.5, gs, granularity=gran, backend="torch"))
    with pytest.raises(ValueError, match="pass global_scale or amax, not both"):
        nv.residual_fake_quantize(x, 0.5, gs, amax="row", granularity=gran, backend=backend)
    with pytest.raises(ValueError, match="amax must be a tensor or 'row', got 'rows'"):
        nv.residual_quantize(x, 0.5, amax="rows", granularity=gran, backend=backend)
