"""moe_align in ONE launch, decode included (issue #5; verl_quads/nvfp4/moe_routing.py
``_moe_align_one_launch``, ``_moe_align_fused_kernel``) on a CUDA GPU (the H200): every output tensor == the torch
reference (``moe_align_reference``, torch.equal) at Qwen3-30B-A3B routing (128 experts, top-8, some ids -1) and at
E = 8 / 256 / 257 / 512 / 1024, also replayed from a CUDA graph with new ids; moe_align's default dispatch (every
path) == the reference at 128 experts x T = 1..4096 tokens and at 256 / 512 experts. Timings (CUDA graph of one
call, us; printed with pytest -s; informational: where MOE_ALIGN_ONE_LAUNCH_MAX and _moe_align_chunk belong): the
one launch with options around its default vs the two launches (histogram, then scan + scatter) at S = 512 .. 32768
slots (decode sizes: tests/gpu/test_nvfp4_gemm_gpu.py::test_moe_align_paths_timed). Each variant is checked against
the reference before it is timed.
"""

import pytest
import torch

from verl_quads.nvfp4 import moe_routing as mr
from verl_quads.nvfp4 import triton_gemm as tg

pytestmark = pytest.mark.gpu
DEV = "cuda"
FIELDS = ("tile_expert", "tile_row0", "tile_row1", "sorted_slots", "sorted_tokens")


def _variants(slots):
    """_moe_align_one_launch options timed by the sweep at ``slots`` token-slots ({} = the default)."""
    if slots <= 512:
        return [{}, dict(chunk=16)]
    if slots <= 2048:
        return [{}, dict(chunk=64), dict(eb=32)]
    if slots <= 4096:
        return [{}, dict(eb=32), dict(num_warps=16)]
    if slots <= 8192:
        return [{}, dict(eb=8)]
    if slots <= 16384:
        return [{}, dict(chunk=256)]
    return [dict(chunk=128), dict(chunk=256)]


