"""The vLLM quantization config ``quads_nvfp4``.

How to turn it on (vLLM alone; verl's glue will pass ``actor.quant`` the same way):

1. ``LLM(model, quantization="quads_nvfp4", hf_overrides={"quantization_config": {"quant_method":
   "quads_nvfp4", "quant": "quads", "residual_ratio": 0.5, ...}})``: vLLM 0.32 reads
   ``hf_config.quantization_config`` (which ``hf_overrides`` sets) and calls
   :meth:`QuadsNVFP4Config.from_config` with it. The keys besides ``quant_method`` are
   :class:`verl_quads.config.QuantConfig`'s fields (``quant``, ``residual_ratio``,
   ``residual_per_token``, ``guided_layers``, ``ignore``, ``backend``, ...). The dict travels
   with the model config to every worker process. ``quantization=`` may then be omitted.
2. ``LLM(model, quantization="quads_nvfp4")`` with no quantization config: vLLM builds the config
   with no arguments (``get_config_filenames() == []``); it then reads the JSON object in the
   environment variable ``VERL_QUADS_QUANT_CONFIG`` (same keys; the variable must be set before
   the engine starts so worker processes inherit it), and defaults to ``{"quant": "quads"}``.

Which layers: linear layers (``LinearBase``) and routed experts (``RoutedExperts``) are
quantized unless ``QuantConfig.is_ignored`` matches their name (the trainer's ignore list; a fused
vLLM layer is matched through its checkpoint shard names, e.g. ``qkv_proj`` -> ``q_proj``,
``k_proj``, ``v_proj``, and must be all-ignored or all-quantized). Ignored linear layers (MoE
router ``mlp.gate``) get vLLM's unquantized method; embeddings, lm_head and attention get none.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from verl_quads.config import QuantConfig
from verl_quads.rollout.backend import resolve_backend
from verl_quads.rollout.emulation import ActQuant

logger = logging.getLogger("verl_quads")

NAME = "quads_nvfp4"
ENV_VAR = "VERL_QUADS_QUANT_CONFIG"
DEFAULT_ARGS = {"quant": "quads"}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


def quant_config_from_args(args: dict[str, Any]) -> QuantConfig:
    """Validate ``args`` (QuantConfig fields, plus an optional ``quant_method``) into a QuantConfig."""
    args = dict(args)
    method = args.pop("quant_method", NAME)
    if method != NAME:
        raise ValueError(f"quads_nvfp4: quantization_config has quant_method={method!r}, expected {NAME!r}")
    quant = args.pop("quant", DEFAULT_ARGS["quant"])
    cfg = QuantConfig.from_mapping(quant, args)
    if cfg.rollout_mode == "none":
        raise ValueError(
            "quads_nvfp4: quant='none' means a stock BF16 rollout; do not pass quantization='quads_nvfp4'"
        )
    return cfg


def _num_hidden_layers() -> int | None:
    try:
        from vllm.config import get_current_vllm_config

        hf = get_current_vllm_config().model_config.hf_text_config
        return int(hf.num_hidden_layers)
    except Exception:
        return None


def _prefix_caching_enabled() -> bool:
    try:
        from vllm.config import get_current_vllm_config

        return bool(get_current_vllm_config().cache_config.enable_prefix_caching)
    except Exception:
        return False


class QuadsNVFP4Config(QuantizationConfig):
    """vLLM side of a :class:`~verl_quads.config.QuantConfig` (see module docstring)."""

    def __init__(self, quant_config: QuantConfig | None = None):
        super().__init__()
        if quant_config is None:
            raw = os.environ.get(ENV_VAR)
            try:
                args = json.loads(raw) if raw else dict(DEFAULT_ARGS)
            except json.JSONDecodeError as e:
                raise ValueError(f"quads_nvfp4: {ENV_VAR} is not valid JSON: {e}") from e
            if not isinstance(args, dict):
                raise ValueError(f"quads_nvfp4: {ENV_VAR} must hold a JSON object, got {raw!r}")
            quant_config = quant_config_from_args(args)
        self.quant_config = quant_config
        self.mode = quant_config.rollout_mode
        self.backend = resolve_backend(quant_config.backend)
        self._guided_from: int | None = None
        logger.info("verl-quads: quads_nvfp4 mode=%s backend=%s config=%s", self.mode, self.backend, quant_config)

    # --- QuantizationConfig interface ---
    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # the torch backend runs anywhere; the device-specific backends check for themselves

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "QuadsNVFP4Config":
        return cls(quant_config_from_args(config))

    # --- layer dispatch ---
    def _is_ignored(self, prefix: str) -> bool:
        """Trainer-side ignore decision for a vLLM module name (fused layers via their shard names)."""
        parent, _, last = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(last)
        if not shards:
            return self.quant_config.is_ignored(prefix)
        flags = [self.quant_config.is_ignored(f"{parent}.{s}" if parent else s) for s in shards]
        if all(flags) != any(flags):
            raise ValueError(
                f"quads_nvfp4: {prefix} fuses {shards} into one GEMM; the ignore list must match all or none of them"
            )
        return flags[0]

    def _guided_layer_start(self) -> int:
        if self._guided_from is None:
            n = _num_hidden_layers()
            if n is None:
                raise RuntimeError("quads_nvfp4 trace: cannot read num_hidden_layers from the vLLM config")
            self._guided_from = max(0, n - self.quant_config.guided_layers)
        return self._guided_from

    def activation_quant(self, prefix: str) -> tuple[ActQuant, int | None, str | None]:
        """(activation quantization, decoder layer index, gemm name) for the layer named ``prefix``."""
        m = _LAYER_RE.search(prefix)
        layer_idx, gemm = (int(m.group(1)), m.group(2)) if m else (None, None)
        cfg = self.quant_config
        capture = self.mode == "trace" and layer_idx is not None and layer_idx >= self._guided_layer_start()
        if capture:
            self._enable_capture()
        act = ActQuant(self.mode, cfg.residual_ratio, cfg.residual_per_token, capture)
        return act, layer_idx, gemm

    def _enable_capture(self) -> None:
        """Trace mode: hook the model runner and enable this process's store.

        Done here, in the process that builds the model, not in ``__init__``: vLLM builds the config
        in the front-end process and pickles it into the engine-core/worker processes.
        """
        from verl_quads.rollout.capture import get_store, install_runner_hook

        if _prefix_caching_enabled():
            raise ValueError(
                "quads_nvfp4 trace mode needs prefix caching off: cached prompt positions are never "
                "computed, so their guidance would be missing. Pass enable_prefix_caching=False "
                "(verl: actor_rollout_ref.rollout.enable_prefix_caching=False)."
            )
        install_runner_hook()
        get_store().enabled = True

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

        from verl_quads.rollout.vllm_plugin import require_packed_sync

        require_packed_sync()  # a verl rollout on a vLLM without our packed-sync patch: refuse loudly

        if isinstance(layer, LinearBase):
            if self._is_ignored(prefix):
                return UnquantizedLinearMethod()
            from verl_quads.rollout.linear import QuadsNVFP4LinearMethod

            act, idx, gemm = self.activation_quant(prefix)
            key = (idx, gemm) if act.capture else None
            return QuadsNVFP4LinearMethod(act, self.backend, capture_key=key)
        if isinstance(layer, RoutedExperts):
            if self._is_ignored(prefix):
                from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
                    UnquantizedFusedMoEMethod,
                )

                return UnquantizedFusedMoEMethod(layer.moe_config)
            from verl_quads.rollout.moe import QuadsNVFP4MoEMethod

            act, idx, _ = self.activation_quant(prefix)
            return QuadsNVFP4MoEMethod(layer.moe_config, act, self.backend, capture_layer=idx if act.capture else None)
        return None


def register_quant_config() -> None:
    """Register :class:`QuadsNVFP4Config` under ``quads_nvfp4`` with vLLM (idempotent)."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    register_quantization_config(NAME)(QuadsNVFP4Config)


__all__ = ["NAME", "ENV_VAR", "QuadsNVFP4Config", "quant_config_from_args", "register_quant_config"]
