"""Helpers of the moe_align unit tests (test_moe_align_one_launch.py, test_moe_decode_kernels.py): random routing ids
and launch spies on every kernel moe_align can launch."""

import torch
from launch_spy import LaunchSpy

from verl_quads.nvfp4 import moe_routing as mr

#: every kernel moe_align can launch: the one launch, then the two launches' histogram and scan + scatter
ALIGN_KERNELS = ("_moe_align_fused_kernel", "_moe_hist_kernel", "_moe_scan_scatter_kernel")


def routing_ids(tokens, top_k, e, local_frac, seed, one_expert=None, dtype=torch.int64, device="cpu"):
    """Expert ids ``[tokens, top_k]`` uniform over ``e`` experts (all ``one_expert`` if given), each local with
    probability ``local_frac`` (else -1), ``dtype`` on ``device``; deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, e, (tokens, top_k), generator=g)
    if one_expert is not None:
        ids.fill_(one_expert)
    ids[torch.rand(tokens, top_k, generator=g) >= local_frac] = -1
    return ids.to(dtype).to(device)


def spy_align(monkeypatch) -> dict:
    """Replace each of :data:`ALIGN_KERNELS` in verl_quads.nvfp4.moe_routing by a :class:`LaunchSpy` (for this
    test): name -> spy."""
    spies = {n: LaunchSpy(getattr(mr, n)) for n in ALIGN_KERNELS}
    for n, sp in spies.items():
        monkeypatch.setattr(mr, n, sp)
    return spies
