"""``quads/routing_disagreement``: the trainer's router choices (RouterRecorder, real HF Qwen3-MoE routers)
against a rollout's, through the verl metric hook (``quads_gap_metrics``).

The "rollout" here is the same model with one layer's router perturbed, so the expected answer is known
without the code under test: 0 for identical routers, > 0 when a router changes, and the layers upstream
of the perturbed one must agree exactly (their inputs did not change).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from verl_quads.config import QuantConfig
from verl_quads.integration.trace import RouterRecorder

ASSET = Path(__file__).resolve().parents[2] / "verl_quads" / "assets" / "tiny_math_moe"


class _Batch:
    def __init__(self, **t):
        self.batch = t


def _routing(model, ids):
    with RouterRecorder(model) as rec, torch.no_grad():
        model(input_ids=ids)
        return rec.take()


@pytest.fixture(scope="module")
def trainer():
    from transformers import AutoModelForCausalLM

    from verl_quads.qat import apply_qat

    m = AutoModelForCausalLM.from_pretrained(str(ASSET), dtype=torch.float32)
    apply_qat(m, QuantConfig(quant="quads"), backend="torch")  # the trainer's w4a16 QAT forward
    return m.eval()


def test_recorder_shape_and_no_side_effect(trainer):
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = trainer(input_ids=ids).logits
    with RouterRecorder(trainer) as rec, torch.no_grad():
        out = trainer(input_ids=ids).logits
        r = rec.take()
    assert torch.equal(out, ref)
    assert r.shape == (22, 4, 2) and r.dtype == torch.int16 and int(r.min()) >= 0 and int(r.max()) < 8
    with pytest.raises(RuntimeError, match="did not run"):
        rec.take()
    with pytest.raises(ValueError, match="no MoE router"):
        RouterRecorder(torch.nn.Linear(4, 4))


def test_perturbed_router_raises_routing_disagreement(trainer):
    from verl_quads.patches.verl_gap_metrics import ACTOR_ROUTING_KEY, ROUTING_METRIC, quads_gap_metrics

    g = torch.Generator().manual_seed(1)
    bsz, prompt, resp = 4, 6, 10
    ids = torch.randint(3, 300, (bsz, prompt + resp), generator=g)
    mine = _routing(trainer, ids).reshape(bsz, prompt + resp, 4, 2)
    other = copy.deepcopy(trainer)
    with torch.no_grad():
        w = other.model.layers[2].mlp.gate.weight
        w.add_(torch.randn(w.shape, generator=g) * w.abs().mean() * 2)
    theirs = _routing(other, ids).reshape(bsz, prompt + resp, 4, 2)
    assert torch.equal(theirs[:, :, :2], mine[:, :, :2])  # layers before the perturbed router: identical

    mask = torch.ones(bsz, resp, dtype=torch.long)
    mask[0, 7:] = 0
    logp = -torch.rand(bsz, resp, generator=g)
    base = dict(rollout_log_probs=logp, old_log_probs=logp, response_mask=mask)
    same = quads_gap_metrics(_Batch(**base, routed_experts=mine, **{ACTOR_ROUTING_KEY: mine.clone()}))
    assert same[ROUTING_METRIC] == 0.0
    diff = quads_gap_metrics(_Batch(**base, routed_experts=theirs, **{ACTOR_ROUTING_KEY: mine}))
    # expected, counted here: response positions x layers whose sorted top-k differ
    a, b = torch.sort(theirs[:, prompt:].long(), -1).values, torch.sort(mine[:, prompt:].long(), -1).values
    differs = (a != b).any(-1) & mask.bool()[..., None]
    want = float(differs.sum()) / (int(mask.sum()) * 4)
    assert 0.0 < diff[ROUTING_METRIC] <= 1.0
    assert diff[ROUTING_METRIC] == pytest.approx(want)
    print(f"\nrouting_disagreement with layer 2's router perturbed: {diff[ROUTING_METRIC]:.3f}")


# ----------------------------------------------------------------------------- end-to-end pieces (issue 6/7)
def test_store_routing_records_per_request():
    """Rollout side: the runner's steps + each MoE layer's topk_ids -> one uint8 [T, layers, k] record per
    request, positions sorted, the latest record kept on recompute, external ids resolved."""
    from verl_quads.rollout.capture import GuidanceStore, RequestRouting

    st = GuidanceStore()
    st.routing = True
    ids = {0: torch.tensor([[1, 2], [3, 4], [5, 6]]), 2: torch.tensor([[7, 0], [6, 5], [4, 3]])}

    def step(req_ids, qsl, pos, per_layer):
        st.begin_step(req_ids, qsl, torch.tensor(pos))
        for layer, t in per_layer.items():  # what record_routing does inside QuadsNVFP4MoEMethod.apply
            rows = t.shape[0]
            st.routing_buffer(layer, rows, 2, "cpu")[:rows].copy_(t)
        st.end_step()

    step(["a-0123abcd", "b-89abcdef"], [0, 2, 3], [0, 1, 0], ids)  # prefill: a has 2 tokens, b has 1
    step(["a-0123abcd", "b-89abcdef"], [0, 1, 2], [2, 1], {0: torch.tensor([[0, 1], [2, 3]]), 2: torch.tensor([[4, 5], [6, 7]])})
    step(["a-0123abcd"], [0, 1], [2], {0: torch.tensor([[7, 6]]), 2: torch.tensor([[5, 4]])})  # a's position 2 recomputed
    a = st.pop_routing("a")  # external id
    assert a.request_id == "a-0123abcd" and a.layers == [0, 2] and a.experts.dtype == torch.uint8
    assert a.positions.tolist() == [0, 1, 2]
    assert a.experts.tolist() == [[[1, 2], [7, 0]], [[3, 4], [6, 5]], [[7, 6], [5, 4]]]
    assert st.pop_routing("a") is None
    b = RequestRouting.from_wire(st.pop_routing("b-89abcdef").to_wire())
    assert b.positions.tolist() == [0, 1] and b.experts.tolist() == [[[5, 6], [4, 3]], [[2, 3], [6, 7]]]
    assert b.nbytes == 2 * 2 * 2 and st.routing_request_ids() == [] and st.routing_log.held_rows == 0


@pytest.mark.parametrize("chunk_bytes", [None, 300])
def test_store_pop_routings_of_a_batch_equals_a_per_row_reference(chunk_bytes, monkeypatch):
    """Collecting many requests at once (verl pops a rollout's whole batch) and one by one: random steps with
    chunked prefills, decode rows, recomputed positions (preemption), requests absent from some steps, wide ids in
    some, a weight sync midway; checked against a dict-per-request reference written here, row by row. With
    300-byte chunks (15 rows of 20 B: 3 layers x top-2 int16 + an int64
    position) requests span many chunks, emptied chunks are reused."""
    from verl_quads.rollout import routing_log
    from verl_quads.rollout.capture import GuidanceStore

    if chunk_bytes:
        monkeypatch.setattr(routing_log, "CHUNK_BYTES", chunk_bytes)

    g = torch.Generator().manual_seed(0)
    st = GuidanceStore()
    st.routing = True
    layers, k = (1, 3, 4), 2
    for layer in layers:
        st.register_routing_layer(layer)
    reqs = [f"q{i}-{i:08x}" for i in range(12)]
    ref: dict[str, dict[int, list]] = {r: {} for r in reqs}  # request -> position -> the latest row's ids
    versions: dict[str, list] = {r: [] for r in reqs}
    next_pos = {r: 0 for r in reqs}
    for step in range(40):
        st.policy_version = 0 if step < 25 else 1
        active = [r for r in reqs if torch.rand(1, generator=g).item() < 0.6]
        if not active:
            continue
        qsl, pos = [0], []
        for r in active:
            n = int(torch.randint(1, 4, (1,), generator=g)) if next_pos[r] == 0 else 1
            start = next_pos[r] - 1 if next_pos[r] > 2 and torch.rand(1, generator=g).item() < 0.15 else next_pos[r]
            pos += list(range(start, start + n))  # start < next_pos: recompute of the last position
            next_pos[r] = max(next_pos[r], start + n)
            qsl.append(qsl[-1] + n)
            versions[r].append(st.policy_version)
        st.begin_step(active, qsl, torch.tensor(pos))
        per_layer = {}
        for layer in layers:
            hi = 300 if layer == 4 and step == 7 else 128  # one step with ids >= 256: those requests stay int16
            per_layer[layer] = torch.randint(0, hi, (qsl[-1], k), generator=g)
            st.routing_buffer(layer, qsl[-1], k, "cpu")[: qsl[-1]].copy_(per_layer[layer])
        st.end_step()
        for i, r in enumerate(active):
            for row in range(qsl[i], qsl[i + 1]):
                ref[r][pos[row]] = [per_layer[layer][row].tolist() for layer in layers]
    if chunk_bytes:
        assert len(st.routing_log._chunks) > 10
    one = st.pop_routing("q0")  # external id, alone
    ext = [r.split("-")[0] for r in reqs[1:6]]
    got = {**st.pop_routings(ext + ["nobody"]), **st.pop_routings()}  # external ids, then the rest (internal)
    assert "nobody" not in got and set(got) == set(ext) | set(reqs[6:]) and st.routing_log.held_rows == 0
    got["q0"] = one
    for r in reqs:
        rec = got[r.split("-")[0] if r.split("-")[0] in got else r]
        assert rec.request_id == r and rec.layers == list(layers)
        assert rec.positions.tolist() == sorted(ref[r])
        assert rec.experts.tolist() == [ref[r][p] for p in sorted(ref[r])]
        wide = max(max(max(row) for row in v) for v in ref[r].values()) >= 256
        assert rec.experts.dtype == (torch.int16 if wide else torch.uint8)
        assert rec.policy_version == versions[r][0] and rec.mixed_versions == (len(set(versions[r])) > 1)
        assert rec.experts.untyped_storage().nbytes() == rec.experts.numel() * rec.experts.element_size()
    assert any(r.experts.dtype == torch.int16 for r in got.values()) and any(r.mixed_versions for r in got.values())


@pytest.mark.parametrize("chunk_bytes", [None, 200])
def test_routing_log_segments_of_steady_batches_equal_a_per_row_reference(chunk_bytes, monkeypatch):
    """Steps that repeat the previous step's batch (same requests, same rows each) continue one segment (no
    per-request bookkeeping); everything that ends a segment is exercised against a per-row reference: a request
    joining or leaving, a chunked prefill (several steps of the same rows), a weight sync, a full chunk (200-byte
    chunks: 10 rows of 20 B), and a request popped while it is still running (its later rows form a new record)."""
    from verl_quads.rollout import routing_log

    if chunk_bytes:
        monkeypatch.setattr(routing_log, "CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(1)
    log = routing_log.RoutingLog(max_bytes=1 << 30)
    layers, k = (0, 5, 9), 2
    ref: dict[str, dict[int, list]] = {}  # request -> position -> its row's ids (since its last pop)
    first_version: dict[str, int] = {}
    next_pos: dict[str, int] = {}
    active = ["r0-00000000", "r1-00000001"]
    popped_running = 0
    continued = 0
    for step in range(160):
        version = 0 if step < 90 else 1
        if torch.rand(1, generator=g).item() < 0.1:  # the batch changes now and then
            if len(active) > 1 and torch.rand(1, generator=g).item() < 0.5:
                active = [r for r in active if r != active[int(torch.randint(0, len(active), (1,), generator=g))]]
            else:
                active = active + [f"r{step + 2}-{step + 2:08x}"]
        qsl, pos = [0], []
        for r in active:
            start = next_pos.setdefault(r, 0)
            n = 3 if start < 6 else 1  # prompts of 6 tokens: two prefill chunks of 3 rows, then decode
            pos += list(range(start, start + n))
            next_pos[r] = start + n
            qsl.append(qsl[-1] + n)
        ids = torch.randint(0, 128, (qsl[-1], len(layers), k), generator=g, dtype=torch.int16)
        before = log._open
        log.append_step(list(active), qsl, torch.tensor(pos), ids, layers, version)
        continued += before is not None and log._open is before
        for i, r in enumerate(active):
            first_version.setdefault(r, version)
            for row in range(qsl[i], qsl[i + 1]):
                ref.setdefault(r, {})[pos[row]] = ids[row].tolist()
        if step % 37 == 36:  # pop a running request: the rows it gets afterwards start a new record
            r = active[0]
            got = log.pop([r])[r]
            assert got.positions.tolist() == sorted(ref[r])
            assert got.experts.tolist() == [ref[r][p] for p in sorted(ref[r])]
            assert got.policy_version == first_version.pop(r)
            del ref[r]
            popped_running += 1
    got = log.pop()
    assert sorted(got) == sorted(ref) and log.held_rows == 0 and log.request_ids() == []
    for r, rec in got.items():
        assert rec.positions.tolist() == sorted(ref[r]), r
        assert rec.experts.tolist() == [ref[r][p] for p in sorted(ref[r])], r
        assert rec.layers == list(layers) and rec.policy_version == first_version[r]
    assert popped_running == 4 and continued > (100 if chunk_bytes is None else 60), continued  # most steps continue one
    assert any(rec.mixed_versions for rec in got.values())
    if chunk_bytes:
        assert log._spare is not None  # emptied chunks were retired for reuse


def test_routing_log_reuses_emptied_chunks_and_drops_the_oldest(monkeypatch, caplog):
    """Chunks of 2 rows (12 B each: 1 layer x top-2 int16 + int64 position), at most 2 chunks: a chunk emptied by
    pops is reused for the next one (same storage); past the bound the oldest chunk is dropped with one warning,
    and a request with rows in it keeps only its later rows."""
    from verl_quads.rollout import routing_log

    monkeypatch.setattr(routing_log, "CHUNK_BYTES", 24)
    log = routing_log.RoutingLog(max_bytes=48)

    def step(reqs, qsl, pos):
        ids = torch.tensor([[[p, 1]] for p in pos], dtype=torch.int16)  # [n, 1 layer, top-2]
        log.append_step(reqs, qsl, torch.tensor(pos), ids, (0,), 7)

    step(["a"], [0, 2], [0, 1])  # chunk 0
    step(["b"], [0, 2], [0, 1])  # chunk 1
    first = log._chunks[0].experts.data_ptr()
    assert log.pop(["a"])["a"].positions.tolist() == [0, 1] and log._spare is not None and 0 not in log._chunks
    step(["c"], [0, 2], [0, 1])  # chunk 2: the spare
    assert log._chunks[2].experts.data_ptr() == first and log._spare is None
    with caplog.at_level("WARNING"):
        step(["c", "d"], [0, 1, 2], [2, 0])  # chunk 3: chunk 1 (b) dropped
        step(["d"], [0, 1], [1])  # chunk 4: chunk 2 (c's positions 0, 1) dropped
    assert log.dropped_steps == 2 and sum("never collected" in r.message for r in caplog.records) == 1
    assert log.request_ids() == ["c", "d"] and log.nbytes == 48
    c, d = log.pop(["c"])["c"], log.pop(["d"])["d"]
    assert c.positions.tolist() == [2] and c.experts.tolist() == [[[2, 1]]] and c.policy_version == 7
    assert d.positions.tolist() == [0, 1] and d.experts.tolist() == [[[0, 1]], [[1, 1]]]
    assert log.held_rows == 0 and log.request_ids() == []
    with pytest.raises(ValueError, match=r"experts must be int16 \[1, 1, top_k\]"):
        log.append_step(["e"], [0, 1], torch.tensor([0]), torch.zeros(1, 1, 2, dtype=torch.int64), (0,), None)


def test_store_routing_bounded_and_wide_ids():
    from verl_quads.rollout.capture import GuidanceStore

    st = GuidanceStore()
    # the log holds int16 ids + an int64 position: 12 B per row here (1 layer x top-2); 24 B = one chunk of 2 rows
    # (ids narrowed to uint8 per request when popped)
    st.routing, st.routing_log.max_bytes = True, 24
    for i in range(4):
        st.begin_step([f"r{i}"], [0, 1], torch.tensor([0]))
        st.routing_buffer(5, 1, 2, "cpu")[:1].copy_(torch.tensor([[i, 300 if i == 3 else 1]]))
        st.end_step()
    assert st.routing_request_ids() == ["r2", "r3"] and st.routing_log.dropped_steps == 2
    r3 = st.pop_routing("r3")
    assert r3.experts.dtype == torch.int16 and r3.experts.tolist() == [[[3, 300]]]
    r2 = st.pop_routing("r2")
    assert r2.experts.dtype == torch.uint8 and r2.experts.tolist() == [[[2, 1]]]


def test_store_routing_copies_are_taken_at_the_step_and_checked_when_popped():
    """The step hook neither waits for nor checks the device-to-host copies (module docstring: a blocking copy
    per step stalls a GPU engine); the record still holds the step's values (the runner rewrites its positions
    buffer and the layers their routing buffers in place afterwards), and a layer that wrote no ids in a step
    is still refused, when the request's record is popped."""
    from verl_quads.rollout.capture import GuidanceStore

    st = GuidanceStore()
    st.routing = True
    for layer in (0, 1):
        st.register_routing_layer(layer)
    positions = torch.tensor([4, 5])
    st.begin_step(["a"], [0, 2], positions)
    st.routing_buffer(0, 2, 2, "cpu")[:2].copy_(torch.tensor([[1, 2], [3, 4]]))
    st.routing_buffer(1, 2, 2, "cpu")[:2].copy_(torch.tensor([[5, 6], [7, 0]]))
    st.end_step()
    positions.fill_(99)  # the runner's next step
    st.routing_buffer(0, 2, 2, "cpu").fill_(-1)
    st.routing_buffer(1, 2, 2, "cpu").fill_(-1)
    a = st.pop_routing("a")
    assert a.positions.tolist() == [4, 5] and a.experts.tolist() == [[[1, 2], [5, 6]], [[3, 4], [7, 0]]]

    st.begin_step(["b"], [0, 1], torch.tensor([0]))
    st.routing_buffer(0, 1, 2, "cpu")[:1].copy_(torch.tensor([[1, 2]]))  # layer 1 never writes this step
    st.end_step()
    with pytest.raises(RuntimeError, match=r"layers \[0, 1\] did not all write expert ids"):
        st.pop_routing("b")


