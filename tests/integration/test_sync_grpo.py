"""Packed NVFP4 weight sync inside the stock verl 0.9.1 GRPO run on CPU (issue 6).

``python -m verl.trainer.main_ppo`` (the CPU command of ``test_cpu_grpo.py``) with
``actor_rollout_ref.actor.quant=quads`` as the only verl-quads setting (it also starts the vLLM engine
in ``quads_nvfp4`` mode ``quads``; see docs/sync.md "Wiring"), 2 GRPO steps. With ``VERL_QUADS_SYNC_DUMP_DIR``
both ends of every sync dump what they hold: the actor worker the QAT effective weights it computed
from its own parameters (QAT code path), the vLLM worker its quads_nvfp4 parameters after loading.
Asserts: one sync before the first rollout + one per step on both sides; after every sync, for every
quantized layer, vLLM's dequantization equals the actor's QAT effective weight (``torch.equal``);
the weights changed between the first and the last sync; bytes ~0.28x of bf16 in the actor's log.
Routing consistency (issue 6/7, default on): every step logs ``actor/quads/routing_disagreement`` in
[0, 1] over a non-zero number of compared response tokens, none uncovered (the positions producing
response log-probs are always computed by vLLM), from records of ``layers * top_k`` bytes per token.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.verl, pytest.mark.vllm]


def test_grpo_quads_packed_sync_bit_exact(tmp_path):
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from test_cpu_grpo import STEPS, cpu_grpo_command, parse_step_metrics

    from verl_quads.models.data import write_gsm8k_parquet
    from verl_quads.models.tiny import build_tiny_qwen3_moe
    from verl_quads.rollout.emulation import weight_f32

    model_dir = build_tiny_qwen3_moe(tmp_path / "model")
    write_gsm8k_parquet(tmp_path / "data")
    dump = tmp_path / "dump"
    cmd = cpu_grpo_command(model_dir, tmp_path / "data") + ["actor_rollout_ref.actor.quant=quads"]
    env = dict(os.environ, VERL_QUADS_SYNC_DUMP_DIR=str(dump), VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1",
               RAY_DEDUP_LOGS="0")
    t0 = time.time()
    log_path = tmp_path / "main_ppo.log"
    with open(log_path, "w") as f:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900)
    log = log_path.read_text(errors="replace")
    assert proc.returncode == 0, f"main_ppo failed after {time.time() - t0:.0f}s:\n{log[-6000:]}"
    steps = parse_step_metrics(log)
    assert sorted(steps) == list(range(1, STEPS + 1))
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    for s, m in steps.items():
        assert 0.0 <= m["actor/quads/routing_disagreement"] <= 1.0, (s, m)
        assert m["actor/quads/routing_compared_tokens"] > 0 and m["actor/quads/routing_uncovered_frac"] == 0.0, (s, m)
        assert m["actor/quads/routing_bytes_per_token"] == cfg.num_hidden_layers * cfg.num_experts_per_tok, (s, m)
    print("routing_disagreement per step:", {s: m["actor/quads/routing_disagreement"] for s, m in steps.items()})
    ratios = [float(r) for r in re.findall(r"quantized layers [\d.]+ MiB vs [\d.]+ MiB bf16 \(([\d.]+)x\)", log)]
    assert ratios and all(0.28125 <= r < 0.2825 for r in ratios), ratios

    trainer = sorted(dump.glob("trainer_sync_*.pt"))
    vllm_side = sorted(dump.glob("packed_sync_*.pt"))
    assert len(trainer) == len(vllm_side) >= STEPS + 1, ([p.name for p in trainer], [p.name for p in vllm_side])
    firsts = lasts = None
    for t_path, v_path in zip(trainer, vllm_side):
        eff = torch.load(t_path)["effective"]
        v = torch.load(v_path)
        assert v["header"]["quant"] == "quads"
        held = v["vllm"]
        assert len(eff) == 8
        for name, want in eff.items():
            got = weight_f32(held[f"{name}_packed"], held[f"{name}_scale"], held[f"{name}_global_scale"])
            assert torch.equal(got.to(want.dtype), want), (t_path.name, name)
        firsts = firsts or eff
        lasts = eff
    assert any(not torch.equal(firsts[k], lasts[k]) for k in firsts), "weights did not change between syncs"
    print(f"main_ppo wall {time.time() - t0:.0f}s, {len(trainer)} syncs, ratio {ratios[0]:.4f}")