def _ids(tokens, e, seed, local_frac=0.9, topk=8):
    """Router-like ids: top_k distinct experts per token, a fraction not local (-1); int32 as vLLM's."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.rand(tokens, e, device=DEV, generator=g).argsort(-1)[:, :min(topk, e)]
    ids[torch.rand(ids.shape, device=DEV, generator=g) > local_frac] = -1
    return ids.to(torch.int32)


def _outs(ref):
    return tuple(torch.full_like(getattr(ref, f), -7) for f in FIELDS)


def _same(outs, ref):
    return all(torch.equal(o, getattr(ref, f)) for o, f in zip(outs, FIELDS))


def _label(kw):
    return "one launch " + (" ".join(f"{k}={v}" for k, v in kw.items()) or "(default)")


@pytest.mark.parametrize("tokens, e, block_m", [(33, 128, 16), (64, 128, 16), (256, 128, 32), (512, 128, 64),
                                                (1024, 128, 64), (256, 8, 64), (40, 257, 16), (2, 128, 16),
                                                (17, 128, 16), (32, 256, 16), (1, 512, 16), (16, 512, 16),
                                                (32, 512, 16), (2, 1024, 16)])
@pytest.mark.parametrize("kw", [{}, dict(chunk=16, eb=8)], ids=["default", "chunk16-eb8"])
def test_one_launch_equals_torch_reference(tokens, e, block_m, kw):
    ids = _ids(tokens, e, seed=tokens + e)
    ref = mr.moe_align_reference(ids, e, block_m)
    outs = _outs(ref)
    mr._moe_align_one_launch(ids.reshape(-1), e, ids.shape[-1], block_m, outs, **kw)
    for o, f in zip(outs, FIELDS):
        assert torch.equal(o, getattr(ref, f)), f


@pytest.mark.parametrize("tokens, e, block_m", [(33, 128, 16), (256, 128, 32), (512, 128, 64), (17, 128, 16),
                                                (1, 512, 16), (32, 512, 16), (8, 128, 16), (1, 128, 16),
                                                (2, 256, 16)])
def test_moe_align_one_launch_graph_replay(tokens, e, block_m):
    """moe_align (default dispatch: one launch at these sizes) captured once, replayed with new ids == reference."""
    assert tokens * 8 <= mr.MOE_ALIGN_ONE_LAUNCH_MAX
    ids = _ids(tokens, e, seed=1)
    graph = torch.cuda.CUDAGraph()
    mr.moe_align(ids, e, block_m)  # compile outside the capture
    with torch.cuda.graph(graph):
        cap = mr.moe_align(ids, e, block_m)
    for seed in (2, 3):
        ids.copy_(_ids(tokens, e, seed=seed, local_frac=0.8 if seed == 2 else 1.0))
        graph.replay()
        torch.cuda.synchronize()
        ref = mr.moe_align_reference(ids, e, block_m)
        for f in FIELDS:
            assert torch.equal(getattr(cap, f), getattr(ref, f)), (seed, f)


def _graph_us(fn):
    from verl_quads.bench.timing import graph_time_s

    t = graph_time_s(fn)
    assert t is not None, "not capturable in a CUDA graph"
    return t * 1e6


@pytest.mark.parametrize("e, tokens", [(128, t) for t in (1, 2, 4, 5, 6, 8, 16, 17, 24, 32, 33, 64, 128, 256, 512,
                                                             1024, 2048, 4096)]
                         + [(256, t) for t in (1, 16, 17, 32, 64)] + [(512, t) for t in (1, 16, 32, 64, 256)])
def test_moe_align_dispatch_equals_reference(e, tokens):
    """moe_align's default dispatch (the one launch or the two launches, as the sizes fall) at top-8 with
    moe_forward's block_m == moe_align_reference, every output (torch.equal)."""
    s = tokens * 8
    bm = tg.grouped_block_m(-(-s // min(e, s)))
    ids = _ids(tokens, e, seed=s + e)
    got, ref = mr.moe_align(ids, e, bm), mr.moe_align_reference(ids, e, bm)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f


@pytest.mark.parametrize("slots", [512, 2048, 4096, 8192, 16384, 32768])
def test_moe_align_one_launch_sweep(monkeypatch, slots):
    """CUDA-graph time (us) of one call: moe_align's default dispatch and (past 256 slots) the two launches
    (MOE_ALIGN_ONE_LAUNCH_MAX = 0), each timed first and last; every _variants entry of the one launch (==
    reference first; timed twice, interleaved) and an empty launch."""
    e, topk = 128, 8
    tokens = slots // topk
    bm = tg.grouped_block_m(-(-slots // min(e, slots)))
    ids = _ids(tokens, e, seed=slots)
    flat = ids.reshape(-1)
    ref = mr.moe_align_reference(ids, e, bm)
    one = mr.MOE_ALIGN_ONE_LAUNCH_MAX
    base = {"moe_align (default dispatch)": lambda: mr.moe_align(ids, e, bm)}
    if slots > 256:
        base["two launches (hist, scan + scatter)"] = lambda: mr.moe_align(ids, e, bm)
    rows, bad = {}, []

    def time_base():
        for lb, fn in base.items():
            monkeypatch.setattr(mr, "MOE_ALIGN_ONE_LAUNCH_MAX", 0 if lb.startswith("two") else one)
            r = fn()
            if not all(torch.equal(getattr(r, f), getattr(ref, f)) for f in FIELDS):
                bad.append(lb)
            rows.setdefault(lb, []).append(_graph_us(fn))
        monkeypatch.setattr(mr, "MOE_ALIGN_ONE_LAUNCH_MAX", one)

    time_base()
    fns = {}
    for kw in _variants(slots):
        outs = _outs(ref)
        mr._moe_align_one_launch(flat, e, topk, bm, outs, **kw)
        if not _same(outs, ref):
            bad.append(_label(kw))
            continue
        fns[_label(kw)] = lambda outs=outs, kw=kw: mr._moe_align_one_launch(flat, e, topk, bm, outs, **kw)
    x = torch.zeros(1, device=DEV)
    fns["empty launch (torch add_ of 1 element)"] = lambda: x.add_(0)
    for _ in range(2):
        for lb, fn in fns.items():
            rows.setdefault(lb, []).append(_graph_us(fn))
    time_base()
    w = max(len(k) for k in rows)
    print(f"\nmoe_align S={slots} (128 experts, top-8, block_m {bm}, default chunk {mr._moe_align_chunk(slots)}), "
          "CUDA graph, us (two runs):\n" + "\n".join(
              f"  {k.ljust(w)} | " + " | ".join(f"{v:6.2f}" for v in vs) for k, vs in rows.items()), flush=True)
    assert not bad, f"!= moe_align_reference: {bad}"
