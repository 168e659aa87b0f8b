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
- :class:`QuadsRolloutConfig`: ``RolloutConfig`` whose ``quant`` / ``quant_config`` mirror the actor's
  (Hydra interpolations added by ``verl_quads/patches/hydra_rollout_quant_mirror.py``, the way verl's
  own ``rollout.qat`` mirrors ``actor.fsdp_config.qat``). Its ``__post_init__`` derives the vLLM
  engine arguments from them (:func:`rollout_engine_kwargs`): ``quantization="quads_nvfp4"`` and
  ``hf_overrides.quantization_config`` = the rollout mode + options, for every ``quant`` whose
  rollout mode is not ``none``. verl spreads ``engine_kwargs.vllm`` into vLLM's engine arguments, so
  ``actor.quant`` is the only switch; a conflicting hand-set rollout quantization fails, naming both keys.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from verl_quads.config import QUANT_MODES, QuantConfig

#: The Enum Hydra validates ``quant`` against (a ``str`` Enum: members compare equal to their names).
QuantMode = enum.Enum("QuantMode", {m: m for m in QUANT_MODES}, type=str)

STOCK_ACTOR_TARGET = "verl.workers.config.FSDPActorConfig"
QUADS_ACTOR_TARGET = "verl_quads.integration.verl_config.QuadsFSDPActorConfig"
STOCK_ROLLOUT_TARGET = "verl.workers.config.RolloutConfig"
QUADS_ROLLOUT_TARGET = "verl_quads.integration.verl_config.QuadsRolloutConfig"
#: vLLM quantization name of :mod:`verl_quads.rollout.quant_config` (not imported: it needs vLLM).
VLLM_QUANT_NAME = "quads_nvfp4"
#: Test only: run the rollout engine in this ``quant``'s mode instead of the actor's, to exercise the
#: trainer/engine mode-mismatch failure of a real weight sync. Never set it in a recipe.
TEST_FORCE_ROLLOUT_QUANT_ENV = "VERL_QUADS_TEST_FORCE_ROLLOUT_QUANT"

logger = logging.getLogger("verl_quads")


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


def _conflict(key: str, value: Any, qc: QuantConfig, wanted: Any) -> ValueError:
    return ValueError(
        f"actor_rollout_ref.{key}={value!r} conflicts with actor_rollout_ref.actor.quant={qc.quant}, which "
        f"configures the vLLM rollout itself ({wanted}). verl-quads has one switch: remove "
        f"actor_rollout_ref.{key} and set actor_rollout_ref.actor.quant (+ actor_rollout_ref.actor.quant_config.*)."
    )


def _same_quads_config(user: Any, qc: QuantConfig) -> bool:
    """Whether a hand-written ``hf_overrides.quantization_config`` says exactly what ``qc`` says."""
    if not isinstance(user, dict) or user.get("quant_method") != VLLM_QUANT_NAME:
        return False
    opts = {k: v for k, v in user.items() if k not in ("quant_method", "quant")}
    try:
        return QuantConfig.from_mapping(user.get("quant", "quads"), opts) == qc
    except ValueError:
        return False


def rollout_engine_kwargs(qc: QuantConfig, *, name: Any, quantization: Any, engine_kwargs: Any) -> dict:
    """verl's ``rollout.engine_kwargs`` with the vLLM ``quads_nvfp4`` settings for ``qc`` added.

    ``name`` / ``quantization`` / ``engine_kwargs``: the rollout config's ``name``, ``quantization``
    (verl's fp8/torchao switch) and ``engine_kwargs``. ``qc.rollout_mode == "none"``: returned unchanged,
    but a hand-set ``engine_kwargs.vllm.quantization=quads_nvfp4`` is refused (the trainer would send
    BF16). Otherwise: ``engine_kwargs.vllm.quantization = "quads_nvfp4"`` and
    ``engine_kwargs.vllm.hf_overrides.quantization_config = {"quant_method": "quads_nvfp4", **qc.to_dict()}``
    (other ``hf_overrides`` keys are kept). Any hand-set value that says something else is an error
    naming both keys; one that says the same is accepted.
    """
    ek = _plain(engine_kwargs) or {}
    if not isinstance(ek, dict):
        raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs must be a mapping, got {type(ek).__name__}")
    ek = dict(ek)
    vk = dict(_plain(ek.get("vllm")) or {})
    user_q = vk.get("quantization")
    if qc.rollout_mode == "none":
        if user_q == VLLM_QUANT_NAME:
            raise ValueError(
                f"actor_rollout_ref.rollout.engine_kwargs.vllm.quantization={VLLM_QUANT_NAME} with "
                "actor_rollout_ref.actor.quant=none: the trainer would sync BF16 weights into an NVFP4 engine. "
                "Remove the engine_kwargs key and set actor_rollout_ref.actor.quant (one of "
                "naive, w4a16, quads, trace, w4a4_qat) instead."
            )
        return ek
    if name != "vllm":
        raise ValueError(
            f"actor_rollout_ref.actor.quant={qc.quant} needs actor_rollout_ref.rollout.name=vllm "
            f"(got {name!r}): the NVFP4 rollout is a vLLM quantization plugin"
        )
    if quantization is not None:
        raise _conflict("rollout.quantization", quantization, qc, f"vLLM quantization={VLLM_QUANT_NAME}")
    if user_q is not None and user_q != VLLM_QUANT_NAME:
        raise _conflict("rollout.engine_kwargs.vllm.quantization", user_q, qc, f"{VLLM_QUANT_NAME}")
    wanted = {"quant_method": VLLM_QUANT_NAME, **qc.to_dict()}
    hf = _plain(vk.get("hf_overrides")) or {}
    if isinstance(hf, str):
        hf = json.loads(hf)
    hf = dict(hf)
    if "quantization_config" in hf and not _same_quads_config(_plain(hf["quantization_config"]), qc):
        raise _conflict(
            "rollout.engine_kwargs.vllm.hf_overrides.quantization_config", hf["quantization_config"], qc,
            f"quantization_config={wanted}",
        )
    hf["quantization_config"] = wanted
    vk["quantization"] = VLLM_QUANT_NAME
    vk["hf_overrides"] = hf
    ek["vllm"] = vk
    return ek


