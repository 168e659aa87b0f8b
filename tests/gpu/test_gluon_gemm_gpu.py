"""Gluon W4A16 prototype (verl_quads/nvfp4/gluon_gemm.py) on a CUDA GPU (sm_80+, triton >= 3.6 with Gluon): dense
decode shapes M = 1..16 (+ odd N / K: padded row groups and chunks, masked tails) against the rollout's torch
reference (verl_quads/rollout/emulation.py). Per element |y - ref| <= 1 bf16 ulp(ref) + 4 K eps_f32 (|x| @ |w|.T)
(the bound of tests/gpu/test_nvfp4_gemm_stream_gpu.py); one-hot rows bit for bit against the dequantized weight
(codes 0/1: bf16 subnormal inputs of the packed multiply; E4M3-subnormal and zero scales; every nibble position);
the split-K fixup deterministic over many launches; CUDA-graph replay."""

import dataclasses

import pytest
import torch

from _gemm_helpers import check_close as _check
from _gemm_helpers import rand_w as _w
from _gemm_helpers import rand_x as _x
from _gemm_helpers import w4a16_case
from verl_quads.bench.gluon_probe import xs_alternatives, xs_candidates
from verl_quads.nvfp4 import gluon_gemm as gg
from verl_quads.nvfp4 import gluon_tma as gt
from verl_quads.rollout import emulation as em

pytestmark = pytest.mark.gpu
DEV = "cuda"
G = gg.GluonConfig

if gg.gluon is None:
    pytest.skip("triton.experimental.gluon not available", allow_module_level=True)

CFGS = [G(4, 2, 0, 4), G(8, 4, 0, 2), G(4, 2, 1, 4), G(2, 1, 3, 4, prefetch=False), G(4, 2, 0, 4, asm=False)]
QUICK = [CFGS[0], CFGS[3], CFGS[4]]  # odd shapes: permuted layout (the standard layout's tests below cover more)


def _case(m, n, k, cfg, seed=0, fmt=1):
    q = em.quantize_weight(_w((n, k), seed=seed + 1))
    gs = q.global_scale.reshape(())
    w = gg.permute_weight(q.packed, q.block_scale, gs, fmt=fmt)
    x = _x(m, k, seed)
    xf, _ = em.quantize_activation(x, em.ActQuant("w4a16", 0.5, False))
    wf = em.weight_f32(q.packed, q.block_scale, gs)
    ref = em.gemm(xf, wf, None, x.dtype)
    y = gg.gluon_w4a16(x, w, cfg)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _check(y, ref, xf, wf, f"{cfg.label} fmt {fmt} M={m} N={n} K={k}")


@pytest.mark.parametrize("fmt", [1, 2])
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n, k", [(8192, 8192), (4096, 4096)])
def test_dense_decode(m, n, k, fmt):
    _case(m, n, k, CFGS[0], fmt=fmt)


@pytest.mark.parametrize("cfg", QUICK, ids=lambda c: c.label)
@pytest.mark.parametrize("m, n, k", [(3, 4096, 4096), (5, 1000, 2064), (11, 4104, 1040), (1, 24, 16)])
def test_configs_and_odd_shapes(cfg, m, n, k):
    _case(m, n, k, cfg, seed=m, fmt=2 if cfg.asm and m % 2 else 1)


def _one_hot_columns():
    """16 columns of a K = 1024 weight: blocks with every scale residue mod 7 of the one-hot tests (0: zero scale,
    1 / 2: E4M3 subnormals 2**-9 / 7 * 2**-9, others: the quantizer's), at varied positions in the 64 / 128 chunks."""
    blocks = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8, 9, 15, 16, 22, 23, 29, 36, 43])
    ks = blocks * 16 + (torch.arange(16) * 5 + 3) % 16
    assert {int(b) % 7 for b in blocks} >= {0, 1, 2} and len({int(c) % 64 for c in ks}) == 16
    return ks.to(DEV)


