"""Triton kernels at realistic shapes on a CUDA GPU (the H200): same bytes as the torch reference,
and the torch reference on CUDA gives the same bytes as on CPU."""

import pytest
import torch

import verl_quads.nvfp4 as nv
from verl_quads.nvfp4 import triton_channel as tc
from verl_quads.nvfp4 import triton_kernels as tk

pytestmark = pytest.mark.gpu

#: quantize / QDQ kernel variants (triton_kernels.KERNELS + the v2 E2M1 formulation)
#: (kernel, E2M1 formulation, bf16 store) with KERNELS["bf16_store"]: "native" = the GPU's cvt.rn
QUANT_VARIANTS = {"v1": ("v1", None, "native"), "v2-float-e2m1": ("v2", True, "native"),
                  "v2-int-e2m1": ("v2", False, "native"), "v2-float-e2m1-int-bf16-store": ("v2", True, "int")}


@pytest.fixture(params=list(QUANT_VARIANTS))
def quant_variant(request, monkeypatch):
    kern, fp, store = QUANT_VARIANTS[request.param]
    monkeypatch.setitem(tk.KERNELS, "quantize", kern)
    monkeypatch.setitem(tk.KERNELS, "fake_quantize", kern)
    monkeypatch.setitem(tk.KERNELS, "bf16_store", store)
    if fp is not None:
        monkeypatch.setitem(tk.QUANT2_CONFIG, "quantize", dict(tk.QUANT2_CONFIG["quantize"], fp=fp))
    return request.param


#: per-token residual kernels: "row", "auto" (the default: RESIDUAL_BY_BLOCKS per row length),
#: "gather-int-bf16-store" (KERNELS "gather": TILED_CONFIG["gather"]) and every named tile variant of the gather
#: kernel (triton_kernels.RESIDUAL_VARIANTS: the ones RESIDUAL_BY_BLOCKS uses; the others removed in session 10)
RESIDUAL_KERNELS = ["row", "auto", "gather-int-bf16-store"] + list(tk.RESIDUAL_VARIANTS)


@pytest.fixture(params=RESIDUAL_KERNELS)
def residual_kernel(request, monkeypatch):
    if request.param in tk.RESIDUAL_VARIANTS:
        kern, over = tk.RESIDUAL_VARIANTS[request.param]
        monkeypatch.setitem(tk.TILED_CONFIG, kern, dict(tk.TILED_CONFIG[kern], **over))
    else:
        kern = request.param.split("-")[0]
    monkeypatch.setitem(tk.KERNELS, "residual_per_token", kern)
    monkeypatch.setitem(tk.KERNELS, "bf16_store", "int" if request.param.endswith("int-bf16-store") else "native")
    return request.param


def _x(m, k, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) / torch.rand(m, k, device="cuda", generator=g).clamp(min=0.02)
    x[:, ::512] *= 40
    return x.to(dtype)


def _eq(a, b):
    return torch.equal(a.packed, b.packed) and torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))


