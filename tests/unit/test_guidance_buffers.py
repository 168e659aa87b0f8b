"""TRACE guidance through persistent buffers (``GuidanceStore.add`` / ``end_step``): what lets a CUDA-graph engine
record guidance. Under CUDA graphs the layers' Python runs once, while a graph is captured (no step open); each replay
re-runs only the kernels, i.e. the record's copies into the same buffers; ``end_step`` must then take the step's
rows of every guided GEMM of the model from those buffers. These tests drive the store as the runner hook and the
layers do, on CPU; the compiled guided linear goes through its custom op under ``torch.compile`` (Triton kernels
interpreted on CPU). The engine-level check (a CUDA-graph engine's records == an eager one's) is
tests/gpu/test_rollout_vllm_gpu.py."""

from __future__ import annotations

import pytest
import torch
from guidance_records import records_equal, row_record

from verl_quads.rollout import capture
from verl_quads.rollout.capture import GuidanceStore, get_store
from verl_quads.rollout.emulation import ActQuant

QKV, O = (0, "self_attn.qkv_proj"), (0, "self_attn.o_proj")


def test_replayed_steps_take_rows_written_without_python():
    """Capture: the layers' Python writes with no step open. Replays: the same buffers rewritten by 'kernels'
    (here in-place writes standing in for the graph's copies), steps opened and closed with no add at all -> each
    step's records are the buffers' rows [0, n) at the end of that step, kept although the next step rewrites
    them."""
    torch.manual_seed(0)
    store = GuidanceStore()
    store.enabled = True
    store.active_trace_keys = [QKV, O]
    store.add(*QKV, row_record(torch.randn(4, 32)))  # "capture" at the padded batch size 4: nothing taken
    store.add(*O, row_record(torch.randn(4, 64)))
    assert store.request_ids() == []
    steps = [torch.randn(4, 32), torch.randn(4, 32)]
    for i, x in enumerate(steps):
        store.begin_step(["a", "b"], [0, 1, 2], torch.tensor([5 + i, 9 + i, 0, 0]))  # 2 real rows + padding
        rec = row_record(x)  # the replayed kernels' output
        buf = store._trace_buf[QKV]
        buf.bits[:4].copy_(rec.bits)
        buf.block_scale[:4].view(torch.uint8).copy_(rec.block_scale.view(torch.uint8))
        buf.global_scale[:4].copy_(rec.global_scale)
        store.end_step()
    a, b = store.pop("a"), store.pop("b")
    assert a.positions.tolist() == [5, 6] and b.positions.tolist() == [9, 10]
    assert set(a.records) == {QKV, O}
    assert records_equal(a.records[QKV], row_record(torch.stack([steps[0][0], steps[1][0]])))
    assert records_equal(b.records[QKV], row_record(torch.stack([steps[0][1], steps[1][1]])))


def test_eager_step_writing_some_guided_gemms_is_refused():
    store = GuidanceStore()
    store.enabled = True
    store.active_trace_keys = [QKV, O]
    store.add(*O, row_record(torch.randn(2, 64)))  # an earlier forward wrote O's buffer
    store.begin_step(["a"], [0, 2], torch.tensor([0, 1]))
    store.add(*QKV, row_record(torch.randn(2, 32)))
    with pytest.raises(RuntimeError, match=r"guided GEMMs \[\(0, 'self_attn.o_proj'\)\] wrote no guidance"):
        store.end_step()


def test_a_guided_gemm_that_never_wrote_is_refused_even_after_replay():
    store = GuidanceStore()
    store.enabled = True
    store.active_trace_keys = [QKV, O]
    store.add(*QKV, row_record(torch.randn(2, 32)))
    store._trace_in_graph.add(QKV)  # what add() records when it runs inside a CUDA graph capture (no GPU here)
    store.begin_step(["a"], [0, 1], torch.tensor([0]))
    with pytest.raises(RuntimeError, match="o_proj"):
        store.end_step()


