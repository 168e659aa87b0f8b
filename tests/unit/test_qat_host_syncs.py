"""No device->host synchronisation in the steady-state QAT forward+backward (issue 4, overhead goals).

:class:`verl_quads.qat.host_sync.HostSyncRecorder` records every op that would make the host wait for
a CUDA device (``.item()``/``bool(t)``, ``nonzero``/boolean-mask indexing, ``tolist``, ``equal``, ...;
its docstring lists them and why). Here it watches one forward+backward of the tiny Qwen3-MoE in each
trainer mode, after one warm-up step, on the code path a GPU runs: NVFP4 backend ``triton`` (run by the
Triton interpreter on CPU; the torch reference backend is the CPU path and checks its global scale on
the host), transformers' ``grouped_mm`` experts (a Qwen3-MoE's default; the ``eager`` per-expert loop
is transformers' own and syncs by design).

TRACE runs as verl runs it: router replay installed, guidance records from the trainer's own first
forward (``TraceBatch.record_into``), a one-layer model whose layer is guided, two sequences of a padded batch, a new :class:`TraceBatch` for
the recorded step (a micro-batch's one-time host work happens when its TraceBatch is built, outside
the model). Checks that need the host (routing equal to the rollout's, finite weights) are deferred to
``TraceBatch.verify`` / ``QATState.verify``; the tests below also show they still raise.
"""

from __future__ import annotations

import os

import pytest
import torch
from qat_models import tiny_model, tokens

from verl_quads.config import QuantConfig
from verl_quads.qat import InMemoryGuidanceStore, TraceBatch, apply_qat, trace_context
from verl_quads.qat.host_sync import HostSyncRecorder
from verl_quads.qat.replay import install_router_replay

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (CPU)"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # the Triton interpreter's numpy on NaN weights
]

UIDS = ["s0/0", "s1/0"]


def _model(quant: str):
    model = tiny_model("qwen3_moe", layers=1, experts_impl="grouped_mm")
    state = apply_qat(model, QuantConfig(quant=quant, guided_layers=1), backend="triton")
    return model, state


def _step(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask).logits
    out.float().square().mean().backward()


def _recorded_step(model, ids, mask) -> HostSyncRecorder:
    with HostSyncRecorder() as rec:
        _step(model, ids, mask)
    return rec


@pytest.mark.parametrize("quant", ["w4a16", "w4a4_qat"])
def test_no_host_sync_in_steady_state_forward_backward(quant):
    model, _ = _model(quant)
    ids = tokens(2, 8)
    mask = torch.ones_like(ids)
    _step(model, ids, mask)  # warm-up (first-call work is allowed to sync)
    rec = _recorded_step(model, ids, mask)
    assert len(rec) == 0, f"{quant}: {len(rec)} host syncs in one forward+backward:\n{rec.summary()}"


def _trace_setup():
    model, state = _model("trace")
    ids = tokens(2, 8)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding in the 2nd sequence: uncovered rows take the round-to-nearest path
    store = InMemoryGuidanceStore()
    rec_tb = TraceBatch.padded(store, 3, UIDS, mask)
    rec_tb.record_into = store
    with torch.no_grad(), trace_context(model, rec_tb):
        model(input_ids=ids, attention_mask=mask)
    install_router_replay(model, state)
    return model, state, store, ids, mask


def test_no_host_sync_in_steady_state_trace_forward_backward():
    model, state, store, ids, mask = _trace_setup()
    with trace_context(model, TraceBatch.padded(store, 3, UIDS, mask)):
        _step(model, ids, mask)  # warm-up
    tb = TraceBatch.padded(store, 3, UIDS, mask)  # a new micro-batch
    with trace_context(model, tb):  # verify() at exit is outside the recorded region
        rec = _recorded_step(model, ids, mask)
    assert len(rec) == 0, f"trace: {len(rec)} host syncs in one forward+backward:\n{rec.summary()}"


