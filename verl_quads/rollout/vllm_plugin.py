"""``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every engine process."""

from __future__ import annotations

from verl_quads._plugin_errors import loud


@loud("vLLM plugin (vllm.general_plugins entry point)")
def register() -> None:
    """Register the ``quads_nvfp4`` quantization config with vLLM. Idempotent."""
    from verl_quads.patches import apply_vllm_cpu_patches
    from verl_quads.rollout.quant_config import register_quant_config

    apply_vllm_cpu_patches()  # verl's weight sync on vLLM CPU (issue 3); no-op elsewhere
    from verl_quads.patches import vllm_packed_weight_sync

    vllm_packed_weight_sync.apply_if_verl_installed()  # packed NVFP4 sync into quads_nvfp4 engines (issue 6)
    register_quant_config()
