"""``verl-quads bench qat`` (or ``python -m verl_quads.bench.qat``): QAT overhead of one MoE decoder layer.

One transformers ``Qwen3MoeDecoderLayer`` at Qwen3-30B-A3B width by default (hidden 2048, 32 query /
4 KV heads of 128, 128 experts, top-8, expert intermediate 768), bf16 weights (what the layer sees
under FSDP2 mixed precision), 4096 tokens of one sequence, forward + backward (gradients w.r.t. the
input and every weight). Timed in one run, same process, same input, for:

- ``bf16``: the stock layer;
- ``w4a16`` (QUADS trainer): NVFP4 QDQ (STE) of every linear and expert weight;
- ``w4a4_qat``: + per-token NVFP4 QDQ of every GEMM input;
- ``trace``: the layer guided (``guided_layers=1``) with guidance records made beforehand from the
  layer's own activations (the rollout would supply them; the cost of applying them is the same),
  the TraceBatch set on the QAT state as the verl engine sets it per micro-batch; the deferred checks
  (routing equal to the records', finite weights: one host sync) run once after the mode's timings,
  as the engine runs them once per micro-batch. Router replay is not installed (the layer's own
  routing is the recorded one).

Reported: median ms per forward+backward (CUDA events; ``median_time_s``) and the ratio to ``bf16``.
Goals (issue 4): ``w4a16`` <= 1.10, ``trace`` <= 1.20. Runs on CPU too with small ``--tokens``
(smoke test), where the numbers mean little.

Breakdown per mode (``--no-breakdown`` skips it):

- ``wQDQ ms``: the weight fake quantization of the layer alone (every quantized module's QDQ weight,
  global-scale amax included, no autograd), median like the main timing;
- on CUDA, one forward+backward under ``torch.profiler``: device time summed per kernel class
  (``gemm``: cuBLAS/CUTLASS/grouped GEMMs; ``nvfp4``: the core's Triton quantize/QDQ/guided kernels,
  weights and activations together; ``reduce``: reductions such as amax and the slot sum;
  ``attn``: attention kernels; ``other``: elementwise, copies, gathers/scatters, sort). The
  profiled step is slower than the timed ones; use the classes' shares, not their sum.

Host-side facts per mode (same flag; they tell whether a mode is launch- or sync-bound):

- ``host ms``: CPU wall time to enqueue one forward+backward (``perf_counter`` around ``step()``
  after a device sync, no sync at its end: if the host must wait for the device inside the step,
  that wait is included), median over ``--iters``; ``wQDQ host ms`` the same for the weight QDQ alone;
- on any device, from one step under :class:`OpCounter`: ``aten ops`` (aten ops that reach the device,
  backward included, views not counted) and ``triton`` (Triton kernel launches); their sum is the launch
  count of the step on CUDA up to ops whose CUDA and CPU kernels differ in number (CPU: run with
  ``--backend triton`` under ``TRITON_INTERPRET=1`` to count the CUDA path's Triton launches);
- on CUDA, from one ``torch.profiler`` step (CPU + CUDA activities): ``launches`` (CUDA runtime/driver
  kernel-launch calls), ``kernels`` (kernels that ran), ``busy ms`` (sum of kernel durations: the
  device time; ``ms`` minus it is time the device idled), ``syncs`` (``cudaStreamSynchronize``,
  ``cudaEventSynchronize``, ``cudaDeviceSynchronize`` and blocking ``cudaMemcpy`` calls inside the
  step) and ``sync ops``: aten ops that force a host sync, seen by
  :class:`verl_quads.qat.host_sync.HostSyncRecorder` in one more step (their source lines are printed).
  If ``host ms`` is close to ``ms`` while ``busy ms`` is well below it, the mode is launch-bound.
- ``launch overhead``: host microseconds per call of a torch op, of the weight path's global-scale ops
  and of one NVFP4 QDQ call, on a tiny tensor (what a launch costs on this host).

``--fsdp``: the layer under FSDP2 instead (``fully_shard`` on the decoder layer and on a root module, fp32
master weights, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` as verl sets it, so every
forward AND backward all-gathers), on a process group of ONE rank made here (NCCL on CUDA, gloo on CPU;
a file store in a temporary directory; destroyed at the end). Each mode runs with every ``--weight-qdq``
(``per_forward``: QDQ of the unsharded weight in every forward; ``per_version``: verl_quads/qat/fsdp_qdq.py,
QDQ of the shard once per weight version, before the all-gather). One timed unit = one weight version:
the version counter of every master parameter is bumped (``torch.autograd.graph.increment_version``: no
device work, the same in every row, standing in for ``optimizer.step``, whose own cost is not timed), then
``G`` forward+backward micro-batches (``--micro-batches``, several values allowed). Reported per micro-batch
(unit time / G) and as a ratio to the FSDP-wrapped BF16 layer at the same G: ``per_version`` pays its
refresh (amax + QDQ of the shard, on one rank: no all-reduce) once per unit, so its ratio at G > 1 is the
refresh amortized over G micro-batches, stated as such in the output. Before timing, ``per_version`` is
checked against ``per_forward`` on the device (output and input gradient, ``torch.equal``, printed).
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from verl_quads.bench.timing import device_name, median_time_s, print_table
from verl_quads.config import QuantConfig

MODES = ("bf16", "w4a16", "w4a4_qat", "trace")
_QUANT_OF = {"w4a16": "quads", "w4a4_qat": "w4a4_qat", "trace": "trace"}


def build_layer(a: argparse.Namespace, device: str, dtype: torch.dtype):
    """A one-layer container ``model.layers[0]`` (so QAT finds layer 0) + rotary embedding."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding

    cfg = Qwen3MoeConfig(
        vocab_size=1024, hidden_size=a.hidden, num_hidden_layers=1, num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads, head_dim=a.head_dim, moe_intermediate_size=a.moe_inter,
        intermediate_size=4 * a.moe_inter, num_experts=a.experts, num_experts_per_tok=a.top_k,
        decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=max(a.tokens, 4096),
    )
    cfg._attn_implementation = a.attn
    # A standalone layer has no PreTrainedModel to pick the experts implementation: set it here.
    cfg._experts_implementation = a.experts_impl
    torch.manual_seed(0)
    root = nn.Module()
    root.config = cfg
    root.layers = nn.ModuleList([Qwen3MoeDecoderLayer(cfg, 0)])
    with torch.no_grad():
        for p in root.parameters():
            p.copy_(torch.randn_like(p) * 0.02 + (1.0 if p.dim() == 1 else 0.0))
    root = root.to(device=device, dtype=dtype)
    rope = Qwen3MoeRotaryEmbedding(cfg).to(device)
    return root, rope, cfg


