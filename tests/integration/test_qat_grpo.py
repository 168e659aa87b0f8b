"""``actor_rollout_ref.actor.quant=...`` on the stock verl 0.9.1 GRPO command line (no ``+``), on CPU.

- a bad value fails in Hydra composition, before Ray or any worker starts, naming the allowed values.

``quant=quads`` end to end with verl-quads QAT in the actor (the engine's log line with how many linear /
fused-expert modules it made quantization-aware) is asserted by the quads GRPO run of
``tests/integration/test_demo.py`` (one Ray + vLLM start-up shared with the demo and packed-sync checks).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.verl]
pytest.importorskip("verl")


def test_bad_quant_value_fails_before_any_worker(tmp_path):
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "algorithm.adv_estimator=grpo",
           "actor_rollout_ref.actor.quant=w4a8"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Invalid value 'w4a8', expected one of [none, naive, w4a16, quads, trace, w4a4_qat]" in out, out[-3000:]
    assert "actor_rollout_ref.actor.quant" in out
    assert "Started a local Ray instance" not in out and "ray.init" not in out
    print(f"failed in {time.time() - t0:.1f}s")
