"""A trainer/engine mode mismatch fails the stock verl GRPO run fast, with the error in its output.

``python -m verl.trainer.main_ppo`` (the CPU command of ``test_cpu_grpo.py``) with
``actor_rollout_ref.actor.quant=quads`` and the test-only ``VERL_QUADS_TEST_FORCE_ROLLOUT_QUANT=none``,
which starts the vLLM engine stock (BF16) while the actor sends packed NVFP4: the real failure path —
the first weight sync (before the first rollout) reaches the vLLM worker, our patched
``update_weights_from_ipc`` refuses it with ``SyncModeError``. Before the fix main_ppo then hung
(verl's sender waited for a reply that never came; 15 min timeout observed); now it must exit
non-zero well within the timeout, the error naming both modes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.verl, pytest.mark.vllm]

TIMEOUT_S = 600  # a healthy 1-step run takes ~3 min here; a hang is killed at this bound


def test_mode_mismatch_fails_main_ppo_fast(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from test_cpu_grpo import cpu_grpo_command

    from verl_quads.integration.verl_config import TEST_FORCE_ROLLOUT_QUANT_ENV
    from verl_quads.models.data import write_gsm8k_parquet
    from verl_quads.models.tiny import build_tiny_qwen3_moe

    model_dir = build_tiny_qwen3_moe(tmp_path / "model")
    write_gsm8k_parquet(tmp_path / "data")
    cmd = cpu_grpo_command(model_dir, tmp_path / "data", steps=1) + ["actor_rollout_ref.actor.quant=quads"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0",
               **{TEST_FORCE_ROLLOUT_QUANT_ENV: "none"})
    log_path = tmp_path / "main_ppo.log"
    t0 = time.time()
    with open(log_path, "w") as f:
        # start_new_session: on a timeout the whole process group (Ray, vLLM) is killed, not left behind
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            pytest.fail(f"main_ppo still running after {TIMEOUT_S}s: a failed weight sync hangs it\n"
                        f"{log_path.read_text(errors='replace')[-4000:]}")
    wall = time.time() - t0
    log = log_path.read_text(errors="replace")
    assert rc != 0, log[-4000:]
    assert "SyncModeError" in log, log[-6000:]
    assert "trainer actor.quant='quads' (trainer mode 'w4a16') sends packed NVFP4 weights" in log, log[-6000:]
    assert "step:1 -" not in log  # no training step ran on mismatched weights
    print(f"main_ppo exited rc={rc} after {wall:.0f}s")