def run(a: argparse.Namespace) -> str:
    from verl_quads.qat import InMemoryGuidanceStore, TraceBatch, apply_qat, trace_context

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    base, rope, cfg = build_layer(a, device, dtype)
    g = torch.Generator(device=device).manual_seed(1)
    x0 = torch.randn(1, a.tokens, a.hidden, device=device, dtype=dtype, generator=g)
    pos = torch.arange(a.tokens, device=device).unsqueeze(0)
    pe = rope(x0, pos)
    dy = torch.randn(1, a.tokens, a.hidden, device=device, dtype=dtype, generator=g) * 1e-2
    lines = [f"device: {device_name()}",
             f"layer: hidden {a.hidden}, heads {a.heads}/{a.kv_heads}x{a.head_dim}, experts {a.experts} top-{a.top_k}, "
             f"expert inter {a.moe_inter}, tokens {a.tokens}, attention {cfg._attn_implementation}, "
             f"experts impl {cfg._experts_implementation}, NVFP4 backend {a.backend}"]
    print("\n".join(lines), flush=True)

    rows, brows, hrows, t_bf16 = [], [], [], None
    for mode in a.modes:
        layer_root = copy.deepcopy(base)
        ctx = state = None
        if mode != "bf16":
            qc = QuantConfig(quant=_QUANT_OF[mode], guided_layers=1, backend=a.backend)
            state = apply_qat(layer_root, qc)
        layer = layer_root.layers[0]
        if mode == "trace":
            store = InMemoryGuidanceStore()
            tb = TraceBatch.padded(store, 0, ["seq0"], torch.ones(1, a.tokens, dtype=torch.long))
            tb.record_into = store
            with torch.no_grad(), trace_context(layer_root, tb):
                layer(x0, attention_mask=None, position_embeddings=pe)
            ctx = TraceBatch.padded(store, 0, ["seq0"], torch.ones(1, a.tokens, dtype=torch.long))

        x = x0.detach().clone().requires_grad_(True)

        def step():
            for p in layer.parameters():
                p.grad = None
            x.grad = None
            if ctx is not None:
                # what verl-quads' verl engine does per micro-batch: the TraceBatch is set on the QAT state;
                # its deferred checks (routing, finite weights; one sync) run once per micro-batch, here
                # once after all timings of the mode (below), not inside every timed step
                state.trace = ctx
                try:
                    y = layer(x, attention_mask=None, position_embeddings=pe)
                    y.backward(dy)
                finally:
                    state.trace = None
            else:
                y = layer(x, attention_mask=None, position_embeddings=pe)
                y.backward(dy)

        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = median_time_s(step, warmup=a.warmup, iters=a.iters, inner=1)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        if mode == "bf16":
            t_bf16 = t
        rows.append([mode, t * 1e3, (t / t_bf16) if t_bf16 else float("nan"), peak])
        print(f"{mode}: {t * 1e3:.2f} ms", flush=True)
        if a.breakdown:
            wq = weight_qdq_time_s(layer_root, a) if mode != "bf16" else 0.0
            classes = kernel_classes_ms(step) if device == "cuda" else {}
            brows.append([mode, wq * 1e3] + [classes.get(c, float("nan")) for c in KERNEL_CLASSES])
            print(f"{mode}: weight QDQ {wq * 1e3:.2f} ms; kernels {classes or 'profiled on CUDA only'}", flush=True)
            hf = host_facts(step, a.iters)
            wq_host = host_ms(_weight_qdq_fn(layer_root), a.iters) if mode != "bf16" else 0.0
            hrows.append([mode, t * 1e3, hf["host ms"], wq_host] + [hf.get(c, float("nan")) for c in HOST_FACTS[1:]])
            print(f"{mode}: host {({k: v for k, v in hf.items() if k != 'sync sites'})}; weight QDQ host "
                  f"{wq_host:.2f} ms", flush=True)
            if hf.get("sync sites"):
                print(f"{mode}: host sync sites:\n{hf['sync sites']}", flush=True)
        if ctx is not None:
            ctx.verify()  # the deferred checks of every step above: raises if the routing ever differed
        if state is not None:
            state.verify()
        del layer_root, layer
    table = print_table("one MoE decoder layer, forward+backward", ["mode", "ms", "x bf16", "peak GiB"], rows)
    out = lines + [table]
    if a.breakdown:
        out.append(print_table(
            "breakdown: weight QDQ alone; device ms per kernel class in one profiled forward+backward (CUDA)",
            ["mode", "wQDQ ms"] + [f"{c} ms" for c in KERNEL_CLASSES], brows))
        lo = launch_overhead_us(device, a.backend)
        print(f"launch overhead (host us per call, tiny tensor, no sync): {lo}", flush=True)
        out.append(f"launch overhead (host us per call, tiny tensor, no sync): {lo}")
        out.append(print_table(
            "host side: event ms vs host enqueue ms (fwd+bwd; weight QDQ alone); per fwd+bwd: aten ops + triton "
            "launches (OpCounter, any device); profiled (CUDA): launches, kernels, device busy ms, sync calls, "
            "sync ops (HostSyncRecorder)",
            ["mode", "ms", "host ms", "wQDQ host ms"] + list(HOST_FACTS[1:]), hrows))
    return "\n".join(out)


