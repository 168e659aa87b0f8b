"""Host-side log of the rollout's routed experts, per request (the storage behind routing capture).

Layout: the rows of each step (one per computed token) go, contiguously, into a chunk of host memory (pinned when
they come from CUDA): ``experts`` int16 ``[capacity, L, top_k]`` (global expert ids of the ``L`` captured MoE layers)
and ``positions`` int64 ``[capacity]``. :meth:`RoutingLog.append_step` copies a step's rows there from the device
WITHOUT waiting (non-blocking copies on the forward's stream + a CUDA event; a blocking copy per step stalls a GPU
engine). Consecutive steps of the same batch (the same request ids and rows per request, the same weight version
and layers, one chunk) form a SEGMENT: its step ``i`` holds rows ``start + i * rows_per_step + query_start_loc[j]``
onward for request ``j``. A step that continues the open segment costs a comparison of two short lists and the two
copies, whatever the batch size; only a step that opens a segment (a request joined or left, a prefill, a new chunk
or weight version) adds ``(segment, j)`` to the index of each of its requests. Popping a request
(:meth:`RoutingLog.pop`) waits for the event of its latest segment only, then gathers its rows with one indexing per
chunk it touches: its cost does not grow with the number of other requests or steps held (verl pops each request
of a rollout separately; a scan of every step per pop made the total quadratic). Chunks of about
:data:`CHUNK_BYTES` are reused once all their rows were popped; beyond ``max_bytes`` the oldest chunk is dropped
(its requests lose those rows) with a warning. No container object per request and step (one tuple per request and
step made Python's cyclic GC run 10x as often).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch

from verl_quads.rollout.request_ids import RequestCapture, RequestIndex

logger = logging.getLogger(__name__)

#: the environment variable that bounds the log (MiB; read by the capture store)
ROUTING_MAX_MB_ENV = "VERL_QUADS_ROUTING_MAX_MB"
#: target size of one chunk (experts + positions); a chunk always holds at least one whole step
CHUNK_BYTES = 16 << 20


@dataclass
class _Chunk:
    experts: torch.Tensor  # int16 [capacity, L, top_k]
    positions: torch.Tensor  # int64 [capacity]
    layers: tuple[int, ...]
    pinned: bool  # kept, not asked per step: is_pinned() is a CUDA driver query
    used: int = 0  # rows written
    live: int = 0  # rows written and neither popped nor dropped
    steps: int = 0
    requests: set[str] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        return self.experts.numel() * self.experts.element_size() + self.positions.numel() * 8

    def fits(self, rows: int, layers: tuple[int, ...], top_k: int, pinned: bool) -> bool:
        return (self.layers == layers and self.experts.shape[2] == top_k and self.used + rows <= self.experts.shape[0]
                and self.pinned == pinned)


@dataclass(eq=False)
class _Segment:
    """Consecutive steps with the same requests and rows per request, written back to back into one chunk: step
    ``i``'s rows of request ``j`` are ``start + i * rows + qsl[j]`` up to ``... + qsl[j + 1]``."""

    cid: int
    start: int
    req_ids: list[str]
    qsl: list[int]  # query_start_loc of every step of the segment; rows = qsl[-1]
    version: int | None
    ready: "torch.cuda.Event | None"  # re-recorded after each step's copies (one event object per segment)
    steps: int = 1

    @property
    def rows(self) -> int:
        return self.qsl[-1]


@dataclass
class _Index:
    """One request's part of each segment it is in: parallel lists (segment, its position j in it), in step order."""

    segments: list[_Segment]
    slots: list[int]
    first_version: int | None
    versions: set
    layer_sets: set[tuple[int, ...]]


