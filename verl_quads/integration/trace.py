"""TRACE in verl's actor passes: the rollout's guidance records -> one TraceBatch per micro-batch.

Data path (verl 0.9.1): the vLLM server returns each sequence's record (``patches/
verl_rollout_guidance.py``) -> ``non_tensor_batch["quads_guidance"]`` (one wire dict per sequence:
``RequestGuidance.to_wire``, normally ONE uint8 CPU tensor of the sequence's token rows with every guided GEMM's
record side by side plus the row layout; the per-record form (bits uint8 ``[T, K/8]``, block scales uint8 (E4M3
bytes) ``[T, K/16]``, global scales float32 ``[T, 1]`` (w2: ``[T, top_k, ...]``), expert ids int16 ``[T, top_k]``)
only for a request whose record buffer was laid out again mid-request; ``policy_version``, ``request_id``) ->
``DataProto.to_tensordict`` keeps it as a per-row list, which verl's ``prepare_micro_batches`` splits (and reorders)
together with the rows.

Per micro-batch (:class:`TraceSession.begin_micro_batch`, called from the QAT engine's
``prepare_model_inputs``): the micro-batch's records only are decoded and moved to the model's
device (one asynchronous copy for all of them), keyed ``f"{uid}/{request_id}"`` (verl's ``uid`` is per prompt; the request id makes it per
sequence), and a :class:`~verl_quads.qat.guidance.TraceBatch` describing the model input's token
rows is activated on the model:

- ``use_remove_padding=False``: input ``[B, S]`` right-padded from the nested rows; the row map
  comes from the attention mask (valid tokens = positions ``0..n-1``).
- ``use_remove_padding=True``: input ``[1, sum(n_i) + pad]``; the row map from the nested offsets,
  trailing (static) pad rows are padding. Ulysses SP > 1 is refused.

The trainer's policy version is the engine's sync counter (the version stamped on the records by
the weight sync). A record of another version, a row without a record, or a record that does not
cover the row's positions ``0..n-2`` raises :class:`~verl_quads.qat.guidance.GuidanceError`. The
records are dropped when the pass ends (the session is closed by ``forward_backward_batch``). The
checks that read device data (the trainer's routing equals the rollout's; the weights are finite) do
not sync inside the forward: they are deferred and raised once per micro-batch (at the next
micro-batch's start, and at the end of the pass, before any optimizer step).

Several PPO mini-batches per step (``ppo_mini_batch_size`` < train batch): verl runs one update pass
per mini-batch on the same rollout batch, with no weight sync in between, so every pass of the step
sees the same engine sync counter and is guided by the records of the rollout's policy version. This
is by design: the importance ratio's denominator (the old log-probs of the log-prob pass, run before
any update) is the rollout policy, which the guided forward reproduces exactly at that version; the
update passes evaluate the current weights under the rollout's rounding decisions and scales, which
at the first mini-batch equals that same forward (ratio 1), and afterwards follows the rollout's
choice wherever the trainer's scaled value still lies between two codewords. Where the moved weights
put a scaled value on a codeword (incl. the clamp at +-6), no choice exists and the code's low bit
can differ from the record (counted as ``bit_mismatch_forced`` by the audit below; measured 0.2-0.4%
of elements in the 2nd mini-batch of tests/integration/test_trace_grpo.py). A sync between passes of
one step (a rollout of another version) makes the versions differ and raises GuidanceError.

Test instrument (``VERL_QUADS_TRACE_DUMP_DIR``, tests only): every guided QDQ also re-derives the
trainer's guidance from its guided codes and counts elements whose low code bit, block scale or
global scale differs from the record it was given; low-bit mismatches are split into ``forced``
elements (the scaled value is a codeword: both bits give the same code) and ``free`` ones (a real
failure to follow the record); one JSON per pass is written to the directory.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from verl_quads.qat.guidance import GuidanceError, RolloutGuidanceProvider, TraceBatch

logger = logging.getLogger("verl_quads")

FIELD = "quads_guidance"
DUMP_ENV = "VERL_QUADS_TRACE_DUMP_DIR"
METRIC_BPT = "quads/guidance_bytes_per_token"


def _rows(td, key: str) -> list:
    from verl.utils import tensordict_utils as tu

    if key not in td.keys():
        return []
    return list(tu.get(td, key))


def _wires_to_device(wires: list[dict], device) -> list[dict]:
    """The wire records with every record tensor (rows form: the rows; records form: bits, block/global scales,
    expert ids) on ``device``; ``positions`` stay on the host (they are checked there).

    To a CUDA device all tensors of the micro-batch travel in ONE asynchronous copy: their bytes are
    concatenated (16-byte aligned) into one pinned host buffer, copied with ``non_blocking=True``, and
    each tensor becomes a typed view of the device buffer. A per-tensor ``.to(device)`` would be one
    blocking copy (a full stream synchronisation) per tensor: thousands per micro-batch."""
    device = torch.device(device)
    tensors: list[torch.Tensor] = []
    for w in wires:
        if "rows" in w:  # rows form (RequestGuidance.to_wire): one tensor
            tensors.append(w["rows"])
            continue
        for r in w["records"]:
            tensors += [r["bits"], r["block_scale"], r["global_scale"]]
        tensors += [t for _, t in w["expert_ids"]]
    if device.type != "cuda" or not tensors or all(t.device == device for t in tensors):
        moved = [t.to(device) for t in tensors]
    else:
        moved = _one_copy(tensors, device, pin=True)
    it = iter(moved)
    out = []
    for w in wires:
        d = dict(w)
        if "rows" in w:
            d["rows"] = next(it)
            out.append(d)
            continue
        d["records"] = [{**r, "bits": next(it), "block_scale": next(it), "global_scale": next(it)} for r in w["records"]]
        d["expert_ids"] = [[layer, next(it)] for layer, _ in w["expert_ids"]]
        out.append(d)
    return out


def _one_copy(tensors: list[torch.Tensor], device: torch.device, pin: bool) -> list[torch.Tensor]:
    """``tensors`` (host) on ``device`` through one byte buffer: each tensor's bytes at a 16-byte aligned
    offset of one (pinned if ``pin``) host buffer, ONE ``non_blocking`` copy, then a view per tensor of
    the device buffer (same dtype, shape and values; contiguous)."""
    chunks, views, off = [], [], 0
    for t in tensors:
        b = t.detach().contiguous().reshape(-1).cpu().view(torch.uint8)
        pad = -b.numel() % 16
        chunks.append(b)
        if pad:
            chunks.append(torch.zeros(pad, dtype=torch.uint8))
        views.append((off, b.numel(), t.dtype, t.shape))
        off += b.numel() + pad
    host = torch.empty(off, dtype=torch.uint8, pin_memory=pin)
    torch.cat(chunks, out=host)
    dev = host.to(device, non_blocking=pin)
    return [dev[o:o + n].view(dt).view(shape) for o, n, dt, shape in views]


def _guidance_rows(td, field: str = FIELD) -> list:
    """Each row's record. verl's agent loop carries ``TokenOutput.extra_fields`` in one of two ways:
    the DataProto path (``AgentLoopWorker._postprocess``) makes each key a column (``td[field]``);
    the v1 trainer's TransferQueue path (``AgentLoopWorkerTQ``) stores the whole dict per row as the
    ``extra_fields`` column. A row whose dict lacks the key yields None (an error in the caller)."""
    if field in td.keys():
        return _rows(td, field)
    if "extra_fields" in td.keys():
        return [r.get(field) if isinstance(r, dict) else None for r in _rows(td, "extra_fields")]
    return []


def batch_guidance(td) -> tuple[list[str], list[dict]]:
    """``(sequence keys, wire records)`` of every row of a verl TensorDict; raises if any is missing."""
    wires = _guidance_rows(td)
    uids = _rows(td, "uid")
    n = td.batch_size[0]
    if len(wires) != n:
        raise GuidenceMissing(n, len(wires))
    keys = []
    for i, w in enumerate(wires):
        if not isinstance(w, dict):
            raise GuidanceError(
                f"TRACE: row {i} (uid {uids[i] if i < len(uids) else '?'}) has no rollout guidance record "
                f"({type(w).__name__}); was the sequence aborted or generated by a non-trace engine?"
            )
        uid = uids[i] if i < len(uids) else f"row{i}"
        keys.append(f"{uid}/{w['request_id']}")
    return keys, wires


class GuidenceMissing(GuidanceError):
    def __init__(self, rows: int, got: int):
        super().__init__(
            f"TRACE: the batch has {rows} rows but {got} carry a '{FIELD}' record; the rollout must run "
            "vLLM quads_nvfp4 in trace mode (actor.quant=trace) through verl's vLLM server"
        )


def guidance_bytes(wires: list[dict]) -> tuple[int, int]:
    """(bytes, tokens) of a list of wire records (bits + scales + expert ids; positions excluded)."""
    from verl_quads.patches.verl_rollout_guidance import wire_nbytes, wire_num_tokens

    return sum(wire_nbytes(w) for w in wires), sum(wire_num_tokens(w) for w in wires)


class TraceSession:
    """One actor pass (log-prob or update) of a TRACE-mode QAT engine."""

    def __init__(self, engine, state, data, forward_only: bool):
        self.engine = engine
        self.state = state
        self.forward_only = forward_only
        self.version = getattr(engine, "_verl_quads_policy_version", None)
        if self.version is None:
            raise GuidanceError(
                "TRACE: the actor has no policy version (no weight sync to the rollout happened yet); "
                "guidance records cannot be matched to weights"
            )
        _, wires = batch_guidance(data)
        self.nbytes, self.ntokens = guidance_bytes(wires)
        self.nresp = int(data["response_mask"].values().sum()) if "response_mask" in data.keys() and data["response_mask"].is_nested else None
        self.audit = _Audit() if os.environ.get(DUMP_ENV) else None
        self.replay_disagree = 0
        self.replay_tokens = 0
        self.micro_batches = 0
        self.t0 = time.perf_counter()

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / max(self.ntokens, 1)

    def begin_micro_batch(self, micro_batch, model_inputs: dict, output_args: dict) -> None:
        from verl.utils import tensordict_utils as tu

        if getattr(self.engine, "use_ulysses_sp", False):
            raise NotImplementedError("verl-quads TRACE with Ulysses sequence parallelism is not supported")
        keys, wires = batch_guidance(micro_batch)
        input_ids = model_inputs["input_ids"]
        device = input_ids.device
        from verl_quads.rollout.capture import RequestGuidance

        caps = {k: RequestGuidance.from_wire(w) for k, w in zip(keys, _wires_to_device(wires, device))}
        provider = RolloutGuidanceProvider(caps)
        if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            seq_lens = micro_batch["input_ids"].offsets().diff().tolist()
            tb = TraceBatch.packed(provider, self.version, keys, seq_lens, total_rows=input_ids.shape[-1])
        else:
            mask = model_inputs["attention_mask"]
            if mask is None or mask.dim() != 2:
                raise GuidanceError(f"TRACE: padded micro-batch without a 2-D attention mask ({type(mask)})")
            tb = TraceBatch.padded(provider, self.version, keys, mask.cpu())
        prev = self.state.trace
        if prev is not None:  # the previous micro-batch's forward+backward is done: its deferred checks
            prev.verify()
        self.state.trace = tb  # replaced by the next micro-batch; cleared by close()
        self.micro_batches += 1

    def close(self, verify: bool = True) -> None:
        """End the pass; with ``verify``, raise what the last micro-batch's deferred checks found
        (routing != rollout's: :class:`GuidanceError`; NaN/Inf weights: ``ValueError``)."""
        tb, self.state.trace = self.state.trace, None
        if verify:
            if tb is not None:
                tb.verify()
            self.state.verify()

    def metrics(self) -> dict[str, float]:
        m = {METRIC_BPT: self.bytes_per_token, "quads/guidance_batch_bytes": float(self.nbytes),
             "quads/router_replay_disagree_frac": self.replay_disagree / max(self.replay_tokens, 1)}
        if self.nresp:
            m["quads/guidance_bytes_per_response_token"] = self.nbytes / self.nresp
        return m

    def log(self) -> None:
        kind = "log-prob" if self.forward_only else "update"
        logger.warning(
            "verl-quads TRACE %s pass (policy version %s): guidance %d B for %d tokens = %.1f B/token%s; "
            "%d micro-batches; router replay changed %d of %d token-layer routings; %.2fs",
            kind, self.version, self.nbytes, self.ntokens, self.bytes_per_token,
            f", {self.nbytes / self.nresp:.1f} B per response token" if self.nresp else "",
            self.micro_batches, self.replay_disagree, self.replay_tokens, time.perf_counter() - self.t0,
        )

    def dump(self) -> None:
        d = os.environ.get(DUMP_ENV)
        if not d:
            return
        Path(d).mkdir(parents=True, exist_ok=True)
        rec = {"pass": "log_prob" if self.forward_only else "update", "pid": os.getpid(), "policy_version": self.version,
               "bytes": self.nbytes, "tokens": self.ntokens, "response_tokens": self.nresp,
               "micro_batches": self.micro_batches, "replay_disagree": self.replay_disagree,
               "replay_tokens": self.replay_tokens, "source": str(Path(__file__).resolve().parents[1]),
               **(self.audit.as_dict() if self.audit else {})}
        path = Path(d) / f"trace_{os.getpid()}_{time.time_ns()}.json"
        path.write_text(json.dumps(rec))


class _Audit:
    """Counts of the guided-QDQ self-check (see the module docstring)."""

    def __init__(self) -> None:
        self.calls = self.elements = self.bit_mismatch = self.block_scale_mismatch = 0
        self.global_scale_mismatch = self.rounding_changed = 0
        self.forced = self.bit_mismatch_forced = self.bit_mismatch_free = 0

    def check(self, x: torch.Tensor, record) -> None:
        from verl_quads.nvfp4 import extract_guidance, quantize_guided
        from verl_quads.nvfp4.guidance import guided_codes, unpack_bits
        from verl_quads.nvfp4.reference import encode_codes, scaled_values

        with torch.no_grad():
            q = quantize_guided(x.detach(), record, check_finite=False)
            g = extract_guidance(q)
            self.calls += 1
            self.elements += x.numel()
            self.bit_mismatch += int(_popcount(g.bits ^ record.bits.to(g.bits.device)))
            self.block_scale_mismatch += int(
                (g.block_scale.view(torch.uint8) != record.block_scale.view(torch.uint8).to(g.bits.device)).sum()
            )
            self.global_scale_mismatch += int((g.global_scale != record.global_scale.to(g.bits.device)).sum())
            # how many codes guidance chose differently from round-to-nearest under the same scales
            y = scaled_values(x.detach(), record.block_scale.to(x.device), record.global_scale.to(x.device))
            low = unpack_bits(record.bits.to(x.device)).unflatten(-1, (-1, 16))
            self.rounding_changed += int((guided_codes(y, low) != encode_codes(y)).sum())
            # forced: the scaled value is a codeword itself (incl. the clamp at +-6), so both low bits give
            # the same code and the record's bit cannot be followed; a mismatch anywhere else is a bug
            forced = guided_codes(y, torch.zeros_like(low)) == guided_codes(y, torch.ones_like(low))
            differ = unpack_bits(g.bits).unflatten(-1, (-1, 16)).to(x.device) != low
            self.forced += int(forced.sum())
            self.bit_mismatch_forced += int((differ & forced).sum())
            self.bit_mismatch_free += int((differ & ~forced).sum())

    def as_dict(self) -> dict:
        return {"audit_calls": self.calls, "audit_elements": self.elements, "bit_mismatch": self.bit_mismatch,
                "block_scale_mismatch": self.block_scale_mismatch, "global_scale_mismatch": self.global_scale_mismatch,
                "rounding_changed": self.rounding_changed, "forced": self.forced,
                "bit_mismatch_forced": self.bit_mismatch_forced, "bit_mismatch_free": self.bit_mismatch_free}


def _popcount(t: torch.Tensor) -> torch.Tensor:
    t = t.to(torch.int32)
    n = torch.zeros_like(t)
    for j in range(8):
        n += (t >> j) & 1
    return n.sum()


_ACTIVE: list[TraceSession] = []


def _audited_qdq_guided(orig):
    def qdq_guided(x, record, backend="auto", check_finite=True):
        if _ACTIVE and _ACTIVE[-1].audit is not None:
            _ACTIVE[-1].audit.check(x, record)
        return orig(x, record, backend, check_finite)

    qdq_guided.__verl_quads_audit__ = True
    return qdq_guided


def install_audit() -> None:
    """Test instrument: route the QAT model's guided QDQ through :class:`_Audit` (only if the dump
    env var is set in this process; idempotent)."""
    if not os.environ.get(DUMP_ENV):
        return
    from verl_quads.qat import model as qat_model

    if not getattr(qat_model.qdq_guided, "__verl_quads_audit__", False):
        qat_model.qdq_guided = _audited_qdq_guided(qat_model.qdq_guided)


class trace_pass:
    """Context manager around one ``forward_backward_batch`` of a TRACE engine."""

    def __init__(self, engine, state, data, forward_only: bool):
        self.session = TraceSession(engine, state, data, forward_only)

    def __enter__(self) -> TraceSession:
        install_audit()
        _ACTIVE.append(self.session)
        return self.session

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self.session)
        self.session.close(verify=exc[0] is None)
        if exc[0] is None:
            self.session.log()
            self.session.dump()


