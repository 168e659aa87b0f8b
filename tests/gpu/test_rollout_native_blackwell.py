"""The ``native`` rollout backend (verl_quads/rollout/native.py) on real hardware.

``blackwell`` tests need an sm_100+ GPU AND a CUDA vLLM with its CUTLASS FP4 ops
(``cutlass_fp4_supported()``); they are skipped everywhere else and have NEVER RUN in this project
(no Blackwell machine). They check vLLM's real ``cutlass_scaled_fp4_mm`` against the contract the
native path assumes (swizzled scales from :func:`verl_quads.nvfp4.swizzle_block_scale`, ``alpha``
multiplies the float32 accumulator, bf16 output), and the native linear path against the
``torch`` backend's arithmetic within the double-rounding bound of native.py:
``|y_native - y_torch| <= u |y_torch| + (2u + K 2^-23) A`` (u = 2^-8, A = sum over passes of
``|x_q| @ |W_q|^T``).

The ``gpu`` test (runs on the H200, no vLLM needed) runs the native activation path on CUDA (the
core's triton quantization, the QUADS residual scatter, swizzling) with the FP4 GEMM MOCKED by a
torch emulation: what can be checked without FP4 tensor cores.

Run: ``python -m pytest tests/gpu/test_rollout_native_blackwell.py -q -s``
"""

import pytest
import torch

from verl_quads import nvfp4
from verl_quads.nvfp4 import NVFP4Tensor
from verl_quads.rollout import emulation as em
from verl_quads.rollout import native
from verl_quads.rollout.emulation import ActQuant

DEV = "cuda"
U = 2.0**-8
# quads: ActQuant's default rule (per-token channels), the per-token block rule, per-call blocks
MODES = [ActQuant("naive"), ActQuant("trace"), ActQuant("quads", 0.5), ActQuant("quads", 0.5, residual_granularity="block"),
         ActQuant("quads", 0.25, residual_per_token=False, residual_granularity="block")]
MODE_IDS = ["naive", "trace", "quads0.5_channel", "quads0.5_block", "quads0.25_per_call_block"]


def _blackwell_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    cap = torch.cuda.get_device_capability()
    if cap[0] < 10:
        return f"needs sm_100+ (Blackwell), this GPU is sm_{cap[0]}{cap[1]}"
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"needs a CUDA vLLM: {e}"
    return native.fp4_ops_unavailable_reason()


_BW = _blackwell_reason()


def blackwell(fn):
    """Marks a test ``blackwell`` + ``gpu`` and skips it unless sm_100+ with vLLM's FP4 ops."""
    return pytest.mark.blackwell(pytest.mark.gpu(pytest.mark.skipif(_BW is not None, reason=str(_BW))(fn)))


def _x(m, k, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g)
    x[:, ::293] *= 30.0  # outlier channels
    if m > 3:
        x[2] *= 1e-3  # a small-magnitude token
    return x.to(torch.bfloat16)


def _w(n, k, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(n, k, device=DEV, generator=g) * 0.02).to(torch.bfloat16)


def _unit(q: NVFP4Tensor) -> torch.Tensor:
    one = torch.ones((), dtype=torch.float32, device=q.packed.device)
    return nvfp4.dequantize(NVFP4Tensor(q.packed, q.block_scale, one, q.shape, q.dtype), torch.float32, backend="torch")


