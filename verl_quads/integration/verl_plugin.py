"""``verl.plugins`` entry point.

verl 0.9.1 resolves every entry point of the group ``verl.plugins`` on ``import verl`` (it
loads the object, it does not call it), so registration happens when this module is imported:
:func:`load` runs at import time and is also exposed so the entry point can name it.
"""

from __future__ import annotations

from verl_quads._plugin_errors import loud


@loud("verl plugin (verl.plugins entry point)")
def load() -> None:
    """Register verl-quads with verl. Idempotent."""
    from verl_quads.integration.trainer import register_trainer

    register_trainer()  # actor.quant config key + QAT engine; must run before the CPU engines register
    from verl_quads.patches import hydra_rollout_quant_mirror

    hydra_rollout_quant_mirror.apply()  # rollout.{quant,quant_config} mirror actor's -> vLLM quads_nvfp4 (one switch)
    from verl_quads.patches import apply_verl_cpu_patches

    apply_verl_cpu_patches()  # CPU platform + CPU patches; no-op with an accelerator torch
    from verl_quads.patches import verl_gap_metrics

    verl_gap_metrics.apply()  # quads/logp_gap_* and quads/k3_kl next to verl's rollout metrics


load()
