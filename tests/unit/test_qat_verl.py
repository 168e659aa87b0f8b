"""verl 0.9.1 integration of the trainer half: config key, validation, engine registration, verl's own QAT.

Uses real verl (its Hydra configs, dataclasses, EngineRegistry, its QAT) and real Hydra composition.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

verl = pytest.importorskip("verl")

from hydra import compose, initialize_config_module  # noqa: E402
from hydra.errors import ConfigCompositionException  # noqa: E402

from verl_quads.patches._guard import PatchVersionError  # noqa: E402

BASE = ["actor_rollout_ref.actor.rollout_n=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.strategy=fsdp2"]


def _compose(*overrides):
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=list(overrides))


def _actor(*overrides):
    from verl.utils.config import omega_conf_to_dataclass

    return omega_conf_to_dataclass(_compose(*BASE, *overrides).actor_rollout_ref.actor)


def test_quant_key_exists_without_plus_and_reaches_the_engine_config():
    from verl.workers.config import FSDPActorConfig

    cfg = _compose("actor_rollout_ref.actor.quant=quads", "actor_rollout_ref.actor.quant_config.residual_ratio=0.25")
    assert cfg.actor_rollout_ref.actor.quant == "quads"
    a = _actor("actor_rollout_ref.actor.quant=trace", "actor_rollout_ref.actor.quant_config.guided_layers=4",
               "actor_rollout_ref.actor.quant_config.trace_base_mode=w4a4_qat")
    assert isinstance(a, FSDPActorConfig)
    assert a.quant == "trace" and a.quant_config["guided_layers"] == 4
    qc = a.engine._verl_quads_quant
    assert (qc.trainer_mode, qc.rollout_mode, qc.guided_layers, qc.trace_base_mode) == ("trace", "trace", 4, "w4a4_qat")
    assert qc.weight_qdq == "auto"  # default: per_version where it can run (fsdp_qdq.setup in the engine)
    v = _actor("actor_rollout_ref.actor.quant=quads", "actor_rollout_ref.actor.quant_config.weight_qdq=per_version")
    assert v.engine._verl_quads_quant.weight_qdq == "per_version"
    # Default: quant=none, stock behaviour; the ref model's config is untouched.
    d = _actor()
    assert d.quant == "none" and d.engine._verl_quads_quant.trainer_mode == "none"
    assert "quant" not in _compose().actor_rollout_ref.ref


@pytest.mark.parametrize("override,message", [
    ("actor_rollout_ref.actor.quant=w4a8", "Invalid value 'w4a8', expected one of [none, naive, w4a16, quads, trace, w4a4_qat]"),
    ("actor_rollout_ref.actor.quant_config.bogus=1", "Could not override 'actor_rollout_ref.actor.quant_config.bogus'"),
    ("actor_rollout_ref.actor.quant_config.guided_layers=many", "guided_layers"),
])
def test_bad_values_fail_at_composition(override, message):
    with pytest.raises(ConfigCompositionException) as ei:
        _compose(override)
    chain, e = [], ei.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__
    assert any(message in c for c in chain), chain


@pytest.mark.parametrize("overrides,message", [
    (["actor_rollout_ref.actor.quant_config.residual_ratio=1.5"], r"residual_ratio=1.5: must be a number in \[0, 1\]"),
    (["actor_rollout_ref.actor.quant_config.trace_base_mode=none"], "trace_base_mode='none': allowed: w4a16, w4a4_qat"),
    (["actor_rollout_ref.actor.quant_config.weight_qdq=per_step"], "weight_qdq='per_step': allowed: auto, per_forward, per_version"),
    (["actor_rollout_ref.actor.fsdp_config.qat.enable=true"], "verl's QAT and verl-quads would both fake-quantize"),
    (["actor_rollout_ref.actor.strategy=fsdp"], "needs actor_rollout_ref.actor.strategy=fsdp2"),
])
def test_invalid_combinations_fail_when_verl_instantiates_the_actor_config(overrides, message):
    from hydra.errors import InstantiationException

    # Hydra wraps the dataclass's ValueError, keeping its message (and the full key).
    with pytest.raises(InstantiationException, match=message) as ei:
        _actor("actor_rollout_ref.actor.quant=quads", *overrides)
    assert isinstance(ei.value.__cause__, ValueError)


def test_engine_registered_for_cpu_and_nvidia():
    import verl.workers.engine.fsdp.transformer_impl as impl
    from verl.workers.engine.base import EngineRegistry

    for backend in ("fsdp", "fsdp2"):
        reg = EngineRegistry._engines["language_model"][backend]
        for key in ("cpu", ("cuda", "nvidia")):
            assert issubclass(reg[key], impl.FSDPEngineWithLMHead) and reg[key].__name__ == "QuadsFSDPEngineWithLMHead"
        assert reg["cuda"] is impl.FSDPEngineWithLMHead  # verl's own entry is left alone


def test_hydra_patch_guards_upstream():
    import importlib.metadata as md

    import yaml

    from verl_quads.patches import hydra_actor_quant_key as h

    # The upstream file we augment: verl's dp_actor.yaml, its _target_, and no quant key of its own.
    path = Path(verl.__file__).parent / "trainer" / "config" / "actor" / "dp_actor.yaml"
    raw = yaml.safe_load(path.read_text())
    assert raw["_target_"] == "verl.workers.config.FSDPActorConfig"
    assert "quant" not in raw and "quant_config" not in raw
    from hydra._internal.config_repository import ConfigRepository

    from verl_quads.patches._guard import patches_in_chain

    assert h.PATCH in patches_in_chain(ConfigRepository.load_config), "patch not installed by import verl"
    assert h.apply() is False  # idempotent, also under the rollout mirror's wrapper
    assert md.version("hydra-core") in h.SUPPORTED_HYDRA
    with pytest.raises(PatchVersionError, match="hydra-core 1.3.8; found 1.4.0"):
        h.apply(hydra_version="1.4.0")
    with pytest.raises(PatchVersionError, match="verl 0.9.1; found 0.10.0"):
        h.apply(verl_version="0.10.0")
    from omegaconf import OmegaConf

    with pytest.raises(PatchVersionError, match="_target_='verl.workers.config.SomethingElse'"):
        h.augment("actor/dp_actor", OmegaConf.create({"_target_": "verl.workers.config.SomethingElse"}))


def test_verl_qat_does_not_fake_quantize_fused_experts():
    """verl's own QAT (verl/utils/qat) under transformers 5: which parameters of a Qwen3-MoE does it cover?"""
    pytest.importorskip("triton")
    from qat_models import tiny_model
    from verl.utils.qat.core import apply_qat as verl_apply_qat
    from verl.utils.qat.linear import QATLinear

    model = tiny_model("qwen3_moe", dtype=torch.float32)
    model = verl_apply_qat(model, {"enable": True, "mode": "w4a16", "group_size": 16,
                                   "ignore_patterns": ["lm_head", "embed_tokens", "re:.*mlp.gate$"]})
    wrapped = {n for n, m in model.named_modules() if isinstance(m, QATLinear)}
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert wrapped and all(".self_attn." in n for n in wrapped)  # only attention projections
    assert experts and all(not isinstance(e, QATLinear) and type(e).__name__ == "Qwen3MoeExperts" for e in experts)
    decoder = {n: p.numel() for n, p in model.named_parameters() if ".layers." in n}
    covered = sum(v for n, v in decoder.items() if n.rsplit(".", 1)[0] in wrapped)
    expert_params = sum(v for n, v in decoder.items() if ".mlp.experts." in n)
    # Fused expert weights (most of an MoE decoder) are not fake-quantized by verl's QAT.
    assert expert_params > covered
    print(f"verl QAT covers {covered / sum(decoder.values()):.0%} of decoder parameters; experts "
          f"{expert_params / sum(decoder.values()):.0%} uncovered")
