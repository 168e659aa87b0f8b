"""Patch: log verl-quads' rollout-vs-trainer gap statistics every step, next to verl's own.

Upstream (verl 0.9.1): after recomputing ``old_log_probs``, the PPO trainers call
``verl.utils.debug.metrics.calculate_debug_metrics(batch)`` whenever the batch carries the rollout's
``rollout_log_probs`` (``actor_rollout_ref.rollout.calculate_log_probs=True``) and merge the returned
dict into the step's metrics (which go to every tracker the recipe configures):

- ``verl/trainer/ppo/ray_trainer.py`` (``RayPPOTrainer.fit``) and
  ``verl/experimental/separation/ray_trainer.py`` import the function *inside* the step, so replacing
  the module attribute is enough;
- ``verl/trainer/ppo/v1/trainer_base.py`` imports it at module level, so that module's global is
  replaced too (now, or when it is imported later).

verl's function returns ``training/rollout_probs_diff_*`` (differences of *probabilities*) and its
``rollout_corr/*`` metrics (k3 KL, ...) only exist when ``algorithm.rollout_correction`` is set.
There is no extension point for extra per-step metrics, hence this wrapper: it calls the original
unchanged and adds, from the same tensors, ``quads/logp_gap_max``, ``quads/logp_gap_p99``,
``quads/logp_gap_mean``, ``quads/k3_kl`` (:func:`verl_quads.diagnostics.stats.gap_stats`, masked by
``response_mask``), and ``quads/routing_disagreement`` (= ``quads/routing_set_differs``) /
``quads/routing_slot_differs`` when the batch
holds both sides' routing: the rollout's under verl's key ``routed_experts`` (router replay R3 records
it) and the trainer's under :data:`ACTOR_ROUTING_KEY` (``[bsz, seqlen, layers, top_k]`` each). Nothing
in verl 0.9.1 fills :data:`ACTOR_ROUTING_KEY`: the trainer engine must store it for the routing metric
to appear (absent otherwise, never a made-up 0).
"""

from __future__ import annotations

import logging
import sys

from verl_quads.patches._guard import require_version

logger = logging.getLogger("verl_quads")

PATCH = "verl_gap_metrics"
SUPPORTED_VERL = ("0.9.1",)
TARGET_MODULE = "verl.utils.debug.metrics"
TARGET_NAME = "calculate_debug_metrics"
#: modules that bind the name at import time
IMPORTERS = ("verl.trainer.ppo.v1.trainer_base",)
PREFIX = "quads/"
ROLLOUT_ROUTING_KEY = "routed_experts"
ACTOR_ROUTING_KEY = "quads_actor_routed_experts"
#: fraction of valid (response token, MoE layer) pairs whose top-k expert sets differ (= routing_set_differs)
ROUTING_METRIC = PREFIX + "routing_disagreement"


def quads_gap_metrics(batch) -> dict[str, float]:
    """``quads/*`` metrics of a verl ``DataProto``-like batch (``.batch`` mapping of tensors).

    Needs ``rollout_log_probs`` and ``old_log_probs`` ``[bsz, resp_len]``; the mask is
    ``response_mask`` (else the last ``resp_len`` columns of ``attention_mask``). Returns {} when no
    token is valid.
    """
    from verl_quads.diagnostics import stats as S

    b = batch.batch
    rollout, trainer = b["rollout_log_probs"], b["old_log_probs"]
    n = rollout.shape[-1]
    if "response_mask" in b.keys():
        mask = b["response_mask"]
    elif "attention_mask" in b.keys():
        mask = b["attention_mask"][:, -n:]
    else:
        raise KeyError("verl-quads gap metrics: the batch has neither response_mask nor attention_mask")
    mask = mask.bool()
    if not bool(mask.any()):
        return {}
    st = S.gap_stats(rollout, trainer, mask)
    out = {PREFIX + k: st[k] for k in S.GAP_KEYS}
    keys = b.keys()
    if ROLLOUT_ROUTING_KEY in keys and ACTOR_ROUTING_KEY in keys:
        r, t = b[ROLLOUT_ROUTING_KEY], b[ACTOR_ROUTING_KEY]
        rm = mask
        if r.shape[1] >= n:  # [bsz, seqlen, L, k] over prompt+response: take the response positions
            r, t = r[:, -n:], t[:, -n:]
        rd = S.routing_disagreement(r, t, rm)
        out.update({PREFIX + k: v for k, v in rd.items()})
        out[ROUTING_METRIC] = rd["routing_set_differs"]
    return out


def _wrap(original):
    def calculate_debug_metrics(data):
        metrics = original(data)
        metrics.update(quads_gap_metrics(data))  # errors propagate: a broken metric is a bug, not a blank chart
        return metrics

    return calculate_debug_metrics


def apply() -> None:
    """Wrap ``verl.utils.debug.metrics.calculate_debug_metrics`` (and the names bound to it). Idempotent."""
    require_version(PATCH, ("verl",), SUPPORTED_VERL)
    import verl.utils.debug.metrics as mod

    from verl_quads.patches._guard import install_method_patch
    from verl_quads.patches._post_import import when_imported

    install_method_patch(mod, TARGET_NAME, PATCH, _wrap)
    wrapped = getattr(mod, TARGET_NAME)
    ours = wrapped
    while getattr(ours, "__dict__", {}).get("__verl_quads_patch__") != PATCH:  # our wrapper in the chain
        ours = ours.__verl_quads_original__
    original = ours.__verl_quads_original__

    def rebind(m):
        if getattr(m, TARGET_NAME, None) is original:
            setattr(m, TARGET_NAME, wrapped)

    for name in IMPORTERS:
        if name in sys.modules:
            rebind(sys.modules[name])
        else:
            when_imported(name, rebind)


__all__ = ["ACTOR_ROUTING_KEY", "ROUTING_METRIC", "PATCH", "ROLLOUT_ROUTING_KEY", "apply", "quads_gap_metrics"]
