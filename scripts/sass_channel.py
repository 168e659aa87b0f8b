"""Offline sm_90 SASS counts of the QUADS channel kernels' launches (no GPU): how session 35 found its cuts.

For ``M x K`` and each named ``triton_channel.CHANNEL_VARIANTS`` entry, the launches that
``nvfp4.residual_fake_quantize(x, 0.5, amax="row", granularity=...)`` makes are recorded through
``scripts/triton36_check.py``'s dry GPU (triton's own binder: the real constexprs, warps and register caps), compiled
for sm_90 with the bundled ptxas and disassembled (``verl_quads.bench.sass``). Printed per kernel: SASS instructions
in total, in the longest backward-branch loop (the channel_sampled threshold search), the registers / spill stack,
and the loop's most frequent opcodes. ``--dump DIR`` writes each kernel's whole SASS and loop there.

Static counts, not timings: a cut here is a candidate for the H200 (``python -m verl_quads.bench.channel_probe``), not
a result. Run it in the triton 3.6 venv that ``scripts/triton36_check.sh`` builds (the H200's triton), from the repo
root, TRITON_INTERPRET unset:

    bash scripts/triton36_check.sh --groups channel --kernels _channel_row_kernel --limit 1   # builds the venv once
    ~/.cache/verl-quads/triton36-*/bin/python scripts/sass_channel.py 4096 4096 --variants default,s34
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


def _opcode(line: str) -> str:
    return (line.split()[1] if line.startswith("@") else line.split()[0]).split(".")[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("m", type=int, help="rows of x")
    ap.add_argument("k", type=int, help="channels of x (a multiple of 16)")
    ap.add_argument("--variants", default="default", help="comma-separated triton_channel.CHANNEL_VARIANTS names")
    ap.add_argument("--granularity", default="channel_sampled", choices=("channel", "channel_sampled"))
    ap.add_argument("--dump", default="", help="write each kernel's SASS (.all.sass) and loop (.loop.sass) here")
    args = ap.parse_args()

    import triton36_check as t3

    triton, target = t3.install_dry_gpu()
    mods = [m for m in t3.kernel_modules() if ".triton_" in m]
    for mod in mods:
        importlib.import_module(mod)
    t3.patch_host(mods)
    import torch
    from triton.compiler import ASTSource

    from verl_quads import nvfp4
    from verl_quads.bench.sass import sass_and_loop
    from verl_quads.nvfp4 import triton_channel as tc

    for name in args.variants.split(","):
        if name not in tc.CHANNEL_VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; allowed {sorted(tc.CHANNEL_VARIANTS)}")
        t3.RECORDS.clear()
        with tc.channel_config(**tc.CHANNEL_VARIANTS[name]):
            x = torch.randn(args.m, args.k).to(torch.bfloat16)
            nvfp4.residual_fake_quantize(x, 0.5, None, amax="row", per_token=True, backend="triton",
                                         granularity=args.granularity)
        for rec in t3.RECORDS.values():
            kern = triton.compile(ASTSource(rec["fn"], rec["signature"], rec["constexprs"], rec["attrs"]),
                                  target=target, options=rec["options"].__dict__)
            every, loop = sass_and_loop(kern)
            fn = rec["fn"].__name__
            ops = collections.Counter(_opcode(t) for t in loop)
            print(f"{name:20s} {fn:24s} SASS {len(every):5d}  loop {len(loop):4d}  {t3._resources(kern)}")
            print("    loop opcodes:", ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                stem = os.path.join(args.dump, f"{name.replace(' ', '_')}_{fn}_{args.m}x{args.k}")
                for suffix, lines in ((".all.sass", every), (".loop.sass", loop)):
                    with open(stem + suffix, "w") as f:
                        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
