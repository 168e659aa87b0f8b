"""Helpers of the TRACE guidance-store tests (test_guidance_buffers.py, test_trace_rows.py, test_rollout_config.py):
the rollout's record of an activation and byte equality of two records."""

import torch

from verl_quads import nvfp4


def row_record(x: torch.Tensor) -> nvfp4.GuidanceRecord:
    """The guidance record of ``x`` ``[..., K]`` quantized as the rollout does: a global scale per row (the torch
    reference)."""
    gs = nvfp4.global_scale_from_amax(x.abs().amax(-1, keepdim=True).float())
    return nvfp4.extract_guidance(nvfp4.quantize(x, gs, backend="torch"))


def records_equal(a: nvfp4.GuidanceRecord, b: nvfp4.GuidanceRecord) -> bool:
    """Bits, block-scale bytes, global scales and logical shape all equal."""
    return (torch.equal(a.bits, b.bits)
            and torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
            and torch.equal(a.global_scale, b.global_scale) and tuple(a.shape) == tuple(b.shape))
