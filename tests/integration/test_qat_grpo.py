"""``actor_rollout_ref.actor.quant=...`` on the stock verl 0.9.1 GRPO command line (no ``+``), on CPU.

- a bad value fails in Hydra composition, before Ray or any worker starts, naming the allowed values;
- ``quant=quads`` runs 2 GRPO steps end to end with verl-quads QAT in the actor (the engine logs how
  many linear / fused-expert modules it made quantization-aware).
"""

from __future__ import annotations

import os
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


@pytest.mark.slow
@pytest.mark.vllm
def test_stock_grpo_with_quant_quads_two_steps(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from test_cpu_grpo import STEPS, cpu_grpo_command, parse_step_metrics

    from verl_quads.models.data import write_gsm8k_parquet
    from verl_quads.models.tiny import build_tiny_qwen3_moe

    model_dir = build_tiny_qwen3_moe(tmp_path / "model")
    write_gsm8k_parquet(tmp_path / "data")
    # actor.quant alone: it also starts vLLM in quads_nvfp4 mode quads (the packed sync refuses a BF16 engine)
    cmd = cpu_grpo_command(model_dir, tmp_path / "data") + ["actor_rollout_ref.actor.quant=quads"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
    log_path = tmp_path / "main_ppo.log"
    t0 = time.time()
    with open(log_path, "w") as f:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900)
    log = log_path.read_text(errors="replace")
    assert proc.returncode == 0, f"main_ppo failed after {time.time() - t0:.0f}s:\n{log[-6000:]}"
    assert "verl-quads: QAT quads (trainer mode w4a16) on 8 linear and 2 fused-expert modules" in log, log[-6000:]
    metrics = parse_step_metrics(log)
    assert sorted(metrics) == list(range(1, STEPS + 1)), sorted(metrics)
    for step, m in metrics.items():
        print(f"step {step}: update_actor {m['timing_s/update_actor']:.2f}s "
              f"rollout_probs_diff_mean {m.get('training/rollout_probs_diff_mean', float('nan')):.4f}")
    print(f"main_ppo wall time {time.time() - t0:.0f}s")
