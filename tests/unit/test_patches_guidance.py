"""patches/verl_rollout_guidance.py: upstream symbols it relies on (verl 0.9.1), guard, and behaviour."""

from __future__ import annotations

import asyncio
import inspect
import types

import pytest
import torch

pytestmark = pytest.mark.verl

from verl_quads.patches import PatchVersionError
from verl_quads.patches import verl_rollout_guidance as g


def test_upstream_symbols_unchanged():
    import verl.experimental.agent_loop.agent_loop as al
    import verl.workers.rollout.vllm_rollout.utils as wu
    import verl.workers.rollout.vllm_rollout.vllm_async_server as srv
    from verl.workers.rollout.replica import TokenOutput

    gen = getattr(srv.vLLMHttpServer.generate, "__verl_quads_original__", srv.vLLMHttpServer.generate)
    assert list(inspect.signature(gen).parameters)[:4] == ["self", "prompt_ids", "sampling_params", "request_id"]
    assert inspect.iscoroutinefunction(gen)
    src = inspect.getsource(gen)
    assert "self.engine.generate(" in src and "extra_fields=extra_fields" in src
    assert "extra_fields" in TokenOutput.model_fields
    assert hasattr(wu, g.WORKER_CLASS)
    # the agent loop turns every extra_fields key into a per-sample non-tensor column
    post = inspect.getsource(al)
    assert "for key in input_item.extra_fields" in post and "non_tensor_batch.update(extra_fields)" in post


def test_version_guard():
    with pytest.raises(PatchVersionError, match="verl_rollout_guidance"):
        from verl_quads.patches._guard import require_version

        require_version(g.PATCH, ("verl",), g.SUPPORTED_VERL, found="0.9.2")


def test_applied_on_import_verl_and_idempotent():
    import verl  # noqa: F401
    import verl.workers.rollout.vllm_rollout.vllm_async_server as srv

    assert getattr(srv.vLLMHttpServer.generate, "__verl_quads_patch__", None) == g.PATCH
    before = srv.vLLMHttpServer.generate
    g.apply()
    assert srv.vLLMHttpServer.generate is before


def _wire(T=5, k=2):
    return {"request_id": "r-1", "positions": torch.arange(T), "policy_version": 3,
            "records": [{"layer": 1, "gemm": "self_attn.qkv_proj", "bits": torch.zeros(T, 8, dtype=torch.uint8),
                         "block_scale": torch.zeros(T, 4, dtype=torch.uint8), "global_scale": torch.ones(T, 1),
                         "shape": [T, 64]}],
            "expert_ids": [[1, torch.arange(T * k, dtype=torch.int64).reshape(T, k)]]}


def test_compact_wire_and_bytes():
    w = g.compact_wire(_wire())
    assert w["expert_ids"][0][1].dtype == torch.int16
    assert g.wire_nbytes(w) == 5 * (8 + 4 + 4) + 5 * 2 * 2
    assert g.wire_num_tokens(w) == 5
    bad = _wire()
    bad["expert_ids"][0][1][0, 0] = 1 << 15
    with pytest.raises(ValueError, match="int16"):
        g.compact_wire(bad)