#: Kernel classes of the profile breakdown, matched on lower-case kernel names in this order.
KERNEL_CLASSES = ("gemm", "nvfp4", "reduce", "attn", "other")
_CLASS_PATTERNS = (
    ("nvfp4", ("_quant_kernel", "_guided_kernel", "_dequant_kernel", "_residual")),
    ("gemm", ("gemm", "cutlass", "nvjet", "cublas", "sm90_xmma", "grouped_mm", "_mm_")),
    ("attn", ("flash", "fmha", "attention", "efficient_attention")),
    ("reduce", ("reduce",)),
)


def _kernel_class(name: str) -> str:
    n = name.lower()
    for cls, pats in _CLASS_PATTERNS:
        if any(p in n for p in pats):
            return cls
    return "other"


def _weight_qdq_fn(layer_root: nn.Module):
    """A callable computing every quantized module's QDQ weight once (what one forward does)."""
    from verl_quads.qat.model import _QATExperts, _QATLinear

    mods = [m for m in layer_root.modules() if isinstance(m, (_QATLinear, _QATExperts))]

    def qdq():
        with torch.no_grad():
            for m in mods:
                m._qat_weight() if isinstance(m, _QATLinear) else m._qdq_weights()

    return qdq


def weight_qdq_time_s(layer_root: nn.Module, a: argparse.Namespace) -> float:
    """Median seconds of computing every quantized module's QDQ weight once (what one forward does)."""
    return median_time_s(_weight_qdq_fn(layer_root), warmup=a.warmup, iters=a.iters, inner=1)


