"""CPU checks of the floor probe's host side (verl_quads/bench/gluon_floor.py): the mode parser and the torch
references its GPU run compares the kernel's bytes with (per-program sums of the std kernel's weight bytes; the
epilogue / split-K fixup output), against a direct per-program loop over the same rows and chunks."""

import pytest
import torch

from verl_quads.bench import gluon_floor as gf
from verl_quads.bench.gluon_probe import parse_std
from verl_quads.nvfp4 import gluon_gemm as gg


def test_parse_mode():
    assert gf.parse_mode("reg2") == (0, 2, 1, 0, 1)
    assert gf.parse_mode("reg") == (0, 1, 1, 0, 1)
    assert gf.parse_mode("ring4") == (1, 8, 4, 0, 1)
    assert gf.parse_mode("ring3u16f") == (1, 16, 3, 1, 1)
    assert gf.parse_mode("emptyf") == (2, 1, 1, 1, 1)
    assert gf.parse_mode("emptyf16") == (2, 1, 1, 1, 16)
    assert gf.parse_mode("reg2f9") == (0, 2, 1, 1, 9)
    for bad in ("ring1", "ring", "reg2x", "fast", "emptyf17", "emptyf0", "emptyfv"):
        with pytest.raises(ValueError):
            gf.parse_mode(bad)


def _loop_sums(wp, wsc, cfg):
    """Per program (pid_n, pid_k): the int32-wrapping sum of its rows' words and scale bytes, by a direct loop."""
    n, kh = wp.shape
    k = 2 * kh
    grid_n, split, cps, _ = gg.std_plan(n, k, cfg, 132)
    rows_per = 16 * cfg.num_warps * cfg.rg
    w32, s8 = wp.view(torch.int32), wsc.view(torch.uint8)
    out = []
    for pn in range(grid_n):
        for pk in range(split):
            tot = 0
            for r in range(pn * rows_per, (pn + 1) * rows_per):
                rr = min(r, n - 1)  # rows past N read row N - 1, as the kernel's offsets
                for c in range(pk * cps, min((pk + 1) * cps, k // 128)):
                    tot += int(w32[rr, c * 16:(c + 1) * 16].long().sum()) + int(s8[rr, c * 8:(c + 1) * 8].long().sum())
            tot &= 0xFFFFFFFF
            out.append(tot - (1 << 32) if tot >= 1 << 31 else tot)
    return torch.tensor(out, dtype=torch.int32), grid_n, split


@pytest.mark.parametrize("spec, n, k", [("w4:rg2:o2", 300, 1024), ("w4:o2", 200, 1536), ("w8:s3", 130, 2048)])
def test_floor_reference_matches_loop(spec, n, k):
    cfg = parse_std(spec)[0]
    g = torch.Generator().manual_seed(n + k)
    wp = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    wsc = torch.randint(0, 127, (n, k // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    want, grid_n, split = _loop_sums(wp, wsc, cfg)
    assert torch.equal(gf.floor_reference(wp, wsc, cfg, 0), want)
    assert torch.equal(gf.floor_reference(wp, wsc, cfg, 2), torch.zeros_like(want))  # empty: no reads
    # the FIX modes' output: every row of tile t = bf16(sum over the tile's splits of (sum & 255) * 256)
    y = gf.fix_reference(want, n, cfg, grid_n, split)
    bn = 16 * cfg.num_warps * cfg.rg
    per_tile = [sum(float((int(v) & 255) * 256) for v in want[t * split:(t + 1) * split]) for t in range(grid_n)]
    exp = torch.tensor([per_tile[r // bn] for r in range(n)], dtype=torch.float32).to(torch.bfloat16).view(1, n)
    assert y.shape == (1, n) and torch.equal(y, exp)
    y16 = gf.fix_reference(want, n, cfg, grid_n, split, 16)  # fM modes: the same row in each of the M rows
    assert y16.shape == (16, n) and torch.equal(y16, exp.expand(16, n))
