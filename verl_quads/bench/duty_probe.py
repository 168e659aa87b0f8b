"""Per-call time of the dense W4A16 decode GEMM and of cuBLAS BF16 at one token when the device is busy only part of
the time, as in a batch-1 engine step (issue #5, session 23: batch-1 generates of a W4A16 engine swing 0.19-0.29 s
while BF16's stay steady; hypothesis: our decode kernels are issue-bound, so they slow down with the SM clock,
while the memory-bound BF16 GEMV does not).

``python -m verl_quads.bench.duty_probe [--shapes qkv,o_proj,d8192] [--gaps-ms 0,1] [--steps 200] [--calls 32]``;
``--eager N [--eager-modes w4a16,trace]``: instead, the host time of eager calls (:func:`eager_host_time`).

Per shape and per gap: ``--steps`` steps of ``--calls`` back-to-back GEMMs ``[1, K] x [N, K]^T`` (weight copies
rotated so that they do not stay in L2; on CUDA one captured graph per step, replayed, so no host time per call), the
step timed between two CUDA events, then a synchronize and a host sleep of the gap (0: back to back). First the BF16
baseline (``x @ w.T``), then ``triton`` W4A16 (``nvfp4_gemm`` on packed weights: the rollout's decode dispatch), then
both again (drift). Reported: median us per call, W4A16's speed-up over BF16 in the same pass, and the SM clock (MHz,
``torch.cuda.clock_rate``, read from NVML after every 10th step; median). On CPU (smoke runs, ``TRITON_INTERPRET=1``):
host wall time, no clock.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verl_quads import nvfp4 as nv
from verl_quads.bench.rollout import SHAPES, _bf16_matmul, model_graph_copies
from verl_quads.nvfp4 import triton_gemm as tg


def _clock(dev: torch.device) -> float | None:
    if dev.type != "cuda":
        return None
    try:
        return float(torch.cuda.clock_rate(dev))
    except Exception:  # no NVML: the clock column stays empty
        return None


def _steps(call, copies: int, steps: int, calls: int, gap_s: float, dev: torch.device) -> tuple[float, float | None]:
    """Median seconds per call over ``steps`` steps, and the median SM clock read during them."""
    per_call, clocks = [], []
    cuda = dev.type == "cuda"
    if cuda:  # one CUDA graph of the step's calls (as the engine replays its decode step): no host time per call
        call(0)  # compiles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for j in range(calls):
                call(j % copies)
    for s in range(steps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
        else:
            t = time.perf_counter()
            for j in range(calls):
                call(j % copies)
        if cuda:
            b.record()
            b.synchronize()
            per_call.append(a.elapsed_time(b) * 1e-3 / calls)
        else:
            per_call.append((time.perf_counter() - t) / calls)
        if s % 10 == 0:
            c = _clock(dev)
            if c is not None:
                clocks.append(c)
        if gap_s > 0:
            time.sleep(gap_s)
    return statistics.median(per_call), (statistics.median(clocks) if clocks else None)


def _operands(shape: str, dev: torch.device):
    """A random bf16 weight ``[N, K]`` of ``shape``, its NVFP4 form (tensor scale from its amax), that global scale
    as a 0-d tensor, and one bf16 activation row ``[1, K]`` (seeded: the same in every call)."""
    _, n, k = SHAPES[shape]
    g = torch.Generator(device=dev).manual_seed(0)
    w16 = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    q = nv.quantize(w16, nv.global_scale_from_amax(w16.abs().amax()), backend="triton")
    x = torch.randn(1, k, device=dev, generator=g).to(torch.bfloat16)
    return w16, q, q.global_scale.reshape(()), x


def measure(shape: str, gaps_ms: list[float], steps: int, calls: int, dev: torch.device) -> list[list]:
    """Rows ``[shape, pass, gap ms, bf16 us, bf16 MHz, w4a16 us, w4a16 MHz, x bf16]``."""
    w16, q, gs, x = _operands(shape, dev)
    cuda = dev.type == "cuda"  # weight copies per rotation: as many as bench rollout --model-graph walks (cold L2)
    c16 = model_graph_copies(w16.numel() * 2) if cuda else 1
    c4 = model_graph_copies(q.packed.numel() + q.block_scale.numel()) if cuda else 1
    w16s = [w16] + [w16.clone() for _ in range(c16 - 1)]
    w4s = [(q.packed, q.block_scale)] + [(q.packed.clone(), q.block_scale.clone()) for _ in range(c4 - 1)]
    want = nv.fake_quantize(w16, q.global_scale).float() @ x.float().t()
    op, _ = tg.quantize_activation(x, "w4a16")  # the rollout's W4A16 operand (x itself)
    got = tg.nvfp4_gemm(op, *w4s[0], gs).float().t()
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):  # the call timed is the W4A16 GEMM, not something else
        raise RuntimeError(f"duty probe {shape}: W4A16 output differs from the QDQ reference "
                           f"(max |diff| {(got - want).abs().max().item():.3e})")

    def bf16(i):
        return _bf16_matmul(x, w16s[i])

    def w4a16(i):
        return tg.nvfp4_gemm(op, w4s[i][0], w4s[i][1], gs)

    rows = []
    for p in (1, 2):
        for gap in gaps_ms:
            t16, mhz16 = _steps(bf16, c16, steps, calls, gap * 1e-3, dev)
            t4, mhz4 = _steps(w4a16, c4, steps, calls, gap * 1e-3, dev)
            rows.append([shape, p, gap, t16 * 1e6, mhz16, t4 * 1e6, mhz4, t16 / t4])
    return rows


def _host_us(fn, calls: int, dev: torch.device) -> float:
    """Wall us per call of ``calls`` back-to-back eager calls of ``fn`` (one call first: compiles, caches)."""
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def _stored_calls(x: torch.Tensor, weight: tuple, dev: torch.device, per_step: int = 64):
    """The ``trace`` linear method's eager call on activation ``x`` and ``weight`` (packed, block scales, global
    scale): the record's rows from :meth:`GuidanceStore.record_rows` in a step of one request (a fresh store; a step
    of ``per_step`` calls, then the next step of a new request, as the runner hook opens and ends steps; records are
    kept, as during a rollout), quantize with capture into them, then the GEMM."""
    from verl_quads.rollout.capture import GuidanceStore
    from verl_quads.rollout.trace_rows import GemmRows

    store = GuidanceStore()
    store.enabled = True
    pos = torch.zeros(1, dtype=torch.int64, device=dev)
    n = [0]

    def fn():
        if n[0] % per_step == 0:  # records are kept (as during a rollout): popped by nobody here
            store.end_step()
            store.begin_step([f"r{n[0]}"], [0, 1], pos)
        n[0] += 1
        out = store.record_rows(n[0] % per_step, "self_attn.o_proj", GemmRows(x.shape[1]), x.shape[0], x.device)
        a, _ = tg.quantize_activation(x, "trace", capture=True, record_out=out)
        return tg.nvfp4_gemm(a, *weight)

    return fn


def eager_host_time(shape: str, calls: int, dev: torch.device, act_mode: str = "w4a16", top: int = 15) -> None:
    """Host time of eager NVFP4 calls (``--eager N``; what a step pays per GEMM outside CUDA graphs, e.g. in
    eager engines): wall us per call of N back-to-back calls (the device waits for the host: host-bound at M = 1)
    of the whole call in ``act_mode`` (``trace``: with the guidance record's capture), of its parts
    (``quantize_activation`` alone, ``nvfp4_gemm`` on a ready operand) and of BF16 ``x @ w.T`` (baseline, same run);
    then the ``top`` functions by own and by cumulative time under cProfile (a second pass of N whole calls)."""
    import cProfile
    import pstats

    w16, q, gs, x = _operands(shape, dev)
    capture = act_mode == "trace"
    op, _ = tg.quantize_activation(x, act_mode, capture=capture)

    def call():
        a, _ = tg.quantize_activation(x, act_mode, capture=capture)
        return tg.nvfp4_gemm(a, q.packed, q.block_scale, gs)

    parts = {"whole call (quantize_activation + nvfp4_gemm)": call,
             "quantize_activation alone": lambda: tg.quantize_activation(x, act_mode, capture=capture),
             "nvfp4_gemm alone": lambda: tg.nvfp4_gemm(op, q.packed, q.block_scale, gs),
             "bf16 x @ w.T (baseline)": lambda: _bf16_matmul(x, w16)}
    if capture:
        name = "whole call into GuidanceStore.record_rows (the trace linear method)"
        parts[name] = _stored_calls(x, (q.packed, q.block_scale, gs), dev)
    for name, fn in parts.items():
        print(f"[eager] {shape} M=1 {act_mode} {name}: {_host_us(fn, calls, dev):.1f} us per call, {calls} calls",
              flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof).sort_stats(key).print_stats(top)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m verl_quads.bench.duty_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", default="qkv,o_proj,d8192", help=f"dense shapes of {sorted(SHAPES)}")
    p.add_argument("--gaps-ms", default="0,1", help="host sleep after each step, ms (comma-separated)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--calls", type=int, default=32, help="GEMMs per step (a 16-layer step has 32 attention linears)")
    p.add_argument("--eager", type=int, default=0, help="instead of the table: host time of N eager NVFP4 calls per "
                   "shape and --eager-modes mode, split into parts, and a cProfile of them")
    p.add_argument("--eager-modes", default="w4a16", help="activation modes of --eager (comma-separated; trace: with "
                   "the guidance capture)")
    args = p.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES or SHAPES[s][0]]
    if bad:
        p.error(f"--shapes: {bad} are not dense shapes; choose from {sorted(s for s, v in SHAPES.items() if not v[0])}")
    gaps = [float(v) for v in args.gaps_ms.split(",") if v]
    modes = [m for m in args.eager_modes.split(",") if m]
    if any(m not in tg.ACT_MODES for m in modes):
        p.error(f"--eager-modes: {modes}; allowed: {list(tg.ACT_MODES)}")
    if any(v < 0 for v in gaps) or args.steps < 1 or args.calls < 1:
        p.error("--gaps-ms must be >= 0, --steps and --calls >= 1")
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"duty probe: {name}, torch {torch.__version__}, M = 1, {args.steps} steps x {args.calls} calls per "
          f"(shape, gap, pass), median", flush=True)
    if args.eager:
        for mode in modes:
            for s in shapes:
                eager_host_time(s, args.eager, dev, mode)
        return
    rows = [r for s in shapes for r in measure(s, gaps, args.steps, args.calls, dev)]

    def mhz(v):
        return "-" if v is None else f"{v:.0f}"

    print("shape  | pass | gap ms | bf16 us/call | bf16 MHz | w4a16 us/call | w4a16 MHz | x bf16")
    print("------ | ---- | ------ | ------------ | -------- | ------------- | --------- | ------")
    for s, pa, gap, t16, m16, t4, m4, ratio in rows:
        print(f"{s:6s} | {pa:4d} | {gap:6.2f} | {t16:12.2f} | {mhz(m16):>8s} | {t4:13.2f} | {mhz(m4):>9s} | "
              f"{ratio:5.2f}x")


if __name__ == "__main__":
    main()
