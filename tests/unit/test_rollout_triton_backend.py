"""The vLLM methods of quads_nvfp4 with backend="triton" against backend="torch", on CPU tensors.

The Triton kernels run under TRITON_INTERPRET=1 (scripts/test.sh sets it on CPU). The methods are
constructed directly with ``backend="triton"``: this BYPASSES ``resolve_backend``'s device check
(which rightly refuses triton on vLLM CPU) -- only in this test, to run the real method code
(create_weights, process_weights_after_loading, apply) on the kernels' interpreter. Real vLLM
classes; the MoE config is a namespace with the two fields the method reads.
"""

import os
import types

import pytest
import torch

pytest.importorskip("vllm")

from verl_quads import nvfp4 as nv  # noqa: E402
from verl_quads.rollout import capture as capture_mod  # noqa: E402
from verl_quads.rollout.emulation import ActQuant  # noqa: E402
from verl_quads.rollout.linear import QuadsNVFP4LinearMethod  # noqa: E402
from verl_quads.rollout.moe import QuadsNVFP4MoEMethod  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
        reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (scripts/test.sh sets it on CPU)",
    ),
]


def _one_step(monkeypatch, rows: int, fn):
    """``fn()`` inside one step of request "r" (``rows`` token rows) of a fresh real guidance store, as the model
    runner's hook drives it: (fn's output, {key: record} popped for "r" ({} if nothing was recorded), with the
    popped expert ids of its MoE layers under the key "expert_ids")."""
    store = capture_mod.GuidanceStore()
    store.enabled = True
    monkeypatch.setattr(capture_mod, "get_store", lambda: store)
    store.begin_step(["r"], [0, rows], torch.arange(rows))
    out = fn()
    store.end_step()
    g = store.pop("r")
    return out, ({} if g is None else {**g.records, "expert_ids": g.expert_ids})