def check_rollout_execution(qc: QuantConfig, *, enable_prefix_caching: Any, enforce_eager: Any) -> None:
    """Refuse, at config time (in verl's driver, before Ray starts), rollout settings the ``quads_nvfp4``
    engine would refuse at start inside a worker: ``trace`` with prefix caching (cached prompt positions are
    never computed, so they carry no guidance), and a compiled / CUDA-graph engine (verl's default
    ``enforce_eager=False``) for a configuration that needs an eager one (:meth:`QuantConfig.eager_reasons`,
    here with the unresolved backend: the worker's device is not known)."""
    need = []
    if qc.rollout_mode == "trace" and enable_prefix_caching:
        need.append("actor_rollout_ref.rollout.enable_prefix_caching=False (cached prompt positions carry no guidance)")
    why = qc.eager_reasons()
    if why and not enforce_eager:
        need.append("actor_rollout_ref.rollout.enforce_eager=True (" + "; ".join(why) + ")")
    if need:
        raise ValueError(f"actor_rollout_ref.actor.quant={qc.quant} needs " + "; ".join(need) +
                         (" (recipes/modes/trace.args sets the first)" if qc.rollout_mode == "trace" else ""))


def _make_rollout_class():
    from verl.workers.config import RolloutConfig

    @dataclass
    class QuadsRolloutConfig(RolloutConfig):
        """``RolloutConfig`` + ``quant`` / ``quant_config`` mirrored from ``actor_rollout_ref.actor`` (not set by hand)."""

        quant: Any = "none"
        quant_config: Any = None

        def __post_init__(self):
            super().__post_init__()
            qc = quant_config_from(self.quant, self.quant_config)
            forced = os.environ.get(TEST_FORCE_ROLLOUT_QUANT_ENV)
            if forced:
                logger.error(
                    "verl-quads: %s=%s: the rollout engine runs quant=%s while the actor runs quant=%s "
                    "(test of the mode-mismatch failure; never set this in a recipe)",
                    TEST_FORCE_ROLLOUT_QUANT_ENV, forced, forced, qc.quant,
                )
                qc = dataclasses.replace(qc, quant=forced)
            object.__setattr__(self, "quant", qc.quant)
            object.__setattr__(self, "quant_config", {k: v for k, v in qc.to_dict().items() if k != "quant"})
            self.engine_kwargs = rollout_engine_kwargs(
                qc, name=self.name, quantization=self.quantization, engine_kwargs=self.engine_kwargs
            )
            check_rollout_execution(qc, enable_prefix_caching=self.enable_prefix_caching, enforce_eager=self.enforce_eager)
            if qc.rollout_mode != "none":
                logger.info(
                    "verl-quads: vLLM rollout quantization=%s mode=%s (from actor_rollout_ref.actor.quant=%s)",
                    VLLM_QUANT_NAME, qc.rollout_mode, qc.quant,
                )
                if not self.calculate_log_probs:
                    logger.warning(
                        "verl-quads: actor_rollout_ref.actor.quant=%s with actor_rollout_ref.rollout."
                        "calculate_log_probs=False: the rollout-vs-trainer gap metrics (quads/logp_gap_*, "
                        "quads/k3_kl, training/rollout_probs_diff_*) need the rollout's log-probs; set "
                        "actor_rollout_ref.rollout.calculate_log_probs=True to log them",
                        qc.quant,
                    )

    QuadsRolloutConfig.__module__ = __name__
    QuadsRolloutConfig.__qualname__ = "QuadsRolloutConfig"
    return QuadsRolloutConfig


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
            if qc.quant != "none" and self.strategy != "fsdp2":  # QAT and/or the packed sync (naive)
                raise ValueError(
                    f"actor_rollout_ref.actor.quant={qc.quant} needs actor_rollout_ref.actor.strategy=fsdp2 "
                    f"(got {self.strategy!r}); verl-quads QAT and the packed NVFP4 weight sync are tested under "
                    "FSDP2 only"
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
    makers = {"QuadsFSDPActorConfig": _make_actor_class, "QuadsRolloutConfig": _make_rollout_class}
    if name in makers:
        cls = makers[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


__all__ = [
    "QuantMode",
    "QuadsActorSchema",
    "QuadsQuantOptions",
    "STOCK_ACTOR_TARGET",
    "QUADS_ACTOR_TARGET",
    "STOCK_ROLLOUT_TARGET",
    "QUADS_ROLLOUT_TARGET",
    "VLLM_QUANT_NAME",
    "TEST_FORCE_ROLLOUT_QUANT_ENV",
    "rollout_engine_kwargs",
    "check_rollout_execution",
    "hydra_schema",
    "quant_config_from",
    "check_no_verl_qat",
]
