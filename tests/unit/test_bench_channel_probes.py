"""Session 28's probes on CPU: ``python -m verl_quads.bench.channel_probe --split-phases`` runs its launches under
TRITON_INTERPRET=1 (times not checked; the table rows are), and ``verl_quads.bench.operand_bits``' rounding to a
number of significant bits (its timing needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from test_nvfp4_residual_channel import _needs_interp


@_needs_interp
def test_split_phases_probe_runs_each_variant(capsys):
    from verl_quads.bench import channel_probe

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = channel_probe.split_phases(["3x1024"], [3], ("sampled split", "sampled fused"), dev=dev)
    lines = [ln for ln in out.splitlines() if ln.startswith("3x1024 M=3")]
    assert len(lines) == 2, out
    assert "split: scores" in lines[0] and "search 1 rows / 1 warps" in lines[0], lines[0]
    assert "split" not in lines[1].split("|")[2], lines[1]


@pytest.mark.parametrize("bits,values,expected", [
    (1, [1.0, 1.4, 1.6, 3.0, -2.9, 0.75], [1.0, 1.0, 2.0, 4.0, -2.0, 1.0]),  # 3.0 = 1.5 * 2: ties round up
    (2, [1.0, 1.3, 1.6, 1.9, -1.2, 7.0], [1.0, 1.5, 1.5, 2.0, -1.0, 8.0]),
    (4, [1.0625, 1.09375, 1.03125], [1.125, 1.125, 1.0]),  # steps of 1/8 above 1; a tie rounds away from 0
])
def test_operand_bits_rounds_to_significant_bits(bits, values, expected):
    from verl_quads.bench.operand_bits import _round_bits

    got = _round_bits(torch.tensor(values, dtype=torch.bfloat16), bits)
    assert got.dtype == torch.bfloat16
    assert got.float().tolist() == expected, (bits, got.float().tolist())
