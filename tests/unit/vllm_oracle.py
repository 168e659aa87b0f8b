"""An independent oracle: vLLM's NVFP4 test reference, re-expressed from its published algorithm.

vLLM checks its CUDA kernels against ``ref_nvfp4_quant`` + ``cast_to_fp4`` (tests/kernels/
quantization/nvfp4_utils.py). This file follows that algorithm step by step — Python-float
constants, masked assignment rounding, division-based reciprocal — and packs codes with
compressed-tensors' own ``pack_fp4_to_uint8``, so that it shares no code with
``verl_quads.nvfp4``. Only for tests.
"""

from __future__ import annotations

import torch

FLOAT4_E2M1_MAX = 6.0
FLOAT8_E4M3_MAX = 448.0


def get_reciprocal(x):
    if isinstance(x, torch.Tensor):
        return torch.where(x == 0, torch.tensor(0.0, dtype=x.dtype), 1.0 / x)
    return 1.0 / x


def cast_to_fp4(x: torch.Tensor) -> torch.Tensor:
    sign = torch.sign(x)
    x = torch.abs(x)
    x[(x >= 0.0) & (x <= 0.25)] = 0.0
    x[(x > 0.25) & (x < 0.75)] = 0.5
    x[(x >= 0.75) & (x <= 1.25)] = 1.0
    x[(x > 1.25) & (x < 1.75)] = 1.5
    x[(x >= 1.75) & (x <= 2.5)] = 2.0
    x[(x > 2.5) & (x < 3.5)] = 3.0
    x[(x >= 3.5) & (x <= 5.0)] = 4.0
    x[x > 5.0] = 6.0
    return x * sign


def ref_nvfp4_quant(x: torch.Tensor, global_scale: torch.Tensor, block_size: int = 16):
    """Returns (fp4 values as float32 [m, n] with sign of the scaled input, e4m3 scales [m, n/16],
    scaled pre-rounding values)."""
    assert global_scale.dtype == torch.float32
    m, n = x.shape
    if global_scale.dim() == 2:  # per row [m, 1] -> [m, 1, 1] against the [m, blocks, 16] view
        global_scale = global_scale.unsqueeze(-1)
    x = torch.reshape(x, (m, n // block_size, block_size))
    vec_max = torch.max(torch.abs(x), dim=-1, keepdim=True)[0].to(torch.float32)
    scale = global_scale * (vec_max * get_reciprocal(FLOAT4_E2M1_MAX))
    scale = torch.clamp(scale, max=FLOAT8_E4M3_MAX).to(torch.float8_e4m3fn)
    output_scale = get_reciprocal(scale.to(torch.float32) * get_reciprocal(global_scale))
    scaled_x = x.to(torch.float32) * output_scale
    clipped_x = torch.clamp(scaled_x, -6.0, 6.0).reshape(m, n)
    return cast_to_fp4(clipped_x.clone()), scale.squeeze(-1), clipped_x


def oracle_packed(x: torch.Tensor, global_scale: torch.Tensor):
    """Packed bytes and scales as vLLM's reference + compressed-tensors' packer give them.

    The sign of a value that rounds to zero is the sign of the scaled input (IEEE sign bit),
    as the hardware conversion and compressed-tensors' ``torch.signbit`` packing keep it.
    """
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    vals, scale, clipped = ref_nvfp4_quant(x, global_scale)
    # cast_to_fp4 loses the sign of zeros (sign(x) * 0 = +0 or -0 depending on sign(x)=0);
    # restore it from the scaled input so that packing sees the IEEE sign bit.
    vals = torch.where(vals == 0, torch.copysign(torch.zeros_like(vals), clipped), vals)
    return pack_fp4_to_uint8(vals), scale


def oracle_dequant(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, m: int, n: int, dtype):
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    vals = unpack_fp4_from_uint8(packed, m, n, dtype=torch.float32).reshape(m, n // 16, 16)
    sf = scale.to(torch.float32) / global_scale  # [m, n/16] / (0-d or [m, 1])
    return (vals * sf.unsqueeze(-1)).reshape(m, n).to(dtype)