def _one_hot_case(run, what):
    """Each output is one product: it must equal bf16(E2M1 * block_scale * fl(1 / gs) * 3) bit for bit -- codes
    0/1 (bf16 subnormal 2**-127 before the packed scale multiply), -0, zero and E4M3-subnormal block scales,
    16 columns at different chunk positions. ``run(packed, scale, gs, x)`` -> y."""
    n, k = 256, 1024
    q = em.quantize_weight(_w((n, k)))
    packed = torch.arange(256, dtype=torch.uint8, device=DEV).repeat(n, k // 2 // 256).roll(1, 1).contiguous()
    scale = q.block_scale.view(torch.uint8).clone()
    scale[:, ::7] = 0
    scale[:, 1::7] = 1
    scale[:, 2::7] = 7
    scale = scale.view(torch.float8_e4m3fn)
    gs = q.global_scale.reshape(())
    ks = _one_hot_columns()
    x = torch.zeros(16, k, dtype=torch.bfloat16, device=DEV)
    x[torch.arange(16, device=DEV), ks] = 3.0
    y = run(packed, scale, gs, x)
    wq = gg.reference_weight(packed, scale)  # E2M1 * scale, exact float32
    want = ((wq[:, ks] * 3.0).t() * torch.reciprocal(gs.float())).to(torch.bfloat16)
    assert torch.equal(y, want), f"{what}: {int((y != want).sum())} outputs differ"
    assert bool((wq[:, ks] != 0).any()) and bool((wq[:, ks] < 0).any())
    assert bool(((wq[:, ks].abs() > 0) & (wq[:, ks].abs() < 2.0**-8)).any())  # E4M3-subnormal scale 2**-9 products


@pytest.mark.parametrize("cfg, fmt", [(CFGS[0], 1), (CFGS[1], 1), (CFGS[4], 1), (CFGS[0], 2), (CFGS[1], 2)],
                         ids=lambda v: v.label if isinstance(v, G) else f"fmt{v}")
def test_one_hot_exact(cfg, fmt):
    _one_hot_case(lambda p, s, gs, x: gg.gluon_w4a16(x, gg.permute_weight(p, s, gs, fmt=fmt), cfg),
                  f"perm {cfg.label} fmt {fmt}")


def test_split_fixup_deterministic_and_graph():
    """Split-K partials summed by the last program of each tile: the same bits as the unsplit kernel is not
    required (float32 order differs), but the same bits over 100 launches is; captured in a CUDA graph and
    replayed with new inputs it gives the eager result."""
    n, k = 8192, 8192
    q = em.quantize_weight(_w((n, k)))
    gs = q.global_scale.reshape(())
    w = gg.permute_weight(q.packed, q.block_scale, gs)
    x = _x(4, k)
    cfg = G(4, 2, 0, 8)
    assert gg.plan(w, cfg)[1] > 1
    ref = gg.gluon_w4a16(x, w, cfg)
    bad = sum(not torch.equal(gg.gluon_w4a16(x, w, cfg), ref) for _ in range(100))
    assert bad == 0, f"{bad} of 100 runs differ"
    xs = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gg.gluon_w4a16(xs, w, cfg)
    for seed in (5, 6):
        x2 = _x(4, k, seed)
        xs.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gg.gluon_w4a16(x2, w, cfg))


# --------------------------------------------------------------------------- standard layout (gluon_w4a16_std)

STD_CFGS = [G(4, 1, 0, 2), G(4, 1, 0, 2, prefetch=False), G(8, 1, 0, 2, prefetch=False), G(8, 2, 0, 2),
            G(4, 1, 1, 4)]


def _std_case(m, n, k, cfg, seed=0, bias=False, w_seed=None):
    """gluon_w4a16_std with ``cfg`` on random inputs (weight seed ``w_seed``, default seed + 1), checked against the
    reference bound; returns (y, the call's inputs ``(x, packed, block_scale, gs, bias)``) for further comparisons."""
    return w4a16_case(lambda *a: gg.gluon_w4a16_std(*a, cfg), m, n, k, f"std {cfg.label}", seed, bias, w_seed)


#: The table's std entries with the re-encoded words (decode 2: spread_std, decode 4: adjacent_std; session 15).
REENCODED = ["w4:o2:rg2:d4:xs1:r128", "w8:s1:o2:pf0:d4:ks8", "w4:o2:d4:xs1", "w4:o2:d4:xs1:r128", "w4:o2:rg2:d2:xs1"]


@pytest.mark.parametrize("spec", REENCODED)
@pytest.mark.parametrize("m, n, k, bias", [(1, 8192, 8192, False), (16, 8192, 8192, True), (4, 4096, 4096, True),
                                           (9, 1040, 2304, False)])
def test_std_reencoded_words(spec, m, n, k, bias):
    """Decodes 2 / 4 read spread_std's / adjacent_std's words: within the bound; decode 2 builds the same registers as
    decode 3 on the plain codes (the same bytes)."""
    from verl_quads.bench.gluon_probe import parse_std

    cfg = parse_std(spec)[0]
    y, (x, p, s, gs, b) = w4a16_case(lambda x, p, s, gs, b: gg.gluon_w4a16_std(x, gg.std_words(p, cfg.dec), s, gs, b,
                                                                               cfg), m, n, k, f"std {cfg.label}", m + 5,
                                     bias)
    if cfg.dec == 2:
        assert torch.equal(y, gg.gluon_w4a16_std(x, p, s, gs, b, dataclasses.replace(cfg, dec=3)))


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n, k", [(8192, 8192), (4096, 4096)])
def test_std_dense_decode(m, n, k):
    _std_case(m, n, k, STD_CFGS[0], seed=m)


