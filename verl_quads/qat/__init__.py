"""Trainer side: NVFP4 quantization-aware training for Hugging Face causal LMs (DESIGN.md §1, §5).

- :func:`apply_qat` / :func:`remove_qat`: in place, parameters untouched (FSDP2-, optimizer- and
  checkpoint-neutral); see :mod:`.model`.
- weight layouts and global-scale sharing: :mod:`.weights`; activation QDQ: :mod:`.activations`.
- TRACE guidance: :class:`GuidanceProvider` keyed by :class:`GuidanceKey` (uid, policy version,
  layer, GEMM), :class:`TraceBatch` mapping token rows to sequences, :func:`trace_context`;
  see :mod:`.guidance`.
"""

from verl_quads.qat.guidance import (
    GEMM_NAMES,
    GuidanceEntry,
    GuidanceError,
    GuidanceKey,
    GuidanceProvider,
    InMemoryGuidanceStore,
    RolloutGuidanceProvider,
    TraceBatch,
)
from verl_quads.qat.model import QATState, apply_qat, remove_qat, trace_context

__all__ = [
    "GEMM_NAMES",
    "GuidanceEntry",
    "GuidanceError",
    "GuidanceKey",
    "GuidanceProvider",
    "InMemoryGuidanceStore",
    "QATState",
    "RolloutGuidanceProvider",
    "TraceBatch",
    "apply_qat",
    "remove_qat",
    "trace_context",
]
