"""verl_quads.rollout.capture.PinnedArena (the host memory of TRACE's CUDA records) with a plain allocator (no GPU
here; the pinned allocation itself is exercised by tests/gpu/test_guidance_store_gpu.py)."""

import torch

from verl_quads.rollout.capture import PinnedArena


def test_takes_are_aligned_disjoint_and_share_a_chunk_until_it_is_full():
    allocs = []

    def alloc(n):
        allocs.append(n)
        return torch.zeros(n, dtype=torch.uint8)

    a = PinnedArena(alloc, chunk_bytes=256)
    parts = [a.take(n) for n in (5, 16, 33, 100)]  # 5 -> [0, 5), 16 -> [16, 32), 33 -> [32, 65), 100 -> [80, 180)
    assert allocs == [256]
    base = parts[0].untyped_storage().data_ptr()
    starts = [p.data_ptr() - base for p in parts]
    assert starts == [0, 16, 32, 80] and all(s % PinnedArena.ALIGN == 0 for s in starts)
    assert [p.numel() for p in parts] == [5, 16, 33, 100]
    for i, p in enumerate(parts):
        p.fill_(i + 1)
    assert [int(p.unique().item()) for p in parts] == [1, 2, 3, 4]  # no overlap
    nxt = a.take(100)  # 192 + 100 > 256: a new chunk
    assert allocs == [256, 256] and nxt.untyped_storage().data_ptr() != base
    big = a.take(1000)  # larger than a chunk: its own allocation, the current chunk kept
    assert allocs == [256, 256, 1000] and big.numel() == 1000
    assert a.take(8).untyped_storage().data_ptr() == nxt.untyped_storage().data_ptr()


def test_views_of_any_dtype_fit_and_keep_the_chunk_alive():
    a = PinnedArena(lambda n: torch.zeros(n, dtype=torch.uint8), chunk_bytes=1024)
    a.take(3)
    f = a.take(4 * 6).view(torch.float32)  # aligned start: the float32 view is allowed
    f.copy_(torch.arange(6, dtype=torch.float32))
    a._chunk = None  # the arena lets go of the chunk; the view still owns its memory
    assert f.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
