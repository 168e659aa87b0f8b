"""One switch: ``actor_rollout_ref.actor.quant`` alone configures verl's vLLM rollout (real verl 0.9.1 + Hydra).

The rollout node mirrors the actor's ``quant`` / ``quant_config`` (patch ``hydra_rollout_quant_mirror``);
``QuadsRolloutConfig`` turns them into ``engine_kwargs.vllm`` (``quantization`` + ``hf_overrides``), which
verl's ``vLLMHttpServer.launch_server`` spreads last into vLLM's engine arguments.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

verl = pytest.importorskip("verl")

from hydra import compose, initialize_config_module  # noqa: E402
from hydra.errors import InstantiationException  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from verl_quads.config import QUANT_MODES, QuantConfig  # noqa: E402
from verl_quads.patches._guard import PatchVersionError  # noqa: E402

BASE = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.strategy=fsdp2"]


def _rollout(*overrides):
    """Compose like main_ppo, resolve like its TaskRunner, instantiate like verl's replica/workers."""
    from verl.utils.config import omega_conf_to_dataclass

    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=[*BASE, *overrides])
    OmegaConf.resolve(cfg)
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)


#: What a trace rollout needs beyond actor.quant (verl's default is the opposite; recipes/modes/trace.args)
TRACE_NEEDS = ["actor_rollout_ref.rollout.enable_prefix_caching=False"]
EAGER = "actor_rollout_ref.rollout.enforce_eager=True"


def test_trace_rollout_with_prefix_caching_fails_at_config_time():
    """verl's default (prefix caching on) would make the trace vLLM engine refuse to start inside a Ray worker: the
    rollout config refuses it first, in the driver, naming the key."""
    with pytest.raises(Exception, match=r"actor\.quant=trace needs actor_rollout_ref\.rollout\.enable_prefix_caching"
                                        r"=False") as e:
        _rollout("actor_rollout_ref.actor.quant=trace", EAGER)
    assert "enforce_eager" not in str(e.value)


def test_trace_rollout_runs_compiled_unless_its_backend_needs_eager():
    """A trace rollout on the GPU backends records guidance inside CUDA graphs (verl's default enforce_eager=False is
    accepted: backend auto, triton, native); the torch backend (the reference emulation) needs an eager engine:
    refused in the driver, naming the key and the reason."""
    for backend in ("auto", "triton", "native"):
        _rollout("actor_rollout_ref.actor.quant=trace", f"actor_rollout_ref.actor.quant_config.backend={backend}",
                 *TRACE_NEEDS)
    with pytest.raises(Exception, match=rf"actor\.quant=trace needs {EAGER.replace('.', '[.]')} \(.*backend 'torch'"):
        _rollout("actor_rollout_ref.actor.quant=trace", "actor_rollout_ref.actor.quant_config.backend=torch",
                 *TRACE_NEEDS)
    _rollout("actor_rollout_ref.actor.quant=trace", "actor_rollout_ref.actor.quant_config.backend=torch",
             *TRACE_NEEDS, EAGER)


@pytest.mark.parametrize("quant", QUANT_MODES)
def test_actor_quant_alone_configures_vllm(quant):
    from verl.workers.config import RolloutConfig

    r = _rollout(f"actor_rollout_ref.actor.quant={quant}", "actor_rollout_ref.actor.quant_config.residual_ratio=0.25",
                 "actor_rollout_ref.actor.quant_config.guided_layers=3", *(TRACE_NEEDS if quant == "trace" else []))
    assert isinstance(r, RolloutConfig) and type(r).__name__ == "QuadsRolloutConfig"
    qc = QuantConfig(quant=quant, residual_ratio=0.25, guided_layers=3)
    vk = r.engine_kwargs["vllm"]
    if qc.rollout_mode == "none":
        assert vk == {} and r.quantization is None
        return
    assert vk["quantization"] == "quads_nvfp4"
    want = vk["hf_overrides"]["quantization_config"]
    assert want == {"quant_method": "quads_nvfp4", **qc.to_dict()}
    # what vLLM's quads_nvfp4 config reads from it: the rollout mode and the options
    from verl_quads.rollout.quant_config import quant_config_from_args

    got = quant_config_from_args(want)
    assert got == qc and got.rollout_mode == qc.rollout_mode


def test_stock_vllm_when_quant_none_and_other_hf_overrides_kept():
    r = _rollout("+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides={rope_theta:1000}")
    assert r.engine_kwargs["vllm"] == {"hf_overrides": {"rope_theta": 1000}}
    r = _rollout("actor_rollout_ref.actor.quant=quads",
                 "+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides={rope_theta:1000}")
    hf = r.engine_kwargs["vllm"]["hf_overrides"]
    assert hf["rope_theta"] == 1000 and hf["quantization_config"]["quant"] == "quads"


