"""Block-scale layouts and checkpoint conventions.

Swizzled layout (what Blackwell CUTLASS FP4 GEMMs read): the ``[M, K // 16]`` scale matrix is
zero-padded to ``[round_up(M, 128), round_up(K // 16, 4)]``, viewed as
``(M / 128, 4, 32, K / 64, 4)``, permuted ``(0, 3, 2, 1, 4)`` and flattened back to 2-D, so each
512-byte tile holds the scales of a 128-row x 64-column block. Leading batch dimensions (e.g.
experts) are kept.

Checkpoint conventions for a quantized weight named ``<p>.weight``:

- compressed-tensors: ``<p>.weight_packed`` (uint8), ``<p>.weight_scale`` (E4M3, linear),
  ``<p>.weight_global_scale`` (float32 ``[1]``, the encode scale, our ``global_scale``).
- ModelOpt: ``<p>.weight`` (uint8 packed), ``<p>.weight_scale`` (E4M3), ``<p>.weight_scale_2``
  (float32, the decode scale ``amax / 2688 = 1 / global_scale``). Going to ModelOpt and back
  computes ``1 / (1 / gs)`` in float32, which can differ from ``gs`` by one ulp; such a
  round-trip is exact only where that holds, which :func:`from_modelopt` does not promise.
"""

from __future__ import annotations

import torch

from verl_quads.nvfp4.format import BLOCK_SIZE, NVFP4Tensor


def _round_up(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def swizzle_block_scale(scale: torch.Tensor) -> torch.Tensor:
    """Linear ``[..., M, K // 16]`` E4M3 scales -> swizzled ``[..., round_up(M,128), round_up(K//16,4)]``."""
    *lead, m, kb = scale.shape
    mp, kp = _round_up(m, 128), _round_up(kb, 4)
    raw = scale.view(torch.uint8)
    padded = torch.zeros(*lead, mp, kp, dtype=torch.uint8, device=scale.device)
    padded[..., :m, :kb] = raw
    nl = len(lead)
    t = padded.reshape(*lead, mp // 128, 4, 32, kp // 4, 4)
    perm = list(range(nl)) + [nl + i for i in (0, 3, 2, 1, 4)]
    return t.permute(perm).reshape(*lead, mp, kp).contiguous().view(scale.dtype)


def unswizzle_block_scale(swizzled: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_block_scale` for a tensor of ``m`` rows and ``k`` elements per row."""
    *lead, mp, kp = swizzled.shape
    kb = k // BLOCK_SIZE
    if mp != _round_up(m, 128) or kp != _round_up(kb, 4):
        raise ValueError(f"unswizzle_block_scale: shape {tuple(swizzled.shape)} does not fit m={m}, k={k}")
    nl = len(lead)
    t = swizzled.view(torch.uint8).reshape(*lead, mp // 128, kp // 4, 32, 4, 4)
    perm = list(range(nl)) + [nl + i for i in (0, 3, 2, 1, 4)]
    lin = t.permute(perm).reshape(*lead, mp, kp)[..., :m, :kb]
    return lin.contiguous().view(swizzled.dtype)


def to_compressed_tensors(q: NVFP4Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """State-dict entries of a 2-D (or per-expert 3-D) weight in the compressed-tensors convention."""
    gs = q.global_scale.reshape(-1) if q.global_scale.dim() <= 1 else q.global_scale
    return {
        f"{prefix}.weight_packed": q.packed,
        f"{prefix}.weight_scale": q.block_scale,
        f"{prefix}.weight_global_scale": gs.reshape(1) if gs.numel() == 1 else gs,
    }


def from_compressed_tensors(
    sd: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype = torch.bfloat16
) -> NVFP4Tensor:
    """Inverse of :func:`to_compressed_tensors`. ``dtype`` is the logical (dequantization) dtype."""
    packed = sd[f"{prefix}.weight_packed"]
    scale = sd[f"{prefix}.weight_scale"]
    gs = sd[f"{prefix}.weight_global_scale"].to(torch.float32)
    shape = torch.Size(tuple(packed.shape[:-1]) + (packed.shape[-1] * 2,))
    gs = gs.reshape(()) if gs.numel() == 1 else gs.reshape(*gs.shape[:1], *([1] * (len(shape) - 1)))
    return NVFP4Tensor(packed, scale.view(torch.float8_e4m3fn), gs, shape, dtype)


def to_modelopt(q: NVFP4Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """State-dict entries in the ModelOpt convention (``weight_scale_2 = 1 / global_scale``)."""
    return {
        f"{prefix}.weight": q.packed,
        f"{prefix}.weight_scale": q.block_scale,
        f"{prefix}.weight_scale_2": (1.0 / q.global_scale).reshape(-1) if q.global_scale.dim() == 0 else 1.0 / q.global_scale,
    }


def from_modelopt(sd: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype = torch.bfloat16) -> NVFP4Tensor:
    """Inverse of :func:`to_modelopt` (global scale = ``1 / weight_scale_2``, see module docstring)."""
    packed = sd[f"{prefix}.weight"]
    shape = torch.Size(tuple(packed.shape[:-1]) + (packed.shape[-1] * 2,))
    s2 = sd[f"{prefix}.weight_scale_2"].to(torch.float32)
    gs = 1.0 / (s2.reshape(()) if s2.numel() == 1 else s2)
    return NVFP4Tensor(packed, sd[f"{prefix}.weight_scale"].view(torch.float8_e4m3fn), gs, shape, dtype)
