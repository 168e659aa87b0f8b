"""Permuted NVFP4 weight layout of the Gluon W4A16 prototype (verl_quads/nvfp4/gluon_gemm.py), CPU / torch only:
the round trip packed -> permuted -> packed is the identity (incl. padding of N to 16 and K to 64), the
permuted layout's bit positions are the documented ones (checked element by element against an independent
index formula), and the kernel's decode arithmetic on the permuted words (:func:`decode_permuted`) gives
exactly E2M1(code) * block_scale for every code, including zero / E4M3-subnormal / maximal scales."""

import pytest
import torch

from verl_quads.nvfp4 import device_info as di
from verl_quads.nvfp4 import gluon_gemm as gg
from verl_quads.rollout import emulation as em

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = em.quantize_weight(torch.randn(n, k, generator=g) * 0.02)
    return q.packed, q.block_scale, q.global_scale.reshape(())


def _all_codes_weight(n, k, seed=1):
    """Random bytes (every code at every nibble position) and random scale bytes incl. 0, E4M3 subnormals and
    448 (no NaN 0x7F / 0xFF)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    sb = torch.randint(0, 0x7F, (n, k // 16), generator=g, dtype=torch.uint8)
    sb[:, ::5] = 0
    sb[:, 1::5] = 1
    sb[:, 2::5] = 7
    sb[:, 3::5] = 0x7E  # 448
    sb[::3] |= 0x80  # negative scales: the format never makes them, the decode is sign-exact anyway
    return packed, sb.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("fmt", gg.FORMATS)
@pytest.mark.parametrize("n, k", [(64, 256), (48, 128), (37, 80), (16, 16), (129, 400)])
def test_round_trip(n, k, fmt):
    packed, scale = _all_codes_weight(n, k)
    w = gg.permute_weight(packed, scale, torch.tensor(3.0), fmt=fmt)
    assert w.fmt == fmt
    assert w.wq.dtype == torch.int32 and tuple(w.wq.shape) == (-(-n // 16), -(-k // 64), 32, 4)
    assert w.sq.dtype == torch.uint8 and tuple(w.sq.shape) == (-(-n // 16), -(-k // 64), 8, 4, 2)
    p2, s2 = gg.unpermute_weight(w)
    assert torch.equal(p2, packed)
    assert torch.equal(s2.view(torch.uint8), scale.view(torch.uint8))


@pytest.mark.parametrize("n, k", [(32, 128), (37, 80)])
def test_bit_positions(n, k):
    """Every code lands at the documented (row group, chunk, lane, word, nibble) and every scale byte at its
    (row group, chunk, g, t, rb3): checked by direct indexing, one element at a time (independent of the
    vectorized permutes of permute_weight)."""
    packed, scale = _all_codes_weight(n, k, seed=2)
    w = gg.permute_weight(packed, scale, torch.tensor(1.0))
    wq = w.wq.view(torch.uint8).view(*w.wq.shape[:3], 16)  # little-endian bytes of each lane's 4 words
    sq = w.sq
    sb = scale.view(torch.uint8)
    for row in range(n):
        rg, rem = divmod(row, 16)
        rb3, gi = divmod(rem, 8)
        for col in range(k):
            c, kk = divmod(col, 64)
            t, r2 = divmod(kk, 16)
            s, r3 = divmod(r2, 4)
            kb3, e = divmod(r3, 2)
            j = rb3 + 2 * kb3 + 4 * e
            byte = int(wq[rg, c, gi * 4 + t, s * 4 + j // 2])
            got = (byte >> (4 * (j % 2))) & 15
            want = (int(packed[row, col // 2]) >> (4 * (col % 2))) & 15
            assert got == want, (row, col)
            if col % 16 == 0:
                assert int(sq[rg, c, gi, t, rb3]) == int(sb[row, col // 16]), (row, col)
    # the padding is zero codes and zero scales
    full = torch.zeros(w.nr * 16, w.chunks * 64, dtype=torch.bool)
    full[:n, :k] = True
    dec = gg.decode_permuted(gg.GluonWeight(w.wq, w.sq, w.gs, w.nr * 16, w.chunks * 64))
    assert bool((dec[~full] == 0).all())


@pytest.mark.parametrize("fmt", gg.FORMATS)
@pytest.mark.parametrize("n, k", [(64, 256), (37, 80)])
def test_decode_exact_all_codes(n, k, fmt):
    """The kernel's integer decode (per format: shifts / rotations and masks) of the permuted words, times the
    bf16 scale multiplier, is E2M1(code) * block_scale exactly for every element (reference: a table lookup on
    the plain packed codes)."""
    packed, scale = _all_codes_weight(n, k, seed=3)
    w = gg.permute_weight(packed, scale, torch.tensor(1.0), fmt=fmt)
    got = gg.decode_permuted(w)
    tab = torch.tensor(E2M1 + tuple(-v for v in E2M1))
    lo, hi = packed & 15, packed >> 4
    codes = torch.stack([lo, hi], -1).flatten(-2).long()
    want = tab[codes] * scale.to(torch.float32).repeat_interleave(16, dim=1)  # exact products in float32
    assert torch.equal(got, want)
    assert torch.equal(gg.reference_weight(packed, scale), want)
    # the codes 8 (-0) keep their sign bit: -0.0 * positive scale
    neg0 = (codes == 8) & (scale.to(torch.float32).repeat_interleave(16, dim=1) > 0)
    assert bool(torch.signbit(got[neg0]).all())


def test_formats_differ_only_in_bits():
    """Format 2 holds the same codes as format 1 (same round trip), in other bit positions of the same words."""
    packed, scale = _all_codes_weight(32, 128, seed=4)
    w1, w2 = (gg.permute_weight(packed, scale, torch.tensor(1.0), fmt=f) for f in (1, 2))
    assert torch.equal(w1.sq, w2.sq) and not torch.equal(w1.wq, w2.wq)
    ones = lambda t: int(sum(((t.to(torch.int64) & 0xFFFFFFFF) >> b & 1).sum() for b in range(32)))
    assert ones(w1.wq) == ones(w2.wq)  # a bit permutation of each word


def test_decode_matches_reference_dequant():
    """Times the rounded reciprocal of the global scale the decoded weight is em.weight_f32's value up to
    float32 rounding (the reference multiplies by fl(scale / gs) first): relative <= 2 eps_f32."""
    packed, scale, gs = _weight(48, 192)
    w = gg.permute_weight(packed, scale, gs)
    ref = em.weight_f32(packed, scale, gs)
    got = gg.decode_permuted(w) * (1.0 / gs)
    assert bool(((got - ref).abs() <= 2 * torch.finfo(torch.float32).eps * ref.abs()).all())


def test_plan_covers_all_chunks():
    packed, scale, gs = _weight(16 * 9, 64 * 13)
    w = gg.permute_weight(packed, scale, gs)
    for cfg in [gg.GluonConfig(num_warps=4, kc=2), gg.GluonConfig(num_warps=8, kc=4, occ=2),
                gg.GluonConfig(num_warps=2, kc=1, split=3)]:
        grid_n, split, cps, even = gg.plan(w, cfg, sms=132)
        assert grid_n * cfg.num_warps >= w.nr and (grid_n - 1) * cfg.num_warps < w.nr
        assert cps % cfg.kc == 0 and split * cps >= w.chunks and (split - 1) * cps < w.chunks
        assert even == (w.chunks % cps == 0 and w.k == 64 * w.chunks)


def test_dispatch_never_picks_gluon_on_cpu_or_interpreter():
    """GLUON_TABLE (dense bf16 w4a16, M <= 16, sm_90 only): on CPU / under the interpreter the default dispatch
    does not choose it; an explicit GluonConfig there raises (no silent fallback)."""
    from verl_quads.nvfp4 import gluon_dispatch as gd
    from verl_quads.nvfp4 import triton_gemm as tg

    from verl_quads.nvfp4.gluon_tma import TmaConfig

    assert gd.GLUON_TABLE and all(isinstance(c, (gg.GluonConfig, TmaConfig)) for c in gd.GLUON_TABLE.values())
    assert all(b <= 16 for b, _, _ in gd.GLUON_TABLE)
    packed, scale, gs = _weight(4096, 4096)
    x = torch.randn(4, 4096).to(torch.bfloat16)
    assert gd.gluon_dense_config(x, packed) is None  # CPU tensor
    assert not gg.std_supported(x, packed)
    act, _ = tg.quantize_activation(x[:, :128], "w4a16")
    with pytest.raises((ValueError, RuntimeError)):
        tg.nvfp4_gemm(act, packed[:16, :64], scale[:16, :8], gs, config=gg.GluonConfig())
    with pytest.raises(RuntimeError, match="gluon_w4a16_tma cannot run"):
        tg.nvfp4_gemm(act, packed[:16, :64], scale[:16, :8], gs, config=TmaConfig())


def _nib(w: torch.Tensor, j: int) -> torch.Tensor:
    return ((w.to(torch.int64) & 0xFFFFFFFF) >> (4 * j)) & 15


@pytest.mark.parametrize("wpt", [4, 8])
@pytest.mark.parametrize("nw, kc, nt", [(1, 1, 1), (2, 2, 2)])
def test_std_kernel_operand_index_math(wpt, nw, kc, nt):
    """The standard-layout kernel's operand construction (gluon_gemm._std_chunk_loads / _std_chunk_mma), replayed
    in torch with the same offsets, joins (stack on a new last dim), permutes and row-major reshapes, with the
    nibble values as weights and small integers as activations: the MMA operands A [16 NW, KC chunk] and
    B [KC chunk, 8 NT] of one iteration must multiply to W[rows, cols] @ x[:, cols].T exactly (A and B share one
    K permutation). A layout mismatch with the MMA fragments is excluded at compile time (assert_trivial)."""
    ce = 32 * wpt  # chunk elements
    n, k, c = 16 * nw + 5, ce * kc * 3, 1  # iteration starting at chunk c (of KC chunks)
    g = torch.Generator().manual_seed(wpt + nw)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    m = 8 * nt
    x = torch.randint(-8, 9, (m, k), generator=g).to(torch.bfloat16)
    kw, ib_n = k // 8, wpt // 2
    words = packed.view(torch.int32).reshape(-1)
    ar = torch.arange
    # weight words [NW, 2, 8, 4, KC, WPT] (woff of the kernel)
    row = (ar(nw).view(-1, 1, 1, 1, 1, 1) * 16 + ar(2).view(1, -1, 1, 1, 1, 1) * 8 + ar(8).view(1, 1, -1, 1, 1, 1))
    woff = (row * kw + ar(kc).view(1, 1, 1, 1, -1, 1) * (4 * wpt) + ar(4).view(1, 1, 1, -1, 1, 1) * wpt
            + ar(wpt).view(1, 1, 1, 1, 1, -1)) + c * (4 * wpt)
    wd = words[woff].reshape(nw, 2, 8, 4, kc, ib_n, 2)
    pairs = [torch.stack([_nib(wd, p), _nib(wd, p + 4)], -1).float() for p in range(4)]
    a = torch.stack([torch.stack([pairs[0], pairs[1]], -1), torch.stack([pairs[2], pairs[3]], -1)], -1)
    a = a.permute(0, 1, 2, 4, 5, 6, 9, 8, 3, 7).reshape(nw * 16, kc * ce)
    # activation [NT, 8, 4, KC, 8 WPT] (xoff of the kernel)
    xs = x.float().reshape(-1)
    xoff = ((ar(nt).view(-1, 1, 1, 1, 1) * 8 + ar(8).view(1, -1, 1, 1, 1)) * k
            + ar(kc).view(1, 1, 1, -1, 1) * ce + ar(4).view(1, 1, -1, 1, 1) * (8 * wpt)
            + ar(8 * wpt).view(1, 1, 1, 1, -1)) + c * ce
    xv = xs[xoff].reshape(nt, 8, 4, kc, ib_n, 2, 2, 2, 2)  # [nt, g, t, kc, ib, il, e, sh, kb3]
    b = xv.permute(3, 4, 5, 7, 8, 2, 6, 0, 1).reshape(kc * ce, nt * 8)
    codes = torch.stack([packed & 15, packed >> 4], -1).flatten(-2).float()
    cols = slice(c * ce, (c + kc) * ce)
    want = codes[: nw * 16, cols] @ x[:, cols].float().t()
    assert torch.equal(a @ b, want)
    # and it is not trivially equal: a wrong pairing of the activation (e and kb3 swapped) gives another result
    b_bad = xv.permute(3, 4, 5, 7, 6, 2, 8, 0, 1).reshape(kc * ce, nt * 8)
    assert not torch.equal(a @ b_bad, want)


def test_dispatch_takes_gluon_only_where_it_can_run(monkeypatch, caplog):
    """The default dispatch's choice (no GPU: availability, triton version and device capability patched): the
    table entry on sm_90 when Gluon can run; else None (the Triton kernels) with ONE warning per process naming the
    triton version; never on other capabilities / M > 16 / K % 128; an explicit GluonConfig raises instead."""
    import logging

    from verl_quads.nvfp4 import gluon_dispatch as gd

    assert gd.gluon_table_entry(4, 8192, 8192, (9, 0)) is gd.GLUON_TABLE[(4, 8192, 8192)]
    assert gd.gluon_table_entry(3, 8192, 8192, (9, 0)) is gd.GLUON_TABLE[(4, 8192, 8192)]  # next bucket
    for args in [(4, 8192, 8192, (10, 0)), (4, 8192, 8192, (8, 0)), (1, 2048, 4096, (9, 0)), (32, 8192, 8192, (9, 0)),
                 (4, 8192, 8000, (9, 0)), (4, 1234, 8192, (9, 0))]:
        assert gd.gluon_table_entry(*args) is None, args

    x = torch.zeros(4, 8192, dtype=torch.bfloat16)
    w = torch.zeros(8192, 4096, dtype=torch.uint8)

    class FakeDevice:
        type = "cuda"

    class FakeX:  # a CUDA-looking bf16 activation, shape [4, 8192]
        device, dtype, shape = FakeDevice(), torch.bfloat16, x.shape

    monkeypatch.setattr(gd, "interpreting", lambda: False)
    monkeypatch.setattr(di, "capability", lambda dev=None: (9, 0))
    monkeypatch.setattr(gg, "gluon_available", lambda: (True, ""))
    assert gd.gluon_dense_config(FakeX(), w) is gd.GLUON_TABLE[(4, 8192, 8192)]

    monkeypatch.setattr(gg, "gluon_available", lambda: (False, "triton 3.5.0 < 3.6"))
    monkeypatch.setattr(gd, "_GLUON_WARNED", [])
    with caplog.at_level(logging.WARNING, logger=gd.__name__):
        assert gd.gluon_dense_config(FakeX(), w) is None
        assert gd.gluon_dense_config(FakeX(), w) is None
    warns = [r for r in caplog.records if "Gluon W4A16" in r.getMessage()]
    assert len(warns) == 1 and "triton 3.5.0" in warns[0].getMessage()

    monkeypatch.setattr(di, "capability", lambda dev=None: (8, 0))
    monkeypatch.setattr(gg, "gluon_available", lambda: (True, ""))
    assert gd.gluon_dense_config(FakeX(), w) is None  # measured on sm_90 only

    # explicit request where it cannot run: a clear error, no fallback
    monkeypatch.setattr(gg, "gluon_available", lambda: (False, "triton 3.5.0 < 3.6"))
    with pytest.raises(RuntimeError, match="3.5.0"):
        gg.gluon_w4a16_std(x, w, torch.zeros(8192, 512, dtype=torch.uint8).view(torch.float8_e4m3fn),
                           torch.ones(()))


def test_gluon_available_version_gate(monkeypatch):
    ok, why = gg.gluon_available()
    assert ok == (gg.gluon is not None and gg.triton_version() >= gg.MIN_TRITON), why
    monkeypatch.setattr(gg, "triton_version", lambda: (3, 5))
    ok, why = gg.gluon_available()
    assert not ok and "3.6" in why


def _fmt3_ptx(src: str) -> dict:
    """The FMT == 3 branch's PTX per pair P, read from _pair_asm's source text."""
    import re

    body = src.split("if FMT == 3:")[1].split("elif FMT == 2")[0]
    out = {}
    for p, chunk in enumerate(re.split(r"\n\s*(?:elif P == \d|else):", body)):
        out[p] = " ".join(re.findall(r'"([^"]*)"', chunk))
    return out


def _run_ptx(ops: str, word: int) -> int:
    """A tiny interpreter of the integer PTX used by the FMT 3 decode (and.b32 / mul.lo.u32 / shr.u32 on t, $1,
    immediates), 32-bit unsigned."""
    regs = {"$1": word}

    def val(tok):
        return regs[tok] if tok in regs else int(tok, 0)

    n_ops = 0
    for ins in filter(None, (i.strip() for i in ops.split(";"))):
        op, args = ins.split(None, 1)
        d, a, b = (t.strip() for t in args.split(","))
        if op == "and.b32":
            regs[d] = val(a) & val(b)
        elif op == "mul.lo.u32":
            regs[d] = (val(a) * val(b)) & 0xFFFFFFFF
        elif op == "shr.u32":
            regs[d] = val(a) >> val(b)
        else:
            raise AssertionError(f"unexpected PTX op {op}")
        n_ops += 1
    return regs["t"], n_ops


def test_std_decode3_ptx_equals_shift_decode():
    """_pair_asm's FMT 3 (mask + multiply) PTX, interpreted from its source, builds the same bf16x2 register as
    format 1's shift decode (_pair_bits, the torch model of the kernel's FMT 1 asm checked by the tests above) for
    every pair P and every value of the pair's 8 code bits (other bits random), in at most 4 integer ops."""
    if gg.gluon is None:
        pytest.skip("no Gluon")
    ptx = _fmt3_ptx(gg._pair_asm.src)
    assert sorted(ptx) == [0, 1, 2, 3]
    g = torch.Generator().manual_seed(3)
    noise = torch.randint(0, 2**31, (256,), generator=g).tolist()
    for p in range(4):
        keep = (15 << 4 * p) | (15 << (4 * p + 16))
        for v in range(256):
            word = ((v & 15) << 4 * p) | ((v >> 4) << (4 * p + 16)) | (noise[v] * 2 + v % 2) & ~keep & 0xFFFFFFFF
            got, n_ops = _run_ptx(ptx[p], word)
            want = int(gg._pair_bits(torch.tensor([word], dtype=torch.int64), p, 1)[0])
            assert got == want, (p, hex(word), hex(got), hex(want))
            assert n_ops <= 4


