"""Model-width options shared by the benchmarks that build a Qwen3-MoE (layer or whole model)."""

from __future__ import annotations

import argparse


def add_qwen3_moe_width_args(p: argparse.ArgumentParser) -> None:
    """``--hidden --heads --kv-heads --head-dim --experts --top-k --moe-inter``, defaulting to Qwen3-30B-A3B's
    widths (hidden 2048, 32 query / 4 KV heads of 128, 128 experts, top-8, expert intermediate 768)."""
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--moe-inter", type=int, default=768)
