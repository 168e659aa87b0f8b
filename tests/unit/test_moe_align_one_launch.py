"""moe_align in ONE launch (verl_quads/nvfp4/moe_routing.py, issue #5): ``_moe_align_one_launch``
(``_moe_align_fused_kernel``) and the dispatch of ``moe_align`` to it at 1 <= S <= MOE_ALIGN_ONE_LAUNCH_MAX
token-slots at any number of experts, decode included (until session 12 a register kernel took S <= 16 slots at
<= 256 experts, and a one-program scratch kernel S <= 256 slots at more experts; both are gone).

On CPU under TRITON_INTERPRET=1. Every output tensor of GroupedRouting (sorted slots, sorted tokens, the tile table
incl. its dead entries) is compared with torch.equal against the torch reference (``moe_align_reference``); the
outputs start filled with a sentinel, so an entry the kernel does not write fails the comparison.
"""

import functools
import os
import sys

import pytest
import torch

from verl_quads.nvfp4 import moe_routing as mr

sys.path.insert(0, os.path.dirname(__file__))
from moe_routing import routing_ids, spy_align  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (scripts/test.sh sets it on CPU)",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
FIELDS = ("tile_expert", "tile_row0", "tile_row1", "sorted_slots", "sorted_tokens")
_ids = functools.partial(routing_ids, device=DEV)


def _run(ids, e, block_m, **kw):
    """(_moe_align_one_launch outputs, reference) with the outputs pre-filled with -7 (unwritten entries show)."""
    ref = mr.moe_align_reference(ids, e, block_m)
    flat = ids.reshape(-1).contiguous()
    outs = tuple(torch.full_like(getattr(ref, f), -7) for f in FIELDS)
    mr._moe_align_one_launch(flat, e, ids.shape[-1], block_m, outs, **kw)
    return outs, ref


def _assert_same(outs, ref, tag):
    for got, f in zip(outs, FIELDS):
        assert torch.equal(got, getattr(ref, f)), (tag, f)


def _assert_stable(ids, e, ref):
    """The reference itself: keys ascending (-1 last as key E), stable (slots of one key in index order)."""
    flat = ids.reshape(-1).long()
    slots = ref.sorted_slots.long()
    key = torch.where(flat < 0, e, flat)[slots]
    assert bool((key[1:] >= key[:-1]).all())
    order = key * flat.numel() + slots  # (key, slot) lexicographic
    assert bool((order[1:] > order[:-1]).all())


CASES = [  # tokens, top_k, E, block_m, local fraction, all on one expert
    (33, 8, 128, 16, 0.9, None),    # 264 slots, -1 ids
    (257, 1, 128, 32, 1.0, None),   # 257 slots (top-1), every slot local
    (256, 8, 128, 32, 0.9, None),   # 2048 slots: T = 256 at Qwen3-30B-A3B routing (block_m 32 as moe_forward)
    (512, 8, 128, 64, 0.85, None),  # 4096 slots
    (1024, 8, 128, 64, 0.9, None),  # 8192 slots
    (256, 8, 8, 64, 0.8, None),     # E = 8: ~256 slots per expert, several tiles each
    (100, 4, 100, 16, 0.7, None),   # E not a power of two
    (40, 8, 128, 16, 1.0, 127),     # every slot on the last expert: 20 tiles of one expert
    (40, 8, 128, 32, 0.0, None),    # no slot local: every tile dead, all slots in index order
    (300, 1, 257, 16, 0.9, None),   # 257 experts
    # S <= 256 (until session 12 the one-program scratch kernel's at E > 256):
    (1, 1, 257, 16, 1.0, None),     # S = 1, 257 experts
    (1, 8, 512, 16, 0.9, None),     # decode M=1, 512 experts
    (2, 8, 1024, 16, 1.0, None),    # E = 1024 (32+ tile-table programs of 16 experts)
    (32, 8, 300, 16, 0.8, None),    # S = 256, E not a power of two
    (16, 8, 512, 64, 0.0, None),    # no slot local, 512 experts
    (20, 8, 512, 16, 1.0, 511),     # every slot on the last expert, E == EP (its key + 1 falls off the histogram)
    (17, 8, 128, 16, 0.9, None),    # 136 slots, 128 experts
    (5, 8, 128, 16, 0.9, None),     # 40 slots, 128 experts
    (16, 8, 256, 32, 0.9, None),    # 128 slots, 256 experts
    (24, 8, 200, 32, 0.9, None),    # 192 slots, E = 200
    (32, 8, 256, 16, 0.8, 255),     # 256 slots, 256 experts (E == EP), all on the last one but -1s
    (8, 8, 300, 128, 0.9, None),    # 64 slots, 300 experts, a tall M-tile
    (16, 8, 300, 2, 0.9, None),     # 128 slots, 300 experts, 2-row M-tiles (64 tiles + 128 possible experts)
]


@pytest.mark.parametrize("kw", [{}, dict(chunk=16), dict(chunk=128), dict(eb=1), dict(eb=8), dict(eb=256)],
                         ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()) or "default")
@pytest.mark.parametrize("tokens, top_k, e, block_m, local_frac, one_expert", CASES)
def test_one_launch_equals_torch_reference(kw, tokens, top_k, e, block_m, local_frac, one_expert):
    """Every chunk / tile-table split: == the reference (stable order, -1 last, same tile table)."""
    ids = _ids(tokens, top_k, e, local_frac, seed=tokens * 13 + e + block_m, one_expert=one_expert)
    outs, ref = _run(ids, e, block_m, **kw)
    _assert_same(outs, ref, kw)
    _assert_stable(ids, e, ref)