@dataclass
class RequestRouting(RequestCapture):
    """The rollout's routed experts of one request (every quantized mode).

    Attributes:
        request_id: vLLM's internal request id.
        positions: int64 ``[T]`` computed token positions, ascending, unique.
        experts: uint8 (int16 if any id >= 256) ``[T, L, top_k]``: global expert ids of each routing
            slot, in vLLM's slot order, for the decoder layers ``layers`` (ascending).
        layers: the decoder-layer indices of dimension 1 (MoE layers run by ``quads_nvfp4``).
        policy_version: the weight version of the request's first step (None if never set).
        mixed_versions: whether the request's steps span a weight sync.
    """

    experts: torch.Tensor
    layers: list[int]
    policy_version: int | None = None
    mixed_versions: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the expert ids (positions excluded: implied by the computed range)."""
        return self.experts.numel() * self.experts.element_size()

    def to_wire(self) -> dict:
        """Plain dict of str/int/bool/list/tensors (what verl's extra_fields and vLLM's RPC carry)."""
        return {"request_id": self.request_id, "positions": self.positions, "experts": self.experts,
                "layers": list(self.layers), "policy_version": self.policy_version,
                "mixed_versions": self.mixed_versions}

    @classmethod
    def from_wire(cls, d: dict) -> "RequestRouting":
        return cls(d["request_id"], d["positions"], d["experts"], [int(x) for x in d["layers"]], d["policy_version"],
                   bool(d.get("mixed_versions", False)))


class RoutingLog:
    """Per-request routed experts of the steps run so far, until popped (one per vLLM worker process; not
    thread-safe: the caller holds a lock)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.dropped_steps = 0
        self._chunks: dict[int, _Chunk] = {}  # id -> chunk, oldest first
        self._next_id = 0
        self._spare: _Chunk | None = None  # an emptied chunk kept for reuse
        self._by_req: RequestIndex[_Index] = RequestIndex()
        self._open: _Segment | None = None  # the segment the next step may continue

    @property
    def nbytes(self) -> int:
        """Host bytes held by chunks in use (the spare excluded)."""
        return sum(c.nbytes for c in self._chunks.values())

    @property
    def held_rows(self) -> int:
        """Rows written and neither popped nor dropped."""
        return sum(c.live for c in self._chunks.values())

    def request_ids(self) -> list[str]:
        return sorted(self._by_req)

    def clear(self) -> None:
        self._chunks.clear()
        self._spare = None
        self._by_req.clear()
        self._open = None

    # ------------------------------------------------------------------------------------------------ writing
    def append_step(self, req_ids: list[str], query_start_loc: list[int], positions: torch.Tensor,
                    experts: torch.Tensor, layers: tuple[int, ...], version: int | None) -> None:
        """Log one step: request ``req_ids[j]`` owns rows ``query_start_loc[j]:query_start_loc[j + 1]`` of
        ``positions`` (``[n]``, any integer dtype) and ``experts`` (int16 ``[n, len(layers), top_k]``), both on
        the same device. From CUDA the copies are not waited for here (see the module docstring): the tensors
        must stay unchanged in stream order until the copies ran: a freshly made tensor (a clone), or a persistent
        buffer that only later work on the current stream rewrites (the next step's forward)."""
        n = query_start_loc[-1]
        if experts.dtype != torch.int16 or experts.dim() != 3 or experts.shape[:2] != (n, len(layers)):
            raise ValueError(f"routing log: experts must be int16 [{n}, {len(layers)}, top_k], got "
                             f"{experts.dtype} {tuple(experts.shape)}")
        cuda = experts.is_cuda
        seg = self._open
        if seg is not None and seg.qsl == query_start_loc and seg.req_ids == req_ids and seg.version == version:
            ch = self._chunks[seg.cid]
            off = seg.start + seg.steps * n
            # fits: the chunk's layers, top_k, pinning and room
            if off == ch.used and ch.fits(n, layers, int(experts.shape[2]), cuda):  # continue the open segment
                self._write(ch, off, n, positions, experts, cuda)
                seg.steps += 1
                if cuda:
                    seg.ready.record()
                return
        cid, ch = self._chunk_for(n, layers, int(experts.shape[2]), cuda)
        off = ch.used
        self._write(ch, off, n, positions, experts, cuda)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        seg = self._open = _Segment(cid, off, list(req_ids), list(query_start_loc), version, ready)
        ch.requests.update(req_ids)
        for j, r in enumerate(req_ids):
            if query_start_loc[j + 1] <= query_start_loc[j]:
                continue
            ix = self._by_req.setdefault(r, lambda: _Index([], [], version, set(), set()))
            ix.segments.append(seg)
            ix.slots.append(j)
            ix.versions.add(version)
            ix.layer_sets.add(layers)

    @staticmethod
    def _write(ch: _Chunk, off: int, n: int, positions: torch.Tensor, experts: torch.Tensor, cuda: bool) -> None:
        ch.experts[off:off + n].copy_(experts, non_blocking=cuda)
        ch.positions[off:off + n].copy_(positions[:n], non_blocking=cuda)
        ch.used += n
        ch.live += n
        ch.steps += 1

    def _chunk_for(self, rows: int, layers: tuple[int, ...], top_k: int, pinned: bool) -> tuple[int, _Chunk]:
        if self._chunks:
            cid = next(reversed(self._chunks))
            if self._chunks[cid].fits(rows, layers, top_k, pinned):
                return cid, self._chunks[cid]
            if self._chunks[cid].live == 0:  # emptied while it was being filled
                self._retire(cid)
        row_bytes = len(layers) * top_k * 2 + 8
        capacity = max(rows, min(CHUNK_BYTES, self.max_bytes) // row_bytes)
        ch = self._spare
        self._spare = None
        if ch is None or not ch.fits(rows, layers, top_k, pinned):  # a spare is empty: fits = its shape and size
            ch = _Chunk(torch.empty((capacity, len(layers), top_k), dtype=torch.int16, pin_memory=pinned),
                        torch.empty(capacity, dtype=torch.int64, pin_memory=pinned), layers, pinned)
        while self._chunks and self.nbytes + ch.nbytes > self.max_bytes:
            self._drop_oldest()
        cid, self._next_id = self._next_id, self._next_id + 1
        self._chunks[cid] = ch
        return cid, ch

    def _close(self, cid: int | None = None) -> None:
        """The next step opens a new segment (only if the open one is in chunk ``cid``, when given)."""
        if self._open is not None and (cid is None or self._open.cid == cid):
            self._open = None

    def _retire(self, cid: int) -> None:
        """An emptied chunk becomes the spare (kept for reuse)."""
        self._close(cid)
        ch = self._chunks.pop(cid)
        ch.used, ch.live, ch.steps, ch.requests = 0, 0, 0, set()
        self._spare = ch

    def _drop_oldest(self) -> None:
        cid = next(iter(self._chunks))
        self._close(cid)
        ch = self._chunks.pop(cid)
        if self.dropped_steps == 0:
            logger.warning(
                "verl-quads routing capture: more than %s=%d MiB of routing records were never collected; dropping "
                "the oldest (requests in them lose their record). Outside verl set VERL_QUADS_ROUTING=0.",
                ROUTING_MAX_MB_ENV, self.max_bytes >> 20,
            )
        self.dropped_steps += ch.steps
        for r in ch.requests:
            ix = self._by_req.get(r)
            if ix is None:
                continue
            k = 0  # the oldest chunk's segments lead each of its requests' lists (chunk ids grow with steps)
            while k < len(ix.segments) and ix.segments[k].cid == cid:
                k += 1
            del ix.segments[:k], ix.slots[:k]
            if not ix.segments:
                self._forget(r)

    # ------------------------------------------------------------------------------------------------ reading
    def _forget(self, request_id: str) -> _Index:
        ix = self._by_req.pop(request_id)
        if ix.segments and ix.segments[-1] is self._open:  # rows it may still get go to a new segment (re-indexed)
            self._close()
        return ix

    def resolve(self, request_id: str) -> str | None:
        """The internal id held for ``request_id`` (itself, or the one whose external id it is), or None."""
        return self._by_req.resolve(request_id)

    def pop(self, request_ids: list[str] | None = None) -> dict[str, RequestRouting]:
        """Remove and return the routing of ``request_ids`` (internal or external ids; every request held if
        None), keyed by the id as given (internal ids for None); a request without rows is absent. Raises
        ``RuntimeError`` for a request whose steps hold different layer sets or whose rows hold an id < 0 (a
        captured layer did not write its buffer in that step)."""
        given = self.request_ids() if request_ids is None else list(dict.fromkeys(request_ids))
        internal = {g: self.resolve(g) for g in given}
        for r in set(internal.values()) - {None}:
            if len(self._by_req[r].layer_sets) > 1:
                raise RuntimeError(f"verl-quads routing capture: request {r!r} steps hold layers "
                                   f"{sorted(self._by_req[r].layer_sets)}")
        order = list(dict.fromkeys(v for v in internal.values() if v is not None))
        popped = dict(zip(order, self._gather(order, [self._forget(r) for r in order])))
        return {g: popped[r] for g, r in internal.items() if r is not None}

    def _gather(self, order: list[str], ixs: list[_Index]) -> list[RequestRouting]:
        """The records of requests ``order`` (their removed indexes ``ixs``): one row gather per chunk for all of
        them together, then per request a slice, the id check and narrowing; sorting by position only for a
        request whose rows are not already ascending (a position recomputed after preemption)."""
        if not order:
            return []
        latest = (ix.segments[-1] for ix in ixs)
        for ev in {id(seg.ready): seg.ready for seg in latest if seg.ready is not None}.values():
            ev.synchronize()  # each request's latest segment's copies; earlier ones were enqueued before them
        # per chunk, one entry per (request, segment): rows base + i * stride + k for steps i and k < length
        entries: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}  # base, steps, stride, length
        spans = []  # per request: [chunk id, first index into that chunk's gathered rows, row count] runs
        filled: dict[int, int] = {}  # chunk id -> rows claimed so far
        for ix in ixs:
            sp = []
            for seg, j in zip(ix.segments, ix.slots):
                base, steps, stride, length = entries.setdefault(seg.cid, ([], [], [], []))
                ln = seg.qsl[j + 1] - seg.qsl[j]
                base.append(seg.start + seg.qsl[j])
                steps.append(seg.steps)
                stride.append(seg.rows)
                length.append(ln)
                n = seg.steps * ln
                at = filled.get(seg.cid, 0)
                if sp and sp[-1][0] == seg.cid and sp[-1][1] + sp[-1][2] == at:
                    sp[-1][2] += n  # this request's previous entry in the same chunk: one run
                else:
                    sp.append([seg.cid, at, n])
                filled[seg.cid] = at + n
            spans.append(sp)
        newest = next(reversed(self._chunks))
        got = {}
        for cid, cols in entries.items():
            ch = self._chunks[cid]
            base, steps, stride, length = (torch.tensor(c, dtype=torch.int64) for c in cols)
            total = filled[cid]
            counts = steps * length
            # gathered row t of entry e (its local index u = t - rows before e): step i = u // length, k = u % length
            rep = functools.partial(torch.repeat_interleave, repeats=counts, output_size=total)
            u = torch.arange(total) - rep(torch.cumsum(counts, 0) - counts)
            ln = rep(length)
            i = torch.div(u, ln, rounding_mode="floor")
            idx = rep(base) + i * rep(stride) + (u - i * ln)
            got[cid] = (ch.positions[idx], ch.experts[idx])
            ch.live -= total
            if ch.live == 0 and cid != newest:  # emptied and not being filled: reuse
                self._retire(cid)
        out = []
        for r, ix, sp in zip(order, ixs, spans):
            parts = [(got[c][0][i:i + n], got[c][1][i:i + n]) for c, i, n in sp]
            positions = torch.cat([p for p, _ in parts]) if len(parts) > 1 else parts[0][0].clone()
            experts = torch.cat([e for _, e in parts]) if len(parts) > 1 else parts[0][1]
            layers = next(iter(ix.layer_sets))
            lo, hi = torch.aminmax(experts)
            if int(lo) < 0:
                raise RuntimeError(f"verl-quads routing capture: layers {list(layers)} did not all write expert ids "
                                   f"for some of request {r!r}'s {experts.shape[0]} rows")
            if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
                order_ = torch.argsort(positions, stable=True)  # rows in step order: the last of equal positions wins
                p = positions[order_]
                last = torch.ones_like(p, dtype=torch.bool)
                last[:-1] = p[1:] != p[:-1]
                keep = order_[last]
                positions, experts = positions[keep], experts[keep]
                hi = experts.max()  # the rows kept decide the width
            # a new tensor per request (a slice would pickle the whole batch's storage when shipped)
            experts = experts.to(torch.uint8) if int(hi) < 256 else experts.clone()
            out.append(RequestRouting(r, positions, experts, list(layers), ix.first_version, len(ix.versions) > 1))
        return out
