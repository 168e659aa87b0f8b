"""Host time of the routing capture's (or TRACE's) per-step work and of popping the records, without vLLM.

``python -m verl_quads.bench.capture_probe [--device cuda] [--batch-sizes 1,16,64] [--layers 16] [--top-k 8]
[--what routing|trace]``

What the vLLM runner hook does around each forward (:mod:`verl_quads.rollout.capture`): ``begin_step`` with the
step's request ids, ``query_start_loc`` and device positions, then ``end_step``, which hands the layers' persistent
expert-id block to the :class:`~verl_quads.rollout.routing_log.RoutingLog`. Here a steady decode (every request one
row per step, the same requests every step) after one prefill step of ``--prompt-len`` rows per request, as in
``bench engine``; then every request popped (``pop_routings``, what a rollout's collection does).

Reported per batch size (host wall time, ``time.perf_counter``; the device work is enqueued, not waited for):
``hook us/step`` (begin_step + end_step of the decode steps), ``pop ms`` (all requests), and the baseline timed in the
same run: ``bare us/step``, the least a non-blocking capture must do per step -- one non-blocking copy of the step's
expert-id block and of its positions into pinned host memory plus one CUDA event record (on CPU: the two copies).

``--what trace``: TRACE's guidance store instead (``enabled``, no routing), every layer guided with the GEMMs of a
Qwen3-MoE decoder layer at the width options (``self_attn.qkv_proj`` K = hidden, ``self_attn.o_proj`` K = heads x
head_dim, ``mlp.experts.w13`` K = hidden, ``mlp.experts.w2`` K = moe-inter x top_k slots), registered as the layers do
and written once (a CUDA graph's capture: replays rewrite the buffer without Python), then the steps' hook and one
``pop`` per request (``into_bytes``, as verl's worker RPC pops), then ``wire ms``: the worker's RPC reply for all of them
(``to_plain`` of each request's ``to_wire``: the bytes vLLM's msgpack RPC sends). Baseline: the same, with the
step's record rows (one row of every GEMM per token) in place of the expert-id block.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verl_quads.bench.widths import add_qwen3_moe_width_args


def _steps(batch: int, prompt_len: int, steps: int, device: torch.device):
    """(req_ids, query_start_loc, positions) per step: one prefill step, then ``steps`` decode steps."""
    req_ids = [f"{i}-{i:08x}" for i in range(batch)]
    qsl = [i * prompt_len for i in range(batch + 1)]
    pos = torch.arange(prompt_len, device=device).repeat(batch)
    out = [(req_ids, qsl, pos)]
    dec_qsl = list(range(batch + 1))
    buf = torch.empty(max(batch * prompt_len, batch), dtype=torch.int64, device=device)  # persistent, as vLLM's
    for s in range(steps):
        out.append((req_ids, dec_qsl, torch.full((batch,), prompt_len + s, dtype=torch.int64, device=device)))
    return out, buf


def _bare_step_s(block: torch.Tensor, positions: torch.Tensor, steps: int) -> float:
    """Baseline, host seconds per step: the least a non-blocking capture does with a decode step's ``block`` (its
    rows of the capture buffer, leading dim = batch) and positions -- two non-blocking copies into pinned memory and
    one CUDA event (on CPU: the two copies)."""
    cuda, batch = block.is_cuda, block.shape[0]
    host_b = torch.empty((steps * batch, *block.shape[1:]), dtype=block.dtype, pin_memory=cuda)
    host_p = torch.empty(steps * batch, dtype=torch.int64, pin_memory=cuda)
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for s in range(steps):
        host_b[s * batch:(s + 1) * batch].copy_(block, non_blocking=cuda)
        host_p[s * batch:(s + 1) * batch].copy_(positions[:batch], non_blocking=cuda)
        if cuda:
            torch.cuda.Event().record()
    spent = (time.perf_counter() - t) / steps
    if cuda:
        torch.cuda.synchronize()
    return spent


def measure(batch: int, layers: int, top_k: int, steps: int, prompt_len: int, device: torch.device,
            repeats: int) -> dict[str, float]:
    """Median over ``repeats`` of one generate's capture: hook us/step, pop ms, bare us/step."""
    from verl_quads.rollout.capture import GuidanceStore

    hook, pop, bare = [], [], []
    rows = batch * prompt_len
    for _ in range(repeats):
        store = GuidanceStore()
        store.routing = True
        for layer in range(layers):
            store.register_routing_layer(layer)
        for layer in range(layers):  # every layer's buffer: a column of one [rows, L, top_k] block
            store.routing_buffer(layer, rows, top_k, device).random_(0, 128)
        plan, buf = _steps(batch, prompt_len, steps, device)
        spent = 0.0  # the decode steps' begin_step + end_step (the prefill step and the runner's own work not timed)
        for i, (req_ids, qsl, positions) in enumerate(plan):
            n = qsl[-1]
            buf[:n].copy_(positions)  # the runner's input preparation
            t = time.perf_counter()
            store.begin_step(list(req_ids), list(qsl), buf[:n])  # fresh lists per step, as the runner hook makes
            store.end_step()
            if i > 0:
                spent += time.perf_counter() - t
        hook.append(spent / steps)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        got = store.pop_routings(None)
        pop.append(time.perf_counter() - t)
        if len(got) != batch or any(r.positions.numel() != prompt_len + steps for r in got.values()):
            raise RuntimeError(f"capture probe: popped {len(got)} records of "
                               f"{sorted({r.positions.numel() for r in got.values()})} rows, expected {batch} of "
                               f"{prompt_len + steps}")
        bare.append(_bare_step_s(torch.zeros((batch, layers, top_k), dtype=torch.int16, device=device), buf, steps))
    return {"hook_us": statistics.median(hook) * 1e6, "pop_ms": statistics.median(pop) * 1e3,
            "bare_us": statistics.median(bare) * 1e6}


