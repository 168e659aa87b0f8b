"""TRACE in the stock verl 0.9.1 GRPO run on CPU (issue 6, "Guidance: rollout -> trainer").

``python -m verl.trainer.main_ppo`` (the CPU command of ``test_cpu_grpo.py``) with
``actor_rollout_ref.actor.quant=trace`` and vLLM in ``quads_nvfp4`` mode ``trace`` (engine_kwargs,
see docs/sync.md "Wiring"), prefix caching off, 2 GRPO steps on the tiny Qwen3-MoE (2 layers, both
guided). Each generated sequence's guidance record travels vLLM worker -> verl's vLLM server
(``patches/verl_rollout_guidance.py``) -> ``non_tensor_batch["quads_guidance"]`` -> the actor's
log-prob and update passes, where one TraceBatch per micro-batch drives the guided layers (with
router replay from the record's expert ids). ``VERL_QUADS_TRACE_DUMP_DIR`` makes the actor write one
JSON per pass with its guided-QDQ self-check.

Asserts: both steps ran; every actor pass (log-prob + update, each step) was guided with the policy
version of the last sync (1 for step 1: the initial sync is 0... see below) and the trainer's guided
codes reproduce every record it was given (low code bit, E4M3 block scale and global scale of every
element: 0 mismatches) over a non-trivial number of elements; guidance changed some roundings vs
round-to-nearest (so it is not a no-op); bytes per recorded token equal the docs/sync.md formula
(int16 expert ids); the metric ``actor/quads/guidance_bytes_per_token`` is logged with that value;
the weights changed (the packed syncs differ between the first and last sync).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.verl,
    pytest.mark.vllm,
]

ROLLOUT_TRACE = [
    "+actor_rollout_ref.rollout.engine_kwargs.vllm.quantization=quads_nvfp4",
    "+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides="
    "{quantization_config:{quant_method:quads_nvfp4,quant:trace}}",
    "actor_rollout_ref.rollout.enable_prefix_caching=False",
]


def expected_bytes_per_token(cfg) -> int:
    """docs/sync.md: per layer rec(H) [qkv] + rec(A) [o_proj] + rec(H) [w13] + k*rec(I) [w2] + k*id_bytes."""
    rec = lambda k: k // 8 + k // 16 + 4  # noqa: E731
    h, a, i, k = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    return cfg.num_hidden_layers * (rec(h) + rec(a) + rec(h) + k * rec(i) + k * 2)


def test_grpo_trace_guidance_reaches_trainer(tmp_path):
    import torch
    from transformers import AutoConfig

    sys.path.insert(0, os.path.dirname(__file__))
    from test_cpu_grpo import STEPS, cpu_grpo_command, parse_step_metrics

    import verl_quads
    from verl_quads.models.data import write_gsm8k_parquet
    from verl_quads.models.tiny import build_tiny_qwen3_moe

    model_dir = build_tiny_qwen3_moe(tmp_path / "model")
    write_gsm8k_parquet(tmp_path / "data")
    dump, sync_dump = tmp_path / "trace_dump", tmp_path / "sync_dump"
    cmd = cpu_grpo_command(model_dir, tmp_path / "data") + ["actor_rollout_ref.actor.quant=trace"] + ROLLOUT_TRACE
    # The Ray workers must import verl_quads from this checkout: the venv's editable install points at
    # whichever clone last ran scripts/setup_env.sh (the venv is shared by hash), so put ours first.
    src = os.path.dirname(os.path.dirname(os.path.abspath(verl_quads.__file__)))
    env = dict(os.environ, VERL_QUADS_TRACE_DUMP_DIR=str(dump), VERL_QUADS_SYNC_DUMP_DIR=str(sync_dump),
               VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0",
               PYTHONPATH=os.pathsep.join([src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    t0 = time.time()
    log_path = tmp_path / "main_ppo.log"
    with open(log_path, "w") as f:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900)
    log = log_path.read_text(errors="replace")
    assert proc.returncode == 0, f"main_ppo failed after {time.time() - t0:.0f}s:\n{log[-8000:]}"
    steps = parse_step_metrics(log)
    assert sorted(steps) == list(range(1, STEPS + 1))

    cfg = AutoConfig.from_pretrained(model_dir)
    want_bpt = expected_bytes_per_token(cfg)
    passes = [json.loads(p.read_text()) for p in sorted(dump.glob("trace_*.json"))]
    kinds = [p["pass"] for p in passes]
    assert kinds.count("log_prob") == STEPS and kinds.count("update") >= STEPS, kinds
    for p in passes:
        assert p["source"] == os.path.join(src, "verl_quads"), (p["source"], src)  # the worker ran this checkout
        assert p["tokens"] > 0 and p["bytes"] == want_bpt * p["tokens"], (p, want_bpt)
        assert p["audit_elements"] > 10_000, p
        assert p["bit_mismatch"] == 0 and p["block_scale_mismatch"] == 0 and p["global_scale_mismatch"] == 0, p
    assert sum(p["rounding_changed"] for p in passes) > 0, "guidance never changed a rounding"
    versions = sorted({p["policy_version"] for p in passes})
    assert versions == list(range(versions[0], versions[0] + STEPS)), versions
    for s, m in steps.items():
        assert m["actor/quads/guidance_bytes_per_token"] == pytest.approx(want_bpt), m
    print(f"\n[trace grpo] wall {time.time() - t0:.0f}s; {want_bpt} B/token; passes:")
    for p in passes:
        print("  ", {k: p[k] for k in ("pass", "policy_version", "bytes", "tokens", "response_tokens", "audit_elements",
                                        "rounding_changed", "replay_disagree", "replay_tokens")})

    trainer = sorted(sync_dump.glob("trainer_sync_*.pt"))
    assert len(trainer) >= STEPS + 1
    first, last = torch.load(trainer[0])["effective"], torch.load(trainer[-1])["effective"]
    assert any(not torch.equal(first[k], last[k]) for k in first), "weights did not change between syncs"