def _linear_layer(seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.Module()
    QuadsNVFP4LinearMethod(ActQuant("naive")).create_weights(layer, 96, [32, 16, 16], 96, 64, torch.bfloat16,
                                                             weight_loader=lambda *a: None)
    layer.weight.data.copy_(torch.randn(64, 96, dtype=torch.bfloat16) * 0.05)
    QuadsNVFP4LinearMethod(ActQuant("naive")).process_weights_after_loading(layer)
    return layer


def _close(y, ref, what):
    d = (y.float() - ref.float()).abs()
    equal = float((y == ref).float().mean())
    rel = float(d.max() / ref.float().abs().max())
    print(f"{what}: {equal:.1%} of outputs bit-equal, max |diff| / max |ref| = {rel:.2e}")
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert rel <= 2 ** -7 and equal >= 0.95, (what, rel, equal)


def _act(monkeypatch, backend, mode, per_token, combine, gran, prefix):
    """The layer's ActQuant. ``combine="auto"`` (quads only): built as the engine builds it, by QuadsNVFP4Config
    with quant_config.residual_combine left at its default (auto) and the backend resolved to ``backend`` (mocked:
    no GPU here), so the default's resolution (bf16 on torch and triton) is what the layer runs."""
    if combine != "auto":
        return ActQuant(mode, 0.5, per_token, capture=mode == "trace", residual_combine=combine,
                        **({} if gran is None else {"residual_granularity": gran}))
    from verl_quads.rollout import quant_config as qc_mod

    assert mode == "quads"
    monkeypatch.setattr(qc_mod, "resolve_backend", lambda requested: backend)
    cfg = qc_mod.QuadsNVFP4Config.from_config({"quant": "quads", "residual_ratio": 0.5, "residual_per_token": per_token,
                                               **({} if gran is None else {"residual_granularity": gran})})
    act = cfg.activation_quant(prefix)[0]
    assert cfg.quant_config.residual_combine == "auto" and cfg.backend == backend and act.residual_combine == "bf16"
    return act


#: QUADS selection unit per case: None = the default (the per-token sampled-threshold channel rule since session 33;
#: "channel" keeps the exact channel rule tested); per-call cases need
#: "block" (per-call selection is defined for blocks only); ("quads", True, ..., "block") keeps the per-token
#: block rule tested through the product path. combine "auto": the product default (-> bf16 on both backends,
#: see _act); fp4x2 and explicit bf16 stay covered.
@pytest.mark.parametrize("mode, per_token, combine, gran", [
    ("w4a16", False, "fp4x2", None), ("naive", False, "fp4x2", None), ("quads", False, "fp4x2", "block"),
    ("quads", True, "fp4x2", None), ("quads", True, "fp4x2", "block"), ("quads", True, "fp4x2", "channel"),
    ("trace", False, "fp4x2", None), ("quads", True, "auto", None), ("quads", False, "bf16", "block"),
])
def test_linear_apply_triton_equals_torch(monkeypatch, mode, per_token, combine, gran):
    layer = _linear_layer()
    x = torch.randn(2, 3, 96, dtype=torch.bfloat16)  # [batch, seq, K]: apply flattens the leading dims
    x[..., 7] *= 20
    bias = torch.randn(64, dtype=torch.bfloat16)
    outs, recs = {}, {}
    for backend in ("torch", "triton"):
        act = _act(monkeypatch, backend, mode, per_token, combine, gran, "model.layers.3.self_attn.qkv_proj")
        assert mode != "quads" or act.residual_granularity == (gran or "channel_sampled")
        m = QuadsNVFP4LinearMethod(act, backend, capture_key=(3, "self_attn.qkv_proj") if mode == "trace" else None)
        outs[backend], recs[backend] = _one_step(monkeypatch, 6, lambda: m.apply(layer, x, bias))
    _close(outs["triton"], outs["torch"], f"linear {mode} per_token={per_token} combine={combine} granularity={gran}")
    if mode == "trace":
        a, b = recs["torch"][(3, "self_attn.qkv_proj")], recs["triton"][(3, "self_attn.qkv_proj")]
        assert torch.equal(a.bits, b.bits) and torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
        assert torch.equal(a.global_scale, b.global_scale) and a.shape == b.shape == (6, 96)
        assert torch.equal(b.bits, nv.extract_guidance(nv.quantize(x.reshape(6, 96), amax="row", backend="torch")).bits)
    else:
        assert not recs["triton"]


def _moe_layer(n_exp=4, hidden=64, inter=32, seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.Module()
    cfg = types.SimpleNamespace(has_bias=False, activation=None)  # the fields the method reads
    m = QuadsNVFP4MoEMethod(cfg, ActQuant("naive"))
    m.create_weights(layer, n_exp, hidden, inter, torch.bfloat16, weight_loader=lambda *a: None)
    layer.w13_weight.data.copy_(torch.randn(n_exp, 2 * inter, hidden) * 0.1)
    layer.w2_weight.data.copy_(torch.randn(n_exp, hidden, inter) * 0.1)
    m.process_weights_after_loading(layer)
    return layer, cfg


@pytest.mark.parametrize("mode, per_token, expert_map, combine, gran", [  # gran: as test_linear_apply_triton_equals_torch
    ("w4a16", False, False, "fp4x2", None), ("naive", False, True, "fp4x2", None),
    ("quads", False, False, "fp4x2", "block"), ("quads", True, False, "fp4x2", None),
    ("quads", True, False, "fp4x2", "block"), ("quads", True, False, "fp4x2", "channel"),
    ("trace", False, False, "fp4x2", None),
    ("quads", True, True, "auto", None), ("quads", False, False, "bf16", "block"), ("trace", False, True, "fp4x2", None),
])
def test_moe_apply_triton_equals_torch(monkeypatch, mode, per_token, expert_map, combine, gran):
    layer, cfg = _moe_layer()
    if expert_map:  # expert parallel: global experts 0..5, this rank holds 4 of them, 1 and 4 elsewhere
        layer.expert_map = torch.tensor([0, -1, 1, 2, -1, 3])
    t = 7
    x = torch.randn(t, 64, dtype=torch.bfloat16)
    x[:, 9] *= 15
    ids = torch.tensor([[0, 3], [1, 3], [2, 0], [3, 2], [0, 1], [3, 5], [2, 4]])
    if not expert_map:
        ids = ids % 4
    tw = torch.softmax(torch.randn(t, 2), -1)
    outs, recs = {}, {}
    for backend in ("torch", "triton"):
        act = _act(monkeypatch, backend, mode, per_token, combine, gran, "model.layers.5.mlp.experts")
        m = QuadsNVFP4MoEMethod(cfg, act, backend, capture_layer=5 if mode == "trace" else None)
        outs[backend], recs[backend] = _one_step(monkeypatch, t, lambda: m.apply(layer, x, tw, ids, None, None))
    _close(outs["triton"], outs["torch"],
           f"moe {mode} per_token={per_token} expert_map={expert_map} combine={combine} granularity={gran}")
    assert set(recs["triton"]) == set(recs["torch"])
    if mode == "trace":  # the local expert of each slot (-1: on another rank) stored beside w2's record, int16
        local = (layer.expert_map[ids] if expert_map else ids).to(torch.int16)
        for backend in ("torch", "triton"):
            assert torch.equal(recs[backend].pop("expert_ids")[5], local), backend
    for key in recs["torch"]:
        a, b = recs["torch"][key], recs["triton"][key]
        assert a.shape == b.shape and torch.equal(a.bits, b.bits), key
        assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8)), key
        assert torch.equal(a.global_scale, b.global_scale), key
    if mode == "trace":  # the w13 record is x's own (the triton kernels wrote the store's rows themselves)
        assert set(recs["triton"]) == {(5, "mlp.experts.w13"), (5, "mlp.experts.w2")}
        w13 = recs["triton"][(5, "mlp.experts.w13")]
        assert torch.equal(w13.bits, nv.extract_guidance(nv.quantize(x, amax="row", backend="torch")).bits)
        assert recs["triton"][(5, "mlp.experts.w2")].shape == (t, 2, 32)


