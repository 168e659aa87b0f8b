"""Torch reference implementation of NVFP4 quantization, bit-exact with vLLM's reference.

Every operation follows vLLM's test reference (``ref_nvfp4_quant``) in the same float32
order, because a different but mathematically equal order (``gs / scale`` instead of
``1 / (scale * (1 / gs))``) flips about one element in 6000:

    vec_max      = max |x| over the 16-block                        (float32)
    scale        = e4m3( min(global_scale * (vec_max * f32(1/6)), 448) )   (round-to-nearest-even)
    output_scale = 1 / (float(scale) * (1 / global_scale))          (1/0 := 0)
    y            = clamp(x * output_scale, -6, 6)
    code         = E2M1 round-to-nearest-even of y, sign = IEEE sign bit of y

The Triton kernels (:mod:`.triton_kernels`) must produce the same bytes as this module.
"""

from __future__ import annotations

import torch

from verl_quads.nvfp4.format import (
    BLOCK_SIZE,
    E4M3_MAX,
    FP4_MAX,
    GLOBAL_SCALE_NUMERATOR,
    SUPPORTED_INPUT_DTYPES,
    NVFP4Tensor,
    e2m1_table,
    pack_codes,
    unpack_codes,
)

# f32(1/6): vLLM multiplies by the Python float 1/6, which torch applies as a float32 scalar.
_INV_FP4_MAX = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)

# E2M1 round-to-nearest-even decision points on |y|: the magnitude index is the number of
# thresholds passed. ``>`` at a tie rounds down to the even index, ``>=`` rounds up to it.
# (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0)
E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def validate_input(x: torch.Tensor, name: str = "x", check_finite: bool = True) -> None:
    """Raise ``ValueError`` naming ``name`` and its shape if ``x`` cannot be quantized.

    Allowed: float32 / bfloat16 / float16, at least 1 dimension, last dimension divisible by 16,
    finite values (the finite check costs one pass over ``x``; hot paths that already know
    their input is finite pass ``check_finite=False``).
    """
    if x.dtype not in SUPPORTED_INPUT_DTYPES:
        raise ValueError(
            f"NVFP4: {name} has dtype {x.dtype} (shape {tuple(x.shape)}); allowed: float32, bfloat16, float16"
        )
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"NVFP4: {name} has shape {tuple(x.shape)}; its last dimension must be divisible by {BLOCK_SIZE}"
        )
    if check_finite and x.numel() and not bool(torch.isfinite(x).all()):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise ValueError(
            f"NVFP4: {name} (shape {tuple(x.shape)}) contains {n_nan} NaN and {n_inf} Inf values; "
            "only finite values can be quantized"
        )


def global_scale_from_amax(amax: torch.Tensor | float) -> torch.Tensor:
    """Encode global scale ``448 * 6 / amax`` in float32, same shape as ``amax``.

    ``amax`` is clamped below at the smallest normal float32 first; a result that is not finite
    (amax == 0 overflows) becomes 1.0, the convention of compressed-tensors' ``generate_gparam``.
    Order of float32 operations: ``reciprocal(amax) * 2688`` — what torch does for
    ``python_float / tensor`` (vLLM's reference writes it that way), which differs from a true
    division ``2688 / amax`` in about a quarter of inputs; kernels reproduce this order.
    So an all-zero tensor gets global scale 1.0, block scales 0 and all-zero codes.
    """
    a = torch.as_tensor(amax).to(torch.float32)
    a = torch.clamp(a, min=torch.finfo(torch.float32).tiny)
    gs = GLOBAL_SCALE_NUMERATOR / a
    # == where(isfinite(gs), gs, 1) in one kernel instead of three (host launch cost in the QAT step)
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)


def per_row_global_scale(x: torch.Tensor) -> torch.Tensor:
    """Encode scale per row (the activation convention: one per token): float32 ``[..., 1]``,
    :func:`global_scale_from_amax` of each row's ``amax(|x|)`` (1.0 for an all-zero row). Detached."""
    return global_scale_from_amax(x.detach().abs().amax(dim=-1, keepdim=True).to(torch.float32))


