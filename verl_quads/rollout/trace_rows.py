"""TRACE records as one byte row per token: every guided GEMM's guidance record of a token side by side.

Why: a step's records then leave the device as ONE copy of rows ``[0, n)`` of one persistent ``uint8 [rows, B]``
buffer, and a request's records as one concatenation of its rows, instead of a few tensor operations per guided GEMM
and step (64 guided GEMMs in 16 layers cost 1.5-3.9 ms of host time per decode step that way on the H200's host,
session 26: docs/bench_engine_trace_rows_h200_session26.txt).

Layout of a row (``B`` = :attr:`TraceRowLayout.row_bytes` bytes, a multiple of 8): the guided GEMMs in sorted
``(layer, gemm)`` order; per GEMM of ``K`` input channels and ``S`` slots (``S`` = top_k for the routed experts'
``mlp.experts.w2``, whose record is ``[T, top_k, K]``; none for a plain ``[T, K]`` record) four sections, each
starting at a multiple of 8 bytes:

- ``bits``: uint8 ``[S, K / 8]`` (low bit of each code's magnitude index, LSB first; :class:`GuidanceRecord`);
- ``block_scale``: float8_e4m3fn bytes ``[S, K / 16]``;
- ``global_scale``: float32 ``[S, 1]`` (the rollout's per-row global scale), native byte order;
- ``expert_ids``: int16 ``[S]``, only for a GEMM with slots (the routed expert of each slot; the MoE layer refuses
  models with more than 32,767 experts: 2 bytes per slot instead of int64's 8, ~1.7% of a token's row at Qwen3-30B-A3B
  widths).

Without slots the leading ``S`` is absent (``[K / 8]``, ``[K / 16]``, ``[1]``). :meth:`TraceRowLayout.views` cuts
typed views of any ``uint8 [R, B]`` tensor in this layout (the device buffer the GEMMs write, a step's host rows, a
request's concatenated rows: what ``GuidanceStore.pop`` hands over and the RPC wire carries, see ``RequestGuidance``);
:meth:`TraceRowLayout.spec` / :meth:`TraceRowLayout.from_spec` carry a layout over an RPC.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_quads.nvfp4 import GuidanceRecord

Key = tuple[int, str]  # (decoder layer index, GEMM name)

_ALIGN = 8  # bytes: every section starts 8-byte aligned


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class GemmRows:
    """The per-token shape of one guided GEMM's record: ``k`` input channels (a multiple of 16), ``slots`` = top_k
    for a record ``[T, top_k, k]`` with expert ids ``[T, top_k]`` (the routed experts' second GEMM), else None."""

    k: int
    slots: int | None = None

    def __post_init__(self) -> None:
        if self.k <= 0 or self.k % 16:
            raise ValueError(f"TRACE record rows: K = {self.k} input channels must be a positive multiple of 16")
        if self.slots is not None and self.slots <= 0:
            raise ValueError(f"TRACE record rows: slots = {self.slots} must be positive (top_k) or None")

    @classmethod
    def of(cls, record: GuidanceRecord, expert_ids: torch.Tensor | None) -> "GemmRows":
        """The rows of ``record`` (leading dim = tokens): ``[T, K]`` without ``expert_ids``, ``[T, S, K]`` with
        ``expert_ids`` ``[T, S]``; anything else is a ValueError naming the shapes."""
        shape = tuple(record.shape)
        if expert_ids is None and len(shape) == 2:
            return cls(shape[1])
        if expert_ids is not None and len(shape) == 3 and tuple(expert_ids.shape) == shape[:2]:
            return cls(shape[2], shape[1])
        ids = None if expert_ids is None else list(expert_ids.shape)
        raise ValueError(f"TRACE record of shape {list(shape)} with expert ids {ids}: expected [T, K] without expert "
                         "ids or [T, top_k, K] with expert ids [T, top_k]")

    @property
    def lead(self) -> tuple[int, ...]:
        return () if self.slots is None else (self.slots,)


@dataclass(frozen=True)
class _Sections:
    bits: int
    scale: int
    gs: int
    ids: int | None


class TraceRowLayout:
    """Byte offsets of every guided GEMM's record in a token's row (module docstring). Immutable: a store that
    needs another layout builds a new one, and host rows keep the layout they were written in."""

    def __init__(self, gemms: dict[Key, GemmRows]) -> None:
        self.gemms: dict[Key, GemmRows] = dict(sorted(gemms.items()))
        self._at: dict[Key, _Sections] = {}
        self.ids_key: dict[int, Key] = {}  # decoder layer -> its GEMM with slots (expert ids)
        o = 0
        for key, g in self.gemms.items():
            s = g.slots or 1
            bits, o = o, _up(o + s * g.k // 8)
            scale, o = o, _up(o + s * g.k // 16)
            gs, o = o, _up(o + 4 * s)
            ids = None
            if g.slots is not None:
                if key[0] in self.ids_key:
                    raise ValueError(f"TRACE record rows: layer {key[0]} has two GEMMs with expert slots "
                                     f"({self.ids_key[key[0]][1]!r}, {key[1]!r}); one expert-id set per layer")
                self.ids_key[key[0]] = key
                ids, o = o, _up(o + 2 * g.slots)
            self._at[key] = _Sections(bits, scale, gs, ids)
        self.row_bytes = max(o, _ALIGN)

    def spec(self) -> list[list]:
        """The layout as plain values (what an RPC can carry): ``[[layer, gemm, k, slots or 0], ...]`` in row
        order; :meth:`from_spec` rebuilds an equal layout (the offsets follow from the GEMMs alone)."""
        return [[layer, gemm, g.k, g.slots or 0] for (layer, gemm), g in self.gemms.items()]

    @classmethod
    def from_spec(cls, spec: list, row_bytes: int) -> "TraceRowLayout":
        """Inverse of :meth:`spec`; ``row_bytes`` is the sender's :attr:`row_bytes`, checked (a ValueError if this
        code lays the GEMMs out differently, e.g. records from another verl-quads version). Cached per spec: every
        request of an engine has the same layout."""
        key = tuple((int(la), str(gm), int(k), int(s)) for la, gm, k, s in spec)
        layout = _SPEC_CACHE.get(key)
        if layout is None:
            layout = cls({(la, gm): GemmRows(k, s or None) for la, gm, k, s in key})
            if len(_SPEC_CACHE) < 64:
                _SPEC_CACHE[key] = layout
        if layout.row_bytes != int(row_bytes):
            raise ValueError(f"TRACE rows: the sender's layout of {len(key)} GEMMs has rows of {row_bytes} bytes, "
                             f"this verl-quads lays them out in {layout.row_bytes}: rollout and trainer run "
                             "different verl-quads versions")
        return layout

    def record_nbytes(self, keys) -> int:
        """Bytes per token of the records of ``keys`` (bits + block scales + global scales, no padding, no expert
        ids): :attr:`GuidanceRecord.nbytes` of one token summed over ``keys``."""
        return sum((self.gemms[k].slots or 1) * (self.gemms[k].k // 8 + self.gemms[k].k // 16 + 4) for k in keys)

    def views(self, rows: torch.Tensor) -> tuple[dict[Key, GuidanceRecord], dict[int, torch.Tensor]]:
        """Typed views of ``rows`` (uint8 ``[R, row_bytes]``, last dim contiguous, 8-byte aligned rows):
        ``{key: GuidanceRecord}`` (bits ``[R, (S,) K/8]``, block scales ``[R, (S,) K/16]``, global scales
        ``[R, (S,) 1]``) and ``{layer: int16 [R, S]}`` expert ids. Writing a view writes ``rows``."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != self.row_bytes:
            raise ValueError(f"TRACE rows: expected uint8 [R, {self.row_bytes}], got {rows.dtype} {list(rows.shape)}")
        n = rows.shape[0]
        if n:
            # one typed view of the whole rows per dtype, then ONE as_strided per section: a slice + view + reshape
            # per section cost ~3 ms of host time per request with 64 guided GEMMs (the trainer cuts every request)
            typed = {dt: rows if dt == torch.uint8 else rows.view(dt)
                     for dt in (torch.uint8, torch.float8_e4m3fn, torch.float32, torch.int16)}

        def cut(start: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            if not n:
                return torch.empty((0, *shape), dtype=dtype, device=rows.device)
            t = typed[dtype]
            inner = [1] * len(shape)
            for i in range(len(shape) - 2, -1, -1):
                inner[i] = inner[i + 1] * shape[i + 1]
            return t.as_strided((n, *shape), (t.stride(0), *inner), t.storage_offset() + start // t.element_size())

        records, ids = {}, {}
        for key, g in self.gemms.items():
            at = self._at[key]
            records[key] = GuidanceRecord(
                cut(at.bits, torch.uint8, (*g.lead, g.k // 8)),
                cut(at.scale, torch.float8_e4m3fn, (*g.lead, g.k // 16)),
                cut(at.gs, torch.float32, (*g.lead, 1)),
                torch.Size((n, *g.lead, g.k)),
            )
            if at.ids is not None:
                ids[key[0]] = cut(at.ids, torch.int16, (g.slots,))
        return records, ids


_SPEC_CACHE: dict[tuple, TraceRowLayout] = {}


def contiguous_records(records: dict[Key, GuidanceRecord],
                       ids: dict[int, torch.Tensor]) -> tuple[dict[Key, GuidanceRecord], dict[int, torch.Tensor]]:
    """``records`` and expert ``ids`` with every tensor contiguous (``.contiguous()`` each), sorted by key."""
    return ({k: GuidanceRecord(r.bits.contiguous(), r.block_scale.contiguous(), r.global_scale.contiguous(), r.shape)
             for k, r in sorted(records.items())}, {la: t.contiguous() for la, t in sorted(ids.items())})
