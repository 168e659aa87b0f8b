"""vLLM request ids (the caller's external id of an engine-internal one) and the base of what the rollout
captures per request."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


def external_request_id(internal_id: str) -> str:
    """The caller's request id of a vLLM 0.32 internal id ``<external>-<8 hex>`` (unchanged otherwise)."""
    head, sep, tail = internal_id.rpartition("-")
    if sep and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail):
        return head
    return internal_id


def single_match(request_id: str, hits: Iterable[str]) -> str | None:
    """The one internal id among ``hits`` (those whose external id is ``request_id``), None if none; ``KeyError``
    if several (the caller's id is then ambiguous)."""
    hits = sorted(hits)
    if len(hits) > 1:
        raise KeyError(f"request id {request_id!r} matches several captured requests: {hits}")
    return hits[0] if hits else None


@dataclass
class RequestCapture:
    """What the rollout captured for one request, keyed by its token positions (base of the two kinds).

    Attributes:
        request_id: vLLM's internal request id.
        positions: int64 ``[T]`` token positions, ascending, unique.
    """

    request_id: str
    positions: torch.Tensor

    @property
    def external_id(self) -> str:
        """The id the caller gave the request (vLLM's internal id without its random suffix)."""
        return external_request_id(self.request_id)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())