def test_std_plan_row_groups():
    """std_plan with rg row groups per warp: grid_n programs of 16 num_warps rg rows cover N exactly once (no
    program wholly past N), the K ranges cover every 128-element chunk once, kc divides the range."""
    for n, k in [(8192, 8192), (4104, 1152), (1000, 2176), (2048, 4096), (5120, 2048)]:
        chunks = k // gg.STD_CHUNK
        for cfg in [gg.GluonConfig(4, 1, 0, 2, rg=2), gg.GluonConfig(4, 1, 0, 2, rg=4),
                    gg.GluonConfig(8, 1, 0, 2, prefetch=False, rg=2), gg.GluonConfig(4, 2, 3, 2, rg=2)]:
            grid_n, split, cps, even = gg.std_plan(n, k, cfg)
            rows = 16 * cfg.num_warps * cfg.rg
            assert grid_n * rows >= n and (grid_n - 1) * rows < n, (n, cfg.label, grid_n)
            assert cps % cfg.kc == 0 and split * cps >= chunks and (split - 1) * cps < chunks
            assert even == (chunks % cps == 0)
    # rg 1 unchanged: d8192 with 4 warps, occ 2 on 132 SMs: 128 programs along N, 4 K ranges of 16 chunks
    assert gg.std_plan(8192, 8192, gg.GluonConfig(4, 1, 0, 2)) == (128, 4, 16, True)
    # rg 2: 64 programs along N, so >= 264 / 64 -> 5 K ranges wanted; 64 chunks: the first even split >= 5 is 8
    assert gg.std_plan(8192, 8192, gg.GluonConfig(4, 1, 0, 2, rg=2)) == (64, 8, 8, True)


