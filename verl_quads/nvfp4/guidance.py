"""TRACE guided rounding (DESIGN.md §1, "our definition").

The rollout keeps, per quantized activation, a compact :class:`GuidanceRecord`: the low bit of
each element's E2M1 code (1 bit/element, bit-packed), the E4M3 block scales (8 bits per 16
elements) and the float32 global scale(s): 1.5 bits per element plus 4 bytes per global scale,
against 16 for the BF16 activation and 4.5 for the full NVFP4 tensor.

The trainer quantizes its own (nearby) value ``x`` under that record: it reuses the record's
block and global scales, computes ``y = clamp(x * output_scale, -6, 6)`` exactly as the
reference does, and among the two E2M1 magnitudes adjacent to ``|y|`` (floor and ceiling on the
grid; equal when ``|y|`` is a grid point) takes the one whose magnitude-index low bit equals the
record's bit. Adjacent indices differ by one, so exactly one of floor/ceil matches unless
``|y|`` lies on the grid, where that grid point is kept. The sign is ``y``'s.

Bit packing of ``bits``: uint8 ``[..., K // 8]``, element ``8i + j`` in bit ``j`` (LSB first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_quads.nvfp4.format import BLOCK_SIZE, NVFP4Tensor, pack_codes
from verl_quads.nvfp4.reference import scaled_values, validate_input

_BIT_WEIGHTS = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8)
# floor index on the E2M1 grid: number of grid magnitudes <= |y|, minus one.
_GRID = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class GuidanceRecord:
    """Compact rollout guidance for one quantized tensor of logical shape ``[..., K]``.

    Attributes:
        bits: uint8 ``[..., K // 8]``, low bit of each code's magnitude index, LSB first.
        block_scale: float8_e4m3fn ``[..., K // 16]``.
        global_scale: float32, as in :class:`~verl_quads.nvfp4.NVFP4Tensor`.
        shape: logical shape ``[..., K]``.
    """

    bits: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        """Bytes held: bits + block scales + global scales."""
        return self.bits.numel() + self.block_scale.numel() + 4 * self.global_scale.numel()


_BIT_WEIGHTS_ON: dict[torch.device, torch.Tensor] = {}


def check_record_out(out: GuidanceRecord, x: torch.Tensor) -> tuple[int, ...]:
    """Check that ``out`` can receive the guidance record of x ``[..., K]`` and return its leading shape ``L``:
    bits uint8 ``[*L, K/8]``, block scales (e4m3 or uint8 bytes) ``[*L, K/16]``, global scales float32 ``[*L, 1]``,
    on x's device, each with a contiguous last dim, where ``L`` is ``(R,)`` (R = x's rows, any row stride) or
    ``(T, S)`` with T * S = R, x's row ``t * S + s`` going to ``[t, s]`` and a token's S slots contiguous (TRACE's
    token rows, :mod:`verl_quads.rollout.trace_rows`). Anything else is a ValueError naming the tensor."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    lead = tuple(out.bits.shape[:-1])
    want = {"bits": (out.bits, (torch.uint8,), k // 8),
            "block_scale": (out.block_scale, (torch.float8_e4m3fn, torch.uint8), k // BLOCK_SIZE),
            "global_scale": (out.global_scale, (torch.float32,), 1)}
    for name, (t, dtypes, last) in want.items():
        ok = (t.dtype in dtypes and t.device == x.device and tuple(t.shape) == (*lead, last) and t.stride(-1) == 1
              and len(lead) in (1, 2) and lead[0] * (lead[-1] if len(lead) == 2 else 1) == rows
              and (len(lead) == 1 or t.stride(1) == last))
        if not ok:
            raise ValueError(
                f"NVFP4 guidance output: record.{name} must be {dtypes[0]} on {x.device} shaped [R, {last}] (R = "
                f"{rows} rows of x {list(x.shape)}) or [T, S, {last}] with T * S = R and slots contiguous, last dim "
                f"contiguous; got {t.dtype} on {t.device} {list(t.shape)} strides {list(t.stride())}")
    return lead


def _bit_weights(device: torch.device) -> torch.Tensor:
    """:data:`_BIT_WEIGHTS` on ``device``, copied once per device: a CPU -> GPU copy per call would be a
    blocking host transfer in the QAT hot path (TRACE's own guidance for uncovered rows)."""
    w = _BIT_WEIGHTS_ON.get(device)
    if w is None:
        w = _BIT_WEIGHTS_ON.setdefault(device, _BIT_WEIGHTS.to(device))
    return w


def pack_bits(b: torch.Tensor) -> torch.Tensor:
    """Pack a 0/1 uint8 tensor ``[..., K]`` (K % 8 == 0) into uint8 ``[..., K // 8]``, LSB first."""
    w = _bit_weights(b.device)
    return (b.to(torch.uint8).unflatten(-1, (-1, 8)) * w).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 ``[..., K // 8]`` -> 0/1 uint8 ``[..., K]``."""
    w = _bit_weights(packed.device)
    return ((packed.unsqueeze(-1) & w) != 0).to(torch.uint8).flatten(-2)


def extract_guidance(q: NVFP4Tensor) -> GuidanceRecord:
    """The compact guidance record of an NVFP4 tensor (low magnitude bit of every code)."""
    low = q.packed & 0x11  # bit 0 of both nibbles
    codes_low = torch.stack([low & 1, low >> 4], dim=-1).flatten(-2)
    return GuidanceRecord(pack_bits(codes_low), q.block_scale, q.global_scale, q.shape)


def _floor_index(abs_y: torch.Tensor) -> torch.Tensor:
    idx = torch.zeros(abs_y.shape, dtype=torch.uint8, device=abs_y.device)
    for g in _GRID:
        idx += (abs_y >= g).to(torch.uint8)
    return idx


def guided_codes(y: torch.Tensor, low_bits: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of scaled values ``y`` (float32, in [-6, 6]) under the guidance bits."""
    a = y.abs()
    lo = _floor_index(a)
    grid = torch.tensor((0.0,) + _GRID, dtype=torch.float32, device=y.device)
    on_grid = grid[lo.long()] == a
    hi = torch.clamp(lo + 1, max=7)
    pick = torch.where((lo & 1) == low_bits, lo, hi)
    mag = torch.where(on_grid, lo, pick)
    return (torch.signbit(y).to(torch.uint8) << 3) | mag


def quantize_guided(x: torch.Tensor, guidance: GuidanceRecord, *, check_finite: bool = True) -> NVFP4Tensor:
    """Quantize ``x`` reusing ``guidance``'s scales and following its rounding choices.

    Raises ``ValueError`` if ``x``'s shape differs from the record's (a stale or foreign record).
    """
    validate_input(x, check_finite=check_finite)
    if tuple(x.shape) != tuple(guidance.shape):
        raise ValueError(
            f"quantize_guided: x has shape {tuple(x.shape)} but the guidance record was made for "
            f"{tuple(guidance.shape)} (stale or foreign record)"
        )
    gs = guidance.global_scale.to(x.device)
    y = scaled_values(x, guidance.block_scale.to(x.device), gs)
    low = unpack_bits(guidance.bits.to(x.device)).unflatten(-1, (-1, BLOCK_SIZE))
    codes = guided_codes(y, low).flatten(-2)
    return NVFP4Tensor(pack_codes(codes), guidance.block_scale.to(x.device), gs, x.shape, x.dtype)