@pytest.mark.parametrize("cfg", STD_CFGS, ids=lambda c: c.label)
@pytest.mark.parametrize("m, n, k, bias", [(3, 4096, 4096, True), (16, 8192, 8192, False), (5, 1000, 2176, True),
                                           (11, 4104, 1152, False), (1, 24, 128, True), (9, 2048, 768, True)])
def test_std_configs_and_odd_shapes(cfg, m, n, k, bias):
    _std_case(m, n, k, cfg, seed=m, bias=bias)


@pytest.mark.parametrize("cfg", STD_CFGS[:2], ids=lambda c: c.label)
def test_std_one_hot_exact(cfg):
    _one_hot_case(lambda p, s, gs, x: gg.gluon_w4a16_std(x, p, s, gs, None, cfg), f"std {cfg.label}")


def test_std_rejects_unsupported():
    q = em.quantize_weight(_w((256, 1040)))
    gs = q.global_scale.reshape(())
    with pytest.raises(ValueError):  # K % 128 != 0
        gg.gluon_w4a16_std(_x(2, 1040), q.packed, q.block_scale, gs)
    q = em.quantize_weight(_w((256, 1024)))
    with pytest.raises(ValueError):  # float32 activation
        gg.gluon_w4a16_std(_x(2, 1024).float(), q.packed, q.block_scale, q.global_scale.reshape(()))
    with pytest.raises(ValueError):  # M > 16
        gg.gluon_w4a16_std(_x(17, 1024), q.packed, q.block_scale, q.global_scale.reshape(()))


def test_std_split_deterministic_and_graph():
    n, k = 8192, 8192
    q = em.quantize_weight(_w((n, k)))
    gs = q.global_scale.reshape(())
    x = _x(4, k)
    cfg = G(4, 1, 0, 8)
    assert gg.std_plan(n, k, cfg)[1] > 1
    ref = gg.gluon_w4a16_std(x, q.packed, q.block_scale, gs, None, cfg)
    bad = sum(not torch.equal(gg.gluon_w4a16_std(x, q.packed, q.block_scale, gs, None, cfg), ref) for _ in range(100))
    assert bad == 0, f"{bad} of 100 runs differ"
    xs = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gg.gluon_w4a16_std(xs, q.packed, q.block_scale, gs, None, cfg)
    for seed in (5, 6):
        x2 = _x(4, k, seed)
        xs.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gg.gluon_w4a16_std(x2, q.packed, q.block_scale, gs, None, cfg))


# --------------------------------------------------------------------------- std kernel options (session 10)
# rg (row groups per warp), wev (weight-load cache hint), dec (pair decode 3: mask + multiply) change neither the
# decoded bf16 registers nor any row's MMA / split-K order: at the same split the bytes must equal the plain kernel's.

OPT_CFGS = [G(4, 1, 2, 2, rg=2), G(4, 1, 2, 2, rg=4), G(8, 1, 2, 2, prefetch=False, rg=2), G(4, 1, 2, 2, wev=1),
            G(4, 1, 2, 2, wev=2), G(4, 1, 2, 2, dec=3), G(8, 1, 2, 2, prefetch=False, dec=3, wev=2),
            G(4, 1, 2, 2, rg=2, wev=2, dec=3), G(4, 1, 1, 2, rg=2, dec=3), G(4, 1, 3, 2, prefetch=False, rg=4, dec=3),
            G(8, 1, 2, 2, pfd=2, dec=3), G(4, 2, 3, 2, pfd=2),
            G(4, 1, 2, 2, xs=True, dec=3), G(8, 1, 2, 2, prefetch=False, xs=True, xsc=2, xsb=2, dec=3),
            G(4, 1, 2, 2, prefetch=False, rg=2, xs=True, dec=3), G(4, 1, 3, 2, pfd=2, xs=True, xsc=3)]


def _plain(cfg):
    return G(cfg.num_warps, cfg.kc, cfg.split, cfg.occ, prefetch=cfg.prefetch or cfg.pfd > 0)


@pytest.mark.parametrize("cfg", OPT_CFGS, ids=lambda c: c.label)
@pytest.mark.parametrize("m, n, k, bias", [(1, 4096, 4096, False), (16, 4096, 4096, False), (5, 1000, 2176, True),
                                           (11, 4104, 1152, False), (8, 2048, 4096, True)])
