"""QAT with the Triton NVFP4 kernels == QAT with the torch reference, bit for bit (forward and grads);
and the ``bench qat`` script runs end to end (tiny shapes)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from qat_models import tiny_model, tokens

from verl_quads.config import QuantConfig
from verl_quads.qat import InMemoryGuidanceStore, TraceBatch, apply_qat, trace_context

needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (scripts/test.sh sets it on CPU hosts)",
)


def _run(model, quant, ids):
    if quant != "trace":
        logits = model(input_ids=ids).logits
        logits.float().sum().backward()
        return logits.detach()
    store = InMemoryGuidanceStore()
    rec = TraceBatch.padded(store, 0, ["a", "b"], torch.ones_like(ids))
    rec.record_into = store
    with torch.no_grad(), trace_context(model, rec):
        model(input_ids=ids)
    with trace_context(model, TraceBatch.padded(store, 0, ["a", "b"], torch.ones_like(ids))):
        logits = model(input_ids=ids).logits
        logits.float().sum().backward()
    return logits.detach()


@needs_triton
@pytest.mark.parametrize("quant", ["quads", "w4a4_qat", "trace"])
def test_triton_backend_equals_torch_reference(quant):
    pytest.importorskip("triton")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    base = tiny_model("qwen3_moe").to(dev)
    ids = tokens().to(dev)
    res = {}
    for backend in ("torch", "triton"):
        m = copy.deepcopy(base)
        apply_qat(m, QuantConfig(quant=quant, guided_layers=1, backend=backend))
        res[backend] = (_run(m, quant, ids), {n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert torch.equal(res["torch"][0], res["triton"][0])
    assert all(torch.equal(res["torch"][1][k], res["triton"][1][k]) for k in res["torch"][1])


def test_bench_qat_runs_tiny():
    from verl_quads.bench import qat

    report = qat.main(["--tokens", "32", "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
                       "--experts", "4", "--top-k", "2", "--moe-inter", "32", "--iters", "1", "--warmup", "0",
                       "--backend", "torch"])
    for mode in ("bf16", "w4a16", "w4a4_qat", "trace"):
        assert f"\n{mode} " in report
