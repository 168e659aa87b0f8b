"""The NVFP4 format: constants, the 4-bit code layout and :class:`NVFP4Tensor`.

An NVFP4 tensor of logical shape ``[..., K]`` (K divisible by 16) is stored as

- ``packed``: uint8 ``[..., K // 2]``. Each byte holds two 4-bit E2M1 codes: element ``2i`` in
  the LOW nibble, element ``2i + 1`` in the HIGH nibble (vLLM, compressed-tensors and ModelOpt
  all use this order). A code is ``sign << 3 | magnitude_index``; the magnitude index points
  into :data:`E2M1_VALUES` = (0, .5, 1, 1.5, 2, 3, 4, 6). The sign bit is the IEEE sign bit of
  the scaled value, so a small negative value that rounds to zero is stored as code 8 (-0),
  as the hardware conversion instruction and compressed-tensors' packer do.
- ``block_scale``: float8_e4m3fn ``[..., K // 16]``, one per 16 consecutive elements along
  the last dimension, row-major ("linear" layout; see :mod:`.layout` for the swizzled one).
- ``global_scale``: float32, the *encode* scale ``448 * 6 / amax`` (compressed-tensors'
  ``weight_global_scale``; ModelOpt's ``weight_scale_2`` is its inverse). A 0-d tensor for a
  per-tensor scale, or a tensor with the same number of dimensions as the data that broadcasts
  against it with a last dimension of 1: ``[E, 1, 1]`` per expert, ``[..., 1]`` per row.

Dequantized value of element j: ``E2M1_VALUES[code_j] * (float(block_scale[j // 16]) /
global_scale)`` computed in float32, then cast to the output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 16
FP4_MAX = 6.0
E4M3_MAX = 448.0
#: 448 * 6: the encode global scale is ``GLOBAL_SCALE_NUMERATOR / amax``.
GLOBAL_SCALE_NUMERATOR = E4M3_MAX * FP4_MAX

#: Magnitudes of the 8 E2M1 magnitude indices (index = low 3 bits of a code).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

SUPPORTED_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """All 16 code values as float32 ``[16]``: codes 0-7 positive, 8-15 their negatives."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes ``[..., K]`` (values 0..15) into uint8 ``[..., K // 2]``, even element low."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_codes: last dimension must be even, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 ``[..., K // 2]`` -> uint8 codes ``[..., K]``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_codes: packed must be uint8, got {packed.dtype}")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


@dataclass(frozen=True)
class NVFP4Tensor:
    """A tensor quantized to NVFP4 (layout in the module docstring).

    Attributes:
        packed: uint8 ``[..., K // 2]``.
        block_scale: float8_e4m3fn ``[..., K // 16]`` (linear layout).
        global_scale: float32 encode scale, 0-d or broadcastable with a trailing 1.
        shape: logical shape ``[..., K]`` of the original tensor.
        dtype: dtype of the original tensor (the default dequantization dtype).
    """

    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    def __post_init__(self) -> None:
        k = self.shape[-1]
        lead = tuple(self.shape[:-1])
        if self.packed.dtype != torch.uint8 or tuple(self.packed.shape) != lead + (k // 2,):
            raise ValueError(
                f"NVFP4Tensor.packed must be uint8 {lead + (k // 2,)}, got {self.packed.dtype} "
                f"{tuple(self.packed.shape)}"
            )
        if self.block_scale.dtype != torch.float8_e4m3fn or tuple(self.block_scale.shape) != lead + (
            k // BLOCK_SIZE,
        ):
            raise ValueError(
                f"NVFP4Tensor.block_scale must be float8_e4m3fn {lead + (k // BLOCK_SIZE,)}, got "
                f"{self.block_scale.dtype} {tuple(self.block_scale.shape)}"
            )
        if self.global_scale.dtype != torch.float32:
            raise ValueError(f"NVFP4Tensor.global_scale must be float32, got {self.global_scale.dtype}")

    @property
    def codes(self) -> torch.Tensor:
        """Unpacked 4-bit codes, uint8 ``[..., K]``."""
        return unpack_codes(self.packed)

    @property
    def nbytes(self) -> int:
        """Storage in bytes (packed codes + block scales + global scale)."""
        return (
            self.packed.numel()
            + self.block_scale.numel()
            + self.global_scale.numel() * self.global_scale.element_size()
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Shorthand for :func:`verl_quads.nvfp4.dequantize`."""
        from verl_quads.nvfp4 import dequantize

        return dequantize(self, dtype or self.dtype)
