"""``verl-quads bench sync``: bytes per weight sync, packed NVFP4 vs BF16.

Two numbers:
- measured: the packed stream of a tiny random Qwen3-MoE (QAT applied, CPU, no download) through
  :func:`verl_quads.sync.trainer.pack_for_rollout`, plus the time to pack it;
- computed for Qwen3-30B-A3B's shapes (config values below, from its public config.json): per
  quantized ``[N, K]`` weight ``N*K/2`` code bytes + ``N*K/16`` E4M3 scales + 4 bytes per global
  scale (one per fused linear group, one per expert per w13/w2) vs ``2*N*K`` bf16 bytes; unquantized
  tensors (embeddings, lm_head, router, norms) are sent as bf16 in both cases.
"""

from __future__ import annotations

import argparse
import tempfile
import time

#: Qwen3-30B-A3B (public config.json)
QWEN3_30B_A3B = dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128,
                     moe_inter=768, vocab=151936, tied=False)


def qwen3_moe_sync_bytes(hidden, layers, heads, kv_heads, head_dim, experts, moe_inter, vocab, tied) -> dict:
    """Bytes of one full sync for a Qwen3-MoE shape: packed vs bf16 (see module docstring)."""
    def packed(n, k, scales):
        return n * k // 2 + n * k // 16 + 4 * scales

    qkv = ((heads + 2 * kv_heads) * head_dim, hidden)
    o = (hidden, heads * head_dim)
    w13 = (2 * moe_inter, hidden)
    w2 = (hidden, moe_inter)
    q_numel = layers * (qkv[0] * qkv[1] + o[0] * o[1] + experts * (w13[0] * w13[1] + w2[0] * w2[1]))
    q_packed = layers * (packed(*qkv, 1) + packed(*o, 1) + experts * (packed(*w13, 1) + packed(*w2, 1)))
    other = vocab * hidden * (1 if tied else 2) + layers * (experts * hidden + 2 * hidden + 2 * head_dim) + hidden
    return {
        "quantized_bf16": 2 * q_numel,
        "quantized_packed": q_packed,
        "other_bf16": 2 * other,
        "total_bf16": 2 * q_numel + 2 * other,
        "total_packed": q_packed + 2 * other,
    }


def guidance_bytes_per_token(hidden, heads, head_dim, moe_inter, top_k, guided_layers, expert_id_bytes=1) -> dict:
    """TRACE guidance bytes per token for a Qwen3-MoE layer stack (rollout -> trainer).

    Per guided GEMM input of K elements: ``K/8`` (1 bit each) + ``K/16`` (E4M3 block scales) + 4
    (float32 per-token global scale). Guided inputs per layer: qkv_proj (K = hidden), o_proj
    (K = heads*head_dim), experts w13 (K = hidden, once per token), experts w2 (``top_k`` rows of
    K = moe_inter) + the routed expert ids (``expert_id_bytes`` each).
    """
    def rec(k):
        return k // 8 + k // 16 + 4

    per_layer = rec(hidden) + rec(heads * head_dim) + rec(hidden) + top_k * rec(moe_inter) + top_k * expert_id_bytes
    bf16 = 2 * (hidden + heads * head_dim + hidden + top_k * moe_inter)
    return {"per_layer": per_layer, "per_token": per_layer * guided_layers, "bf16_per_token": bf16 * guided_layers}


def measure_tiny() -> tuple[object, float]:
    """Pack a tiny random Qwen3-MoE with QAT; returns (SyncStats, seconds)."""
    import torch
    from transformers import AutoModelForCausalLM

    from verl_quads.models.tiny import build_tiny_qwen3_moe
    from verl_quads.qat import apply_qat
    from verl_quads.sync.trainer import SyncStats, pack_for_rollout, plan_from_model

    with tempfile.TemporaryDirectory() as d:
        path = build_tiny_qwen3_moe(d, num_layers=2, hidden_size=256, moe_intermediate_size=128, num_experts=16)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    apply_qat(model, "quads", backend="torch")
    stats = SyncStats()
    t0 = time.perf_counter()
    for _ in pack_for_rollout(((n, p.detach()) for n, p in model.state_dict().items()), plan_from_model(model),
                              torch.bfloat16, backend="torch", stats=stats):
        pass
    return stats, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="verl-quads bench sync", description=__doc__).parse_args(argv)
    stats, dt = measure_tiny()
    print(f"tiny Qwen3-MoE (measured): {stats.summary()}; packing {dt * 1e3:.1f} ms on CPU")
    b = qwen3_moe_sync_bytes(**QWEN3_30B_A3B)
    gib = 2**30
    print(
        "Qwen3-30B-A3B (computed): quantized layers "
        f"{b['quantized_packed'] / gib:.2f} GiB packed vs {b['quantized_bf16'] / gib:.2f} GiB bf16 "
        f"({b['quantized_packed'] / b['quantized_bf16']:.4f}x); whole sync {b['total_packed'] / gib:.2f} GiB vs "
        f"{b['total_bf16'] / gib:.2f} GiB ({b['total_packed'] / b['total_bf16']:.3f}x)"
    )
    c = QWEN3_30B_A3B
    g = guidance_bytes_per_token(c["hidden"], c["heads"], c["head_dim"], c["moe_inter"], 8, 20)
    tokens = 16384
    print(
        f"Qwen3-30B-A3B TRACE guidance (computed, 20 guided layers, top-8): {g['per_token']} B/token "
        f"({g['per_layer']} B/layer; bf16 activations would be {g['bf16_per_token']} B/token, "
        f"{g['bf16_per_token'] / g['per_token']:.1f}x more); one 16k-token sequence {g['per_token'] * tokens / 2**20:.0f} MiB"
    )


__all__ = ["QWEN3_30B_A3B", "qwen3_moe_sync_bytes", "measure_tiny", "main"]
