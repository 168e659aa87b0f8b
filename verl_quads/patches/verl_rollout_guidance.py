"""Patch: verl's vLLM server returns each request's TRACE guidance record with its tokens.

Upstream (verl 0.9.1): ``verl/workers/rollout/vllm_rollout/vllm_async_server.py``
``vLLMHttpServer.generate(prompt_ids, sampling_params, request_id, ...)`` runs one request on the
server's ``AsyncLLM`` and returns a ``TokenOutput`` (token ids, rollout log-probs, optional routed
experts, ``extra_fields``). The agent loop copies ``extra_fields`` into its ``AgentLoopOutput``, and
``AgentLoopWorker._postprocess`` turns every ``extra_fields`` key into a per-sample object column of
the batch's ``non_tensor_batch``, which ``DataProto.to_tensordict`` carries (as a per-row list) into
the actor's ``compute_log_prob`` / ``update_actor`` micro-batches. verl has no hook to add data
computed *inside* the vLLM workers to a request's output.

Change (routing, every ``quads_nvfp4`` mode): after the original ``generate`` returns, one worker RPC (shared
by the requests that finish together: :class:`RecordFetcher`) pops the request's routing record
(``verl_quads.rollout.capture.RequestRouting``: uint8 expert ids ``[T, layers, top_k]`` + positions,
``layers * top_k`` B per computed token) and the wrapper stores its wire form under ``extra_fields["quads_routing"]``
(:data:`ROUTING_FIELD`); the QAT engine compares it with its own routers in the log-prob pass
(``quads/routing_disagreement``). Workers started with ``VERL_QUADS_ROUTING=0`` report routing capture off and
nothing is attached; a worker with capture on but no record for a completed request raises.

Change (TRACE): when the server's engine is a ``quads_nvfp4`` engine in ``trace`` mode, after the original
``generate`` returns, the wrapper pops the request's guidance from the worker's capture store
(``collective_rpc`` of the method :data:`WORKER_METHOD` that :func:`install_worker_rpc` adds to
verl's worker extension class ``vLLMColocateWorkerExtension`` inside the vLLM worker process; a
method name, so no pickled function and no ``VLLM_ALLOW_INSECURE_SERIALIZATION``) and stores its
wire form (``RequestGuidance.to_wire``: one uint8 CPU tensor of the request's token rows, each holding every
guided GEMM's bit-packed bits, E4M3 block-scale bytes, float32 global scales and expert ids, plus the row layout;
:func:`compact_wire`) under ``extra_fields["quads_guidance"]``. It therefore becomes
``non_tensor_batch["quads_guidance"]`` (one dict per generated sequence, host memory), keyed by the
request id and stamped with the policy version. Engines not running ``quads_nvfp4``: unchanged (no RPC).
A trace engine that has no record for a completed request raises (never a silent fallback); an
aborted request (empty output) carries none, and the trainer refuses such a row.

Applied by :func:`apply` in every process that imports verl's server module (the ``verl.plugins``
entry point registers a post-import hook); :func:`install_worker_rpc` is called by the capture hook
(``verl_quads.rollout.capture.install_runner_hook``) in the vLLM worker process, trace mode only.
Test: ``tests/unit/test_patches_guidance.py``.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from verl_quads.patches._guard import install_method_patch, require_version

logger = logging.getLogger("verl_quads")

PATCH = "verl_rollout_guidance"
SUPPORTED_VERL = ("0.9.1",)
SERVER_MODULE = "verl.workers.rollout.vllm_rollout.vllm_async_server"
SERVER_CLASS = "vLLMHttpServer"
SERVER_METHOD = "generate"
WORKER_MODULE = "verl.workers.rollout.vllm_rollout.utils"
WORKER_CLASS = "vLLMColocateWorkerExtension"
WORKER_METHOD = "verl_quads_fetch_guidance"
#: The non-tensor batch column (and TokenOutput.extra_fields key) that carries the records.
FIELD = "quads_guidance"
#: The non-tensor batch column (and TokenOutput.extra_fields key) that carries the routing records.
ROUTING_FIELD = "quads_routing"


def compact_wire(wire: dict) -> dict:
    """The records form of a wire with expert ids as int16 (a hand-built records form may hold int64 ids; ids <
    32768 always hold: the MoE layer refuses TRACE beyond that); everything else is already compact (1 bit/element,
    1 byte/16). The rows form
    (``RequestGuidance.to_wire`` of a popped request: one uint8 tensor ``[T, row bytes]``) is returned as is: its
    expert ids are int16 inside the rows already."""
    if "rows" in wire:
        return wire
    out = dict(wire)
    ids = []
    for layer, t in wire["expert_ids"]:
        if t.numel() and int(t.max()) >= 2**15:
            raise ValueError(f"verl-quads: expert id {int(t.max())} does not fit int16")
        ids.append([layer, t.to(torch.int16)])
    out["expert_ids"] = ids
    return out


def wire_nbytes(wire: dict) -> int:
    """Bytes a wire record holds in tensors (positions excluded: they are implied, ``0..T-1``): the rows form's
    rows (records, int16 expert ids and the 8-byte alignment padding of each section), the records form's bits +
    block scales + global scales + expert ids."""
    if "rows" in wire:
        return int(wire["rows"].numel())
    n = 0
    for r in wire["records"]:
        n += r["bits"].numel() + r["block_scale"].numel() + 4 * r["global_scale"].numel()
    for _, t in wire["expert_ids"]:
        n += t.numel() * t.element_size()
    return n


def wire_num_tokens(wire: dict) -> int:
    return int(wire["positions"].numel())


# ----------------------------------------------------------------------------- RPC transport
# vLLM's engine-core RPC (msgpack) returns a utility result *untyped* unless
# VLLM_ALLOW_INSECURE_SERIALIZATION is set: a tensor inside a returned dict then arrives as its raw
# encoding (``[dtype, shape, data-or-buffer-index]``), not as a tensor. So the worker method returns
# msgpack-native values only: each tensor becomes ``{TENSOR_KEY: dtype, "shape": [...], "data": bytes}``.
TENSOR_KEY = "__verl_quads_tensor__"


def to_plain(obj):
    """Tensors (anywhere in nested dicts/lists) -> msgpack-native dicts of dtype, shape and raw bytes (a tensor made
    by :func:`~verl_quads.rollout.wire_bytes.bytes_backed`, e.g. a popped request's TRACE rows: its own
    ``bytearray``, not a copy)."""
    if isinstance(obj, torch.Tensor):
        from verl_quads.rollout.wire_bytes import backing_bytes

        data = backing_bytes(obj)
        if data is not None:
            return {TENSOR_KEY: "uint8", "shape": list(obj.shape), "data": data}
        t = obj.detach().to("cpu").contiguous()
        return {TENSOR_KEY: str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "data": t.reshape(-1).view(torch.uint8).numpy().tobytes()}
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def from_plain(obj):
    """Inverse of :func:`to_plain`."""
    if isinstance(obj, dict):
        if TENSOR_KEY in obj:
            dtype, shape, data = getattr(torch, obj[TENSOR_KEY]), obj["shape"], obj["data"]
            if not isinstance(dtype, torch.dtype) or not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"verl-quads TRACE: malformed tensor in a guidance RPC reply: {obj[TENSOR_KEY]!r}")
            if len(data) == 0:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [from_plain(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------- worker side
def _fetch(self, request_ids: list[str]) -> dict:
    """Worker RPC: ``{"enabled": bool, "records": {request id: wire}, "routing_enabled": bool,
    "routing": {request id: routing wire}}`` (popped from the store), in the msgpack-native form of
    :func:`to_plain`."""
    from verl_quads.rollout.capture import fetch_guidance, fetch_routing, get_store

    store = get_store()
    # into_bytes: the rows' own bytearray is the reply's payload (to_plain), not a copy of them
    records = fetch_guidance(self, list(request_ids), into_bytes=True) if store.enabled else {}
    routing = fetch_routing(self, list(request_ids)) if store.routing else {}
    return {"enabled": store.enabled, "records": to_plain(records), "routing_enabled": store.routing,
            "routing": to_plain(routing)}


def install_worker_rpc() -> bool:
    """Add :data:`WORKER_METHOD` to verl's vLLM worker extension (vLLM worker process). Returns
    whether verl is installed (without verl there is nothing to call it)."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("verl") is None:
        return False
    require_version(PATCH, ("verl",), SUPPORTED_VERL)
    cls = getattr(importlib.import_module(WORKER_MODULE), WORKER_CLASS)
    if getattr(cls, WORKER_METHOD, None) is not _fetch:
        setattr(cls, WORKER_METHOD, _fetch)
    return True