def _layer(w):
    q = em.quantize_weight(w)
    layer = torch.nn.Module()
    layer.weight_packed = torch.nn.Parameter(q.packed, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(q.block_scale, requires_grad=False)
    layer.weight_global_scale = torch.nn.Parameter(q.global_scale.reshape(()), requires_grad=False)
    native.prepare_linear(layer)
    return layer


def _reference_and_bound(x, layer, act):
    wf = em.weight_f32(layer.weight_packed, layer.weight_scale, layer.weight_global_scale)
    xf, _ = em.quantize_activation(x, act)
    ref = em.gemm(xf, wf, None, x.dtype)
    gs = nvfp4.per_row_global_scale(x)
    if act.mode == "quads":
        r = nvfp4.residual_quantize(x, act.residual_ratio, gs, per_token=act.residual_per_token, backend="torch",
                                    granularity=act.residual_granularity)
        first = nvfp4.dequantize(r.first, torch.float32, backend="torch")
        xa = first.abs() + (r.dequantize(torch.float32) - first).abs() * 1.001
    else:
        xa = xf.abs()
    a = xa @ wf.abs().t()
    return ref, U * ref.float().abs() + (2 * U + x.shape[1] * 2.0**-23) * a


@blackwell
@pytest.mark.parametrize("m", [1, 37, 300])
def test_vllm_cutlass_fp4_mm_contract_on_blackwell(m):
    import vllm._custom_ops as ops

    k, n = 2048, 4096
    qx = nvfp4.quantize(_x(m, k), None)
    qw = nvfp4.quantize(_w(n, k), None)
    alpha = (1.0 / (qx.global_scale * qw.global_scale)).reshape(1).to(torch.float32)
    got = ops.cutlass_scaled_fp4_mm(qx.packed, qw.packed, nvfp4.swizzle_block_scale(qx.block_scale),
                                    nvfp4.swizzle_block_scale(qw.block_scale), alpha, torch.bfloat16)
    want = (_unit(qx) @ _unit(qw).t()) * alpha
    a = _unit(qx).abs() @ _unit(qw).abs().t() * alpha
    err = (got.float() - want).abs()
    bound = U * want.abs() + k * 2.0**-23 * a
    print(f"M={m}: max err/bound {float((err / bound.clamp_min(1e-30)).max()):.3f}, "
          f"equal {float((got == want.to(torch.bfloat16)).float().mean()):.3f}")
    assert bool((err <= bound).all())


@blackwell
@pytest.mark.parametrize("act", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("m", [1, 16, 300])
def test_native_linear_within_double_rounding_bound_on_blackwell(act, m):
    x, layer = _x(m, 2048), _layer(_w(4096, 2048))
    ref, bound = _reference_and_bound(x, layer, act)
    passes, _ = native.activation_passes(x, act.mode, act.residual_ratio, act.residual_per_token,
                                         residual_granularity=act.residual_granularity)
    got = native.gemm_passes(passes, layer.weight_packed, layer.weight_scale_swizzled, layer.weight_alpha, None,
                             x.dtype)
    err = (got.float() - ref.float()).abs()
    print(f"{act.mode} M={m}: equal {float((got == ref).float().mean()):.3f}, "
          f"max err/bound {float((err / bound.clamp_min(1e-30)).max()):.3f}")
    assert bool((err <= bound).all())


@blackwell
def test_our_swizzle_equals_vllms_swizzle_blockscale_on_blackwell():
    from vllm.model_executor.layers.quantization.utils.nvfp4_utils import swizzle_blockscale

    s = nvfp4.quantize(_w(300, 2048 + 64), None).block_scale
    assert torch.equal(nvfp4.swizzle_block_scale(s).view(torch.uint8), swizzle_blockscale(s).view(torch.uint8))


def _mocked_fp4_mm(a, b, sa, sb, alpha, out_dtype):
    """MOCK of vLLM's cutlass_scaled_fp4_mm (no FP4 tensor cores on the H200): unswizzle, decode, float32 GEMM."""
    m, n, k = a.shape[0], b.shape[0], a.shape[1] * 2
    av = _unit(NVFP4Tensor(a, nvfp4.unswizzle_block_scale(sa, m, k), torch.ones((), device=a.device),
                           torch.Size((m, k)), torch.bfloat16))
    bv = _unit(NVFP4Tensor(b, nvfp4.unswizzle_block_scale(sb, n, k), torch.ones((), device=a.device),
                           torch.Size((n, k)), torch.bfloat16))
    return ((av @ bv.t()) * alpha.reshape(())).to(out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("act", MODES, ids=MODE_IDS)
def test_native_activation_path_on_cuda_with_mocked_fp4_gemm(act, monkeypatch):
    """H200 (no vLLM): the native path's CUDA activation quantization (core triton kernels) gives the
    torch core's codes, and with the FP4 GEMM mocked the output is within the bound."""
    monkeypatch.setattr(native, "_fp4_mm", lambda: _mocked_fp4_mm)
    x, layer = _x(37, 2048), _layer(_w(1024, 2048))
    passes, rec = native.activation_passes(x, act.mode, act.residual_ratio, act.residual_per_token, capture=True,
                                           residual_granularity=act.residual_granularity)
    gs = nvfp4.per_row_global_scale(x)
    if act.mode == "quads":
        r = nvfp4.residual_quantize(x, act.residual_ratio, gs, per_token=act.residual_per_token, backend="torch",
                                    granularity=act.residual_granularity)
        assert torch.equal(passes[0][0], r.first.packed) and len(passes) == 2
    else:
        q = nvfp4.quantize(x, gs, backend="torch")
        assert torch.equal(passes[0][0], q.packed)
        assert torch.equal(passes[0][1].view(torch.uint8), q.block_scale.view(torch.uint8))
        if act.mode == "trace":
            assert torch.equal(rec.bits, nvfp4.extract_guidance(q).bits)
    ref, bound = _reference_and_bound(x, layer, act)
    got = native.gemm_passes(passes, layer.weight_packed, layer.weight_scale_swizzled, layer.weight_alpha, None,
                             x.dtype)
    assert bool(((got.float() - ref.float()).abs() <= bound).all())
