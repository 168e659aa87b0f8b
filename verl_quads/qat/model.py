"""Make a Hugging Face causal LM quantization-aware without touching its parameters.

:func:`apply_qat` swaps the class of each quantized module for a subclass whose ``forward``
uses NVFP4-QDQ weights (and, in W4A4 modes, QDQ GEMM inputs). Parameters, their names,
``state_dict`` and the optimizer are unchanged, so FSDP2 (``fully_shard``, which swaps classes the
same way and composes with ours in either order), optimizers and checkpoints see the stock model.
The QDQ runs inside ``forward``, after FSDP2's pre-forward all-gather, so it sees the full
unsharded weight. With ``QuantConfig.weight_qdq == "per_version"`` (or ``auto`` once
:func:`verl_quads.qat.fsdp_qdq.setup` chose it) the weight QDQ leaves the forward:
FSDP2 gathers shards that :mod:`verl_quads.qat.fsdp_qdq` QDQ'd once per weight version (same values bit
for bit), the modules use their weights as they are (activation QDQ unchanged), and a forward without
that installed cache raises (:meth:`QATState.weights_pre_quantized`).

Quantized modules (everything else is untouched):

- every ``nn.Linear`` whose name ``QuantConfig.is_ignored`` does not match;
- every fused-experts module (direct 3-D parameters named ``gate_up_proj``/``up_proj``/
  ``down_proj``, transformers 5 ``@use_experts_implementation`` classes) not ignored.

Per-layer activation handling (``act``): ``none`` (w4a16), ``rtn`` (w4a4_qat) or ``guided`` (trace,
for decoder layers ``>= num_layers - guided_layers``; other layers follow ``trace_base_mode``).

Fused experts: with ``act == none`` the model's own experts forward runs (whatever
``experts_implementation`` the model uses) with the QDQ weights substituted for the duration of
the call. ``act == rtn`` with the ``grouped_mm``/``batched_mm`` implementations does the same on the
per-token QDQ'd input and QDQs the w2 input per row inside ``_apply_gate`` (exact: per-row QDQ does
not depend on row order). ``act == guided`` (TRACE, which must know each row's (token, slot)) runs
:meth:`_QATExperts._grouped_guided_forward`: rows sorted by expert, two grouped GEMMs, one guided
quantization call over all (token, slot) rows with the rollout's records gathered by index. ``rtn``
with the eager implementation (and ``guided`` with ``QATState.expert_path == "loop"``, the reference
the grouped path is tested against) runs :meth:`_QATExperts._a4_forward`: a per-expert loop that QDQs
the w13 input (per token, once) and the w2 inputs (per (token, expert) row, all rows in one call).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from verl_quads.config import QuantConfig
from verl_quads.nvfp4 import extract_guidance, quantize
from verl_quads.qat.activations import merged_record, qdq_guided, qdq_rtn
from verl_quads.qat.guidance import GuidanceError, TraceBatch
from verl_quads.qat.weights import (
    EXPERT_PARAMS,
    FUSED_GROUPS,
    abs_max,
    check_unsharded,
    qdq_expert_weight,
    qdq_linear_weight,
)

#: transformers experts implementations that call ``self._apply_gate`` between the two GEMMs.
_APPLY_GATE_IMPLS = ("grouped_mm", "batched_mm")
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass
class QATState:
    """Shared by all QAT modules of one model (held as ``model._verl_quads_qat``)."""

    config: QuantConfig
    num_layers: int  # decoder layers (trace mode; -1 otherwise)
    backend: str = "torch"
    #: Finite checks of every QDQ input (one device sync each); off by default in training, where the
    #: weights are checked lazily instead (:meth:`note_weight` / :meth:`verify`).
    check_finite: bool = False
    trace: TraceBatch | None = None
    #: TRACE experts: ``grouped`` (grouped GEMMs, one guided call over all (token, slot) rows) or
    #: ``loop`` (the per-expert loop of :meth:`_QATExperts._a4_forward`; a reference for tests).
    expert_path: str = "grouped"
    #: ``weight_qdq=per_version``: the installed :class:`verl_quads.qat.fsdp_qdq.ShardQDQ` (FSDP2 all-gathers
    #: QDQ'd shards; the modules' forwards then use their weights as they are). None until installed.
    fsdp_qdq: object | None = None
    #: the weight QDQ schedule in effect (``per_forward`` | ``per_version``) once decided: by
    #: :func:`verl_quads.qat.fsdp_qdq.setup` (or ``install``), or, for ``weight_qdq=auto`` without either, by
    #: the first QAT forward (``per_forward``, logged once). None until then.
    weight_qdq: str | None = None
    #: fully-qualified name -> (kind, gemm, layer, act) of every quantized module.
    modules: dict[str, tuple[str, str, int | None, str]] = field(default_factory=dict)
    original_classes: dict[str, type] = field(default_factory=dict)

    #: parameter name -> the last forward's weight amax (device tensor, per expert ``[E, 1, 1]`` for
    #: fused experts); :meth:`verify` checks them all at once. Each forward overwrites its modules' entries.
    weight_finite: dict[str, torch.Tensor] = field(default_factory=dict)

    def note_weight(self, name: str, amax: torch.Tensor) -> None:
        """Remember the ``abs_max`` of weight ``name`` (NaN and Inf propagate into it) for :meth:`verify`:
        no device op and no sync here (the amax tensor is kept; it is tiny)."""
        if not self.check_finite:
            self.weight_finite[name] = amax.detach()

    def verify(self) -> None:
        """Raise ``ValueError`` naming every parameter (and expert) whose forward saw NaN/Inf weights
        since the last call. One device sync (none if nothing was noted). ``trace_context`` calls it on
        exit; verl-quads' verl engine once per ``forward_backward_batch`` (before any optimizer step
        uses its gradients); call it yourself in a hand-written training loop."""
        amaxes, self.weight_finite = self.weight_finite, {}
        if not amaxes:
            return
        # one concatenation per dtype, one compare, one copy to the host (amax >= 0, so amax < inf is
        # False exactly for NaN and +Inf)
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, a in amaxes.items():
            by_dtype.setdefault(a.dtype, []).append(name)
        good: dict[str, list[bool]] = {}
        for names in by_dtype.values():
            ok = (torch.cat([amaxes[n].reshape(-1) for n in names]) < float("inf")).tolist()
            pos = 0
            for n in names:
                k = amaxes[n].numel()
                good[n], pos = ok[pos:pos + k], pos + k
        bad = []
        for name, a in amaxes.items():
            flags = good[name]
            if not all(flags):
                if a.dim() == 3:  # [E, 1, 1] per expert
                    experts = [e for e, f in enumerate(flags) if not f]
                    bad.append(f"{name} (experts {experts[:16]}{' ...' if len(experts) > 16 else ''})")
                else:
                    bad.append(name)
        if bad:
            raise ValueError(
                f"verl-quads QAT: NaN/Inf weights at forward time in {', '.join(bad)}; only finite weights can be "
                "quantized (the master weights diverged or a checkpoint is corrupt)"
            )

    def weights_pre_quantized(self, name: str) -> bool:
        """True when the module's weight already IS its QDQ (``weight_qdq=per_version``, or ``auto`` after
        :func:`verl_quads.qat.fsdp_qdq.setup` installed the per-version QDQ: FSDP2 gathers QDQ'd shards); False
        for ``per_forward`` and for ``auto`` without an installed per-version QDQ (the forward QDQs it; the same
        values). Raises if ``per_version`` has no installed cache: the weight would be the plain BF16 weight
        (never a silent fallback)."""
        if self.config.weight_qdq == "per_forward":
            return False
        if self.config.weight_qdq == "auto":
            if self.fsdp_qdq is None and self.weight_qdq is None:
                from verl_quads.qat.fsdp_qdq import note_auto_without_setup

                note_auto_without_setup(self)
            return self.fsdp_qdq is not None
        if self.fsdp_qdq is None:
            raise RuntimeError(
                f"verl-quads QAT: {name}: quant_config.weight_qdq=per_version but no FSDP2 per-version weight QDQ "
                "is installed: call verl_quads.qat.fsdp_qdq.install(model) on the root module after fully_shard "
                "(verl-quads' verl engine does), or use weight_qdq=per_forward (the only choice without FSDP2)"
            )
        return True

    def require_trace(self, name: str) -> TraceBatch:
        if self.trace is None:
            raise GuidanceError(
                f"TRACE: {name} is a guided layer but no TraceBatch is active; run forward (and backward, "
                "if activations are recomputed) inside verl_quads.qat.trace_context(model, batch)"
            )
        return self.trace


def _f8_rows(t: torch.Tensor, *idx: torch.Tensor) -> torch.Tensor:
    """Advanced indexing of a float8 tensor through its bytes (not every device indexes float8)."""
    return t.view(torch.uint8)[idx].view(t.dtype)


def _expert_counts(sorted_ids: torch.Tensor, n_exp: int) -> torch.Tensor:
    """Rows per expert ``[E]`` of expert ids in ``[0, E)``, without a device sync (histc, as transformers'
    grouped_mm implementation: integer input on CUDA, float on CPU/MPS)."""
    src = sorted_ids.float() if sorted_ids.device.type in ("cpu", "mps") else sorted_ids.int()
    return torch.histc(src, bins=n_exp, min=0, max=n_exp - 1)


def _grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Rows ``x`` ``[S, in]`` sorted by expert times each expert's ``w`` (``[E, out, in]``, or ``[E, in, out]``
    when ``transposed``); ``offs`` int32 ``[E]`` cumulative row counts. Returns ``[S, out]``.

    Uses transformers' grouped-mm dispatcher (the GEMM of its ``grouped_mm`` experts implementation:
    ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``, or its own per-expert fallback where
    those cannot run), so TRACE and ``w4a4_qat`` multiply with the same kernel."""
    wt = w if transposed else w.transpose(-2, -1)
    try:
        from transformers.integrations.moe import _grouped_mm
    except ImportError:  # pragma: no cover - a transformers without the dispatcher
        gm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
        if gm is None:
            raise RuntimeError("verl-quads QAT: TRACE experts need torch.nn.functional.grouped_mm or torch._grouped_mm")
        return gm(x.to(wt.dtype), wt, offs=offs)
    return _grouped_mm(x, wt, offs)


