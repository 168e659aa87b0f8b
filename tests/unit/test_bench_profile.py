"""``verl-quads bench profile`` (verl_quads/bench/profile.py): the CLI's errors on this CPU machine. The profile
itself needs a CUDA GPU (device kernels); its output from the H200 is in docs/bench_rollout_h200_session7.txt."""

from __future__ import annotations

import pytest
import torch

from verl_quads import cli
from verl_quads.bench import profile


def test_bench_profile_is_a_bench_subcommand_and_refuses_bad_modes():
    assert cli.BENCHES["profile"] == "verl_quads.bench.profile"
    with pytest.raises(SystemExit, match=r"--modes: unknown \['bogus'\]; allowed \['naive', 'quads', 'quads:block'"):
        profile.main(["--modes", "quads,bogus"])
    # every mode maps to the rollout's (act_mode, residual_combine, residual_granularity) vocabulary
    from verl_quads.nvfp4.triton_gemm import ACT_MODES, RESIDUAL_COMBINES
    from verl_quads.nvfp4 import RESIDUAL_GRANULARITIES

    for act, comb, gran in profile.MODES.values():
        assert act in ACT_MODES and comb in RESIDUAL_COMBINES and gran in RESIDUAL_GRANULARITIES


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_bench_profile_without_a_gpu_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        cli.main(["bench", "profile", "--m", "1"])