def _check_global_scale(gs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(gs, torch.Tensor):
        gs = torch.tensor(float(gs), dtype=torch.float32)
    if gs.dtype != torch.float32:
        raise ValueError(f"NVFP4: global_scale must be float32, got {gs.dtype}")
    if gs.dim() not in (0, x.dim()) or (gs.dim() and gs.shape[-1] != 1):
        raise ValueError(
            f"NVFP4: global_scale of shape {tuple(gs.shape)} does not fit x of shape {tuple(x.shape)}; "
            "allowed: a 0-d tensor, or one with x's number of dimensions and a last dimension of 1 "
            "(e.g. [E, 1, 1] per expert, [..., 1] per row)"
        )
    try:
        torch.broadcast_shapes(gs.shape, x.shape)
    except RuntimeError as e:
        raise ValueError(f"NVFP4: global_scale {tuple(gs.shape)} does not broadcast to x {tuple(x.shape)}") from e
    if not bool(torch.isfinite(gs).all()) or bool((gs <= 0).any()):
        raise ValueError("NVFP4: global_scale must be finite and > 0")
    return gs.to(x.device)


def _check_amax(amax, x: torch.Tensor):
    """``amax`` of :func:`quantize` / :func:`fake_quantize`: "row", or a floating tensor shaped like a
    global scale (0-d; x's dims with a trailing 1) or 1-D (a fused group: one scale from the max of its
    G entries). Shape/dtype checks only (no device sync). Returns (amax tensor or "row", group size)."""
    if isinstance(amax, str):
        if amax != "row":
            raise ValueError(f"NVFP4: amax must be a tensor or 'row', got {amax!r}")
        return amax, 1
    if not isinstance(amax, torch.Tensor) or not amax.is_floating_point():
        raise ValueError(f"NVFP4: amax must be a floating tensor or 'row', got {type(amax).__name__} "
                         f"{getattr(amax, 'dtype', '')}")
    if amax.device != x.device:
        raise ValueError(f"NVFP4: amax is on {amax.device} but x on {x.device}")
    if amax.dim() == 1 and x.dim() > 1:
        if amax.numel() < 1:
            raise ValueError("NVFP4: a group amax needs at least one entry")
        return amax.contiguous(), amax.numel()
    _check_shape_only(amax, x, "amax")
    return amax, 1


def _check_shape_only(t: torch.Tensor, x: torch.Tensor, what: str) -> None:
    if t.dim() not in (0, x.dim()) or (t.dim() and t.shape[-1] != 1):
        raise ValueError(
            f"NVFP4: {what} of shape {tuple(t.shape)} does not fit x of shape {tuple(x.shape)}; allowed: a 0-d "
            "tensor, or one with x's number of dimensions and a last dimension of 1 (e.g. [E, 1, 1] per expert, "
            "[..., 1] per row)" + ("; or 1-D [G] (a fused group)" if what == "amax" else ""))
    # (by hand: torch.broadcast_shapes costs ~0.4 ms of host time per call)
    if t.dim() and any(d not in (1, n) for d, n in zip(t.shape, x.shape)):
        raise ValueError(f"NVFP4: {what} {tuple(t.shape)} does not broadcast to x {tuple(x.shape)}")


def _gs_of_amax(x: torch.Tensor, am, ng: int) -> torch.Tensor:
    """The global scale that ``amax`` (checked by :func:`_check_amax`) stands for, by the torch ops of
    :func:`global_scale_from_amax` (the slow paths: check_finite, empty x, odd broadcast shapes)."""
    if isinstance(am, str):
        return per_row_global_scale(x)
    a = am.to(torch.float32)
    return global_scale_from_amax(a.amax() if ng > 1 or (am.dim() == 1 and x.dim() > 1) else a)


def _reciprocal(t: torch.Tensor) -> torch.Tensor:
    """1 / t with 1/0 := 0 (vLLM's ``get_reciprocal``)."""
    return torch.where(t == 0, torch.zeros_like(t), 1.0 / t)


def e2m1_magnitude_index(abs_y: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even magnitude index (uint8 0..7) of ``|y|`` in [0, 6], float32."""
    idx = torch.zeros(abs_y.shape, dtype=torch.uint8, device=abs_y.device)
    for t, inclusive in E2M1_THRESHOLDS:
        idx += (abs_y >= t if inclusive else abs_y > t).to(torch.uint8)
    return idx


def block_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales ``[..., K // 16]`` for ``x`` under the encode ``global_scale``."""
    blocks = x.unflatten(-1, (-1, BLOCK_SIZE))
    vec_max = blocks.abs().amax(dim=-1).to(torch.float32)
    gs = global_scale if global_scale.dim() == 0 else global_scale
    scale = gs * (vec_max * _INV_FP4_MAX.to(x.device))
    return torch.clamp(scale, max=E4M3_MAX).to(torch.float8_e4m3fn)


def scaled_values(x: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x * output_scale, -6, 6)`` in float32, shape ``[..., K // 16, 16]``."""
    output_scale = _reciprocal(block_scale.to(torch.float32) * _reciprocal(global_scale))
    blocks = x.unflatten(-1, (-1, BLOCK_SIZE)).to(torch.float32)
    return torch.clamp(blocks * output_scale.unsqueeze(-1), -FP4_MAX, FP4_MAX)


def encode_codes(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, sign << 3 | magnitude index) of scaled float32 values ``y``."""
    sign = torch.signbit(y).to(torch.uint8) << 3
    return sign | e2m1_magnitude_index(y.abs())


def quantize(
    x: torch.Tensor, global_scale: torch.Tensor | float | None = None, *, check_finite: bool = True
) -> NVFP4Tensor:
    """Quantize ``x`` (float32/bf16/fp16 ``[..., K]``, K % 16 == 0) to NVFP4.

    ``global_scale``: float32 encode scale (0-d, or broadcastable with a trailing 1, e.g.
    ``[E, 1, 1]``); when None it is :func:`global_scale_from_amax` of ``amax(|x|)`` (per tensor).
    """
    validate_input(x, check_finite=check_finite)
    if global_scale is None:
        gs = global_scale_from_amax(x.abs().amax() if x.numel() else torch.tensor(0.0)).to(x.device)
    else:
        gs = _check_global_scale(global_scale, x)
    scale = block_scales(x, gs)
    y = scaled_values(x, scale, gs)
    codes = encode_codes(y).flatten(-2)
    return NVFP4Tensor(pack_codes(codes), scale, gs, x.shape, x.dtype)


def dequantize_to_float32(q: NVFP4Tensor) -> torch.Tensor:
    """Dequantized values in float32, shape ``q.shape`` (exact: one product per element)."""
    vals = e2m1_table(q.packed.device)[unpack_codes(q.packed).long()]
    factor = q.block_scale.to(torch.float32) / q.global_scale
    return (vals.unflatten(-1, (-1, BLOCK_SIZE)) * factor.unsqueeze(-1)).flatten(-2)


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``E2M1 value * (block_scale / global_scale)`` in float32, cast to ``dtype``."""
    return dequantize_to_float32(q).to(dtype)


def fake_quantize(
    x: torch.Tensor, global_scale: torch.Tensor | float | None = None, *, check_finite: bool = True
) -> torch.Tensor:
    """Quantize-dequantize (QDQ): same shape and dtype as ``x``."""
    return dequantize(quantize(x, global_scale, check_finite=check_finite), x.dtype)


__all__ = [
    "validate_input",
    "global_scale_from_amax",
    "per_row_global_scale",
    "e2m1_magnitude_index",
    "block_scales",
    "scaled_values",
    "encode_codes",
    "quantize",
    "dequantize",
    "dequantize_to_float32",
    "fake_quantize",
    "unpack_codes",
]
