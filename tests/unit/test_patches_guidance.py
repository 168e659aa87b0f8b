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
