"""QUADS residual compensation with ``granularity="channel_sampled"`` (session 27): the channel rule whose per-row
threshold is the n_s-th highest score of a fixed sample of the row (verl_quads/nvfp4/residual.py) and its Triton
kernel (verl_quads/nvfp4/triton_channel.py, SAMPLE launches; compared bit for bit with the reference, on CPU under
TRITON_INTERPRET=1).

Sample positions and ranks below are written out by hand from the rule's definition; expected selections come from
an independent Python loop over the scores (sorted lists, no torch.topk), never from the code under test."""

from __future__ import annotations

import math

import pytest
import torch

import verl_quads.nvfp4 as nv
from test_nvfp4_residual_channel import _DEV, _bytes_eq, _needs_interp, _rows  # the channel rule's test fixtures
from verl_quads.nvfp4 import residual as res

_G = "channel_sampled"


def test_sample_positions_and_threshold_rank_by_hand():
    # K = 32: 2 blocks -> 16 samples per block (the whole row), block 1 starts at its position 1
    assert res.samples_per_block(32) == 16
    assert res.sample_channels(32).tolist() == list(range(16)) + [17 + i for i in range(15)] + [16]
    # K = 2048: 128 blocks -> 4 per block at positions (b + 0 / 4 / 8 / 12) mod 16
    assert res.samples_per_block(2048) == 4
    assert res.sample_channels(2048)[:8].tolist() == [0, 4, 8, 12, 17, 21, 25, 29]
    assert res.sample_channels(2048)[-4:].tolist() == [127 * 16 + 15, 127 * 16 + 3, 127 * 16 + 7, 127 * 16 + 11]
    # K = 768: 48 blocks, padded to 64 -> 8 per block (384 samples); K = 8192: one per block (512)
    assert res.samples_per_block(768) == 8 and res.sample_channels(768).numel() == 384
    s = res.sample_channels(8192)
    assert res.samples_per_block(8192) == 1 and s.numel() == 512
    assert s[:3].tolist() == [0, 17, 34] and s[16].item() == 256 and s[17].item() == 273
    # n_s = round(k * S) half away from zero, >= 1 when any channel is selected, 0 when none
    assert res.num_sampled_threshold_rank(8192, 0.5) == 256
    assert res.num_sampled_threshold_rank(2048, 0.25) == 128
    assert res.num_sampled_threshold_rank(768, 0.5) == 192
    assert res.num_sampled_threshold_rank(16, 0.5) == 8
    assert res.num_sampled_threshold_rank(8192, 0.001) == 1  # n_sel = 8, k * S = 0.512 -> 1
    assert res.num_sampled_threshold_rank(8192, 1e-6) == 0  # n_sel = round(0.008) = 0: nothing
    assert res.num_sampled_threshold_rank(8192, 1.0) == 512