def test_probe_parse_std():
    from verl_quads.bench.gluon_probe import parse_std

    G = gg.GluonConfig
    assert parse_std("w8:pf0,w4:rg2:ev2:d3,w4:kc2:s3:o4,w4,w8:pd2") == [
        G(8, 1, 0, 2, prefetch=False), G(4, 1, 0, 2, rg=2, wev=2, dec=3), G(4, 2, 3, 4), G(4, 1, 0, 2), G(8, 1, 0, 2, pfd=2)]
    assert G(4, 1, 0, 2, rg=2, wev=2, dec=3).label == "w4 kc1 sa2 pf1 rg2 ev2 d3"
    with pytest.raises(ValueError):
        parse_std("w4:x2")


def test_std_plan_k_slices():
    """GluonConfig.ks (K slices inside a program): ``num_warps / ks`` warps per slice set the rows of a program, each
    program's range is ks slices of ``cps / ks`` chunks; split 1 at d8192 / d4096 = the table's global split 8
    boundaries (8 / 4 chunks a slice)."""
    G = gg.GluonConfig
    assert gg.std_plan(8192, 8192, G(8, 1, 1, 2, rg=2, dec=3, ks=8)) == (256, 1, 64, True)
    assert gg.std_plan(8192, 8192, G(4, 1, 0, 2, rg=2, dec=3, xs=True))[1:3] == (8, 8)
    assert gg.std_plan(4096, 4096, G(8, 1, 1, 2, dec=3, ks=8)) == (256, 1, 32, True)
    assert gg.std_plan(8192, 8192, G(8, 1, 2, 2, rg=2, ks=4)) == (128, 2, 32, True)
    assert gg.std_plan(1000, 2176, G(8, 1, 1, 2, ks=8)) == (63, 1, 24, False)  # 17 chunks: slices of 3, 3, .., 2, 0, 0
    assert G(8, 1, 1, 2, ks=8).label.endswith(" ks8")
