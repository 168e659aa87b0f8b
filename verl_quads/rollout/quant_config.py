"""The vLLM quantization config ``quads_nvfp4``.

How to turn it on (vLLM alone; verl's glue will pass ``actor.quant`` the same way):

1. ``LLM(model, quantization="quads_nvfp4", hf_overrides={"quantization_config": {"quant_method":
   "quads_nvfp4", "quant": "quads", "residual_ratio": 0.5, ...}})``: vLLM (0.24 and 0.32) reads
   ``hf_config.quantization_config`` (which ``hf_overrides`` sets) and calls
   :meth:`QuadsNVFP4Config.from_config` with it. The keys besides ``quant_method`` are
   :class:`verl_quads.config.QuantConfig`'s fields (``quant``, ``residual_ratio``,
   ``residual_per_token``, ``residual_combine``, ``residual_granularity``, ``guided_layers``, ``ignore``, ``backend``, ...), with its
   defaults (QUADS: k = 0.5, the per-token channel rule over a sampled threshold, ``channel_sampled``;
   ``residual_granularity="channel"`` for the exact top-k channels, ``"block"`` for 16-channel blocks;
   ``residual_combine="auto"``, resolved once in :class:`QuadsNVFP4Config` on the concrete backend:
   ``bf16`` on torch/triton, ``fp4x2`` on native, logged at INFO). The dict travels with the model config to
   every worker process. ``quantization=`` may then be omitted. Modes that need an eager engine
   (:meth:`verl_quads.config.QuantConfig.eager_reasons`: ``backend="torch"``, per-call selection) also need
   ``enforce_eager=True``; ``trace`` needs ``enable_prefix_caching=False`` (and runs with CUDA graphs on the GPU
   backends: its records are copied into persistent buffers inside them, :mod:`verl_quads.rollout.capture`).
2. ``LLM(model, quantization="quads_nvfp4")`` with no quantization config: vLLM builds the config
   with no arguments (``get_config_filenames() == []``); it then reads the JSON object in the
   environment variable ``VERL_QUADS_QUANT_CONFIG`` (same keys; the variable must be set before
   the engine starts so worker processes inherit it), and defaults to ``{"quant": "quads"}``.

3. Serving an NVFP4 checkpoint in the compressed-tensors format (``verl-quads export``'s output, or
   any ``NVFP4A16`` checkpoint: ``format: nvfp4-pack-quantized``, weight-only, group size 16):
   ``LLM(export_dir, quantization="quads_nvfp4")``. Opt-in only: without ``quantization=``, vLLM
   keeps serving such a directory with its own ``compressed-tensors`` method (Blackwell / Hopper
   kernels); :meth:`QuadsNVFP4Config.override_quantization_method` claims the checkpoint only when
   the user asked for ``quads_nvfp4``. The packed tensors (``weight_packed`` / ``weight_scale`` /
   ``weight_global_scale``) are loaded as they are (no BF16 detour, no re-quantization); the layers
   that are NVFP4 are the ones the checkpoint's ``quantization_config.ignore`` does not list (exact
   names or ``re:`` patterns, compressed-tensors' rule). The mode defaults to ``w4a16`` (the export is
   weight-only); ``naive`` / ``quads`` / ``trace`` activations (and ``residual_ratio``, ``backend``,
   ...) come from a ``"verl_quads"`` object inside the checkpoint's quantization config, else from
   ``VERL_QUADS_QUANT_CONFIG``, with the same keys as above except ``ignore`` (refused: the
   checkpoint decides). A W4A4 checkpoint (``input_activations`` with a static calibrated
   ``input_global_scale``) is refused: our rollout's per-token dynamic activation scales would not
   be the ones it was calibrated with, and ``verl-quads export`` does not write one.

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

from verl_quads.config import QuantConfig, resolve_residual_combine
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


#: compressed-tensors ``NVFP4A16`` weight arguments a packed checkpoint must have (key -> allowed values)
_CT_NVFP4_WEIGHTS = {
    "num_bits": (4,),
    "type": ("float",),
    "strategy": ("tensor_group",),
    "group_size": (16,),
    "symmetric": (True, None),
    "dynamic": (False, None),
}
_CT_FORMAT = "nvfp4-pack-quantized"
#: key inside a compressed-tensors quantization config that carries our mode arguments
CT_ARGS_KEY = "verl_quads"


def _ct_error(msg: str) -> ValueError:
    return ValueError(
        f"quads_nvfp4: cannot serve this compressed-tensors checkpoint: {msg}. quads_nvfp4 serves "
        f"compressed-tensors NVFP4A16 checkpoints only (format {_CT_FORMAT!r}, weights 4-bit float, strategy "
        "tensor_group, group size 16, input_activations null; e.g. `verl-quads export` output)"
    )


def check_ct_nvfp4a16(cfg: dict[str, Any]) -> list[str]:
    """Validate a compressed-tensors ``quantization_config`` as a packed NVFP4A16 checkpoint; return its
    ``ignore`` list. Raises ValueError naming the offending key and what is allowed."""
    if cfg.get("quant_method") != "compressed-tensors":
        raise _ct_error(f"quant_method={cfg.get('quant_method')!r}")
    status = cfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise _ct_error(f"quantization_status={status!r} (the weights are not packed; expected 'compressed')")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if cfg.get(key):
            raise _ct_error(f"{key} is set ({cfg[key]!r}); not supported")
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise _ct_error("config_groups is empty")
    for gname, g in groups.items():
        fmt = g.get("format") or cfg.get("format")
        if fmt != _CT_FORMAT:
            raise _ct_error(f"config_groups.{gname}.format={fmt!r}")
        if list(g.get("targets") or []) != ["Linear"]:
            raise _ct_error(f"config_groups.{gname}.targets={g.get('targets')!r} (allowed: ['Linear'])")
        if g.get("input_activations") is not None:
            raise _ct_error(
                f"config_groups.{gname}.input_activations is set (a W4A4 checkpoint with static calibrated "
                "activation scales); pick the activation mode with the 'verl_quads' arguments instead"
            )
        if g.get("output_activations") is not None:
            raise _ct_error(f"config_groups.{gname}.output_activations is set")
        w = g.get("weights") or {}
        for key, allowed in _CT_NVFP4_WEIGHTS.items():
            if w.get(key) not in allowed:
                raise _ct_error(f"config_groups.{gname}.weights.{key}={w.get(key)!r} (allowed: {list(allowed)})")
    ignore = cfg.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise _ct_error(f"ignore={ignore!r} (expected a list of module names / 're:' patterns)")
    return list(ignore)


def ct_ignored(ignore: list[str], name: str) -> bool:
    """compressed-tensors' ignore rule: ``name`` equals an entry, or ``re.match``es a ``re:`` entry."""
    return any(re.match(p[3:], name) if p.startswith("re:") else p == name for p in ignore)


