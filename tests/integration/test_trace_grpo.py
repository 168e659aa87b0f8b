"""TRACE in the stock verl 0.9.1 GRPO run on CPU (issue 6, "Guidance: rollout -> trainer").

``python -m verl.trainer.main_ppo`` (the CPU command of ``test_cpu_grpo.py``) with
``actor_rollout_ref.actor.quant=trace`` and vLLM in ``quads_nvfp4`` mode ``trace`` (engine_kwargs,
see docs/sync.md "Wiring"), prefix caching off, 2 GRPO steps on the tiny Qwen3-MoE (2 layers, both
guided). Each generated sequence's guidance record travels vLLM worker -> verl's vLLM server
(``patches/verl_rollout_guidance.py``) -> ``non_tensor_batch["quads_guidance"]`` -> the actor's
log-prob and update passes, where one TraceBatch per micro-batch drives the guided layers (with
router replay from the record's expert ids). ``VERL_QUADS_TRACE_DUMP_DIR`` makes the actor write one
JSON per pass with its guided-QDQ self-check.

Several PPO mini-batches per step: ``ppo_mini_batch_size=2`` (prompts) with 4 prompts x n=4 per step
gives 2 mini-batches of 8 sequences, so each step runs one log-prob pass and two update passes
(2 optimizer steps on the same rollout batch); the 2nd update pass runs with weights already moved by
the 1st, while the records (and the old log-probs of the importance ratio) belong to the rollout's
policy version (see ``verl_quads/integration/trace.py``, "Several mini-batches").

Asserts: both steps ran; per step, exactly one log-prob pass and 2 update passes (one per mini-batch),
all three guided with the policy version of the sync that preceded the step's rollout (consecutive
versions across steps), each with 0 mismatches of E4M3 block scales and global scales vs the records and
0 low-bit mismatches wherever the trainer's scaled value had two neighbouring codewords to choose
from, over a non-trivial number of elements; the log-prob pass and the 1st mini-batch (weights of the
rollout's version) have 0 low-bit mismatches at all; the 2nd mini-batch (weights moved by the 1st)
may have some only at values that are codewords themselves (``bit_mismatch_forced``: measured
3280 / 1490 and 3096 / 1806 of 788,480 elements in steps 1 / 2 of two runs, 0.19-0.42%); the update passes together cover exactly the log-prob pass's sequences and
tokens; guidance changed some roundings vs round-to-nearest (so it is not a no-op); bytes per
recorded token equal the docs/sync.md formula (int16 expert ids); the metric
``actor/quads/guidance_bytes_per_token`` is logged with that value; the routing metrics of the
log-prob pass are logged every step (``actor/quads/routing_disagreement`` in [0, 1],
``actor/quads/routing_disagreement_replayed`` == 0: both layers are guided, so router replay makes
the effective routing the rollout's, 0 uncovered tokens); the weights changed (the packed syncs
differ between the first and last sync).
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


MINI_BATCH_PROMPTS = 2  # data.train_batch_size=4 prompts per step -> 2 mini-batches
MINI_BATCHES = 2


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
    # 2 PPO mini-batches per step (4 prompts / 2); later overrides win in Hydra
    cmd = (cpu_grpo_command(model_dir, tmp_path / "data") + ["actor_rollout_ref.actor.quant=trace"] + ROLLOUT_TRACE
           + [f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI_BATCH_PROMPTS}"])
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
    # one actor process: file names sort by time -> per step: log_prob, update x MINI_BATCHES
    assert kinds == (["log_prob"] + ["update"] * MINI_BATCHES) * STEPS, kinds
    for p in passes:
        assert p["source"] == os.path.join(src, "verl_quads"), (p["source"], src)  # the worker ran this checkout
        assert p["tokens"] > 0 and p["bytes"] == want_bpt * p["tokens"], (p, want_bpt)
        assert p["audit_elements"] > 10_000, p
        # scales always the record's; every low bit the trainer had a choice for is the record's
        assert p["block_scale_mismatch"] == 0 and p["global_scale_mismatch"] == 0, p
        assert p["bit_mismatch_free"] == 0 and p["bit_mismatch"] == p["bit_mismatch_forced"], p
    assert sum(p["rounding_changed"] for p in passes) > 0, "guidance never changed a rounding"
    per_step = [passes[i:i + 1 + MINI_BATCHES] for i in range(0, len(passes), 1 + MINI_BATCHES)]
    v0 = per_step[0][0]["policy_version"]
    for s, group in enumerate(per_step):
        lp, ups = group[0], group[1:]
        # all mini-batches of a step are guided by the records of the step's rollout version
        assert [p["policy_version"] for p in group] == [v0 + s] * (1 + MINI_BATCHES), group
        assert sum(p["tokens"] for p in ups) == lp["tokens"] and sum(p["bytes"] for p in ups) == lp["bytes"], group
        assert all(0 < p["tokens"] < lp["tokens"] for p in ups), group  # really split, not one full-batch pass
        # log-prob pass and 1st mini-batch run the rollout version's weights: every code is the rollout's
        assert lp["bit_mismatch"] == 0 and ups[0]["bit_mismatch"] == 0, group
        # later mini-batches run weights moved by the earlier ones: only values that became codewords
        # (incl. the clamp at +-6) may carry another low bit (bit_mismatch_forced; 0 free ones, above)
    for s, m in steps.items():
        assert m["actor/quads/guidance_bytes_per_token"] == pytest.approx(want_bpt), m
        assert 0.0 <= m["actor/quads/routing_disagreement"] <= 1.0, m
        assert m["actor/quads/routing_disagreement_replayed"] == 0.0, m
        assert m["actor/quads/routing_compared_tokens"] > 0 and m["actor/quads/routing_uncovered_frac"] == 0.0, m
    print(f"\n[trace grpo] wall {time.time() - t0:.0f}s; {want_bpt} B/token; routing per step:",
          {s: {k: m[k] for k in m if k.startswith("actor/quads/routing")} for s, m in steps.items()}, "passes:")
    for p in passes:
        print("  ", {k: p[k] for k in ("pass", "policy_version", "bytes", "tokens", "response_tokens", "audit_elements",
                                        "rounding_changed", "forced", "bit_mismatch_forced", "bit_mismatch_free",
                                        "replay_disagree", "replay_tokens")})

    trainer = sorted(sync_dump.glob("trainer_sync_*.pt"))
    assert len(trainer) >= STEPS + 1
    first, last = torch.load(trainer[0])["effective"], torch.load(trainer[-1])["effective"]
    assert any(not torch.equal(first[k], last[k]) for k in first), "weights did not change between syncs"