def test_recorder_sees_the_syncs_it_claims():
    """The recorder itself: each listed kind of op is recorded, integer indexing and device ops are not."""
    x = torch.arange(12.0).view(3, 4)
    with HostSyncRecorder() as rec:
        _ = x[1, 2].item()
        _ = bool(x.sum() > 0)
        _ = x[x > 3]
        _ = torch.nonzero(x)
        _ = x.tolist()
        _ = torch.equal(x, x)
        _ = torch.bincount(x.long().flatten())
        _ = torch.repeat_interleave(x.flatten(), torch.ones(12, dtype=torch.long))
        _ = x.cpu()
    kinds = [e.reason for e in rec.events]
    assert len(kinds) == 9, rec.summary()
    assert any("boolean mask" in k for k in kinds) and "Tensor.tolist" in kinds and "aten.equal" in kinds
    with HostSyncRecorder() as rec2:
        i = torch.tensor([2, 0])
        _ = x[i]
        _ = torch.repeat_interleave(x.flatten(), torch.ones(12, dtype=torch.long), output_size=12)
        _ = (x > 3).any()
        _ = torch.histc(x, bins=4, min=0, max=11)
        _ = torch.argsort(x.flatten(), stable=True)
    assert len(rec2) == 0, rec2.summary()


def test_nonfinite_weight_is_reported_by_verify_naming_the_parameter_and_expert():
    """The deferred finite check (no sync in the forward): ``QATState.verify`` names the parameter and expert."""
    model, state = _model("w4a16")
    ids = tokens(1, 8)
    with torch.no_grad():
        model.model.layers[0].mlp.experts.down_proj[2, 0, 3] = float("nan")
        model.model.layers[0].self_attn.k_proj.weight[1, 1] = float("inf")
    with HostSyncRecorder() as rec:
        model(input_ids=ids)
    assert len(rec) == 0, rec.summary()
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight, "
                                         r"model\.layers\.0\.mlp\.experts\.down_proj \(experts \[2\]\)"):
        state.verify()
    state.verify()  # flags are consumed: nothing noted since
    with torch.no_grad():
        model.model.layers[0].mlp.experts.down_proj[2, 0, 3] = 0.0
        model.model.layers[0].self_attn.k_proj.weight[1, 1] = 0.0
    model(input_ids=ids)
    state.verify()


def test_routing_mismatch_raises_at_trace_context_exit():
    """The routing check is deferred out of the forward (no sync) and raised by ``TraceBatch.verify``."""
    from verl_quads.qat import GuidanceError, GuidanceKey

    model, state = _model("trace")
    ids = tokens(2, 8)
    mask = torch.ones_like(ids)
    store = InMemoryGuidanceStore()
    rec_tb = TraceBatch.padded(store, 3, UIDS, mask)
    rec_tb.record_into = store
    with torch.no_grad(), trace_context(model, rec_tb):
        model(input_ids=ids, attention_mask=mask)
    v, e = store._entries[("s1/0", 0, "mlp.experts.w2")]
    store.put(GuidanceKey("s1/0", v, 0, "mlp.experts.w2"), e.record, (e.expert_ids + 1) % 4)
    tb = TraceBatch.padded(store, 3, UIDS, mask)
    with pytest.raises(GuidanceError, match="layer 0 mlp.experts.w2: the trainer's routing differs .* on 8 token"):
        with trace_context(model, tb):
            with HostSyncRecorder() as rec:
                model(input_ids=ids, attention_mask=mask)
            assert len(rec) == 0, rec.summary()


