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
- ``expert_ids``: int64 ``[S]``, only for a GEMM with slots (the routed expert of each slot).

Without slots the leading ``S`` is absent (``[K / 8]``, ``[K / 16]``, ``[1]``). :meth:`TraceRowLayout.views` cuts
typed views of any ``uint8 [R, B]`` tensor in this layout (the device buffer the GEMMs write, a step's host rows, a
request's concatenated rows); :meth:`TraceRowLayout.copy_out` copies a request's records out of its rows as contiguous
tensors (what ``GuidanceStore.pop`` hands over), one strided copy per section kind and run of equally spaced GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_quads.nvfp4 import GuidanceRecord

Key = tuple[int, str]  # (decoder layer index, GEMM name)

_ALIGN = 8  # bytes: every section may be viewed as int64


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
                ids, o = o, _up(o + 8 * g.slots)
            self._at[key] = _Sections(bits, scale, gs, ids)
        self.row_bytes = max(o, _ALIGN)

    def views(self, rows: torch.Tensor) -> tuple[dict[Key, GuidanceRecord], dict[int, torch.Tensor]]:
        """Typed views of ``rows`` (uint8 ``[R, row_bytes]``, last dim contiguous, 8-byte aligned rows):
        ``{key: GuidanceRecord}`` (bits ``[R, (S,) K/8]``, block scales ``[R, (S,) K/16]``, global scales
        ``[R, (S,) 1]``) and ``{layer: int64 [R, S]}`` expert ids. Writing a view writes ``rows``."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != self.row_bytes:
            raise ValueError(f"TRACE rows: expected uint8 [R, {self.row_bytes}], got {rows.dtype} {list(rows.shape)}")
        n = rows.shape[0]

        def cut(start: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            t = rows[:, start:start + nbytes]
            return (t if dtype == torch.uint8 else t.view(dtype)).reshape(n, *shape) if n else \
                torch.empty((0, *shape), dtype=dtype, device=rows.device)

        records, ids = {}, {}
        for key, g in self.gemms.items():
            at, s = self._at[key], g.slots or 1
            records[key] = GuidanceRecord(
                cut(at.bits, s * g.k // 8, torch.uint8, (*g.lead, g.k // 8)),
                cut(at.scale, s * g.k // 16, torch.uint8, (*g.lead, g.k // 16)).view(torch.float8_e4m3fn),
                cut(at.gs, 4 * s, torch.float32, (*g.lead, 1)),
                torch.Size((n, *g.lead, g.k)),
            )
            if at.ids is not None:
                ids[key[0]] = cut(at.ids, 8 * g.slots, torch.int64, (g.slots,))
        return records, ids

    def copy_out(self, rows: torch.Tensor,
                 keys: set[Key]) -> tuple[dict[Key, GuidanceRecord], dict[int, torch.Tensor]]:
        """:meth:`views` of ``keys`` only (and the expert ids of the layers whose GEMM with slots is among them) as
        CONTIGUOUS tensors that do not share ``rows``' memory (what a popped request hands over: vLLM's RPC and
        verl's transport copy views anyway), ``rows`` uint8 ``[R, row_bytes]`` (rows not contiguous are copied
        first). Why not a ``.contiguous()`` per view: that is three small strided copies per GEMM (192 for 64 guided
        GEMMs, most of a pop's host time). Here GEMMs of the same name and shape whose sections lie at equal
        distances in the row (the same GEMM of consecutive layers: one run) are copied together, one strided copy
        per section kind and run into ``[layers, R, bytes]``, and each GEMM's tensors are slices of it (contiguous,
        own memory)."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != self.row_bytes:
            raise ValueError(f"TRACE rows: expected uint8 [R, {self.row_bytes}], got {rows.dtype} {list(rows.shape)}")
        n = rows.shape[0]
        if n == 0:
            recs, ids = self.views(rows)
            return contiguous_records({k: r for k, r in recs.items() if k in keys},
                                      {la: t for la, t in ids.items() if self.ids_key[la] in keys})
        rows = rows.contiguous()  # rows of a wider buffer: one copy, then the strided copies below
        groups: dict[tuple[str, GemmRows], list[Key]] = {}
        for key in sorted(keys):
            groups.setdefault((key[1], self.gemms[key]), []).append(key)
        records, ids = {}, {}
        for (_, g), members in groups.items():
            for run in _runs(members, [self._at[k].bits for k in members]):
                self._copy_run(rows, run, g, records, ids)
        return dict(sorted(records.items())), dict(sorted(ids.items()))

    def _copy_run(self, rows: torch.Tensor, run: list[Key], g: GemmRows, records: dict, ids: dict) -> None:
        """One strided copy per section kind of the GEMMs ``run`` (equal shape, sections at equal distances)."""
        n, s = rows.shape[0], g.slots or 1
        first = self._at[run[0]]
        step = self._at[run[1]].bits - first.bits if len(run) > 1 else self.row_bytes

        def block(start: int, nbytes: int) -> torch.Tensor:  # [len(run), n, nbytes], its own memory
            return rows.as_strided((len(run), n, nbytes), (step, self.row_bytes, 1),
                                   rows.storage_offset() + start).clone(memory_format=torch.contiguous_format)

        bits = block(first.bits, s * g.k // 8)
        scale = block(first.scale, s * g.k // 16).view(torch.float8_e4m3fn)
        gs = block(first.gs, 4 * s).view(torch.float32)
        eids = None if first.ids is None else block(first.ids, 8 * s).view(torch.int64)
        for i, key in enumerate(run):
            records[key] = GuidanceRecord(bits[i].reshape(n, *g.lead, g.k // 8),
                                          scale[i].reshape(n, *g.lead, g.k // 16),
                                          gs[i].reshape(n, *g.lead, 1), torch.Size((n, *g.lead, g.k)))
            if eids is not None:
                ids[key[0]] = eids[i]


def contiguous_records(records: dict[Key, GuidanceRecord],
                       ids: dict[int, torch.Tensor]) -> tuple[dict[Key, GuidanceRecord], dict[int, torch.Tensor]]:
    """``records`` and expert ``ids`` with every tensor contiguous (``.contiguous()`` each), sorted by key."""
    return ({k: GuidanceRecord(r.bits.contiguous(), r.block_scale.contiguous(), r.global_scale.contiguous(), r.shape)
             for k, r in sorted(records.items())}, {la: t.contiguous() for la, t in sorted(ids.items())})


def _runs(keys: list[Key], starts: list[int]) -> list[list[Key]]:
    """``keys`` (sorted) cut into maximal runs whose ``starts`` (increasing: the layout's sorted order) advance by one
    constant step."""
    out: list[list[Key]] = []
    for i, key in enumerate(keys):
        run = out[-1] if out else None
        if run is not None and (len(run) == 1 or starts[i] - starts[i - 1] == starts[i - 1] - starts[i - 2]):
            run.append(key)
        else:
            out.append([key])
    return out