def test_store_routing_follows_the_model_built_last():
    """A second model built in the same process (two ``LLM`` objects in one test session) must not be
    checked against the first model's layers: before this was handled, a 2-layer engine after a 4-layer one
    failed with "layers [0, 1, 2, 3] did not all write expert ids"."""
    from verl_quads.rollout.capture import GuidanceStore

    st = GuidanceStore()
    st.routing = True

    def build_and_step(n_layers, req):
        for layer in range(n_layers):  # what create_weights -> enable_routing_capture does, in build order
            st.register_routing_layer(layer)
        st.begin_step([req], [0, 1], torch.tensor([0]))
        for layer in range(n_layers):
            st.routing_buffer(layer, 1, 2, "cpu")[:1].copy_(torch.tensor([[layer, 7]]))
        st.end_step()
        return st.pop_routing(req)

    assert build_and_step(4, "first").layers == [0, 1, 2, 3]
    second = build_and_step(2, "second")
    assert second.layers == [0, 1] and second.experts.tolist() == [[[0, 7], [1, 7]]]
    st.register_routing_layer(0)  # a third model whose layer 0 never runs a forward: loud, not skipped
    st.register_routing_layer(5)
    st.begin_step(["third"], [0, 1], torch.tensor([0]))
    with pytest.raises(RuntimeError, match=r"MoE layers \[5\] of this model never wrote"):
        st.end_step()


