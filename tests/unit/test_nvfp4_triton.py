"""Triton kernels produce the reference's bytes (torch.equal). On CPU they run under
TRITON_INTERPRET=1 (scripts/test.sh sets it) at small shapes; the same tests run on the H200 at
realistic shapes via tests/gpu."""

import os

import pytest
import torch

import verl_quads.nvfp4 as nv

from sm90_compile import compile_for_sm90_in_subprocess

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (scripts/test.sh sets it on CPU)",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _x(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) / torch.rand(*shape, generator=g).clamp(min=0.02)
    x = x.reshape(-1, shape[-1])
    x[:, 3] *= 50
    x[: max(1, x.shape[0] // 4), 16:32] *= 1e-5  # scales in the E4M3 subnormal range
    x[:, 32:48] = 0.0
    x[0, 48:64] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * torch.tensor([1.0, -1.0]).repeat(8)
    return x.reshape(shape).to(dtype).to(DEV)


def _eq_q(a, b):
    return torch.equal(a.packed, b.packed) and torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 64), (3, 2, 96), (17, 256)])
def test_quantize_dequantize_qdq_match_reference(dtype, shape):
    x = _x(shape, dtype)
    for gs in (None, nv.global_scale_from_amax(x.float().abs().amax(-1, keepdim=True))):
        qt = nv.quantize(x, gs, backend="triton")
        qr = nv.quantize(x, gs, backend="torch")
        assert _eq_q(qt, qr) and torch.equal(qt.global_scale, qr.global_scale)
        assert torch.equal(nv.dequantize(qr, dtype, backend="triton"), nv.dequantize(qr, dtype, backend="torch"))
        assert torch.equal(nv.fake_quantize(x, gs, backend="triton"), nv.fake_quantize(x, gs, backend="torch"))


def test_per_expert_global_scale():
    w = _x((4, 8, 64), torch.bfloat16)
    gs = nv.global_scale_from_amax(w.float().abs().amax(dim=(1, 2), keepdim=True))
    assert _eq_q(nv.quantize(w, gs, backend="triton"), nv.quantize(w, gs, backend="torch"))


