"""Every GPU recipe in ``recipes/`` composes with verl 0.9.1's own Hydra config (no run, no hub).

For each recipe x mode, ``recipes/run.sh`` is executed with ``PYTHON`` pointing at a stand-in that
records its argument vector instead of starting verl, so the overrides tested are exactly what the
script would pass to ``python -m verl.trainer.main_ppo``. They are then composed into verl's stock
``ppo_trainer`` config (with the verl-quads plugin loaded by ``import verl``, as in a real run) and the
actor / rollout nodes are converted into verl's config dataclasses: a typo, a renamed verl key or a bad
value fails here. Every mode runs through run.sh (none is refused).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.verl

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.args"))
MODES = sorted(p.stem for p in (ROOT / "recipes" / "modes").glob("*.args"))


def test_recipe_set_is_complete():
    assert {"grpo_math_qwen3_30b_a3b", "grpo_code_qwen3_30b_a3b", "grpo_math_olmoe_1gpu"} <= set(RECIPES), RECIPES
    assert {"bf16", "fp8", "naive", "quads", "trace"} <= set(MODES), MODES


def _run_sh_args(tmp_path: Path, recipe: str, mode: str) -> tuple[int, list[str], str]:
    record = tmp_path / f"{recipe}-{mode}.argv"
    fake = tmp_path / "fake_python"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "{record}"\n')
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "recipes" / "run.sh"), recipe, mode], env=dict(os.environ, PYTHON=str(fake)),
                          capture_output=True, text=True, timeout=60)
    argv = record.read_bytes().decode().split("\0")[:-1] if record.exists() else []
    return proc.returncode, argv, proc.stderr


def _mode_lines(mode: str) -> list[str]:
    lines = (ROOT / "recipes" / "modes" / f"{mode}.args").read_text().splitlines()
    return [ln for ln in lines if ln and not ln.startswith("#")]


def _compose(overrides: list[str]):
    import verl  # noqa: F401  (loads the verl-quads plugin: actor.quant keys, as in main_ppo)
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=overrides)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_with_verl(tmp_path, recipe, mode):
    from verl.utils.config import omega_conf_to_dataclass

    from verl_quads.config import QuantConfig
    from verl_quads.rollout.quant_config import quant_config_from_args

    rc, argv, err = _run_sh_args(tmp_path, recipe, mode)
    assert rc == 0, err
    assert argv[:2] == ["-m", "verl.trainer.main_ppo"], argv[:3]
    overrides = argv[2:]
    assert overrides[-len(_mode_lines(mode)):] == _mode_lines(mode)

    cfg = _compose(overrides)
    arr = cfg.actor_rollout_ref
    assert arr.model.path and "${" not in str(arr.model.path)
    actor = omega_conf_to_dataclass(arr.actor)
    rollout = omega_conf_to_dataclass(arr.rollout)
    assert cfg.algorithm.adv_estimator == "grpo"
    assert rollout.calculate_log_probs is True  # the quads/* gap metrics need the rollout's log-probs

    quant = QuantConfig.from_mapping(arr.actor.quant, dict(arr.actor.get("quant_config") or {}))
    expected = {"bf16": "none", "fp8": "none"}.get(mode, mode)
    assert quant.quant == expected
    assert getattr(actor, "quant_settings", quant).quant == expected
    if mode == "fp8":
        assert rollout.quantization == "fp8"
    else:
        assert rollout.quantization is None
    # actor.quant alone configures vLLM: the rollout config verl builds carries the engine settings
    vllm_kwargs = (rollout.engine_kwargs or {}).get("vllm", {}) or {}
    if quant.rollout_mode == "none":
        assert "quantization" not in vllm_kwargs
    else:  # the vLLM engine runs quads_nvfp4 in the same mode as the trainer expects
        assert vllm_kwargs["quantization"] == "quads_nvfp4"
        from omegaconf import OmegaConf

        qc_args = vllm_kwargs["hf_overrides"]["quantization_config"]
        if not isinstance(qc_args, dict):
            qc_args = OmegaConf.to_container(qc_args)
        qc = quant_config_from_args(qc_args)
        assert qc.rollout_mode == quant.rollout_mode
    if mode == "trace":
        # CUDA graphs stay on (verl's default): the triton / native backends record guidance inside them
        assert rollout.enable_prefix_caching is False and rollout.enforce_eager is False


def test_a_typo_fails_composition():
    """The check above can fail: a misspelt verl key is rejected by verl's struct config."""
    lines = [ln for ln in (ROOT / "recipes" / "grpo_math_olmoe_1gpu.args").read_text().splitlines()
             if ln and not ln.startswith("#")]
    with pytest.raises(Exception, match="gpu_memory_utilisation"):
        _compose(lines + ["actor_rollout_ref.rollout.gpu_memory_utilisation=0.5"])
