"""TRACE guidance capture inside a vLLM worker process.

What is kept: for each guided GEMM input (the last ``guided_layers`` decoder layers), per token,
the :class:`~verl_quads.nvfp4.GuidanceRecord` of its NVFP4 activation (per-token global scale, so
each token's record depends on that token alone): 1 bit per element + 1 E4M3 scale per 16 + one
float32 global scale. Keys: request id (vLLM's internal id as the worker sees it) + token position
+ decoder layer index + GEMM name (module path inside the layer: ``self_attn.qkv_proj``,
``self_attn.o_proj``, ``mlp.experts.w13``, ``mlp.experts.w2``, ``mlp.gate_up_proj``, ...).
For ``mlp.experts.w2`` the record of a token is ``[top_k, I]`` (one row per routed slot) and the
slot's expert ids are kept beside it.

How rows become (request, position): the GEMMs see a flat batch of token rows. A wrapper around
the model runner's ``_model_forward`` (installed only in ``trace`` mode) opens a *step* with the
batch's request ids, ``query_start_loc`` and ``positions`` before the forward and closes it after;
:meth:`GuidanceStore.add` stores the step's records; :meth:`GuidanceStore.pop` later gathers one
request's rows over all its steps (prefill + each decode step), sorted by position.
Forwards outside ``_model_forward`` (profiling/dummy runs) open no step and record nothing.

Limits (documented, not hidden): with prefix caching, cached prompt positions are never computed
and have no record (disable it for TRACE); the last sampled token is never fed through the model,
so it has none either; a request recomputed after preemption keeps the latest record per position.
Records are stamped with :attr:`GuidanceStore.policy_version` (set by the weight sync); a request
whose steps span two versions is refused at :meth:`pop`.

Retrieval from the driver: :func:`collect_guidance` (``llm.collective_rpc(fetch_guidance, ...)``
then :meth:`RequestGuidance.from_wire`; vLLM needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to
ship a function to workers in other processes; in-process engines need nothing) returns
``{request_id: RequestGuidance}``. The wire form (:meth:`RequestGuidance.to_wire`) is plain
tensors/ints/strings, so the weight-sync/trainer side can ship it further as is.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field

import torch

from verl_quads.nvfp4 import GuidanceRecord

logger = logging.getLogger("verl_quads")

Key = tuple[int, str]  # (decoder layer index, GEMM name)


def slice_record(rec: GuidanceRecord, rows: slice | torch.Tensor) -> GuidanceRecord:
    """Rows ``rows`` (along dim 0) of a record whose tensors have a leading token dimension."""
    bits, scale, gs = rec.bits[rows], rec.block_scale[rows], rec.global_scale[rows]
    return GuidanceRecord(bits, scale, gs, torch.Size((bits.shape[0], *rec.shape[1:])))


def cat_records(recs: list[GuidanceRecord]) -> GuidanceRecord:
    """Concatenate records along the leading (token) dimension."""
    bits = torch.cat([r.bits for r in recs])
    return GuidanceRecord(
        bits,
        torch.cat([r.block_scale for r in recs]),
        torch.cat([r.global_scale for r in recs]),
        torch.Size((bits.shape[0], *recs[0].shape[1:])),
    )


def external_request_id(internal_id: str) -> str:
    """The caller's request id of a vLLM 0.32 internal id ``<external>-<8 hex>`` (unchanged otherwise)."""
    head, sep, tail = internal_id.rpartition("-")
    if sep and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail):
        return head
    return internal_id


