"""quads_nvfp4 backend ``native`` on CPU with vLLM's Blackwell FP4 GEMM MOCKED.

No FP4 tensor cores exist here. ``vllm._custom_ops.cutlass_scaled_fp4_mm`` is replaced by
:func:`mocked_blackwell_fp4_mm`, a torch emulation of an FP4 tensor-core GEMM written from the
op's contract (not from our code): it decodes the E2M1 nibbles with its own table and reads the
block scales at the positions of the SWIZZLED layout (PTX "scale factor layout 4x": 512-byte
tiles of 128 rows x 4 scale columns), so a layout bug in what the native path hands to the op
fails these tests. Real vLLM linear-method classes and the real NVFP4 core; the methods are built
with ``backend='native'`` directly (``resolve_backend`` refuses native here, tested in
test_rollout_config.py). ``w4a16`` runs the triton kernel (TRITON_INTERPRET=1 on CPU).
"""

import os
import types

import pytest
import torch

pytest.importorskip("vllm")

import vllm._custom_ops as vllm_ops  # noqa: E402

from verl_quads import nvfp4  # noqa: E402
from verl_quads.nvfp4 import NVFP4Tensor  # noqa: E402
from verl_quads.rollout import emulation, native  # noqa: E402
from verl_quads.rollout.emulation import ActQuant  # noqa: E402
from verl_quads.rollout.linear import QuadsNVFP4LinearMethod  # noqa: E402

pytestmark = [pytest.mark.vllm]

