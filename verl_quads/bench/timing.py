"""Timing helpers shared by the benchmarks: CUDA-event medians, device description."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def device_name() -> str:
    """e.g. ``NVIDIA H200 (sm_90), torch 2.11.0, triton 3.6.0``."""
    import platform

    try:
        import triton

        tv = triton.__version__
    except Exception:
        tv = "n/a"
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), torch {torch.__version__}, triton {tv}"
    return f"CPU {platform.processor() or platform.machine()}, torch {torch.__version__}, triton {tv}"


def median_time_s(fn: Callable[[], object], warmup: int = 5, iters: int = 30, inner: int = 10) -> float:
    """Median over ``iters`` repetitions of the mean time of ``inner`` back-to-back calls, in seconds.

    On CUDA the calls are enqueued between two events, so host-side launch overhead overlaps
    with the previous call's kernels as it does in a real model; on CPU perf_counter is used.
    """
    for _ in range(warmup):
        fn()
    times = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        for _ in range(iters):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / inner)
    else:
        import time

        for _ in range(iters):
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


def graph_time_s(fn: Callable[[], object], iters: int = 20, inner: int = 10) -> float | None:
    """Device time of ``fn`` with host overhead removed: capture one call in a CUDA graph and time
    replays. Returns None when ``fn`` cannot be captured (e.g. it synchronizes with the host)."""
    if not torch.cuda.is_available():
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception:
        torch.cuda.synchronize()
        return None
    return median_time_s(graph.replay, 3, iters, inner)


def print_table(title: str, header: list[str], rows: list[list[object]]) -> str:
    """Render a plain-text table (also returned, for README pasting)."""
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, " | ".join(h.ljust(w[i]) for i, h in enumerate(header)), "-+-".join("-" * x for x in w)]
    lines += [" | ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in cells[1:]]
    out = "\n".join(lines)
    print(out, flush=True)
    return out