def test_expert_weight_qdq_is_one_launch_per_tensor_with_per_expert_scale(monkeypatch):
    """All E experts of a fused 3-D weight: one amax reduction over dims (1, 2) and ONE QDQ call = one Triton
    kernel launch, which derives the per-expert global scale ``[E, 1, 1]`` from that amax itself, not a loop
    over experts (and no torch ops for the scale)."""
    import verl_quads.qat.weights as qw_mod
    from verl_quads.nvfp4 import fake_quantize, global_scale_from_amax, triton_kernels

    model, _ = _model("w4a16")
    experts = model.model.layers[0].mlp.experts
    launches, calls = [], []
    real_launch, real_quant2, real_ste = triton_kernels._launch, triton_kernels._quant2, qw_mod.fake_quantize_ste

    def spy_launch(kernel, grid, *args, **meta):  # v1 kernels
        launches.append(kernel)
        return real_launch(kernel, grid, *args, **meta)

    def spy_quant2(*args, **kw):  # the v2 quantize/QDQ kernel (one launch per call)
        launches.append("_quant2")
        return real_quant2(*args, **kw)

    def spy_ste(x, gs=None, **kw):
        calls.append((x, gs, kw.get("amax")))
        return real_ste(x, gs, **kw)

    monkeypatch.setattr(triton_kernels, "_launch", spy_launch)
    monkeypatch.setattr(triton_kernels, "_quant2", spy_quant2)
    monkeypatch.setattr(qw_mod, "fake_quantize_ste", spy_ste)
    with torch.no_grad():
        qw = experts._qdq_weights()
    assert len(launches) == 2 and len(calls) == 2, (launches, len(calls))  # gate_up_proj, down_proj
    for (x, gs, amax), p in zip(calls, ("gate_up_proj", "down_proj")):
        w = getattr(experts, p)
        want_amax = w.detach().abs().amax(dim=(1, 2), keepdim=True)
        want_gs = global_scale_from_amax(want_amax.float())
        assert x is w and gs is None and amax.shape == (w.shape[0], 1, 1) and torch.equal(amax, want_amax)
        assert torch.equal(qw[p], fake_quantize(w.detach(), want_gs, backend="torch"))

def test_micro_batch_guidance_travels_in_one_copy():
    """verl integration: the micro-batch's record tensors go to the device as views of ONE buffer (one
    asynchronous copy on CUDA; here the same packing into a host buffer), values/dtypes/shapes intact."""
    from verl_quads.integration.trace import _one_copy

    g = torch.Generator().manual_seed(0)
    ts = [torch.randint(0, 256, (5, 3), generator=g, dtype=torch.uint8),
          torch.randn(5, 1, generator=g),
          torch.randint(0, 256, (7, 2, 1), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn),
          torch.randint(-1, 8, (5, 2), generator=g).to(torch.int16),
          torch.randn(3, 2, 1, generator=g)[:, ::2]]  # non-contiguous
    out = _one_copy(ts, torch.device("cpu"), pin=False)
    base = out[0].untyped_storage().data_ptr()
    for t, o in zip(ts, out):
        assert o.dtype == t.dtype and o.shape == t.shape
        assert torch.equal(o.view(torch.uint8), t.contiguous().view(torch.uint8))
        assert o.untyped_storage().data_ptr() == base and o.data_ptr() % 16 == 0


def test_fused_group_scale_computed_once_per_forward_and_never_stale(monkeypatch):
    """q/k/v share one global scale: the first member computes it (3 amaxes), k and v reuse it in the same
    forward; a weight changed in place in between (version counter) or a new weight tensor makes the member
    compute afresh, so the scale always matches the weights the forward sees."""
    import verl_quads.qat.model as qm
    from verl_quads.nvfp4 import fake_quantize
    from verl_quads.qat.weights import linear_global_scale

    model, _ = _model("w4a16")
    attn = model.model.layers[0].self_attn
    calls = []
    real = qm.abs_max
    monkeypatch.setattr(qm, "abs_max", lambda w, *a, **k: (calls.append(w), real(w, *a, **k))[1])
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        for p in ("q_proj", "k_proj", "v_proj"):
            getattr(attn, p)(x)
        assert len(calls) == 3  # once for the group
        attn.q_proj(x)
        attn.k_proj.weight.mul_(2.0)  # in place between q and k: k must not take q's stash
        yk = attn.k_proj(x)
        ws = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        gs = linear_global_scale(ws)
        want = torch.nn.functional.linear(x, fake_quantize(attn.k_proj.weight, gs, backend="torch"))
        assert torch.equal(yk, want) and len(calls) == 9
        assert attn.q_proj._qat_stash is attn.v_proj._qat_stash


