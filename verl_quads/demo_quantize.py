"""``verl-quads quantize-demo``: quantize a tiny random Qwen3-MoE and print its error table.

Builds the tiny Qwen3-MoE of :mod:`verl_quads.models.tiny` locally (no download), then runs the
trainer-side forward in each QAT mode against BF16 on the same token ids and reports:
per-mode max / mean |log-prob gap| of the next token and argmax disagreement vs BF16, and a
per-weight table (relative NVFP4 QDQ error, bytes in BF16 vs NVFP4). The end-to-end GRPO demo
(main-job issue) replaces this command once it exists.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import verl_quads.nvfp4 as nv
from verl_quads.bench.timing import print_table
from verl_quads.config import QuantConfig


def _weights_table(model: torch.nn.Module, cfg: QuantConfig) -> list[list[object]]:
    rows = []
    for name, p in model.named_parameters():
        mod = name.rsplit(".", 1)[0]
        if p.dim() < 2 or cfg.is_ignored(mod) or p.shape[-1] % nv.BLOCK_SIZE:
            continue
        w = p.detach()
        gs = nv.global_scale_from_amax(w.abs().amax(dim=tuple(range(1, w.dim())), keepdim=True)) if w.dim() == 3 else None
        q = nv.quantize(w, gs)
        err = ((nv.dequantize(q, torch.float32) - w.float()).norm() / w.float().norm()).item()
        rows.append([name, "x".join(map(str, w.shape)), err, w.numel() * 2, q.nbytes])
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="verl-quads quantize-demo", description=__doc__)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from verl_quads.models.tiny import build_tiny_qwen3_moe
    from verl_quads.qat import apply_qat

    torch.manual_seed(a.seed)
    with tempfile.TemporaryDirectory() as d:
        build_tiny_qwen3_moe(d, seed=a.seed, num_layers=a.layers, hidden_size=a.hidden, dtype="float32")
        load = lambda: AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()  # noqa: E731
        base = load()
        ids = torch.randint(0, base.config.vocab_size, (1, a.tokens))
        with torch.no_grad():
            ref = torch.log_softmax(base(ids).logits.float(), -1)
        rows = []
        for mode in ("w4a16", "w4a4_qat"):
            m = load()
            apply_qat(m, mode)
            with torch.no_grad():
                lp = torch.log_softmax(m(ids).logits.float(), -1)
            tok = ref.argmax(-1, keepdim=True)
            gap = (lp.gather(-1, tok) - ref.gather(-1, tok)).abs()
            flips = (lp.argmax(-1) != ref.argmax(-1)).float().mean().item()
            rows.append([mode, gap.max().item(), gap.mean().item(), flips])
        print(f"tiny random Qwen3-MoE: {a.layers} layers, hidden {a.hidden}, {a.tokens} random tokens (CPU, torch reference)")
        print_table("trainer-side QAT vs BF16 (log-prob of BF16's argmax token)",
                    ["mode", "max |gap|", "mean |gap|", "argmax flips"], rows)
        print_table("per-weight NVFP4 error (per tensor; experts per expert)",
                    ["weight", "shape", "rel. error", "bf16 bytes", "nvfp4 bytes"], _weights_table(base, QuantConfig("w4a16")))
