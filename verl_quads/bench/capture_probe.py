"""Host time of the routing capture's per-step work and of popping the records, without vLLM.

``python -m verl_quads.bench.capture_probe [--device cuda] [--batch-sizes 1,16,64] [--layers 16] [--top-k 8]``

What the vLLM runner hook does around each forward (:mod:`verl_quads.rollout.capture`): ``begin_step`` with the
step's request ids, ``query_start_loc`` and device positions, then ``end_step``, which hands the layers' persistent
expert-id block to the :class:`~verl_quads.rollout.routing_log.RoutingLog`. Here a steady decode (every request one
row per step, the same requests every step) after one prefill step of ``--prompt-len`` rows per request, as in
``bench engine``; then every request popped (``pop_routings``, what a rollout's collection does).

Reported per batch size (host wall time, ``time.perf_counter``; the device work is enqueued, not waited for):
``hook us/step`` (begin_step + end_step of the decode steps), ``pop ms`` (all requests), and the baseline timed in the
same run: ``bare us/step``, the least a non-blocking capture must do per step -- one non-blocking copy of the step's
expert-id block and of its positions into pinned host memory plus one CUDA event record (on CPU: the two copies).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


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
        # baseline: the same bytes per step, two non-blocking copies into pinned memory and one event
        cuda = device.type == "cuda"
        block = torch.zeros((batch, layers, top_k), dtype=torch.int16, device=device)
        host_e = torch.empty((steps * batch, layers, top_k), dtype=torch.int16, pin_memory=cuda)
        host_p = torch.empty(steps * batch, dtype=torch.int64, pin_memory=cuda)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for s in range(steps):
            host_e[s * batch:(s + 1) * batch].copy_(block, non_blocking=cuda)
            host_p[s * batch:(s + 1) * batch].copy_(buf[:batch], non_blocking=cuda)
            if cuda:
                torch.cuda.Event().record()
        bare.append((time.perf_counter() - t) / steps)
        if cuda:
            torch.cuda.synchronize()
    return {"hook_us": statistics.median(hook) * 1e6, "pop_ms": statistics.median(pop) * 1e3,
            "bare_us": statistics.median(bare) * 1e6}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m verl_quads.bench.capture_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--steps", type=int, default=128, help="decode steps per generate")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if min(sizes) < 1 or min(args.layers, args.top_k, args.steps, args.prompt_len, args.repeats) < 1:
        raise SystemExit("--batch-sizes, --layers, --top-k, --steps, --prompt-len and --repeats must be positive")
    device = torch.device(args.device)
    from verl_quads.bench.timing import device_name

    lines = ["batch | hook us/step | bare us/step | hook / bare | pop ms (all requests)",
             "----- | ------------ | ------------ | ----------- | ---------------------"]
    for b in sizes:
        r = measure(b, args.layers, args.top_k, args.steps, args.prompt_len, device, args.repeats)
        lines.append(f"{b:5d} | {r['hook_us']:12.1f} | {r['bare_us']:12.1f} | {r['hook_us'] / r['bare_us']:10.2f}x | "
                     f"{r['pop_ms']:.2f}")
    print(f"routing capture probe: {device_name()}, device {device}, {args.layers} layers top-{args.top_k}, prefill "
          f"{args.prompt_len} rows per request + {args.steps} decode steps, median of {args.repeats}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
