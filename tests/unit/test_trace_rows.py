"""TRACE records as one byte row per token (``verl_quads.rollout.trace_rows``) and the guidance store's single record
buffer laid out from the GEMMs the layers register (``GuidanceStore.register_trace_gemm`` / ``add`` / ``pop``)."""

from __future__ import annotations

import pytest
import torch
from guidance_records import records_equal, row_record

from verl_quads.rollout.capture import GuidanceStore
from verl_quads.rollout.trace_rows import GemmRows, TraceRowLayout

QKV, O, W13, W2 = (3, "self_attn.qkv_proj"), (3, "self_attn.o_proj"), (3, "mlp.experts.w13"), (3, "mlp.experts.w2")


def test_layout_sections_are_aligned_and_views_round_trip_every_dtype():
    layout = TraceRowLayout({O: GemmRows(48), W2: GemmRows(32, slots=3), QKV: GemmRows(16)})
    assert list(layout.gemms) == sorted([O, W2, QKV])  # sorted (layer, gemm) order, whatever the insertion order
    # per GEMM: bits S*K/8, scales S*K/16, gs 4*S (+ int16 ids 2*S), each padded to 8 bytes
    assert layout.row_bytes == (8 + 8 + 8) + (8 + 8 + 8) + (16 + 8 + 16 + 8)
    assert layout.ids_key == {3: W2}
    torch.manual_seed(0)
    recs = {QKV: row_record(torch.randn(5, 16)), O: row_record(torch.randn(5, 48)), W2: row_record(torch.randn(5, 3, 32))}
    ids = torch.randint(0, 128, (5, 3))
    # a buffer whose first row is not at offset 0 of its storage, as a request's rows inside a pinned chunk
    base = torch.zeros(7 * layout.row_bytes, dtype=torch.uint8)[layout.row_bytes:].view(6, -1)[1:]
    views, id_views = layout.views(base)
    for k, r in recs.items():
        views[k].bits.copy_(r.bits)
        views[k].block_scale.view(torch.uint8).copy_(r.block_scale.view(torch.uint8))
        views[k].global_scale.copy_(r.global_scale)
    id_views[3].copy_(ids)
    again, again_ids = layout.views(base.clone())  # the bytes alone carry everything
    for k, r in recs.items():
        assert records_equal(again[k], r), k
    assert again_ids[3].dtype == torch.int16 and torch.equal(again_ids[3], ids)
    with pytest.raises(ValueError, match=r"expected uint8 \[R, 96\]"):
        layout.views(torch.zeros(2, 112, dtype=torch.uint8))


def test_gemm_rows_refuse_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 16"):
        GemmRows(24)
    with pytest.raises(ValueError, match=r"expected \[T, K\] without expert ids or \[T, top_k, K\]"):
        GemmRows.of(row_record(torch.randn(2, 3, 16)), None)
    with pytest.raises(ValueError, match="two GEMMs with expert slots"):
        TraceRowLayout({(1, "a"): GemmRows(16, 2), (1, "b"): GemmRows(16, 2)})


def test_registered_gemms_share_one_buffer_allocated_at_the_first_forward():
    """What vLLM does: every guided GEMM registers at layer build; the first forward allocates ONE buffer for all of
    them (no reallocation as later GEMMs of that forward arrive, so the profile run's peak holds it once), and a
    record whose shape differs from the registered one is an error naming the GEMM."""
    store = GuidanceStore()
    store._rows = 8
    store.register_trace_gemm(*QKV, k=16)
    store.register_trace_gemm(*W13, k=16)
    store.register_trace_gemm(*W2, k=32, slots=2)
    store.add(*QKV, row_record(torch.randn(4, 16)))
    base = store._trace_rows
    assert base.shape == (8, store._trace_layout.row_bytes) and set(store._trace_layout.gemms) == {QKV, W13, W2}
    store.add(*W13, row_record(torch.randn(4, 16)))
    store.add(*W2, row_record(torch.randn(4, 2, 32)), expert_ids=torch.zeros(4, 2, dtype=torch.int64))
    assert store._trace_rows is base
    with pytest.raises(RuntimeError, match=r"\(3, 'mlp.experts.w2'\) registered records of .*slots=2.*slots=4"):
        store.add(*W2, row_record(torch.randn(4, 4, 32)), expert_ids=torch.zeros(4, 4, dtype=torch.int64))