def test_moe_triton_single_token_decode():
    """M = 1 (decode): 2 active experts of 4, one grouped launch per GEMM."""
    layer, cfg = _moe_layer(seed=1)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    ids, tw = torch.tensor([[2, 1]]), torch.tensor([[0.7, 0.3]])
    ref = QuadsNVFP4MoEMethod(cfg, ActQuant("naive")).apply(layer, x, tw, ids, None, None)
    y = QuadsNVFP4MoEMethod(cfg, ActQuant("naive"), "triton").apply(layer, x, tw, ids, None, None)
    _close(y, ref, "moe naive M=1")


def test_triton_methods_compile_as_opaque_custom_ops():
    """vLLM compiles the model with torch.compile: the triton path must trace without graph breaks
    (fullgraph=True; the launch code is hidden behind torch.ops.verl_quads.*) and give the eager result.
    backend="eager": Dynamo's graph capture only (no Inductor / C++ compiler needed here)."""
    layer = _linear_layer()
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    lin = QuadsNVFP4LinearMethod(ActQuant("quads", 0.5, True), "triton")
    moe_layer, cfg = _moe_layer()
    moe = QuadsNVFP4MoEMethod(cfg, ActQuant("naive"), "triton")
    xm = torch.randn(3, 64, dtype=torch.bfloat16)
    ids, tw = torch.tensor([[0, 3], [1, 3], [2, 0]]), torch.full((3, 2), 0.5)
    torch._dynamo.reset()
    f_lin = torch.compile(lambda x: lin.apply(layer, x), backend="eager", fullgraph=True)
    f_moe = torch.compile(lambda x, w, i: moe.apply(moe_layer, x, w, i, None, None), backend="eager", fullgraph=True)
    assert torch.equal(f_lin(x), lin.apply(layer, x))
    assert torch.equal(f_moe(xm, tw, ids), moe.apply(moe_layer, xm, tw, ids, None, None))
    # residual_combine travels through the op's schema (a graph-time constant): bf16 stays bf16 when compiled
    lin_bf = QuadsNVFP4LinearMethod(ActQuant("quads", 0.5, True, residual_combine="bf16"), "triton")
    f_bf = torch.compile(lambda x: lin_bf.apply(layer, x), backend="eager", fullgraph=True)
    y_bf = f_bf(x)
    assert torch.equal(y_bf, lin_bf.apply(layer, x)) and not torch.equal(y_bf, lin.apply(layer, x))


@pytest.mark.parametrize("per_token, dtype, bound", [(True, torch.bfloat16, 2 ** -8), (False, torch.bfloat16, 2 ** -8),
                                                     (True, torch.float16, 2 ** -11)])