U = 2.0**-8  # bf16 unit roundoff
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _decode(packed: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(_E2M1, dtype=torch.float32)
    lo, hi = (packed & 0xF).long(), (packed >> 4).long()
    return torch.stack([table[lo], table[hi]], -1).flatten(-2)  # even element in the low nibble


def _read_swizzled(sf: torch.Tensor, m: int, kb: int) -> torch.Tensor:
    """Scale of (row r, 16-block j) from a swizzled [round_up(m,128), round_up(kb,4)] e4m3 tensor, as float32."""
    mp, kp = sf.shape
    assert mp == -(-m // 128) * 128 and kp == -(-kb // 4) * 4, (tuple(sf.shape), m, kb)
    flat = sf.contiguous().view(torch.uint8).reshape(-1)
    r = torch.arange(m).view(-1, 1)
    j = torch.arange(kb).view(1, -1)
    off = ((r // 128) * (kp // 4) + j // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + j % 4
    return flat[off].view(torch.float8_e4m3fn).to(torch.float32)


def mocked_blackwell_fp4_mm(a, b, block_scale_a, block_scale_b, alpha, out_dtype):
    """MOCK of vLLM's ``cutlass_scaled_fp4_mm``: exact FP4 x FP4 x E4M3 products, float32 sum,
    times ``alpha``, one rounding to ``out_dtype`` (bf16/fp16 only, as the CUTLASS op)."""
    assert a.dtype == b.dtype == torch.uint8 and a.dim() == b.dim() == 2 and a.shape[1] == b.shape[1]
    assert block_scale_a.dtype == block_scale_b.dtype == torch.float8_e4m3fn
    assert alpha.dtype == torch.float32 and alpha.numel() == 1
    assert out_dtype in (torch.bfloat16, torch.float16)
    m, n, kb = a.shape[0], b.shape[0], a.shape[1] * 2 // 16
    av = _decode(a) * _read_swizzled(block_scale_a, m, kb).repeat_interleave(16, -1)
    bv = _decode(b) * _read_swizzled(block_scale_b, n, kb).repeat_interleave(16, -1)
    return ((av @ bv.t()) * alpha.reshape(())).to(out_dtype)


@pytest.fixture(autouse=True)
def _mock_op(monkeypatch):
    monkeypatch.setattr(vllm_ops, "cutlass_scaled_fp4_mm", mocked_blackwell_fp4_mm)


def _layer(backend, act, w, bias=None):
    n, k = w.shape
    m = QuadsNVFP4LinearMethod(act, backend)
    layer = torch.nn.Module()
    layer.prefix = "model.layers.0.mlp.down_proj"
    m.create_weights(layer, k, [n // 2, n - n // 2], k, n, torch.bfloat16, weight_loader=lambda *a: None)
    layer.weight.data.copy_(w)
    m.process_weights_after_loading(layer)
    return m, layer


def _data(m=37, n=64, k=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    x[3] *= 40.0  # rows of very different magnitude: per-token global scales matter
    x[5] = 0.0  # an all-zero token
    bias = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)
    return x, w, bias


def _unit(q: NVFP4Tensor) -> torch.Tensor:
    """codes * block scales in float32 (the core's dequantize with global scale 1: exact)."""
    one = torch.ones((), dtype=torch.float32)
    return nvfp4.dequantize(NVFP4Tensor(q.packed, q.block_scale, one, q.shape, q.dtype), torch.float32, backend="torch")


def test_mocked_blackwell_gemm_reads_the_swizzled_layout():
    """The mock itself: fed the core's swizzled scales it reproduces codes*scales @ codes*scales^T."""
    x, w, _ = _data()
    qx = nvfp4.quantize(x, None, backend="torch")
    qw = nvfp4.quantize(w, None, backend="torch")
    got = mocked_blackwell_fp4_mm(qx.packed, qw.packed, nvfp4.swizzle_block_scale(qx.block_scale),
                                  nvfp4.swizzle_block_scale(qw.block_scale), torch.ones(1), torch.bfloat16)
    assert torch.equal(got, (_unit(qx) @ _unit(qw).t()).to(torch.bfloat16))
    bad = mocked_blackwell_fp4_mm(qx.packed, qw.packed, _padded_linear(qx.block_scale),
                                  _padded_linear(qw.block_scale), torch.ones(1), torch.bfloat16)
    assert not torch.equal(bad, got)


def _padded_linear(scale):
    """A layout BUG on purpose: padded to the swizzled shape but left row-major."""
    m, kb = scale.shape
    out = torch.zeros(-(-m // 128) * 128, -(-kb // 4) * 4, dtype=torch.uint8)
    out[:m, :kb] = scale.view(torch.uint8)
    return out.view(torch.float8_e4m3fn)


def test_native_naive_equals_qdq_then_fp4_gemm_then_row_scale():
    """naive, exact: core QDQ codes*scales, plain float32 matmul, *alpha, bf16, / row global scale, + bias."""
    x, w, bias = _data()
    meth, layer = _layer("native", ActQuant("naive"), w)
    got = meth.apply(layer, x, bias)
    gs = nvfp4.per_row_global_scale(x)
    qx = nvfp4.quantize(x, gs, backend="torch")
    qw = emulation.quantize_weight(w)
    g = ((_unit(qx) @ _unit(qw).t()) * (1.0 / qw.global_scale)).to(torch.bfloat16)
    want = (g.float() / gs + bias.float()).to(torch.bfloat16)
    assert torch.equal(got, want)
    assert torch.equal(layer.weight_scale_swizzled, nvfp4.swizzle_block_scale(layer.weight_scale))
    assert layer.weight_alpha.shape == (1,) and layer.weight_alpha.dtype == torch.float32


def _passes_abs(x, act):
    """A = sum over the activation passes of |x_q| (float32, dequantized): for the error bound."""
    gs = nvfp4.per_row_global_scale(x)
    if act.mode == "quads":
        r = nvfp4.residual_quantize(x, act.residual_ratio, gs, per_token=act.residual_per_token, backend="torch",
                                    granularity=act.residual_granularity)
        first = nvfp4.dequantize(r.first, torch.float32, backend="torch")
        return first.abs() + (r.dequantize(torch.float32) - first).abs() * 1.001
    return nvfp4.dequantize(nvfp4.quantize(x, gs, backend="torch"), torch.float32, backend="torch").abs()


@pytest.mark.parametrize("act", [ActQuant("naive"), ActQuant("trace"), ActQuant("quads", 0.5),
                                 ActQuant("quads", 0.25, residual_per_token=False, residual_granularity="block"),
                                 ActQuant("quads", 1.0), ActQuant("quads", 0.5, residual_granularity="block")],
                         ids=["naive", "trace", "quads0.5_channel_default", "quads0.25_per_call_block", "quads1.0",
                              "quads0.5_block"])
def test_native_w4a4_within_the_double_rounding_bound_of_torch_backend(act):
    """|native - torch| <= u|y_torch| + (2u + K 2^-23) A (native.py docstring); and mostly equal."""
    x, w, bias = _data()
    mt, lt = _layer("torch", act, w)
    mn, ln = _layer("native", act, w)
    yt, yn = mt.apply(lt, x, bias), mn.apply(ln, x, bias)
    wq = emulation.weight_f32(lt.weight_packed, lt.weight_scale, lt.weight_global_scale).abs()
    a = _passes_abs(x, act) @ wq.t()
    k = x.shape[1]
    err = (yn.float() - yt.float()).abs()
    bound = U * yt.float().abs() + (2 * U + k * 2.0**-23) * a
    assert bool((err <= bound).all()), float((err - bound).max())
    equal = float((yn == yt).float().mean())
    print(f"{act.mode} ratio={act.residual_ratio}: equal {equal:.3f}, max err/bound {float((err / bound.clamp_min(1e-30)).max()):.3f}")
    assert equal > 0.5  # double rounding changes a minority of outputs (by 1 bf16 ulp typically)
    assert torch.equal(yn[5], (bias.float()).to(torch.bfloat16))  # zero token: exactly the bias


def test_native_runs_the_product_default_residual_combine_auto_as_fp4x2(monkeypatch):
    """quant_config.residual_combine='auto' (the default) on the native backend (resolve_backend mocked to native,
    as on a Blackwell GPU with vLLM's FP4 ops) resolves at engine start to fp4x2: the layer's ActQuant is the
    two-FP4-operand form, and the native GEMM on it stays within the double-rounding bound of the torch backend's
    fp4x2 output. An explicit bf16 is refused there, naming the key."""
    from verl_quads.rollout import quant_config as qc_mod

    monkeypatch.setattr(qc_mod, "resolve_backend", lambda requested: "native")
    cfg = qc_mod.QuadsNVFP4Config.from_config({"quant": "quads"})
    act = cfg.activation_quant("model.layers.0.mlp.down_proj")[0]
    assert (cfg.quant_config.residual_combine, cfg.backend, act.residual_combine) == ("auto", "native", "fp4x2")
    test_native_w4a4_within_the_double_rounding_bound_of_torch_backend(act)
    with pytest.raises(ValueError, match=r"quant_config\.residual_combine='bf16' is for the emulated backends"):
        qc_mod.QuadsNVFP4Config.from_config({"quant": "quads", "residual_combine": "bf16"})


def test_native_with_a_swizzle_bug_fails_the_bound():
    """Negative control: a layout bug (row-major scales handed to the op) breaks the bound above."""
    x, w, bias = _data()
    mt, lt = _layer("torch", ActQuant("naive"), w)
    mn, ln = _layer("native", ActQuant("naive"), w)
    ln.weight_scale_swizzled.copy_(_padded_linear(ln.weight_scale))
    yt, yn = mt.apply(lt, x, bias), mn.apply(ln, x, bias)
    wq = emulation.weight_f32(lt.weight_packed, lt.weight_scale, lt.weight_global_scale).abs()
    bound = U * yt.float().abs() + (2 * U + 96 * 2.0**-23) * (_passes_abs(x, ActQuant("naive")) @ wq.t())
    assert bool(((yn.float() - yt.float()).abs() > bound).any())


def test_native_trace_captures_the_torch_backends_record(monkeypatch):
    from verl_quads.rollout import capture as capture_mod

    recs = {}
    store = types.SimpleNamespace(add=lambda layer, gemm, rec, expert_ids=None: recs.__setitem__((layer, gemm), rec))
    monkeypatch.setattr(capture_mod, "get_store", lambda: store)
    x, w, bias = _data()
    act = ActQuant("trace", capture=True)
    out = {}
    # "native compiled": under torch.compile the capture runs as the custom op verl_quads::nvfp4_native_linear_guided
    # (what a CUDA-graph engine records and replays); Dynamo never traces the store
    for name in ("torch", "native", "native compiled"):
        backend = name.split()[0]
        m = QuadsNVFP4LinearMethod(act, backend, capture_key=(3, "mlp.down_proj"))
        _, layer = _layer(backend, act, w)
        fn = torch.compile(m.apply, backend="eager", fullgraph=True) if "compiled" in name else m.apply
        out[name] = (fn(layer, x, bias), recs.pop((3, "mlp.down_proj")))
    rt = out["torch"][1]
    for name in ("native", "native compiled"):
        rn = out[name][1]
        assert torch.equal(rt.bits, rn.bits) and torch.equal(rt.block_scale.view(torch.uint8),
                                                             rn.block_scale.view(torch.uint8)), name
        assert torch.equal(rt.global_scale, rn.global_scale), name
    assert torch.equal(out["native compiled"][0], out["native"][0])
    # the native output under capture is the same as without capture
    mn, ln = _layer("native", ActQuant("trace"), w)
    assert torch.equal(out["native"][0], mn.apply(ln, x, bias))


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="w4a16 on native runs the triton kernel: needs a GPU or TRITON_INTERPRET=1")
def test_native_w4a16_runs_the_triton_kernel_not_the_fp4_op(monkeypatch):
    x, w, bias = _data(m=6, n=64, k=64)
    monkeypatch.setattr(vllm_ops, "cutlass_scaled_fp4_mm", lambda *a: pytest.fail("w4a16 must not call the FP4 GEMM"))
    mt, lt = _layer("torch", ActQuant("w4a16"), w)
    mn, ln = _layer("native", ActQuant("w4a16"), w)
    yt, yn = mt.apply(lt, x, bias), mn.apply(ln, x, bias)
    assert torch.allclose(yn.float(), yt.float(), rtol=2 * U, atol=1e-5)


def test_reload_reswizzles_in_place_through_the_packed_sync_and_vllm_reload():
    """Weights A, then B written into the linear-layout params by the real packed-sync apply_load
    (the receiver calls after_packed_load): swizzled scales/alpha follow in the SAME storage, and
    outputs equal a fresh B layer's; then vLLM's reload route (process_weights_after_loading on a
    kernel-format layer) back to A gives A's outputs bit for bit."""
    from verl_quads.sync.receiver import LoadPlan, apply_load

    x, wa, bias = _data(seed=1)
    _, wb, _ = _data(seed=2)
    act = ActQuant("quads", 0.5)
    ma, la = _layer("native", act, wa)
    mb, lb = _layer("native", act, wb)
    ya, yb = ma.apply(la, x, bias), mb.apply(lb, x, bias)
    assert not torch.equal(ya, yb)
    model = torch.nn.Module()
    model.proj = la
    la.quant_method = ma
    ptrs = (la.weight_scale_swizzled.data_ptr(), la.weight_alpha.data_ptr())
    plan = LoadPlan(header={}, packed=[(f"proj.{n}", la._parameters[n], lb._parameters[n].clone())
                                       for n in ("weight_packed", "weight_scale", "weight_global_scale")])
    apply_load(model, None, plan)
    assert (la.weight_scale_swizzled.data_ptr(), la.weight_alpha.data_ptr()) == ptrs
    assert torch.equal(la.weight_scale_swizzled.view(torch.uint8), lb.weight_scale_swizzled.view(torch.uint8))
    assert torch.equal(ma.apply(la, x, bias), yb)
    _, la2 = _layer("native", act, wa)
    for n in ("weight_packed", "weight_scale", "weight_global_scale"):
        la._parameters[n].data.copy_(la2._parameters[n])
    ma.process_weights_after_loading(la)
    assert (la.weight_scale_swizzled.data_ptr(), la.weight_alpha.data_ptr()) == ptrs
    assert torch.equal(ma.apply(la, x, bias), ya)


def test_native_refuses_unaligned_linear_at_create_weights():
    m = QuadsNVFP4LinearMethod(ActQuant("naive"), "native")
    layer = torch.nn.Module()
    layer.prefix = "model.layers.2.self_attn.o_proj"
    with pytest.raises(ValueError, match=r"o_proj.*K=48.*multiples of 32.*backend='triton'.*ignore"):
        m.create_weights(layer, 48, [64], 48, 64, torch.bfloat16, weight_loader=lambda *a: None)


def test_native_routed_experts_refused_unless_triton_experts_chosen(monkeypatch):
    from verl_quads.rollout.moe import QuadsNVFP4MoEMethod

    monkeypatch.delenv(native.NATIVE_EXPERTS_ENV, raising=False)
    monkeypatch.setenv("VERL_QUADS_ROUTING", "0")
    cfg = types.SimpleNamespace(has_bias=False, activation=None)
    layer = torch.nn.Module()
    layer.layer_name = "model.layers.1.mlp.experts"
    meth = QuadsNVFP4MoEMethod(cfg, ActQuant("naive"), "native")
    with pytest.raises(NotImplementedError, match=r"model\.layers\.1\.mlp\.experts.*VERL_QUADS_NATIVE_EXPERTS=triton"
                                                  r".*backend='triton'.*ignore"):
        meth.create_weights(layer, 4, 64, 32, torch.bfloat16)
    monkeypatch.setenv(native.NATIVE_EXPERTS_ENV, "cutlass")
    with pytest.raises(NotImplementedError, match="allowed: triton"):
        QuadsNVFP4MoEMethod(cfg, ActQuant("naive"), "native").create_weights(layer, 4, 64, 32, torch.bfloat16)
    monkeypatch.setenv(native.NATIVE_EXPERTS_ENV, "triton")
    meth = QuadsNVFP4MoEMethod(cfg, ActQuant("naive"), "native")
    meth.create_weights(layer, 4, 64, 32, torch.bfloat16)
    assert meth.backend == "triton" and layer.w13_weight.shape == (4, 64, 64)
