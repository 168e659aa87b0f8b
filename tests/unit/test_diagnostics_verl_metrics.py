"""The quads/* per-step gap metrics patch on verl 0.9.1: the upstream symbols it hooks are unchanged,
it registers (idempotently, also in modules that bind the name at import), and it computes the right
numbers on synthetic batches next to verl's own debug metrics."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl", reason="verl not installed")
pytestmark = pytest.mark.verl


def _batch(**tensors):
    from tensordict import TensorDict
    from verl import DataProto

    bsz = next(iter(tensors.values())).shape[0]
    return DataProto(batch=TensorDict(tensors, batch_size=[bsz]))


def test_upstream_call_sites_unchanged():
    """Fails loudly if verl moves/renames what the patch wraps (re-read the patch docstring then)."""
    import verl.trainer.ppo.ray_trainer as rt
    import verl.utils.debug.metrics as m

    src = inspect.getsource(getattr(m.calculate_debug_metrics, "__verl_quads_original__", m.calculate_debug_metrics))
    assert 'data.batch["rollout_log_probs"]' in src and 'data.batch["old_log_probs"]' in src
    fit = inspect.getsource(rt.RayPPOTrainer.fit)
    assert "from verl.utils.debug.metrics import calculate_debug_metrics" in fit
    assert "metrics.update(calculate_debug_metrics(batch))" in fit
    import importlib.util

    spec = importlib.util.find_spec("verl.trainer.ppo.v1.trainer_base")
    text = open(spec.origin).read()
    assert "from verl.utils.debug.metrics import calculate_debug_metrics" in text


def test_version_guard_refuses_other_verl(monkeypatch):
    from verl_quads.patches import _guard, verl_gap_metrics
    from verl_quads.patches._guard import PatchVersionError

    monkeypatch.setattr(_guard, "installed_version", lambda *n: ("verl", "0.10.0"))
    monkeypatch.setattr(verl_gap_metrics, "require_version",
                        lambda p, d, s: _guard.require_version(p, d, s, found="0.10.0"))
    with pytest.raises(PatchVersionError, match="verl_gap_metrics"):
        verl_gap_metrics.apply()


def test_metrics_on_synthetic_batch():
    from verl_quads.patches.verl_gap_metrics import ACTOR_ROUTING_KEY, quads_gap_metrics

    g = torch.Generator().manual_seed(0)
    roll = -torch.rand(3, 8, generator=g) * 2
    old = roll + torch.randn(3, 8, generator=g) * 0.2
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, 5:] = 0
    out = quads_gap_metrics(_batch(rollout_log_probs=roll, old_log_probs=old, response_mask=mask,
                                   responses=torch.zeros(3, 8, dtype=torch.long)))
    d = (old - roll).double().numpy()[mask.bool().numpy()]
    assert out["quads/logp_gap_max"] == pytest.approx(np.abs(d).max())
    assert out["quads/logp_gap_p99"] == pytest.approx(np.quantile(np.abs(d), 0.99))
    assert out["quads/logp_gap_mean"] == pytest.approx(np.abs(d).mean())
    assert out["quads/k3_kl"] == pytest.approx(np.mean(np.exp(d) - d - 1))
    assert "quads/routing_set_differs" not in out  # no routing in the batch: absent, not 0
    # routing on both sides: [bsz, seqlen(prompt 4 + response 8), layers 2, k 2]
    r = torch.randint(0, 8, (3, 12, 2, 2), generator=g)
    t = r.clone()
    t[0, 4, 0] = torch.tensor([r[0, 4, 0, 0] + 100, r[0, 4, 0, 1]])  # one differing (token, layer) in the response
    t[0, 0, 1] = t[0, 0, 1] + 100  # differs in the prompt: not counted
    out = quads_gap_metrics(_batch(rollout_log_probs=roll, old_log_probs=old, response_mask=mask,
                                   routed_experts=r, **{ACTOR_ROUTING_KEY: t}))
    n_valid = int(mask.sum()) * 2
    assert out["quads/routing_set_differs"] == pytest.approx(1 / n_valid)
    assert out["quads/routing_slot_differs"] == pytest.approx(1 / (2 * n_valid))


def test_patch_registered_and_wraps_verl_metrics():
    """In a fresh interpreter: the plugin applied the patch on ``import verl``; apply() replaces the function
    verl's trainers call, idempotently, also the
    name bound by v1/trainer_base on later import; the result holds verl's keys and ours."""
    code = textwrap.dedent("""
        import torch
        from tensordict import TensorDict
        from verl import DataProto
        from verl_quads.patches import verl_gap_metrics as p
        import verl.utils.debug.metrics as m
        # `import verl` already applied it through the verl.plugins entry point
        assert getattr(m.calculate_debug_metrics, "__verl_quads_patch__", None) == "verl_gap_metrics"
        orig = m.calculate_debug_metrics.__verl_quads_original__
        p.apply(); p.apply()
        assert m.calculate_debug_metrics.__verl_quads_original__ is orig
        import verl.trainer.ppo.v1.trainer_base as tb
        assert tb.calculate_debug_metrics is m.calculate_debug_metrics
        roll = torch.tensor([[-1.0, -2.0, -0.5]]); old = torch.tensor([[-1.1, -2.0, -0.2]])
        d = DataProto(batch=TensorDict(dict(rollout_log_probs=roll, old_log_probs=old,
            response_mask=torch.ones(1, 3, dtype=torch.long), responses=torch.zeros(1, 3, dtype=torch.long)), batch_size=[1]))
        out = m.calculate_debug_metrics(d)
        assert "training/rollout_probs_diff_max" in out, out
        assert abs(out["quads/logp_gap_max"] - 0.3) < 1e-6, out
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
