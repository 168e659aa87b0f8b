"""The gate fused into the grouped Gluon w13 GEMM (gluon_moe.gluon_w4a16_grouped(silu_mul=True), moe_forward's
``fuse_gate``) on CPU: when the fused epilogue applies (silu_mul_refusal: a program pairs BN / 2 gate rows with their
up rows, one K range), that GLUON_MOE_TABLE's w13 entries take it at their own points on an H200 (132 SMs), and that
moe_forward with ``fuse_gate=True`` raises where it cannot fuse (here: no Gluon under the interpreter / on CPU) while
the default keeps the unfused path. The kernel runs on a GPU only (tests/gpu/test_gluon_moe_gpu.py)."""

import pytest
import torch

from verl_quads.nvfp4 import gluon_dispatch as gd
from verl_quads.nvfp4 import gluon_moe as gm
from verl_quads.nvfp4 import triton_gemm as tg

G = gm.GroupedConfig


def test_refusal_rules():
    # BN = 16 num_warps rg weight rows: half gate, half up, so I must be a multiple of BN / 2
    assert gm.silu_mul_refusal(2 * 768, 2048, 128, G(4, 1, 1, 2)) == ""  # BN 64: 768 = 24 x 32
    assert gm.silu_mul_refusal(2 * 768, 2048, 128, G(4, 1, 1, 2, rg=2)) == ""  # BN 128: 768 = 12 x 64
    assert "BN / 2 = 64" in gm.silu_mul_refusal(2 * 96, 256, 8, G(4, 1, 1, 2, rg=2))  # 96 % 64 != 0
    assert "BN / 2 = 64" in gm.silu_mul_refusal(2 * 96, 256, 8, G(8, 1, 1, 2))
    assert gm.silu_mul_refusal(2 * 96, 256, 8, G(1, 1, 1, 2)) == ""  # one 16-row group: 8 gate + 8 up rows
    assert "BN / 2" in gm.silu_mul_refusal(2 * 768 + 1, 2048, 128, G(4, 1, 1, 2))  # odd N
    assert "split" in gm.silu_mul_refusal(2 * 768, 2048, 128, G(4, 1, 2, 2))  # two K ranges: no fused fixup
    # the planned split: at 1 token (8 live tiles) G(4, 1, 0, 2) splits K on 132 SMs; with split 1 it fuses
    assert gm.grouped_plan(1536, 2048, 8, G(4, 1, 0, 2, nt=1))[1] > 1
    assert "split" in gm.silu_mul_refusal(1536, 2048, 8, G(4, 1, 0, 2, nt=1))
    assert gm.silu_mul_refusal(1536, 2048, 8, G(4, 1, 1, 2, nt=1)) == ""


@pytest.mark.parametrize("key", sorted(k for k in gd.GLUON_MOE_TABLE if k[1:] == (1536, 2048)),
                         ids=lambda k: f"S{k[0]}")
def test_table_w13_entries_fuse_at_their_points(key):
    """Each w13 GLUON_MOE_TABLE entry runs one K range at its bucket's slot count on 132 SMs (the H200), so the
    default moe_forward fuses the gate there (the GPU test checks the bytes)."""
    slots, n, k = key
    assert gm.silu_mul_refusal(n, k, min(128, slots), gd.GLUON_MOE_TABLE[key], sms=132) == ""


def _case(tokens=3, e=4, hidden=128, inter=64, topk=2):
    g = torch.Generator().manual_seed(0)

    def w(n, k):
        return (torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g),
                (torch.rand(e, n, k // 16, generator=g) + 0.5).to(torch.float8_e4m3fn), torch.full((e,), 100.0))

    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)])
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    sw = torch.softmax(torch.randn(tokens, topk, generator=g), -1)
    return x, sw, ids, (*w(2 * inter, hidden), *w(hidden, inter))


def test_moe_forward_fuse_gate_true_raises_where_it_cannot_fuse():
    x, sw, ids, w = _case()
    with pytest.raises(ValueError, match="fuse_gate=True"):
        tg.moe_forward(x, sw, ids, *w, "w4a16", fuse_gate=True)
    with pytest.raises(ValueError, match="fuse_gate=True"):
        tg.moe_forward(x, sw, ids, *w, "naive", fuse_gate=True)
    # default / False: the unfused path (the same bytes as each other here)
    assert torch.equal(tg.moe_forward(x, sw, ids, *w, "w4a16"), tg.moe_forward(x, sw, ids, *w, "w4a16",
                                                                                 fuse_gate=False))