def served_checkpoint_config(cfg: dict[str, Any]) -> tuple[QuantConfig, list[str]]:
    """(QuantConfig, checkpoint ignore list) for serving a compressed-tensors NVFP4A16 checkpoint.

    Mode arguments: ``cfg["verl_quads"]`` if present, else the JSON in ``VERL_QUADS_QUANT_CONFIG``,
    else ``{"quant": "w4a16"}`` (the checkpoint is weight-only NVFP4). ``ignore`` is refused there:
    which layers are NVFP4 is the checkpoint's ``ignore`` list.
    """
    ignore = check_ct_nvfp4a16(cfg)
    if CT_ARGS_KEY in cfg:
        args, where = cfg[CT_ARGS_KEY], f"quantization_config.{CT_ARGS_KEY}"
    elif os.environ.get(ENV_VAR):
        args, where = _env_args(), ENV_VAR
    else:
        args, where = {"quant": "w4a16"}, "default"
    if not isinstance(args, dict):
        raise ValueError(f"quads_nvfp4: {where} must be a JSON object of QuantConfig keys, got {args!r}")
    if "ignore" in args:
        raise ValueError(
            f"quads_nvfp4: {where} sets 'ignore', but a packed checkpoint's NVFP4 layers are fixed by its "
            "quantization_config.ignore; remove the key"
        )
    return quant_config_from_args(args), ignore