def _own_guidance(x: torch.Tensor, state: "QATState"):
    q = quantize(x.detach(), amax="row", backend=state.backend, check_finite=state.check_finite)
    return extract_guidance(q)


def _guided_input(state: QATState, name: str, layer: int, gemm: str, x: torch.Tensor) -> torch.Tensor:
    """Guided QDQ of a token-rows input ``[..., K]`` (leading dims = the model's token rows)."""
    tb = state.require_trace(name)
    flat = x.reshape(-1, x.shape[-1])
    if tb.record_into is not None:
        tb.store(layer, gemm, _own_guidance(flat, state))
        return qdq_rtn(x, state.backend, state.check_finite)
    parts, covered, _, uncovered = tb.gather(layer, gemm, tuple(flat.shape[:-1]), flat.shape[-1], flat.device)
    rec = merged_record(flat, parts, covered, state.backend, state.check_finite, uncovered)
    return qdq_guided(flat, rec, state.backend, state.check_finite).reshape(x.shape)


class _QATLinear:
    """Mixin placed before ``nn.Linear`` (or a subclass of it)."""

    _qat_state: QATState
    _qat_name: str
    _qat_gemm: str
    _qat_layer: int | None
    _qat_act: str
    _qat_group: list

    def _qat_weight(self) -> torch.Tensor:
        """The QDQ (STE) weight ``[out, in]`` this forward multiplies with (group-shared global scale)."""
        st = self._qat_state
        return qdq_linear_weight(self.weight, None, st.backend, st.check_finite, amax=self._qat_amax())

    def _qat_amax(self) -> torch.Tensor:
        """The amax source of the group-shared encode scale, computed ONCE per forward of a fused group:
        the weight's :func:`abs_max` (0-d, weight dtype) alone, or a 1-D ``[G]`` buffer holding each
        member's (one reduction each, written in place: no stack); the QDQ kernel derives
        ``global_scale_from_amax(max)`` from it (== :func:`linear_global_scale`, bit for bit).

        The first member to run (q_proj / gate_proj in model order) reads every member's amax and
        leaves it in the group's stash (shared dict) for the others; a member takes it only if the
        stash was made from the very weight tensors it sees now, unmodified since (same objects, same
        in-place version counters), else it computes afresh. The stash is emptied when every member has
        taken it, so it never outlives one forward of the group (no reference to unsharded weights kept).
        Bit-identical to each member computing the scale itself (same ops on the same values)."""
        st, group = self._qat_state, self._qat_group
        stash = self._qat_stash
        ws = [m.weight for m in group]
        if (stash.get("left") and self._qat_name in stash["left"]
                and all(a is b for a, b in zip(stash["ws"], ws))
                and stash["versions"] == [w._version for w in ws]):
            stash["left"].discard(self._qat_name)
            amax = stash["amax"]
            if not stash["left"]:
                stash.clear()
            return amax
        for m in group:
            check_unsharded(m.weight, f"{m._qat_name}.weight")
        if len(ws) == 1:
            amax = abs_max(ws[0])
            st.note_weight(f"{self._qat_name}.weight", amax)
            return amax
        if all(w.dtype == ws[0].dtype and w.device == ws[0].device for w in ws):
            amax = torch.empty(len(ws), dtype=ws[0].dtype, device=ws[0].device)
            for i, w in enumerate(ws):
                abs_max(w, out=amax[i])
        else:  # members of different dtypes (not seen in practice): float32 entries, same values
            amax = torch.stack([abs_max(w).to(torch.float32) for w in ws])
        for i, m in enumerate(group):
            st.note_weight(f"{m._qat_name}.weight", amax[i])
        stash.clear()
        stash.update(ws=ws, versions=[w._version for w in ws], amax=amax,
                     left={m._qat_name for m in group if m is not self})
        return amax

    def _qat_input(self, x: torch.Tensor) -> torch.Tensor:
        """The QDQ (STE) GEMM input of a W4A4 layer, computed ONCE per forward of a fused group: q/k/v
        (gate/up) get the same input tensor and, being one GEMM in vLLM, the same rounding (one record
        under TRACE), so the first member's result is stashed for the others (same tensor object, same
        in-place version, else computed afresh; emptied once every member took it). Autograd then sums the
        members' gradients into that one result and passes the sum straight through to ``x``."""
        st, stash = self._qat_state, self._qat_xstash
        if (stash.get("left") and self._qat_name in stash["left"] and stash["x"] is x
                and stash["version"] == x._version):
            stash["left"].discard(self._qat_name)
            q = stash["q"]
            if not stash["left"]:
                stash.clear()
            return q
        if self._qat_act == "rtn":
            q = qdq_rtn(x, st.backend, st.check_finite)
        else:
            q = _guided_input(st, self._qat_name, self._qat_layer, self._qat_gemm, x)
        stash.clear()
        if len(self._qat_group) > 1:
            stash.update(x=x, version=x._version, q=q, left={m._qat_name for m in self._qat_group if m is not self})
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        w = self.weight if self._qat_state.weights_pre_quantized(self._qat_name) else self._qat_weight()
        if self._qat_act != "none":
            x = self._qat_input(x)
        return F.linear(x, w, self.bias)