def test_buffers_sized_once_and_not_reallocated_under_a_captured_graph():
    store = GuidanceStore()
    store._rows = 16  # max_num_batched_tokens of the building engine
    store.register_trace_gemm(*QKV, k=32)  # what the layer does when vLLM builds it
    store.add(*QKV, row_record(torch.randn(3, 32)))
    buf = store._trace_buf[QKV]
    assert buf.bits.shape == (16, 4) and buf.block_scale.shape == (16, 2) and buf.global_scale.shape == (16, 1)
    store.add(*QKV, row_record(torch.randn(16, 32)))
    assert store._trace_buf[QKV].bits.data_ptr() == buf.bits.data_ptr()  # the same storage: graphs stay valid
    store._trace_in_graph.add(QKV)  # as if a CUDA graph had captured it
    with pytest.raises(RuntimeError, match=r"already captured in a CUDA graph.*max_num_batched_tokens"):
        store.add(*QKV, row_record(torch.randn(17, 32)))
    store.register_trace_gemm(*QKV, k=32)  # a new engine builds this GEMM: it will capture its own graphs
    store.add(*QKV, row_record(torch.randn(17, 32)))
    assert store._trace_buf[QKV].bits.shape[0] == 17


def test_w2_records_keep_their_slots_expert_ids():
    store = GuidanceStore()
    store.enabled = True
    key = (1, "mlp.experts.w2")
    x = torch.randn(3, 2, 32)  # [T, top_k, I]
    ids = torch.tensor([[0, 5], [7, -1], [2, 3]])
    rec = row_record(x)
    store.begin_step(["r"], [0, 3], torch.tensor([0, 1, 2]))
    store.add(*key, rec, expert_ids=ids)
    store.end_step()
    g = store.pop("r")
    assert records_equal(g.records[key], rec) and g.records[key].shape == (3, 2, 32)
    assert g.expert_ids[1].dtype == torch.int16 and g.expert_ids[1].tolist() == ids.tolist()  # int16 in the rows


@pytest.mark.parametrize("compile_backend", ["eager", "inductor"])
def test_compiled_guided_linear_records_as_eager(compile_backend, monkeypatch):
    """The guided linear of the triton backend under torch.compile runs as the custom op
    ``verl_quads::nvfp4_linear_guided`` (Dynamo does not trace the store); its output and records are the eager
    call's, bit for bit (same kernels)."""
    from verl_quads.rollout import emulation
    from verl_quads.rollout.linear import QuadsNVFP4LinearMethod, set_kernel_param

    torch.manual_seed(1)
    layer = torch.nn.Module()
    q = emulation.quantize_weight(torch.randn(32, 64, dtype=torch.bfloat16))
    for name, t in (("weight_packed", q.packed), ("weight_scale", q.block_scale),
                    ("weight_global_scale", q.global_scale.reshape(()))):
        set_kernel_param(layer, name, t)
    method = QuadsNVFP4LinearMethod(ActQuant("trace", capture=True), backend="triton", capture_key=O)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    # the process's store as the op sees it, fresh: engines built earlier in this process registered their GEMMs
    monkeypatch.setattr(capture, "_STORE", GuidanceStore())
    store = get_store()
    store.enabled, store.active_trace_keys = True, None
    out = {}
    for name, fn in (("eager", method.apply),
                     ("compiled", torch.compile(method.apply, backend=compile_backend, fullgraph=True))):
        store.begin_step([name], [0, 3], torch.arange(3))
        y = fn(layer, x)
        store.end_step()
        out[name] = (y, store.pop(name))
    (ye, ge), (yc, gc) = out["eager"], out["compiled"]
    assert torch.equal(ye, yc)
    assert set(gc.records) == {O} and records_equal(gc.records[O], ge.records[O])
    assert records_equal(ge.records[O], row_record(x))  # the rollout's codes (per-token global scale)
