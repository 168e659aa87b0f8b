"""QAT under FSDP2 (``fully_shard``) on 2 CPU ranks (gloo) vs 1 rank: identical outputs and gradients.

The QDQ must see the full unsharded weight (global scale = amax of the whole tensor, and for q/k/v
and gate/up of the whole group); a shard's amax would give different values on each rank.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from verl_quads.config import QuantConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, family: str, quant: str, granularity: str):
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    import torch.distributed as dist
    from qat_models import tiny_model, tokens
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from verl_quads.qat import apply_qat

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = tiny_model(family, dtype=torch.float32)
        apply_qat(model, QuantConfig(quant=quant))
        mesh = init_device_mesh("cpu", (world,))
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if granularity == "per_linear":
            for layer in model.model.layers:
                fully_shard(layer.self_attn.q_proj, mesh=mesh, mp_policy=mp_policy)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        ids = tokens(batch=2, seq=8)
        try:
            logits = model(input_ids=ids).logits
        except RuntimeError as e:
            torch.save({"error": str(e)}, os.path.join(out_dir, f"rank{rank}.pt"))
            return
        logits.float().logsumexp(-1).sum().backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        torch.save({"logits": logits.detach().float(), "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run(world, tmp_path, family, quant, granularity="per_layer"):
    out = tmp_path / f"w{world}_{family}_{quant}_{granularity}"
    out.mkdir()
    mp.spawn(_worker, args=(world, _free_port(), str(out), family, quant, granularity), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("family,quant", [("qwen3_moe", "quads"), ("qwen3", "w4a4_qat")])
def test_fsdp2_two_ranks_equal_one_rank(tmp_path, family, quant):
    one = _run(1, tmp_path, family, quant)[0]
    two = _run(2, tmp_path, family, quant)
    for r in two:
        assert torch.equal(r["logits"], one["logits"])
        assert r["grads"].keys() == one["grads"].keys()
        for k in one["grads"]:
            assert torch.equal(r["grads"][k], one["grads"][k]), k


def test_fsdp2_1rank_matches_unsharded_qat_model():
    """The 1-rank FSDP2 run (bf16 mixed precision) equals plain QAT on the bf16 model: QDQ saw the bf16 param."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from qat_models import tiny_model, tokens

    from verl_quads.qat import apply_qat

    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", dtype=torch.float32)
    for p in model.parameters():  # what MixedPrecisionPolicy(param_dtype=bf16) does; buffers stay fp32
        p.data = p.data.to(torch.bfloat16)
    apply_qat(model, "quads")
    logits = model(input_ids=tokens(batch=2, seq=8)).logits
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        one = _run(1, Path(d), "qwen3_moe", "quads")[0]
    assert torch.equal(logits.detach().float(), one["logits"])


def test_fsdp2_sharding_below_the_fused_group_is_refused(tmp_path):
    res = _run(2, tmp_path, "qwen3_moe", "quads", granularity="per_linear")
    for r in res:
        # q_proj has its own FSDP group: it is resharded after its forward, so k_proj's QDQ (which needs
        # the q/k/v group amax) sees q_proj's shard and refuses, naming it.
        assert "error" in r and "sharded DTensor" in r["error"], r
        assert "self_attn.q_proj.weight" in r["error"] or "self_attn.k_proj.weight" in r["error"], r["error"]