class _QATExperts:
    """Mixin placed before a transformers-5 fused-experts class."""

    _qat_state: QATState
    _qat_name: str
    _qat_layer: int | None
    _qat_act: str
    _qat_params: tuple[str, ...]
    _qat_gemm: str  # module path inside the decoder layer, e.g. "mlp.experts"

    def _qdq_weights(self) -> dict[str, torch.Tensor]:
        transposed = bool(getattr(self, "is_transposed", False))
        out = {}
        for p in self._qat_params:
            w = getattr(self, p)
            check_unsharded(w, f"{self._qat_name}.{p}")
            st = self._qat_state
            out[p] = qdq_expert_weight(w, transposed, st.backend, st.check_finite,
                                       on_amax=lambda a, n=f"{self._qat_name}.{p}": st.note_weight(n, a))
        return out

    def _stock_forward(self, qw, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        """The model's own experts forward with the QDQ weights substituted for the duration of the call,
        where the attribute lives now (``_parameters``; FSDP1 puts unsharded views in ``__dict__``)."""
        where = {p: (self._parameters if p in self._parameters else self.__dict__) for p in qw}
        saved = {p: where[p][p] for p in qw}
        try:
            for p, t in qw.items():
                where[p][p] = t
            return super().forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        finally:
            for p, t in saved.items():
                where[p][p] = t

    def _gate_hook_supported(self) -> bool:
        """Whether the model's experts forward routes the w2 input through ``self._apply_gate``."""
        impl = getattr(getattr(self, "config", None), "_experts_implementation", None)
        return impl in _APPLY_GATE_IMPLS and getattr(self, "has_gate", False) and hasattr(self, "_apply_gate")

    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):  # type: ignore[override]
        if self._qat_state.weights_pre_quantized(self._qat_name):
            if self._qat_act == "none":  # the weights are the QDQ weights: the model's own forward
                return super().forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
            qw = {p: getattr(self, p) for p in self._qat_params}
        else:
            qw = self._qdq_weights()
        if self._qat_act == "none":
            return self._stock_forward(qw, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        if self._qat_act == "rtn" and self._gate_hook_supported():
            # Fast path (grouped/batched GEMMs of the model's implementation): per-token QDQ of the w13
            # input here, per-row QDQ of the w2 input on the way out of ``_apply_gate``. Per-row QDQ does
            # not depend on the order the implementation puts the (token, expert) rows in.
            st = self._qat_state
            x = qdq_rtn(hidden_states, st.backend, st.check_finite)
            cls_gate = type(self)._apply_gate

            def gate_then_qdq(gate_up_out):
                return qdq_rtn(cls_gate(self, gate_up_out), st.backend, st.check_finite)

            self.__dict__["_apply_gate"] = gate_then_qdq
            try:
                return self._stock_forward(qw, x, top_k_index, top_k_weights, *args, **kwargs)
            finally:
                del self.__dict__["_apply_gate"]
        if args or kwargs:
            raise TypeError(f"verl-quads QAT: {self._qat_name}: unexpected extra experts arguments {args} {list(kwargs)}")
        if self._qat_act == "guided" and self._qat_state.expert_path == "grouped":
            return self._grouped_guided_forward(qw, hidden_states, top_k_index, top_k_weights)
        return self._a4_forward(qw, hidden_states, top_k_index, top_k_weights)

    def _w2_guidance(self, tb: TraceBatch, top_k_index: torch.Tensor, inter: int, device):
        """The rollout's records of the w2 input over ``[T, top_k]`` (token, slot) rows. Returns
        ``(parts, covered, uncovered)`` (see :meth:`TraceBatch.gather`; rows = tokens).

        The trainer must have routed every covered token exactly as the rollout did. That check reads
        device data, so it is deferred (:meth:`TraceBatch.defer_check`, no sync here) and raised by
        :meth:`TraceBatch.verify` (``trace_context`` exit; once per micro-batch in verl) as a
        :class:`GuidanceError` naming the layer and the number of tokens."""
        parts, covered, eids, uncovered = tb.gather(
            self._qat_layer, self._qat_gemm + ".w2", tuple(top_k_index.shape), inter, device)
        layer, gemm = self._qat_layer, self._qat_gemm

        def describe(n_bad: int) -> str:
            return (f"TRACE: layer {layer} {gemm}.w2: the trainer's routing differs from the rollout's on {n_bad} "
                    "token(s); guided rounding of the expert inputs needs identical routing (router replay)")

        if eids is None:
            raise GuidanceError(describe(-1) + "; the records carry no expert ids")
        with torch.no_grad():
            cov = covered.to(top_k_index.device)
            bad = (eids.to(top_k_index.device) != top_k_index.long()).any(-1) & cov
        tb.defer_check(bad, describe)
        return parts, covered, uncovered

    def _grouped_guided_forward(self, qw, hidden_states, top_k_index, top_k_weights):
        """TRACE experts on grouped GEMMs. hidden_states ``[T, H]``, top_k_index/weights ``[T, k]``; returns
        ``[T, H]`` in hidden_states' dtype.

        The ``S = T * k`` (token, slot) rows are sorted by expert (stable: ascending token order within
        an expert), both expert GEMMs are one grouped GEMM each (``transformers``' grouped-mm dispatcher,
        the one the stock ``grouped_mm`` implementation and so ``w4a4_qat`` use), and the w2 input of all
        S rows is quantized in ONE guided call, each row under the rollout's record of its (token, slot),
        gathered by index. The w13 input is guided per token before the row gather (a row's quantization
        does not depend on its neighbours, so this equals quantizing every gathered row). The k slots of
        a token are combined as the stock implementation does (float32-accumulated sum over the slots).
        Expert ids must lie in ``[0, E)`` (the router's top-k or router replay; expert parallelism,
        whose sentinel ids need masking, is refused). No device sync (checked by tests/unit/test_qat_host_syncs.py).
        """
        st = self._qat_state
        if "gate_up_proj" not in qw or not getattr(self, "has_gate", True):
            raise NotImplementedError(f"verl-quads QAT: {self._qat_name}: W4A4 modes need gate_up_proj experts")
        if getattr(self, "_is_expert_parallel", False):
            raise NotImplementedError(f"verl-quads QAT: {self._qat_name}: TRACE experts under expert parallelism")
        transposed = bool(getattr(self, "is_transposed", False))
        has_bias = bool(getattr(self, "has_bias", False))
        w13, w2 = qw["gate_up_proj"], qw["down_proj"]
        n_exp = w13.shape[0]
        n_tok, top_k = top_k_index.shape
        inter = w2.shape[-2] if transposed else w2.shape[-1]
        tb = st.require_trace(self._qat_name)
        recording = tb.record_into is not None
        x = _guided_input(st, self._qat_name, self._qat_layer, self._qat_gemm + ".w13", hidden_states)
        w2_guidance = None if recording else self._w2_guidance(tb, top_k_index, inter, hidden_states.device)
        with torch.no_grad():
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)  # [S] sorted row -> flat (token * k + slot)
            eid_g = flat[order]
            offs = torch.cumsum(_expert_counts(eid_g, n_exp), dim=0, dtype=torch.int32)
            tok_g = order // top_k
        h = _grouped_gemm(x[tok_g], w13, offs, transposed)  # [S, 2I]
        if has_bias:
            h = h + self.gate_up_proj_bias[eid_g]
        h = self._apply_gate(h)  # [S, I]
        if recording:
            full = torch.zeros((n_tok * top_k, inter), dtype=h.dtype, device=h.device)
            full[order] = h.detach()
            tb.store(self._qat_layer, self._qat_gemm + ".w2", _own_guidance(full.view(n_tok, top_k, inter), st),
                     top_k_index.detach())
            h = qdq_rtn(h, st.backend, st.check_finite)
        else:
            (bits, bsc, gsc), covered, unc_tok = w2_guidance
            o = order.to(bits.device)
            parts = (bits.flatten(0, 1)[o], _f8_rows(bsc.flatten(0, 1), o), gsc.flatten(0, 1)[o])
            # sorted rows of the uncovered tokens' (token, slot) pairs: inverse permutation, no sync
            inv = torch.empty_like(order)
            inv[order] = torch.arange(order.numel(), device=order.device)
            slots = torch.arange(top_k, device=order.device)
            unc_rows = inv[(unc_tok.to(order.device)[:, None] * top_k + slots).flatten()]
            rec = merged_record(h, parts, covered.to(o.device)[o // top_k], st.backend, st.check_finite, unc_rows)
            h = qdq_guided(h, rec, st.backend, st.check_finite)
        y = _grouped_gemm(h, w2, offs, transposed)  # [S, H]
        if has_bias:
            y = y + self.down_proj_bias[eid_g]
        y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        rows = torch.empty_like(y)
        rows[order] = y  # back to (token, slot) order; backward is a gather
        return rows.view(n_tok, top_k, -1).sum(dim=1).to(hidden_states.dtype)

    def _a4_forward(self, qw, hidden_states, top_k_index, top_k_weights):
        """W4A4 experts. hidden_states ``[T, H]``, top_k_index/weights ``[T, k]``; returns ``[T, H]``.

        The (token, slot) pairs are grouped by expert (stable sort, so each expert's rows are in
        ascending token order, as ``torch.where`` gives them). The w13 input is QDQ'd once per token,
        the w2 inputs of all pairs in one call (per row, so the grouping does not change any value).
        """
        st = self._qat_state
        if "gate_up_proj" not in qw or not getattr(self, "has_gate", True):
            raise NotImplementedError(f"verl-quads QAT: {self._qat_name}: W4A4 modes need gate_up_proj experts")
        transposed = bool(getattr(self, "is_transposed", False))
        has_bias = bool(getattr(self, "has_bias", False))
        w13, w2 = qw["gate_up_proj"], qw["down_proj"]
        n_exp, top_k = w13.shape[0], top_k_index.shape[1]
        inter = w2.shape[-2] if transposed else w2.shape[-1]
        act = self._qat_act
        tb = st.require_trace(self._qat_name) if act == "guided" else None
        recording = tb is not None and tb.record_into is not None
        if act == "rtn":
            x = qdq_rtn(hidden_states, st.backend, st.check_finite)
        else:
            x = _guided_input(st, self._qat_name, self._qat_layer, self._qat_gemm + ".w13", hidden_states)
        w2_guidance = None
        if tb is not None and not recording:
            w2_guidance = self._w2_guidance(tb, top_k_index, inter, hidden_states.device)
        with torch.no_grad():
            flat = top_k_index.reshape(-1)
            valid = (flat >= 0) & (flat < n_exp)
            order = torch.argsort(torch.where(valid, flat, n_exp), stable=True)[: int(valid.sum())]
            counts = torch.bincount(flat[order], minlength=n_exp).tolist()
            tok_all, slot_all = order // top_k, order % top_k
        # gate/up GEMM per expert, then one QDQ over all (token, slot) rows
        hs, segs, start = [], [], 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = tok_all[start : start + n]
            we13 = w13[e].transpose(0, 1) if transposed else w13[e]
            h = F.linear(x[tok], we13, self.gate_up_proj_bias[e] if has_bias else None)
            hs.append(self._apply_gate(h))
            segs.append((e, start, n))
            start += n
        if not hs:
            return torch.zeros_like(hidden_states)
        h_all = torch.cat(hs, dim=0)
        if recording:
            full = torch.zeros((hidden_states.shape[0], top_k, inter), dtype=h_all.dtype, device=h_all.device)
            full[tok_all, slot_all] = h_all.detach()
            # rows of unrouted (token, slot) pairs stay zero; they are never read back
            tb.store(self._qat_layer, self._qat_gemm + ".w2", _own_guidance(full, st), top_k_index.detach())
        if w2_guidance is None:
            h_all = qdq_rtn(h_all, st.backend, st.check_finite)
        else:
            (bits, bsc, gsc), covered, _ = w2_guidance
            parts = (bits[tok_all, slot_all], _f8_rows(bsc, tok_all, slot_all), gsc[tok_all, slot_all])
            rec = merged_record(h_all, parts, covered[tok_all], st.backend, st.check_finite)
            h_all = qdq_guided(h_all, rec, st.backend, st.check_finite)
        out = torch.zeros_like(hidden_states)
        for e, start, n in segs:
            tok, slot = tok_all[start : start + n], slot_all[start : start + n]
            we2 = w2[e].transpose(0, 1) if transposed else w2[e]
            y = F.linear(h_all[start : start + n], we2, self.down_proj_bias[e] if has_bias else None)
            y = y * top_k_weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


_CLASS_CACHE: dict[tuple[type, type], type] = {}


def _swap_class(module: nn.Module, mixin: type) -> None:
    base = type(module)
    key = (mixin, base)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = type(f"QAT{base.__name__}", (mixin, base), {})
    module.__class__ = _CLASS_CACHE[key]


def _num_layers(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        n = getattr(c, "num_hidden_layers", None)
        if isinstance(n, int):
            return n
    idx = [int(m.group(1)) for name, _ in model.named_modules() if (m := _LAYER_RE.search(name))]
    if not idx:
        raise ValueError("verl-quads QAT: cannot find the number of decoder layers (no config.num_hidden_layers)")
    return max(idx) + 1


def _layer_of(name: str) -> int | None:
    found = _LAYER_RE.findall(name)
    return int(found[-1]) if found else None


def _in_layer_path(name: str, layer: int | None) -> str:
    """Module path inside its decoder layer (``self_attn.q_proj``), or the full name outside layers."""
    for wrapper in _WRAPPER_PREFIXES:  # activation-checkpoint / FSDP1 / torch.compile wrappers
        name = name.replace(wrapper, "")
    if layer is None:
        return name
    return name.split(f"layers.{layer}.", 1)[-1]


def _expert_params(module: nn.Module) -> tuple[str, ...]:
    return tuple(n for n, p in module.named_parameters(recurse=False) if p is not None and p.dim() == 3)


def apply_qat(
    model: nn.Module, config: QuantConfig | str, *, backend: str | None = None, check_finite: bool = False
) -> QATState | None:
    """Make ``model`` quantization-aware in place for ``config.trainer_mode``.

    ``config``: a :class:`QuantConfig` or a ``quant`` mode string. ``backend``: NVFP4 backend for
    the QDQ (default: ``config.backend``, ``auto`` = triton on CUDA, torch on CPU). ``check_finite``:
    check every QDQ input (weights and activations) for NaN/Inf and raise at once (one device sync
    per QDQ). Off by default: no sync in the forward; the weights are then checked lazily (each
    forward notes on the device whether each weight is finite, :meth:`QATState.verify` raises naming
    the parameter; ``trace_context`` and the verl engine call it, a hand-written loop should too), and
    a non-finite activation propagates to the loss as in the BF16 model. Returns the
    :class:`QATState` (also at ``model._verl_quads_qat``), or None for trainer mode ``none`` (the
    model is left exactly as it was). Raises if the model is already QAT-enabled, or if a
    module has 3-D parameters that are not fused experts verl-quads knows.
    """
    if isinstance(config, str):
        config = QuantConfig(quant=config)
    if getattr(model, "_verl_quads_qat", None) is not None:
        raise RuntimeError("verl-quads QAT: apply_qat was already applied to this model")
    mode = config.trainer_mode
    if mode == "none":
        return None
    be = backend or config.backend
    num_layers = _num_layers(model) if mode == "trace" else -1
    state = QATState(
        config=config, num_layers=num_layers, backend="auto" if be == "native" else be, check_finite=check_finite
    )
    first_guided = state.num_layers - config.guided_layers

    def act_for(layer: int | None) -> str:
        if mode == "w4a16":
            return "none"
        if mode == "w4a4_qat":
            return "rtn"
        if layer is not None and layer >= first_guided:
            return "guided"
        return "rtn" if config.trace_base_mode == "w4a4_qat" else "none"

    names = {m: n for n, m in model.named_modules()}
    todo: list[tuple[str, nn.Module, str]] = []
    for name, mod in model.named_modules():
        if isinstance(mod, _QATLinear) or isinstance(mod, _QATExperts):
            raise RuntimeError(f"verl-quads QAT: {name} is already QAT-enabled")
        if config.is_ignored(name):
            continue
        if isinstance(mod, nn.Linear):
            todo.append((name, mod, "linear"))
            continue
        three_d = _expert_params(mod)
        if three_d:
            unknown = [p for p in three_d if p not in EXPERT_PARAMS]
            if unknown:
                raise ValueError(
                    f"verl-quads QAT: {name} ({type(mod).__name__}) has 3-D parameters {unknown} that are not fused "
                    f"experts verl-quads knows ({', '.join(EXPERT_PARAMS)}); add its name to "
                    "actor_rollout_ref.actor.quant_config.ignore to keep it BF16"
                )
            todo.append((name, mod, "experts"))

    stashes: dict[tuple[int, ...], dict] = {}
    xstashes: dict[tuple[int, ...], dict] = {}
    for name, mod, kind in todo:
        layer = _layer_of(name)
        act = act_for(layer)
        rel = _in_layer_path(name, layer)
        if act == "guided" and layer is None:
            raise ValueError(f"verl-quads QAT: {name} is guided (trace) but is not inside a decoder layer")
        if kind == "linear":
            leaf = name.rsplit(".", 1)[-1]
            parent_name = name.rsplit(".", 1)[0] if "." in name else ""
            parent = model.get_submodule(parent_name) if parent_name else model
            group, gemm = [mod], rel
            for members, fused in FUSED_GROUPS.items():
                if leaf in members:
                    gemm = rel[: len(rel) - len(leaf)] + fused
                    group = [
                        getattr(parent, s)
                        for s in members
                        if isinstance(getattr(parent, s, None), nn.Linear) and not config.is_ignored(f"{parent_name}.{s}")
                    ]
            state.original_classes[name] = type(mod)
            _swap_class(mod, _QATLinear)
            mod._qat_state, mod._qat_name, mod._qat_gemm, mod._qat_layer, mod._qat_act = state, name, gemm, layer, act
            mod._qat_group = group
            mod._qat_stash = stashes.setdefault(tuple(id(m) for m in group), {})  # one per group: _qat_amax
            mod._qat_xstash = xstashes.setdefault(tuple(id(m) for m in group), {})  # one per group: _qat_input
            state.modules[name] = ("linear", gemm, layer, act)
        else:
            state.original_classes[name] = type(mod)
            _swap_class(mod, _QATExperts)
            mod._qat_state, mod._qat_name, mod._qat_gemm, mod._qat_layer, mod._qat_act = state, name, rel, layer, act
            mod._qat_params = tuple(p for p in _expert_params(mod))
            state.modules[name] = ("experts", rel, layer, act)
    del names
    model._verl_quads_qat = state
    return state


def remove_qat(model: nn.Module) -> None:
    """Undo :func:`apply_qat` (restores the original classes)."""
    state = getattr(model, "_verl_quads_qat", None)
    if state is None:
        return
    if state.fsdp_qdq is not None:
        state.fsdp_qdq.remove()
    for name, cls in state.original_classes.items():
        mod = model.get_submodule(name)
        base = type(mod)
        # FSDP2 may have wrapped our class in its own; restore the class below ours.
        if issubclass(base, (_QATLinear, _QATExperts)) and base.__mro__[1] in (_QATLinear, _QATExperts):
            mod.__class__ = cls
        else:
            raise RuntimeError(f"verl-quads QAT: cannot remove QAT from {name} ({base.__name__}): class changed since")
        for a in ("_qat_state", "_qat_name", "_qat_gemm", "_qat_layer", "_qat_act", "_qat_group", "_qat_params",
                  "_qat_stash", "_qat_xstash"):
            mod.__dict__.pop(a, None)
    del model._verl_quads_qat


@contextlib.contextmanager
def trace_context(model: nn.Module, batch: TraceBatch):
    """Activate ``batch`` for the TRACE-guided layers of ``model`` (forward and any recompute).

    On a clean exit, runs ``batch.verify()``: the checks the forward deferred to avoid host syncs
    (routing equal to the rollout's) raise :class:`GuidanceError` here. Put the backward inside the
    context too (as recomputed activations need it anyway)."""
    state = getattr(model, "_verl_quads_qat", None)
    if state is None:
        raise RuntimeError("verl-quads QAT: trace_context on a model without apply_qat")
    prev, state.trace = state.trace, batch
    try:
        yield batch
    finally:
        state.trace = prev
    batch.verify()  # deferred checks (routing == rollout's): one device sync, only on a clean exit
    state.verify()  # weights finite


__all__ = ["QATState", "apply_qat", "remove_qat", "trace_context"]
