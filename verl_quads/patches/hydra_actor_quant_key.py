"""Add ``quant`` / ``quant_config`` to verl's FSDP actor config as Hydra loads it.

Upstream: verl 0.9.1 composes its trainer config with Hydra in struct mode from YAML files in
``verl/trainer/config`` (``ppo_trainer.yaml`` pulls ``actor/dp_actor.yaml`` into
``actor_rollout_ref.actor``; that node's ``_target_`` is ``verl.workers.config.FSDPActorConfig``,
which verl instantiates with the node's keys in the driver's ``validate_config`` and in every
worker). A key that is not in those files can only be set with a ``+`` prefix, and an unknown key
is then rejected by the dataclass constructor.

Why we change it: the user-facing switch is ``actor_rollout_ref.actor.quant=<mode>`` on a stock
verl command line, with options under ``actor_rollout_ref.actor.quant_config.*``; verl has no
extension point for config keys.

What we change: Hydra's ``ConfigRepository.load_config`` (hydra-core 1.3.8), only for the config
``actor/dp_actor`` whose ``_target_`` is verl's ``FSDPActorConfig``: the loaded node gets the typed
keys of :func:`verl_quads.integration.verl_config.hydra_schema` (``quant: none`` and every option
with its default) and its ``_target_`` becomes ``QuadsFSDPActorConfig`` (a subclass: every
``isinstance`` check in verl still holds). Nothing else is touched; command-line overrides are
applied by Hydra afterwards as usual, so ``quant=bogus`` fails in composition with the allowed
values. Any other ``_target_`` on ``actor/dp_actor`` means upstream changed: loud error.
"""

from __future__ import annotations

from verl_quads.patches._guard import PatchVersionError, install_config_augmenter, require_version

PATCH = "hydra_actor_quant_key"
SUPPORTED_HYDRA = ("1.3.8",)
SUPPORTED_VERL = ("0.9.1",)
CONFIG_PATH = "actor/dp_actor"


def augment(config_path: str, config):
    """The ``actor/dp_actor`` node with our keys added (a new node), or None for any other config."""
    from omegaconf import OmegaConf, open_dict

    from verl_quads.integration.verl_config import QUADS_ACTOR_TARGET, STOCK_ACTOR_TARGET, hydra_schema

    if config_path != CONFIG_PATH or config is None:
        return None
    target = config.get("_target_")
    if target == QUADS_ACTOR_TARGET:
        return None
    if target != STOCK_ACTOR_TARGET:
        raise PatchVersionError(
            f"verl-quads patch {PATCH!r}: Hydra config {CONFIG_PATH!r} has _target_={target!r}, expected "
            f"{STOCK_ACTOR_TARGET!r} (verl {', '.join(SUPPORTED_VERL)}); verl's actor config changed, re-read it"
        )
    if "quant" in config or "quant_config" in config:
        raise PatchVersionError(
            f"verl-quads patch {PATCH!r}: verl's {CONFIG_PATH!r} now defines 'quant'/'quant_config' itself; "
            "re-read upstream before merging ours"
        )
    # Merging the structured schema keeps its typed nodes (Enum / float / int / list[str]), so
    # command-line overrides are validated by OmegaConf during composition.
    merged = OmegaConf.merge(config, hydra_schema())
    with open_dict(merged):
        merged._target_ = QUADS_ACTOR_TARGET
    return merged


def apply(*, hydra_version: str | None = None, verl_version: str | None = None) -> bool:
    """Install the wrapper (idempotent). Returns True if installed now."""
    require_version(PATCH, ("hydra-core",), SUPPORTED_HYDRA, found=hydra_version)
    require_version(PATCH, ("verl",), SUPPORTED_VERL, found=verl_version)
    return install_config_augmenter(PATCH, augment)


__all__ = ["PATCH", "SUPPORTED_HYDRA", "SUPPORTED_VERL", "augment", "apply"]
