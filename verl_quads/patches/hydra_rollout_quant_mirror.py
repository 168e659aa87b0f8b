"""Mirror ``actor_rollout_ref.actor.quant`` / ``quant_config`` into verl's rollout config as Hydra loads it.

Upstream: verl 0.9.1's ``ppo_trainer.yaml`` pulls ``rollout/rollout.yaml`` into
``actor_rollout_ref.rollout``; that node's ``_target_`` is ``verl.workers.config.RolloutConfig``,
instantiated in the rollout replica (``RolloutReplica.__init__``) and in the workers. vLLM's server
(``vllm_async_server.vLLMHttpServer.launch_server``) builds the engine arguments from that config
only — it never sees the actor config — and spreads ``engine_kwargs.vllm`` last into them. verl
itself carries its own QAT switch across the same way: ``rollout.yaml`` has
``qat: ${oc.select:actor_rollout_ref.actor.fsdp_config.qat,...}``.

Why we change it: ``actor_rollout_ref.actor.quant`` must be the only switch (issue 4); the rollout
engine must start in ``quads_nvfp4`` in the matching mode without a second setting.

What we change: Hydra's ``ConfigRepository.load_config`` (hydra-core 1.3.8), only for the config
``rollout/rollout`` whose ``_target_`` is verl's ``RolloutConfig``: the loaded node gets
``quant: ${oc.select:actor_rollout_ref.actor.quant,none}`` and
``quant_config: ${oc.select:actor_rollout_ref.actor.quant_config,null}`` (resolved by verl's
``OmegaConf.resolve`` in ``main_ppo`` before any worker starts; ``none`` where the actor has no such
key, e.g. Megatron), and its ``_target_`` becomes
:class:`verl_quads.integration.verl_config.QuadsRolloutConfig` (a subclass: every ``isinstance``
check holds), which turns them into ``engine_kwargs.vllm.quantization`` / ``hf_overrides``. The
actor-key patch (``hydra_actor_quant_key``) is installed first and stays inside this wrapper.
Any other ``_target_`` on ``rollout/rollout`` means upstream changed: loud error.
"""

from __future__ import annotations

from verl_quads.patches._guard import PatchVersionError, install_config_augmenter, require_version

PATCH = "hydra_rollout_quant_mirror"
SUPPORTED_HYDRA = ("1.3.8",)
SUPPORTED_VERL = ("0.9.1",)
CONFIG_PATH = "rollout/rollout"
QUANT_INTERP = "${oc.select:actor_rollout_ref.actor.quant,none}"
OPTIONS_INTERP = "${oc.select:actor_rollout_ref.actor.quant_config,null}"


def augment(config_path: str, config):
    """The ``rollout/rollout`` node with the mirrored keys (a new node), or None for any other config."""
    from omegaconf import OmegaConf, open_dict

    from verl_quads.integration.verl_config import QUADS_ROLLOUT_TARGET, STOCK_ROLLOUT_TARGET

    if config_path != CONFIG_PATH or config is None:
        return None
    target = config.get("_target_")
    if target == QUADS_ROLLOUT_TARGET:
        return None
    if target != STOCK_ROLLOUT_TARGET:
        raise PatchVersionError(
            f"verl-quads patch {PATCH!r}: Hydra config {CONFIG_PATH!r} has _target_={target!r}, expected "
            f"{STOCK_ROLLOUT_TARGET!r} (verl {', '.join(SUPPORTED_VERL)}); verl's rollout config changed, re-read it"
        )
    if "quant" in config or "quant_config" in config:
        raise PatchVersionError(
            f"verl-quads patch {PATCH!r}: verl's {CONFIG_PATH!r} now defines 'quant'/'quant_config' itself; "
            "re-read upstream before mirroring ours"
        )
    new = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    with open_dict(new):
        new.quant = QUANT_INTERP
        new.quant_config = OPTIONS_INTERP
        new._target_ = QUADS_ROLLOUT_TARGET
    return new


def apply(*, hydra_version: str | None = None, verl_version: str | None = None) -> bool:
    """Install the wrapper (idempotent; after the actor-key patch). Returns True if installed now."""
    require_version(PATCH, ("hydra-core",), SUPPORTED_HYDRA, found=hydra_version)
    require_version(PATCH, ("verl",), SUPPORTED_VERL, found=verl_version)
    from verl_quads.patches import hydra_actor_quant_key

    hydra_actor_quant_key.apply()
    return install_config_augmenter(PATCH, augment)


__all__ = ["PATCH", "SUPPORTED_HYDRA", "SUPPORTED_VERL", "CONFIG_PATH", "augment", "apply"]
