"""``quant=naive`` end to end in the stock verl 0.9.1 GRPO run on CPU (issue 8).

``python -m verl.trainer.main_ppo`` (the CPU command of ``test_cpu_grpo.py``) with
``actor_rollout_ref.actor.quant=naive`` as the only verl-quads setting: the trainer runs verl's stock
forward (no QAT), vLLM runs ``quads_nvfp4`` in mode ``naive`` (W4A4 round-to-nearest), and the weight
sync packs the trainer's weights to NVFP4 (``verl_quads.sync.trainer.plan_for_stock_trainer``).
With ``VERL_QUADS_SYNC_DUMP_DIR`` the actor dumps the unquantized weights it packed (``source``: its
weights cast to the FSDP ``param_dtype``, bf16, in vLLM's fused layout) and vLLM dumps the
``quads_nvfp4`` parameters it holds after loading.

Asserts, after every sync (initial + one per step), for every quantized layer: vLLM's dequantized
weight equals ``nvfp4.fake_quantize`` of the trainer's bf16 weight with the scale sharing of the
config (one global scale per fused tensor, one per expert), computed here from the dump with the
core (``torch.equal``), and vLLM's packed bytes equal the engine's own quantization of that bf16
weight (``rollout.emulation.quantize_weight``, the path that loads a BF16 checkpoint); the trainer ran
no QAT (its log says so, and no "QAT ... on N linear" line); both steps logged the ``quads/*`` gap
metrics; the weights changed between the first and the last sync.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.verl, pytest.mark.vllm]

QUADS_KEYS = ("quads/logp_gap_max", "quads/logp_gap_p99", "quads/logp_gap_mean", "quads/k3_kl")


def test_grpo_naive_rollout_holds_rtn_of_stock_trainer(tmp_path):
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from test_cpu_grpo import STEPS, cpu_grpo_command, parse_step_metrics

    import verl_quads
    from verl_quads import nvfp4
    from verl_quads.models.data import write_gsm8k_parquet
    from verl_quads.models.tiny import build_tiny_qwen3_moe
    from verl_quads.rollout.emulation import quantize_weight, weight_f32

    model_dir = build_tiny_qwen3_moe(tmp_path / "model")
    write_gsm8k_parquet(tmp_path / "data")
    dump = tmp_path / "dump"
    cmd = cpu_grpo_command(model_dir, tmp_path / "data") + ["actor_rollout_ref.actor.quant=naive"]
    # Ray workers import this checkout's verl_quads (the shared venv's editable install may point elsewhere)
    src = os.path.dirname(os.path.dirname(os.path.abspath(verl_quads.__file__)))
    env = dict(os.environ, VERL_QUADS_SYNC_DUMP_DIR=str(dump), VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1",
               RAY_DEDUP_LOGS="0",
               PYTHONPATH=os.pathsep.join([src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    t0 = time.time()
    log_path = tmp_path / "main_ppo.log"
    with open(log_path, "w") as f:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900)
    wall = time.time() - t0
    log = log_path.read_text(errors="replace")
    assert proc.returncode == 0, f"main_ppo failed after {wall:.0f}s:\n{log[-6000:]}"
    steps = parse_step_metrics(log)
    assert sorted(steps) == list(range(1, STEPS + 1))
    for s, m in steps.items():
        for k in QUADS_KEYS:
            assert k in m and math.isfinite(m[k]), (s, k, sorted(m))
    # the trainer's forward is verl's own (no QAT); its sync packs
    assert "naive: stock trainer forward (no QAT); weight sync packs 6 modules" in log, log[-4000:]
    assert "verl-quads: QAT " not in log

    trainer = sorted(dump.glob("trainer_sync_*.pt"))
    vllm_side = sorted(dump.glob("packed_sync_*.pt"))
    assert len(trainer) == len(vllm_side) >= STEPS + 1, ([p.name for p in trainer], [p.name for p in vllm_side])
    first = last = None
    for t_path, v_path in zip(trainer, vllm_side):
        t = torch.load(t_path)
        v = torch.load(v_path)
        assert t["header"]["trainer_mode"] == "none" and t["header"]["quant"] == "naive", t["header"]
        assert v["header"]["quant"] == "naive" and v["header"]["rollout_mode"] == "naive", v["header"]
        source, held = t["source"], v["vllm"]
        assert len(source) == 8, sorted(source)  # 2 layers x (qkv, o, w13, w2)
        for name, w in source.items():
            assert w.dtype == torch.bfloat16, (name, w.dtype)
            per_expert = name.endswith(("w13_weight", "w2_weight"))
            amax = (w.abs().amax(dim=(1, 2), keepdim=True) if per_expert else w.abs().amax()).float()
            want = nvfp4.fake_quantize(w, nvfp4.global_scale_from_amax(amax), backend="torch")
            packed, scale, gs = held[f"{name}_packed"], held[f"{name}_scale"], held[f"{name}_global_scale"]
            assert packed.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn, name
            got = weight_f32(packed, scale, gs)
            assert torch.equal(got.to(torch.bfloat16), want), (t_path.name, name)
            engine = quantize_weight(w, reduce_dims=(1, 2) if per_expert else None)
            assert torch.equal(packed, engine.packed), (t_path.name, name)
        first = first or source
        last = source
    assert any(not torch.equal(first[k], last[k]) for k in first), "weights did not change between syncs"
    print(f"\n[naive grpo] main_ppo wall {wall:.0f}s, {len(trainer)} syncs; " + "; ".join(
        f"step {s}: reward {m['critic/score/mean']:.3f} gap_max {m['quads/logp_gap_max']:.4f} "
        f"p99 {m['quads/logp_gap_p99']:.4f} k3 {m['quads/k3_kl']:.2e}" for s, m in sorted(steps.items())))