# ----------------------------------------------------------------------------- server side
def engine_quads_mode(server) -> str | None:
    """The ``quads_nvfp4`` rollout mode of the server's vLLM engine (front-end config), None if the
    engine does not run ``quads_nvfp4``."""
    from verl_quads.sync.receiver import engine_quant_config

    vllm_config = getattr(getattr(server, "engine", None), "vllm_config", None)
    qc = engine_quant_config(vllm_config) if vllm_config is not None else None
    return getattr(qc, "mode", None) if qc is not None else None


def engine_is_trace(server) -> bool:
    """Whether the server's vLLM engine runs ``quads_nvfp4`` in trace mode (front-end config)."""
    return engine_quads_mode(server) == "trace"


def _attach_routing(reply: dict, request_id: str, out) -> None:
    if not reply.get("routing_enabled") or not out.token_ids:  # capture off, or aborted request
        return
    wire = reply.get("routing", {}).get(request_id)
    if wire is None:
        raise RuntimeError(
            f"verl-quads routing: no routing record captured for request {request_id!r} ({len(out.token_ids)} "
            "generated tokens) although the vLLM workers capture routing; set VERL_QUADS_ROUTING=0 to run "
            "without quads/routing_disagreement"
        )
    out.extra_fields[ROUTING_FIELD] = from_plain(wire)


