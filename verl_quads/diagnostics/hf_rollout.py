"""The rollout side's NVFP4 arithmetic over a Hugging Face model (for machines without vLLM).

:class:`RolloutEmulator` replaces, on one HF causal LM instance, the ``forward`` of every quantized
linear layer and fused-experts module with the arithmetic of the ``quads_nvfp4`` vLLM plugin's torch
backend, built from the same functions (:mod:`verl_quads.rollout.emulation`, which calls the one
NVFP4 core): NVFP4 weights (one global scale per tensor, q/k/v and gate/up sharing one as vLLM's
fused GEMMs do; per expert for routed experts), per-token activation quantization (``naive``,
``quads`` residual compensation, ``trace`` = naive + guidance capture), float32 GEMMs cast once.
The experts' arithmetic mirrors ``QuadsNVFP4MoEMethod.forward_reference`` (that module imports
vLLM, so it cannot be called here); ``tests/unit/test_diagnostics_hf_rollout.py`` checks the two
agree bit for bit where vLLM is installed.

Unlike the vLLM plugin it can also ablate: weights and activations are switched independently
(:class:`RolloutSpec`), which is what the weight / activation decomposition of the log-prob gap needs.

Rows: a GEMM sees the flattened token rows of the forward. Set :attr:`RolloutEmulator.rows` to
``(row_seq, row_pos)`` (int64 ``[N]``, -1 for padding) before each forward: padding rows are
excluded from QUADS' per-call block selection (as in vLLM, whose batches have no padding), and
guidance records / routing choices are filed under (sequence, position).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from verl_quads.config import DEFAULT_RESIDUAL_GRANULARITY, RESIDUAL_COMBINES, QuantConfig, resolve_residual_combine
from verl_quads.nvfp4 import GuidanceRecord
from verl_quads.qat.weights import EXPERT_PARAMS, FUSED_GROUPS
from verl_quads.rollout import emulation
from verl_quads.rollout.emulation import ActQuant

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
ACT_MODES = ("none", "naive", "quads", "trace")
#: Activation quantization backend: Triton kernels on CUDA tensors (bit-exact with the torch reference,
#: only faster: the emulation issues thousands of small GEMM calls per decode step), torch on CPU.
_BACKEND = "auto"
#: The rollout backend whose arithmetic this emulator runs (the plugin's ``torch`` backend): it decides what
#: ``residual_combine="auto"`` resolves to here (:func:`verl_quads.config.resolve_residual_combine`: ``bf16``).
EMULATED_BACKEND = "torch"


@dataclass(frozen=True)
class RolloutSpec:
    """What the emulated rollout quantizes.

    Attributes:
        weights: NVFP4 weights (else the checkpoint's BF16 weights, upcast exactly).
        act: activation handling: ``none`` (BF16), ``naive`` (RTN NVFP4), ``quads`` (NVFP4 +
            residual compensation), ``trace`` (naive + guidance capture in the guided layers).
        residual_ratio / residual_per_token / residual_granularity: QUADS options (defaults as
            :class:`verl_quads.config.QuantConfig`: per token, the sampled-threshold channel rule).
        guided_layers: trace: the last N decoder layers capture guidance.
        residual_combine: QUADS operand form, as ``quant_config.residual_combine`` (default ``auto``); the
            emulator runs the emulated (``torch``) arithmetic, so ``auto`` resolves to ``bf16`` as on the
            plugin's torch/triton backends (:attr:`combine`).
    """

    weights: bool
    act: str
    residual_ratio: float = 0.5
    residual_per_token: bool = True
    guided_layers: int = 20
    residual_granularity: str = DEFAULT_RESIDUAL_GRANULARITY
    residual_combine: str = "auto"

    def __post_init__(self) -> None:
        if self.act not in ACT_MODES:
            raise ValueError(f"RolloutSpec.act must be one of {ACT_MODES}, got {self.act!r}")
        if self.residual_combine not in RESIDUAL_COMBINES:
            raise ValueError(f"RolloutSpec.residual_combine (quant_config.residual_combine) must be one of "
                             f"{RESIDUAL_COMBINES}, got {self.residual_combine!r}")
        if self.act == "quads":  # the same checks as the rollout's (names the key and the allowed values)
            ActQuant("quads", self.residual_ratio, self.residual_per_token, residual_combine=self.combine,
                     residual_granularity=self.residual_granularity)

    @property
    def combine(self) -> str:
        """The concrete QUADS operand form the emulator runs: ``residual_combine`` resolved on the emulated
        backend (``auto`` -> ``bf16``; ``fp4x2`` / ``bf16`` as given)."""
        return resolve_residual_combine(self.residual_combine, EMULATED_BACKEND)

    @property
    def act_backend(self) -> str:
        """NVFP4 core backend of the activation quantization (every rule, the channel rule included, has a
        Triton kernel bit-exact with the torch reference: ``auto``)."""
        return _BACKEND

    @property
    def is_bf16(self) -> bool:
        return not self.weights and self.act == "none"

    @classmethod
    def for_rollout_mode(cls, cfg: QuantConfig) -> "RolloutSpec":
        """The plugin's rollout mode of ``cfg`` (``none`` -> BF16)."""
        mode = cfg.rollout_mode
        if mode == "none":
            return cls(False, "none")
        act = "none" if mode == "w4a16" else mode
        return cls(True, act, cfg.residual_ratio, cfg.residual_per_token, cfg.guided_layers,
                   residual_granularity=cfg.residual_granularity, residual_combine=cfg.residual_combine)


class _Recorder:
    """Per (key) lists of (row_seq, row_pos, tensor) filed during forwards; assembled per sequence."""

    def __init__(self) -> None:
        self.items: dict[object, list[tuple[torch.Tensor, torch.Tensor, object]]] = {}

    def add(self, key, row_seq, row_pos, value) -> None:
        self.items.setdefault(key, []).append((row_seq, row_pos, value))

    def clear(self) -> None:
        self.items.clear()


class RolloutEmulator:
    """Install/remove the rollout arithmetic on ``model`` (in place, parameters untouched).

    Args:
        model: a HF causal LM (transformers 5 fused experts or plain MLPs).
        spec: what to quantize.
        config: whose ``ignore`` list decides which modules stay BF16 (default: ``QuantConfig()``).
    """

    def __init__(self, model: nn.Module, spec: RolloutSpec, config: QuantConfig | None = None):
        self.model = model
        self.spec = spec
        self.config = config or QuantConfig()
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._row_masks: dict | None = None  # device -> (bool mask [N], int64 valid indices); None: every row valid
        self._kept = None  # (rows, their non-padding (keep, seq, pos)): see _kept_rows
        self.guidance = _Recorder()  # key (layer, gemm) -> GuidanceRecord rows
        self.routing = _Recorder()  # key layer -> int64 [n, k]
        self._installed: list[nn.Module] = []
        self._hooks: list = []
        self._last = None  # (input tensor, (layer, gemm), quantized operand) of the last linear call
        n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        self.num_layers = int(n) if n is not None else None

    # ---------------------------------------------------------------- helpers
    def _guided(self, layer: int | None) -> bool:
        if self.spec.act != "trace" or layer is None:
            return False
        if self.num_layers is None:
            raise RuntimeError("RolloutEmulator trace: model.config.num_hidden_layers is missing")
        return layer >= self.num_layers - self.spec.guided_layers

    @property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(row_seq, row_pos)`` int64 ``[N]`` of the next forward's token rows (-1: padding), or None."""
        return self._rows

    @rows.setter
    def rows(self, value: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self._rows = value
        # whether any row is padding is decided here, once per forward (one check on the rows' own
        # device: no device sync for host rows), not in each of the forward's GEMM calls
        self._row_masks = None if value is None or bool((value[0] >= 0).all()) else {}
        self._kept = None

    def _kept_rows(self, rows: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keep, seq[keep], pos[keep])``: the non-padding rows of ``rows`` (the current forward's
        ``(seq, pos)``; int64, on the rows' own device), computed once per forward: every captured GEMM and
        routing hook files the same rows."""
        if self._kept is None or self._kept[0] is not rows:
            seq, pos = rows
            keep = (seq >= 0).nonzero().flatten()
            self._kept = (rows, (keep, seq[keep], pos[keep]))
        return self._kept[1]

    def _valid(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(bool mask ``[n]``, int64 indices of the valid rows) on ``device``; None if every row is valid."""
        if self._rows is None:
            return None
        seq = self._rows[0]
        if seq.numel() != n:
            raise RuntimeError(f"RolloutEmulator: rows describe {seq.numel()} token rows, the GEMM sees {n}")
        if self._row_masks is None:
            return None
        key = torch.device(device)
        if key not in self._row_masks:
            mask = seq >= 0
            self._row_masks[key] = (mask.to(device), mask.nonzero().flatten().to(device))
        return self._row_masks[key]

    def _quant_act_cached(self, x: torch.Tensor, layer, gemm) -> torch.Tensor:
        """:meth:`_quant_act` once per input tensor: the members of a fused group (q/k/v, gate/up) see
        the same input object; vLLM quantizes it once for the fused GEMM (and captures it once)."""
        hit = self._last
        if hit is not None and hit[0] is x and hit[1] == (layer, gemm):
            return hit[2]
        xf = self._quant_act(x.reshape(-1, x.shape[-1]), layer, gemm)
        self._last = (x, (layer, gemm), xf)
        return xf

    def _quant_act(self, x2: torch.Tensor, layer, gemm) -> torch.Tensor:
        """float32 activation operand of ``x2`` ``[N, K]`` (padding rows excluded from the call)."""
        if self.spec.act == "none":
            return x2.to(torch.float32)
        act = ActQuant(
            "naive" if self.spec.act == "trace" else self.spec.act,
            self.spec.residual_ratio,
            self.spec.residual_per_token,
            backend=self.spec.act_backend,
            residual_combine=self.spec.combine,
            residual_granularity=self.spec.residual_granularity,
        )
        guided = self._guided(layer)
        if guided:
            act = ActQuant("trace", capture=True, backend=_BACKEND)
        valid = self._valid(x2.shape[0], x2.device)
        if valid is None:
            xf, rec = emulation.quantize_activation(x2, act)
            idx = None
        else:
            idx = valid[1]
            out = x2.to(torch.float32).clone()
            q, rec = emulation.quantize_activation(x2[idx], act)
            out[idx] = q
            xf = out
        if guided and rec is not None:
            if self.rows is None:
                raise RuntimeError("RolloutEmulator trace: set .rows before each forward to capture guidance")
            _, s, p = self._kept_rows(self.rows)  # the same rows as idx, on the rows' device
            self.guidance.add((layer, gemm), s, p, rec)
        return xf

    # ---------------------------------------------------------------- install
    def _linear_weights(self) -> dict[str, tuple[torch.Tensor, int | None, str]]:
        """name -> (float32 weight as the rollout's GEMM sees it, layer, gemm name)."""
        out = {}
        mods = dict(self.model.named_modules())
        done = set()
        for name, mod in mods.items():
            if not isinstance(mod, nn.Linear) or self.config.is_ignored(name) or name in done:
                continue
            parent, _, leaf = name.rpartition(".")
            group, fused = [name], leaf
            for members, fname in FUSED_GROUPS.items():
                if leaf in members:
                    group = [f"{parent}.{m}" for m in members if isinstance(mods.get(f"{parent}.{m}"), nn.Linear)]
                    fused = fname
            flags = {self.config.is_ignored(g) for g in group}
            if len(flags) > 1:
                raise ValueError(f"RolloutEmulator: {group} are fused into one GEMM; ignore all or none of them")
            ws = [mods[g].weight.detach() for g in group]
            if self.spec.weights:
                q = emulation.quantize_weight(torch.cat(ws, 0))
                wf = emulation.weight_f32(q.packed, q.block_scale, q.global_scale.reshape(()))
            else:
                wf = torch.cat(ws, 0).to(torch.float32)
            m = _LAYER_RE.search(parent + ".x")
            layer = int(m.group(1)) if m else None
            gemm = (m.group(2)[:-2] + "." if m and m.group(2) != "x" else "") + fused
            start = 0
            for g, w in zip(group, ws):
                out[g] = (wf[start : start + w.shape[0]], layer, gemm)
                start += w.shape[0]
                done.add(g)
        return out

    def _expert_weights(self, mod: nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for p in ("gate_up_proj", "down_proj"):
            w = getattr(mod, p).detach()
            if self.spec.weights:
                q = emulation.quantize_weight(w, reduce_dims=(1, 2))
                out[p] = emulation.weight_f32(q.packed, q.block_scale, q.global_scale.reshape(-1))
            else:
                out[p] = w.to(torch.float32)
        return out

    def install(self) -> "RolloutEmulator":
        if self._installed:
            raise RuntimeError("RolloutEmulator: already installed")
        if getattr(self.model, "_verl_quads_qat", None) is not None:
            raise RuntimeError("RolloutEmulator: the model has QAT applied; use a separate model instance")
        emu = self
        for name, (wf, layer, gemm) in self._linear_weights().items():
            mod = self.model.get_submodule(name)

            def fwd(x, _m=mod, _w=wf, _l=layer, _g=gemm):
                y = emulation.gemm(emu._quant_act_cached(x, _l, _g), _w, _m.bias, x.dtype)
                return y.reshape(*x.shape[:-1], y.shape[-1])

            mod.forward = fwd
            self._installed.append(mod)
        for name, mod in self.model.named_modules():
            three_d = [n for n, p in mod.named_parameters(recurse=False) if p.dim() == 3]
            if not three_d or self.config.is_ignored(name):
                continue
            if set(three_d) != {"gate_up_proj", "down_proj"} or getattr(mod, "is_transposed", False) or getattr(
                mod, "has_bias", False
            ):
                raise NotImplementedError(
                    f"RolloutEmulator: {name} ({type(mod).__name__}) has experts {three_d}; only gated "
                    f"[E, 2I, H]/[E, H, I] experts without bias are emulated (known: {sorted(EXPERT_PARAMS)})"
                )
            m = _LAYER_RE.search(name)
            layer, gemm = (int(m.group(1)), m.group(2)) if m else (None, name)
            ws = self._expert_weights(mod)

            def efwd(hidden_states, top_k_index, top_k_weights, _ws=ws, _l=layer, _g=gemm):
                return emu._experts_forward(_ws, hidden_states, top_k_index, top_k_weights, _l, _g)

            mod.forward = efwd
            self._installed.append(mod)
        for name, mod in self.model.named_modules():
            if name.endswith("mlp.gate") and not isinstance(mod, nn.Linear):
                m = _LAYER_RE.search(name)
                if m:
                    self._hooks.append(mod.register_forward_hook(self._routing_hook(int(m.group(1)))))
        return self

    def _routing_hook(self, layer: int):
        def hook(_mod, _inp, out):
            if self.rows is not None and isinstance(out, tuple) and len(out) == 3:
                keep, s, p = self._kept_rows(self.rows)
                self.routing.add(layer, s, p, out[2].detach()[keep.to(out[2].device)].cpu())

        return hook

    def remove(self) -> None:
        self._last = None
        for mod in self._installed:
            mod.__dict__.pop("forward", None)
        for h in self._hooks:
            h.remove()
        self._installed, self._hooks = [], []

    @contextlib.contextmanager
    def installed(self):
        self.install()
        try:
            yield self
        finally:
            self.remove()

    # ---------------------------------------------------------------- experts
    def _experts_forward(self, ws, x, topk_ids, topk_weights, layer, gemm) -> torch.Tensor:
        """Routed experts ``[T, H]``: the arithmetic of ``QuadsNVFP4MoEMethod.forward_reference``."""
        t = x.shape[0]
        k = topk_ids.shape[1]
        ids = topk_ids.to(torch.int64)
        valid = self._valid(t, x.device)
        if valid is not None:
            ids = torch.where(valid[0].unsqueeze(-1), ids, torch.full_like(ids, -1))
        slot_w = topk_weights.to(torch.float32)
        xf = self._quant_act(x, layer, gemm + ".w13")
        w13, w2 = ws["gate_up_proj"], ws["down_proj"]
        inter = w2.shape[-1]
        act_all = torch.zeros(t, k, inter, dtype=x.dtype, device=x.device)
        rows = {}
        for e in [int(e) for e in torch.unique(ids).tolist() if e >= 0]:
            tok, slot = (ids == e).nonzero(as_tuple=True)
            rows[e] = (tok, slot)
            h = emulation.gemm(xf[tok], w13[e], None, x.dtype)
            act_all[tok, slot] = (F.silu(h[:, :inter].to(torch.float32)) * h[:, inter:].to(torch.float32)).to(x.dtype)
        # expert-call rows are (token, slot) pairs, all valid
        saved_rows, saved_masks, self._rows, self._row_masks = self._rows, self._row_masks, None, None
        try:
            if self.spec.act == "quads" and not self.spec.residual_per_token:
                # per-call selection: one call per expert, as vLLM's per-expert GEMMs see it
                a_f = {e: self._quant_act(act_all[tok, slot], layer, gemm + ".w2") for e, (tok, slot) in rows.items()}
            elif self.spec.act == "none":
                a_f = {e: act_all[tok, slot].to(torch.float32) for e, (tok, slot) in rows.items()}
            else:
                # every row is quantized on its own (per-token scales; QUADS per-token selection is
                # batch-invariant), so one call over all (token, slot) rows equals per-expert calls
                sel = (ids >= 0).reshape(-1)
                flat = act_all.reshape(t * k, inter)
                f32 = flat.to(torch.float32).clone()
                f32[sel] = self._quant_act(flat[sel], None, gemm + ".w2")
                if self._guided(layer) and saved_rows is not None:
                    self._capture_w2(layer, gemm, flat, sel, ids, saved_rows, k)
                a_f = {e: f32.reshape(t, k, inter)[tok, slot] for e, (tok, slot) in rows.items()}
        finally:
            self._rows, self._row_masks = saved_rows, saved_masks
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        for e, (tok, slot) in rows.items():
            y = emulation.gemm(a_f[e], w2[e], None, x.dtype)
            out.index_add_(0, tok, y.to(torch.float32) * slot_w[tok, slot].unsqueeze(-1))
        return out.to(x.dtype)

    def _capture_w2(self, layer, gemm, flat, sel, ids, rows, k) -> None:
        """Guidance of the w2 input per (token, slot) row, filed per token as ``[k, I]`` + expert ids."""
        tok_valid, s, p = self._kept_rows(rows)
        x = flat.reshape(-1, k, flat.shape[-1])[tok_valid.to(flat.device)]
        _, rec = emulation.quantize_activation(x.reshape(-1, x.shape[-1]), ActQuant("trace", capture=True, backend=_BACKEND))
        n = x.shape[0]
        rec = GuidanceRecord(rec.bits.reshape(n, k, -1), rec.block_scale.reshape(n, k, -1),
                             rec.global_scale.reshape(n, k, 1), torch.Size((n, k, x.shape[-1])))
        self.guidance.add((layer, gemm + ".w2"), s, p, (rec, ids[tok_valid.to(ids.device)].cpu()))


# ------------------------------------------------------------------ assembling recorded rows
def assemble_routing(rec: _Recorder, n_seq: int, n_pos: int, top_k: int) -> torch.Tensor:
    """``[n_seq, n_pos, L, k]`` int64 of recorded routing (-1 where nothing was recorded)."""
    layers = sorted(rec.items)
    out = torch.full((n_seq, n_pos, len(layers), top_k), -1, dtype=torch.int64)
    for li, layer in enumerate(layers):
        for seq, pos, ids in rec.items[layer]:
            keep = pos < n_pos
            out[seq[keep], pos[keep], li] = ids[keep.to(ids.device)].to(torch.int64)
    return out


def assemble_guidance(rec: _Recorder, uids: list[str], policy_version: int = 0):
    """An :class:`~verl_quads.qat.InMemoryGuidanceStore` of per-sequence records, positions 0..T-1.

    Raises if a sequence's recorded positions are not contiguous from 0 (a capture gap is an error).
    """
    from verl_quads.qat import GuidanceKey, InMemoryGuidanceStore
    from verl_quads.rollout.capture import cat_records, slice_record

    store = InMemoryGuidanceStore()
    for (layer, gemm), parts in rec.items.items():
        for i, uid in enumerate(uids):
            recs, pos_l, eids_l = [], [], []
            for seq, pos, value in parts:
                sel = (seq == i).nonzero().flatten()
                if sel.numel() == 0:
                    continue
                r, e = value if isinstance(value, tuple) else (value, None)
                recs.append(slice_record(r, sel.to(r.bits.device)))
                pos_l.append(pos[sel])
                if e is not None:
                    eids_l.append(e[sel.to(e.device)])
            if not recs:
                raise RuntimeError(f"assemble_guidance: no record of sequence {uid!r} at layer {layer} {gemm}")
            pos = torch.cat(pos_l)
            order = torch.argsort(pos)
            if not torch.equal(pos[order], torch.arange(pos.numel())):
                raise RuntimeError(f"assemble_guidance: sequence {uid!r} {layer} {gemm}: positions not 0..T-1")
            full = cat_records(recs)
            full = slice_record(full, order.to(full.bits.device))
            eids = torch.cat(eids_l)[order] if eids_l else None
            store.put(GuidanceKey(uid, policy_version, layer, gemm), full, eids)
    return store


__all__ = ["ACT_MODES", "RolloutEmulator", "RolloutSpec", "assemble_guidance", "assemble_routing"]