def test_pop_across_a_relayout_and_a_new_model():
    """Steps of one request written in two layouts (an engine without CUDA graphs whose forward outgrew the buffer)
    pop as one request, equal to its records; a GEMM registered again (a new model in this process) forgets the
    old model's GEMMs, so its steps carry only its own."""
    torch.manual_seed(1)
    store = GuidanceStore()
    store.enabled = True
    store.register_trace_gemm(*QKV, k=16)
    store.register_trace_gemm(*W2, k=32, slots=2)
    xs, ws, ids = [torch.randn(n, 16) for n in (2, 5)], [torch.randn(n, 2, 32) for n in (2, 5)], []
    layouts = []
    for i, (x, w) in enumerate(zip(xs, ws)):  # step 0: 2 rows, step 1: 5 rows (the buffer grows)
        n = x.shape[0]
        ids.append(torch.randint(0, 9, (n, 2)))
        store.begin_step(["r", "s"], [0, 1, n], torch.arange(n) + 10 * i)
        store.add(*QKV, row_record(x))
        store.add(*W2, row_record(w), expert_ids=ids[-1])
        store.end_step()
        layouts.append(store._trace_layout)
    assert layouts[0] is not layouts[1] and layouts[0].row_bytes == layouts[1].row_bytes  # same layout, larger
    r = store.pop("r")
    assert r.positions.tolist() == [0, 10]
    assert records_equal(r.records[QKV], row_record(torch.stack([xs[0][0], xs[1][0]])))
    assert records_equal(r.records[W2], row_record(torch.stack([ws[0][0], ws[1][0]])))
    assert torch.equal(r.expert_ids[3], torch.stack([ids[0][0], ids[1][0]]))
    assert all(t.is_contiguous() for rec in r.records.values() for t in (rec.bits, rec.block_scale, rec.global_scale))
    s = store.pop("s")
    assert s.positions.tolist() == [1, 11, 12, 13, 14]
    assert records_equal(s.records[QKV], row_record(torch.cat([xs[0][1:], xs[1][1:]])))
    store.register_trace_gemm(*QKV, k=16)  # a new model: only QKV guided now
    store.begin_step(["t"], [0, 1], torch.tensor([0]))
    store.add(*QKV, row_record(xs[0][:1]))
    store.end_step()
    t = store.pop("t")
    assert set(t.records) == {QKV} and t.expert_ids == {} and records_equal(t.records[QKV], row_record(xs[0][:1]))


def test_a_model_built_after_a_forward_replaces_the_buffer_even_with_other_gemms():
    """A second engine in the process whose guided GEMMs are all different keys (another depth, other guided layers):
    its registrations come after the first model's buffer exists, so they start a new layout, and the first model's
    CUDA-graph marks do not block the new model's first forward."""
    store = GuidanceStore()
    store.register_trace_gemm(*QKV, k=16)
    store.add(*QKV, row_record(torch.randn(2, 16)))
    store._trace_in_graph.add(QKV)  # the first engine captured its graphs (no GPU here)
    other = (7, "self_attn.qkv_proj")
    store.register_trace_gemm(*other, k=32)
    store.add(*other, row_record(torch.randn(2, 32)))
    assert set(store._trace_layout.gemms) == {other} and not store._trace_in_graph - {other}