def test_merged_record_with_uncovered_rows_equals_the_masked_merge():
    """Own round-to-nearest guidance for the uncovered rows only (index_copy, no sync) == quantizing every
    row and merging with ``torch.where`` (the reference path, which reads ``covered`` on the host)."""
    from verl_quads.nvfp4 import extract_guidance, quantize
    from verl_quads.qat.activations import merged_record, per_token_global_scale

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(12, 2, 64, generator=g) * torch.logspace(-2, 2, 12).view(12, 1, 1)).to(torch.bfloat16)
    other = torch.randn(12, 2, 64, generator=g).to(torch.bfloat16)
    rec = extract_guidance(quantize(other, per_token_global_scale(other), backend="torch"))
    parts = (rec.bits, rec.block_scale, rec.global_scale)
    covered = torch.tensor([1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    want = merged_record(x, parts, covered, backend="torch")
    got = merged_record(x, parts, covered, backend="torch", uncovered_rows=torch.tensor([2, 4, 5, 9]))
    assert torch.equal(got.bits, want.bits) and torch.equal(got.global_scale, want.global_scale)
    assert torch.equal(got.block_scale.view(torch.uint8), want.block_scale.view(torch.uint8))
    assert not torch.equal(want.bits, rec.bits)  # the uncovered rows did change
    full = merged_record(x, parts, torch.ones(12, dtype=torch.bool), backend="torch",
                         uncovered_rows=torch.empty(0, dtype=torch.long))
    assert torch.equal(full.bits, rec.bits)


def test_grouped_experts_with_uncovered_rows_equal_the_loop_reference():
    """TRACE experts with padding + records one position short (uncovered rows) and foreign guidance
    (flipped bits): the grouped path (uncovered (token, slot) rows found by the inverse sort, no sync)
    equals the per-expert loop reference (masked merge) in logits and gradients, bit for bit."""
    import dataclasses

    from verl_quads.nvfp4 import GuidanceRecord
    from verl_quads.qat import GuidanceKey

    model = tiny_model("qwen3_moe", layers=1)
    state = apply_qat(model, QuantConfig(quant="trace", guided_layers=1))  # torch backend on CPU
    ids = tokens(2, 8)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    store = InMemoryGuidanceStore()
    rec_tb = TraceBatch.padded(store, 1, UIDS, mask)
    rec_tb.record_into = store
    with torch.no_grad(), trace_context(model, rec_tb):
        model(input_ids=ids, attention_mask=mask)
    g = torch.Generator().manual_seed(0)
    for (uid, layer, gemm), (v, e) in list(store._entries.items()):
        r, t = e.record, e.record.shape[0] - 1
        flip = torch.randint(0, 256, r.bits[:t].shape, generator=g, dtype=torch.int32).to(torch.uint8)
        short = GuidanceRecord(r.bits[:t] ^ flip, r.block_scale[:t], r.global_scale[:t], torch.Size((t, *r.shape[1:])))
        store.put(GuidanceKey(uid, v, layer, gemm), dataclasses.replace(short), None if e.expert_ids is None
                  else e.expert_ids[:t])
    install_router_replay(model, state)  # the flipped guidance moves the router's input: replay the records' routing
    out = {}
    for path in ("grouped", "loop"):
        state.expert_path = path
        model.zero_grad(set_to_none=True)
        with trace_context(model, TraceBatch.padded(store, 1, UIDS, mask)):
            logits = model(input_ids=ids, attention_mask=mask).logits
            logits.float().square().mean().backward()
        out[path] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (l0, g0), (l1, g1) = out["grouped"], out["loop"]
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)
