"""TRACE's guidance store on CUDA (verl_quads/rollout/capture.py): records handed over by the guided GEMMs are copied
to pinned host memory without waiting, and a pop after the steps gives each request exactly its rows of every record
(bits, block scales, global scales, expert ids, positions), even when the device tensors (the record buffers, the
runner's positions buffer) are rewritten right after the step ends
(in stream order, as the caching allocator reuses them) and the device is still busy when the step's copies are
enqueued."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_cuda_records_copied_without_waiting_pop_exact_rows():
    from verl_quads import nvfp4 as nv
    from verl_quads.rollout.capture import GuidanceStore

    store = GuidanceStore()
    store.enabled = True
    g = torch.Generator(device="cuda").manual_seed(0)
    reqs = ["a", "b", "c"]
    want: dict[str, list] = {r: [] for r in reqs}
    busy = torch.randn(4096, 4096, device="cuda")
    posbuf = torch.zeros(64, dtype=torch.int64, device="cuda")
    for step in range(6):
        n_per = [4, 2, 3] if step == 0 else [1, 1, 1]
        qsl = [0]
        for n in n_per:
            qsl.append(qsl[-1] + n)
        n = qsl[-1]
        pos = [p for k in n_per for p in (range(k) if step == 0 else [step + 3])]
        posbuf[:n] = torch.tensor(pos, device="cuda")  # the runner's persistent positions buffer (2 padding rows)
        store.begin_step(reqs, qsl, posbuf[: n + 2])
        for _ in range(4):  # the device is busy: the copies are still pending when the host goes on
            busy = busy @ busy / 64.0
        x = (torch.randn((n + 2) * 8, 64, device="cuda", generator=g) * 3).to(torch.bfloat16)  # 2 padding rows
        q, rec = nv.quantize_with_guidance(x, amax="row", backend="triton", check_finite=False)
        rec = nv.GuidanceRecord(rec.bits.reshape(n + 2, 8, -1), rec.block_scale.reshape(n + 2, 8, -1),
                                rec.global_scale.reshape(n + 2, 8, 1), torch.Size((n + 2, 8, 64)))  # [T, top_k, I]
        ids = torch.randint(0, 128, (n + 2, 8), device="cuda", generator=g, dtype=torch.int32)
        store.add(5, "mlp.experts.w2", rec, expert_ids=ids)
        host = (rec.bits[:n].cpu(), rec.block_scale[:n].view(torch.uint8).cpu(), rec.global_scale[:n].cpu(),
                ids[:n].to(torch.int64).cpu())  # the reference (waits)
        for _ in range(4):  # busy again: the step's copies are still pending when the device memory is rewritten
            busy = busy @ busy / 64.0
        step_obj = store._current
        store.end_step()
        assert step_obj.copied is not None and step_obj.packed.is_pinned()
        assert step_obj.positions.is_pinned()  # copied without waiting, like the records
        # the store now holds host buffers only; the device memory is rewritten (as the caching allocator reuses it)
        # in stream order after the copies
        for t in (rec.bits, rec.block_scale.view(torch.uint8), rec.global_scale, ids, posbuf):
            t.fill_(0)
        buf = store._trace_buf[(5, "mlp.experts.w2")]  # the persistent record buffers, rewritten by the next forward
        for t in (buf.bits, buf.block_scale.view(torch.uint8), buf.global_scale):
            t.fill_(0)
        host = host + (torch.tensor(pos),)
        for j, r in enumerate(reqs):
            want[r].append(tuple(h[qsl[j]:qsl[j + 1]] for h in host))
    for r in reqs:
        got = store.pop(r)
        rec = got.records[(5, "mlp.experts.w2")]
        assert rec.bits.device.type == "cpu"
        assert torch.equal(rec.bits, torch.cat([w[0] for w in want[r]]))
        assert torch.equal(rec.block_scale.view(torch.uint8), torch.cat([w[1] for w in want[r]]))
        assert torch.equal(rec.global_scale, torch.cat([w[2] for w in want[r]]))
        assert torch.equal(got.expert_ids[5], torch.cat([w[3] for w in want[r]]))
        assert got.positions.tolist() == sorted(torch.cat([w[4] for w in want[r]]).tolist())
        assert rec.bits.any()  # real records, not the zeros written after


@pytest.mark.parametrize("k, slots", [(2048, None), (768, 8), (4096, None), (12288, None)])
def test_quantize_kernel_writes_records_into_store_rows_and_graph_replays_it(k, slots):
    """The triton quantize kernel writing a record straight into the store's token rows
    (``GuidanceStore.record_rows`` + ``quantize_with_guidance(out=...)``, what the triton linear / MoE methods do):
    the same bytes as the record it allocates itself, at real widths (K = 12288: rows too long for one program, the
    row amax by torch first) and for w2's ``[T, top_k]`` slot rows; captured in a CUDA graph, each replay rewrites the
    rows from the new input, and a step takes them."""
    from verl_quads import nvfp4 as nv
    from verl_quads.rollout.capture import GuidanceStore
    from verl_quads.rollout.trace_rows import GemmRows

    store = GuidanceStore()
    store.enabled = True
    store._rows = 64
    store.register_trace_gemm(1, "self_attn.o_proj", k=512)  # another GEMM first: the target is not at offset 0
    key = (3, "mlp.experts.w2" if slots else "self_attn.qkv_proj")
    store.register_trace_gemm(*key, k=k, slots=slots)
    store.active_trace_keys = [key]  # what the runner hook sets: a replay runs no Python that could say so
    t = 37
    rows_x = t * (slots or 1)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(rows_x, k, device="cuda", generator=g) * 3).to(torch.bfloat16)
    ids = torch.randint(0, 128, (t, slots), device="cuda", generator=g) if slots else None

    def forward():
        out = store.record_rows(*key, GemmRows(k, slots), t, x.device, ids)
        return nv.quantize_with_guidance(x, amax="row", backend="triton", check_finite=False, out=out)

    def expect():
        return nv.quantize_with_guidance(x, amax="row", backend="triton", check_finite=False)[1]

    def check(rec, want):
        assert torch.equal(rec.bits.reshape(want.bits.shape).cpu(), want.bits.cpu())
        assert torch.equal(rec.block_scale.view(torch.uint8).reshape(-1).cpu(),
                           want.block_scale.view(torch.uint8).reshape(-1).cpu())
        assert torch.equal(rec.global_scale.reshape(-1).cpu(), want.global_scale.reshape(-1).cpu())

    q, rec = forward()  # eager (lays the buffer out)
    check(rec, expect())
    other = store._trace_buf[(1, "self_attn.o_proj")]
    before = other.bits.clone(), other.block_scale.view(torch.uint8).clone(), other.global_scale.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # warm-up outside the capture (Triton compiles)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, grec = forward()
    assert key in store._trace_in_graph
    for step in range(3):
        x.copy_((torch.randn(rows_x, k, device="cuda", generator=g) * (step + 1)).to(torch.bfloat16))
        if ids is not None:
            ids.copy_(torch.randint(0, 128, (t, slots), device="cuda", generator=g))
        store.begin_step(["r"], [0, t], torch.arange(t, device="cuda"))
        graph.replay()
        store.end_step()
        got = store.pop("r")
        check(got.records[key], expect())
        if slots:
            assert torch.equal(got.expert_ids[3], ids.to(torch.int16).cpu())
    for a, b in zip(before, (other.bits, other.block_scale.view(torch.uint8), other.global_scale)):
        assert torch.equal(a, b)  # the neighbouring GEMM's rows untouched
