"""The TMA-fed dense W4A16 kernel's host side on CPU (verl_quads/nvfp4/gluon_tma.py; the kernel itself:
tests/gpu/test_gluon_tma_gpu.py): config validation, the probe's spec parser, shared-memory accounting, and the clear
refusals where it cannot run (CPU tensors, the interpreter, shapes, a grouped GEMM) -- never a silent fallback."""

import pytest
import torch

from verl_quads.bench.gluon_probe import TMA_CONFIGS, parse_tma
from verl_quads.nvfp4 import gluon_dispatch as gd
from verl_quads.nvfp4 import gluon_tma as gt
from verl_quads.nvfp4 import moe_routing as mr
from verl_quads.nvfp4 import triton_gemm as tg

T = gt.TmaConfig


@pytest.mark.parametrize("kw", [dict(ks=3), dict(ks=1), dict(nwr=3), dict(ks=4, nwr=8), dict(u=0), dict(ns=1),
                                dict(dec=5), dict(dec=0), dict(maxnreg=-1)])
def test_config_rejects(kw):
    with pytest.raises(ValueError, match="TmaConfig"):
        T(**kw)


def test_parse_tma_and_labels():
    assert parse_tma("ks4:w2:u1:ns6:d1,ks2") == [T(ks=4, nwr=2, u=1, ns=6, dec=1), T()]
    assert parse_tma("ks2:w2:u4:ns3:r128")[0] == T(ks=2, nwr=2, u=4, ns=3, maxnreg=128)
    assert parse_tma("ks2:d2:floor1") == [T(ks=2, dec=2, floor=True)]
    assert T(floor=True).label.endswith(" FLOOR") and "FLOOR" not in T().label
    assert not any(c.floor for c in TMA_CONFIGS)  # the configs the GPU tests check for results compute them
    with pytest.raises(ValueError, match="bad part"):
        parse_tma("ks2:q3")
    labels = [c.label for c in TMA_CONFIGS]
    assert len(set(labels)) == len(labels) and all(lb.startswith("tma ks") for lb in labels)


def test_smem_bytes():
    """Ring bytes = stages x chunks per stage x (16 nwr rows of 64 code bytes + 8 scale bytes, + the staged activation:
    M rounded up to a power of two rows of 256 bytes)."""
    c = T(ks=2, nwr=2, u=4, ns=3)
    assert c.smem_bytes(1) == 3 * 8 * (2 * 16 * (64 + 8) + 1 * 256)
    assert c.smem_bytes(3) == c.smem_bytes(4) == 3 * 8 * (2 * 16 * 72 + 4 * 256)
    assert c.smem_bytes(9) == 3 * 8 * (2 * 16 * 72 + 16 * 256)
    assert T(ks=4, nwr=4, u=2, ns=6).smem_bytes(16) > gt.SMEM_LIMIT
    assert [gt.staged_rows(m) for m in range(1, 17)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8


def test_plan():
    """One program per 16 nwr weight rows (the last one partly past N), stages of ks u chunks (the last one partly past
    K when K / 128 is not a multiple)."""
    assert gt.tma_plan(8192, 8192, T(ks=2, nwr=2, u=4, ns=3)) == (256, 8, 8, True)
    assert gt.tma_plan(1040, 2304, T(ks=2, nwr=4, u=2)) == (17, 5, 4, False)


def test_refusals_on_cpu():
    x = torch.randn(2, 512).to(torch.bfloat16)
    w = torch.zeros(64, 256, dtype=torch.uint8)
    ok, why = gt.tma_supported(x, w)
    assert not ok and why
    with pytest.raises(RuntimeError, match="gluon_w4a16_tma cannot run"):
        gt.gluon_w4a16_tma(x, w, torch.zeros(64, 32, dtype=torch.uint8).view(torch.float8_e4m3fn),
                           torch.ones(1))
    act, _ = tg.quantize_activation(x, "w4a16")
    routing = mr.moe_align_reference(torch.zeros(2, 1, dtype=torch.int64), 1, 16)
    with pytest.raises(ValueError, match="dense w4a16 GEMMs only"):
        tg.nvfp4_gemm(act, w.unsqueeze(0), torch.zeros(1, 64, 32, dtype=torch.uint8).view(torch.float8_e4m3fn),
                      torch.ones(1), routing=routing, config=T())


def test_table_entries_fit():
    """Every TmaConfig entry of GLUON_TABLE fits the H200's shared memory at its bucket's largest M, on a shape the
    kernel supports (N % 16, K % 256)."""
    entries = [(key, c) for key, c in gd.GLUON_TABLE.items() if isinstance(c, T)]
    assert entries
    for (bucket, n, k), c in entries:
        assert c.smem_bytes(bucket) <= gt.SMEM_LIMIT and n % 16 == 0 and k % 256 == 0, (bucket, n, k, c)


def test_spread_std_words_decode_like_plain_words():
    """Decode 2 on spread_std's words builds the same bf16 register pairs as decode 1 on the plain words (the bit
    format's rotations, read back by gluon_gemm._pair_bits: the kernel's per-thread arithmetic in torch), and
    unspread_std inverts spread_std; every code value and sign appears."""
    from verl_quads.nvfp4 import gluon_gemm as gg

    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (48, 64), dtype=torch.uint8, generator=g)
    sp = gg.spread_std(packed)
    assert sp.shape == packed.shape and sp.dtype == torch.uint8 and not torch.equal(sp, packed)
    assert torch.equal(gg.unspread_std(sp), packed)
    plain = packed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    spread = sp.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    for p in range(4):
        assert torch.equal(gg._pair_bits(spread, p, 2), gg._pair_bits(plain, p, 1)), p
    with pytest.raises(ValueError, match="spread_std"):
        gg.spread_std(torch.zeros(4, 6, dtype=torch.uint8))
    assert torch.equal(gg.std_words(packed, 2), sp) and torch.equal(gg.std_words(packed, 4), gg.adjacent_std(packed))
    assert gg.std_words(packed, 1) is packed and gg.std_words(packed, 3) is packed
    with pytest.raises(ValueError, match="std_words"):
        gg.std_words(packed, 5)


def test_adjacent_std_pairs_adjacent_elements():
    """Decode 2 on adjacent_std's words: register pair P of word i holds the codes of elements 8 i + 2 P (low bf16
    half) and 8 i + 2 P + 1 (high half), each as bf16 bits (magnitude -> bits 6..8, sign -> bit 15)."""
    from verl_quads.nvfp4 import gluon_gemm as gg

    g = torch.Generator().manual_seed(4)
    packed = torch.randint(0, 256, (32, 96), dtype=torch.uint8, generator=g)
    adj = gg.adjacent_std(packed).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    plain = packed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF

    def bf16_bits(code):
        return ((code & 7) << 6) | ((code & 8) << 12)

    for p in range(4):
        lo, hi = (plain >> (8 * p)) & 0xF, (plain >> (8 * p + 4)) & 0xF
        assert torch.equal(gg._pair_bits(adj, p, 2), bf16_bits(lo) | (bf16_bits(hi) << 16)), p