def test_one_launch_int32_ids_and_block_m_128():
    """Routing ids as vLLM passes them (int32), a tall M-tile."""
    ids = _ids(200, 8, 128, 0.95, seed=5, dtype=torch.int32)
    outs, ref = _run(ids, 128, 128)
    _assert_same(outs, ref, "int32")


#: moe_align's dispatch cases (tokens, top_k, E, block_m, local fraction, all on one expert, seed): until session 13
#: two tests over two lists (this file's at top-8 / 0.9 local / seed = tokens, test_moe_decode_kernels.py's decode
#: list at seed = tokens * 31 + E); merged here with each case's ids unchanged (hence the seed column)
DISPATCH_CASES = [(t, 8, e, bm, 0.9, None, t) for t, e, bm in [
    (33, 128, 16), (256, 128, 32), (1024, 128, 64), (2048, 128, 128), (40, 300, 16), (17, 128, 16), (32, 256, 16),
    (1, 257, 16), (16, 512, 16), (32, 512, 16), (16, 128, 16), (1, 128, 16), (2, 256, 16), (3, 128, 16)]] + [
    (t, k, e, bm, lf, one, t * 31 + e) for t, k, e, bm, lf, one in [
        (1, 1, 3, 16, 1.0, None),     # S = 1, E not a power of two
        (1, 8, 128, 16, 1.0, None),   # decode M=1 at Qwen3-30B-A3B routing
        (3, 2, 5, 16, 0.7, None),     # -1 ids (not local), E = 5
        (4, 4, 7, 2, 1.0, 6),         # every slot on one expert (the last), 8 tiles of 2 rows
        (4, 4, 7, 16, 0.0, None),     # no slot local: every tile empty
        (2, 8, 100, 32, 0.9, None),   # decode M=2, E = 100
        (2, 8, 256, 16, 0.8, None),   # 16 slots, 256 experts (the register path's limits until session 12)
        (3, 8, 128, 16, 0.9, None),   # 24 slots
        (4, 8, 128, 16, 0.9, None),   # 32 slots
        (16, 8, 128, 16, 0.9, None),  # 128 slots
        (32, 8, 256, 16, 0.9, None),  # 256 slots, 256 experts
        (33, 8, 128, 16, 0.9, None),  # 264 slots
        (2, 8, 257, 16, 0.9, None),   # 16 slots, 257 experts
        (1, 1, 512, 16, 0.9, None),   # 1 slot, 512 experts
    ]]


@pytest.mark.parametrize("tokens, top_k, e, block_m, local_frac, one_expert, seed", DISPATCH_CASES)
def test_moe_align_dispatch_is_one_launch(monkeypatch, tokens, top_k, e, block_m, local_frac, one_expert, seed):
    """moe_align at 1 <= S <= MOE_ALIGN_ONE_LAUNCH_MAX slots at any E, decode included: ONE launch of the fused
    kernel, nothing else; == the reference bit for bit (stable order within an expert, -1 last, same tile table)."""
    spies = spy_align(monkeypatch)
    ids = _ids(tokens, top_k, e, local_frac, seed=seed, one_expert=one_expert)
    assert 1 <= ids.numel() <= mr.MOE_ALIGN_ONE_LAUNCH_MAX
    got, ref = mr.moe_align(ids, e, block_m), mr.moe_align_reference(ids, e, block_m)
    want = {n: 0 for n in spies}
    want["_moe_align_fused_kernel"] = 1
    assert {n: sp.launches for n, sp in spies.items()} == want
    _assert_same(tuple(getattr(got, f) for f in FIELDS), ref, "moe_align")
    _assert_stable(ids, e, ref)


def test_past_the_one_launch_limit_two_launches(monkeypatch):
    """Past MOE_ALIGN_ONE_LAUNCH_MAX slots (lowered to 512 here, to keep the interpreter quick): the histogram
    launch, then scan + scatter; same result."""
    monkeypatch.setattr(mr, "MOE_ALIGN_ONE_LAUNCH_MAX", 512)
    spies = spy_align(monkeypatch)
    ids = _ids(80, 8, 128, 0.9, seed=9)
    got, ref = mr.moe_align(ids, 128, 16), mr.moe_align_reference(ids, 128, 16)
    assert (spies["_moe_hist_kernel"].launches, spies["_moe_align_fused_kernel"].launches) == (1, 0)
    _assert_same(tuple(getattr(got, f) for f in FIELDS), ref, "two launches")


def test_one_launch_rejects_bad_options():
    ids = _ids(40, 8, 128, 1.0, seed=1)
    flat = ids.reshape(-1)
    ref = mr.moe_align_reference(ids, 128, 16)
    outs = tuple(torch.empty_like(getattr(ref, f)) for f in FIELDS)
    for chunk in (48, 8):
        with pytest.raises(ValueError, match="chunk"):
            mr._moe_align_one_launch(flat, 128, 8, 16, outs, chunk=chunk)
    with pytest.raises(ValueError, match="eb"):
        mr._moe_align_one_launch(flat, 128, 8, 16, outs, eb=12)


def test_chunk_rule():
    """Chunks of 32..128 slots, at most 64 scatter programs up to 8192 slots (the H200 measurement behind
    _moe_align_chunk: the fastest chunk at 512 / 2048 / 4096 / 8192 / 16384 slots)."""
    for s in (257, 512, 2048, 2049, 4096, 8192, 16384):
        c = mr._moe_align_chunk(s)
        assert 32 <= c <= 128 and c & (c - 1) == 0 and (-(-s // c) <= 64 or c == 128), (s, c)
    assert [mr._moe_align_chunk(s) for s in (512, 2048, 4096, 8192, 16384)] == [32, 32, 64, 128, 128]
