"""``quads/routing_disagreement``: the trainer's router choices (RouterRecorder, real HF Qwen3-MoE routers)
against a rollout's, through the verl metric hook (``quads_gap_metrics``).

The "rollout" here is the same model with one layer's router perturbed, so the expected answer is known
without the code under test: 0 for identical routers, > 0 when a router changes, and the layers upstream
of the perturbed one must agree exactly (their inputs did not change).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from verl_quads.config import QuantConfig
from verl_quads.integration.trace import RouterRecorder

ASSET = Path(__file__).resolve().parents[2] / "verl_quads" / "assets" / "tiny_math_moe"


class _Batch:
    def __init__(self, **t):
        self.batch = t


def _routing(model, ids):
    with RouterRecorder(model) as rec, torch.no_grad():
        model(input_ids=ids)
        return rec.take()


@pytest.fixture(scope="module")
def trainer():
    from transformers import AutoModelForCausalLM

    from verl_quads.qat import apply_qat

    m = AutoModelForCausalLM.from_pretrained(str(ASSET), dtype=torch.float32)
    apply_qat(m, QuantConfig(quant="quads"), backend="torch")  # the trainer's w4a16 QAT forward
    return m.eval()


def test_recorder_shape_and_no_side_effect(trainer):
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = trainer(input_ids=ids).logits
    with RouterRecorder(trainer) as rec, torch.no_grad():
        out = trainer(input_ids=ids).logits
        r = rec.take()
    assert torch.equal(out, ref)
    assert r.shape == (22, 4, 2) and r.dtype == torch.int16 and int(r.min()) >= 0 and int(r.max()) < 8
    with pytest.raises(RuntimeError, match="did not run"):
        rec.take()
    with pytest.raises(ValueError, match="no MoE router"):
        RouterRecorder(torch.nn.Linear(4, 4))


def test_perturbed_router_raises_routing_disagreement(trainer):
    from verl_quads.patches.verl_gap_metrics import ACTOR_ROUTING_KEY, ROUTING_METRIC, quads_gap_metrics

    g = torch.Generator().manual_seed(1)
    bsz, prompt, resp = 4, 6, 10
    ids = torch.randint(3, 300, (bsz, prompt + resp), generator=g)
    mine = _routing(trainer, ids).reshape(bsz, prompt + resp, 4, 2)
    other = copy.deepcopy(trainer)
    with torch.no_grad():
        w = other.model.layers[2].mlp.gate.weight
        w.add_(torch.randn(w.shape, generator=g) * w.abs().mean() * 2)
    theirs = _routing(other, ids).reshape(bsz, prompt + resp, 4, 2)
    assert torch.equal(theirs[:, :, :2], mine[:, :, :2])  # layers before the perturbed router: identical

    mask = torch.ones(bsz, resp, dtype=torch.long)
    mask[0, 7:] = 0
    logp = -torch.rand(bsz, resp, generator=g)
    base = dict(rollout_log_probs=logp, old_log_probs=logp, response_mask=mask)
    same = quads_gap_metrics(_Batch(**base, routed_experts=mine, **{ACTOR_ROUTING_KEY: mine.clone()}))
    assert same[ROUTING_METRIC] == 0.0
    diff = quads_gap_metrics(_Batch(**base, routed_experts=theirs, **{ACTOR_ROUTING_KEY: mine}))
    # expected, counted here: response positions x layers whose sorted top-k differ
    a, b = torch.sort(theirs[:, prompt:].long(), -1).values, torch.sort(mine[:, prompt:].long(), -1).values
    differs = (a != b).any(-1) & mask.bool()[..., None]
    want = float(differs.sum()) / (int(mask.sum()) * 4)
    assert 0.0 < diff[ROUTING_METRIC] <= 1.0
    assert diff[ROUTING_METRIC] == pytest.approx(want)
    print(f"\nrouting_disagreement with layer 2's router perturbed: {diff[ROUTING_METRIC]:.3f}")
