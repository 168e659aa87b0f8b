"""Log-prob gap diagnostics (DESIGN.md §5 ``diagnostics/``).

- :mod:`.stats`: gap statistics on per-token tensors (max/p99/mean |gap|, k3 KL, argmax-differs,
  routing disagreement, relative error, summaries over seeds).
- :mod:`.hf_rollout`: the rollout's NVFP4 arithmetic over a HF model, with weight/activation ablations.
- :mod:`.probe`: ``verl-quads probe`` (engines, trainer re-scoring, decomposition, tables, plot, JSON).
- :mod:`.outliers`: activation outlier statistics; tiny model with injected outlier channels.
- :mod:`.realistic`: train a small Qwen3-MoE on local text (GPU script), then probe it.
"""
