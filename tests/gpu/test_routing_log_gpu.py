"""The routing log's CUDA path (verl_quads/rollout/routing_log.py): steps copied from the device without waiting
(pinned chunks, non-blocking copies, one event per segment of steps, re-recorded each step) still give each request
exactly the rows of its steps, even when the device buffers (expert ids and positions) are rewritten right after
(in stream order, as the runner and the layers rewrite theirs) and while the device is still busy with earlier
work; emptied chunks are reused on the device path too."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_cuda_steps_logged_without_waiting_pop_exact_rows(monkeypatch):
    from verl_quads.rollout import routing_log

    monkeypatch.setattr(routing_log, "CHUNK_BYTES", 2048)  # 51 rows of 40 B (2 layers x top-8 + position): 5 chunks
    log = routing_log.RoutingLog(max_bytes=1 << 30)
    g = torch.Generator(device="cuda").manual_seed(0)
    reqs = [f"r{i}" for i in range(6)]
    expect: dict[str, list] = {r: [] for r in reqs}
    buf = torch.empty(64, 2, 8, dtype=torch.int16, device="cuda")  # a persistent buffer, rewritten every step
    pos_buf = torch.empty(64, dtype=torch.int64, device="cuda")
    busy = torch.randn(4096, 4096, device="cuda")
    for step in range(40):
        for _ in range(4):  # keep the stream busy so the copies are still pending when the next step is logged
            busy = busy @ busy / 64.0
        n_per = [3 if step == 0 else 1 for _ in reqs]
        qsl = [0]
        for n in n_per:
            qsl.append(qsl[-1] + n)
        n = qsl[-1]
        buf[:n] = torch.randint(0, 128, (n, 2, 8), generator=g, device="cuda", dtype=torch.int16)
        pos_buf[:n] = torch.tensor([p for k in n_per for p in (range(3) if step == 0 else [step + 2])],
                                   device="cuda")
        # what the capture hands over: the persistent buffers themselves (its [rows, L, k] routing buffer and the
        # runner's positions buffer); steps 1-39 repeat one batch, so they continue segments (one event each)
        log.append_step(reqs, qsl, pos_buf[:n], buf[:n], (3, 7), 0)
        host = buf[:n].cpu()  # the reference (waits)
        for j, r in enumerate(reqs):
            expect[r] += host[qsl[j]:qsl[j + 1]].tolist()
        buf.fill_(-1)  # the next step's rewrites, in stream order after the logged copies
        pos_buf.fill_(-1)
    assert len(log._chunks) > 3
    first = log.pop(["r0"])["r0"]
    assert first.positions.tolist() == list(range(3)) + [s + 2 for s in range(1, 40)]
    assert first.experts.tolist() == expect["r0"] and first.experts.dtype == torch.uint8
    rest = log.pop()
    for r in reqs[1:]:
        assert rest[r].experts.tolist() == expect[r], r
    assert log.held_rows == 0
    kept = {c.experts.data_ptr() for c in [*log._chunks.values(), log._spare] if c is not None}
    log.append_step(["x"], [0, 1], pos_buf[:1].clone(), buf[:1].clone().fill_(5), (3, 7), 1)
    assert next(reversed(log._chunks.values())).experts.data_ptr() in kept  # no new pinned chunk
    assert log.pop(["x"])["x"].experts.tolist() == [[[5] * 8] * 2]


def test_routing_buffers_for_device_named_without_index_stay_columns_of_one_block():
    """The layers' buffers asked for with ``"cuda"`` (no index) are found again on the tensor's ``cuda:0``:
    asking for layer 1's must not reallocate the block (that dropped layer 0's ids: the capture probe's error)."""
    from verl_quads.rollout.capture import GuidanceStore

    store = GuidanceStore()
    for layer in range(3):
        store.register_routing_layer(layer)
    first = store.routing_buffer(0, 8, 4, "cuda")
    first.fill_(7)
    for layer in (1, 2, 0):
        store.routing_buffer(layer, 8, 4, torch.device("cuda"))
    again = store.routing_buffer(0, 8, 4, "cuda")
    assert again.data_ptr() == first.data_ptr() and bool((again == 7).all())
    assert store.routing_buffer(2, 8, 4, "cuda").data_ptr() == first.data_ptr() + 2 * 4 * 2  # column 2, int16
