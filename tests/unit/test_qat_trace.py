"""TRACE on the trainer side: guidance keyed by (uid, policy version, layer, GEMM); strict errors.

The guidance records here are made from the trainer's own activations (``TraceBatch.record_into``,
i.e. ``extract_guidance(quantize(x))``): a legitimate stand-in for the rollout in a unit test of the
trainer half. With its own round-to-nearest guidance, TRACE must reproduce ``w4a4_qat`` bit for bit.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from qat_models import tiny_model, tokens

from verl_quads.config import QuantConfig
from verl_quads.nvfp4 import GuidanceRecord
from verl_quads.qat import GuidanceError, GuidanceKey, InMemoryGuidanceStore, TraceBatch, apply_qat, trace_context

UIDS = ["a/0", "b/0"]


def _models(family="qwen3_moe"):
    base = tiny_model(family, layers=3)
    trace, rtn = copy.deepcopy(base), copy.deepcopy(base)
    apply_qat(trace, QuantConfig(quant="trace", guided_layers=2, trace_base_mode="w4a4_qat"))
    apply_qat(rtn, "w4a4_qat")
    return trace, rtn


def _run(model, ids, batch=None, mask=None):
    model.zero_grad(set_to_none=True)
    if batch is None:
        out = model(input_ids=ids, attention_mask=mask).logits
        out.float().logsumexp(-1).sum().backward()
    else:
        with trace_context(model, batch):
            out = model(input_ids=ids, attention_mask=mask).logits
            out.float().logsumexp(-1).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _record(model, ids, version=7, mask=None):
    store = InMemoryGuidanceStore()
    m = torch.ones_like(ids) if mask is None else mask
    tb = TraceBatch.padded(store, version, UIDS, m)
    tb.record_into = store
    with torch.no_grad(), trace_context(model, tb):
        model(input_ids=ids, attention_mask=mask)
    return store


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3"])
def test_trace_with_own_guidance_equals_round_to_nearest(family):
    trace, rtn = _models(family)
    ids = tokens()
    store = _record(trace, ids)
    # 2 guided layers x (qkv, o, w13, w2 | qkv, o, gate_up, down) x 2 sequences
    assert len(store) == 2 * 4 * 2
    assert {k[2] for k in store._entries} == (
        {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.experts.w13", "mlp.experts.w2"} if family == "qwen3_moe" else
        {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"})
    assert {k[1] for k in store._entries} == {1, 2}
    l0, g0 = _run(rtn, ids)
    l1, g1 = _run(trace, ids, TraceBatch.padded(store, 7, UIDS, torch.ones_like(ids)))
    assert torch.equal(l0, l1)
    assert all(torch.equal(g0[k], g1[k]) for k in g0)


def test_guidance_decides_the_rounding():
    trace, rtn = _models()
    ids = tokens()
    store = _record(trace, ids)
    # Flip every guidance bit of the last layer's expert-w2 input of one sequence (the last layer, so the
    # routing upstream stays the same): the rounding, and so the logits, must change.
    key = ("a/0", 2, "mlp.experts.w2")
    version, entry = store._entries[key]
    flipped = dataclasses.replace(entry.record, bits=entry.record.bits ^ 0xFF)
    store.put(GuidanceKey("a/0", version, 2, "mlp.experts.w2"), flipped, entry.expert_ids)
    l0, _ = _run(rtn, ids)
    l1, _ = _run(trace, ids, TraceBatch.padded(store, 7, UIDS, torch.ones_like(ids)))
    assert not torch.equal(l0[0], l1[0])
    assert torch.equal(l0[1], l1[1])  # the other sequence's guidance is untouched


def test_padded_batch_and_uncovered_last_position():
    trace, rtn = _models()
    ids = tokens(seq=8)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding: sequence b has 6 tokens
    store = _record(trace, ids, mask=mask)
    assert store.get(GuidanceKey("b/0", 7, 1, "self_attn.qkv_proj")).record.shape == (6, 64)
    # The rollout never feeds the last sampled token: records of n - 1 positions are accepted.
    for (uid, layer, gemm), (v, e) in list(store._entries.items()):
        r = e.record
        t = r.shape[0] - 1
        store.put(GuidanceKey(uid, v, layer, gemm),
                  GuidanceRecord(r.bits[:t], r.block_scale[:t], r.global_scale[:t], torch.Size((t, *r.shape[1:]))),
                  None if e.expert_ids is None else e.expert_ids[:t])
    l0, _ = _run(rtn, ids, mask=mask)
    l1, _ = _run(trace, ids, TraceBatch.padded(store, 7, UIDS, mask), mask=mask)
    assert torch.equal(l0[0], l1[0]) and torch.equal(l0[1, :6], l1[1, :6])


def test_stale_missing_and_foreign_guidance_are_errors():
    trace, _ = _models()
    ids = tokens()
    store = _record(trace, ids, version=7)
    ones = torch.ones_like(ids)
    with pytest.raises(GuidanceError, match="stale guidance .*policy version 7, the trainer is at 8"):
        _run(trace, ids, TraceBatch.padded(store, 8, UIDS, ones))
    with pytest.raises(GuidanceError, match="no guidance record for .*uid='c/0'"):
        _run(trace, ids, TraceBatch.padded(store, 7, ["a/0", "c/0"], ones))
    with pytest.raises(GuidanceError, match="no TraceBatch is active"):
        trace(input_ids=ids)
    # Wrong sequence length (a record made for another sequence): shape error naming the key.
    short = torch.ones_like(ids)
    short[0, 4:] = 0
    with pytest.raises(GuidanceError, match=r"uid='a/0'.*has shape \(8, 64\).*T in \(4, 3\)"):
        _run(trace, ids, TraceBatch.padded(store, 7, UIDS, short), mask=short)
    # The TraceBatch must describe this forward's token rows.
    with pytest.raises(GuidanceError, match="does not describe this forward"):
        _run(trace, ids, TraceBatch.packed(store, 7, UIDS, [8, 4]))


def test_routing_mismatch_is_an_error():
    trace, _ = _models()
    ids = tokens()
    store = _record(trace, ids)
    v, e = store._entries[("b/0", 1, "mlp.experts.w2")]
    store.put(GuidanceKey("b/0", v, 1, "mlp.experts.w2"), e.record, (e.expert_ids + 1) % 4)
    with pytest.raises(GuidanceError, match="layer 1 mlp.experts.w2: the trainer's routing differs .* on 8 token"):
        _run(trace, ids, TraceBatch.padded(store, 7, UIDS, torch.ones_like(ids)))


def test_packed_layout_matches_padded():
    # Dense model: without a varlen attention mask the second packed sequence attends to the first, which
    # would change MoE routing (an error, see above) - the keying is what is checked here.
    trace, _ = _models("qwen3")
    ids = tokens()
    store = _record(trace, ids)
    l_pad, _ = _run(trace, ids, TraceBatch.padded(store, 7, UIDS, torch.ones_like(ids)))
    # Same two sequences packed into one row [1, 16] with position ids restarting per sequence.
    packed = ids.reshape(1, -1)
    pos = torch.cat([torch.arange(8), torch.arange(8)]).unsqueeze(0)
    trace.zero_grad()
    tb = TraceBatch.packed(store, 7, UIDS, [8, 8])
    with trace_context(trace, tb), torch.no_grad():
        # Attention across the boundary differs from the padded run; only guided-GEMM keying is checked
        # on the first sequence, whose tokens see no other sequence in causal attention.
        out = trace(input_ids=packed, position_ids=pos).logits
    assert torch.equal(out[0, :8], l_pad[0])


def test_rollout_capture_provider_adapts_request_guidance():
    """The trainer reads the rollout's capture format (verl_quads.rollout.capture.RequestGuidance) directly."""
    from verl_quads.qat import RolloutGuidanceProvider

    try:
        from verl_quads.rollout.capture import RequestGuidance
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"rollout capture unavailable: {e}")
    trace, rtn = _models()
    ids = tokens()
    store = _record(trace, ids)
    caps = {}
    for uid in UIDS:
        recs, eids = {}, {}
        for (u, layer, gemm), (v, e) in store._entries.items():
            if u == uid:
                recs[(layer, gemm)] = e.record
                if e.expert_ids is not None:
                    eids[layer] = e.expert_ids
        caps[uid] = RequestGuidance(f"req-{uid}", torch.arange(ids.shape[1]), recs, eids, policy_version=7)
    provider = RolloutGuidanceProvider(caps)
    l0, _ = _run(rtn, ids)
    l1, _ = _run(trace, ids, TraceBatch.padded(provider, 7, UIDS, torch.ones_like(ids)))
    assert torch.equal(l0, l1)
    with pytest.raises(GuidanceError, match="the rollout ran policy version 7, the trainer is at 9"):
        _run(trace, ids, TraceBatch.padded(provider, 9, UIDS, torch.ones_like(ids)))
    caps["a/0"].positions = torch.tensor([0, 1, 2, 4, 5, 6, 7, 8])
    with pytest.raises(GuidanceError, match="prefix caching"):
        _run(trace, ids, TraceBatch.padded(provider, 7, UIDS, torch.ones_like(ids)))