@dataclass
class RequestGuidance:
    """All captured guidance of one request.

    Attributes:
        request_id: vLLM's internal request id.
        positions: int64 ``[T]`` token positions, ascending, unique.
        records: ``{(layer, gemm): GuidanceRecord}``, each with leading dimension T aligned with
            ``positions`` (shape ``[T, K]``, or ``[T, top_k, I]`` for ``mlp.experts.w2``; global
            scales ``[T, 1]`` / ``[T, top_k, 1]``).
        expert_ids: ``{layer: int64 [T, top_k]}`` routed expert of each slot of ``mlp.experts.w2``.
        policy_version: the weight version the records were made with (None if never set).
    """

    request_id: str
    positions: torch.Tensor
    records: dict[Key, GuidanceRecord]
    expert_ids: dict[int, torch.Tensor] = field(default_factory=dict)
    policy_version: int | None = None

    @property
    def external_id(self) -> str:
        return external_request_id(self.request_id)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def nbytes(self) -> int:
        """Bytes of all records (bits + block scales + global scales; expert ids not counted)."""
        return sum(r.nbytes for r in self.records.values())

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / max(self.num_tokens, 1)

    def to_wire(self) -> dict:
        """Plain dict of str/int/list/uint8-int64-float32 tensors (what vLLM's RPC can carry).

        vLLM's msgpack RPC cannot carry dataclasses (a call returning one hangs), hence this form;
        float8 block scales travel as their uint8 bytes.
        """
        return {
            "request_id": self.request_id,
            "positions": self.positions,
            "policy_version": self.policy_version,
            "records": [
                {"layer": layer, "gemm": gemm, "bits": r.bits, "block_scale": r.block_scale.view(torch.uint8),
                 "global_scale": r.global_scale, "shape": list(r.shape)}
                for (layer, gemm), r in self.records.items()
            ],
            "expert_ids": [[layer, t] for layer, t in self.expert_ids.items()],
        }

    @classmethod
    def from_wire(cls, d: dict) -> "RequestGuidance":
        """Inverse of :meth:`to_wire`."""
        records = {
            (int(r["layer"]), r["gemm"]): GuidanceRecord(
                r["bits"], r["block_scale"].view(torch.float8_e4m3fn), r["global_scale"], torch.Size(r["shape"])
            )
            for r in d["records"]
        }
        experts = {int(layer): t for layer, t in d["expert_ids"]}
        return cls(d["request_id"], d["positions"], records, experts, d["policy_version"])

    def record(self, position: int, layer: int, gemm: str) -> GuidanceRecord:
        """The record of one token (leading dimension dropped)."""
        hit = (self.positions == position).nonzero()
        if hit.numel() == 0:
            raise KeyError(f"request {self.request_id!r}: no guidance for position {position}")
        i = int(hit[0, 0])
        r = self.records[(layer, gemm)]
        return GuidanceRecord(r.bits[i], r.block_scale[i], r.global_scale[i], torch.Size(r.shape[1:]))


@dataclass
class _Step:
    req_ids: list[str]
    query_start_loc: list[int]
    positions: torch.Tensor  # int64 [N] on CPU
    policy_version: int | None
    records: dict[Key, GuidanceRecord] = field(default_factory=dict)
    expert_ids: dict[int, torch.Tensor] = field(default_factory=dict)
    remaining: set[str] = field(default_factory=set)


class GuidanceStore:
    """Process-local store of captured guidance (one per vLLM worker process)."""

    def __init__(self) -> None:
        self.enabled = False
        self.policy_version: int | None = None
        self._lock = threading.Lock()
        self._steps: list[_Step] = []
        self._current: _Step | None = None

    # --- written by the runner wrapper and the quantized layers ---
    def begin_step(self, req_ids: list[str], query_start_loc: list[int], positions: torch.Tensor) -> None:
        n = query_start_loc[-1] if query_start_loc else 0
        if not self.enabled or n <= 0:
            self._current = None
            return
        # clone: the runner's positions buffer is persistent and rewritten by the next step
        pos = positions[:n].detach().to("cpu", torch.int64).clone()
        self._current = _Step(list(req_ids), list(query_start_loc), pos, self.policy_version, remaining=set(req_ids))

    def end_step(self) -> None:
        step, self._current = self._current, None
        if step is not None and step.records:
            with self._lock:
                self._steps.append(step)

    @property
    def in_step(self) -> bool:
        return self._current is not None

    def add(self, layer: int, gemm: str, record: GuidanceRecord, expert_ids: torch.Tensor | None = None) -> None:
        """Store a batch record (leading dim = batch rows, padding rows beyond the step dropped)."""
        step = self._current
        if step is None:
            return
        n = step.query_start_loc[-1]
        rec = slice_record(record, slice(0, n))
        rec = GuidanceRecord(rec.bits.cpu(), rec.block_scale.cpu(), rec.global_scale.cpu(), rec.shape)
        step.records[(layer, gemm)] = rec
        if expert_ids is not None:
            step.expert_ids[layer] = expert_ids[:n].detach().to("cpu", torch.int64).clone()

    # --- read by the driver (through collective_rpc) ---
    def request_ids(self) -> list[str]:
        with self._lock:
            return sorted({r for s in self._steps for r in s.remaining})

    def resolve(self, request_id: str) -> str | None:
        """The internal id stored for ``request_id``: itself, or the one whose external id it is.

        vLLM 0.32 appends ``-<8 hex>`` to the caller's (external) request id inside the engine.
        """
        ids = self.request_ids()
        if request_id in ids:
            return request_id
        hits = [i for i in ids if external_request_id(i) == request_id]
        if len(hits) > 1:
            raise KeyError(f"request id {request_id!r} matches several captured requests: {hits}")
        return hits[0] if hits else None

    def pop(self, request_id: str) -> RequestGuidance | None:
        """Remove and return one request's guidance (None if nothing was captured for it).

        ``request_id``: vLLM's internal id or the caller's external id (see :meth:`resolve`).
        """
        request_id = self.resolve(request_id) or request_id
        with self._lock:
            parts = []
            for s in self._steps:
                if request_id in s.remaining:
                    i = s.req_ids.index(request_id)
                    parts.append((s, slice(s.query_start_loc[i], s.query_start_loc[i + 1])))
                    s.remaining.discard(request_id)
            self._steps = [s for s in self._steps if s.remaining]
        if not parts:
            return None
        versions = {s.policy_version for s, _ in parts}
        if len(versions) > 1:
            raise ValueError(
                f"request {request_id!r}: guidance spans policy versions {sorted(versions, key=str)}; "
                "refusing to mix records made with different weights"
            )
        positions = torch.cat([s.positions[sl] for s, sl in parts])
        # keep the latest record per position (recomputation after preemption), sorted
        order = torch.arange(positions.numel())
        last = {}
        for j, p in zip(order.tolist(), positions.tolist()):
            last[p] = j
        keep = torch.tensor([last[p] for p in sorted(last)], dtype=torch.int64)
        keys = set.intersection(*(set(s.records) for s, _ in parts))
        records = {k: slice_record(cat_records([slice_record(s.records[k], sl) for s, sl in parts]), keep) for k in keys}
        layers = set.intersection(*(set(s.expert_ids) for s, _ in parts))
        experts = {l: torch.cat([s.expert_ids[l][sl] for s, sl in parts])[keep] for l in layers}
        return RequestGuidance(request_id, positions[keep], records, experts, versions.pop())

    def clear(self) -> None:
        with self._lock:
            self._steps.clear()
        self._current = None


