"""Router replay for TRACE: guided MoE layers route every covered token to the rollout's experts.

verl 0.9.1 ships rollout router replay (R3) only for its Megatron and VeOmni engines
(``actor.megatron.router_replay`` / ``actor.veomni.router_replay``; vLLM's
``enable_return_routed_experts``, which verl allows only from vLLM 0.22 and documents as correct for
hybrid-attention models); its FSDP engine has none. TRACE needs it: guided rounding of the experts'
inputs is keyed by (token, routing slot), so the trainer must use the rollout's experts in the
rollout's slot order. The expert ids already travel with the guidance record (beside each guided
layer's ``mlp.experts.w2`` record), so no extra data is needed.

:func:`install_router_replay` puts a forward hook on the router (``<layer>.mlp.gate``, a module
returning ``(router_logits, top_k_weights, top_k_index)`` such as transformers 5's
``Qwen3MoeTopKRouter``) of every guided decoder layer. Inside a :func:`~verl_quads.qat.trace_context`
the hook replaces ``top_k_index`` by the rollout's ids for covered rows and recomputes the weights
from the trainer's own router probabilities at those ids (softmax in float32, gather,
renormalised if ``norm_topk_prob``, cast to the logits' dtype), so the router keeps its gradient;
rows the record does not cover (padding, the last position) keep the trainer's routing. Where the
trainer's own choice equals the rollout's, the output is bit-identical to the stock router's.
Outside a trace context the hook raises (a guided layer without guidance is an error anyway),
except in the trace batch's recording mode (tests), where routing is left alone.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from verl_quads.qat.guidance import GuidanceError

_GATE_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


class ReplayStats:
    """Token-rows whose routing the replay changed, over all hooked layers.

    Counted on the device (no host sync in the forward); reading ``tokens`` or ``changed`` syncs once.
    """

    def __init__(self) -> None:
        self._host = [0, 0]
        self._dev: torch.Tensor | None = None  # int64 [2] running (tokens, changed) on the model's device

    def add(self, tokens: torch.Tensor, changed: torch.Tensor) -> None:
        """Add 0-d device counts (no sync)."""
        t = torch.stack([tokens, changed]).to(torch.long)
        if self._dev is not None and self._dev.device != t.device:
            self._flush()
        self._dev = t if self._dev is None else self._dev + t

    def _flush(self) -> list[int]:
        if self._dev is not None:
            a, b = self._dev.tolist()
            self._host = [self._host[0] + a, self._host[1] + b]
            self._dev = None
        return self._host

    @property
    def tokens(self) -> int:
        return self._flush()[0]

    @property
    def changed(self) -> int:
        return self._flush()[1]


def _replay(module: nn.Module, state, layer: int, stats: ReplayStats, output):
    tb = state.trace
    if tb is None:
        raise GuidanceError(f"TRACE: router of guided layer {layer} ran without an active TraceBatch")
    if tb.record_into is not None:
        return output
    logits, weights, index = output
    eids, covered = tb.routing(layer, "mlp.experts.w2", logits.device)
    if eids.shape != index.shape:
        raise GuidanceError(
            f"TRACE: layer {layer}: the rollout routed {tuple(eids.shape)} (rows, top_k), the trainer's router "
            f"gives {tuple(index.shape)}"
        )
    new_index = torch.where(covered[:, None], eids, index.long()).to(index.dtype)
    with torch.no_grad():
        diff = (torch.sort(new_index, -1).values != torch.sort(index, -1).values).any(-1) & covered
        stats.add(covered.sum(), diff.sum())
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    w = probs.gather(1, new_index.long())
    if getattr(module, "norm_topk_prob", False):
        w = w / w.sum(dim=-1, keepdim=True)
    return logits, w.to(logits.dtype), new_index


def install_router_replay(model: nn.Module, state) -> ReplayStats:
    """Hook the routers of the guided decoder layers of a QAT model (``state``: its QATState).

    Raises ``ValueError`` if a guided MoE layer has no recognisable router.
    """
    guided = {layer for kind, _, layer, act in state.modules.values() if kind == "experts" and act == "guided"}
    stats = ReplayStats()
    hooked = set()
    for name, mod in model.named_modules():
        m = _GATE_RE.search(name)
        if m is None or int(m.group(1)) not in guided:
            continue
        layer = int(m.group(1))
        if not all(hasattr(mod, a) for a in ("top_k", "weight")):
            raise ValueError(f"verl-quads router replay: {name} ({type(mod).__name__}) is not a top-k router")

        def hook(module, args, output, _layer=layer):
            return _replay(module, state, _layer, stats, output)

        mod.register_forward_hook(hook)
        hooked.add(layer)
    missing = guided - hooked
    if missing:
        raise ValueError(f"verl-quads router replay: no router found for guided MoE layers {sorted(missing)}")
    return stats


__all__ = ["install_router_replay", "ReplayStats"]
