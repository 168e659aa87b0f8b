"""TRACE experts on grouped GEMMs (``QATState.expert_path = "grouped"``, the default) against the per-expert
loop (``"loop"``, the previous implementation, kept as the reference).

Both sort the (token, slot) rows by expert with a stable sort, so the quantized GEMM inputs come in the
same row order and are compared with ``torch.equal``. Guidance records are made by the trainer itself
(``TraceBatch.record_into``), then some of their bits are flipped so the guided rounding differs from
round-to-nearest and the test sees the guidance being applied row by row.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from qat_models import tiny_model, tokens

import verl_quads.qat.model as qm
from verl_quads.config import QuantConfig
from verl_quads.nvfp4 import fake_quantize, per_row_global_scale
from verl_quads.qat import GuidanceKey, InMemoryGuidanceStore, TraceBatch, apply_qat, trace_context

UIDS = ["a/0", "b/0"]


class _CaptureGuided:
    """Records every guided quantization's output (the quantized GEMM input the trainer multiplies)."""

    def __init__(self, monkeypatch):
        self.outs: list[torch.Tensor] = []
        real = qm.qdq_guided

        def spy(x, record, backend="auto", check_finite=True):
            y = real(x, record, backend, check_finite)
            self.outs.append(y.detach().clone())
            return y

        monkeypatch.setattr(qm, "qdq_guided", spy)


def _flip(store: InMemoryGuidanceStore, pred, seed: int = 0) -> None:
    """Flip a random half of the guidance bits of the records whose key matches ``pred``."""
    g = torch.Generator().manual_seed(seed)
    for (uid, layer, gemm), (v, e) in list(store._entries.items()):
        if pred(layer, gemm):
            r = e.record
            mask = torch.randint(0, 256, r.bits.shape, generator=g, dtype=torch.int32).to(torch.uint8)
            store.put(GuidanceKey(uid, v, layer, gemm), dataclasses.replace(r, bits=r.bits ^ mask), e.expert_ids)


def _expert_call(model, experts, tb, h, idx, wts, dy):
    experts.zero_grad(set_to_none=True)
    h = h.detach().clone().requires_grad_(True)
    w = wts.detach().clone().requires_grad_(True)
    with trace_context(model, tb):
        out = experts(h, idx, w)
    out.backward(dy)
    grads = {"hidden": h.grad, "weights": w.grad}
    grads.update({n: p.grad.clone() for n, p in experts.named_parameters()})
    return out.detach(), grads


@pytest.mark.parametrize("top_k", [2, 3])
def test_grouped_trace_experts_equal_per_expert_loop(top_k, monkeypatch):
    """One experts module, T=24 tokens of one sequence, top-k of 4 experts, guidance with flipped bits."""
    model = tiny_model("qwen3_moe", layers=1)
    state = apply_qat(model, QuantConfig(quant="trace", guided_layers=1))
    experts = model.model.layers[0].mlp.experts
    torch.manual_seed(5)
    n = 24
    h = torch.randn(n, 64).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(4)[:top_k] for _ in range(n)])
    wts = torch.rand(n, top_k).to(torch.bfloat16)
    dy = (torch.randn(n, 64) * 0.1).to(torch.bfloat16)

    # Recording (round to nearest): both paths store identical records.
    stores = {}
    for path in ("loop", "grouped"):
        state.expert_path = path
        store = InMemoryGuidanceStore()
        tb = TraceBatch.padded(store, 0, ["s"], torch.ones(1, n, dtype=torch.long))
        tb.record_into = store
        with torch.no_grad(), trace_context(model, tb):
            experts(h, idx, wts)
        stores[path] = store
    assert stores["loop"]._entries.keys() == stores["grouped"]._entries.keys()
    for key, (v, e) in stores["loop"]._entries.items():
        v2, e2 = stores["grouped"]._entries[key]
        assert v == v2 and torch.equal(e.record.bits, e2.record.bits)
        assert torch.equal(e.record.block_scale.view(torch.uint8), e2.record.block_scale.view(torch.uint8))
        assert torch.equal(e.record.global_scale, e2.record.global_scale)
        assert (e.expert_ids is None) == (e2.expert_ids is None)
        assert e.expert_ids is None or torch.equal(e.expert_ids, e2.expert_ids)

    store = stores["loop"]
    _flip(store, lambda layer, gemm: True)
    tb = TraceBatch.padded(store, 0, ["s"], torch.ones(1, n, dtype=torch.long))
    res = {}
    for path in ("loop", "grouped"):
        state.expert_path = path
        cap = _CaptureGuided(monkeypatch)
        out, grads = _expert_call(model, experts, tb, h, idx, wts, dy)
        res[path] = (cap.outs, out, grads)
        monkeypatch.undo()
    (c0, o0, g0), (c1, o1, g1) = res["loop"], res["grouped"]
    # Quantized GEMM inputs (w13 input per token, w2 input per (token, slot) row sorted by expert): bit-equal.
    assert len(c0) == len(c1) == 2
    assert all(torch.equal(a, b) for a, b in zip(c0, c1))
    # The flipped guidance was applied: the w2 input is not its round-to-nearest QDQ.
    assert not torch.equal(c1[1], fake_quantize(c1[1], per_row_global_scale(c1[1]), backend="torch"))
    if top_k == 2:
        # Two slots: the loop's bf16 index_add_ (0 + a, then + b: one rounding) equals the grouped path's
        # float32 sum with one cast; expert GEMMs per expert (F.linear) and grouped give the same bits here.
        assert torch.equal(o0, o1)
    else:
        # More slots: the loop rounds to bf16 after each slot's add, the grouped path (like transformers'
        # grouped_mm implementation) sums in float32 and rounds once: a few bf16 ulps apart.
        torch.testing.assert_close(o1.float(), o0.float(), rtol=2 ** -7, atol=2 ** -7 * o0.abs().max().item())
    for k in g0:
        if top_k == 2:
            assert torch.equal(g0[k], g1[k]), k
        else:
            torch.testing.assert_close(g1[k].float(), g0[k].float(), rtol=2 ** -6, atol=2 ** -6 * g0[k].abs().max().item())


