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


class _Engine:
    def __init__(self, reply):
        self.reply, self.calls = reply, []

    async def collective_rpc(self, method, args=()):
        self.calls.append((method, args))
        return [self.reply]


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
