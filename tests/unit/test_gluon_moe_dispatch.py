"""Grouped Gluon W4A16 dispatch (gluon_dispatch.GLUON_MOE_TABLE / gluon_moe_table_entry / gluon_grouped_config; the
kernel in verl_quads/nvfp4/gluon_moe.py) on CPU: the table's shape, its exact-bucket lookup (unmeasured buckets,
capabilities and routing tile heights keep the current dispatch), that the default dispatch never picks the Gluon kernel
on CPU / under the Triton interpreter, and that an explicit GroupedConfig there raises (no silent fallback). The kernel
itself runs only on a GPU (tests/gpu/test_gluon_moe_gpu.py)."""

import pytest
import torch

from verl_quads.nvfp4 import device_info as di
from verl_quads.nvfp4 import gluon_dispatch as gd
from verl_quads.nvfp4 import gluon_moe as gm
from verl_quads.nvfp4 import moe_routing as mr
from verl_quads.nvfp4 import triton_gemm as tg
from verl_quads.nvfp4 import triton_stream as ts


def test_table_entries_and_exact_bucket_lookup():
    assert gd.GLUON_MOE_TABLE and all(isinstance(c, gm.GroupedConfig) for c in gd.GLUON_MOE_TABLE.values())
    for (b, n, k), cfg in gd.GLUON_MOE_TABLE.items():
        assert b in gd.GLUON_MOE_BUCKETS and k % 128 == 0
        lower = max((x for x in gd.GLUON_MOE_BUCKETS if x < b), default=0)
        for slots in (lower + 1, b):
            for bm in (8, 16, 32):
                if (bm // 8) % (cfg.nt or 1) == 0:
                    assert gd.gluon_moe_table_entry(slots, n, k, bm, (9, 0)) is cfg
                else:  # the entry's n-tiles do not fit this routing's tiles: the current dispatch
                    assert gd.gluon_moe_table_entry(slots, n, k, bm, (9, 0)) is None
        assert gd.gluon_moe_table_entry(b, n, k, 16, (10, 0)) is None  # measured on sm_90 only
        assert gd.gluon_moe_table_entry(b, n, k, 16, (8, 0)) is None
        assert gd.gluon_moe_table_entry(b, n, k, 64, (9, 0)) is None  # measured on 8..32-row tiles only
        assert gd.gluon_moe_table_entry(b, n, k, 128, (9, 0)) is None  # routing tile height the kernel does not take
        if (lower, n, k) not in gd.GLUON_MOE_TABLE and lower:
            assert gd.gluon_moe_table_entry(lower, n, k, 16, (9, 0)) is None  # an unmeasured bucket: no entry
    assert gd.gluon_moe_table_entry(8, 1536, 2048, 16, (9, 0)) is None  # T=1 (8 slots): the stream entries stay
    assert gd.gluon_moe_table_entry(4096, 1536, 2048, 32, (9, 0)) is None  # an unmeasured bucket (T=512)
    assert gd.gluon_moe_table_entry(16384, 1536, 2048, 32, (9, 0)) is None  # past the last bucket
    assert gd.gluon_moe_bucket(2048) == gd.gluon_moe_bucket(1025) == 2048 and gd.gluon_moe_bucket(512) == 512


def _grouped_case(e=4, n=32, k=128, tokens=3, topk=2):
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    scale = (torch.rand(e, n, k // 16, generator=g) + 0.5).to(torch.float8_e4m3fn)
    gs = torch.full((e,), 100.0)
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(tokens)])
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    return x, packed, scale, gs, ids


def test_dispatch_never_picks_gluon_on_cpu(monkeypatch):
    x, packed, scale, gs, ids = _grouped_case()
    routing = mr.moe_align_reference(ids, packed.shape[0], 16)
    monkeypatch.setitem(gd.GLUON_MOE_TABLE, (ts.decode_bucket(6), packed.shape[1], x.shape[1]), gm.GroupedConfig())
    assert gd.gluon_moe_table_entry(6, packed.shape[1], x.shape[1], 16, (9, 0)) is not None  # an entry for this shape
    assert gd.gluon_grouped_config(x, packed, routing) is None  # ... but not on a CPU tensor
    assert not gm.grouped_supported(x, packed, 16)


def test_explicit_config_raises_where_it_cannot_run():
    x, packed, scale, gs, ids = _grouped_case()
    routing = mr.moe_align_reference(ids, packed.shape[0], 16)
    act, _ = tg.quantize_activation(x, "w4a16")
    with pytest.raises((ValueError, RuntimeError)):
        tg.nvfp4_gemm(act, packed, scale, gs, routing=routing, a_rows=routing.sorted_tokens, out_rows=6,
                      config=gm.GroupedConfig())
    with pytest.raises((ValueError, RuntimeError)):
        gm.gluon_w4a16_grouped(x, packed, scale, gs, routing, a_rows=routing.sorted_tokens, cfg=gm.GroupedConfig())


def test_default_dispatch_on_a_hopper_without_usable_gluon_warns_once(monkeypatch, caplog):
    """On sm_90 (capability, device type and interpreter patched; no GPU) the grouped default dispatch takes its table
    entry when Gluon can run, else None (the Triton kernels) with ONE warning per process naming the triton version
    and the MoE kernel (the dense path's warning is a separate one: tests/unit/test_gluon_layout.py)."""
    import logging
    from types import SimpleNamespace

    from verl_quads.nvfp4 import gluon_gemm as gg

    w = torch.zeros(128, 1536, 1024, dtype=torch.uint8)  # [E, N, K/2]: K = 2048
    x = SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=torch.bfloat16, shape=(16, 2048))
    routing = SimpleNamespace(sorted_slots=torch.zeros(128, dtype=torch.int32), block_m=16)  # S = 128: T = 16
    monkeypatch.setattr(gd, "interpreting", lambda: False)
    monkeypatch.setattr(di, "capability", lambda dev=None: (9, 0))
    monkeypatch.setattr(gg, "gluon_available", lambda: (True, ""))
    assert gd.gluon_grouped_config(x, w, routing) is gd.GLUON_MOE_TABLE[(128, 1536, 2048)]

    monkeypatch.setattr(gg, "gluon_available", lambda: (False, "triton 3.5.0 < 3.6"))
    monkeypatch.setattr(gd, "_GLUON_MOE_WARNED", [])
    with caplog.at_level(logging.WARNING, logger=gd.__name__):
        assert gd.gluon_grouped_config(x, w, routing) is None
        assert gd.gluon_grouped_config(x, w, routing) is None
    warns = [r.getMessage() for r in caplog.records if "Gluon W4A16 MoE kernel" in r.getMessage()]
    assert len(warns) == 1 and "triton 3.5.0" in warns[0] and "grouped W4A16 expert GEMMs" in warns[0]


