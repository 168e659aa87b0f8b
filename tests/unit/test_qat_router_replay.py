"""Router replay for TRACE (verl_quads/qat/replay.py): guided MoE layers follow the rollout's routing.

Records come from the trainer's own forward (``TraceBatch.record_into``, as in test_qat_trace.py); a
"rollout" that routed differently is simulated by rewriting the record's expert ids.
"""

from __future__ import annotations

import pytest
import torch
from test_qat_trace import UIDS, _models, _record, _run

from verl_quads.qat import GuidanceError, GuidanceKey, TraceBatch
from verl_quads.qat.replay import install_router_replay


def _state(model):
    return model._verl_quads_qat


def test_replay_is_a_no_op_when_routing_agrees():
    trace, _ = _models()
    ids = __import__("qat_models").tokens()
    store = _record(trace, ids)
    ref, ref_g = _run(trace, ids, TraceBatch.padded(store, 7, UIDS, torch.ones_like(ids)))
    stats = install_router_replay(trace, _state(trace))
    out, g = _run(trace, ids, TraceBatch.padded(store, 7, UIDS, torch.ones_like(ids)))
    assert torch.equal(out, ref)
    assert all(torch.equal(g[k], ref_g[k]) for k in ref_g)
    assert stats.tokens == 2 * 2 * 8 and stats.changed == 0  # 2 guided layers x 2 sequences x 8 tokens


def test_replay_follows_the_rollout_routing_and_keeps_router_gradient():
    trace, _ = _models()
    ids = __import__("qat_models").tokens()
    store = _record(trace, ids)
    v, e = store._entries[("b/0", 1, "mlp.experts.w2")]
    other = (e.expert_ids + 1) % 4  # the tiny model has 4 experts
    store.put(GuidanceKey("b/0", v, 1, "mlp.experts.w2"), e.record, other)
    with pytest.raises(GuidanceError, match="routing differs"):
        _run(trace, ids, TraceBatch.padded(store, 7, UIDS, torch.ones_like(ids)))
    stats = install_router_replay(trace, _state(trace))
    seen = {}
    gate = trace.model.layers[1].mlp.gate
    h = gate.register_forward_hook(lambda m, a, o: seen.__setitem__("idx", o[2]))  # runs after the replay hook
    try:
        _, grads = _run(trace, ids, TraceBatch.padded(store, 7, UIDS, torch.ones_like(ids)))
    finally:
        h.remove()
    assert stats.changed == 8  # every token of sequence b in layer 1
    assert torch.equal(seen["idx"][8:].long(), other.long())
    assert grads["model.layers.1.mlp.gate.weight"].abs().sum() > 0


def test_replay_without_trace_batch_is_an_error():
    trace, _ = _models()
    install_router_replay(trace, _state(trace))
    with pytest.raises(GuidanceError):
        trace(input_ids=__import__("qat_models").tokens())
