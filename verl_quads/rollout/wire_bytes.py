"""Host tensors whose memory is a Python ``bytearray``: what a worker RPC reply can carry without another copy.

Why: verl's worker RPC (``verl_quads.patches.verl_rollout_guidance``) sends each request's TRACE rows as raw bytes
(vLLM's msgpack RPC carries no typed tensors in a utility result), and ``torch.Tensor.numpy().tobytes()`` copies
them into fresh memory once more after :meth:`~verl_quads.rollout.capture.GuidanceStore.pop` has concatenated them
into fresh memory: two first touches of every byte (~43.7 KB per token and 64 guided GEMMs at Qwen3-30B-A3B widths,
~8 MB per request). A pop that concatenates into :func:`bytes_backed` memory (``GuidanceStore.pop(into_bytes=True)``,
what the worker RPC asks for) hands the RPC that ``bytearray`` itself (:func:`backing_bytes`; msgpack and pickle both
carry a ``bytearray`` as bytes). H200 host, 64 requests x 191 tokens (session 30, ``capture_probe --what trace``, two
alternating rounds): pop + reply 299-381 ms vs 401-467 ms before; a pop alone cost more that way (the zero-fill of
``bytearray(n)``: 287-358 vs 252-305 ms), so callers that keep the tensors do not ask for it. Since session 31 the pop
builds the bytearray with :func:`bytes_backed_cat` (``bytearray.join`` of the row blocks: one pass over fresh memory, no
zero-fill): ``capture_probe --what trace --device cpu`` on a 2-core CPU, three alternating rounds, pop of 64 requests
435-457 ms vs 456-508, 16 requests 119-125 vs 125-148 (docs/bench_capture_probe_pop_join_cpu_session31.txt; not yet
re-measured on the H200 host).
"""

from __future__ import annotations

import math

import torch

_ATTR = "_verl_quads_backing_bytes"


def bytes_backed(shape: tuple[int, ...]) -> torch.Tensor:
    """A new uint8 CPU tensor of ``shape`` (contents: zeros) whose memory is a ``bytearray`` that
    :func:`backing_bytes` returns for this very tensor object (not for views of it)."""
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=torch.uint8)
    return _over(bytearray(n), shape)


def _over(buf: bytearray, shape: tuple[int, ...]) -> torch.Tensor:
    """The uint8 tensor of ``shape`` over all of ``buf``, carrying ``buf`` for :func:`backing_bytes`."""
    t = torch.frombuffer(buf, dtype=torch.uint8).view(shape)
    setattr(t, _ATTR, buf)
    return t


def bytes_backed_cat(blocks: list[torch.Tensor], width: int) -> torch.Tensor:
    """``torch.cat(blocks)`` of uint8 CPU row blocks ``[n_i, width]`` as a :func:`bytes_backed`-style tensor
    ``[sum n_i, width]``: the bytearray is made by ``bytearray.join`` of the blocks' memory (each written once into
    fresh memory; ``bytearray(n)`` would zero it first). Non-contiguous blocks are made contiguous first."""
    for i, b in enumerate(blocks):
        if b.dtype != torch.uint8 or b.device.type != "cpu" or b.dim() != 2 or b.shape[1] != width:
            raise ValueError(f"bytes_backed_cat: block {i} is {b.dtype} {tuple(b.shape)} on {b.device}; "
                             f"need uint8 [rows, {width}] on the CPU")
    n = sum(b.shape[0] for b in blocks)
    if n == 0 or width == 0:
        return bytes_backed((n, width))
    return _over(bytearray().join([b.contiguous().numpy() for b in blocks]), (n, width))


def backing_bytes(t: torch.Tensor) -> bytearray | None:
    """The ``bytearray`` holding exactly ``t``'s bytes (``t`` made by :func:`bytes_backed`, unchanged in shape and
    storage), else None."""
    buf = getattr(t, _ATTR, None)
    if buf is None or t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous() \
            or t.numel() != len(buf) or t.storage_offset() != 0:
        return None
    return buf


__all__ = ["backing_bytes", "bytes_backed", "bytes_backed_cat"]