def active_session() -> TraceSession | None:
    return _ACTIVE[-1] if _ACTIVE else None


# ----------------------------------------------------------------------------- routing (all modes)
class RouterRecorder:
    """Trainer side of ``quads/routing_disagreement``: the top-k expert ids the trainer's routers pick.

    A forward hook on every MoE router (``<...>.layers.<i>.mlp.gate``, a module returning
    ``(router_logits, top_k_weights, top_k_index)`` such as transformers 5's ``Qwen3MoeTopKRouter``)
    records ``top_k_index`` (int ``[rows, top_k]``, rows = the model input's flattened token rows) of
    each forward, per decoder layer. :meth:`take` returns the last forward's ids stacked as int16
    ``[rows, layers, top_k]`` (layers in ascending index order) and clears them. Use as a context
    manager (hooks removed on exit). Recording does not change any output.

    :class:`RoutingSession` runs it in the QAT engine's log-prob pass (``quads/routing_disagreement``).
    ``prepend=True`` registers the hooks before any existing ones (TRACE's router replay), so the
    router's own choice is recorded rather than the replayed one.
    """

    def __init__(self, model: torch.nn.Module, prepend: bool = False):
        import re

        pat = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")
        self.routers = {int(m.group(1)): mod for name, mod in model.named_modules() if (m := pat.search(name))}
        if not self.routers:
            raise ValueError(
                f"verl-quads routing: {type(model).__name__} has no MoE router modules (<...>.layers.<i>.mlp.gate)"
            )
        self._ids: dict[int, torch.Tensor] = {}
        self._handles: list = []
        self.prepend = prepend  # True: run before other forward hooks (TRACE router replay): the router's own choice

    def _hook(self, layer: int):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) == 3):
                raise TypeError(
                    f"verl-quads routing: router of layer {layer} ({type(module).__name__}) returned "
                    f"{type(output).__name__}; expected (router_logits, top_k_weights, top_k_index)"
                )
            self._ids[layer] = output[2].detach().reshape(-1, output[2].shape[-1])

        return hook

    def __enter__(self) -> "RouterRecorder":
        self._handles = [m.register_forward_hook(self._hook(i), prepend=self.prepend) for i, m in sorted(self.routers.items())]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def take(self) -> torch.Tensor:
        """int16 ``[rows, layers, top_k]`` of the last forward (every router must have run)."""
        missing = sorted(set(self.routers) - set(self._ids))
        if missing:
            raise RuntimeError(f"verl-quads routing: routers of layers {missing} did not run in the last forward")
        out = torch.stack([self._ids[i] for i in sorted(self.routers)], dim=1).to(torch.int16)
        self._ids = {}
        return out


