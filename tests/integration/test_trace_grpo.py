"""TRACE in the stock verl 0.9.1 GRPO run on CPU (issue 6, "Guidance: rollout -> trainer"; issue 8 demo).

``python -m verl.trainer.main_ppo`` with the command ``verl-quads demo --quant trace`` runs
(``verl_quads.demo.grpo_command``: stock GRPO + the CPU settings + ``actor_rollout_ref.actor.quant=trace``, ``--lr 1e-3``,
which alone puts vLLM in ``quads_nvfp4`` mode ``trace``, + prefix caching off) on the embedded demo
model (``verl_quads/assets/tiny_math_moe``: 4 layers, all guided; 8 prompts x 4 samples per step, the
demo's default: fewer gave all-zero rewards and no update), 2 GRPO steps, plus two PPO mini-batches
per step (below). Each generated sequence's guidance record travels vLLM worker -> verl's vLLM
server (``patches/verl_rollout_guidance.py``) -> ``non_tensor_batch["quads_guidance"]`` -> the actor's
log-prob and update passes, where one TraceBatch per micro-batch drives the guided layers (with
router replay from the record's expert ids). ``VERL_QUADS_TRACE_DUMP_DIR`` makes the actor write one
JSON per pass with its guided-QDQ self-check; ``VERL_QUADS_SYNC_DUMP_DIR`` (what ``demo --dump-dir``
sets) makes both ends of every weight sync dump what they hold. This one run replaces two (this file's
former run on a random 2-layer model, and ``test_demo.py``'s trace run with the demo's command):
one Ray + vLLM + FSDP start-up instead of two (CI time, issue 2); every check of both is kept.

Several PPO mini-batches per step: ``ppo_mini_batch_size=4`` (prompts) with 8 prompts x n=4 per step
gives 2 mini-batches of 16 sequences, so each step runs one log-prob pass and two update passes
(2 optimizer steps on the same rollout batch); the 2nd update pass runs with weights already moved by
the 1st, while the records (and the old log-probs of the importance ratio) belong to the rollout's
policy version (see ``verl_quads/integration/trace.py``, "Several mini-batches").

Asserts: both steps ran and logged reward and the ``quads/*`` gap metrics (finite, gap_max >= p99 >= 0);
per step, exactly one log-prob pass and 2 update passes (one per mini-batch),
all three guided with the policy version of the sync that preceded the step's rollout (consecutive
versions across steps), each with 0 mismatches of E4M3 block scales and global scales vs the records and
0 low-bit mismatches wherever the trainer's scaled value had two neighbouring codewords to choose
from, over a non-trivial number of elements; the log-prob pass and the 1st mini-batch (weights of the
rollout's version) have 0 low-bit mismatches at all; the 2nd mini-batch (weights moved by the 1st)
may have some only at values that are codewords themselves (``bit_mismatch_forced``: measured
3280 / 1490 and 3096 / 1806 of 788,480 elements in steps 1 / 2 of two runs of the 2-layer model,
0.19-0.42%); the update passes together cover exactly the log-prob pass's sequences and
tokens; guidance changed some roundings vs round-to-nearest (so it is not a no-op); bytes per
recorded token equal the docs/sync.md formula (int16 expert ids); the metric
``actor/quads/guidance_bytes_per_token`` is logged with that value; the routing metrics of the
log-prob pass are logged every step (``actor/quads/routing_disagreement`` in [0, 1],
``actor/quads/routing_disagreement_replayed`` == 0: all layers are guided, so router replay makes
the effective routing the rollout's, 0 uncovered tokens); the rollout ran NVFP4 in mode trace: after
every sync (one before the first rollout + one per step) vLLM holds ``quads_nvfp4`` packed FP4 codes
(uint8) + E4M3 block scales that dequantize to exactly the actor's QAT effective weights
(``torch.equal``); the weights changed between the first and last sync.
"""

from __future__ import annotations

import json
import math
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