class RecordFetcher:
    """Pops finished requests' records from the vLLM workers, many requests per worker RPC.

    verl runs each request as its own ``generate`` coroutine, and a rollout's requests finish close together;
    each RPC is a utility call that the engine core serves between two steps (the batch waits meanwhile). So
    the first finished request's RPC goes out at once (no added latency), and the requests that finish while
    an RPC is in flight wait for it and go together in the next one (one pop of all of them in the worker).
    An RPC that raises fails every request of its batch (the exception is re-raised in each); a request whose
    ``generate`` is cancelled while it waits still has its record popped (and dropped) with its batch.
    Counters for tests and benchmarks: ``rpcs`` (RPCs sent) and ``requests`` (request ids fetched)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._waiting: dict[str, asyncio.Future] = {}
        self._task: asyncio.Task | None = None
        self.rpcs = 0
        self.requests = 0

    async def fetch(self, request_id: str) -> dict:
        """The worker reply for ``request_id`` alone: ``{"enabled", "records": {request_id: wire} or {},
        "routing_enabled", "routing": {...}}`` (plain form, :func:`from_plain` not applied)."""
        if request_id in self._waiting:
            raise RuntimeError(f"verl-quads: records of request {request_id!r} asked for twice at once")
        fut = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = fut
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, {}
                self.rpcs += 1
                self.requests += len(batch)
                try:
                    results = await self.engine.collective_rpc(WORKER_METHOD, args=(list(batch),))
                except BaseException as e:  # noqa: BLE001 -- handed to every waiting request, then re-raised there
                    for fut in batch.values():
                        if fut.done():
                            continue
                        if isinstance(e, asyncio.CancelledError):
                            fut.cancel()
                        else:
                            fut.set_exception(e)
                    if not isinstance(e, Exception):
                        raise
                    continue
                reply = results[0] if results else {}  # TP ranks hold identical records: first one
                for rid, fut in batch.items():
                    if not fut.done():
                        fut.set_result(_reply_for(reply, rid))
        finally:  # cancelled (the loop shutting down): requests queued meanwhile must not wait forever
            self._task = None
            for fut in self._waiting.values():
                fut.cancel()
            self._waiting = {}


def _reply_for(reply: dict, request_id: str) -> dict:
    one = {k: v for k, v in reply.items() if k not in ("records", "routing")}
    for key in ("records", "routing"):
        if key in reply:
            rec = reply[key].get(request_id)
            one[key] = {} if rec is None else {request_id: rec}
    return one


def record_fetcher(server) -> RecordFetcher:
    """The server's :class:`RecordFetcher` (one per server and engine, made on first use)."""
    f = server.__dict__.get("_verl_quads_fetcher")
    if f is None or f.engine is not server.engine:
        f = server.__dict__["_verl_quads_fetcher"] = RecordFetcher(server.engine)
    return f


