"""``quant_config.weight_qdq=auto`` (the default): what :func:`verl_quads.qat.fsdp_qdq.setup` decides.

per_version when the root is FSDP2-sharded and the FSDP2 patch's torch guard accepts the installed torch, else
per_forward (INFO; WARNING when an FSDP2 model had to take per_forward); explicit per_version where it cannot
run raises. FSDP2 here: a 1-rank gloo group in this process (``bench.qat._one_rank_group``), a tiny random
Qwen3-MoE. Bit-identity of per_version and per_forward on 2 ranks: tests/unit/test_qat_fsdp2.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from qat_models import tiny_model, tokens
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from verl_quads.config import QuantConfig
from verl_quads.patches import _guard
from verl_quads.patches import fsdp2_qdq_all_gather as patch
from verl_quads.qat import apply_qat, fsdp_qdq


@pytest.fixture
def mesh():
    from verl_quads.bench.qat import _one_rank_group

    cleanup = _one_rank_group("cpu")
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        cleanup()


def _sharded(mesh, weight_qdq: str, quant: str = "quads"):
    """Tiny Qwen3-MoE, fp32 master, QAT, fully_shard on each layer and the root with verl's mixed precision."""
    model = tiny_model("qwen3_moe", dtype=torch.float32, layers=2)
    apply_qat(model, QuantConfig(quant=quant, weight_qdq=weight_qdq, backend="torch"))
    mpp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mpp)
    fully_shard(model, mesh=mesh, mp_policy=mpp)
    return model


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens()).logits.float()


def _unsupported_torch(monkeypatch, version: str = "2.12.0") -> None:
    """The guard reads the installed version through _guard.installed_version: report another torch."""
    real = _guard.installed_version
    monkeypatch.setattr(_guard, "installed_version",
                        lambda *names: ("torch", version) if names == ("torch",) else real(*names))


def test_auto_on_fsdp2_with_supported_torch_takes_per_version(mesh, caplog):
    assert _guard.base_version(torch.__version__) in patch.SUPPORTED_TORCH  # this environment's torch (2.13.0)
    model = _sharded(mesh, "auto")
    with caplog.at_level(logging.INFO, logger="verl_quads"):
        assert fsdp_qdq.setup(model) == "per_version"
    assert fsdp_qdq.installed(model) is not None and model._verl_quads_qat.weight_qdq == "per_version"
    assert [r.levelname for r in caplog.records if "weight_qdq auto -> per_version" in r.message] == ["INFO"]
    pf = _sharded(mesh, "per_forward")
    assert fsdp_qdq.setup(pf) == "per_forward" and fsdp_qdq.installed(pf) is None
    got, want = _logits(model), _logits(pf)
    assert fsdp_qdq.installed(model).refreshes == 1  # the forward ran on the per-version caches
    assert torch.equal(got, want)


