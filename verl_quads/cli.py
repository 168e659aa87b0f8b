"""The ``verl-quads`` command.

- ``verl-quads demo``: quantize a tiny random Qwen3-MoE (built locally, no download) with the
  NVFP4 core and print its per-layer error table (the end-to-end GRPO demo replaces this once
  the CPU runtime and both halves exist).
- ``verl-quads bench nvfp4``: kernel benchmark (CUDA).
"""

from __future__ import annotations

import argparse
import sys


def _demo(argv: list[str]) -> None:
    from verl_quads.demo_quantize import main

    main(argv)


def _bench(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="verl-quads bench")
    p.add_argument("what", choices=["nvfp4"])
    a, rest = p.parse_known_args(argv)
    if a.what == "nvfp4":
        from verl_quads.bench.nvfp4 import main

        main(rest)


COMMANDS = {"demo": _demo, "bench": _bench}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            raise SystemExit(f"verl-quads: unknown command {argv[0]!r}; allowed: {', '.join(COMMANDS)}")
        return
    COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