def test_spec_round_trip_record_nbytes_and_refused_layouts():
    """A layout's ``spec`` (plain values) rebuilds an equal layout (same offsets: the views of the same rows are equal
    bytes); a sender whose rows have another width is refused naming both widths; ``record_nbytes`` = the records'
    ``GuidanceRecord.nbytes`` of one token (no padding, no expert ids)."""
    gemms = {(0, "self_attn.qkv_proj"): GemmRows(32), (0, "mlp.experts.w2"): GemmRows(16, slots=3),
             (2, "self_attn.o_proj"): GemmRows(48)}
    layout = TraceRowLayout(gemms)
    spec = layout.spec()
    assert spec == [[0, "mlp.experts.w2", 16, 3], [0, "self_attn.qkv_proj", 32, 0], [2, "self_attn.o_proj", 48, 0]]
    back = TraceRowLayout.from_spec(spec, layout.row_bytes)
    assert back.gemms == layout.gemms and back.row_bytes == layout.row_bytes
    assert TraceRowLayout.from_spec([list(e) for e in spec], layout.row_bytes) is back  # cached per spec
    rows = torch.randint(0, 256, (5, layout.row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    (a, ida), (b, idb) = layout.views(rows), back.views(rows)
    for k in gemms:
        assert torch.equal(a[k].bits, b[k].bits) and torch.equal(a[k].global_scale, b[k].global_scale)
        assert torch.equal(a[k].block_scale.view(torch.uint8), b[k].block_scale.view(torch.uint8))
    assert torch.equal(ida[0], idb[0])
    wide = torch.zeros(5, 3 * layout.row_bytes, dtype=torch.uint8)
    wide[:, layout.row_bytes:2 * layout.row_bytes] = rows  # rows that are not contiguous: views of the same bytes
    c, idc = layout.views(wide[:, layout.row_bytes:2 * layout.row_bytes])
    for k in gemms:
        assert torch.equal(a[k].bits, c[k].bits) and torch.equal(a[k].global_scale, c[k].global_scale)
        assert torch.equal(a[k].block_scale.view(torch.uint8), c[k].block_scale.view(torch.uint8))
    assert torch.equal(ida[0], idc[0])
    with pytest.raises(ValueError, match=f"rows of {layout.row_bytes + 8} bytes.*lays them out in {layout.row_bytes}"):
        TraceRowLayout.from_spec(spec, layout.row_bytes + 8)
    for keys in (set(gemms), {(0, "mlp.experts.w2")}, set()):
        one = layout.views(rows[:1])[0]
        assert layout.record_nbytes(keys) == sum(one[k].nbytes for k in keys)
    assert layout.record_nbytes({(0, "mlp.experts.w2")}) == 3 * (2 + 1 + 4)


def _roundtrip(g):
    """``g`` through the path verl's server takes: to_wire -> the worker RPC's plain form and back -> compact_wire
    -> the trainer's device move -> from_wire."""
    from verl_quads.integration.trace import _wires_to_device
    from verl_quads.patches import verl_rollout_guidance as patch
    from verl_quads.rollout.capture import RequestGuidance

    wire = patch.compact_wire(patch.from_plain(patch.to_plain(g.to_wire())))
    return wire, RequestGuidance.from_wire(_wires_to_device([wire], "cpu")[0])


def test_pop_hands_over_the_rows_and_the_wire_carries_them_as_one_tensor():
    """A request popped from one layout is its rows (one tensor ``[T, row_bytes]``) with typed views as records; the
    wire carries those rows and the layout, and the trainer's records after the round trip equal the ones the GEMMs
    wrote (bits, scales, global scales, expert ids), as do a relayout request's (records form); a wire whose row
    width disagrees with this code's layout, and rows that do not match the positions, are refused."""
    from verl_quads.rollout.capture import RequestGuidance

    torch.manual_seed(2)
    store = GuidanceStore()
    store.enabled, store._rows = True, 8
    store.register_trace_gemm(*QKV, k=16)
    store.register_trace_gemm(*W2, k=32, slots=2)
    xs, ws, ids = [torch.randn(n, 16) for n in (3, 2)], [torch.randn(n, 2, 32) for n in (3, 2)], []
    for i, (x, w) in enumerate(zip(xs, ws)):  # prefill (r: 2 rows, s: 1), then one decode row each
        n = x.shape[0]
        ids.append(torch.randint(0, 200, (n, 2)))
        store.begin_step(["r", "s"], [0, n - 1, n], torch.tensor([0, 1, 0] if i == 0 else [2, 1]))
        store.add(*QKV, row_record(x))
        store.add(*W2, row_record(w), expert_ids=ids[-1])
        store.end_step()
    r = store.pop("r")
    layout = store._trace_layout
    assert r.rows is not None and tuple(r.rows.shape) == (3, layout.row_bytes) and r.layout is layout
    want_q = row_record(torch.cat([xs[0][:2], xs[1][:1]]))
    want_w = row_record(torch.cat([ws[0][:2], ws[1][:1]]))
    want_ids = torch.cat([ids[0][:2], ids[1][:1]])
    assert r.nbytes == want_q.nbytes + want_w.nbytes
    wire, back = _roundtrip(r)
    assert set(wire) == {"request_id", "positions", "policy_version", "rows", "row_gemms", "row_bytes", "keys"}
    from verl_quads.patches.verl_rollout_guidance import wire_nbytes

    assert wire_nbytes(wire) == 3 * layout.row_bytes
    for got in (r, back):
        assert got.positions.tolist() == [0, 1, 2] and got.request_id == "r"
        assert records_equal(got.records[QKV], want_q) and records_equal(got.records[W2], want_w)
        assert torch.equal(got.expert_ids[3], want_ids) and sorted(got.records) == sorted([QKV, W2])
    bad = dict(wire, row_bytes=wire["row_bytes"] + 8)
    with pytest.raises(ValueError, match="different verl-quads versions"):
        RequestGuidance.from_wire(bad)
    with pytest.raises(ValueError, match=r"do not match 2 positions"):
        RequestGuidance.from_rows("r", torch.arange(2), r.rows, layout, [QKV])
    with pytest.raises(ValueError, match=r"not in the record layout"):
        RequestGuidance.from_rows("r", r.positions, r.rows, layout, [(9, "self_attn.o_proj")])
    # a records-form request (built by hand, or popped across a relayout) travels as before
    s = RequestGuidance("s", torch.arange(3), {QKV: want_q, W2: want_w}, {3: want_ids}, policy_version=4)
    s_wire, s_back = _roundtrip(s)
    assert "rows" not in s_wire and s_back.rows is None and s_back.policy_version == 4
    assert records_equal(s_back.records[W2], want_w) and torch.equal(s_back.expert_ids[3], want_ids)
    assert s.keys == (W2, QKV)  # sorted