def test_auto_without_fsdp2_takes_per_forward(caplog):
    model = tiny_model("qwen3_moe")
    apply_qat(model, QuantConfig(quant="quads", backend="torch"))  # weight_qdq default: auto
    assert model._verl_quads_qat.config.weight_qdq == "auto"
    with caplog.at_level(logging.INFO, logger="verl_quads"):
        assert fsdp_qdq.setup(model) == "per_forward"
    assert fsdp_qdq.installed(model) is None
    assert [r.levelname for r in caplog.records if "weight_qdq auto -> per_forward: the model (Qwen3MoeForCausalLM) "
            "is not FSDP2-sharded" in r.message] == ["INFO"]
    # a model on which setup never ran (a hand-written loop): per_forward at the first QAT forward, logged once
    bare = tiny_model("qwen3_moe")
    apply_qat(bare, QuantConfig(quant="quads", backend="torch"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="verl_quads"):
        a, b = _logits(bare), _logits(bare)
    assert bare._verl_quads_qat.weight_qdq == "per_forward"
    assert len([r for r in caplog.records if "no per-version weight QDQ was set up" in r.message]) == 1
    ref = tiny_model("qwen3_moe")
    apply_qat(ref, QuantConfig(quant="quads", backend="torch", weight_qdq="per_forward"))
    assert torch.equal(a, _logits(ref)) and torch.equal(a, b)


def test_auto_on_fsdp2_with_unsupported_torch_warns_and_takes_per_forward(mesh, monkeypatch, caplog):
    _unsupported_torch(monkeypatch)
    model = _sharded(mesh, "auto")
    with caplog.at_level(logging.INFO, logger="verl_quads"):
        assert fsdp_qdq.setup(model) == "per_forward"
    assert fsdp_qdq.installed(model) is None and model._verl_quads_qat.weight_qdq == "per_forward"
    warned = [r for r in caplog.records if "weight_qdq auto -> per_forward on an FSDP2 model" in r.message]
    assert [r.levelname for r in warned] == ["WARNING"], caplog.records
    assert "torch 2.12.0" in warned[0].message and "supports torch 2.11.0, 2.13.0" in warned[0].message
    pf = _sharded(mesh, "per_forward")
    assert torch.equal(_logits(model), _logits(pf))  # per_forward's values: the forward QDQs the gathered weight


def test_explicit_per_version_on_unsupported_torch_is_an_error(mesh, monkeypatch):
    _unsupported_torch(monkeypatch)
    model = _sharded(mesh, "per_version")
    with pytest.raises(fsdp_qdq.PerVersionUnsupported,
                       match=r"weight_qdq=per_version needs the FSDP2 all-gather patch, which supports torch 2.11.0, "
                             r"2.13.0 only: .*found 2.12.0.*Use weight_qdq=per_forward"):
        fsdp_qdq.setup(model)
    assert fsdp_qdq.installed(model) is None
    with pytest.raises(RuntimeError, match=r"weight_qdq=per_version but no FSDP2 per-version weight QDQ is installed"):
        _logits(model)  # never a silent fallback to the plain weight or to per_forward


def test_release_drops_caches_and_the_next_forward_remakes_them(mesh):
    """What verl-quads' engine does on param offload (engine.to("cpu")): the caches go, the next root forward
    refreshes from the master shards; a gather from a released cache is refused like a stale one."""
    model = _sharded(mesh, "auto")
    assert fsdp_qdq.setup(model) == "per_version"
    first = _logits(model)
    qdq = fsdp_qdq.installed(model)
    assert fsdp_qdq.release(model) and all(e.cache is None for e in qdq.entries)
    with pytest.raises(RuntimeError, match=r"changed since its NVFP4 QDQ cache was made"):
        qdq.entries[0].gather_input()
    assert torch.equal(_logits(model), first) and qdq.refreshes == 2
    assert not fsdp_qdq.release(tiny_model("qwen3"))  # no QAT / nothing installed: no-op


def test_auto_per_version_with_gradient_checkpointing_equals_per_forward(mesh):
    """verl's recipes enable gradient checkpointing (``gradient_checkpointing_enable(use_reentrant=False)``, as
    verl's FSDP engine calls it): the recomputed forward inside the backward all-gathers the cached QDQ shards
    again. Loss and every gradient equal per_forward's bit for bit (1 rank, SDPA on CPU), and one refresh
    served the forward and the recompute."""
    res = {}
    for wq in ("auto", "per_forward"):
        model = _sharded(mesh, wq)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        assert fsdp_qdq.setup(model) == ("per_version" if wq == "auto" else "per_forward")
        loss = model(input_ids=tokens()).logits.float().logsumexp(-1).mean()
        loss.backward()
        res[wq] = [loss.detach()] + [p.grad.to_local().clone() for p in model.parameters()]
        if wq == "auto":
            assert fsdp_qdq.installed(model).refreshes == 1
    assert len(res["auto"]) == len(res["per_forward"]) > 10
    for i, (a, b) in enumerate(zip(res["auto"], res["per_forward"])):
        assert torch.equal(a, b), i
