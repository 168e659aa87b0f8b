"""verl_quads.diagnostics.realistic at toy size on CPU (< 60 s): local text -> tokenizer -> trained
Qwen3-MoE -> outlier statistics -> probe over 3 seeds -> trace guided-layer sweep -> JSON."""

from __future__ import annotations

import json


def test_realistic_toy(tmp_path):
    from verl_quads.diagnostics.realistic import main

    rep = main(["--toy", "--seconds", "3", "--modes", "bf16,naive", "--guided-sweep", "1,2",
                "--extra-modes", "quads@0.5", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "realistic.json").read_text())
    assert data["training"]["steps"] >= 1 and data["provenance"]["n_files"] > 0
    assert set(data["outliers_init"]) == set(data["outliers_trained"]) == {
        f"layer{i}.{k}" for i in range(2) for k in ("attn_in", "mlp_in")}
    for v in data["outliers_trained"].values():
        assert v["kurtosis"] > 0 and v["max_over_median"] >= 1.0
    pm = data["probe"]["per_mode"]
    assert set(pm) == {"bf16", "naive"} and all(pm[m]["total"]["logp_gap_p99"]["n"] == 3 for m in pm)
    assert "hf" in data["probe"]["engine"]
    sweep = data["trace_sweep"]
    assert [sweep[k]["guided_layers"] for k in sorted(sweep)] == [1, 2]
    assert sweep["1"]["cache_bytes_per_token"] * 2 == sweep["2"]["cache_bytes_per_token"]
    # all layers guided: the trainer follows every rollout code, so its gap is at most naive's
    assert sweep["2"]["total"]["logp_gap_mean"]["mean"] <= pm["naive"]["total"]["logp_gap_mean"]["mean"]
    assert (tmp_path / "probe.png").exists() and rep["wall_s"] > 0
    # the extra probe reruns bf16/naive as its closure anchors, without decomposition
    px = data["probe_extra"]["per_mode"]
    assert list(px) == ["bf16", "naive", "quads@0.5"] and all("decomposition" not in px[m] or
                                                               set(px[m]["decomposition"]) == {"engine_floor"} for m in px)
    assert (tmp_path / "extra" / "probe.txt").exists() and "extra_probe" in data["phase_seconds"]