def test_quads_bf16_operand_is_the_cores_residual_fake_quantize(per_token, dtype, bound):
    """residual_combine="bf16": both backends' operand is the NVFP4 core's QDQ form (torch reference bytes),
    which is the float32 fp4x2 operand rounded ONCE to the activation dtype (independent check through
    residual_quantize; relative <= 2**-8 for bf16, 2**-11 for fp16); the triton GEMM on it is exactly the
    w4a16 GEMM of that activation."""
    from verl_quads import nvfp4 as nv
    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.rollout import emulation as em

    torch.manual_seed(3)
    x = torch.randn(5, 96, dtype=dtype)
    x[:, 7] *= 20
    x[2, 40:56] *= 0.01
    gs = nv.per_row_global_scale(x)
    want = nv.residual_fake_quantize(x, 0.5, gs, per_token=per_token, backend="torch")
    assert want.dtype == dtype
    # the core's QDQ form = the two-pass sum in float32, rounded once
    f32 = nv.residual_quantize(x, 0.5, gs, per_token=per_token, backend="torch").dequantize(torch.float32)
    assert torch.equal(want, f32.to(dtype))
    rel = float(((want.float() - f32).abs() / f32.abs().clamp_min(1e-30)).max())
    print(f"{dtype} operand vs fp4x2 operand: max relative difference {rel:.2e} (bound {bound:.2e})")
    assert 0 < rel <= bound
    op, rec = tg.quantize_activation(x, "quads", residual_ratio=0.5, residual_per_token=per_token,
                                     residual_combine="bf16")
    assert rec is None and op.mode == "w4a16" and op.first is None and op.second_packed is None
    assert torch.equal(op.values, want)
    # the block rule through the plugin's ActQuant (the core and triton_gemm default to blocks; the product to channels)
    xf, _ = em.quantize_activation(x, ActQuant("quads", 0.5, per_token, residual_combine="bf16",
                                               residual_granularity="block"))
    assert xf.dtype == torch.float32 and torch.equal(xf, want.float())
    fp4x2, _ = em.quantize_activation(x, ActQuant("quads", 0.5, per_token, residual_granularity="block"))
    assert torch.equal(fp4x2, f32)  # the default operand is unchanged (never rounded)
    layer = _linear_layer()
    w = (layer.weight_packed, layer.weight_scale, layer.weight_global_scale)
    y = tg.nvfp4_linear(x, *w, None, "quads", residual_per_token=per_token, residual_combine="bf16")
    assert torch.equal(y, tg.nvfp4_linear(want, *w, None, "w4a16"))
    with pytest.raises(ValueError, match=r"residual_combine must be one of \('fp4x2', 'bf16'\), got 'fp16'"):
        tg.quantize_activation(x, "quads", residual_combine="fp16")
    with pytest.raises(ValueError, match=r"ActQuant.residual_combine \(quant_config.residual_combine\) must be one of"):
        ActQuant("quads", residual_combine="fp8")


def test_native_refuses_quads_bf16_combine():
    """Blackwell's native backend runs vLLM's FP4 GEMM on the two FP4 operands: residual_combine="bf16"
    is refused there (at method construction; no Blackwell GPU needed for the refusal)."""
    with pytest.raises(ValueError, match=r"residual_combine='bf16' is for the emulated backends.*'native'.*'fp4x2'"):
        QuadsNVFP4LinearMethod(ActQuant("quads", residual_combine="bf16"), "native")


def test_moe_trace_refuses_expert_ids_beyond_int16():
    """TRACE keeps each slot's expert id as int16 in the guidance rows: a model with more experts is refused when
    its MoE layer is built (naming the layer and the limit), never wrapped silently."""
    cfg = types.SimpleNamespace(has_bias=False, activation=None, num_experts=40000, experts_per_token=2)
    layer = torch.nn.Module()
    layer.layer_name = "model.layers.5.mlp.experts"
    m = QuadsNVFP4MoEMethod(cfg, ActQuant("trace"), capture_layer=5)
    with pytest.raises(NotImplementedError, match=r"model.layers.5.mlp.experts has 40000 experts.*at most 32767"):
        m.create_weights(layer, 4, 64, 32, torch.bfloat16, weight_loader=lambda *a: None)
