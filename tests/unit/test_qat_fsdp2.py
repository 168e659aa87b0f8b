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

``quant_config.weight_qdq=per_version`` (verl_quads/qat/fsdp_qdq.py: each rank QDQs its shard once per
weight version, FSDP2 all-gathers the QDQ'd shards) runs in the same spawn: forward, gradients, the forward
after an AdamW step and after a hand edit of a master weight must equal the per-forward path bit for bit
(which QDQs the freshly gathered weight in every forward: the fresh reference), state_dict and optimizer
state are stock, a NaN weight is named, a weight changed between forward and backward is refused; also
uneven shards (3 experts on 2 ranks), q_proj in its own FSDP group, and a world-size-1 FSDP mesh.
"""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from verl_quads.config import QuantConfig

#: (family, quant) of the equality cases; the refusal case runs on the first.
CASES = [("qwen3_moe", "quads"), ("qwen3", "w4a4_qat")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _uneven_moe():
    """A 1-layer Qwen3-MoE with 3 experts: on 2 ranks the expert stacks shard as 2 + 1 (+ 1 padding row)."""
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False, head_dim=32,
                            intermediate_size=64, moe_intermediate_size=32, num_experts=3, num_experts_per_tok=2,
                            decoder_sparse_step=1, norm_topk_prob=True)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    return model


class _TransposedExperts(torch.nn.Module):
    """gpt-oss-style fused experts (``is_transposed``: ``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``,
    K = dim 1): every token through every expert, weighted (a tiny stand-in with the transformers experts
    signature; QAT needs only the layout)."""

    is_transposed = True

    def __init__(self, experts=3, hidden=32, inter=16):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, hidden, 2 * inter) * 0.05)
        self.down_proj = torch.nn.Parameter(torch.randn(experts, inter, hidden) * 0.05)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        h = torch.einsum("th,ehi->eti", hidden_states, self.gate_up_proj)
        gate, up = h.chunk(2, dim=-1)
        y = torch.einsum("eti,eih->eth", F.silu(gate) * up, self.down_proj)
        return (y * top_k_weights.t().unsqueeze(-1)).sum(0)


class _TransposedLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.experts = _TransposedExperts()

    def forward(self, x):
        return self.mlp.experts(x, None, torch.softmax(x[:, :3], dim=-1))


class _TransposedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        import types

        self.config = types.SimpleNamespace(num_hidden_layers=1)
        self.layers = torch.nn.ModuleList([_TransposedLayer()])

    def forward(self, x):
        return self.layers[0](x)


def _sharded_model(family: str, quant: str, granularity: str, mesh, weight_qdq: str = "per_forward"):
    from qat_models import tiny_model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from verl_quads.qat import apply_qat

    torch.manual_seed(0)
    if family == "transposed_experts":
        model = _TransposedModel()
    else:
        model = _uneven_moe() if family == "qwen3_moe_3experts" else tiny_model(family, dtype=torch.float32)
    apply_qat(model, QuantConfig(quant=quant, weight_qdq=weight_qdq))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if family == "transposed_experts":
        fully_shard(model.layers[0], mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        if weight_qdq == "per_version":
            from verl_quads.qat import fsdp_qdq

            fsdp_qdq.install(model)
        return model
    if granularity == "per_linear":
        for layer in model.model.layers:
            fully_shard(layer.self_attn.q_proj, mesh=mesh, mp_policy=mp_policy)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if weight_qdq == "per_version":
        from verl_quads.qat import fsdp_qdq

        fsdp_qdq.install(model)
    return model


#: A weight of layer 0 edited by hand (in place, no_grad) in the per-version sequence.
_HAND_EDITED = {"qwen3_moe": "model.layers.0.mlp.experts.gate_up_proj", "qwen3": "model.layers.0.mlp.up_proj.weight"}


def _forward_backward(model, ids) -> dict:
    logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).sum().backward()
    return {"logits": logits.detach().float(),
            "grads": {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}}


def _forward_backward_x(model, x) -> dict:
    y = model(x.to(torch.bfloat16))
    y.float().pow(2).sum().backward()
    return {"logits": y.detach().float(),
            "grads": {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}}


def _sequence(model, ids, hand_edited: str) -> dict:
    """forward/backward, AdamW step, forward, hand edit of one master weight, forward; then what
    state_dict / optimizer state / torch.save see (float32 logits; metadata as tuples)."""
    import io

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = _forward_backward(model, ids)
    opt.step()
    opt.zero_grad()
    out["after_step"] = model(input_ids=ids).logits.detach().float()
    with torch.no_grad():
        dict(model.named_parameters())[hand_edited].mul_(1.5)
    out["after_edit"] = model(input_ids=ids).logits.detach().float()
    model._verl_quads_qat.verify()
    out["state_dict"] = {k: (tuple(v.shape), v.dtype, type(v).__name__) for k, v in model.state_dict().items()}
    out["optim"] = [(k, tuple(v.shape), v.dtype) for st in opt.state_dict()["state"].values()
                    for k, v in sorted(st.items()) if torch.is_tensor(v)]
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)  # the checkpoint manager's way: must pickle as stock
    out["saved_bytes"] = buf.tell()
    return out


def _per_version_cases(rank: int, world: int, mesh, ids) -> dict:
    """Every per-version case on this rank (see the module docstring)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    res = {}
    for family, quant in CASES:
        pf = _sequence(_sharded_model(family, quant, "per_layer", mesh), ids, _HAND_EDITED[family])
        model = _sharded_model(family, quant, "per_layer", mesh, "per_version")
        pv = _sequence(model, ids, _HAND_EDITED[family])
        pv["refreshes"] = model._verl_quads_qat.fsdp_qdq.refreshes
        # a NaN in the second expert of rank 1's shard (global expert 3 of 4); every rank bumps the version
        # (SPMD), the check must name the weight and the global expert on every rank
        if family == "qwen3_moe":
            w = dict(model.named_parameters())["model.layers.1.mlp.experts.down_proj"]
            with torch.no_grad():
                w.mul_(1.0)
                if rank == 1:
                    w._local_tensor[1, 0, 0] = float("nan")
            model(input_ids=ids)
            try:
                model._verl_quads_qat.verify()
                pv["nan_error"] = None
            except ValueError as e:
                pv["nan_error"] = str(e)
        # changed between forward and backward: the backward's re-gather must refuse (last use of the model)
        logits = model(input_ids=ids).logits
        with torch.no_grad():
            dict(model.named_parameters())[_HAND_EDITED[family]].mul_(2.0)
        try:
            logits.float().sum().backward()
            pv["stale_error"] = None
        except RuntimeError as e:
            pv["stale_error"] = str(e)
        res[(family, quant)] = {"per_forward": pf, "per_version": pv}
    # uneven shards; q_proj in its own FSDP group (per_version takes group amaxes from the all-reduce,
    # so it needs no fused group inside one FSDP unit); an FSDP mesh of one rank (torch's no-collective path)
    res["uneven"] = (_forward_backward(_sharded_model("qwen3_moe_3experts", "quads", "per_layer", mesh), ids),
                     _forward_backward(_sharded_model("qwen3_moe_3experts", "quads", "per_layer", mesh, "per_version"), ids))
    res["per_linear"] = _forward_backward(_sharded_model(*CASES[0], "per_linear", mesh, "per_version"), ids)
    # transposed experts (K = dim 1), 3 experts on 2 ranks; and the same model without QAT (bf16 under FSDP)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(2))
    res["transposed"] = [_forward_backward_x(_sharded_model("transposed_experts", q, "per_layer", mesh, wq), x)
                         for q, wq in (("quads", "per_forward"), ("quads", "per_version"), ("none", "per_forward"))]
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in order
    mesh1 = DeviceMesh.from_group(groups[rank], "cpu")
    res["world1"] = (_forward_backward(_sharded_model(*CASES[1], "per_layer", mesh1), ids),
                     _forward_backward(_sharded_model(*CASES[1], "per_layer", mesh1, "per_version"), ids))
    return res


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
        try:
            res["per_version"] = _per_version_cases(rank, world, mesh, ids)
        except Exception:  # noqa: BLE001 - reported by the per-version tests (the other cases still count)
            import traceback

            res["per_version"] = {"error": traceback.format_exc()}
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


def _per_version(two_ranks, rank):
    pv = two_ranks[rank]["per_version"]
    assert "error" not in pv, f"rank {rank}: per-version cases failed:\n{pv['error']}"
    return pv


def _assert_same(a: dict, b: dict, what: str):
    assert torch.equal(a["logits"], b["logits"]), f"{what}: logits differ"
    assert a["grads"].keys() == b["grads"].keys(), what
    for k in a["grads"]:
        assert a["grads"][k].dtype == b["grads"][k].dtype, (what, k)
        assert torch.equal(a["grads"][k], b["grads"][k]), f"{what}: gradient of {k} differs"


@pytest.mark.parametrize("family,quant", CASES)
def test_fsdp2_per_version_weight_qdq_equals_per_forward(two_ranks, family, quant):
    logits, grads = _plain_qat_reference(family, quant)
    for rank in range(2):
        r = _per_version(two_ranks, rank)[(family, quant)]
        pf, pv = r["per_forward"], r["per_version"]
        # first forward/backward: == plain unsharded QAT (in-process reference) and == per_forward
        _assert_same(pv, {"logits": logits, "grads": {k: g.float() for k, g in grads.items()}}, f"rank {rank} vs plain")
        _assert_same(pv, pf, f"rank {rank} per_version vs per_forward")
        # after the optimizer step and after a hand edit, the next forward uses the new weights: equal to the
        # path that QDQs the freshly gathered weight in that forward; and the weights did change
        for key in ("after_step", "after_edit"):
            assert torch.equal(pv[key], pf[key]), f"rank {rank}: {key} logits differ from per_forward"
        assert not torch.equal(pv["after_step"], pv["logits"]) and not torch.equal(pv["after_edit"], pv["after_step"])
        assert pv["refreshes"] == 3, pv["refreshes"]  # install + after step + after edit; none in between
        # parameters, optimizer state and checkpoints are stock
        assert pv["state_dict"] == pf["state_dict"], rank
        assert pv["optim"] == pf["optim"] and pv["optim"], rank
        assert pv["saved_bytes"] == pf["saved_bytes"], rank
        assert pv["stale_error"] is not None, f"rank {rank}: a weight changed after the forward was gathered in backward"
        assert "refusing to all-gather stale weights" in pv["stale_error"], pv["stale_error"]
        assert _HAND_EDITED[family] in pv["stale_error"], pv["stale_error"]


def test_fsdp2_per_version_names_nan_weight_and_global_expert(two_ranks):
    for rank in range(2):
        err = _per_version(two_ranks, rank)[CASES[0]]["per_version"]["nan_error"]
        assert err is not None, f"rank {rank}: NaN weight not reported"
        assert "NaN/Inf weights at forward time in model.layers.1.mlp.experts.down_proj (experts [3])" in err, err


def test_fsdp2_per_version_uneven_shards_own_group_one_rank_transposed_experts(two_ranks):
    logits, grads = _plain_qat_reference(*CASES[0])
    plain = {"logits": logits, "grads": {k: g.float() for k, g in grads.items()}}
    for rank in range(2):
        pv = _per_version(two_ranks, rank)
        _assert_same(pv["uneven"][1], pv["uneven"][0], f"rank {rank}: 3 experts on 2 ranks")
        # per_forward refuses q_proj in its own FSDP group (test above); per_version serves it exactly
        _assert_same(pv["per_linear"], plain, f"rank {rank}: q_proj in its own FSDP group")
        _assert_same(pv["world1"][1], pv["world1"][0], f"rank {rank}: FSDP mesh of one rank")
        pf_t, pv_t, bf16_t = pv["transposed"]
        _assert_same(pv_t, pf_t, f"rank {rank}: transposed experts")
        assert not torch.equal(pv_t["logits"], bf16_t["logits"]), "transposed experts: QDQ changed nothing"


def test_bench_qat_fsdp_per_version_runs_tiny():
    """``bench qat --fsdp`` (1-rank gloo group made and destroyed by the bench, in this process): the device
    check (per_version vs per_forward, with a per_forward rerun control and SDPA forced to math) finds every
    tensor and every QDQ weight bit-identical on CPU, and in the interleaved timing per_version refreshes once
    per timed unit (one weight version), not once per micro-batch; the no-FSDP baseline and both FSDP
    settings (fp32 and bf16 master) are reported with the QAT added ms."""
    import re

    import torch.distributed as dist

    from verl_quads.bench import qat

    was_initialized = dist.is_initialized()
    report = qat.main(["--fsdp", "--tokens", "16", "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--head-dim",
                       "32", "--experts", "4", "--top-k", "2", "--moe-inter", "32", "--rounds", "1", "--units", "3",
                       "--warmup", "1", "--backend", "torch", "--modes", "bf16", "w4a16", "--micro-batches", "3"])
    assert dist.is_initialized() == was_initialized  # the bench's own group is gone again
    assert re.search(r"w4a16: per_version output, input gradient and \d+ weight gradients bit-identical to "
                     r"per_forward: True", report), report
    assert re.search(r"w4a16: QDQ weights .* 6 tensors bit-identical: True", report), report  # q/k/v/o + 2 expert stacks
    assert "w4a16: verdict: per_version bit-identical to per_forward (output, input grad, every weight grad)" in report
    assert "FAILED" not in report, report
    rows = {tuple(c.strip() for c in line.split("|")[:4]): [c.strip() for c in line.split("|")]
            for line in report.splitlines() if line.count("|") == 9}
    for setting in ("fp32 master", "bf16 master"):
        # weight_qdq auto (the default, set up as verl-quads' engine does) is per_version here: one refresh per
        # unit of 3 micro-batches
        assert rows[(setting, "w4a16", "auto", "3")][9] == "1", rows
        assert rows[(setting, "w4a16", "per_forward", "3")][9] == "0", rows
        assert rows[(setting, "bf16", "-", "3")][7] == "0", rows  # added ms of the baseline itself
    assert re.search(r"^w4a16 +\| [0-9.]+ +\|", report, re.M), report  # the no-FSDP table
    assert "w4a16 auto (fp32 master) -> per_version" in report and "w4a16 auto (bf16 master) -> per_version" in report
    assert "G = forward+backward micro-batches per weight version" in report
    head = report[report.index("HEADLINE: the default path of a verl user"):].splitlines()
    assert [c.strip() for c in head[1].split("|")] == ["mode", "weight_qdq", "G", "ms", "added ms", "x issue"], head
    w4 = [c.strip() for c in head[3].split("|")]
    # the added ms is a timing (it can come out negative on a loaded 2-core machine): only that it was measured
    assert w4[:3] == ["w4a16", "auto -> per_version", "3"] and math.isfinite(float(w4[5])), head


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (triton backend on CPU)")
def test_per_version_step_is_host_sync_free():
    """A forward+backward whose root pre-forward refreshes the shard caches (after an in-place weight change)
    has no device->host sync with the triton backend (HostSyncRecorder; 1-rank gloo group in this process),
    like the per_forward step (tests/unit/test_qat_host_syncs.py)."""
    from qat_models import tiny_model, tokens
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from verl_quads.bench.qat import _one_rank_group
    from verl_quads.qat import apply_qat, fsdp_qdq
    from verl_quads.qat.host_sync import HostSyncRecorder

    cleanup = _one_rank_group("cpu")
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = tiny_model("qwen3_moe", dtype=torch.float32, layers=1)
        apply_qat(model, QuantConfig(quant="quads", weight_qdq="per_version", backend="triton"))
        mpp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model.model.layers[0], mesh=mesh, mp_policy=mpp)
        fully_shard(model, mesh=mesh, mp_policy=mpp)
        qdq = fsdp_qdq.install(model)
        ids = tokens()
        model(input_ids=ids).logits.float().sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0)
        with HostSyncRecorder() as rec:
            model(input_ids=ids).logits.float().sum().backward()
        assert qdq.refreshes == 2, qdq.refreshes
        assert len(rec) == 0, rec.summary()
    finally:
        cleanup()
