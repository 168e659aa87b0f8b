"""Rollout-vs-trainer mismatch statistics on per-token tensors (no model, no verl, no vLLM).

Conventions (the same as verl's ``rollout_corr/*`` metrics, so the numbers line up in a tracker):

- ``rollout_logp`` / ``trainer_logp``: float ``[B, T]`` log-probabilities of the *sampled* tokens
  under the rollout engine and under the trainer; ``mask``: bool/0-1 ``[B, T]`` of valid tokens.
- gap = ``|trainer_logp - rollout_logp|`` per valid token; we report its max, 99th percentile
  (linear interpolation, ``torch.quantile``) and mean.
- ``k3_kl``: mean over valid tokens of ``exp(r) - r - 1`` with ``r = trainer_logp - rollout_logp``,
  the k3 estimator of KL(rollout || trainer) on rollout samples (verl's ``rollout_corr/k3_kl``).
- argmax-differs: fraction of valid positions where the two sides' most likely next token differs.
- routing disagreement: fraction of valid (token, MoE layer) pairs whose top-k expert *sets*
  differ (order inside the top-k does not count), plus the fraction of (token, layer, slot)
  choices that are not in the other side's set.
- relative error: ``||test - ref|| / ||ref||`` (Frobenius, float64).

:func:`summarize` reduces a list of per-batch (or per-seed) results to mean / std / min / max.
"""

from __future__ import annotations

import math

import torch

GAP_KEYS = ("logp_gap_max", "logp_gap_p99", "logp_gap_mean", "k3_kl")