def test_std_options_bit_equal_plain(cfg, m, n, k, bias):
    y, args = _std_case(m, n, k, cfg, seed=m, bias=bias)
    want = gg.gluon_w4a16_std(*args, _plain(cfg))
    assert torch.equal(y, want), f"{cfg.label} M={m} N={n} K={k}: {int((y != want).sum())} outputs differ from plain"


@pytest.mark.parametrize("cfg", [G(4, 1, 0, 2, rg=2, dec=3), G(8, 1, 0, 2, prefetch=False, dec=3, wev=2),
                                 G(4, 1, 0, 2, prefetch=False, rg=2, xs=True, dec=3)],
                         ids=lambda c: c.label)
def test_std_options_one_hot_exact(cfg):
    _one_hot_case(lambda p, s, gs, x: gg.gluon_w4a16_std(x, p, s, gs, None, cfg), f"std {cfg.label}")


def _table_keys():
    from verl_quads.nvfp4 import gluon_dispatch as gd

    return sorted(gd.GLUON_TABLE)


@pytest.mark.parametrize("key", _table_keys(), ids=lambda kk: f"b{kk[0]}-{kk[1]}x{kk[2]}")
def test_gluon_table_entry_dispatch(key):
    """Every GLUON_TABLE entry through the default dense dispatch (nvfp4_linear w4a16) at the bucket's largest and
    smallest M: within the bound of the torch reference, and the bytes of gluon_w4a16_std (gluon_w4a16_tma for a
    TmaConfig entry) with the entry's config (the dispatch took the entry)."""
    from verl_quads.nvfp4 import gluon_dispatch as gd
    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.nvfp4 import triton_stream as ts

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("GLUON_TABLE entries are taken on sm_90 only")
    bucket, n, k = key
    cfg = gd.GLUON_TABLE[key]
    lo = max([b for b in ts.DECODE_BUCKETS if b < bucket], default=0) + 1
    q = em.quantize_weight(_w((n, k), seed=bucket))
    gs = q.global_scale.reshape(())
    wf = em.weight_f32(q.packed, q.block_scale, gs)
    for m in sorted({lo, bucket}):
        x = _x(m, k, m + bucket)
        y = tg.nvfp4_linear(x, q.packed, q.block_scale, gs, None, "w4a16")
        run = gt.gluon_w4a16_tma if isinstance(cfg, gt.TmaConfig) else gg.gluon_w4a16_std
        assert torch.equal(y, run(x, q.packed, q.block_scale, gs, None, cfg)), f"{key} M={m}"
        xf, _ = em.quantize_activation(x, em.ActQuant("w4a16", 0.5, False))
        _check(y, em.gemm(xf, wf, None, x.dtype), xf, wf, f"table {key} {cfg.label} M={m}")


#: session 10 call 2: the activation-staging (xs) twin of every GLUON_TABLE entry (gluon_probe.xs_candidates),
#: validated through the dispatch here and timed by gluon_probe --configs table-xs in the same call; adopted into
#: GLUON_TABLE only where they win (measured entries only)
XS_CANDIDATES = sorted(xs_candidates().items()) + sorted(xs_alternatives().items())


@pytest.mark.parametrize("key, cfg", XS_CANDIDATES, ids=[f"b{k[0]}-{k[1]}x{k[2]}-{c.label}" for k, c in XS_CANDIDATES])
def test_xs_candidate_dispatch(key, cfg, monkeypatch):
    """The xs twin of each GLUON_TABLE entry put in the table: the same checks as test_gluon_table_entry_dispatch
    (bytes of gluon_w4a16_std with the config, bound vs the torch reference) at the bucket's smallest and largest M."""
    from verl_quads.nvfp4 import gluon_dispatch as gd

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("GLUON_TABLE entries are taken on sm_90 only")
    monkeypatch.setitem(gd.GLUON_TABLE, key, cfg)
    test_gluon_table_entry_dispatch(key)


# --------------------------------------------------------------------------- split-K inside the program (ks, session 13)
# ks K slices per program, summed through shared memory in the order 0, 1, ..: with one program along K (split 1)
# the operations of the global split-K fixup at the same slice boundaries, so the bytes must equal the plain kernel
# with split = ks; with split > 1 (two levels) only the reference bound applies.

KS_CFGS = [G(8, 1, 1, 2, rg=2, dec=3, ks=8), G(8, 1, 1, 2, rg=4, dec=3, ks=8), G(4, 1, 1, 2, rg=2, dec=3, ks=4),
           G(8, 1, 1, 2, rg=2, dec=3, ks=4), G(8, 1, 1, 2, prefetch=False, dec=3, ks=8), G(2, 1, 1, 2, ks=2)]