def _run(model, ids, batch):
    model.zero_grad(set_to_none=True)
    with trace_context(model, batch):
        out = model(input_ids=ids).logits
        out.float().logsumexp(-1).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_grouped_trace_model_equals_loop_with_foreign_guidance(monkeypatch):
    """Whole tiny Qwen3-MoE (3 layers, 2 guided): logits, every gradient and every guided GEMM input of the
    grouped path equal the loop's (torch.equal), with guidance bits of the last layer's expert inputs flipped."""
    base = tiny_model("qwen3_moe", layers=3)
    loop, grouped = copy.deepcopy(base), copy.deepcopy(base)
    cfg = QuantConfig(quant="trace", guided_layers=2, trace_base_mode="w4a4_qat")
    apply_qat(loop, cfg).expert_path = "loop"
    assert apply_qat(grouped, cfg).expert_path == "grouped"  # the default
    ids = tokens()
    store = InMemoryGuidanceStore()
    rec = TraceBatch.padded(store, 3, UIDS, torch.ones_like(ids))
    rec.record_into = store
    with torch.no_grad(), trace_context(grouped, rec):
        grouped(input_ids=ids)
    # the last layer's expert GEMM inputs only: every router (upstream of them) sees the same input
    _flip(store, lambda layer, gemm: layer == 2 and gemm.startswith("mlp.experts"))
    tb = TraceBatch.padded(store, 3, UIDS, torch.ones_like(ids))
    cap0 = _CaptureGuided(monkeypatch)
    l0, g0 = _run(loop, ids, tb)
    monkeypatch.undo()
    cap1 = _CaptureGuided(monkeypatch)
    l1, g1 = _run(grouped, ids, tb)
    # 2 guided layers x (qkv_proj, o, w13, w2): q, k and v share one guided QDQ of their common input (one
    # GEMM and one record in vLLM; QATLinear._qat_input)
    assert len(cap0.outs) == len(cap1.outs) == 2 * 4
    assert all(torch.equal(a, b) for a, b in zip(cap0.outs, cap1.outs))
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)


def test_grouped_trace_routing_mismatch_is_an_error():
    model = tiny_model("qwen3_moe", layers=1)
    apply_qat(model, QuantConfig(quant="trace", guided_layers=1))
    ids = tokens()
    store = InMemoryGuidanceStore()
    rec = TraceBatch.padded(store, 0, UIDS, torch.ones_like(ids))
    rec.record_into = store
    with torch.no_grad(), trace_context(model, rec):
        model(input_ids=ids)
    v, e = store._entries[("a/0", 0, "mlp.experts.w2")]
    store.put(GuidanceKey("a/0", v, 0, "mlp.experts.w2"), e.record, (e.expert_ids + 1) % 4)
    with pytest.raises(qm.GuidanceError, match="routing differs .* on 8 token"):
        with trace_context(model, TraceBatch.padded(store, 0, UIDS, torch.ones_like(ids))):
            model(input_ids=ids)