def _valid(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != values shape {tuple(like.shape)}")
    return mask.to(device=like.device).bool()


def logp_gap(rollout_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1-D float64 tensor of ``|trainer_logp - rollout_logp|`` over the valid tokens."""
    if rollout_logp.shape != trainer_logp.shape:
        raise ValueError(f"rollout_logp {tuple(rollout_logp.shape)} vs trainer_logp {tuple(trainer_logp.shape)}")
    m = _valid(mask, rollout_logp)
    d = trainer_logp.detach().to(torch.float64) - rollout_logp.detach().to(torch.float64).to(trainer_logp.device)
    return d.abs()[m]


def gap_stats(rollout_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``{logp_gap_max, logp_gap_p99, logp_gap_mean, k3_kl, n_tokens}`` (see module docstring).

    Raises ValueError when no token is valid (a statistic of nothing is not 0).
    """
    m = _valid(mask, rollout_logp)
    n = int(m.sum())
    if n == 0:
        raise ValueError("gap_stats: the mask selects no token")
    gap = logp_gap(rollout_logp, trainer_logp, m)
    r = (trainer_logp.detach().to(torch.float64) - rollout_logp.detach().to(torch.float64).to(trainer_logp.device))[m]
    k3 = torch.exp(r) - r - 1.0
    return {
        "logp_gap_max": float(gap.max()),
        "logp_gap_p99": float(torch.quantile(gap, 0.99)),
        "logp_gap_mean": float(gap.mean()),
        "k3_kl": float(k3.mean()),
        "n_tokens": n,
    }


def argmax_differs(rollout_argmax: torch.Tensor, trainer_argmax: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of valid positions whose argmax token ids differ (inputs: int ``[B, T]``)."""
    if rollout_argmax.shape != trainer_argmax.shape:
        raise ValueError(f"argmax shapes differ: {tuple(rollout_argmax.shape)} vs {tuple(trainer_argmax.shape)}")
    m = _valid(mask, rollout_argmax)
    n = int(m.sum())
    if n == 0:
        raise ValueError("argmax_differs: the mask selects no token")
    return float((rollout_argmax.to(trainer_argmax.device) != trainer_argmax)[m].sum()) / n


def routing_disagreement(rollout_ids: torch.Tensor, trainer_ids: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """Routing mismatch of top-k expert choices.

    ``rollout_ids`` / ``trainer_ids``: int ``[..., L, k]`` or ``[..., k]`` (any leading token/layer
    dims, the last one the top-k slots); ``mask``: bool over the leading dims except the last
    (e.g. ``[B, T]`` for ``[B, T, L, k]`` inputs, broadcast over the layers), or None (all valid).
    Returns ``{"routing_set_differs": ..., "routing_slot_differs": ...}``.
    """
    if rollout_ids.shape != trainer_ids.shape:
        raise ValueError(f"routing shapes differ: {tuple(rollout_ids.shape)} vs {tuple(trainer_ids.shape)}")
    a = torch.sort(rollout_ids.long(), dim=-1).values
    b = torch.sort(trainer_ids.long().to(a.device), dim=-1).values
    set_diff = (a != b).any(-1)  # [...]
    # per slot: is rollout's choice absent from the trainer's set
    slot_missing = ~(a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1)  # [..., k]
    if mask is None:
        valid = torch.ones_like(set_diff)
    else:
        valid = mask.to(set_diff.device).bool()
        while valid.dim() < set_diff.dim():
            valid = valid.unsqueeze(-1)
        valid = valid.expand_as(set_diff)
    n = int(valid.sum())
    if n == 0:
        raise ValueError("routing_disagreement: the mask selects nothing")
    return {
        "routing_set_differs": float(set_diff[valid].sum()) / n,
        "routing_slot_differs": float(slot_missing[valid].sum()) / (n * a.shape[-1]),
    }


def relative_error(ref: torch.Tensor, test: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """``||test - ref|| / ||ref||`` over the rows selected by ``mask`` (leading dims), float64."""
    if ref.shape != test.shape:
        raise ValueError(f"relative_error: shapes differ {tuple(ref.shape)} vs {tuple(test.shape)}")
    r, t = ref.detach().to(torch.float64), test.detach().to(torch.float64).to(ref.device)
    if mask is not None:
        m = mask.to(ref.device).bool()
        r, t = r[m], t[m]
    den = torch.linalg.vector_norm(r)
    if float(den) == 0.0:
        raise ValueError("relative_error: the reference is zero")
    return float(torch.linalg.vector_norm(t - r) / den)


def closure(gap_mode: float, gap_naive: float, gap_floor: float) -> float:
    """Fraction of the naive-to-floor gap that a mode closes: ``(naive - mode) / (naive - floor)``."""
    den = gap_naive - gap_floor
    if den <= 0:
        return float("nan")
    return (gap_naive - gap_mode) / den


def summarize(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per key present in every run: ``{"mean", "std" (sample, 0 for one run), "min", "max", "n"}``."""
    if not runs:
        raise ValueError("summarize: no runs")
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    out = {}
    for k in keys:
        vals = [float(r[k]) for r in runs]
        finite = [v for v in vals if math.isfinite(v)]
        mean = sum(finite) / len(finite) if finite else float("nan")
        var = sum((v - mean) ** 2 for v in finite) / (len(finite) - 1) if len(finite) > 1 else 0.0
        out[k] = {
            "mean": mean,
            "std": math.sqrt(var),
            "min": min(finite) if finite else float("nan"),
            "max": max(finite) if finite else float("nan"),
            "n": len(vals),
        }
    return out


def paired_difference(base_runs: list[dict[str, float]], variant_runs: list[dict[str, float]],
                      keys=GAP_KEYS) -> dict[str, dict[str, float]]:
    """Seed-paired comparison of two modes: ``base_runs[i]`` and ``variant_runs[i]`` measured on the same batch i
    (same tokens). Per key: ``{"base", "variant"}`` (means), ``"diff"`` (mean of variant - base), ``"diff_std"``
    (sample std of the per-batch differences, 0 for one batch), ``"variant_lower"`` (batches where the variant's
    value is strictly lower), ``"n"``. A lower gap is better for every :data:`GAP_KEYS` entry."""
    if len(base_runs) != len(variant_runs) or not base_runs:
        raise ValueError(f"paired_difference: need the same number (> 0) of batches, got {len(base_runs)} and "
                         f"{len(variant_runs)}")
    out = {}
    for k in keys:
        b = [float(r[k]) for r in base_runs]
        v = [float(r[k]) for r in variant_runs]
        d = [y - x for x, y in zip(b, v)]
        n = len(d)
        mean = sum(d) / n
        std = math.sqrt(sum((e - mean) ** 2 for e in d) / (n - 1)) if n > 1 else 0.0
        out[k] = {"base": sum(b) / n, "variant": sum(v) / n, "diff": mean, "diff_std": std,
                  "variant_lower": sum(1 for x, y in zip(b, v) if y < x), "n": n}
    return out


__all__ = [
    "GAP_KEYS",
    "argmax_differs",
    "closure",
    "gap_stats",
    "logp_gap",
    "paired_difference",
    "relative_error",
    "routing_disagreement",
    "summarize",
]