def test_moe_block_m_takes_the_gluon_routing_where_both_gemms_run_on_gluon(monkeypatch):
    """moe_block_m (moe_forward's routing tile height): grouped_block_m, except at a GLUON_MOE_ROUTING_BLOCK_M bucket
    where GEMM1's operand is bf16 w4a16 values and both expert GEMMs have a runnable GLUON_MOE_TABLE entry at that
    block_m (sm_90 patched, no GPU): T=1024 at Qwen3-30B-A3B (8192 slots, 64 per expert) -> 32 instead of 64."""
    from types import SimpleNamespace

    from verl_quads.nvfp4 import gluon_gemm as gg

    e, s = 128, 8192
    w13 = torch.zeros(e, 1536, 1024, dtype=torch.uint8)  # [E, 2I, H/2]: H = 2048
    w2 = torch.zeros(e, 2048, 384, dtype=torch.uint8)  # [E, H, I/2]: I = 768
    x = SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=torch.bfloat16, shape=(1024, 2048))
    assert tg.grouped_block_m(s // e) == 64 and gd.GLUON_MOE_ROUTING_BLOCK_M[gd.gluon_moe_bucket(s)] == 32
    assert tg.moe_block_m(s, e, x, w13, w2) == 64  # on CPU (not sm_90, the interpreter): grouped_block_m
    monkeypatch.setattr(gd, "interpreting", lambda: False)
    monkeypatch.setattr(di, "capability", lambda dev=None: (9, 0))
    monkeypatch.setattr(gg, "gluon_available", lambda: (True, ""))
    assert tg.moe_block_m(s, e, x, w13, w2) == 32
    assert tg.moe_block_m(s, e, None, w13, w2) == 64  # GEMM1 an FP4 operand (naive, quads fp4x2): Triton kernels
    assert tg.moe_block_m(s, e, SimpleNamespace(device=x.device, dtype=torch.float16, shape=x.shape), w13, w2) == 64
    assert tg.moe_block_m(4097, e, x, w13, w2) == 32  # anywhere in the bucket (4097..8192 slots)
    assert tg.moe_block_m(4096, e, x, w13, w2) == tg.grouped_block_m(32) == 32  # bucket 4096: no entries
    assert tg.moe_block_m(2048, e, x, w13, w2) == tg.grouped_block_m(16) == 32  # no routing entry: grouped_block_m
    assert tg.moe_block_m(32768, e, x, w13, w2) == tg.grouped_block_m(256)  # past the last bucket
    w2_other = torch.zeros(e, 2048, 512, dtype=torch.uint8)  # another intermediate size: no w2 entry
    assert tg.moe_block_m(s, e, x, w13, w2_other) == 64  # one GEMM off Gluon: grouped_block_m for both
    monkeypatch.setattr(di, "capability", lambda dev=None: (10, 0))
    assert tg.moe_block_m(s, e, x, w13, w2) == 64


def test_grouped_config_labels_are_stable():
    """GroupedConfig builds its label itself (GluonConfig.label grows the dense kernel's options, some with the same
    names): the probe's picks and the GPU tests' ids rely on these exact labels (session 10: doubled names dropped
    configs from a probe run silently)."""
    G = gm.GroupedConfig
    assert G(8, 1, 0, 2, xs=True, nts=2, xsc=4, xsb=2).label == "w8 kc1 sa2 pf1 xs nts2 xsc4 xsb2"
    assert G(4, 1, 0, 2, xs=True).label == "w4 kc1 sa2 pf1 xs"
    assert G(4, 1, 0, 2, rg=2, dec=3, nt=2, xs=True).label == "w4 kc1 sa2 pf1 rg2 d3 nt2 xs"
    assert G(4, 1, 0, 2, prefetch=False, nt=1).label == "w4 kc1 sa2 pf0 nt1"
    for key, cfg in gd.GLUON_MOE_TABLE.items():
        assert len(cfg.label.split()) == len(set(cfg.label.split())), (key, cfg.label)  # no option printed twice
