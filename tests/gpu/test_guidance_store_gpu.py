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