#: Columns of the host-side table (after mode, ms, host ms, wQDQ host ms).
HOST_FACTS = ("host ms", "aten ops", "triton", "launches", "kernels", "busy ms", "syncs", "sync ops")
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def host_ms(fn, iters: int) -> float:
    """Median CPU wall ms to enqueue ``fn()`` (device synced before each call, not after)."""
    import statistics
    import time

    fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return statistics.median(times)


def _is_launch_call(name: str) -> bool:
    return name.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cudaGraphLaunch"))


def host_facts(step, iters: int) -> dict:
    """``host ms`` always; on CUDA also launches / kernels / busy ms / syncs of one profiled ``step()``
    and ``sync ops`` (+ ``sync sites``, their source lines) from :class:`HostSyncRecorder`. A failure of
    the CUDA part is printed and kept in the result (``error``), not raised, so the timing table of the
    run survives; its columns are then nan."""
    out: dict = {"host ms": host_ms(step, iters)}
    c = count_step(step)  # any device: aten ops reaching the device + Triton launches (OpCounter)
    out.update({"aten ops": c.totals()["aten ops"], "triton": c.totals()["triton"]})
    if not torch.cuda.is_available():
        return out
    try:
        from torch.profiler import ProfilerActivity, profile

        from verl_quads.qat.host_sync import HostSyncRecorder

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
        torch.cuda.synchronize()
        launches = kernels = syncs = 0
        busy_us = 0.0
        for e in prof.events():
            name = e.name
            if _is_device_event(e):
                if not name.startswith(("Memcpy", "Memset")):
                    kernels += 1
                    busy_us += float(getattr(e, "device_time_total", 0.0) or 0.0)  # a device event: its duration
            elif _is_launch_call(name):
                launches += 1
            elif name in _SYNC_CALLS:
                syncs += 1
        out.update({"launches": launches, "kernels": kernels, "busy ms": busy_us / 1e3, "syncs": syncs})
        with HostSyncRecorder() as rec:
            step()
        torch.cuda.synchronize()
        out["sync ops"] = len(rec)
        if len(rec):
            out["sync sites"] = rec.summary()
    except Exception as e:  # noqa: BLE001 - reported, see docstring
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"host_facts: CUDA part FAILED: {out['error']}", flush=True)
    return out


#: aten ops that only make a view or change metadata (no kernel on any device).
_VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "alias", "detach", "t", "transpose", "permute", "expand", "as_strided",
    "slice", "select", "unsqueeze", "squeeze", "unflatten", "flatten", "split", "split_with_sizes", "chunk",
    "unbind", "view_as", "expand_as", "narrow", "_reshape_alias", "lift_fresh", "empty", "empty_like",
    "empty_strided", "_to_copy_noop", "set_", "resolve_conj", "resolve_neg", "diagonal", "movedim", "numpy_T",
})