def _env_args() -> dict[str, Any]:
    raw = os.environ.get(ENV_VAR)
    try:
        args = json.loads(raw) if raw else dict(DEFAULT_ARGS)
    except json.JSONDecodeError as e:
        raise ValueError(f"quads_nvfp4: {ENV_VAR} is not valid JSON: {e}") from e
    if not isinstance(args, dict):
        raise ValueError(f"quads_nvfp4: {ENV_VAR} must hold a JSON object, got {raw!r}")
    return args


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


def _not_eager() -> str | None:
    """What makes this engine run the model other than eagerly (torch.compile, CUDA graphs), or None.

    Read from the engine's resolved ``compilation_config`` (``mode`` / ``cudagraph_mode``; vLLM 0.24 and
    0.32 set both to NONE for ``enforce_eager=True``). None also when no engine config is current (methods
    built outside an engine, e.g. in unit tests): nothing to check there."""
    try:
        from vllm.config import get_current_vllm_config

        cc = get_current_vllm_config().compilation_config
    except Exception:
        return None
    out = []
    mode, graphs = getattr(cc, "mode", None), getattr(cc, "cudagraph_mode", None)
    if mode is not None and int(mode) != 0:
        out.append(f"compilation_config.mode={mode.name}")
    if graphs is not None and graphs.name != "NONE":
        out.append(f"compilation_config.cudagraph_mode={graphs.name}")
    return ", ".join(out) or None


