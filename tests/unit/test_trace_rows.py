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
    # per GEMM: bits S*K/8, scales S*K/16, gs 4*S (+ ids 8*S), each padded to 8 bytes
    assert layout.row_bytes == (8 + 8 + 8) + (8 + 8 + 8) + (16 + 8 + 16 + 24)
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
    assert again_ids[3].dtype == torch.int64 and torch.equal(again_ids[3], ids)
    with pytest.raises(ValueError, match=r"expected uint8 \[R, 112\]"):
        layout.views(torch.zeros(2, 96, dtype=torch.uint8))


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


def _independent_copy(layout, rows, keys):
    """What a pop handed over before session 28: every view of ``keys`` made contiguous on its own."""
    views, ids = layout.views(rows)
    return ({k: r for k, r in views.items() if k in keys},
            {la: t for la, t in ids.items() if layout.ids_key[la] in keys})


@pytest.mark.parametrize("n", [0, 1, 7])
def test_copy_out_equals_the_views_made_contiguous(n):
    """``copy_out`` (a pop's records: one strided copy per section kind and run of equally spaced GEMMs) == the
    views made contiguous one by one, for every GEMM, dtype and shape; its tensors are contiguous and do not share
    the rows' memory; runs broken by a missing layer, GEMMs of another shape between them, and rows that are not
    contiguous (the per-view path) give the same."""
    gemms = {}
    for layer in range(5):
        gemms[(layer, "self_attn.qkv_proj")] = GemmRows(32)
        gemms[(layer, "self_attn.o_proj")] = GemmRows(48 if layer != 2 else 64)  # layer 2's o_proj: another shape
        gemms[(layer, "mlp.experts.w2")] = GemmRows(16, slots=3)
    layout = TraceRowLayout(gemms)
    g = torch.Generator().manual_seed(n)
    rows = torch.randint(0, 256, (n, layout.row_bytes), dtype=torch.uint8, generator=g)
    every = set(gemms)
    some = every - {(1, "self_attn.qkv_proj"), (3, "mlp.experts.w2")}  # runs cut at layers 1 and 3
    for keys in (every, some, {(4, "self_attn.o_proj")}):
        want_recs, want_ids = _independent_copy(layout, rows, keys)
        got_recs, got_ids = layout.copy_out(rows, keys)
        assert list(got_recs) == sorted(keys) and sorted(got_ids) == sorted(want_ids)
        for k, w in want_recs.items():
            r = got_recs[k]
            for a, b in ((r.bits, w.bits), (r.block_scale, w.block_scale), (r.global_scale, w.global_scale)):
                assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), k
                assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8)), k
            assert r.shape == w.shape, k
        for la, w in want_ids.items():
            assert got_ids[la].dtype == torch.int64 and got_ids[la].is_contiguous() and torch.equal(got_ids[la], w)
        if n:  # own memory: the rows may be reused
            before = {k: r.bits.clone() for k, r in got_recs.items()}
            rows2 = rows.clone()
            recs2, _ = layout.copy_out(rows2, keys)
            rows2.fill_(0)
            assert all(torch.equal(recs2[k].bits, before[k]) for k in keys)
    wide = torch.zeros(n, 2 * layout.row_bytes, dtype=torch.uint8)
    wide[:, :layout.row_bytes] = rows  # rows of a wider buffer: not contiguous (n > 1)
    got, _ = layout.copy_out(wide[:, :layout.row_bytes], every)
    want, _ = _independent_copy(layout, rows, every)
    assert all(torch.equal(got[k].bits, want[k].bits) and got[k].bits.is_contiguous() for k in every)
    with pytest.raises(ValueError, match=r"expected uint8 \[R, "):
        layout.copy_out(torch.zeros(2, 8, dtype=torch.uint8), every)


def test_copy_out_runs():
    from verl_quads.rollout.trace_rows import _runs

    keys = [(i, "g") for i in range(7)]
    assert _runs(keys, [0, 10, 20, 30, 45, 60, 75]) == [keys[:4], keys[4:]]
    assert _runs(keys[:3], [0, 10, 25]) == [keys[:2], keys[2:3]]
    assert _runs(keys[:1], [5]) == [keys[:1]]