class OpCounter:
    """Counts, while active, the aten ops that reach the device (``TorchDispatchMode``: after autograd,
    so backward ops are included; views, ``empty*`` and other metadata-only ops counted apart as ``views``)
    and the Triton kernel launches (``kernel[grid](...)``: ``JITFunction.run``; under TRITON_INTERPRET,
    ``InterpretedFunction.run``). On CPU this is the launch count a CUDA run of the same step would
    have, up to ops whose CUDA and CPU kernels differ in number (e.g. a composite CPU fallback).

    ``ops``: per aten op name, the count; ``triton``: per kernel name, the count."""

    def __init__(self):
        from collections import Counter

        self.ops: Counter = Counter()
        self.views: Counter = Counter()
        self.triton: Counter = Counter()
        self._in_triton = 0

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not counter._in_triton:  # the interpreter's own copies of kernel arguments are not counted
                    name = func.overloadpacket.__name__
                    (counter.views if name in _VIEW_OPS else counter.ops)[name] += 1
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._patched = []
        try:
            from triton.runtime import interpreter, jit

            classes = [jit.JITFunction, interpreter.InterpretedFunction]
        except Exception:  # noqa: BLE001 - no triton: nothing to count
            classes = []
        for cls in classes:
            orig = cls.__dict__.get("run")
            if orig is None:
                continue

            def run(fn_self, *args, __orig=orig, **kwargs):
                counter.triton[getattr(fn_self, "__name__", None) or getattr(getattr(fn_self, "fn", None), "__name__", "?")] += 1
                counter._in_triton += 1
                try:
                    return __orig(fn_self, *args, **kwargs)
                finally:
                    counter._in_triton -= 1

            cls.run = run
            self._patched.append((cls, orig))
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for cls, orig in self._patched:
            cls.run = orig
        return False

    def totals(self) -> dict[str, int]:
        return {"aten ops": sum(self.ops.values()), "triton": sum(self.triton.values()),
                "launch-like": sum(self.ops.values()) + sum(self.triton.values()), "views": sum(self.views.values())}


def count_step(step) -> OpCounter:
    """One ``step()`` under :class:`OpCounter` (after one uncounted warm-up step)."""
    step()
    with OpCounter() as c:
        step()
    return c


def launch_overhead_us(device: str, backend: str, n: int = 200) -> dict[str, float]:
    """Host microseconds per call on a tiny bf16 tensor (device time negligible, no sync inside the loop):
    ``torch add`` (one aten kernel), ``amax->global scale`` (the weight path's global-scale ops), ``nvfp4
    fake_quantize`` (the core's QDQ call incl. its checks and, on CUDA, one Triton launch), and the QAT hot
    path's QDQ calls with ``amax=`` (a weight's amax; "row"). Tells what the launches counted above cost on
    this host."""
    import time

    from verl_quads.nvfp4 import fake_quantize, global_scale_from_amax
    from verl_quads.qat.weights import abs_max

    x = torch.randn(16, 64, device=device, dtype=torch.bfloat16)
    gs = torch.ones((), device=device)
    am = abs_max(x)
    fns = {"torch add": lambda: x + 1,
           "amax->global scale": lambda: global_scale_from_amax(abs_max(x).to(torch.float32)),
           "nvfp4 fake_quantize": lambda: fake_quantize(x, gs, backend=backend, check_finite=False),
           # the QAT hot path: the global scale derived in the QDQ kernel from a weight amax / each row's own
           "fake_quantize amax=": lambda: fake_quantize(x, amax=am, backend=backend, check_finite=False),
           "fake_quantize amax=row": lambda: fake_quantize(x, amax="row", backend=backend, check_finite=False)}
    out = {}
    for name, fn in fns.items():
        for _ in range(10):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = round((time.perf_counter() - t0) / n * 1e6, 1)
        if device == "cuda":
            torch.cuda.synchronize()
    return out


def _is_device_event(e) -> bool:
    """A profiler event that ran on the GPU (kernel, memcpy, memset)."""
    dt = getattr(e, "device_type", None)
    return dt is not None and str(dt).endswith("CUDA")


def kernel_classes_ms(step) -> dict[str, float]:
    """Device ms per kernel class over one ``step()`` profiled with torch.profiler (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    out = dict.fromkeys(KERNEL_CLASSES, 0.0)
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us:
            out[_kernel_class(e.key)] += us / 1e3
    return out


class _Root(nn.Module):
    """The FSDP root of the ``--fsdp`` bench: ``layers[0]`` under a module with a forward (FSDP2's and
    verl-quads' root pre-forward hooks run on it)."""

    def __init__(self, config, layers: nn.ModuleList):
        super().__init__()
        self.config = config
        self.layers = layers

    def forward(self, x, position_embeddings):
        return self.layers[0](x, attention_mask=None, position_embeddings=position_embeddings)


def _one_rank_group(device: str):
    """Initialise a 1-rank process group (file store in a temp dir) unless one exists. Returns a cleanup."""
    import os
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("verl-quads bench qat --fsdp: runs on one rank; a larger process group is initialised")
        return lambda: None
    tmp = tempfile.mkdtemp(prefix="vq_bench_qat_")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{os.path.join(tmp, 'store')}",
                            rank=0, world_size=1)

    def cleanup():
        dist.destroy_process_group()

    return cleanup