def test_gemm_names_are_layer_paths_with_vllm_fused_names_through_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_model("qwen3_moe", layers=2)
    model.model.layers[0] = checkpoint_wrapper(model.model.layers[0])  # activation checkpointing renames
    state = apply_qat(model, QuantConfig(quant="trace", guided_layers=2))
    names = {(layer, gemm) for _, gemm, layer, _ in state.modules.values()}
    assert names == {(i, g) for i in (0, 1) for g in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.experts")}


def test_one_sequence_with_the_last_position_uncovered_equals_round_to_nearest():
    """One sequence per micro-batch (its record gathered without a concatenation or fill row) whose records
    are n-1 long, as every verl rollout's (the last position has none): covered rows follow the record, the
    last row gets its own round-to-nearest guidance; with the model's own records that is ``w4a4_qat``."""
    trace, rtn = _models("qwen3_moe")
    ids = tokens()[:1]
    store = InMemoryGuidanceStore()
    tb = TraceBatch.padded(store, 7, ["a/0"], torch.ones_like(ids))
    tb.record_into = store
    with torch.no_grad(), trace_context(trace, tb):
        trace(input_ids=ids)
    for (uid, layer, gemm), (v, e) in list(store._entries.items()):
        r = e.record
        short = GuidanceRecord(r.bits[:-1], r.block_scale[:-1], r.global_scale[:-1], (r.shape[0] - 1, *r.shape[1:]))
        store.put(GuidanceKey(uid, v, layer, gemm), short, None if e.expert_ids is None else e.expert_ids[:-1])
    l0, g0 = _run(rtn, ids)
    l1, g1 = _run(trace, ids, TraceBatch.padded(store, 7, ["a/0"], torch.ones_like(ids)))
    assert torch.equal(l0, l1)
    assert all(torch.equal(g0[k], g1[k]) for k in g0)
