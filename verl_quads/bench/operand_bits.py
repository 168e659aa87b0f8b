"""Issue #5 probe: does a cuBLAS BF16 GEMM's time depend on the operand's VALUES (not its shape)?

Why: at dense 8192x8192, M = 4096 the QUADS-bf16 call's w4a16 GEMM (the decode-once path of
:mod:`verl_quads.nvfp4.dequant_gemm`: weight block values, then ``torch.mm`` in bf16 with float32 output) ran 3-8%
slower than naive's W4A4 GEMM (the same path, with the activation's block values decoded too: MORE work), sessions 27
/ 28. Hypothesis: the H200 runs a power-limited clock during large BF16 GEMMs, and operands with few significant bits
(NVFP4 block values: <= 6 significant bits, many zeros) switch less and run faster.

Times ``torch.mm(a, w.T, out_dtype=torch.float32)`` (what dequant_gemm runs) with the same ``w`` (the NVFP4 weight's
block values, as dequant_gemm decodes them) and activations ``a`` ``[M, K]`` bf16 that differ only in their values:
``randn`` (full 8-bit mantissas), the same rounded to 4 / 2 / 1 significant bits, naive's operand (the NVFP4 block
values of ``x``), the QUADS-bf16 operand (``residual_fake_quantize(x, 0.5, amax="row")``, channel_sampled and
channel), and zeros. Warm L2, CUDA graph replay (``bench rollout``'s timing), us, with the ratio to ``randn``; the
SM clock (nvidia-smi) is not sampled: the times are the evidence. Repeats alternate the order (forward, reversed), so
that a drift over the run is not read as an operand effect.

    python -m verl_quads.bench.operand_bits [--m 4096] [--k 8192] [--n 8192] [--repeat 2]
"""

from __future__ import annotations

import argparse

import torch

from verl_quads.bench.timing import device_name, print_table


def _round_bits(a: torch.Tensor, bits: int) -> torch.Tensor:
    """bf16 ``a`` rounded to ``bits`` significant bits (to nearest, ties away from zero; 1 = the leading bit only)."""
    f = a.float()
    drop = 24 - bits  # float32 has 24 significant bits
    i = f.view(torch.int32)
    i = (i + (1 << (drop - 1))) & ~((1 << drop) - 1)
    return i.view(torch.float32).to(torch.bfloat16)


def run(m: int, k: int, n: int, repeat: int = 1) -> str:
    from verl_quads import nvfp4 as nv
    from verl_quads.bench.rollout import _time
    from verl_quads.nvfp4.dequant_gemm import block_values

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    qw = nv.quantize(w, nv.global_scale_from_amax(w.abs().amax()), backend="triton")
    wv = block_values(qw.packed, qw.block_scale, torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    x[:, ::293] *= 30.0  # as bench channel_probe
    qx = nv.quantize(x, nv.per_row_global_scale(x), backend="triton")
    ops = {"randn bf16 (8 significant bits)": x}
    for b in (4, 2, 1):
        ops[f"randn rounded to {b} significant bit{'s' if b > 1 else ''}"] = _round_bits(x, b)
    ops["naive operand: NVFP4 block values of x"] = block_values(qx.packed, qx.block_scale, torch.bfloat16)
    for gran in ("channel_sampled", "channel"):
        ops[f"QUADS-bf16 operand ({gran}, k=0.5)"] = nv.residual_fake_quantize(
            x, 0.5, amax="row", granularity=gran, backend="triton", check_finite=False)
    ops["zeros"] = torch.zeros_like(x)
    rows = []
    base = None
    for rep in range(repeat):
        # every other repeat in reverse order: a drift of the clock over the run (heat) then shows as disagreement
        for name, a in (list(ops.items()) if rep % 2 == 0 else list(ops.items())[::-1]):
            t = _time(lambda: torch.mm(a, wv.T, out_dtype=torch.float32))[0] * 1e6
            if rep == 0 and name.startswith("randn bf16"):  # the first entry
                base = t
            rows.append([name + (f" (repeat {rep + 1})" if rep else ""), f"{t:.1f}", f"{t / base:.3f}",
                         f"{2 * m * n * k / t / 1e6:.0f}"])
            print(" | ".join(rows[-1]), flush=True)
    return print_table(f"torch.mm bf16 [{m}, {k}] x [{k}, {n}] -> float32, same shapes, different operand values "
                       f"({device_name()}); warm L2 graph replay", ["activation operand", "us", "x randn", "TFLOP/s"],
                       rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=2)
    a = p.parse_args(argv)
    print(run(a.m, a.k, a.n, a.repeat), flush=True)


if __name__ == "__main__":
    main()