@pytest.mark.parametrize("cfg", KS_CFGS, ids=lambda c: c.label)
@pytest.mark.parametrize("m, n, k, bias", [(1, 8192, 8192, False), (4, 8192, 8192, False), (16, 4096, 4096, False),
                                           (5, 1000, 2176, True), (11, 4104, 1152, False), (1, 24, 128, True)])
def test_std_ks_bit_equal_global_split(cfg, m, n, k, bias):
    y, args = _std_case(m, n, k, cfg, seed=m, bias=bias, w_seed=m + 3)
    plain = G(4, 1, cfg.ks, 2, prefetch=cfg.prefetch, dec=cfg.dec)
    assert gg.std_plan(n, k, plain)[2] * cfg.ks == gg.std_plan(n, k, cfg)[2]  # the same slice boundaries
    want = gg.gluon_w4a16_std(*args, plain)
    assert torch.equal(y, want), f"{cfg.label} M={m} N={n} K={k}: {int((y != want).sum())} outputs differ"


@pytest.mark.parametrize("cfg", [G(8, 1, 2, 2, rg=2, dec=3, ks=4), G(8, 1, 0, 2, rg=2, dec=3, ks=8),
                                 G(4, 1, 3, 2, ks=2)], ids=lambda c: c.label)
@pytest.mark.parametrize("m, n, k, bias", [(4, 8192, 8192, False), (16, 4096, 4096, True), (5, 1000, 2176, True)])
def test_std_ks_with_global_split(cfg, m, n, k, bias):
    """ks slices inside programs AND programs along K (the in-program sum is each program's partial of the global
    fixup): within the reference bound, the same bytes over repeated launches."""
    ref, args = _std_case(m, n, k, cfg, seed=m, bias=bias)
    assert all(torch.equal(gg.gluon_w4a16_std(*args, cfg), ref) for _ in range(20))


@pytest.mark.parametrize("cfg", [G(8, 1, 1, 2, prefetch=False, dec=3, ks=8, up=4), G(16, 1, 1, 2, prefetch=False, dec=3,
                                                                                ks=16, up=2),
                                 G(4, 1, 2, 2, prefetch=False, dec=3, ks=4, up=4), G(8, 1, 1, 2, rg=2, dec=3, ks=8,
                                                                                 prefetch=False, up=4)],
                         ids=lambda c: c.label)
@pytest.mark.parametrize("m, bias", [(1, False), (4, True), (16, False)])
def test_std_ks_up_bit_equal_loop(cfg, m, bias):
    """``up`` (session 36: a slice's chunks all loaded before the first is decoded) gives the loop's bytes: the same
    MMAs in the same order (4096x4096: chunks per slice == up for these configs)."""
    from dataclasses import replace

    n = k = 4096
    y, args = _std_case(m, n, k, cfg, seed=m, bias=bias, w_seed=m + 5)
    assert gg.std_plan(n, k, cfg)[2] // cfg.ks == cfg.up
    want = gg.gluon_w4a16_std(*args, replace(cfg, up=0))
    assert torch.equal(y, want), f"{cfg.label} M={m}: {int((y != want).sum())} outputs differ"


def test_std_ks_up_rejects():
    q = em.quantize_weight(_w((4096, 4096)))
    gs = q.global_scale.reshape(())
    for cfg in (G(8, 1, 1, 2, prefetch=False, ks=8, up=2), G(8, 1, 1, 2, prefetch=True, ks=8, up=4),
                G(8, 1, 1, 2, prefetch=False, up=4), G(8, 1, 1, 2, prefetch=False, ks=8, up=8)):
        with pytest.raises(ValueError, match="up"):
            gg.gluon_w4a16_std(_x(2, 4096), q.packed, q.block_scale, gs, None, cfg)


def test_std_ks_one_hot_exact():
    _one_hot_case(lambda p, s, gs, x: gg.gluon_w4a16_std(x, p, s, gs, None, KS_CFGS[0]), f"std {KS_CFGS[0].label}")


def test_std_ks_rejects():
    q = em.quantize_weight(_w((256, 1024)))
    gs = q.global_scale.reshape(())
    for cfg in (G(8, 1, 1, 2, ks=3), G(8, 1, 1, 2, ks=8, xs=True), G(8, 2, 1, 2, ks=8)):
        with pytest.raises(ValueError):
            gg.gluon_w4a16_std(_x(2, 1024), q.packed, q.block_scale, gs, None, cfg)