def test_every_e4m3_scale_value_rounds_like_torch():
    # block maxima sweeping all E4M3 magnitudes and the midpoints between them (ties included)
    vals = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (vals[1:] + vals[:-1]) / 2
    targets = torch.cat([vals, mids, mids * (1 + 1e-6), mids * (1 - 1e-6)])
    targets = targets[: (targets.numel() // 4) * 4]
    # with global scale 448*6/6 = 448, block max m gives scale value 448*m/6: choose m accordingly
    x = torch.zeros(targets.numel(), 16)
    x[:, 0] = targets * 6.0 / 448.0
    x[:, 1] = 6.0 / 448.0 * 448.0 / 448.0  # keep some mass
    x = x.to(DEV)
    gs = torch.tensor(448.0)
    assert _eq_q(nv.quantize(x, gs, backend="triton"), nv.quantize(x, gs, backend="torch"))


def _eq_residual(rt, rr):
    assert torch.equal(rt.block_idx, rr.block_idx), (rt.block_idx, rr.block_idx)
    assert _eq_q(rt.first, rr.first) and _eq_q(rt.second, rr.second)
    assert torch.equal(rt.first.global_scale, rr.first.global_scale)
    assert torch.equal(rt.second.global_scale, rr.second.global_scale)
    assert rt.second.shape == rr.second.shape


def _check_residual(x, ratio, gs, per_token, w=None):
    kw = dict(per_token=per_token, score_weight=w)
    _eq_residual(nv.residual_quantize(x, ratio, gs, backend="triton", **kw),
                 nv.residual_quantize(x, ratio, gs, backend="torch", **kw))
    assert torch.equal(nv.residual_fake_quantize(x, ratio, gs, backend="triton", **kw),
                       nv.residual_fake_quantize(x, ratio, gs, backend="torch", **kw))


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("ratio", [0.0, 0.125, 0.25, 0.5, 1.0])
def test_residual_matches_reference(ratio, per_token):
    # ratio 0.125: exactly one block of 8 per row; per token (the fused kernel, one interpreter program per
    # row) 8 rows, per call (the scores summed over rows) 24
    x = _x((24 if not per_token else 8, 128), torch.bfloat16, seed=3)
    for gs in (None, nv.global_scale_from_amax(x.float().abs().amax(-1, keepdim=True))):
        _check_residual(x, ratio, gs, per_token)


# K / 16 = 1, 5, 13 blocks: not powers of two; each dtype once (the load/store paths do not depend on K)
@pytest.mark.parametrize("dtype,k", [(torch.float32, 16), (torch.bfloat16, 80), (torch.float16, 208)],
                         ids=["float32-k16", "bfloat16-k80", "float16-k208"])
def test_residual_odd_k_zero_rows_and_weights_match_reference(dtype, k):
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(7, k, generator=g) / torch.rand(7, k, generator=g).clamp(min=0.05))
    x[2] = 0.0  # an all-zero row: every score ties at 0 -> the lowest blocks
    x = x.to(dtype).to(DEV)
    gs = nv.per_row_global_scale(x)
    w = torch.rand(k, generator=g).to(DEV)
    w[:16] = 0.0  # a zero-weight block
    for per_token in (True, False):
        for ratio in (0.0, 0.3, 1.0):
            _check_residual(x, ratio, gs, per_token)
            _check_residual(x, ratio, gs, per_token, w)
    _check_residual(x[:1], 0.5, gs[:1], True)  # a single row (second-pass scale is 0-d, as in the reference)
    _check_residual(x[:0], 0.5, gs[:0], True)  # no rows


def test_residual_score_ties_break_to_the_lower_block_like_the_reference():
    # rows built from repeated blocks: equal scores in several blocks, in per-token and per-call mode
    g = torch.Generator().manual_seed(7)
    base = torch.randn(4, 16, generator=g)
    x = torch.stack([torch.cat([base[r % 4], base[(r + 1) % 4]] * 5) for r in range(6)])  # K = 160, 10 blocks
    x[3] = torch.cat([base[0]] * 10)  # ten equal blocks
    x[4, 48:] = 0.0
    x[5] = 0.0
    x = x.to(DEV)
    gs = nv.per_row_global_scale(x)
    for per_token in (True, False):
        for ratio in (0.1, 0.3, 0.5, 0.7):
            _check_residual(x, ratio, gs, per_token)
    r = nv.residual_quantize(x, 0.3, gs, backend="triton")
    assert r.block_idx[3].tolist() == [0, 1, 2] and r.block_idx[5].tolist() == [0, 1, 2]


def test_fused_per_token_kernel_is_the_path_taken_and_equals_the_multi_kernel_path(monkeypatch):
    from verl_quads.nvfp4 import triton_kernels as tk

    monkeypatch.setitem(tk.KERNELS, "residual_per_token", "row")  # the whole-row kernel (default: gather)
    x = _x((9, 96), torch.bfloat16, seed=5)
    gs = nv.per_row_global_scale(x)
    calls = []
    real = tk._residual_rows
    monkeypatch.setattr(tk, "_residual_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = nv.residual_quantize(x, 0.5, gs, backend="triton")
    fused_qdq = nv.residual_fake_quantize(x, 0.5, gs, backend="triton")
    assert len(calls) == 2
    monkeypatch.setitem(tk.ROW_CONFIG, "max_blocks", 4)  # 6 blocks -> too long for the fused kernel
    _eq_residual(fused, nv.residual_quantize(x, 0.5, gs, backend="triton"))
    assert torch.equal(fused_qdq, nv.residual_fake_quantize(x, 0.5, gs, backend="triton"))
    assert len(calls) == 2


def test_residual_score_weight_is_validated():
    x = torch.randn(2, 32)
    for bad in (torch.ones(16), torch.ones(32, dtype=torch.float64), -torch.ones(32), torch.full((32,), float("nan"))):
        for backend in ("torch", "triton"):
            with pytest.raises(ValueError, match="score_weight"):
                nv.residual_quantize(x.to(DEV), 0.5, backend=backend, score_weight=bad.to(DEV))


def test_guided_matches_reference():
    x = _x((12, 128), torch.bfloat16, seed=4)
    gs = nv.global_scale_from_amax(x.float().abs().amax(-1, keepdim=True))
    rec = nv.extract_guidance(nv.quantize(x, gs, backend="torch"))
    noisy = (x.float() * (1 + 0.02 * torch.randn(x.shape, device=x.device))).to(x.dtype)
    assert _eq_q(nv.quantize_guided(noisy, rec, backend="triton"), nv.quantize_guided(noisy, rec, backend="torch"))


@pytest.mark.parametrize("kernel", ["v2", "v1"])
@pytest.mark.parametrize("scale", ["row", "tensor", "per_row_gs", "amax_rows"])
@pytest.mark.parametrize("shape", [(5, 64), (3, 2, 96), (17, 256), (2, 8192)])
def test_quantize_with_guidance_matches_quantize_then_extract(shape, scale, kernel, monkeypatch):
    """The quantize kernel's own guidance bits (GUIDE) are extract_guidance's bytes of the torch reference's codes,
    for every global-scale route of the kernel (in-kernel row amax; a tensor scale; per-row scales; row amaxes
    given, and rows too long for one program: amax by torch) and for the v1 kernel (bits by extract_guidance)."""
    from verl_quads.nvfp4 import triton_kernels as tk

    monkeypatch.setitem(tk.KERNELS, "quantize", kernel)
    x = _x(shape, torch.bfloat16, seed=7)
    kw = {"row": dict(amax="row"), "tensor": dict(global_scale=nv.global_scale_from_amax(x.float().abs().amax())),
          "per_row_gs": dict(global_scale=nv.per_row_global_scale(x)),
          "amax_rows": dict(amax=x.float().abs().amax(-1, keepdim=True))}[scale]
    q, rec = nv.quantize_with_guidance(x, backend="triton", check_finite=False, **kw)
    ref_q = nv.quantize(x, backend="torch", **kw)
    want = nv.extract_guidance(ref_q)
    assert _eq_q(q, ref_q)
    assert rec.bits.dtype == torch.uint8 and rec.bits.shape == want.bits.shape
    assert torch.equal(rec.bits, want.bits)
    assert rec.bits.any() and not rec.bits.eq(255).all()  # a record with both bit values (not all one)
    assert torch.equal(rec.block_scale.view(torch.uint8), want.block_scale.view(torch.uint8))
    assert torch.equal(rec.global_scale, want.global_scale) and rec.shape == want.shape


def _row_record(rows: torch.Tensor, off: int, lead: tuple[int, ...], k: int) -> nv.GuidanceRecord:
    """A record of views into uint8 token rows ``rows`` [T, B] from byte ``off`` on: bits, block scales, global
    scales one after another, each [*lead[1:], .] per token (TRACE's row layout with 8-byte aligned sections)."""
    per = lead[1] if len(lead) == 2 else 1
    nb, ns = per * k // 8, per * k // 16
    so = off + -(-nb // 8) * 8
    go = so + -(-ns // 8) * 8
    bits = rows[:, off:off + nb].reshape(*lead, k // 8)
    scale = rows[:, so:so + ns].view(torch.float8_e4m3fn).reshape(*lead, k // 16)
    gs = rows[:, go:go + 4 * per].view(torch.float32).reshape(*lead, 1)
    return nv.GuidanceRecord(bits, scale, gs, torch.Size((*lead, k)))


@pytest.mark.parametrize("backend,kernel", [("triton", "v2"), ("triton", "v1"), ("torch", None)])
@pytest.mark.parametrize("scale", ["row", "row_checked", "tensor", "per_row_gs"])
@pytest.mark.parametrize("slots", [None, 4])
def test_quantize_with_guidance_into_token_rows(slots, scale, backend, kernel, monkeypatch):
    """``out=`` a record of views into TRACE-like token rows (row stride > the record, a token's ``slots`` rows of
    x side by side): the same bytes as the record quantize_with_guidance allocates itself, every byte of the rows
    outside the record untouched, for each global-scale route (the kernel writes the scales; a checked route and
    the v1 kernel copy them) and for the torch backend."""
    from verl_quads.nvfp4 import triton_kernels as tk

    if kernel is not None:
        monkeypatch.setitem(tk.KERNELS, "quantize", kernel)
    t, k = 5, 96
    x = _x((t * (slots or 1), k), torch.bfloat16, seed=11)
    kw = {"row": dict(amax="row", check_finite=False), "row_checked": dict(amax="row"),
          "tensor": dict(global_scale=nv.global_scale_from_amax(x.float().abs().amax()), check_finite=False),
          "per_row_gs": dict(global_scale=nv.per_row_global_scale(x), check_finite=False)}[scale]
    lead = (t,) if slots is None else (t, slots)
    rows = torch.full((t, 24 + -(-(slots or 1) * (k // 8 + k // 16 + 4) // 8) * 8 + 24), 0xA5, dtype=torch.uint8)
    before = rows.clone()
    out = _row_record(rows, 24, lead, k)
    q, rec = nv.quantize_with_guidance(x, backend=backend, out=out, **kw)
    want_q, want = nv.quantize_with_guidance(x, backend=backend, **kw)
    assert rec is out and _eq_q(q, want_q)
    assert torch.equal(out.bits.reshape(want.bits.shape), want.bits)
    assert torch.equal(out.block_scale.view(torch.uint8).reshape(-1), want.block_scale.view(torch.uint8).reshape(-1))
    assert torch.equal(out.global_scale.reshape(-1), torch.broadcast_to(want.global_scale, (x.shape[0], 1)).reshape(-1))
    outside = torch.ones_like(rows, dtype=torch.bool)
    for t_ in (out.bits, out.block_scale, out.global_scale):
        v = t_.view(torch.uint8) if t_.dtype != torch.uint8 else t_
        start = v.data_ptr() - rows.data_ptr()
        for i in range(t):
            outside[i, start % rows.shape[1]:start % rows.shape[1] + v[0].numel()] = False
    assert torch.equal(rows[outside], before[outside])
    assert not torch.equal(rows[~outside], before[~outside])


def test_quantize_with_guidance_out_layout_errors():
    x = _x((6, 64), torch.float32, seed=3)
    rows = torch.zeros(6, 64, dtype=torch.uint8)
    good = _row_record(rows, 0, (6,), 64)
    bad = {"bits": nv.GuidanceRecord(rows[:, :4], good.block_scale, good.global_scale, good.shape),
           "block_scale": nv.GuidanceRecord(good.bits, good.block_scale[:5], good.global_scale, good.shape),
           "global_scale": nv.GuidanceRecord(good.bits, good.block_scale, good.global_scale.double(), good.shape)}
    for name, out in bad.items():
        for backend in ("triton", "torch"):
            with pytest.raises(ValueError, match=f"record.{name}"):
                nv.quantize_with_guidance(x, amax="row", backend=backend, out=out)
    two = _row_record(torch.zeros(3, 64, dtype=torch.uint8), 0, (3, 2), 64)  # [T, S] with T * S = 6: fine
    nv.quantize_with_guidance(x, amax="row", backend="triton", out=two)
    slots_apart = nv.GuidanceRecord(good.bits.reshape(3, 2, 8)[:, :1], two.block_scale[:, :1], two.global_scale[:, :1],
                                    two.shape)
    with pytest.raises(ValueError, match="record.bits"):
        nv.quantize_with_guidance(x, amax="row", backend="triton", out=slots_apart)


def test_quantize_with_guidance_torch_backend_is_quantize_then_extract():
    x = _x((6, 64), torch.float32, seed=3)
    q, rec = nv.quantize_with_guidance(x, amax="row", backend="torch")
    want = nv.extract_guidance(nv.quantize(x, amax="row", backend="torch"))
    assert torch.equal(rec.bits, want.bits) and _eq_q(q, nv.quantize(x, amax="row", backend="torch"))


def _composed_guided_qdq(x, rec):
    """The definition of the guided QDQ: the torch reference's guided quantize, then its dequantize."""
    return nv.dequantize(nv.quantize_guided(x, rec, backend="torch"), x.dtype, backend="torch")


def _bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_quantize_guided_matches_composed_reference(dtype):
    """One-launch guided QDQ == dequantize(quantize_guided(x, record)) bit for bit (signed zeros included):
    a noisy x under a per-row record, odd leading dims with per-row and per-prefix global scales."""
    x = _x((12, 128), dtype, seed=4)
    gs = nv.global_scale_from_amax(x.float().abs().amax(-1, keepdim=True))
    rec = nv.extract_guidance(nv.quantize(x, gs, backend="torch"))
    noisy = (x.float() * (1 + 0.02 * torch.randn(x.shape, device=x.device))).to(dtype)
    noisy[1, 32:48] = -noisy[1, 32:48]  # -0.0 in a zero block
    for inp in (noisy, x):
        out = nv.fake_quantize_guided(inp, rec, backend="triton")
        assert _bits_equal(out, _composed_guided_qdq(inp, rec))
        assert _bits_equal(nv.fake_quantize_guided(inp, rec, backend="torch"), out)
    # under its own round-to-nearest record, guided QDQ is the plain QDQ (independent of the guided code)
    assert _bits_equal(nv.fake_quantize_guided(x, rec, backend="triton"), nv.fake_quantize(x, gs, backend="torch"))
    x3 = _x((3, 5, 64), dtype, seed=5)
    for g in (nv.global_scale_from_amax(x3.float().abs().amax(-1, keepdim=True)),
              nv.global_scale_from_amax(x3.float().abs().amax(dim=(1, 2), keepdim=True)),
              nv.global_scale_from_amax(x3.float().abs().amax())):
        rec3 = nv.extract_guidance(nv.quantize(x3, g, backend="torch"))
        n3 = (x3.float() * (1 + 0.05 * torch.randn(x3.shape, device=x3.device))).to(dtype)
        assert _bits_equal(nv.fake_quantize_guided(n3, rec3, backend="triton"), _composed_guided_qdq(n3, rec3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_quantize_guided_ties_grid_points_and_zero_scales(dtype):
    """A hand-made record (block scale 1, global scale 1, so y = x exactly): E2M1 midpoints (the guidance
    bit decides), grid points (kept whatever the bit), values past 6, signed zeros; a block with scale byte
    0 (output scale 0: every element -> +-0); random bits; and a random record (any scale byte, per-row
    global scales) on a wide-range x."""
    vals = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 9.0])
    g = torch.Generator().manual_seed(7)
    x = torch.cat([vals, -vals, vals.flip(0), -vals.flip(0)]).reshape(1, 64).repeat(6, 1)
    x[:, 16:32] *= torch.where(torch.rand(6, 16, generator=g) < 0.5, -1.0, 1.0)
    bits = torch.randint(0, 256, (6, 8), generator=g, dtype=torch.uint8)
    bits[0] = 0
    bits[1] = 255
    bscale = torch.ones(6, 4).to(torch.float8_e4m3fn)
    bscale[2, 1] = 0.0
    rec = nv.GuidanceRecord(bits.to(DEV), bscale.to(DEV), torch.tensor(1.0, device=DEV), torch.Size((6, 64)))
    xd = x.to(dtype).to(DEV)
    out = nv.fake_quantize_guided(xd, rec, backend="triton")
    assert _bits_equal(out, _composed_guided_qdq(xd, rec))
    # bit 0 / bit 1 everywhere: midpoints go to the even / odd neighbour, grid points stay (by hand)
    even = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0])
    odd = torch.tensor([0.5, 0.5, 1.5, 1.5, 3.0, 3.0, 6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0])
    assert torch.equal(out[0, :16].float().cpu(), even) and torch.equal(out[1, :16].float().cpu(), odd)
    assert torch.equal(out[0, 32:48].float().cpu(), even.flip(0)) and torch.equal(out[1, 16:32].float().cpu().abs(), odd)
    assert torch.equal(torch.signbit(out[:2, 16:32].float().cpu()), torch.signbit(x[:2, 16:32]))
    z = out[2, 16:32].float().cpu()
    assert torch.equal(z, torch.zeros(16)) and torch.equal(torch.signbit(z), torch.signbit(x[2, 16:32]))
    # a random record: every scale byte 0..126, per-row global scales, x over many binades
    xr = _x((7, 96), dtype, seed=8)
    sb = torch.randint(0, 127, (7, 6), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    gsr = torch.exp2(torch.randint(-20, 20, (7, 1), generator=g).float()) * (1 + torch.rand(7, 1, generator=g))
    recr = nv.GuidanceRecord(torch.randint(0, 256, (7, 12), generator=g, dtype=torch.uint8).to(DEV), sb.to(DEV),
                             gsr.to(DEV), torch.Size((7, 96)))
    assert _bits_equal(nv.fake_quantize_guided(xr, recr, backend="triton"), _composed_guided_qdq(xr, recr))


def test_fake_quantize_guided_errors():
    x = _x((4, 64), torch.bfloat16)
    rec = nv.extract_guidance(nv.quantize(x, backend="torch"))
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="stale or foreign record"):
            nv.fake_quantize_guided(x[:2], rec, backend=backend)
    assert nv.fake_quantize_guided(x[:0], nv.extract_guidance(nv.quantize(x[:0], backend="torch")),
                                   backend="triton").shape == (0, 64)


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        nv.quantize(torch.zeros(2, 16), backend="triton")


def test_e2m1_rounding_on_a_dense_grid_with_all_ties():
    # every multiple of 2**-12 in [-6, 6] (ties of all thresholds included) as scaled values:
    # with global scale 448 and block max 6 the output scale is exactly 1.
    vals = torch.arange(-6 * 4096, 6 * 4096 + 1, dtype=torch.float32) / 4096
    vals = vals[: (vals.numel() // 15) * 15].reshape(-1, 15)
    x = torch.cat([vals, torch.full((vals.shape[0], 1), 6.0)], dim=1).to(DEV)
    gs = torch.tensor(448.0)
    assert _eq_q(nv.quantize(x, gs, backend="triton"), nv.quantize(x, gs, backend="torch"))
    assert torch.equal(nv.fake_quantize(x, gs, backend="triton"), nv.fake_quantize(x, gs, backend="torch"))


# ---- kernel variants (triton_kernels.KERNELS): v2 quantize / QDQ and the tiled per-token residual kernel ----


@pytest.fixture
def tk(monkeypatch):
    from verl_quads.nvfp4 import triton_kernels

    for key in ("KERNELS", "QUANT2_CONFIG", "TILED_CONFIG"):  # tests edit copies; the originals come back
        monkeypatch.setattr(triton_kernels, key, {k: (dict(v) if isinstance(v, dict) else v)
                                                  for k, v in getattr(triton_kernels, key).items()})
    return triton_kernels


def _use_v2(tk, fp):
    tk.KERNELS.update(quantize="v2", fake_quantize="v2")
    tk.QUANT2_CONFIG["quantize"]["fp"] = fp


@pytest.mark.parametrize("fp", [True, False], ids=["float-e2m1", "int-e2m1"])
def test_v2_quantize_qdq_match_reference(tk, fp):
    _use_v2(tk, fp)
    for dtype, blocks in [(d, None) for d in DTYPES] + [(torch.bfloat16, 32)]:
        if blocks:  # 32 blocks per program: K = 2048 is then one row per program, in 4 column tiles
            tk.QUANT2_CONFIG["quantize"]["blocks"] = tk.QUANT2_CONFIG["qdq"]["blocks"] = blocks
        # K = 64/96 (and 2048 with the default 512 blocks): several rows per program, per-block scale loads
        for shape in [(5, 64), (3, 2, 96), (2, 2048)]:
            x = _x(shape, dtype)
            for gs in (None, nv.global_scale_from_amax(x.float().abs().amax(-1, keepdim=True))):
                assert _eq_q(nv.quantize(x, gs, backend="triton"), nv.quantize(x, gs, backend="torch")), (dtype, shape)
                assert torch.equal(nv.fake_quantize(x, gs, backend="triton"), nv.fake_quantize(x, gs, backend="torch"))
    for shape in [(4, 8, 64), (2, 3, 2048)]:  # per-expert scales: one per GS_DIV rows
        w = _x(shape, torch.bfloat16)
        gs = nv.global_scale_from_amax(w.float().abs().amax(dim=(1, 2), keepdim=True))
        assert _eq_q(nv.quantize(w, gs, backend="triton"), nv.quantize(w, gs, backend="torch"))
        assert torch.equal(nv.fake_quantize(w, gs, backend="triton"), nv.fake_quantize(w, gs, backend="torch"))


@pytest.mark.parametrize("fp", [True, False], ids=["float-e2m1", "int-e2m1"])
def test_v2_e2m1_index_around_every_threshold_and_binade_edge(tk, fp):
    # the float32 neighbours (+-40 ulps) of every E2M1 rounding threshold and grid point, both signs,
    # as scaled values (global scale 448 and a block max of 6: output scale 1, as in the dense-grid test)
    _use_v2(tk, fp)
    pts = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    vals = (pts.view(torch.int32)[:, None] + torch.arange(-40, 41)[None, :]).view(torch.float32).flatten()
    vals = torch.cat([vals, -vals, torch.tensor([0.0, -0.0, 1e-30, 7.0, -7.0])])
    vals = torch.cat([vals, torch.zeros((-vals.numel()) % 15)]).reshape(-1, 15)
    x = torch.cat([vals, torch.full((vals.shape[0], 1), 6.0)], dim=1).to(DEV)
    gs = torch.tensor(448.0)
    assert _eq_q(nv.quantize(x, gs, backend="triton"), nv.quantize(x, gs, backend="torch"))
    assert torch.equal(nv.fake_quantize(x, gs, backend="triton"), nv.fake_quantize(x, gs, backend="torch"))


@pytest.mark.parametrize("variant", ["gather", "gather-early-fast", "gather-early-t32w1-fast", "gather-early-t128w4-fast"])
def test_gather_per_token_residual_matches_reference(tk, variant):
    # the gather kernel (KERNELS "gather" and the RESIDUAL_VARIANTS the "auto" default uses; under the interpreter
    # they differ only in warps, so every one also runs tiles of 4 blocks over 10: several tiles per row, a partial
    # last tile, a padded tile slot (NTP * CT > NB)); the second walk reads back the selected indices (chunks of 4
    # slots); the early-stopped search: the random rows take the exact-count branch, the tie / zero rows the tie
    # scan, ratio 0 stops at once
    assert set(tk.RESIDUAL_VARIANTS) == {"gather-early-fast", "gather-early-t32w1-fast", "gather-early-t128w4-fast"}
    kernel, over = ("gather", {}) if variant == "gather" else tk.RESIDUAL_VARIANTS[variant]
    tk.KERNELS["residual_per_token"] = kernel
    tk.TILED_CONFIG[kernel].update(over, tile_blocks=4)
    g = torch.Generator().manual_seed(11)
    base = torch.randn(4, 16, generator=g)
    x = torch.randn(3, 160, generator=g) / torch.rand(3, 160, generator=g).clamp(min=0.05)
    x[0, 48:96] = 0.0  # three zero blocks among random ones
    x[1] = torch.cat([base[0]] * 10)  # ten equal blocks: all scores tie
    x[2] = 0.0
    w = torch.rand(160, generator=g)
    w[:16] = 0.0  # a zero-weight block
    xd = x.to(torch.bfloat16).to(DEV)
    gs = nv.per_row_global_scale(xd)
    for ratio in (0.0, 0.3):
        _check_residual(xd, ratio, gs, True)
    _check_residual(xd, 0.5, gs, True, w.to(DEV))
    xf = x[:2].to(DEV)  # float32 input (its halves are 32-byte rows); the all-tie row included
    _check_residual(xf, 1.0, nv.per_row_global_scale(xf), True)
    r = nv.residual_quantize(xd, 0.3, gs, backend="triton")
    assert r.block_idx[1].tolist() == [0, 1, 2] and r.block_idx[2].tolist() == [0, 1, 2]


def test_gather_kernel_is_the_path_taken_when_chosen(tk, monkeypatch):
    tk.KERNELS["residual_per_token"] = "gather"
    x = _x((3, 96), torch.bfloat16, seed=5)
    gs = nv.per_row_global_scale(x)
    launched = []
    real = tk._residual_tiled_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(tk, "_residual_tiled_kernel", Spy())
    want = nv.residual_fake_quantize(x, 0.5, gs, backend="torch")
    assert torch.equal(nv.residual_fake_quantize(x, 0.5, gs, backend="triton"), want)
    assert launched == [(3,)]


@pytest.mark.parametrize("choice", ["tiled", "hold", "gather-early-fast"])
def test_removed_or_unknown_residual_choice_is_an_error_naming_the_allowed_ones(tk, choice):
    # session 10 removed the "tiled" and "hold" kernels (measured slower); a RESIDUAL_VARIANTS name is not a KERNELS
    # value either: each is a ValueError listing what is allowed, never a silent run of another kernel
    tk.KERNELS["residual_per_token"] = choice
    x = _x((3, 96), torch.bfloat16, seed=5)
    gs = nv.per_row_global_scale(x)
    allowed = r"\['auto', 'gather', 'row', 'gluon'\]"
    for fn in (nv.residual_fake_quantize, nv.residual_quantize):
        with pytest.raises(ValueError, match=rf"KERNELS\['residual_per_token'\] = '{choice}': must be one of {allowed}"):
            fn(x, 0.5, gs, backend="triton")


def test_auto_takes_the_gluon_residual_kernel_only_where_it_was_measured(tk):
    # GLUON_RESIDUAL_AUTO was measured on the H200 (sm_90) only: other GPUs keep the Triton kernels under "auto"
    assert tk.gluon_residual_measured_on((9, 0))
    for cap in ((8, 0), (8, 9), (9, 1), (10, 0), (12, 0)):
        assert not tk.gluon_residual_measured_on(cap), cap
    # on CPU tensors "auto" never picks it, whatever the size
    nbp = next(iter(tk.GLUON_RESIDUAL_AUTO))
    x = torch.zeros(1, nbp * 16, dtype=torch.bfloat16).expand(tk.GLUON_RESIDUAL_AUTO[nbp], -1)  # no 128 MB buffer
    assert not tk._auto_gluon(x, torch.ones(x.shape[0], 1), None, nbp, False, 0)


def test_gluon_residual_smr_only_on_the_triton_it_was_verified_on(monkeypatch):
    # SMR addresses triton's shared memory by byte offsets from global_smem (checked on the H200 with triton 3.6): on
    # another triton the default falls back to SMR off (the same bytes) and an explicit smr=1 is an error naming it
    gr = pytest.importorskip("verl_quads.nvfp4.gluon_residual")
    monkeypatch.setattr(gr, "triton_version", lambda: (3, 6))
    assert gr.resolve_smr(1, None) == 1 and gr.resolve_smr(0, None) == 0 and gr.resolve_smr(1, 0) == 0
    assert gr.resolve_smr(0, 1) == 1
    monkeypatch.setattr(gr, "triton_version", lambda: (3, 9))
    assert gr.resolve_smr(1, None) == 0 and gr.resolve_smr(0, 0) == 0
    with pytest.raises(RuntimeError, match=r"smr=1 .* verified only on triton 3\.6; the installed triton is 3\.9"):
        gr.resolve_smr(1, 1)


def test_auto_residual_kernel_follows_the_row_length_rule(tk, monkeypatch):
    # the default ("auto") serves a row by RESIDUAL_BY_BLOCKS (first entry whose padded block count fits): seen in
    # the gather kernel's launch (tile = min(tile_blocks, padded blocks), warps)
    assert tk.KERNELS["residual_per_token"] == "auto"
    monkeypatch.setattr(tk, "RESIDUAL_BY_BLOCKS", ((8, "gather-early-t32w1-fast"), (None, "gather-early-t128w4-fast")))
    launched = []
    real = tk._residual_tiled_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append((kw["CT"], kw["NTP"], kw["num_warps"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(tk, "_residual_tiled_kernel", Spy())
    for k, want in ((96, (8, 1, 1)), (160, (16, 1, 4)), (2064, (128, 2, 4))):  # 6 / 10 / 129 blocks: 8 / 16 / 256 padded
        x = _x((3, k), torch.bfloat16, seed=5)
        gs = nv.per_row_global_scale(x)
        launched.clear()
        assert torch.equal(nv.residual_fake_quantize(x, 0.5, gs, backend="triton"),
                           nv.residual_fake_quantize(x, 0.5, gs, backend="torch"))
        assert launched == [want], (k, launched)
    monkeypatch.setattr(tk, "RESIDUAL_BY_BLOCKS", ((8, "gather-early-t32w1-fast"),))
    with pytest.raises(ValueError, match="RESIDUAL_BY_BLOCKS has no entry for rows of 16 padded 16-blocks"):
        nv.residual_fake_quantize(_x((3, 160), torch.bfloat16, seed=5), 0.5, gs, backend="triton")


_SM90_COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import verl_quads.nvfp4.triton_kernels as tk

def comp(fn, sig, const, nw):
    sig, const = dict(sig), dict(const)
    for p in fn.params:  # trailing constexprs with a default that sig leaves out: their default, as a launch gives
        if p.name not in sig and p.is_constexpr and p.has_default:
            sig[p.name], const[p.name] = "constexpr", p.default
    missing = [p.name for p in fn.params if p.name not in sig]
    assert not missing, f"{fn.__name__}: the compile signature misses {missing}"
    sig = {p.name: sig[p.name] for p in fn.params}  # the attrs' indices count in parameter order
    # as the JIT specializes for aligned tensors: pointers and ints divisible by 16 carry tt.divisibility=16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if sig[n][0] == "*" or n in ("NBK", "NB", "R")}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": nw, "enable_fp_fusion": False})
    assert k.asm["cubin"], fn
    return k

q = {"x_ptr": "*bf16", "gs_ptr": "*fp32", "packed_ptr": "*i64", "scale_ptr": "*u8", "out_ptr": "*i16", "bits_ptr": "*u8",
     "rsc_ptr": "*u8", "rgs_ptr": "*fp32", "R": "i32", "NBK": "i32", "GS_DIV": "i32", "BITS_RS": "i32", "SC_RS": "i32",
     "GS_RS": "i32", "RT": "constexpr", "CT": "constexpr", "ONE_GS": "constexpr", "MODE": "constexpr",
     "OUT": "constexpr", "FP": "constexpr", "GSRC": "constexpr", "NG": "constexpr", "WRITE_GS": "constexpr"}
g0 = {"GSRC": 0, "NG": 1, "WRITE_GS": False}  # global scales given (the ASTSource needs every constexpr)
comp(tk._quant2_kernel, q, dict(g0, RT=1, CT=512, ONE_GS=False, MODE=0, OUT=0, FP=False), 4)
comp(tk._quant2_kernel, dict(q, packed_ptr="*i16", scale_ptr="*i16"),
     dict(g0, RT=4, CT=128, ONE_GS=True, MODE=1, OUT=3, FP=True), 4)
comp(tk._quant2_kernel, dict(q, x_ptr="*fp32"), dict(g0, RT=1, CT=256, ONE_GS=True, MODE=0, OUT=0, FP=True), 4)
# the QAT in-kernel global scale (GSRC 1: from given amaxes, NG: a fused group; 2: each row's own amax)
q2 = dict(q, gs_ptr="*bf16")
for gsrc, ng, one, rt, ct in ((1, 1, False, 2, 128), (1, 3, True, 2, 128), (2, 1, False, 4, 64)):
    comp(tk._quant2_kernel, dict(q2, packed_ptr="*i16", scale_ptr="*i16"), {"RT": rt, "CT": ct, "ONE_GS": one, "MODE": 1,
         "OUT": 3, "FP": False, "GSRC": gsrc, "NG": ng, "WRITE_GS": False}, 8)
comp(tk._quant2_kernel, dict(q2, out_ptr="*fp32"), {"RT": 4, "CT": 128, "ONE_GS": False, "MODE": 0, "OUT": 0, "FP": False,
     "GSRC": 2, "NG": 1, "WRITE_GS": True}, 4)
# TRACE's rollout quantize: per-row scale in the kernel and the guidance bits (GUIDE, int64 bit gathering)
comp(tk._quant2_kernel, dict(q2, out_ptr="*fp32", bits_ptr="*i16"), {"RT": 4, "CT": 128, "ONE_GS": False, "MODE": 0,
     "OUT": 0, "FP": False, "GSRC": 2, "NG": 1, "WRITE_GS": True, "GUIDE": True}, 4)
# ... writing the whole record into TRACE's token rows (REC; SLOTS 8: the routed slots of mlp.experts.w2)
comp(tk._quant2_kernel, dict(q2, out_ptr="*fp32", bits_ptr="*i16"), {"RT": 4, "CT": 128, "ONE_GS": False, "MODE": 0,
     "OUT": 0, "FP": False, "GSRC": 2, "NG": 1, "WRITE_GS": True, "GUIDE": True, "REC": True, "SLOTS": 8}, 4)
r = {"x_ptr": "*bf16", "gs_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*i16", "packed1_ptr": "*i64", "scale1_ptr": "*u8",
     "packed2_ptr": "*i64", "scale2_ptr": "*u8", "idx_ptr": "*i64", "gs2_ptr": "*fp32", "NB": "i32", "NSEL": "i32",
     "GS_DIV": "i32", "NTP": "constexpr", "CT": "constexpr", "HAS_W": "constexpr", "PACK": "constexpr", "OUT": "constexpr"}
for pack in (True, False):
    for has_w in (True, False):
        sig = r if pack else dict(r, idx_ptr="*i32")  # the wrappers' idx types (PACK: int64 even when NSEL = 0)
        comp(tk._residual_tiled_kernel, sig, {"NTP": 2, "CT": 256, "HAS_W": has_w, "PACK": pack, "OUT": 0 if pack else 3}, 4)
comp(tk._residual_tiled_kernel, dict(r, x_ptr="*fp16", out_ptr="*fp16", idx_ptr="*i32"),
     {"NTP": 4, "CT": 64, "HAS_W": False, "PACK": False, "OUT": 2}, 8)
# the RESIDUAL_BY_BLOCKS tiles: 32 blocks x 1 warp (QDQ), 128 blocks x 4 warps (packed)
for pack, ct, ntp, nw in ((False, 32, 4, 1), (True, 128, 4, 4)):
    comp(tk._residual_tiled_kernel, r if pack else dict(r, idx_ptr="*i32"),
         {"NTP": ntp, "CT": ct, "HAS_W": False, "PACK": pack, "OUT": 0 if pack else 3}, nw)
# the STOP timing probes of `bench nvfp4 --residual-probe` (gather QDQ launch of the 8192-wide default tile)
for stop in (1, 2, 3):
    comp(tk._residual_tiled_kernel, dict(r, idx_ptr="*i32", STOP="constexpr"),
         {"NTP": 4, "CT": 128, "HAS_W": False, "PACK": False, "OUT": 3, "STOP": stop}, 4)
# TRACE guided quantize (MODE 0: packed words) and one-launch guided QDQ (MODE 1, bf16 by cvt.rn / fp16 / fp32)
gd = {"x_ptr": "*bf16", "bits_ptr": "*i16", "scale_ptr": "*u8", "gs_ptr": "*fp32", "packed_ptr": "*i64", "NBLK": "i32",
      "NBK": "i32", "GS_DIV": "i32", "BLK": "constexpr", "SPLIT": "constexpr", "MODE": "constexpr", "OUT": "constexpr"}
comp(tk._guided_kernel, gd, {"BLK": 128, "SPLIT": True, "MODE": 0, "OUT": 0}, 2)
import re


def no_float_negation(k, what):
    # kernels that write dequantized values OR the code's sign into the value's bits: no float negation, which
    # triton 3.6 lowers to 0.0 - v (+0.0 for code 8 where the reference has -0.0; the H200 failure of 1cd2ec7's
    # where(c >= 8, -v, v), and the H200 bytes of _dequant_kernel before the fix)
    neg = re.findall(r"fneg|fsub (?:<\d+ x )?float>? (?:zeroinitializer|-?0\.000000e\+00)", k.asm["llir"])
    assert not neg, (what, "negates a float", neg[:3])


for xt, ot, out in (("*bf16", "*i16", 3), ("*bf16", "*i16", 1), ("*fp16", "*fp16", 2), ("*fp32", "*fp32", 0)):
    k = comp(tk._guided_kernel, dict(gd, x_ptr=xt, packed_ptr=ot), {"BLK": 128, "SPLIT": True, "MODE": 1, "OUT": out}, 2)
    no_float_negation(k, ("_guided_kernel MODE 1", xt, out))
dq = {"packed_ptr": "*i64", "scale_ptr": "*u8", "gs_ptr": "*fp32", "out_ptr": "*i16", "NBLK": "i32", "NBK": "i32",
      "GS_DIV": "i32", "BLK": "constexpr", "OUT": "constexpr", "SPLIT": "constexpr"}
for ot, out in (("*i16", 1), ("*fp16", 2), ("*fp32", 0)):
    no_float_negation(comp(tk._dequant_kernel, dict(dq, out_ptr=ot), {"BLK": 128, "OUT": out, "SPLIT": True}, 2),
                      ("_dequant_kernel", out))
print("compiled")
"""


def test_new_kernels_compile_for_sm90_without_a_gpu():
    # The interpreter does not run the GPU compiler's checks (e.g. a loop-carried variable changing type is
    # accepted there and rejected by the compiler): compile the v2 / gather kernels for sm_90 with the
    # ptxas bundled with triton, in a subprocess without TRITON_INTERPRET. Compiles only; nothing runs.
    compile_for_sm90_in_subprocess(_SM90_COMPILE, "on a GPU the kernels are compiled and run by the other tests")


def test_residual_probe_runs_and_refuses_non_gather_or_packed(tk):
    """``bench nvfp4 --residual-probe`` (issue #2 timing probes): every phase launches (interpreter smoke run, timings
    not checked); a STOP on the packed launch or another variant is an error, not a silent full run."""
    from verl_quads.bench import nvfp4 as bn

    table = bn.run_residual_probe(((2, 64),), ratios=(0.5,), device="cpu")
    assert all(f"STOP {s}:" in table for s in (1, 2, 3, 0)) and "ERROR" not in table
    x = torch.randn(2, 64)
    gs = nv.global_scale_from_amax(x.abs().amax(-1, keepdim=True))
    with pytest.raises(ValueError, match="STOP timing probe"):
        tk._residual_rows(x, gs, x, 0.5, None, packed=True, stop=2)
    tk.KERNELS["residual_per_token"] = "row"
    with pytest.raises(ValueError, match="STOP timing probe"):
        tk._residual_rows(x, gs, x, 0.5, None, packed=False, stop=2)
