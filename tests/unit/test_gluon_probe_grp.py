"""gluon_probe ``--grp`` (issue #5, session 11): the dense GEMM timed through the grouped Gluon kernel as ONE expert.
CPU only: the one-expert routing's index tensors (one M-tile of rows [0, m), 16-byte aligned views) and the config
parser. The kernel runs on the GPU only (the probe checks every config against the torch reference bound)."""

import pytest
import torch

from verl_quads.bench.gluon_probe import _configs, dense_routing, parse_grp
from verl_quads.nvfp4.gluon_moe import GroupedConfig


@pytest.mark.parametrize("m", list(range(1, 17)))
def test_dense_routing(m):
    r = dense_routing(m, torch.device("cpu"))
    assert r.sorted_slots.dtype == r.tile_row1.dtype == r.tile_expert.dtype == r.tile_row0.dtype == torch.int32
    assert r.sorted_slots.tolist() == list(range(m))
    assert r.tile_expert.tolist() == [0] and r.tile_row0.tolist() == [0] and r.tile_row1.tolist() == [m]
    assert r.block_m == (8 if m <= 8 else 16) and r.num_experts == 1 and r.sorted_tokens is None
    for t in (r.sorted_slots, r.tile_expert, r.tile_row0, r.tile_row1):  # one pointer specialization for every m
        assert t.data_ptr() % 16 == 0


def test_dense_routing_rejects_bad_m():
    for m in (0, 4097):
        with pytest.raises(ValueError, match="1..4096"):
            dense_routing(m, torch.device("cpu"))
    with pytest.raises(ValueError, match="32 or 64"):
        dense_routing(17, torch.device("cpu"), block_m=16)


@pytest.mark.parametrize("m,block_m,ends", [(17, 32, [17]), (64, 32, [32, 64]), (100, 64, [64, 100]),
                                             (256, 64, [64, 128, 192, 256])])
def test_dense_routing_many_rows(m, block_m, ends):
    r = dense_routing(m, torch.device("cpu"), block_m)
    assert r.sorted_slots.tolist() == list(range(m)) and r.block_m == block_m and r.num_experts == 1
    assert r.tile_expert.tolist() == [0] * len(ends)
    assert r.tile_row0.tolist() == [e - (e - 1) % block_m - 1 for e in ends] and r.tile_row1.tolist() == ends
    for t in (r.sorted_slots, r.tile_expert, r.tile_row0, r.tile_row1):
        assert t.dtype == torch.int32


def test_parse_grp():
    G = GroupedConfig
    assert parse_grp("rg2:d3:xs1:pf0:r128,rg2:d3:xs1:xsc2:xsb2,w8:nt1:s4,nts2:xs1") == [
        G(4, 1, 0, 2, prefetch=False, rg=2, dec=3, xs=True, maxnreg=128),
        G(4, 1, 0, 2, rg=2, dec=3, xs=True, xsc=2, xsb=2), G(8, 1, 4, 2, nt=1), G(4, 1, 0, 2, nts=2, xs=True)]
    with pytest.raises(ValueError):
        parse_grp("rg2:x3")
    kinds = [kind for kind, _, _ in _configs("std", "w4:rg2", "rg2:xs1:pf0")]
    assert kinds == ["std", "grp"]