def _micro_batch(seqs, resp_lens, wires, remove_padding=False):
    from verl.utils import tensordict_utils as tu

    rows = []
    for i, (s, r) in enumerate(zip(seqs, resp_lens)):
        m = torch.ones(r, dtype=torch.long)
        if i == 0:
            m[-2:] = 0  # masked response tokens are not counted
        rows.append({"input_ids": s, "response_mask": m, "uid": f"u{i}", "quads_routing": wires[i]})
    td = tu.list_of_dict_to_tensordict(rows)
    tu.assign_non_tensor(td, use_remove_padding=remove_padding)
    return td


def test_routing_session_in_log_prob_pass_perturbed_router(trainer):
    """Trainer side as the QAT engine runs it (RoutingSession: row map of the padded model input, rollout
    records per row, trainer routers recorded during the forward): 0 against its own routing; against a
    rollout whose layer-2 router is perturbed, the fraction counted here by hand (response tokens'
    producing positions P-1+j, masked ones excluded, a row without record uncovered)."""
    from verl_quads.integration.trace import METRIC_ROUTING, RoutingSession
    from verl_quads.rollout.capture import RequestRouting

    g = torch.Generator().manual_seed(2)
    prompts, resps = [5, 7, 4], [6, 3, 8]
    seqs = [torch.randint(3, 300, (p + r,), generator=g) for p, r in zip(prompts, resps)]
    S = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    mask = torch.zeros(len(seqs), S, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    other = copy.deepcopy(trainer)
    with torch.no_grad():
        w = other.model.layers[2].mlp.gate.weight
        w.add_(torch.randn(w.shape, generator=g) * w.abs().mean() * 2)

    def recorded(model):
        with RouterRecorder(model) as rec, torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
            return rec.take().reshape(len(seqs), S, 4, 2).long()

    mine, theirs = recorded(trainer), recorded(other)

    def wires(src, first_pos=(0, 0, 0), none_row=None):
        out = []
        for i, s in enumerate(seqs):
            if i == none_row:
                out.append(None)
                continue
            pos = torch.arange(first_pos[i], len(s) - 1)  # vLLM never feeds the last sampled token
            out.append(RequestRouting(f"req{i}", pos, src[i, pos].to(torch.uint8), [0, 1, 2, 3], 1).to_wire())
        return out

    def run(wire_list):
        td = _micro_batch(seqs, resps, wire_list)
        with RoutingSession(trainer) as rs, torch.no_grad():
            rs.begin_micro_batch(td, {"input_ids": ids, "attention_mask": mask})
            trainer(input_ids=ids, attention_mask=mask)
        return rs.metrics()

    same = run(wires(mine, first_pos=(4, 0, 0)))  # row 0: prefix-cached prompt, only P-1 onwards computed
    assert same[METRIC_ROUTING] == 0.0 and same["quads/routing_uncovered_frac"] == 0.0
    assert same["quads/routing_compared_tokens"] == 4 + 3 + 8 and same["quads/routing_bytes_per_token"] == 8.0

    got = run(wires(theirs, none_row=1))
    diff = 0
    for i in (0, 2):  # counted by hand: rows of the response tokens' log-probs
        valid = resps[i] - (2 if i == 0 else 0)
        for j in range(valid):
            p = prompts[i] - 1 + j
            for layer in range(4):
                diff += set(theirs[i, p, layer].tolist()) != set(mine[i, p, layer].tolist())
    pairs = (4 + 8) * 4
    assert diff > 0
    assert got[METRIC_ROUTING] == pytest.approx(diff / pairs)
    assert got["quads/routing_compared_tokens"] == 12 and got["quads/routing_uncovered_frac"] == pytest.approx(3 / 15)
    print(f"\nRoutingSession: routing_disagreement {got[METRIC_ROUTING]:.3f} with layer 2's router perturbed")

    bad = wires(mine)
    bad[0]["layers"] = [0, 1, 2]
    with pytest.raises(ValueError, match="rollout recorded MoE layers"):
        run(bad)


def test_store_routing_buffers_are_columns_of_one_tensor(monkeypatch):
    """The registered layers' buffers are the columns of one [rows, L, top_k] tensor, so a step hands its rows of
    every layer over as one block (no per-layer slicing and stack on the host per step); a larger forward
    re-makes them together; a layer set other than the block's (another model) still gets stacked."""
    from verl_quads.rollout.capture import GuidanceStore

    st = GuidanceStore()
    st.routing = True
    for layer in (2, 5, 9):
        st.register_routing_layer(layer)
    bufs = [st.routing_buffer(layer, 4, 2, "cpu") for layer in (2, 5, 9)]
    base = st._routing_base
    assert base.shape == (4, 3, 2) and [b.data_ptr() for b in bufs] == [base[:, i].data_ptr() for i in range(3)]
    st.begin_step(["a"], [0, 2], torch.tensor([0, 1]))
    for i, b in enumerate(bufs):
        b[:2].copy_(torch.tensor([[i, 10 + i], [20 + i, 30 + i]]))

    def no_stack(*a, **k):
        raise AssertionError("torch.stack called for the block's own layer set")

    with monkeypatch.context() as m:
        m.setattr(torch, "stack", no_stack)
        st.end_step()
    assert st.pop_routing("a").experts.tolist() == [[[0, 10], [1, 11], [2, 12]], [[20, 30], [21, 31], [22, 32]]]
    big = st.routing_buffer(5, 10, 2, "cpu")  # a larger forward: every column re-made in one new block
    assert st._routing_base.shape == (10, 3, 2) and big.data_ptr() == st._routing_base[:, 1].data_ptr()
    assert all(st.routing_buffer(layer, 1, 2, "cpu").data_ptr() == st._routing_base[:, i].data_ptr()
               for i, layer in enumerate((2, 5, 9)))
    st.register_routing_layer(2)  # another model: layers (2, 9) only -> stacked from their columns
    st.register_routing_layer(9)
    st.begin_step(["b"], [0, 1], torch.tensor([0]))
    st.routing_buffer(2, 1, 2, "cpu")[:1].copy_(torch.tensor([[1, 2]]))
    st.routing_buffer(9, 1, 2, "cpu")[:1].copy_(torch.tensor([[3, 4]]))
    st.end_step()
    b = st.pop_routing("b")
    assert b.layers == [2, 9] and b.experts.tolist() == [[[1, 2], [3, 4]]]