def test_redundant_matching_engine_kwargs_are_accepted():
    r = _rollout("actor_rollout_ref.actor.quant=quads",
                 "+actor_rollout_ref.rollout.engine_kwargs.vllm.quantization=quads_nvfp4",
                 "+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides="
                 "{quantization_config:{quant_method:quads_nvfp4,quant:quads}}")
    assert r.engine_kwargs["vllm"]["hf_overrides"]["quantization_config"]["residual_ratio"] == 0.5


@pytest.mark.parametrize("overrides,message", [
    (["actor_rollout_ref.actor.quant=quads", "+actor_rollout_ref.rollout.engine_kwargs.vllm.quantization=fp8"],
     r"actor_rollout_ref\.rollout\.engine_kwargs\.vllm\.quantization='fp8' conflicts with "
     r"actor_rollout_ref\.actor\.quant=quads"),
    (["actor_rollout_ref.actor.quant=quads", "actor_rollout_ref.rollout.quantization=fp8"],
     r"actor_rollout_ref\.rollout\.quantization='fp8' conflicts with actor_rollout_ref\.actor\.quant=quads"),
    (["actor_rollout_ref.actor.quant=quads", "+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides="
      "{quantization_config:{quant_method:quads_nvfp4,quant:naive}}"],
     r"actor_rollout_ref\.rollout\.engine_kwargs\.vllm\.hf_overrides\.quantization_config=.*conflicts with "
     r"actor_rollout_ref\.actor\.quant=quads"),
    (["+actor_rollout_ref.rollout.engine_kwargs.vllm.quantization=quads_nvfp4"],
     r"engine_kwargs\.vllm\.quantization=quads_nvfp4 with actor_rollout_ref\.actor\.quant=none"),
    (["actor_rollout_ref.actor.quant=naive", "actor_rollout_ref.rollout.name=sglang"],
     r"actor_rollout_ref\.actor\.quant=naive needs actor_rollout_ref\.rollout\.name=vllm"),
])
def test_conflicting_rollout_quantization_fails_naming_both_keys(overrides, message):
    with pytest.raises(InstantiationException, match=message) as ei:
        _rollout(*overrides)
    assert isinstance(ei.value.__cause__, ValueError)


def test_quads_selection_rule_default_and_per_call_through_the_verl_config():
    """verl's composed config: quant=quads alone hands vLLM the per-token sampled-threshold channel rule
    (QuantConfig's default since session 33);
    quant_config.residual_per_token=false alone fails at instantiation naming residual_granularity=block (no silent
    switch of rule); with residual_granularity=block it configures per-call block selection."""
    qc = _rollout("actor_rollout_ref.actor.quant=quads").engine_kwargs["vllm"]["hf_overrides"]["quantization_config"]
    assert (qc["residual_granularity"], qc["residual_per_token"]) == ("channel_sampled", True)
    with pytest.raises(InstantiationException, match=r"residual_per_token=false.*set actor_rollout_ref\.actor\."
                                                     r"quant_config\.residual_granularity=block") as ei:
        _rollout("actor_rollout_ref.actor.quant=quads", "actor_rollout_ref.actor.quant_config.residual_per_token=false")
    assert isinstance(ei.value.__cause__, ValueError)
    per_call = ["actor_rollout_ref.actor.quant=quads", "actor_rollout_ref.actor.quant_config.residual_per_token=false",
                "actor_rollout_ref.actor.quant_config.residual_granularity=block"]
    with pytest.raises(Exception, match=r"quant=quads needs actor_rollout_ref\.rollout\.enforce_eager=True "
                                        r"\(quant_config\.residual_per_token=false reads"):
        _rollout(*per_call)  # a host read per MoE forward: no CUDA graphs
    qc = _rollout(*per_call, "actor_rollout_ref.rollout.enforce_eager=True"
                  ).engine_kwargs["vllm"]["hf_overrides"]["quantization_config"]
    assert (qc["residual_granularity"], qc["residual_per_token"]) == ("block", False)


def test_torch_backend_needs_an_eager_rollout_at_config_time():
    with pytest.raises(Exception, match=r"quant=w4a16 needs actor_rollout_ref\.rollout\.enforce_eager=True "
                                        r"\(quant_config\.backend=torch"):
        _rollout("actor_rollout_ref.actor.quant=w4a16", "actor_rollout_ref.actor.quant_config.backend=torch")
    _rollout("actor_rollout_ref.actor.quant=w4a16", "actor_rollout_ref.actor.quant_config.backend=torch",
             "actor_rollout_ref.rollout.enforce_eager=True")
    _rollout("actor_rollout_ref.actor.quant=none", "actor_rollout_ref.actor.quant_config.backend=torch")  # stock BF16


