"""The Marlin probe's count of block scales that vLLM's NVFP4 Marlin conversion drops (issue #5, session 34):
expected counts worked out by hand from vLLM 0.24's rule (``nvfp4_marlin_process_scales``: a power-of-two factor
brings the largest scale up to the E4M3 maximum, then ``s * factor * 2**7 < 2`` becomes 0)."""

import torch

from verl_quads.bench.marlin_probe import _dropped_scales


def _e4m3(values):
    return torch.tensor(values, dtype=torch.float32).to(torch.float8_e4m3fn)


def test_full_range_scales_drop_below_two_to_the_minus_6():
    # largest scale 448: factor 1; 2**-6 * 2**7 == 2 stays, 2**-7 and 2**-9 (E4M3 subnormals) are dropped, 0 is not
    # counted
    nz, dropped = _dropped_scales(_e4m3([448.0, 1.0, 2.0**-6, 2.0**-7, 2.0**-9, 0.0]))
    assert (nz, dropped) == (5, 2)


def test_small_largest_scale_is_rescaled_first():
    # largest scale 1.0: factor 2**floor(log2(448)) = 256, so even 2**-9 * 256 * 2**7 = 64 stays
    nz, dropped = _dropped_scales(_e4m3([1.0, 0.5, 2.0**-9]))
    assert (nz, dropped) == (3, 0)


def test_wide_range_drops_the_smallest_blocks():
    # largest 448 (factor 1): 2**-8 * 2**7 = 0.5 < 2 -> dropped; 0.015625 (2**-6) stays
    nz, dropped = _dropped_scales(_e4m3([448.0, 2.0**-8, 0.015625]))
    assert (nz, dropped) == (3, 1)
