"""QAT under FSDP2 (``fully_shard``) on 2 CPU ranks (gloo): outputs and gradients identical to plain
(unsharded, no FSDP) QAT of the same model with bf16 parameters.

The QDQ must see the full unsharded weight (global scale = amax of the whole tensor, and for q/k/v
and gate/up of the whole group); a shard's amax would give different values on each rank.

For CI time, ONE 2-rank gloo run (module fixture ``two_ranks``) holds every FSDP2 case: each rank
builds, shards and runs every (family, quant) model, then the per-projection sharding that must be
refused. The reference is computed in the pytest process without FSDP:
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` makes the QDQ see bf16 parameters and
turns the bf16 gradients into fp32 ones; both ranks feed the same tokens, so the gradient average
over 2 ranks is exact ((g + g) / 2 == g) and must equal the plain model's bf16 gradient in fp32.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from verl_quads.config import QuantConfig

#: (family, quant) of the equality cases; the refusal case runs on the first.
CASES = [("qwen3_moe", "quads"), ("qwen3", "w4a4_qat")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded_model(family: str, quant: str, granularity: str, mesh):
    from qat_models import tiny_model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from verl_quads.qat import apply_qat

    torch.manual_seed(0)
    model = tiny_model(family, dtype=torch.float32)
    apply_qat(model, QuantConfig(quant=quant))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if granularity == "per_linear":
        for layer in model.model.layers:
            fully_shard(layer.self_attn.q_proj, mesh=mesh, mp_policy=mp_policy)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def _worker(rank: int, world: int, port: int, out_dir: str):
    """Every case on this rank; saves ``rank{rank}.pt``: ``{(family, quant): {"logits", "grads"} or
    {"error"}, "refusal": {"error"} or {"logits"}}`` (logits float32 ``[2, 8, vocab]``, grads float32
    full tensors by parameter name)."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    import torch.distributed as dist
    from qat_models import tokens
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = {}
    try:
        mesh = init_device_mesh("cpu", (world,))
        ids = tokens(batch=2, seq=8)
        for family, quant in CASES:
            model = _sharded_model(family, quant, "per_layer", mesh)
            try:
                logits = model(input_ids=ids).logits
            except RuntimeError as e:
                res[(family, quant)] = {"error": str(e)}
                continue
            logits.float().logsumexp(-1).sum().backward()
            grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
            res[(family, quant)] = {"logits": logits.detach().float(), "grads": grads}
        # q_proj in its own FSDP group; both ranks raise in the same forward, before any collective
        # that the other rank would wait for.
        model = _sharded_model(*CASES[0], "per_linear", mesh)
        try:
            res["refusal"] = {"logits": model(input_ids=ids).logits.detach().float()}
        except RuntimeError as e:
            res["refusal"] = {"error": str(e)}
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Per-rank results of :func:`_worker` (list of 2 dicts)."""
    out = tmp_path_factory.mktemp("fsdp2_two_ranks")
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _plain_qat_reference(family: str, quant: str):
    """Logits (float32) and bf16 gradients of QAT on the unsharded model with bf16 parameters and
    fp32 buffers (what ``MixedPrecisionPolicy(param_dtype=bf16)`` makes each layer compute with)."""
    from qat_models import tiny_model, tokens

    from verl_quads.qat import apply_qat

    torch.manual_seed(0)
    model = tiny_model(family, dtype=torch.float32)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    apply_qat(model, QuantConfig(quant=quant))
    logits = model(input_ids=tokens(batch=2, seq=8)).logits
    logits.float().logsumexp(-1).sum().backward()
    return logits.detach().float(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family,quant", CASES)
def test_fsdp2_two_ranks_equal_unsharded_qat(two_ranks, family, quant):
    logits, grads = _plain_qat_reference(family, quant)
    assert all(g is not None and g.dtype == torch.bfloat16 for g in grads.values())
    for rank, res in enumerate(two_ranks):
        r = res[(family, quant)]
        assert "error" not in r, f"rank {rank}: FSDP2 forward of {family}/{quant} failed: {r.get('error')}"
        assert torch.equal(r["logits"], logits), f"rank {rank}: logits differ from unsharded QAT"
        assert r["grads"].keys() == grads.keys(), f"rank {rank}: parameter names differ"
        for k in grads:
            assert r["grads"][k].dtype == torch.float32, (rank, k, r["grads"][k].dtype)
            assert torch.equal(r["grads"][k], grads[k].float()), f"rank {rank}: gradient of {k} differs"


def test_fsdp2_sharding_below_the_fused_group_is_refused(two_ranks):
    for rank, res in enumerate(two_ranks):
        r = res["refusal"]
        # q_proj has its own FSDP group: it is resharded after its forward, so k_proj's QDQ (which needs
        # the q/k/v group amax) sees q_proj's shard and refuses, naming it.
        assert "error" in r, f"rank {rank}: per-projection fully_shard ran without the refusal"
        assert "sharded DTensor" in r["error"], (rank, r["error"])
        assert "self_attn.q_proj.weight" in r["error"] or "self_attn.k_proj.weight" in r["error"], r["error"]