def _trace_gemms(a) -> list[tuple[str, int, int | None]]:
    """(GEMM name, K, slots) of one guided Qwen3-MoE decoder layer at the width options ``a``."""
    return [("self_attn.qkv_proj", a.hidden, None), ("self_attn.o_proj", a.heads * a.head_dim, None),
            ("mlp.experts.w13", a.hidden, None), ("mlp.experts.w2", a.moe_inter, a.top_k)]


def measure_trace(batch: int, layers: int, gemms: list[tuple[str, int, int | None]], steps: int, prompt_len: int,
                  device: torch.device, repeats: int) -> dict[str, float]:
    """Median over ``repeats`` of one generate's TRACE capture: hook us/step, pop ms (one pop per request), wire ms
    (the popped requests' RPC reply: ``to_plain`` of their ``to_wire``), bare us/step (module docstring)."""
    from verl_quads.nvfp4 import GuidanceRecord
    from verl_quads.patches.verl_rollout_guidance import to_plain
    from verl_quads.rollout.capture import GuidanceStore

    hook, pop, bare, wire = [], [], [], []
    rows = batch * prompt_len
    for _ in range(repeats):
        store = GuidanceStore()
        store.enabled = True
        store._rows = rows  # max_num_batched_tokens of this generate's engine
        store.active_trace_keys = [(layer, g[0]) for layer in range(layers) for g in gemms]  # the runner hook's
        for layer in range(layers):
            for name, k, slots in gemms:
                store.register_trace_gemm(layer, name, k=k, slots=slots)
        for layer in range(layers):  # the capture: every GEMM writes once, then only the "replays" write
            for name, k, slots in gemms:
                lead = (rows,) if slots is None else (rows, slots)
                rec = GuidanceRecord(torch.randint(0, 256, (*lead, k // 8), dtype=torch.uint8, device=device),
                                     torch.randint(0, 256, (*lead, k // 16), dtype=torch.uint8,
                                                   device=device).view(torch.float8_e4m3fn),
                                     torch.rand((*lead, 1), device=device), torch.Size((*lead, k)))
                ids = None if slots is None else torch.randint(0, 128, lead, device=device)
                store.add(layer, name, rec, expert_ids=ids)
        plan, buf = _steps(batch, prompt_len, steps, device)
        spent = 0.0
        for i, (req_ids, qsl, positions) in enumerate(plan):
            n = qsl[-1]
            buf[:n].copy_(positions)
            t = time.perf_counter()
            store.begin_step(list(req_ids), list(qsl), buf[:n])
            store.end_step()
            if i > 0:
                spent += time.perf_counter() - t
        hook.append(spent / steps)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        got = [store.pop(r, into_bytes=True) for r in plan[0][0]]  # as verl's worker RPC pops them
        pop.append(time.perf_counter() - t)
        want = layers * len(gemms)
        if any(g is None or g.positions.numel() != prompt_len + steps or len(g.records) != want for g in got):
            seen = [None if g is None else (g.positions.numel(), len(g.records)) for g in got]
            raise RuntimeError(f"capture probe: popped (rows, records) {seen[:4]}..., expected {batch} requests of "
                               f"{prompt_len + steps} rows and {want} records")
        t = time.perf_counter()
        to_plain({g.request_id: g.to_wire() for g in got})
        wire.append(time.perf_counter() - t)
        bare.append(_bare_step_s(store._trace_rows[:batch], buf, steps))
    return {"hook_us": statistics.median(hook) * 1e6, "pop_ms": statistics.median(pop) * 1e3,
            "bare_us": statistics.median(bare) * 1e6, "wire_ms": statistics.median(wire) * 1e3}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m verl_quads.bench.capture_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--what", choices=("routing", "trace"), default="routing")
    add_qwen3_moe_width_args(p)
    p.add_argument("--steps", type=int, default=128, help="decode steps per generate")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if min(sizes) < 1 or min(args.layers, args.top_k, args.steps, args.prompt_len, args.repeats) < 1:
        raise SystemExit("--batch-sizes, --layers, --top-k, --steps, --prompt-len and --repeats must be positive")
    device = torch.device(args.device)
    from verl_quads.bench.timing import device_name

    gemms = _trace_gemms(args)

    lines = ["batch | hook us/step | bare us/step | hook / bare | pop ms (all requests)",
             "----- | ------------ | ------------ | ----------- | ---------------------"]
    if args.what == "trace":
        lines = [lines[0] + " | wire ms (all requests)", lines[1] + " | ----------------------"]
    for b in sizes:
        r = (measure(b, args.layers, args.top_k, args.steps, args.prompt_len, device, args.repeats)
             if args.what == "routing" else
             measure_trace(b, args.layers, gemms, args.steps, args.prompt_len, device, args.repeats))
        lines.append(f"{b:5d} | {r['hook_us']:12.1f} | {r['bare_us']:12.1f} | {r['hook_us'] / r['bare_us']:10.2f}x | "
                     f"{r['pop_ms']:.2f}" + (f" | {r['wire_ms']:.2f}" if "wire_ms" in r else ""))
    what = "routing" if args.what == "routing" else f"TRACE ({len(gemms)} guided GEMMs per layer: {gemms})"
    print(f"{what} capture probe: {device_name()}, device {device}, {args.layers} layers top-{args.top_k}, prefill "
          f"{args.prompt_len} rows per request + {args.steps} decode steps, median of {args.repeats}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
