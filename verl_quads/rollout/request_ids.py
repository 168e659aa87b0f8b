"""vLLM request ids: the caller's (external) id of an engine-internal one."""

from __future__ import annotations


def external_request_id(internal_id: str) -> str:
    """The caller's request id of a vLLM 0.32 internal id ``<external>-<8 hex>`` (unchanged otherwise)."""
    head, sep, tail = internal_id.rpartition("-")
    if sep and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail):
        return head
    return internal_id
