"""verl config schema for ``actor_rollout_ref.actor.quant`` / ``actor_rollout_ref.actor.quant_config.*``.

Two pieces, both built from :class:`verl_quads.config.QuantConfig` (the one vocabulary):

- :func:`hydra_schema`: a structured-config node merged into verl's ``actor/dp_actor.yaml`` when
  Hydra loads it (see ``verl_quads/patches/hydra_actor_quant_key.py``). ``quant`` is an Enum node,
  so a value outside :data:`~verl_quads.config.QUANT_MODES` fails at config composition, before
  Ray or any worker starts, with OmegaConf's ``Invalid value 'x', expected one of [...]``.
  ``quant_config`` has one typed key per ``QuantConfig`` option, so ``quant_config.residual_ratio=0.25``
  works without ``+`` and an unknown option fails at composition.
- :class:`QuadsFSDPActorConfig`: ``FSDPActorConfig`` plus the two fields; the loaded node's
  ``_target_`` points to it. Its ``__post_init__`` validates through ``QuantConfig.from_mapping``
  (verl instantiates the actor config in the driver's ``validate_config`` and in each worker),
  refuses verl's own QAT at the same time, and hands the validated ``QuantConfig`` to the FSDP
  engine by attaching it to the engine config (``engine_config._verl_quads_quant``).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from verl_quads.config import QUANT_MODES, QuantConfig

#: The Enum Hydra validates ``quant`` against (a ``str`` Enum: members compare equal to their names).
QuantMode = enum.Enum("QuantMode", {m: m for m in QUANT_MODES}, type=str)

STOCK_ACTOR_TARGET = "verl.workers.config.FSDPActorConfig"
QUADS_ACTOR_TARGET = "verl_quads.integration.verl_config.QuadsFSDPActorConfig"


def _options_schema() -> type:
    """A dataclass with one typed field per ``QuantConfig`` option (tuples become lists)."""
    specs = []
    for f in dataclasses.fields(QuantConfig):
        if f.name == "quant":
            continue
        default = f.default
        if isinstance(default, tuple):
            specs.append((f.name, list[str], field(default_factory=lambda d=default: list(d))))
        else:
            specs.append((f.name, type(default), field(default=default)))
    return dataclasses.make_dataclass("QuadsQuantOptions", specs)


QuadsQuantOptions = _options_schema()


@dataclass
class QuadsActorSchema:
    """The keys verl-quads adds to ``actor_rollout_ref.actor``."""

    quant: QuantMode = QuantMode.none  # type: ignore[attr-defined]
    quant_config: QuadsQuantOptions = field(default_factory=QuadsQuantOptions)  # type: ignore[valid-type]


def hydra_schema():
    """The OmegaConf node to merge into the actor config (struct-safe typed keys)."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(QuadsActorSchema)


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True, enum_to_str=True)
    except ImportError:  # pragma: no cover
        pass
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def quant_config_from(quant: Any, options: Any) -> QuantConfig:
    """Validated :class:`QuantConfig` from the raw actor-config values (Enum / DictConfig / dict)."""
    opts = _plain(options) or {}
    if not isinstance(opts, dict):
        raise ValueError(f"actor_rollout_ref.actor.quant_config must be a mapping, got {type(opts).__name__}")
    return QuantConfig.from_mapping(str(_plain(quant)), opts)


def check_no_verl_qat(quant: QuantConfig, verl_qat_enabled: bool) -> None:
    """verl's own QAT (``fsdp_config.qat``) and verl-quads cannot both fake-quantize the model."""
    if quant.quant != "none" and verl_qat_enabled:
        raise ValueError(
            f"actor_rollout_ref.actor.quant={quant.quant} and actor_rollout_ref.actor.fsdp_config.qat.enable=true "
            "are both set: verl's QAT and verl-quads would both fake-quantize the model. verl-quads replaces "
            "verl's QAT (it also covers fused MoE experts); set actor_rollout_ref.actor.fsdp_config.qat.enable=false."
        )


def _make_actor_class():
    from verl.workers.config import FSDPActorConfig

    @dataclass
    class QuadsFSDPActorConfig(FSDPActorConfig):
        """``FSDPActorConfig`` + ``quant`` (a :data:`~verl_quads.config.QUANT_MODES` name) + ``quant_config``."""

        quant: Any = "none"
        quant_config: Any = field(default_factory=dict)

        def __post_init__(self):
            super().__post_init__()
            qc = quant_config_from(self.quant, self.quant_config)
            qat = getattr(self.fsdp_config, "qat", None)
            check_no_verl_qat(qc, bool(getattr(qat, "enable", False)))
            if qc.trainer_mode != "none" and self.strategy != "fsdp2":
                raise ValueError(
                    f"actor_rollout_ref.actor.quant={qc.quant} needs actor_rollout_ref.actor.strategy=fsdp2 "
                    f"(got {self.strategy!r}); verl-quads QAT is tested under FSDP2 only"
                )
            object.__setattr__(self, "quant", qc.quant)
            object.__setattr__(self, "quant_config", {k: v for k, v in qc.to_dict().items() if k != "quant"})
            object.__setattr__(self, "quant_settings", qc)
            # The engine is built from actor_config.engine (this fsdp_config), not from the actor config.
            object.__setattr__(self.engine, "_verl_quads_quant", qc)

    QuadsFSDPActorConfig.__module__ = __name__
    QuadsFSDPActorConfig.__qualname__ = "QuadsFSDPActorConfig"
    return QuadsFSDPActorConfig


def __getattr__(name: str):
    # Built lazily: importing verl.workers.config is heavy and this module is imported on every
    # ``import verl`` (plugin load), while Hydra's instantiate resolves the class only when needed.
    if name == "QuadsFSDPActorConfig":
        cls = _make_actor_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


__all__ = [
    "QuantMode",
    "QuadsActorSchema",
    "QuadsQuantOptions",
    "STOCK_ACTOR_TARGET",
    "QUADS_ACTOR_TARGET",
    "hydra_schema",
    "quant_config_from",
    "check_no_verl_qat",
]