def _vllm_rpc_roundtrip(reply):
    """What verl's server gets back from ``AsyncLLM.collective_rpc``: the worker's return value
    through vLLM's engine-core msgpack transport as an (untyped) utility result."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

    return MsgpackDecoder(UtilityResult).decode(MsgpackEncoder().encode(UtilityResult(reply))).result


def test_rpc_transport_needs_plain_form(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    raw = _vllm_rpc_roundtrip({"r-1": _wire(T=300)})  # tensors are not rebuilt without type info
    assert not isinstance(raw["r-1"]["expert_ids"][0][1], torch.Tensor)
    w = _wire(T=300)
    w["empty"] = torch.empty(0, 3, dtype=torch.float8_e4m3fn)
    back = g.from_plain(_vllm_rpc_roundtrip(g.to_plain(w)))
    assert torch.equal(back["expert_ids"][0][1], w["expert_ids"][0][1]) and back["expert_ids"][0][0] == 1
    for k in ("bits", "block_scale", "global_scale"):
        assert torch.equal(back["records"][0][k], w["records"][0][k]) and back["records"][0][k].dtype == w["records"][0][k].dtype
    assert torch.equal(back["positions"], w["positions"]) and back["empty"].shape == (0, 3)
    assert back["empty"].dtype == torch.float8_e4m3fn and back["records"][0]["shape"] == [300, 64]
    with pytest.raises(TypeError, match="malformed tensor"):
        g.from_plain({g.TENSOR_KEY: "int64", "shape": [1], "data": 3})


def test_popped_rows_travel_as_their_own_bytearray(monkeypatch):
    """A popped request's rows live in a bytearray (rollout/wire_bytes.py) that the RPC reply carries itself (no
    tobytes copy); through vLLM's msgpack transport and through pickle (vLLM's worker message queue) the trainer
    side gets the same rows back; a view or a copy of the rows is sent by value, as before."""
    import pickle

    from verl_quads.rollout import capture
    from verl_quads.rollout.capture import GuidanceStore, RequestGuidance
    from verl_quads.rollout.wire_bytes import backing_bytes, bytes_backed, bytes_backed_cat

    store = GuidanceStore()
    store.enabled = True
    monkeypatch.setattr(capture, "_STORE", store)  # the worker process's store, as _fetch finds it
    for step in range(3):
        store.begin_step(["a", "b"], [0, 2 if step == 0 else 1, 4 if step == 0 else 2],
                         torch.tensor([0, 1, 0, 1] if step == 0 else [step + 1, step + 1]))
        store.add(2, "self_attn.o_proj", _row_record_of_steps()[step])
        store.end_step()
    assert backing_bytes(store.pop("b").rows) is None  # the default: plain torch memory (sent by value)
    reply = g._fetch(object(), ["a"])  # the worker RPC: pops with into_bytes
    plain = reply["records"]["a"]
    assert isinstance(plain["rows"]["data"], bytearray) and len(plain["rows"]["data"]) == 4 * plain["row_bytes"]
    want = [r.bits for r in _row_record_of_steps()]
    for transport in (_vllm_rpc_roundtrip, lambda x: pickle.loads(pickle.dumps(x, protocol=5))):
        back = RequestGuidance.from_wire(g.from_plain(transport(plain)))
        assert back.positions.tolist() == [0, 1, 2, 3]
        assert torch.equal(back.records[(2, "self_attn.o_proj")].bits, torch.cat([want[0][:2], want[1][:1],
                                                                                 want[2][:1]]))
    t = bytes_backed((3, 8))
    t[1].fill_(7)
    assert backing_bytes(t)[8:16] == bytes([7] * 8)  # the tensor IS the bytearray
    assert backing_bytes(t[1:]) is None and backing_bytes(t.clone()) is None and backing_bytes(t.view(torch.int8)) \
        is None
    assert torch.equal(g.from_plain(g.to_plain(t[1:])), t[1:])
    assert bytes_backed((0, 8)).shape == (0, 8)
    # the pop's concatenation (bytearray.join, no zero-fill): torch.cat's bytes, a non-contiguous block included
    blocks = [torch.randint(0, 256, (n, 8), dtype=torch.uint8) for n in (2, 0, 3)]
    blocks.append(torch.randint(0, 256, (8, 4), dtype=torch.uint8).t())
    c = bytes_backed_cat(blocks, 8)
    assert torch.equal(c, torch.cat(blocks)) and bytes(backing_bytes(c)) == torch.cat(blocks).numpy().tobytes()
    assert bytes_backed_cat([], 8).shape == (0, 8) and bytes_backed_cat(blocks[1:2], 8).shape == (0, 8)
    with pytest.raises(ValueError, match=r"block 1 is torch.int8 \(2, 8\) on cpu; need uint8 \[rows, 8\]"):
        bytes_backed_cat([blocks[0], blocks[0].view(torch.int8)], 8)


def _row_record_of_steps():
    """The o_proj records of the three steps above (rows of request "a" first)."""
    from verl_quads import nvfp4 as nv

    xs = [torch.randn(4 if step == 0 else 2, 64, generator=torch.Generator().manual_seed(step)) for step in range(3)]
    return [nv.extract_guidance(nv.quantize(x, amax="row", backend="torch")) for x in xs]


class _Engine:
    """An engine whose workers hold ``records`` (wire form) and answer through vLLM's transport."""

    def __init__(self, reply):
        self.reply, self.calls = reply, []

    async def collective_rpc(self, method, args=()):
        self.calls.append((method, args))
        reply = dict(self.reply, records=g.to_plain(self.reply["records"]))  # as _fetch returns it
        return [_vllm_rpc_roundtrip(reply)]


def _out(tokens):
    return types.SimpleNamespace(token_ids=tokens, extra_fields={})