class QuadsNVFP4Config(QuantizationConfig):
    """vLLM side of a :class:`~verl_quads.config.QuantConfig` (see module docstring)."""

    def __init__(self, quant_config: QuantConfig | None = None, checkpoint_ignore: list[str] | None = None):
        """``checkpoint_ignore``: None for a BF16 checkpoint (quantized at load, layers chosen by
        ``quant_config.ignore``); the compressed-tensors ``ignore`` list when the checkpoint holds packed
        NVFP4 tensors (see :func:`served_checkpoint_config`)."""
        super().__init__()
        if quant_config is None:
            quant_config = quant_config_from_args(_env_args())
        self.quant_config = quant_config
        self.mode = quant_config.rollout_mode
        self.backend = resolve_backend(quant_config.backend)
        if self.backend == "native" and self.mode == "quads" and quant_config.residual_combine == "bf16":
            raise ValueError(
                f"quads_nvfp4: actor_rollout_ref.actor.quant_config.residual_combine="
                f"{quant_config.residual_combine!r} is for the emulated backends (torch, triton); the 'native' "
                "backend (Blackwell FP4 GEMM) keeps the two FP4 operands: allowed there 'fp4x2' or 'auto' (or set "
                "quant_config.backend='triton')"
            )
        #: the QUADS operand form every layer of this engine runs (``auto`` resolved once, here, on the backend)
        self.residual_combine = resolve_residual_combine(quant_config.residual_combine, self.backend)
        if self.mode == "quads":
            logger.info("verl-quads: quads_nvfp4 QUADS operand form residual_combine=%s "
                        "(quant_config.residual_combine=%r on backend %s)",
                        self.residual_combine, quant_config.residual_combine, self.backend)
        self.checkpoint_ignore = None if checkpoint_ignore is None else list(checkpoint_ignore)
        self._guided_from: int | None = None
        logger.info("verl-quads: quads_nvfp4 mode=%s backend=%s config=%s checkpoint=%s", self.mode, self.backend,
                    quant_config, "BF16" if checkpoint_ignore is None else "packed NVFP4 (compressed-tensors)")

    @property
    def packed_checkpoint(self) -> bool:
        """True when the checkpoint holds packed NVFP4 tensors (loaded as they are)."""
        return self.checkpoint_ignore is not None

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
        if config.get("quant_method") == "compressed-tensors":  # a packed checkpoint (see module docstring, 3.)
            qc, ignore = served_checkpoint_config(config)
            return cls(qc, checkpoint_ignore=ignore)
        return cls(quant_config_from_args(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None):
        """Claim a compressed-tensors checkpoint only when the user asked for ``quads_nvfp4`` (opt-in).

        Without ``quantization="quads_nvfp4"`` this returns None: vLLM keeps its own compressed-tensors
        method (what a Blackwell / Hopper GPU should run). With it, a compressed-tensors config that is
        not NVFP4A16 raises here naming the key (instead of vLLM's generic method mismatch).
        """
        if user_quant != NAME or not isinstance(hf_quant_cfg, dict):
            return None
        if hf_quant_cfg.get("quant_method") != "compressed-tensors":
            return None
        check_ct_nvfp4a16(hf_quant_cfg)
        return NAME

    # --- layer dispatch ---
    def _ignored_by(self, name: str) -> bool:
        if self.checkpoint_ignore is not None:
            return ct_ignored(self.checkpoint_ignore, name)
        return self.quant_config.is_ignored(name)

    def _is_ignored(self, prefix: str) -> bool:
        """Ignore decision for a vLLM module name (fused layers via their shard names): the trainer's
        ignore list, or for a packed checkpoint the checkpoint's."""
        prefix = prefix.removesuffix(".routed_experts")  # vLLM 0.32 names routed experts below mlp.experts
        parent, _, last = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(last)
        if not shards:
            return self._ignored_by(prefix)
        flags = [self._ignored_by(f"{parent}.{s}" if parent else s) for s in shards]
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
        act = ActQuant(self.mode, cfg.residual_ratio, cfg.residual_per_token, capture,
                       residual_combine=self.residual_combine, residual_granularity=cfg.residual_granularity)
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

    def _check_execution(self) -> None:
        """Refuse, when the engine builds its first layer, an engine that compiles the model or replays CUDA
        graphs (vLLM's default without ``enforce_eager``) for a configuration that needs eager execution."""
        if getattr(self, "_execution_checked", False):
            return
        reasons, not_eager = self.quant_config.eager_reasons(self.backend), _not_eager()
        if reasons and not_eager:
            raise ValueError(
                f"quads_nvfp4 mode {self.mode!r} backend {self.backend!r} needs an eager engine, but this one runs with "
                f"{not_eager}: " + "; ".join(reasons) + ". Pass enforce_eager=True "
                "(verl: actor_rollout_ref.rollout.enforce_eager=True)."
            )
        self._execution_checked = True

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

        from verl_quads.rollout.vllm_plugin import require_packed_sync

        require_packed_sync()  # a verl rollout on a vLLM without our packed-sync patch: refuse loudly
        self._check_execution()

        if isinstance(layer, LinearBase):
            if self._is_ignored(prefix):
                return UnquantizedLinearMethod()
            from verl_quads.rollout.linear import QuadsNVFP4LinearMethod

            act, idx, gemm = self.activation_quant(prefix)
            key = (idx, gemm) if act.capture else None
            return QuadsNVFP4LinearMethod(act, self.backend, capture_key=key, packed=self.packed_checkpoint)
        if isinstance(layer, RoutedExperts):
            if self._is_ignored(prefix):
                from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
                    UnquantizedFusedMoEMethod,
                )

                return UnquantizedFusedMoEMethod(layer.moe_config)
            from verl_quads.rollout.moe import QuadsNVFP4MoEMethod

            act, idx, _ = self.activation_quant(prefix)
            return QuadsNVFP4MoEMethod(layer.moe_config, act, self.backend, capture_layer=idx if act.capture else None,
                                       packed=self.packed_checkpoint)
        return None


def register_quant_config() -> None:
    """Register :class:`QuadsNVFP4Config` under ``quads_nvfp4`` with vLLM (idempotent)."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    register_quantization_config(NAME)(QuadsNVFP4Config)


__all__ = [
    "NAME",
    "ENV_VAR",
    "CT_ARGS_KEY",
    "QuadsNVFP4Config",
    "check_ct_nvfp4a16",
    "ct_ignored",
    "quant_config_from_args",
    "register_quant_config",
    "served_checkpoint_config",
]
