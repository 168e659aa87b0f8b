"""vLLM side: the ``quads_nvfp4`` quantization config and its linear / fused-MoE methods."""
