"""On a CUDA GPU (the H200): no host synchronisation in a steady-state QAT forward+backward, counted two
ways: aten ops that sync (:class:`verl_quads.qat.host_sync.HostSyncRecorder`, which on CUDA also sees
blocking host<->device copies): none; and the CUDA runtime's own synchronising calls in a
``torch.profiler`` trace (``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` / ``cudaEventSynchronize``
/ blocking ``cudaMemcpy``): no more than the stock BF16 model makes (printed with ``-s``). The CPU twin
is tests/unit/test_qat_host_syncs.py (same model and steps).

Run: ``python -m pytest -q -s tests/gpu/test_qat_host_syncs_gpu.py`` (torch + triton + transformers only).
"""

from __future__ import annotations

import pytest
import torch
from qat_models import tiny_model, tokens

from verl_quads.config import QuantConfig
from verl_quads.qat import InMemoryGuidanceStore, TraceBatch, apply_qat, trace_context
from verl_quads.qat.host_sync import HostSyncRecorder
from verl_quads.qat.replay import install_router_replay

pytestmark = pytest.mark.gpu

UIDS = ["s0/0", "s1/0"]
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _model(quant: str):
    model = tiny_model("qwen3_moe", layers=2, experts_impl="grouped_mm").cuda()
    state = apply_qat(model, QuantConfig(quant=quant, guided_layers=1), backend="triton")
    return model, state


def _step(model, ids, mask):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, attention_mask=mask).logits.float().square().mean().backward()


def _count(step) -> tuple[HostSyncRecorder, list[str]]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with HostSyncRecorder() as rec:
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
    torch.cuda.synchronize()
    calls = [e.name for e in prof.events() if e.name in _SYNC_CALLS]
    return rec, calls


@pytest.mark.parametrize("quant", ["w4a16", "w4a4_qat", "trace"])
def test_no_host_sync_on_cuda(quant):
    model, state = _model(quant)
    ids = tokens(2, 8).cuda()
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    if quant == "trace":
        store = InMemoryGuidanceStore()
        rec_tb = TraceBatch.padded(store, 3, UIDS, mask.cpu())
        rec_tb.record_into = store
        with torch.no_grad(), trace_context(model, rec_tb):
            model(input_ids=ids, attention_mask=mask)
        install_router_replay(model, state)
        tb = TraceBatch.padded(store, 3, UIDS, mask.cpu())

        def step():
            state.trace = tb  # as the verl engine does per micro-batch (verify once, after)
            try:
                _step(model, ids, mask)
            finally:
                state.trace = None
    else:
        tb = None

        def step():
            _step(model, ids, mask)

    step()
    step()
    rec, calls = _count(step)
    # the stock BF16 model's own sync calls (e.g. inside a C++ kernel such as the embedding backward's) are
    # not QAT's: QAT must add none
    stock = tiny_model("qwen3_moe", layers=2, experts_impl="grouped_mm").cuda()
    _step(stock, ids, mask)
    _, stock_calls = _count(lambda: _step(stock, ids, mask))
    print(f"{quant}: CUDA sync calls per fwd+bwd: QAT {calls}, stock BF16 {stock_calls}")
    assert len(rec) == 0, f"{quant}: {len(rec)} syncing ops:\n{rec.summary()}"
    assert len(calls) <= len(stock_calls), f"{quant}: CUDA sync calls {calls} vs stock BF16 {stock_calls}"
    if tb is not None:
        tb.verify()
    state.verify()