def run_fsdp(a: argparse.Namespace) -> str:
    """The ``--fsdp`` variant (see the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from verl_quads.qat import InMemoryGuidanceStore, TraceBatch, apply_qat, fsdp_qdq, trace_context

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cleanup = _one_rank_group(device)
    try:
        mesh = init_device_mesh(device, (1,))
        base, rope, cfg = build_layer(a, device, torch.float32)  # fp32 master weights, as verl keeps them
        g = torch.Generator(device=device).manual_seed(1)
        x0 = torch.randn(1, a.tokens, a.hidden, device=device, dtype=torch.bfloat16, generator=g)
        pos = torch.arange(a.tokens, device=device).unsqueeze(0)
        pe = tuple(t.to(torch.bfloat16) for t in rope(x0, pos))
        dy = torch.randn(1, a.tokens, a.hidden, device=device, dtype=torch.bfloat16, generator=g) * 1e-2
        lines = [f"device: {device_name()}",
                 f"layer: hidden {a.hidden}, heads {a.heads}/{a.kv_heads}x{a.head_dim}, experts {a.experts} "
                 f"top-{a.top_k}, expert inter {a.moe_inter}, tokens {a.tokens} per micro-batch, attention "
                 f"{cfg._attn_implementation}, experts impl {cfg._experts_implementation}, NVFP4 backend {a.backend}",
                 "FSDP2 (fully_shard on the layer and a root; fp32 master, bf16 param_dtype, fp32 reduce_dtype) on a "
                 "process group of 1 rank: every forward and backward all-gathers (a copy on one rank; no all-reduce "
                 "in the per_version refresh)",
                 "one timed unit = one weight version (version bump standing in for optimizer.step, not timed) + G "
                 "forward+backward micro-batches; ms = unit time / G; per_version's refresh (amax + shard QDQ) is "
                 "paid once per unit, i.e. amortized over G micro-batches"]
        print("\n".join(lines), flush=True)

        def make(mode: str, weight_qdq: str):
            root = _Root(cfg, copy.deepcopy(base.layers))
            state = None
            if mode != "bf16":
                qc = QuantConfig(quant=_QUANT_OF[mode], guided_layers=1, backend=a.backend, weight_qdq=weight_qdq)
                state = apply_qat(root, qc)
            mpp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            fully_shard(root.layers[0], mesh=mesh, mp_policy=mpp)
            fully_shard(root, mesh=mesh, mp_policy=mpp)
            if mode != "bf16" and weight_qdq == "per_version":
                fsdp_qdq.install(root)
            ctx = None
            if mode == "trace":
                store = InMemoryGuidanceStore()
                tb = TraceBatch.padded(store, 0, ["seq0"], torch.ones(1, a.tokens, dtype=torch.long))
                tb.record_into = store
                with torch.no_grad(), trace_context(root, tb):
                    root(x0, pe)
                ctx = TraceBatch.padded(store, 0, ["seq0"], torch.ones(1, a.tokens, dtype=torch.long))
            return root, state, ctx

        def fwd_bwd(root, state, ctx, x):
            if ctx is not None:
                state.trace = ctx
            try:
                y = root(x, pe)
                y.backward(dy)
            finally:
                if ctx is not None:
                    state.trace = None
            return y

        # per_version == per_forward on this device (the FSDP patch and the shard QDQ, bit for bit)
        def check(mode: str) -> str:
            outs = {}
            for wq in ("per_forward", "per_version"):
                root, state, ctx = make(mode, wq)
                x = x0.detach().clone().requires_grad_(True)
                y = fwd_bwd(root, state, ctx, x)
                outs[wq] = [y.detach(), x.grad.detach()] + [p.grad.to_local() for p in root.parameters()]
                del root, state, ctx
            same = len(outs["per_forward"]) == len(outs["per_version"]) and all(
                torch.equal(u, v) for u, v in zip(outs["per_forward"], outs["per_version"]))
            return (f"{mode}: per_version output, input gradient and {len(outs['per_version']) - 2} weight "
                    f"gradients bit-identical to per_forward: {same}")

        def time_variant(mode: str, wq: str) -> list[list]:
            out = []
            root, state, ctx = make(mode, "per_forward" if wq == "-" else wq)
            params = list(root.parameters())
            x = x0.detach().clone().requires_grad_(True)
            qdq = fsdp_qdq.installed(root) if state is not None else None
            for n_micro in a.micro_batches:
                def unit(n_micro=n_micro):
                    for p in params:
                        torch.autograd.graph.increment_version(p)  # a new weight version, no device work
                        p.grad = None
                    for _ in range(n_micro):
                        x.grad = None
                        fwd_bwd(root, state, ctx, x)

                r0 = qdq.refreshes if qdq is not None else 0
                t = median_time_s(unit, warmup=a.warmup, iters=a.iters, inner=1) / n_micro
                refreshes = (qdq.refreshes - r0) if qdq is not None else 0
                if mode == "bf16":
                    base_ms[n_micro] = t
                peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
                out.append([mode, wq, n_micro, t * 1e3, t / base_ms.get(n_micro, float("nan")), refreshes, peak])
                print(f"{mode} {wq} G={n_micro}: {t * 1e3:.2f} ms per micro-batch ({refreshes} refreshes)", flush=True)
            if ctx is not None:
                ctx.verify()
            if state is not None:
                state.verify()
            return out

        def failed(what: str, e: Exception) -> str:
            import traceback

            traceback.print_exc()
            return f"{what}: FAILED {type(e).__name__}: {e}"

        checks = []
        if set(a.weight_qdq) == {"per_forward", "per_version"}:
            for mode in [m for m in a.modes if m != "bf16"]:
                try:
                    checks.append(check(mode))
                except Exception as e:  # noqa: BLE001 - reported in the output; the other rows still run
                    checks.append(failed(f"{mode}: per_version vs per_forward check", e))
                print(checks[-1], flush=True)

        rows = []
        base_ms: dict[int, float] = {}
        variants = [("bf16", "-")] + [(m, wq) for m in a.modes if m != "bf16" for wq in a.weight_qdq]
        for mode, wq in variants:
            try:
                rows += time_variant(mode, wq)
            except Exception as e:  # noqa: BLE001 - reported as a row; the other variants still run
                checks.append(failed(f"{mode} {wq}", e))
                rows.append([mode, wq, "-", float("nan"), float("nan"), "FAILED", float("nan")])
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        table = print_table(
            "one MoE decoder layer under FSDP2 (1 rank), per micro-batch (unit of G micro-batches / G; per_version "
            "refreshes once per unit = per weight version)",
            ["mode", "weight_qdq", "G", "ms", "x bf16 (same G)", "refreshes", "peak GiB"], rows)
        return "\n".join(lines + checks + [table])
    finally:
        cleanup()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="verl-quads bench qat", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--moe-inter", type=int, default=768)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"), help="NVFP4 kernel backend")
    p.add_argument("--attn", default="sdpa", help="transformers attention implementation (sdpa, eager, ...)")
    p.add_argument("--experts-impl", default="grouped_mm",
                   help="transformers experts implementation (grouped_mm: what a Qwen3-MoE model gets by default)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                   help="skip the per-mode breakdown (weight QDQ alone; kernel classes on CUDA)")
    p.add_argument("--fsdp", action="store_true",
                   help="run the layer under FSDP2 on a 1-rank process group (see the module docstring)")
    p.add_argument("--weight-qdq", nargs="+", default=["per_forward", "per_version"],
                   choices=("per_forward", "per_version"), help="--fsdp: weight QDQ schedules to time")
    p.add_argument("--micro-batches", nargs="+", type=int, default=[1, 4],
                   help="--fsdp: forward+backward micro-batches per weight version (G)")
    a = p.parse_args(argv)
    if any(g < 1 for g in a.micro_batches):
        p.error("--micro-batches: each G must be >= 1")
    if a.modes[0] != "bf16":
        a.modes = ["bf16"] + [m for m in a.modes if m != "bf16"]  # ratios need the baseline first
    return a


def main(argv: list[str] | None = None) -> str:
    """Run and return the report (the table is printed as it is made)."""
    a = parse(argv)
    return run_fsdp(a) if a.fsdp else run(a)


if __name__ == "__main__":
    main()