def test_attach_guidance_puts_record_and_refuses_missing():
    srv = types.SimpleNamespace(engine=_Engine({"enabled": True, "records": {"r-1": _wire()}}))
    out = _out([1, 2])
    asyncio.run(g.attach_guidance(srv, "r-1", out))
    assert srv.engine.calls == [(g.WORKER_METHOD, (["r-1"],))]
    assert out.extra_fields[g.FIELD]["expert_ids"][0][1].dtype == torch.int16
    srv = types.SimpleNamespace(engine=_Engine({"enabled": True, "records": {}}))
    with pytest.raises(RuntimeError, match="no guidance record captured for request 'r-2'"):
        asyncio.run(g.attach_guidance(srv, "r-2", _out([1])))
    aborted = _out([])
    asyncio.run(g.attach_guidance(srv, "r-2", aborted))
    assert g.FIELD not in aborted.extra_fields
    srv = types.SimpleNamespace(engine=_Engine({"enabled": False, "records": {}}))
    with pytest.raises(RuntimeError, match="capture disabled"):
        asyncio.run(g.attach_guidance(srv, "r-1", _out([1])))


class _GatedEngine:
    """Workers holding one routing and one guidance record per id in ``ids``; the first RPC waits for ``gate``
    (the requests that finish meanwhile queue up), the RPC numbered ``fail_at`` raises."""

    def __init__(self, ids, fail_at=None):
        self.calls, self.fail_at, self.gate = [], fail_at, asyncio.Event()
        self.records = {r: _wire(T=3 + i) for i, r in enumerate(ids)}
        self.routing = {r: {"positions": torch.arange(3 + i), "experts": torch.full((3 + i, 2, 4), i)}
                        for i, r in enumerate(ids)}

    async def collective_rpc(self, method, args=()):
        self.calls.append(list(args[0]))
        if len(self.calls) == 1:
            await self.gate.wait()
        if len(self.calls) == self.fail_at:
            raise ConnectionError("engine core died")
        ids = args[0]
        reply = {"enabled": True, "records": g.to_plain({r: self.records.pop(r) for r in ids if r in self.records}),
                 "routing_enabled": True,
                 "routing": g.to_plain({r: self.routing.pop(r) for r in ids if r in self.routing})}
        return [_vllm_rpc_roundtrip(reply), {"enabled": True, "records": {}}]  # a second TP rank: ignored


def _finish_together(srv, ids, trace=True, cancel=None):
    """Each id's ``generate`` wrapper tail, run concurrently: the first id's finishes alone (its RPC goes out and
    waits at the gate), then the others'; the gate opens once all of them wait."""
    outs = {r: _out([1, 2]) for r in ids}

    async def main():
        tasks = {ids[0]: asyncio.ensure_future(g.attach_records(srv, ids[0], outs[ids[0]], trace))}
        while not srv.engine.calls:
            await asyncio.sleep(0)
        tasks.update({r: asyncio.ensure_future(g.attach_records(srv, r, outs[r], trace)) for r in ids[1:]})
        for _ in range(3):
            await asyncio.sleep(0)
        if cancel is not None:
            tasks[cancel].cancel()
        srv.engine.gate.set()
        return dict(zip(ids, await asyncio.gather(*tasks.values(), return_exceptions=True)))

    return outs, asyncio.run(main())


def test_records_of_requests_finishing_at_once_share_one_rpc():
    ids = [f"r-{i}" for i in range(3)]
    srv = types.SimpleNamespace(engine=_GatedEngine(ids))
    srv.engine.gate.set()
    outs = {r: _out([1]) for r in ids}

    async def main():
        await asyncio.gather(*(g.attach_records(srv, r, outs[r], False) for r in ids))

    asyncio.run(main())
    assert srv.engine.calls == [ids] and all(g.ROUTING_FIELD in o.extra_fields for o in outs.values())
    assert all(g.FIELD not in o.extra_fields for o in outs.values())  # not a trace engine: guidance not attached


def test_records_of_requests_finishing_together_share_one_rpc():
    ids = [f"r-{i}" for i in range(6)]
    srv = types.SimpleNamespace(engine=_GatedEngine(ids))
    want_rec = {r: w for r, w in srv.engine.records.items()}
    want_rt = {r: w for r, w in srv.engine.routing.items()}
    outs, res = _finish_together(srv, ids)
    assert all(v is None for v in res.values()), res
    assert srv.engine.calls == [["r-0"], ids[1:]]  # the first at once, the 5 that finished meanwhile together
    f = g.record_fetcher(srv)
    assert (f.rpcs, f.requests) == (2, 6)
    for r in ids:
        got = outs[r].extra_fields
        assert torch.equal(got[g.ROUTING_FIELD]["experts"], want_rt[r]["experts"])
        assert torch.equal(got[g.FIELD]["positions"], want_rec[r]["positions"])
        assert torch.equal(got[g.FIELD]["expert_ids"][0][1], want_rec[r]["expert_ids"][0][1].to(torch.int16))
    assert not srv.engine.records and not srv.engine.routing  # every record popped