ROUTING_FIELD = "quads_routing"
METRIC_ROUTING = "quads/routing_disagreement"


def batch_routing(td) -> list:
    """Each row's rollout routing wire record (``extra_fields["quads_routing"]``; None where absent)."""
    rows = _guidance_rows(td, ROUTING_FIELD)
    n = td.batch_size[0]
    return rows if len(rows) == n else [None] * n


class RoutingSession:
    """``quads/routing_disagreement`` in one log-prob pass of a QAT engine (every quantized mode).

    Per micro-batch (:meth:`begin_micro_batch`, from the engine's ``prepare_model_inputs``) it keeps
    the row map of the model input (``TraceBatch.packed`` / ``.padded``: sequence index and position
    of every flattened token row) and the micro-batch's rollout records; after that micro-batch's
    forward (at the next :meth:`begin_micro_batch` or :meth:`close`) it compares, for every valid
    response token j of every sequence (prompt length P, response length R, ``response_mask[j] == 1``),
    the trainer's top-k expert set at the row that produces token j's log-prob (position ``P - 1 + j``,
    as verl's ``response_from_nested`` shifts) with the rollout's at the same position, per MoE layer.
    Counts: ``differ`` (token, layer) pairs whose sets differ, ``pairs`` compared; tokens whose position
    has no rollout record (no record for the row; or not computed by vLLM) are counted as uncovered,
    never as agreeing. The rollout's and the trainer's MoE layer lists must be identical (else
    ValueError). With ``replayed=True`` (TRACE: guided layers replay the rollout's routing) a second
    recorder after the replay hooks gives ``quads/routing_disagreement_replayed`` (0 in guided layers by
    construction); the main metric is the routers' own choice.
    """

    def __init__(self, model: torch.nn.Module, replayed: bool = False):
        self.own = RouterRecorder(model, prepend=True)
        self.eff = RouterRecorder(model) if replayed else None
        self.layers = sorted(self.own.routers)
        self.differ = self.pairs = self.eff_differ = 0
        self.tokens = self.uncovered = 0
        self.rec_bytes = self.rec_tokens = 0
        self.micro_batches = 0
        self._pending = None

    def __enter__(self) -> "RoutingSession":
        self.own.__enter__()
        if self.eff is not None:
            self.eff.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                self._flush()
        finally:
            self._pending = None
            self.own.__exit__(*exc)
            if self.eff is not None:
                self.eff.__exit__(*exc)

    def begin_micro_batch(self, micro_batch, model_inputs: dict) -> None:
        from verl.utils import tensordict_utils as tu

        self._flush()
        if getattr(model_inputs, "get", None) is None or "input_ids" not in model_inputs:
            raise ValueError("verl-quads routing: model inputs without input_ids")
        if "response_mask" not in micro_batch.keys():
            raise KeyError("verl-quads routing: the log-prob micro-batch has no response_mask")
        seq_lens = micro_batch["input_ids"].offsets().diff().tolist()
        masks = [m.bool().cpu() for m in micro_batch["response_mask"].unbind()]
        n = len(seq_lens)
        keys = [f"row{i}" for i in range(n)]
        if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            tb = TraceBatch.packed(None, 0, keys, seq_lens, total_rows=model_inputs["input_ids"].shape[-1])
        else:
            mask = model_inputs.get("attention_mask")
            if mask is None or mask.dim() != 2:
                raise ValueError(f"verl-quads routing: padded micro-batch without a 2-D attention mask ({type(mask)})")
            tb = TraceBatch.padded(None, 0, keys, mask.cpu())
        self._pending = (tb.row_seq, tb.row_pos, batch_routing(micro_batch), seq_lens, masks)
        self.micro_batches += 1

    def _flush(self) -> None:
        if self._pending is None:
            return
        row_seq, row_pos, wires, seq_lens, masks = self._pending
        self._pending = None
        own = self.own.take().cpu().long()  # [N, L, k]
        eff = self.eff.take().cpu().long() if self.eff is not None else None
        if own.shape[0] != row_seq.numel():
            raise RuntimeError(f"verl-quads routing: routers saw {own.shape[0]} rows, the row map has {row_seq.numel()}")
        for i, (n, mask) in enumerate(zip(seq_lens, masks)):
            r = mask.numel()
            want = (n - r - 1) + torch.nonzero(mask).flatten()  # positions producing the valid response tokens
            w = wires[i]
            if not isinstance(w, dict):
                self.uncovered += want.numel()
                continue
            if [int(x) for x in w["layers"]] != self.layers:
                raise ValueError(
                    f"verl-quads routing: the rollout recorded MoE layers {list(w['layers'])}, the trainer's routers "
                    f"are layers {self.layers}; they must be the same (is a MoE layer excluded from quads_nvfp4?)"
                )
            self.rec_bytes += w["experts"].numel() * w["experts"].element_size()
            self.rec_tokens += int(w["positions"].numel())
            rpos = w["positions"].long()
            if rpos.numel() == 0:
                idx, covered = want, torch.zeros_like(want, dtype=torch.bool)
            else:
                idx = torch.searchsorted(rpos, want).clamp(max=rpos.numel() - 1)
                covered = rpos[idx] == want
            self.uncovered += int((~covered).sum())
            want, idx = want[covered], idx[covered]
            if want.numel() == 0:
                continue
            rows = torch.nonzero(row_seq == i).flatten()
            rows = rows[torch.argsort(row_pos[rows])]  # rows[p] = the row of position p
            if rows.numel() != n:
                raise RuntimeError(f"verl-quads routing: sequence {i} has {rows.numel()} rows, expected {n}")
            ro = torch.sort(w["experts"][idx].long(), -1).values
            tr = torch.sort(own[rows[want]], -1).values
            if ro.shape != tr.shape:
                raise ValueError(f"verl-quads routing: rollout ids {tuple(ro.shape)} vs trainer {tuple(tr.shape)} (top_k differs?)")
            self.differ += int((ro != tr).any(-1).sum())
            self.pairs += ro.shape[0] * ro.shape[1]
            self.tokens += want.numel()
            if eff is not None:
                self.eff_differ += int((ro != torch.sort(eff[rows[want]], -1).values).any(-1).sum())

    def metrics(self) -> dict[str, float]:
        """``quads/routing_*`` of the pass (``routing_disagreement`` only when some pair was compared)."""
        m = {"quads/routing_compared_tokens": float(self.tokens),
             "quads/routing_uncovered_frac": self.uncovered / max(self.uncovered + self.tokens, 1),
             "quads/routing_bytes_per_token": self.rec_bytes / max(self.rec_tokens, 1)}
        if self.pairs:
            m[METRIC_ROUTING] = self.differ / self.pairs
            if self.eff is not None:
                m["quads/routing_disagreement_replayed"] = self.eff_differ / self.pairs
        return m


__all__ = ["RouterRecorder", "RoutingSession", "batch_routing", "ROUTING_FIELD", "METRIC_ROUTING", "FIELD", "DUMP_ENV", "METRIC_BPT", "TraceSession", "trace_pass", "batch_guidance", "guidance_bytes",
           "active_session", "install_audit"]
