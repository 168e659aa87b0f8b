"""Per-process cache of the CUDA device facts the kernel dispatch reads on every call (compute capability, SM count).

Why: an eager decode GEMM is host-bound at one token, and ``torch.cuda.get_device_capability`` /
``get_device_properties`` cost ~3-10 us each on the H200 host (they resolve the device index and build a properties
object on every call); the dispatch of one dense W4A16 call asked 5-6 times (``python -m verl_quads.bench.duty_probe
--eager``, session 24). Both facts are fixed for a device for the life of the process, so they are read once per
device index.
"""

from __future__ import annotations

import torch

_CAPABILITY: dict[int, tuple[int, int]] = {}
_SMS: dict[int, int] = {}


def _index(device: torch.device | int | None) -> int:
    """The CUDA device index of ``device`` (``None``, ``"cuda"`` without an index: the current device)."""
    if isinstance(device, int):
        return device
    idx = getattr(device, "index", None)
    return torch.cuda.current_device() if idx is None else idx


def capability(device: torch.device | int | None = None) -> tuple[int, int]:
    """``(major, minor)`` compute capability of a CUDA device (read once per device index)."""
    i = _index(device)
    cap = _CAPABILITY.get(i)
    if cap is None:
        cap = _CAPABILITY[i] = tuple(torch.cuda.get_device_capability(i))
    return cap


def sm_count(device: torch.device | int | None = None) -> int:
    """Streaming multiprocessors of a CUDA device (read once per device index)."""
    i = _index(device)
    n = _SMS.get(i)
    if n is None:
        n = _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return n


__all__ = ["capability", "sm_count"]