def test_record_rpc_failure_reaches_every_request_of_its_batch_then_recovers():
    ids = [f"r-{i}" for i in range(4)]
    srv = types.SimpleNamespace(engine=_GatedEngine(ids, fail_at=2))
    _, res = _finish_together(srv, ids)
    assert res["r-0"] is None
    assert all(isinstance(res[r], ConnectionError) for r in ids[1:]), res
    srv.engine.records["r-9"], srv.engine.routing["r-9"] = _wire(), {"experts": torch.zeros(5, 2, 4)}
    out = _out([1])
    asyncio.run(g.attach_records(srv, "r-9", out, True))  # a later request gets a new RPC
    assert srv.engine.calls[-1] == ["r-9"] and g.FIELD in out.extra_fields


def test_cancelled_request_does_not_disturb_its_batch_and_missing_record_fails_alone():
    ids = [f"r-{i}" for i in range(5)]
    srv = types.SimpleNamespace(engine=_GatedEngine(ids))
    del srv.engine.records["r-3"]  # captured routing but no guidance: that request alone must fail
    _, res = _finish_together(srv, ids, cancel="r-2")
    assert isinstance(res["r-2"], asyncio.CancelledError)
    assert isinstance(res["r-3"], RuntimeError) and "no guidance record captured for request 'r-3'" in str(res["r-3"])
    assert all(res[r] is None for r in ("r-0", "r-1", "r-4")), res
    assert srv.engine.calls == [["r-0"], ["r-1", "r-2", "r-3", "r-4"]]  # r-2's record popped (dropped) with them
    _, res = _finish_together(types.SimpleNamespace(engine=srv.engine), ["r-0"])  # popped already: none left
    assert isinstance(res["r-0"], RuntimeError) and "no routing record" in str(res["r-0"])


def test_cancelled_rpc_cancels_its_batch_and_the_queued_requests():
    srv = types.SimpleNamespace(engine=_GatedEngine(["r-0", "r-1"]))

    async def main():
        first = asyncio.ensure_future(g.attach_records(srv, "r-0", _out([1]), True))
        while not srv.engine.calls:
            await asyncio.sleep(0)
        queued = asyncio.ensure_future(g.attach_records(srv, "r-1", _out([1]), True))
        await asyncio.sleep(0)
        g.record_fetcher(srv)._task.cancel()  # e.g. the server's loop shutting down mid-RPC
        return await asyncio.wait_for(asyncio.gather(first, queued, return_exceptions=True), timeout=5)

    res = asyncio.run(main())
    assert all(isinstance(r, asyncio.CancelledError) for r in res), res
    assert srv.engine.calls == [["r-0"]] and g.record_fetcher(srv)._task is None


def test_worker_rpc_installed_on_verl_extension():
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    assert g.install_worker_rpc()
    assert getattr(vLLMColocateWorkerExtension, g.WORKER_METHOD) is g._fetch


def test_trainer_reads_records_from_both_verl_carriers():
    """DataProto path: a ``quads_guidance`` column; v1 TransferQueue path: inside each row's ``extra_fields``."""
    from verl.utils import tensordict_utils as tu

    from verl_quads.integration.trace import GuidanceError, batch_guidance

    def rows(carrier, missing=()):
        out = []
        for i in range(3):
            w = dict(g.compact_wire(_wire()), request_id=f"r-{i}")
            ef = {"turn_scores": []} if i in missing else {g.FIELD: w, "turn_scores": []}
            row = {"input_ids": torch.arange(4), "uid": f"u{i}"}
            row.update({g.FIELD: w} if carrier == "column" else {"extra_fields": ef})
            out.append(row)
        return tu.list_of_dict_to_tensordict(out)

    for carrier in ("column", "extra_fields"):
        keys, wires = batch_guidance(rows(carrier))
        assert keys == [f"u{i}/r-{i}" for i in range(3)]
        assert wires[2]["expert_ids"][0][1].dtype == torch.int16
    with pytest.raises(GuidanceError, match="row 1 .*no rollout guidance record"):
        batch_guidance(rows("extra_fields", missing=(1,)))
    with pytest.raises(GuidanceError, match="0 carry"):
        batch_guidance(tu.list_of_dict_to_tensordict([{"input_ids": torch.arange(4)}]))