def _same_bytes(a, b):
    """Float tensors equal bit for bit (torch.equal on floats takes -0.0 == +0.0: triton 3.6 lowers a float
    negation to 0.0 - v, which wrote +0.0 for code 8 where the reference has -0.0)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_large_quantize_qdq_bit_exact(dtype, quant_variant):
    x = _x(8192, 8192, dtype)
    for gs in (None, nv.global_scale_from_amax(x.float().abs().amax(-1, keepdim=True))):
        qt = nv.quantize(x, gs, backend="triton")
        qr = nv.quantize(x, gs, backend="torch")
        assert _eq(qt, qr)
        assert _same_bytes(nv.dequantize(qt, dtype, backend="triton"), nv.dequantize(qr, dtype, backend="torch"))
        assert _same_bytes(nv.fake_quantize(x, gs, backend="triton"), nv.fake_quantize(x, gs, backend="torch"))


def test_cuda_reference_equals_cpu_reference():
    x = _x(1024, 4096, torch.bfloat16)
    a, b = nv.quantize(x, backend="torch"), nv.quantize(x.cpu(), backend="torch")
    assert torch.equal(a.packed.cpu(), b.packed)
    assert torch.equal(a.block_scale.view(torch.uint8).cpu(), b.block_scale.view(torch.uint8))


def _eq_residual(rt, rr):
    assert torch.equal(rt.block_idx, rr.block_idx), (rt.block_idx != rr.block_idx).float().mean().item()
    assert _eq(rt.first, rr.first) and _eq(rt.second, rr.second)
    assert torch.equal(rt.second.global_scale, rr.second.global_scale)


def test_per_expert_scales_and_narrow_rows_bit_exact(quant_variant):
    # v2 takes several rows per program when K / 16 < its blocks per program, and per-block scale loads
    for shape in [(8, 512, 64), (8, 256, 4096)]:
        w = _x(shape[0] * shape[1], shape[2], torch.bfloat16, seed=4).reshape(shape)
        gs = nv.global_scale_from_amax(w.float().abs().amax(dim=(1, 2), keepdim=True))
        for g in (gs, nv.global_scale_from_amax(w.float().abs().amax(-1, keepdim=True))):
            assert _eq(nv.quantize(w, g, backend="triton"), nv.quantize(w, g, backend="torch"))
            assert _same_bytes(nv.fake_quantize(w, g, backend="triton"), nv.fake_quantize(w, g, backend="torch"))


def test_large_residual_and_guided_bit_exact(residual_kernel):
    x = _x(4096, 4096, torch.bfloat16, seed=1)
    gs = nv.global_scale_from_amax(x.float().abs().amax(-1, keepdim=True))
    for per_token in (False, True):  # per call: multi-kernel path; per token: the fused row kernel
        rt = nv.residual_quantize(x, 0.5, gs, per_token=per_token, backend="triton")
        rr = nv.residual_quantize(x, 0.5, gs, per_token=per_token, backend="torch")
        _eq_residual(rt, rr)
        assert torch.equal(nv.residual_fake_quantize(x, 0.5, gs, per_token=per_token, backend="triton"),
                           nv.residual_fake_quantize(x, 0.5, gs, per_token=per_token, backend="torch"))
    rec = nv.extract_guidance(nv.quantize(x, gs, backend="torch"))
    noisy = (x.float() * (1 + 0.01 * torch.randn_like(x.float()))).to(x.dtype)
    assert _eq(nv.quantize_guided(noisy, rec, backend="triton"), nv.quantize_guided(noisy, rec, backend="torch"))


@pytest.mark.parametrize("store", ["native", "int"])
def test_large_fake_quantize_guided_bit_exact(store, monkeypatch):
    """The one-launch guided QDQ (TRACE's activation QDQ) at a QAT activation shape: bit for bit
    dequantize(quantize_guided(...)) of the torch reference, per-row record, bf16 (cvt.rn and integer bf16
    stores) plus fp16 / fp32, signed zeros included."""
    monkeypatch.setitem(tk.KERNELS, "bf16_store", store)
    for dtype in ([torch.bfloat16] if store == "int" else [torch.bfloat16, torch.float16, torch.float32]):
        x = _x(4096, 2048, dtype, seed=2)
        gs = nv.global_scale_from_amax(x.float().abs().amax(-1, keepdim=True))
        rec = nv.extract_guidance(nv.quantize(x, gs, backend="torch"))
        noisy = (x.float() * (1 + 0.01 * torch.randn_like(x.float()))).to(dtype)
        noisy[:64, :16] = -0.0
        out = nv.fake_quantize_guided(noisy, rec, backend="triton")
        ref = nv.dequantize(nv.quantize_guided(noisy, rec, backend="torch"), dtype, backend="torch")
        assert _same_bytes(out, ref)


@pytest.mark.parametrize("k", [2880, 8192, 16384])
def test_fused_per_token_residual_bit_exact_with_scores_and_ties(k, residual_kernel):
    x = _x(1024, k, torch.bfloat16, seed=2)
    x[5] = 0.0  # all scores tie
    x[6] = x[6, :16].repeat(k // 16)  # equal blocks
    gs = nv.per_row_global_scale(x)
    w = torch.rand(k, device="cuda")
    for ratio in (0.0, 0.25, 0.5, 1.0):
        for sw in (None, w):
            kw = dict(score_weight=sw)
            _eq_residual(nv.residual_quantize(x, ratio, gs, backend="triton", **kw),
                         nv.residual_quantize(x, ratio, gs, backend="torch", **kw))
            assert torch.equal(nv.residual_fake_quantize(x, ratio, gs, backend="triton", **kw),
                               nv.residual_fake_quantize(x, ratio, gs, backend="torch", **kw))


def test_fused_per_token_residual_is_batch_invariant_on_gpu(residual_kernel):
    x = _x(512, 4096, torch.bfloat16, seed=3)
    gs = nv.per_row_global_scale(x)
    full = nv.residual_fake_quantize(x, 0.5, gs, backend="triton")
    part = nv.residual_fake_quantize(x[100:137].contiguous(), 0.5, gs[100:137].contiguous(), backend="triton")
    assert torch.equal(full[100:137], part)


def _same_selection(t, r):
    if r.granularity == "channel_sampled":
        assert torch.equal(t.selected, r.selected), (t.selected != r.selected).float().mean().item()
    else:
        assert torch.equal(t.channel_idx, r.channel_idx), (t.channel_idx != r.channel_idx).float().mean().item()


def _same_channel(x, ratio, gs, granularity="channel", **kw):
    """granularity='channel' (or 'channel_sampled'; verl_quads/nvfp4/triton_channel.py) vs the torch reference on
    the same device: packed codes, scale bytes, global scales (bytes and shape), the selection, QDQ output bytes."""
    t = nv.residual_quantize(x, ratio, gs, granularity=granularity, backend="triton", **kw)
    r = nv.residual_quantize(x, ratio, gs, granularity=granularity, backend="torch", **kw)
    _same_selection(t, r)
    for a, b in ((t.first, r.first), (t.second, r.second)):
        assert _eq(a, b) and _same_bytes(a.global_scale.reshape(-1), b.global_scale.reshape(-1))
        assert a.global_scale.shape == b.global_scale.shape
    fr = nv.residual_fake_quantize(x, ratio, gs, granularity=granularity, backend="torch", **kw)
    assert _same_bytes(nv.residual_fake_quantize(x, ratio, gs, granularity=granularity, backend="triton", **kw), fr)
    if gs is not None and gs.dim() == 2 and gs.shape[0] == x.shape[0]:  # per-row: also derived in the kernel
        assert torch.equal(gs, nv.per_row_global_scale(x))
        tr = nv.residual_quantize(x, ratio, amax="row", granularity=granularity, backend="triton", check_finite=False,
                                  **kw)
        _same_selection(tr, r)
        for a, b in ((tr.first, r.first), (tr.second, r.second)):
            assert _eq(a, b) and _same_bytes(a.global_scale.reshape(-1), b.global_scale.reshape(-1))
            assert a.global_scale.shape == b.global_scale.shape
        assert _same_bytes(nv.residual_fake_quantize(x, ratio, amax="row", granularity=granularity, backend="triton",
                                                     check_finite=False, **kw), fr)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_channel_residual_bit_exact(dtype):
    """The channel rule's Triton kernel at the rollout's activation shape (4096 x 2048, per-row scale, k = 0.5;
    bf16 also at k = 0.125 / 1, a score weight, a per-tensor scale and a non-power-of-two / a long row), plus a
    small tie case: equal R**2 straddling the threshold, all-zero rows, -0.0 and subnormal block scales."""
    x = _x(4096, 2048, dtype, seed=5)
    _same_channel(x, 0.5, nv.per_row_global_scale(x))
    if dtype == torch.bfloat16:
        for ratio in (0.125, 1.0):
            _same_channel(x, ratio, nv.per_row_global_scale(x))
        _same_channel(x, 0.5, nv.per_row_global_scale(x), score_weight=torch.rand(2048, device="cuda"))
        _same_channel(x[:512], 0.5, nv.global_scale_from_amax(x[:512].float().abs().amax()))  # two launches
        for k in (2880, 8192):
            xk = _x(256, k, dtype, seed=6)
            _same_channel(xk, 0.5, nv.per_row_global_scale(xk))
    # ties: rows of constant |x| = 1.25 with one 6.0 per block (grid exact, R = +-0.25 everywhere: all scores tie),
    # hand residuals with six equal .0625 scores cut by n_sel = 3 of 32, all-zero rows, -0.0, subnormal scales
    blk = [6.0, 5.5, 2.75, 1.25, 0.125, 3.75] + [0.0] * 10
    t = torch.tensor([blk + blk] * 4, device="cuda")
    t[1] = torch.tensor([1.25, -1.25] * 16)
    t[1, ::16] = 6.0
    t[2] = 0.0
    t[3, :16] = -0.0
    t[3, 16:] = torch.linspace(-1, 1, 16) * 1e-3
    t = t.to(dtype)
    for ratio in (3 / 32, 0.25, 0.5, 12 / 32, 1.0):
        _same_channel(t, ratio, nv.per_row_global_scale(t))


def _same_channel_underflow_and_tied_candidates(seed: int, rows: int = 4, granularity: str = "channel") -> None:
    """``rows`` x 4096 bf16 rows: residuals whose squares underflow to +0 (every score ties at 0; the largest |R| is
    cut by channel order; odd rows start with 64 zeros), and 60 / 120 / 180 tied candidates (R = +-0.25 in 4 / 8 / 12
    blocks, zero elsewhere) with k = 1/64 .. 1/32: the channel kernel's bytes == the torch reference
    (:func:`_same_channel`)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    xt = (torch.randn(rows, 4096, device="cuda", generator=g) * 1e-25).to(torch.bfloat16)
    xt[1::2, :64] = 0.0
    for ratio in (0.25, 0.5):
        _same_channel(xt, ratio, nv.per_row_global_scale(xt), granularity)
    for nblk, ratio in ((4, 32 / 4096), (8, 77 / 4096), (12, 128 / 4096)):
        xr = torch.zeros(rows, 4096, device="cuda")
        xr[:, 1024: 1024 + nblk * 16] = 1.25
        xr[:, 1024: 1024 + nblk * 16: 16] = 6.0
        xr[1::2, 1025: 1024 + nblk * 16: 2] = -1.25
        xr = xr.to(torch.bfloat16)
        _same_channel(xr, ratio, nv.per_row_global_scale(xr), granularity)


@pytest.mark.parametrize("variant", ["default", "compact cta", "compact fallback", "s9", "ra", "at"])
def test_channel_compact_search_variants_bit_exact_at_decode(variant):
    """The compacted threshold search (CHANNEL_CONFIG compact_*; the default at <= 256 rows, K >= 2048: the warp tile)
    gives the reference's bytes at decode sizes: 1 / 16 / 64 x 8192 and 16 x 2048 at k = 0.5, 16 x 8192 at k = 0.125
    / 1 (bf16 rows end their search in the tile with ties at the threshold), fp32 rows, a score weight, a per-tensor
    scale (two launches), amax='row' (in _same_channel), rows of ulp-apart ties with more candidates than the tile
    (the full-row continuation). "compact cta": run 2's CTA-wide tile; "compact fallback": the continuation on every
    row. Session 10's options at every K ("ra": R_sel amax from the row's largest |R|; "at": warp tile of the
    candidates' chunks only; both are the K = 4096 default): the same cases + 16 / 4 x 4096 (dense d4096 decode).
    (Few cases: every case compiles its own launches, ~1-3 s each on the H200.)"""
    with tc.channel_config(**tc.CHANNEL_VARIANTS[variant]):
        for m, k in ((1, 8192), (16, 8192), (64, 8192), (16, 2048), (192, 4096), (16, 4096), (4, 4096)):  # 192: 4 warps
            xk = _x(m, k, torch.bfloat16, seed=20 + m + k)
            assert tc._compact_args(m, k, tc._check_row(k)) is not None, (variant, m, k)
            _same_channel(xk, 0.5, nv.per_row_global_scale(xk))
        xs = _x(16, 8192, torch.bfloat16, seed=21)
        for ratio in (0.125, 1.0):
            _same_channel(xs, ratio, nv.per_row_global_scale(xs))
        xd = _x(16, 4096, torch.float32, seed=22)
        _same_channel(xd, 0.5, nv.per_row_global_scale(xd), score_weight=torch.rand(4096, device="cuda"))
        _same_channel(xs, 0.5, nv.global_scale_from_amax(xs.float().abs().amax()))
        xl = torch.full((4, 4096), 1.25, device="cuda")
        xl[:, ::16] = 6.0
        xl[1::2, 1::2] = -1.25
        wl = 1.0 + (torch.arange(4096, device="cuda") % 8).float() * 2.0**-23
        _same_channel(xl, 0.3, nv.per_row_global_scale(xl), score_weight=wl)
        _same_channel_underflow_and_tied_candidates(seed=23)


def test_channel_default_at_4096_bit_exact():
    """Session 10's default at K = 4096 (CHANNEL_CONFIG compact_tile_chunks / compact_rmax for NBP = 256: the warp
    tile counts only its candidate chunks, R_sel's amax from the first step's reduction where the largest |R| is
    selected) gives the reference's bytes at the dense d4096 decode launches (1 / 4 / 16 / 64 rows, 8 warps; 192
    rows, 4 warps) at k = 0.5 (per-row scale given and amax='row'), 16 rows at k = 0.125 / 1, a score weight with fp32 rows, rows whose R^2 underflow to +0 (the largest
    |R| cut by channel order: the amax reduction must run) and rows with 60 / 120 / 180 tied candidates (each chunk
    count). Kept to one K and no per-tensor scale so that it compiles few launches (12; the decode variants test covers
    the other K and the per-tensor launches)."""
    assert tc._on("compact_tile_chunks", 256) and tc._on("compact_rmax", 256)
    for m in (1, 4, 16, 64, 192):  # 192 rows: the 4-warp launch of > 132 rows
        xk = _x(m, 4096, torch.bfloat16, seed=40 + m)
        _same_channel(xk, 0.5, nv.per_row_global_scale(xk))
    xs = _x(16, 4096, torch.bfloat16, seed=41)
    for ratio in (0.125, 1.0):
        _same_channel(xs, ratio, nv.per_row_global_scale(xs))
    xd = _x(16, 4096, torch.float32, seed=42)
    _same_channel(xd, 0.5, nv.per_row_global_scale(xd), score_weight=torch.rand(4096, device="cuda"))
    _same_channel_underflow_and_tied_candidates(seed=43)


@pytest.mark.parametrize("variant", ["default", "sampled first", "sampled b3", "sampled split", "s34",
                                     "sampled no digits", "sampled no pick", "sampled masked", "sampled where"])
def test_channel_sampled_bit_exact(variant):
    """granularity='channel_sampled' (session 27: the row's threshold from a fixed sample of its scores): the kernel's
    bytes and selection mask == the torch reference at decode and many-row launches of K = 768 / 2048 / 4096 / 8192
    (1, 2, 4, 8 samples per block), a non-power-of-two block count, k = 0.5 (per-row scale and amax='row'), k =
    0.125 / 1 / 0, fp32 rows with a score weight, a per-tensor scale (two launches), underflowing and tied rows; the
    CHANNEL_VARIANTS launch variants timed by the probe."""
    with tc.channel_config(**tc.CHANNEL_VARIANTS[variant]):
        for m, k in ((1, 8192), (16, 8192), (300, 8192), (1024, 4096), (64, 2048), (7, 768), (5, 16 * 33)):
            xk = _x(m, k, torch.bfloat16, seed=60 + m + k)
            _same_channel(xk, 0.5, nv.per_row_global_scale(xk), "channel_sampled")
        xs = _x(16, 8192, torch.bfloat16, seed=61)
        for ratio in (0.125, 1.0, 0.0):
            _same_channel(xs, ratio, nv.per_row_global_scale(xs), "channel_sampled")
        _same_channel(xs, 0.5, nv.global_scale_from_amax(xs.float().abs().amax()), "channel_sampled")
        xd = _x(16, 4096, torch.float32, seed=62)
        _same_channel(xd, 0.5, nv.per_row_global_scale(xd), "channel_sampled", score_weight=torch.rand(4096, device="cuda"))
        _same_channel_underflow_and_tied_candidates(seed=63, granularity="channel_sampled")


def test_channel_many_rows_reread_bit_exact():
    """Session 17's many-row launches (CHANNEL_CONFIG compact_many_regs: x read again after the search, Q(x) and R
    recomputed, 128-register cap; 8 warps at K = 8192) give the reference's bytes (packed, QDQ, amax='row'): 300 /
    1024 x 4096 and 133 / 1024 x 8192 at k = 0.5, 264 x 4096 (the launch without them, next to it), k = 0.125 / 1,
    fp32 rows with a score weight, a per-tensor scale (both launches re-read), and the tie / underflow rows of
    :func:`_same_channel_underflow_and_tied_candidates` as 300 rows."""
    assert tc._many_regs(300, 256) == 128 == tc._many_regs(133, 512) and tc._many_regs(264, 256) is None
    assert tc._launch_warps(133, 8192, 512) == 8
    for m, k in ((300, 4096), (1024, 4096), (264, 4096), (133, 8192), (1024, 8192)):
        xk = _x(m, k, torch.bfloat16, seed=50 + m + k)
        _same_channel(xk, 0.5, nv.per_row_global_scale(xk))
    xs = _x(300, 8192, torch.bfloat16, seed=51)
    for ratio in (0.125, 1.0):
        _same_channel(xs, ratio, nv.per_row_global_scale(xs))
    _same_channel(xs, 0.5, nv.global_scale_from_amax(xs.float().abs().amax()))
    xd = _x(300, 4096, torch.float32, seed=52)
    _same_channel(xd, 0.5, nv.per_row_global_scale(xd), score_weight=torch.rand(4096, device="cuda"))
    _same_channel_underflow_and_tied_candidates(seed=53, rows=300)


@pytest.mark.parametrize("variant", ["default", "uncapped", "full", "s16"])
def test_channel_residual_variants_bit_exact(variant):
    """Every speed variant of the channel kernel (triton_channel.CHANNEL_VARIANTS, default warps) gives the
    reference's bytes on the GPU: the rollout shapes (bf16 4096 x 2048, MoE-like 2048 x 768, a long row 256 x 8192)
    at k = 0.5 / 0.125 / 0 / 1, a score weight, a per-tensor scale (two launches), and scores a few ulps apart (score
    weights 1 + j * 2**-23 on R**2 = 1/16: the radix select's last digit, ties to the lower channel); decode-sized
    launches (1 / 16 / 64 x 8192, 16 x 2048, 1 x 768: the row counts the compacted search (CHANNEL_CONFIG
    compact_*) is meant for; the default runs it at every M since session 16 (as the "compact" variant did before),
    "s16" = session 16's many-row launches (4 warps at K = 8192, no re-read of x, uncapped), "full" turns the compacted
    search off). The other
    "compact ..." variants differ only at decode sizes: test_channel_compact_search_variants_bit_exact_at_decode."""
    with tc.channel_config(**tc.CHANNEL_VARIANTS[variant]):
        x = _x(4096, 2048, torch.bfloat16, seed=11)
        for ratio in (0.5, 0.125, 0.0, 1.0):
            _same_channel(x, ratio, nv.per_row_global_scale(x))
        _same_channel(x, 0.5, nv.per_row_global_scale(x), score_weight=torch.rand(2048, device="cuda"))
        _same_channel(x[:512], 0.5, nv.global_scale_from_amax(x[:512].float().abs().amax()))
        for m, k in ((2048, 768), (256, 8192), (1, 8192), (16, 8192), (64, 8192), (16, 2048), (1, 768)):
            xk = _x(m, k, torch.bfloat16, seed=12 + m)
            _same_channel(xk, 0.5, nv.per_row_global_scale(xk))
        xs = _x(16, 8192, torch.bfloat16, seed=13)
        for ratio in (0.125, 0.0, 1.0):
            _same_channel(xs, ratio, nv.per_row_global_scale(xs))
        xl = torch.full((64, 256), 1.25, device="cuda")
        xl[:, ::16] = 6.0
        xl[1::2, 1::2] = -1.25
        wl = 1.0 + (torch.arange(256, device="cuda") % 8).float() * 2.0**-23
        for ratio in (3 / 256, 0.3, 0.5):
            _same_channel(xl, ratio, nv.per_row_global_scale(xl), score_weight=wl)