def _expected_mask(x, ratio, gs, w=None):
    """Independent selection: per row, the n_s-th highest sampled score by a sorted Python list; channels >= it."""
    r = x.float() - nv.dequantize(nv.quantize(x, gs, backend="torch"), torch.float32)
    score = r.square() * (w if w is not None else 1.0)
    m, k = score.shape
    n_sel = math.floor(ratio * k + 0.5)
    nb = k // 16
    nbp = 1 << max(0, (nb - 1).bit_length())
    p = min(16, max(1, 512 // nbp))
    pos = [16 * b + (b + i * (16 // p)) % 16 for b in range(nb) for i in range(p)]
    out = torch.zeros(m, k, dtype=torch.bool)
    for row in range(m):
        vals = score[row].tolist()
        if n_sel == 0:
            continue
        if n_sel == k:
            out[row] = True
            continue
        n_s = min(len(pos), max(1, math.floor(ratio * len(pos) + 0.5)))
        t = sorted((vals[c] for c in pos), reverse=True)[n_s - 1]
        out[row] = torch.tensor([v >= t for v in vals])
    return out, r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_matches_an_independent_selection_and_second_pass(dtype):
    for m, k, ratio in ((4, 2048, 0.5), (3, 768, 0.25), (3, 64, 0.5), (2, 8192, 0.3)):
        x = _rows(m, k, dtype, seed=k).cpu()
        gs = nv.per_row_global_scale(x)
        w = torch.rand(k) if k == 768 else None
        got = nv.residual_quantize(x, ratio, gs, granularity=_G, backend="torch", score_weight=w)
        assert isinstance(got, nv.SampledChannelResidualNVFP4) and got.granularity == _G
        mask, r = _expected_mask(x, ratio, gs, w)
        assert torch.equal(got.selected, mask), (k, ratio)
        r_sel = torch.where(mask, r, torch.zeros(()))
        gs2 = nv.global_scale_from_amax(r_sel.abs().amax(dim=-1, keepdim=True))
        q2 = nv.quantize(r_sel, gs2, backend="torch")
        assert torch.equal(got.second.packed, q2.packed) and torch.equal(got.second.global_scale, gs2)
        want = (nv.dequantize(nv.quantize(x, gs, backend="torch"), torch.float32)
                + nv.dequantize(q2, torch.float32)).to(dtype)
        assert torch.equal(nv.residual_fake_quantize(x, ratio, gs, granularity=_G, backend="torch", score_weight=w)
                           .view(torch.uint8), want.view(torch.uint8))


def test_ratio_ends_short_rows_and_the_selected_fraction():
    x = _rows(3, 256, torch.bfloat16, seed=1).cpu()
    gs = nv.per_row_global_scale(x)
    # ratio 0: the naive activation; ratio 1: the exact channel rule's bytes (everything selected)
    assert torch.equal(nv.residual_fake_quantize(x, 0.0, gs, granularity=_G, backend="torch"),
                       nv.fake_quantize(x, gs, backend="torch"))
    assert torch.equal(nv.residual_fake_quantize(x, 1.0, gs, granularity=_G, backend="torch"),
                       nv.residual_fake_quantize(x, 1.0, gs, granularity="channel", backend="torch"))
    # K <= 512: the sample is the whole row and n_s = n_sel, so rows without tied scores select what the exact
    # channel rule selects
    xf = torch.randn(4, 512, generator=torch.Generator().manual_seed(2))
    g = nv.per_row_global_scale(xf)
    a = nv.residual_quantize(xf, 0.3, g, granularity=_G, backend="torch")
    b = nv.residual_quantize(xf, 0.3, g, granularity="channel", backend="torch")
    assert torch.equal(a.selected, b.selected) and torch.equal(a.second.packed, b.second.packed)
    # long rows: about ratio * K channels per row (a sample quantile), measured here 0.465-0.535 at K = 8192
    xl = torch.randn(64, 8192, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    xl[:, ::293] *= 30
    frac = nv.residual_quantize(xl, 0.5, nv.per_row_global_scale(xl), granularity=_G,
                                backend="torch").selected.float().mean(-1)
    assert abs(float(frac.mean()) - 0.5) < 0.02 and float(frac.min()) > 0.4 and float(frac.max()) < 0.6


def test_sampled_rule_errors_like_the_exact_rule_on_gaussian_activations():
    """Relative GEMM output error at equal ratio; measured (this seed, error / exact rule's): ~1.00 at both k."""
    g = torch.Generator().manual_seed(0)
    m, k, n = 128, 4096, 256
    w = torch.randn(n, k, generator=g) / k**0.5
    x = torch.randn(m, k, generator=g)
    gs = nv.per_row_global_scale(x)

    def err(xq):
        return float(((xq.float() - x) @ w.T).norm() / (x @ w.T).norm())

    naive = err(nv.fake_quantize(x, gs, backend="torch"))
    for ratio in (0.25, 0.5):
        exact = err(nv.residual_fake_quantize(x, ratio, gs, granularity="channel", backend="torch"))
        sampled = err(nv.residual_fake_quantize(x, ratio, gs, granularity=_G, backend="torch"))
        assert sampled < 1.03 * exact < naive, (ratio, naive, exact, sampled)


def test_errors_name_the_rule():
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match=r"granularity='channel_sampled' selects channels per token"):
        nv.residual_quantize(x, 0.5, per_token=False, granularity=_G, backend="torch")
    with pytest.raises(ValueError, match="channel_sampled"):
        nv.residual_quantize(x, 0.5, granularity="chanel", backend="torch")
    from verl_quads.config import QuantConfig

    assert QuantConfig("quads", residual_granularity=_G).residual_granularity == _G
    with pytest.raises(ValueError, match=r"residual_granularity='channel_sampled' \(the default\) selects channels per "
                                         r"token"):
        QuantConfig("quads", residual_granularity=_G, residual_per_token=False)


# ---- the Triton kernel: the reference's bytes ---------------------------------------------------------------------

def _same(x, ratio, gs, **kw):
    """Triton vs torch reference: both passes' codes, scale bytes, global scales, the selection mask, the QDQ output
    (and with a per-row scale the same with amax="row", the scale derived in the kernel)."""
    t = nv.residual_quantize(x, ratio, gs, granularity=_G, backend="triton", **kw)
    r = nv.residual_quantize(x, ratio, gs, granularity=_G, backend="torch", **kw)
    assert isinstance(t, nv.SampledChannelResidualNVFP4)
    for a, b in ((t.first, r.first), (t.second, r.second)):
        assert torch.equal(a.packed, b.packed), (ratio, (a.packed != b.packed).nonzero()[:5].tolist())
        assert _bytes_eq(a.block_scale, b.block_scale) and _bytes_eq(a.global_scale, b.global_scale)
    assert t.selected.dtype == torch.bool and torch.equal(t.selected, r.selected), ratio
    fr = nv.residual_fake_quantize(x, ratio, gs, granularity=_G, backend="torch", **kw)
    assert _bytes_eq(nv.residual_fake_quantize(x, ratio, gs, granularity=_G, backend="triton", **kw), fr)
    if gs is not None and gs.dim() == 2 and gs.shape[0] == x.shape[0] > 1:
        ta = nv.residual_quantize(x, ratio, amax="row", granularity=_G, backend="triton", check_finite=False, **kw)
        assert torch.equal(ta.selected, r.selected) and torch.equal(ta.second.packed, r.second.packed)
        assert _bytes_eq(nv.residual_fake_quantize(x, ratio, amax="row", granularity=_G, backend="triton", **kw), fr)
    return t


@_needs_interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_sampled_kernel_matches_reference(dtype):
    # K = 16 / 48 (whole row sampled, 3 blocks padded to 4), 1024 (8 per block), 2048 (4 per block)
    for k, m, ratios in ((16, 3, (0.0, 0.5, 1.0)), (48, 3, (0.125, 0.5)), (1024, 2, (0.5,)), (2048, 2, (0.25,))):
        x = _rows(m, k, dtype, seed=k)
        for ratio in ratios:
            _same(x, ratio, nv.per_row_global_scale(x))


@_needs_interp
def test_triton_sampled_kernel_ties_weights_scale_layouts_and_rows():
    _ties_weights_scale_layouts_and_rows()


def _ties_weights_scale_layouts_and_rows():
    # ties: x = +-1.25 with one 6.0 per block (row amax 6: the grid is exact; 6.0 -> R = 0, +-1.25 -> R = -+0.25):
    # 60 scores of 1/16 and 4 of 0; the whole row is the sample and its 19th highest (round(.3 * 64)) is a tie at
    # 1/16, so all 60 are selected (the exact rule takes the lowest 19)
    xt = torch.full((3, 64), 1.25, device=_DEV)
    xt[:, ::16] = 6.0
    xt[1] = torch.tensor([1.25, -1.25] * 32)
    xt[1, ::16] = 6.0
    t = _same(xt, 0.3, nv.per_row_global_scale(xt))
    assert t.selected.sum(-1).tolist() == [60, 60, 60]
    x = _rows(5, 96, torch.bfloat16, seed=7)
    w = torch.rand(96).to(_DEV)
    w[::3] = 0.0
    _same(x, 0.4, nv.per_row_global_scale(x), score_weight=w)
    t = _same(x, 0.4, nv.global_scale_from_amax(x.float().abs().amax()))  # per tensor: two launches
    assert t.second.global_scale.dim() == 0
    _same(x, 0.25, None)
    _same(x[1:2], 0.25, nv.per_row_global_scale(x[1:2]))
    _same(x[:0], 0.5, nv.per_row_global_scale(x[:0]))  # no rows: nothing launched
    # a row's result does not depend on its batch mates
    full = nv.residual_fake_quantize(x, 0.5, amax="row", granularity=_G, backend="triton")
    assert _bytes_eq(full[2:4], nv.residual_fake_quantize(x[2:4], 0.5, amax="row", granularity=_G, backend="triton"))


@_needs_interp
@pytest.mark.parametrize("variant", ["default", "sampled first", "sampled b3", "sampled split", "s34",
                                     "sampled no digits", "sampled no pick", "sampled masked", "s34 b3",
                                     "sampled where"])
def test_triton_sampled_launch_variants_match_reference(variant):
    """The CHANNEL_CONFIG sample_* options timed on the H200 (the default: R_sel's amax from the row's largest |R| at
    K = 4096 / 8192, the search steps' counts from each sample's digit, the samples picked by a select tree, no block
    masks where K / 16 is a power of two, R_sel by a bit mask; the first launch without the amax shortcut; three bits
    per search step; the split search; session 34's launch and each session-35 option off) give the same bytes, at
    one, two and eight samples per block, past 512 samples (K = 16384: 1024 samples, the 16-bit count fields), with
    ties and score weights."""
    from verl_quads.nvfp4 import triton_channel as tc

    with tc.channel_config(**tc.CHANNEL_VARIANTS[variant]):
        for k, ratio in ((8192, 0.5), (1024, 0.0), (1024, 1.0), (1024, 0.125)):
            x = _rows(2, k, torch.bfloat16, seed=k + 1)
            _same(x, ratio, nv.per_row_global_scale(x))
        x = _rows(2, 256, torch.float32, seed=5)
        _same(x, 0.5, nv.per_row_global_scale(x), score_weight=torch.rand(256).to(_DEV))  # no max-|R| shortcut
        if variant != "sampled first":
            for k in (16384, 4096):  # one / two samples per block (the picked ones)
                x = _rows(2, k, torch.bfloat16, seed=k + 7)
                _same(x, 0.5, nv.per_row_global_scale(x))
            _ties_weights_scale_layouts_and_rows()


@_needs_interp
@pytest.mark.parametrize("search_rows", [1, 8, 16])
def test_triton_sampled_split_search_matches_reference(search_rows):
    """The split search (CHANNEL_CONFIG sample_split_rows: the sampled scores by one kernel, the thresholds of
    ``sample_search_rows`` rows per program by a second, the fused kernel reading them): the same bytes for ties, a
    score weight, per-tensor / per-row / derived scales, one row, 1 / 2 / 8 / 16 samples per block, k at its ends
    (no split: nothing to search), and batches whose rows finish their searches at different steps."""
    from verl_quads.nvfp4 import triton_channel as tc

    with tc.channel_config(sample_split_rows=0, sample_search_rows=search_rows):
        _ties_weights_scale_layouts_and_rows()
        for k, m, ratio in ((8192, 3, 0.5), (4096, 9, 0.25), (1024, 17, 0.5), (16 * 33, 5, 0.75), (48, 4, 1.0)):
            x = _rows(m, k, torch.bfloat16, seed=k + m)
            _same(x, ratio, nv.per_row_global_scale(x))
        x = _rows(6, 256, torch.float16, seed=3)
        x[2] = 0.0  # every score 0: the threshold search runs all 31 bits (T = 0, every channel selected)
        t = _same(x, 0.5, nv.per_row_global_scale(x))
        assert t.selected[2].all() and not t.selected[1].all()


def test_triton_sampled_split_routing():
    """Where the split search runs (the H200 measured it faster at K = 8192 past 1024 rows only), and the variants."""
    from verl_quads.nvfp4 import triton_channel as tc

    assert tc._split(1025, 512) and not tc._split(1024, 512)
    assert not tc._split(4096, 256) and not tc._split(4096, 1024)
    with tc.channel_config(**tc.CHANNEL_VARIANTS["sampled split"]):
        assert tc._split(1, 256) and tc._split(1, 512)
    with tc.channel_config(**tc.CHANNEL_VARIANTS["sampled fused"]):
        assert not tc._split(1 << 20, 512)


@_needs_interp
def test_triton_sampled_split_config_errors():
    from verl_quads.nvfp4 import triton_channel as tc

    x = torch.randn(4, 64, device=_DEV)
    with tc.channel_config(sample_split_rows=0, sample_search_rows=6):
        with pytest.raises(ValueError, match=r"sample_search_rows'\] must be a power of two"):
            nv.residual_fake_quantize(x, 0.5, amax="row", granularity=_G, backend="triton")


@pytest.mark.parametrize("combine", ["fp4x2", "bf16"])
def test_rollout_triton_backend_runs_the_sampled_rule(monkeypatch, combine):
    """The vLLM linear method with backend="triton" and residual_granularity="channel_sampled": the output is the
    NVFP4 GEMM over the core's operand (bf16: the rule's QDQ form; fp4x2: Q(x) and the dense Q(R_sel)) and close to
    the torch backend's; at K = 96 the whole row is the sample, so (no tied scores here) it equals the exact channel
    rule's output."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1")
    from test_rollout_triton_backend import _close, _linear_layer

    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.rollout.emulation import ActQuant
    from verl_quads.rollout.linear import QuadsNVFP4LinearMethod

    layer = _linear_layer()
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    x[..., 7] *= 20
    act = ActQuant("quads", 0.25, True, residual_combine=combine, residual_granularity=_G)
    y = {b: QuadsNVFP4LinearMethod(act, b).apply(layer, x, None) for b in ("torch", "triton")}
    _close(y["triton"], y["torch"], f"linear sampled combine={combine}")
    x2 = x.reshape(-1, 96)
    gs = nv.per_row_global_scale(x2)
    w = (layer.weight_packed, layer.weight_scale, layer.weight_global_scale)
    if combine == "bf16":
        op = tg.ActOperand("w4a16", x.dtype, values=nv.residual_fake_quantize(x2, 0.25, gs, granularity=_G,
                                                                             backend="torch"))
    else:
        r = nv.residual_quantize(x2, 0.25, gs, granularity=_G, backend="torch")
        op = tg.ActOperand("quads", x.dtype, first=nv.NVFP4Tensor(r.first.packed, r.first.block_scale, gs,
                                                                  r.first.shape, r.first.dtype),
                           second_packed=r.second.packed, second_scale=r.second.block_scale,
                           second_gs=r.second.global_scale.reshape(-1))
    assert torch.equal(y["triton"], tg.nvfp4_gemm(op, *w, None).reshape(2, 3, -1))
    exact = QuadsNVFP4LinearMethod(ActQuant("quads", 0.25, True, residual_combine=combine,
                                            residual_granularity="channel"), "triton").apply(layer, x, None)
    assert torch.equal(y["triton"], exact)
