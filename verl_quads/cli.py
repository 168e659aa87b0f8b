"""The ``verl-quads`` command.

- ``verl-quads demo [--quant quads|none|w4a16|w4a4_qat|...] [--steps N] [--model DIR] [--data DIR]``:
  stock verl GRPO (``python -m verl.trainer.main_ppo``, Ray, FSDP2 actor, vLLM CPU rollout) on the
  embedded tiny math MoE with ``actor_rollout_ref.actor.quant=<mode>``; per-step reward and
  ``quads/*`` mismatch metrics, then a summary (``verl-quads demo --help``).
- ``verl-quads quantize-demo``: quantize a tiny random Qwen3-MoE with the NVFP4 core and print its
  per-layer error table (no verl, no vLLM; seconds).
- ``verl-quads bench nvfp4|qat|rollout|sync``: benchmarks (CUDA); each prints ratios to a baseline timed in
  the same run. ``verl-quads bench engine``: a whole vLLM engine's generation throughput per mode vs BF16
  (CUDA or CPU). ``verl-quads bench profile``: the device kernels of one decode-sized rollout GEMM call.
- ``verl-quads export --model DIR --out DIR [--quant-config JSON]``: a trained checkpoint (HF dir or verl
  checkpoint with ``huggingface/``) -> compressed-tensors NVFP4 checkpoint with the packed sync's weights.
- ``verl-quads probe``: rollout-vs-trainer log-prob gap per quantization mode (tables, decomposition,
  per-layer error, PNG + JSON); ``verl-quads probe --help``.
"""

from __future__ import annotations

import argparse
import sys


def _demo(argv: list[str]) -> None:
    from verl_quads.demo import main

    main(argv)


def _quantize_demo(argv: list[str]) -> None:
    from verl_quads.demo_quantize import main

    main(argv)


def _bench(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="verl-quads bench")
    p.add_argument("what", choices=sorted(BENCHES))
    a, rest = p.parse_known_args(argv)
    import importlib

    importlib.import_module(BENCHES[a.what]).main(rest)


BENCHES = {"nvfp4": "verl_quads.bench.nvfp4", "qat": "verl_quads.bench.qat", "sync": "verl_quads.sync.bench",
           "rollout": "verl_quads.bench.rollout", "profile": "verl_quads.bench.profile", "engine": "verl_quads.bench.engine"}


def _probe(argv: list[str]) -> None:
    from verl_quads.diagnostics.probe import main

    main(argv)


def _export(argv: list[str]) -> None:
    from verl_quads.sync.export import main

    main(argv)


COMMANDS = {"demo": _demo, "quantize-demo": _quantize_demo, "bench": _bench, "probe": _probe, "export": _export}


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