async def attach_records(server, request_id: str, out, trace: bool) -> None:
    """Pop ``request_id``'s routing record (any quads_nvfp4 mode, if the workers capture it) and, if ``trace``,
    its guidance record, into ``out.extra_fields`` (through the server's :class:`RecordFetcher`: one worker RPC
    for the requests that finish together)."""
    reply = await record_fetcher(server).fetch(request_id)
    _attach_routing(reply, request_id, out)
    if not trace:
        return
    if not reply.get("enabled"):
        raise RuntimeError(
            f"verl-quads TRACE: the vLLM workers of {type(server).__name__} report guidance capture disabled "
            "although the engine is in quads_nvfp4 trace mode"
        )
    wire = reply["records"].get(request_id)
    wire = from_plain(wire) if wire is not None else None
    if not out.token_ids:  # aborted: nothing generated, no record to keep
        return
    if wire is None:
        raise RuntimeError(
            f"verl-quads TRACE: no guidance record captured for request {request_id!r} "
            f"({len(out.token_ids)} generated tokens); refusing to return a sequence the trainer cannot guide"
        )
    out.extra_fields[FIELD] = compact_wire(wire)


async def attach_guidance(server, request_id: str, out) -> None:
    """TRACE engine: pop ``request_id``'s records (guidance, and routing if captured) into ``out.extra_fields``."""
    await attach_records(server, request_id, out, trace=True)


def _make_generate(current):
    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        out = await current(self, prompt_ids, sampling_params, request_id, *args, **kwargs)
        if "_verl_quads_mode" not in self.__dict__:
            self.__dict__["_verl_quads_mode"] = engine_quads_mode(self)
        mode = self.__dict__["_verl_quads_mode"]
        if mode is not None:
            await attach_records(self, request_id, out, trace=mode == "trace")
        return out

    return generate


def apply(module=None) -> None:
    """Wrap ``vLLMHttpServer.generate`` (idempotent). ``module``: the imported server module."""
    require_version(PATCH, ("verl",), SUPPORTED_VERL)
    import importlib

    module = module or importlib.import_module(SERVER_MODULE)
    install_method_patch(getattr(module, SERVER_CLASS), SERVER_METHOD, PATCH, _make_generate)


def register() -> None:
    """Apply once verl's server module is imported (``verl.plugins`` entry point)."""
    from verl_quads.patches._post_import import when_imported

    when_imported(SERVER_MODULE, apply)


__all__ = ["FIELD", "ROUTING_FIELD", "WORKER_METHOD", "attach_records", "engine_quads_mode", "apply", "register", "install_worker_rpc", "compact_wire", "wire_nbytes",
           "wire_num_tokens", "engine_is_trace"]
