"""The trainer half through real verl 0.9.1: verl's composed config -> EngineRegistry -> FSDP2 engine.

``tests/integration/qat_engine_script.py`` runs in a fresh process (it initialises torch.distributed):
for each mode, ``actor_rollout_ref.actor.quant=<mode>`` is composed into verl's stock ``ppo_trainer``
config (no ``+``), verl builds the engine as its worker does, the engine loads the tiny random
Qwen3-MoE, applies verl-quads QAT, wraps with FSDP2 (gloo, 1 rank) and builds its optimizer; one
forward/backward/optimizer step follows, then a forward with the stepped weights. ``quads`` and ``trace`` run
the default ``quant_config.weight_qdq=auto``, which the engine's ``fsdp_qdq.setup`` turns into ``per_version``
here (FSDP2, torch 2.13: FSDP2 gathers shards QDQ'd once per weight version); ``w4a4_qat`` runs with an explicit
``per_forward``: both schedules through verl's engine, no extra engine build.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.verl]
pytest.importorskip("verl")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_built_from_composed_verl_config_one_step_each_mode(tmp_path):
    tiny = pytest.importorskip("verl_quads.models.tiny")
    model_dir = tiny.build_tiny_qwen3_moe(tmp_path / "model", num_layers=2, dtype="float32")
    script = Path(__file__).with_name("qat_engine_script.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(model_dir), str(_port()), "none", "naive", "quads", "w4a4_qat:per_forward",
         "trace"],
        capture_output=True, text=True, timeout=600,
    )
    results = {r["quant"]: r for r in (json.loads(l[7:]) for l in proc.stdout.splitlines() if l.startswith("RESULT "))}
    assert proc.returncode == 0 and len(results) == 5, proc.stdout[-3000:] + proc.stderr[-5000:]
    for quant, r in results.items():
        assert r["engine"] == "QuadsFSDPEngineWithLMHead", r
    for quant in ("none", "naive"):  # trainer mode none: stock modules, stock numerics
        assert results[quant]["qat_classes"] == [], results[quant]
    for quant in ("quads", "w4a4_qat:per_forward", "trace"):
        assert results[quant]["qat_classes"] == ["QATLinear", "QATQwen3MoeExperts"], results[quant]
    # weight_qdq auto (the default) -> per_version under verl's FSDP2 engine; explicit per_forward stays
    assert results["quads"]["weight_qdq"] == results["trace"]["weight_qdq"] == "per_version", results
    assert results["w4a4_qat:per_forward"]["weight_qdq"] == "per_forward", results
    # the engine's optimizer step frees the (then stale) per-version caches; the next forward remakes them
    # (after_step_equal_ref below)
    assert results["quads"]["caches_freed_by_step"] is True, results["quads"]
    for quant in ("none", "naive", "quads", "w4a4_qat:per_forward"):
        r = results[quant]
        # forward of verl's FSDP2 module == verl_quads.qat on the plain HF model (bit for bit),
        # and one optimizer step updates every parameter (names unchanged: checkpoints are stock);
        # the forward after the step == the reference with the stepped weights (per_version: refreshed)
        assert r["logits_equal_ref"] and r["finite"] and r["names_stock"], r
        assert r["changed"] == r["params"], r
        assert r["after_step_equal_ref"], r
    # verl does not feed TRACE guidance to the actor yet: a guided forward without a TraceBatch is an error.
    assert "no TraceBatch is active" in results["trace"]["error"]
