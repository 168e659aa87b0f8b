"""The TRACE dump's guided-QDQ self-check (``integration/trace.py`` ``_Audit``) separates low-bit
mismatches the trainer could not avoid (its scaled value is a codeword, e.g. clamped at +-6, as after
an optimizer step of an earlier PPO mini-batch) from real failures to follow the record."""

from __future__ import annotations

import torch

import verl_quads.nvfp4 as nvfp4
from verl_quads.integration.trace import _Audit
from verl_quads.nvfp4 import extract_guidance, quantize


def _x():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g)
    x[0, 1] = 0.0  # code 0: low bit 0 in the record
    return x


def test_own_record_has_no_mismatch():
    x = _x()
    rec = extract_guidance(quantize(x, backend="torch"))
    a = _Audit()
    a.check(x, rec)
    assert a.elements == 256 and a.calls == 1
    assert a.bit_mismatch == a.bit_mismatch_forced == a.bit_mismatch_free == 0
    assert a.block_scale_mismatch == 0 and a.global_scale_mismatch == 0


def test_saturated_value_is_a_forced_mismatch_not_a_free_one():
    x = _x()
    rec = extract_guidance(quantize(x, backend="torch"))
    moved = x.clone()
    moved[0, 1] = 1e4  # clamps to 6.0 under the record's scales: code 7 (low bit 1) whatever the record says
    a = _Audit()
    a.check(moved, rec)
    assert a.bit_mismatch == 1 and a.bit_mismatch_forced == 1 and a.bit_mismatch_free == 0
    assert a.forced >= 1


def test_ignoring_the_record_is_a_free_mismatch(monkeypatch):
    x = _x()
    rec = extract_guidance(quantize(x, backend="torch"))
    moved = x * 1.07
    # a broken guided quantizer: round-to-nearest with the record's global scale, ignoring its bits
    monkeypatch.setattr(nvfp4, "quantize_guided",
                        lambda t, r, check_finite=True: quantize(t, r.global_scale, backend="torch"))
    a = _Audit()
    a.check(moved, rec)
    assert a.bit_mismatch_free > 0
    assert a.bit_mismatch == a.bit_mismatch_forced + a.bit_mismatch_free
