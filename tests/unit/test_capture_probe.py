"""``python -m verl_quads.bench.capture_probe`` on CPU (tiny sizes; the times are not checked, the table is: one row
per batch size, the ratio computed from the two times printed)."""

from __future__ import annotations

import re

import pytest


@pytest.mark.parametrize("what", ["routing", "trace"])
def test_capture_probe_prints_hook_and_baseline_per_batch(capsys, what):
    from verl_quads.bench import capture_probe

    capture_probe.main(["--device", "cpu", "--batch-sizes", "1,3", "--layers", "2", "--top-k", "2", "--steps", "4",
                        "--prompt-len", "3", "--repeats", "1", "--what", what, "--hidden", "32", "--heads", "2",
                        "--head-dim", "16", "--moe-inter", "16"])
    out = capsys.readouterr().out
    assert "2 layers top-2, prefill 3 rows per request + 4 decode steps" in out
    assert out.startswith("routing capture" if what == "routing" else
                          "TRACE (4 guided GEMMs per layer: [('self_attn.qkv_proj', 32, None), ('self_attn.o_proj', 32")
    wire = r" \| ([\d.]+)" if what == "trace" else "()"  # trace: the popped requests' RPC reply, ms
    rows = re.findall(r"^\s+(\d+) \|\s+([\d.]+) \|\s+([\d.]+) \|\s+([\d.]+)x \| ([\d.]+)" + wire + "$", out, re.M)
    assert [r[0] for r in rows] == ["1", "3"]
    for _, hook, bare, ratio, _, _ in rows:  # times printed to 0.1 us, the ratio to 0.01
        h, b, r = float(hook), float(bare), float(ratio)
        assert h > 0 and b > 0
        assert (h - 0.05) / (b + 0.05) - 0.005 <= r <= (h + 0.05) / max(b - 0.05, 1e-9) + 0.005


def test_capture_probe_refuses_bad_arguments():
    from verl_quads.bench import capture_probe

    with pytest.raises(SystemExit, match="must be positive"):
        capture_probe.main(["--device", "cpu", "--batch-sizes", "0"])