_STORE = GuidanceStore()


def get_store() -> GuidanceStore:
    """The store of this process."""
    return _STORE


def fetch_guidance(worker, request_ids: list[str] | None = None) -> dict[str, dict]:
    """``collective_rpc`` target: pop the given requests' guidance (all if None) from the worker's store.

    Returns ``{id as asked (internal id when request_ids is None): RequestGuidance.to_wire()}``.
    """
    store = get_store()
    ids = store.request_ids() if request_ids is None else request_ids
    out = {}
    for rid in ids:
        g = store.pop(rid)
        if g is not None:
            out[rid] = g.to_wire()
    return out


def collect_guidance(llm, request_ids: list[str] | None = None) -> dict[str, RequestGuidance]:
    """Driver side: fetch and decode guidance from every worker of a ``vllm.LLM`` (merged; TP ranks
    hold identical records of replicated activations, the first one is kept)."""
    merged: dict[str, RequestGuidance] = {}
    for per_worker in llm.collective_rpc(fetch_guidance, args=(request_ids,)):
        for rid, wire in per_worker.items():
            merged.setdefault(rid, RequestGuidance.from_wire(wire))
    return merged


_HOOK_LOCK = threading.Lock()


def install_runner_hook() -> None:
    """Wrap vLLM's ``GPUModelRunner._model_forward`` (CPU runner inherits it) to open/close steps.

    Idempotent. Raises ``RuntimeError`` if this vLLM has no such method (TRACE cannot key records
    by request there; no silent capture without keys).
    """
    from vllm.v1.worker import gpu_model_runner as gmr

    cls = gmr.GPUModelRunner
    with _HOOK_LOCK:
        orig = getattr(cls, "_model_forward", None)
        if orig is None:
            raise RuntimeError(
                "quads_nvfp4 trace mode: this vLLM's GPUModelRunner has no _model_forward; guidance "
                "capture cannot map rows to requests (supported: vLLM 0.24-0.32)"
            )
        if getattr(orig, "_verl_quads_wrapped", False):
            return

        @functools.wraps(orig)
        def _model_forward(self, *args, **kwargs):
            store = get_store()
            if not store.enabled:
                return orig(self, *args, **kwargs)
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            num_reqs = self.input_batch.num_reqs
            if positions is None or num_reqs == 0 or positions.dim() != 1:
                store.begin_step([], [], torch.empty(0))
            else:
                req_ids = list(self.input_batch.req_ids[:num_reqs])
                qsl = [int(v) for v in self.query_start_loc.cpu[: num_reqs + 1].tolist()]
                store.begin_step(req_ids, qsl, positions)
            try:
                return orig(self, *args, **kwargs)
            finally:
                store.end_step()

        _model_forward._verl_quads_wrapped = True  # type: ignore[attr-defined]
        cls._model_forward = _model_forward
        logger.info("verl-quads: TRACE guidance capture hooked into GPUModelRunner._model_forward")
    # under verl: the RPC its vLLM server calls to return each request's record (patches/verl_rollout_guidance.py)
    from verl_quads.patches.verl_rollout_guidance import install_worker_rpc

    install_worker_rpc()


__all__ = [
    "GuidanceStore",
    "RequestGuidance",
    "get_store",
    "fetch_guidance",
    "collect_guidance",
    "install_runner_hook",
    "external_request_id",
    "slice_record",
    "cat_records",
]