DEMO_BATCH, DEMO_N = 8, 4  # the demo's default prompts x samples per step
#: ``verl-quads demo --lr`` (default 1e-4): 1e-3 as in the former 2-layer run (test_cpu_grpo's command), so
#: the 1st mini-batch's update moves the weights enough that the 2nd mini-batch meets many values whose
#: rounding changed since the rollout's version (at 1e-4: 0 / 16 forced low-bit mismatches in steps 1 / 2)
LR = 1e-3
QUADS_KEYS = ("quads/logp_gap_max", "quads/logp_gap_p99", "quads/logp_gap_mean", "quads/k3_kl")


MINI_BATCH_PROMPTS = 4  # data.train_batch_size=8 prompts per step -> 2 mini-batches
MINI_BATCHES = 2


def expected_bytes_per_token(cfg) -> int:
    """The bytes a token's guidance travels in (one row of ``verl_quads.rollout.trace_rows``, the wire's rows): per
    layer qkv (K = H), o_proj (K = A), w13 (K = H), w2 (top_k slots of K = I, with int16 expert ids), each GEMM's
    bits (K/8 per slot), block scales (K/16 per slot) and float32 global scales (4 per slot) padded to 8 bytes."""
    up = lambda n: -(-n // 8) * 8  # noqa: E731
    rec = lambda k, s=1: up(s * k // 8) + up(s * k // 16) + up(4 * s)  # noqa: E731
    h, a, i, k = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    return cfg.num_hidden_layers * (rec(h) + rec(a) + rec(h) + rec(i, k) + up(2 * k))


def test_grpo_trace_guidance_reaches_trainer(tmp_path):
    import torch
    from transformers import AutoConfig

    sys.path.insert(0, os.path.dirname(__file__))
    from test_cpu_grpo import LEAN_STARTUP, STEPS, parse_step_metrics

    import verl_quads
    from verl_quads.demo import ASSET as DEMO_MODEL
    from verl_quads.demo import grpo_command
    from verl_quads.rollout.emulation import weight_f32

    model_dir = DEMO_MODEL
    dump, sync_dump = tmp_path / "trace_dump", tmp_path / "sync_dump"
    # the demo's command (what `verl-quads demo --quant trace` runs) + 2 PPO mini-batches per step
    # (8 prompts / 4; micro-batch = one mini-batch of 16 sequences) + the tests' lean Ray/TransferQueue start-up;
    # later overrides win in Hydra
    cmd = grpo_command(model_dir, model_dir / "data", quant="trace", steps=STEPS, batch=DEMO_BATCH, n=DEMO_N, lr=LR) + [
        f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI_BATCH_PROMPTS}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MINI_BATCH_PROMPTS * DEMO_N}"] + LEAN_STARTUP
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
    for s, m in steps.items():
        for k in QUADS_KEYS + ("critic/score/mean",):
            assert k in m and math.isfinite(m[k]), (s, k, sorted(m))
        assert 0.0 <= m["critic/score/mean"] <= 1.0
        assert m["quads/logp_gap_max"] >= m["quads/logp_gap_p99"] >= 0.0

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

    # the rollout ran NVFP4 in mode trace: what vLLM holds after every sync = the actor's QAT weights
    trainer = sorted(sync_dump.glob("trainer_sync_*.pt"))
    vllm_side = sorted(sync_dump.glob("packed_sync_*.pt"))
    assert len(trainer) == len(vllm_side) >= STEPS + 1, ([p.name for p in trainer], [p.name for p in vllm_side])
    first = last = None
    for t_path, v_path in zip(trainer, vllm_side):
        eff = torch.load(t_path)["effective"]
        v = torch.load(v_path)
        assert v["header"]["quant"] == "trace" and v["header"]["rollout_mode"] == "trace", v["header"]
        held = v["vllm"]
        assert eff, "no quantized layers"
        for name, want in eff.items():
            assert held[f"{name}_packed"].dtype == torch.uint8
            assert held[f"{name}_scale"].dtype == torch.float8_e4m3fn
            got = weight_f32(held[f"{name}_packed"], held[f"{name}_scale"], held[f"{name}_global_scale"])
            assert torch.equal(got.to(want.dtype), want), (t_path.name, name)
        first = first or eff
        last = eff
    assert any(not torch.equal(first[k], last[k]) for k in first), "weights did not change between syncs"