def test_test_only_env_var_forces_a_mismatched_engine(monkeypatch):
    from verl_quads.integration.verl_config import TEST_FORCE_ROLLOUT_QUANT_ENV

    monkeypatch.setenv(TEST_FORCE_ROLLOUT_QUANT_ENV, "none")
    r = _rollout("actor_rollout_ref.actor.quant=quads")
    assert r.quant == "none" and r.engine_kwargs["vllm"] == {}


def test_upstream_symbols_the_wiring_relies_on():
    """Fails loudly when verl changes what the mirror + engine_kwargs route depend on."""
    import yaml
    from hydra._internal.config_repository import ConfigRepository
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.vllm_rollout import vllm_async_server as srv

    from verl_quads.patches import hydra_rollout_quant_mirror as h

    root = Path(verl.__file__).parent / "trainer" / "config"
    raw = yaml.safe_load((root / "rollout" / "rollout.yaml").read_text())
    assert raw["_target_"] == "verl.workers.config.RolloutConfig"
    assert "quant" not in raw and "quant_config" not in raw
    assert raw["qat"].startswith("${oc.select:actor_rollout_ref.actor.fsdp_config.qat")  # verl's own mirror
    assert "rollout@actor_rollout_ref.rollout: rollout" in (root / "ppo_trainer.yaml").read_text()
    assert "engine_kwargs" in RolloutConfig._mutable_fields and "calculate_log_probs" in RolloutConfig.__dataclass_fields__
    src = inspect.getsource(srv.vLLMHttpServer.launch_server)
    assert 'self.config.get("engine_kwargs", {}).get(self._get_engine_kwargs_key(), {})' in src
    assert src.index('"hf_overrides": hf_overrides,') < src.index("**engine_kwargs,"), "engine_kwargs no longer last"
    from verl.trainer.main_ppo import TaskRunnerV1
    from verl.trainer.main_ppo_v0 import TaskRunner

    for runner in (TaskRunnerV1, TaskRunner):  # the mirrors are resolved before any worker gets the config
        assert "OmegaConf.resolve(config)" in inspect.getsource(runner.run), runner
    wrapped = ConfigRepository.load_config
    from verl_quads.patches._guard import patches_in_chain

    chain = patches_in_chain(wrapped)
    assert h.PATCH in chain, "mirror patch not installed by import verl"
    assert "hydra_actor_quant_key" in chain  # the actor-key patch is still in the chain
    assert h.apply() is False  # idempotent
    with pytest.raises(PatchVersionError, match="hydra-core 1.3.8; found 1.4.0"):
        h.apply(hydra_version="1.4.0")
    with pytest.raises(PatchVersionError, match="verl 0.9.1; found 0.10.0"):
        h.apply(verl_version="0.10.0")
    with pytest.raises(PatchVersionError, match="_target_='verl.workers.config.SomethingElse'"):
        h.augment("rollout/rollout", OmegaConf.create({"_target_": "verl.workers.config.SomethingElse"}))
    with pytest.raises(PatchVersionError, match="now defines 'quant'"):
        h.augment("rollout/rollout", OmegaConf.create({"_target_": "verl.workers.config.RolloutConfig", "quant": 1}))
    assert h.augment("actor/dp_actor", OmegaConf.create({"_target_": "x"})) is None


def test_residual_combine_option_reaches_vllm_and_is_validated():
    """actor_rollout_ref.actor.quant_config.residual_combine (like residual_ratio): typed key, mirrored into the
    rollout's vLLM quantization config; default auto (resolved by the plugin at engine start); a value outside
    auto/fp4x2/bf16 fails naming the key and the allowed values."""
    from verl_quads.rollout.quant_config import quant_config_from_args

    r = _rollout("actor_rollout_ref.actor.quant=quads", "actor_rollout_ref.actor.quant_config.residual_combine=bf16")
    want = r.engine_kwargs["vllm"]["hf_overrides"]["quantization_config"]
    assert want["residual_combine"] == "bf16" and quant_config_from_args(want).residual_combine == "bf16"
    assert _rollout("actor_rollout_ref.actor.quant=quads").quant_config["residual_combine"] == "auto"
    with pytest.raises(InstantiationException,
                       match=r"actor_rollout_ref\.actor\.quant_config\.residual_combine='fp16': allowed: auto, fp4x2, bf16"):
        _rollout("actor_rollout_ref.actor.quant=quads", "actor_rollout_ref.actor.quant_config.residual_combine=fp16")
