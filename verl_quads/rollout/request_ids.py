"""vLLM request ids (the caller's external id of an engine-internal one) and the base of what the rollout
captures per request."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

V = TypeVar("V")


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


class RequestIndex(Generic[V]):
    """What a capture holds per request, keyed by vLLM's internal request id and found by either id.

    Keeps the external id -> internal ids map next to the values, so :meth:`resolve` costs one lookup (not a scan
    of every held request). Not thread-safe: the owner serializes access."""

    def __init__(self) -> None:
        self._by_id: dict[str, V] = {}
        self._by_ext: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, internal_id: str) -> bool:
        return internal_id in self._by_id

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __getitem__(self, internal_id: str) -> V:
        return self._by_id[internal_id]

    def get(self, internal_id: str) -> V | None:
        return self._by_id.get(internal_id)

    def setdefault(self, internal_id: str, make: Callable[[], V]) -> V:
        """The value held for ``internal_id``, ``make()`` stored first if there is none."""
        v = self._by_id.get(internal_id)
        if v is None:
            v = self._by_id[internal_id] = make()
            self._by_ext.setdefault(external_request_id(internal_id), set()).add(internal_id)
        return v

    def pop(self, internal_id: str) -> V | None:
        """Remove and return the value of ``internal_id`` (None if none is held)."""
        v = self._by_id.pop(internal_id, None)
        if v is not None:
            ext = external_request_id(internal_id)
            self._by_ext[ext].discard(internal_id)
            if not self._by_ext[ext]:
                del self._by_ext[ext]
        return v

    def resolve(self, request_id: str) -> str | None:
        """The internal id held for ``request_id``: itself, or the one whose external id it is (vLLM 0.32 appends
        ``-<8 hex>`` to the caller's id inside the engine); None if none; ``KeyError`` if several match."""
        if request_id in self._by_id:
            return request_id
        return single_match(request_id, self._by_ext.get(request_id, ()))

    def clear(self) -> None:
        self._by_id.clear()
        self._by_ext.clear()


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
