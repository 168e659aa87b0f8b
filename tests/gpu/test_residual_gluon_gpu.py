"""The Gluon per-token residual QDQ kernel (verl_quads.nvfp4.gluon_residual, KERNELS["residual_per_token"] = "gluon")
on a CUDA GPU: the same bytes as the torch reference (bf16 output compared as int16: -0.0 vs +0.0 counts), at
realistic shapes, every padded row length its CONFIG covers, ratios incl. 0 and 1, and rows with ties, zeros, huge
and tiny values; every speed variant; the dispatch's explicit refusals (no silent fallback)."""

import pytest
import torch

import verl_quads.nvfp4 as nv
from verl_quads.nvfp4 import gluon_residual as gr
from verl_quads.nvfp4 import triton_kernels as tk
from verl_quads.nvfp4.residual import num_selected_blocks

pytestmark = pytest.mark.gpu

if gr.gluon is None or gr._MISSING is not None:
    pytest.skip(f"the Gluon residual kernel cannot run here: {gr._MISSING or 'no triton.experimental.gluon'}",
                allow_module_level=True)


def _x(m, k, edge=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) / torch.rand(m, k, device="cuda", generator=g).clamp(min=0.02)
    x[:, :: max(1, k // 8)] *= 30.0
    if edge:  # rows 0..8 (m >= 9): the cases a selection / scale rule can get wrong
        x[0] = 0.0  # all zero: every score ties at 0, global scale 1.0
        x[1] = 1.0  # constant: zero residual everywhere, ties
        x[2] *= 1e30  # huge (bf16 keeps float32's range)
        x[3] = 0.0
        x[3, 5] = 3.0  # one non-zero element
        x[4] = (torch.arange(k, device="cuda") % 16) * 0.25  # every block the same: tied scores
        x[5] *= 1e-30  # tiny (block scales underflow to subnormal / zero E4M3)
        x[6, ::2] = -0.0  # signed zeros
        x[7] = torch.repeat_interleave(torch.randn(k // 16, device="cuda", generator=g), 16)  # constant blocks
        x[8, : k // 2] = 0.0  # half the row zero: more tied scores than n_sel at small ratios
    return x.to(torch.bfloat16)


def _gs(x):
    return nv.global_scale_from_amax(x.abs().amax(-1, keepdim=True).float())


def _ref(x, ratio, gs):
    return nv.residual_fake_quantize(x, ratio, gs, backend="torch", check_finite=False)


def _gluon(x, ratio, gs):
    with _use_gluon():
        return nv.residual_fake_quantize(x, ratio, gs, backend="triton", check_finite=False)


class _use_gluon:
    def __enter__(self):
        self.old = tk.KERNELS["residual_per_token"]
        tk.KERNELS["residual_per_token"] = "gluon"

    def __exit__(self, *exc):
        tk.KERNELS["residual_per_token"] = self.old


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


# (M, K): padded blocks 512 (the bench's 8192x8192 rows), 128, 256, 1024, 32, 64, an odd K (259 blocks -> 512), one row
SHAPES = [(1024, 8192), (4096, 2048), (512, 4096), (64, 16384), (16, 512), (16, 1024), (33, 4144), (1, 8192)]


@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("ratio", [0.5, 0.25, 0.0, 1.0])
def test_gluon_residual_bytes_equal_reference(m, k, ratio):
    x = _x(m, k, seed=m + k)
    gs = _gs(x)
    assert _same(_gluon(x, ratio, gs), _ref(x, ratio, gs))


@pytest.mark.parametrize("m,k", [(64, 8192), (64, 2048), (16, 4096), (9, 16384), (9, 512), (40, 4144)])
@pytest.mark.parametrize("ratio", [0.5, 0.25, 0.0, 1.0])
def test_gluon_residual_edge_rows(m, k, ratio):
    x = _x(m, k, edge=True, seed=k)
    gs = _gs(x)
    assert _same(_gluon(x, ratio, gs), _ref(x, ratio, gs))


@pytest.mark.parametrize("m,k", [(64, 8192), (64, 2048), (40, 4144)])
def test_gluon_residual_few_selected(m, k):
    """k = 0.03: fewer selected blocks than tied scores in the edge rows (the tie scan)."""
    x = _x(m, k, edge=True, seed=1)
    gs = _gs(x)
    assert _same(_gluon(x, 0.03, gs), _ref(x, 0.03, gs))


def test_gluon_residual_full_bench_shape():
    """The bench's shape (8192x8192, outlier channels as ``bench nvfp4 --residual-variants``), k = 0.5 and 0.25."""
    x = torch.randn(8192, 8192, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    x[:, ::1024] *= 30.0
    x = x.to(torch.bfloat16)
    gs = _gs(x)
    for ratio in (0.5, 0.25):
        assert _same(_gluon(x, ratio, gs), _ref(x, ratio, gs))


@pytest.mark.parametrize("name", list(gr.VARIANTS))
@pytest.mark.parametrize("m,k", [(256, 8192), (300, 2048)])
def test_gluon_residual_variants(name, m, k):
    x = _x(m, k, edge=True, seed=7)
    gs = _gs(x)
    with gr.variant(name):
        for ratio in (0.5, 0.25):
            assert _same(_gluon(x, ratio, gs), _ref(x, ratio, gs)), (name, ratio)


@pytest.mark.parametrize("nw", [1, 2, 4])
def test_gluon_residual_warps(nw):
    """Other warp counts than CONFIG's (direct launch): same bytes."""
    x = _x(128, 8192, edge=True, seed=nw)
    gs = _gs(x)
    for ratio in (0.5, 0.25):
        out = gr.residual_qdq(x, gs.reshape(-1), 1, num_selected_blocks(8192, ratio), nw)
        assert _same(out, _ref(x, ratio, gs))


# the launch options (gluon_residual.EXTRA_CONFIG: session 11's HWE / MSEL, session 12's SMR, session 13's EVICT), alone
# and together, at every padded row length the kernel takes (32 .. 1024 blocks: one warp at 32 / 64 / 128, 1 / 2 / 4
# tiles) with the edge rows, REUSE (without SMR)
OPTIONS = [dict(hwe=0, msel=0, smr=0), dict(hwe=1, msel=0, smr=0), dict(hwe=0, msel=1, smr=0),
           dict(hwe=1, msel=1, smr=0), dict(hwe=1, msel=1, reuse=True, smr=0), dict(hwe=0, msel=0, smr=1, evict=0),
           dict(hwe=1, msel=1, smr=1, evict=0), dict(hwe=0, msel=0, smr=1, evict=1),
           dict(hwe=1, msel=1, smr=1, evict=1)]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
@pytest.mark.parametrize("m,k", [(64, 8192), (64, 2048), (9, 16384), (9, 512), (12, 1024), (40, 4144)])
def test_gluon_residual_options(opts, m, k):
    x = _x(m, k, edge=True, seed=k + 1)
    gs = _gs(x)
    for ratio in (0.5, 0.25, 0.03):  # 1.0 / 0.0 (no search step): the default options' tests above
        out = gr.residual_qdq(x, gs.reshape(-1), 1, num_selected_blocks(k, ratio), **opts)
        assert _same(out, _ref(x, ratio, gs)), (opts, ratio)


def test_gluon_residual_option_refusals():
    x = _x(4, 2048)
    gs = _gs(x).reshape(-1)
    for bad in (dict(hwe=2), dict(msel=2), dict(smr=2), dict(smr=1, reuse=True), dict(evict=2),
                dict(evict=1, smr=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            gr.residual_qdq(x, gs, 1, 32, **bad)


if gr.gluon is not None:
    from triton.experimental.gluon import language as _gl

    @gr.gluon.jit
    def _e4m3_compare_kernel(bad_ptr, LAST, BLOCK: _gl.constexpr):
        """Per program: how many float32 bit patterns ``pid * BLOCK + i`` (<= LAST) round to a different E4M3 value
        by the hardware conversion (gluon_residual._e4m3_value_hw) than by the integer rounding (_e4m3_round)."""
        bits = _gl.program_id(0) * BLOCK + _gl.arange(0, BLOCK, layout=_gl.BlockedLayout([4], [32], [4], [0]))
        s = bits.to(_gl.float32, bitcast=True)
        hw = gr._e4m3_value_hw(s)
        sw, _ = gr._e4m3_round(s)
        bad = (hw.to(_gl.int32, bitcast=True) != sw.to(_gl.int32, bitcast=True)) & (bits <= LAST)
        _gl.store(bad_ptr + _gl.program_id(0), _gl.sum(bad.to(_gl.int32), axis=0))


def test_hw_e4m3_equals_integer_rounding():
    """HWE's premise: for EVERY float32 in [+0, 448] (the block scales' range; 1.14e9 bit patterns) the hardware
    E4M3 conversion gives the value of the integer rounding the reference formulas use (bit-equal float32)."""
    last = 0x43E00000  # 448.0
    block = 4096
    grid = last // block + 1
    bad = torch.zeros(grid, dtype=torch.int32, device="cuda")
    _e4m3_compare_kernel[(grid,)](bad, last, BLOCK=block, num_warps=4)
    assert int(bad.sum()) == 0


def test_gluon_residual_refuses_what_it_cannot_run():
    """Requested explicitly, the Gluon kernel raises (with the reason) instead of running another kernel."""
    x = _x(16, 2048)
    gs = _gs(x)
    with _use_gluon():
        with pytest.raises(RuntimeError, match="QDQ output only"):
            nv.residual_quantize(x, 0.5, gs, backend="triton", check_finite=False)
        with pytest.raises(RuntimeError, match="bfloat16 input only"):
            nv.residual_fake_quantize(x.half(), 0.5, gs, backend="triton", check_finite=False)
        with pytest.raises(RuntimeError, match="score_weight"):
            nv.residual_fake_quantize(x, 0.5, gs, score_weight=torch.ones(2048, device="cuda"), backend="triton",
                                      check_finite=False)
        with pytest.raises(RuntimeError, match="per-row global scale"):
            nv.residual_fake_quantize(x, 0.5, torch.tensor(10.0, device="cuda"), backend="triton", check_finite=False)
        with pytest.raises(RuntimeError, match="padded 16-blocks"):
            nv.residual_fake_quantize(_x(4, 32768), 0.5, _gs(_x(4, 32768)), backend="triton", check_finite=False)
    # per-call selection is not a per-token kernel's business: unchanged under the choice
    ref = nv.residual_fake_quantize(x, 0.5, gs, per_token=False, backend="torch", check_finite=False)
    with _use_gluon():
        got = nv.residual_fake_quantize(x, 0.5, gs, per_token=False, backend="triton", check_finite=False)
    assert _same(got, ref)


def test_gluon_residual_stop_probes_run():
    """``bench nvfp4 --residual-probe``'s STOP launches compile and run (their outputs are not results)."""
    x = _x(64, 8192)
    gs = _gs(x)
    with _use_gluon():
        for stop in (1, 2, 3):
            tk._residual_rows(x, gs, x, 0.5, None, packed=False, stop=stop)
    torch.cuda.synchronize()


@pytest.mark.parametrize("m,k", [(8192, 8192), (32768, 2048)])
def test_auto_takes_gluon_where_measured_faster(m, k):
    """The default ("auto") dispatch runs the Gluon kernel at GLUON_RESIDUAL_AUTO's sizes (bf16 QDQ, per-row scale):
    same bytes as the reference; the packed residual_quantize (which it does not write) keeps the Triton kernel."""
    assert tk.KERNELS["residual_per_token"] == "auto"
    x = _x(m, k, seed=5)
    gs = _gs(x)
    nbp = 1 << ((k // 16 - 1).bit_length())
    assert tk._auto_gluon(x, gs, None, nbp, False, 0)
    assert not tk._auto_gluon(x, gs, None, nbp, True, 0)  # packed
    assert not tk._auto_gluon(x.half(), gs, None, nbp, False, 0)  # fp16
    assert not tk._auto_gluon(x, gs, torch.ones(k, device="cuda"), nbp, False, 0)  # score_weight
    assert not tk._auto_gluon(x[: GLUON_ROWS[nbp] // 2], gs[: GLUON_ROWS[nbp] // 2], None, nbp, False, 0)  # fewer rows
    for ratio in (0.5, 0.25):
        assert _same(nv.residual_fake_quantize(x, ratio, gs, backend="triton", check_finite=False), _ref(x, ratio, gs))
    q, r = (nv.residual_quantize(x, 0.5, gs, backend=b, check_finite=False) for b in ("triton", "torch"))
    for a, b in ((q.first.packed, r.first.packed), (q.second.packed, r.second.packed), (q.block_idx, r.block_idx),
                 (q.first.block_scale.view(torch.uint8), r.first.block_scale.view(torch.uint8)),
                 (q.second.block_scale.view(torch.uint8), r.second.block_scale.view(torch.uint8)),
                 (q.second.global_scale, r.second.global_scale)):
        assert torch.equal(a, b)


GLUON_ROWS = tk.GLUON_RESIDUAL_AUTO
