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

``--fsdp``: the layer under FSDP2 instead (``fully_shard`` on the decoder layer and on a root module), on a
process group of ONE rank made here (NCCL on CUDA, gloo on CPU; a file store in a temporary directory; destroyed
at the end), so every forward AND backward all-gathers (a copy on one rank). Two FSDP settings: ``fp32 master``
(fp32 master weights, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` as verl sets it: every
gather casts) and ``bf16 master`` (bf16 master weights, default policy: nothing to cast; ``--no-bf16-master``
skips it). Each mode runs with every ``--weight-qdq`` (``per_forward``: QDQ of the unsharded weight in every
forward; ``per_version``: verl_quads/qat/fsdp_qdq.py, QDQ of the shard once per weight version, before the
all-gather; ``auto``, the default of ``quant_config.weight_qdq``: set up by ``fsdp_qdq.setup`` exactly as verl-quads'
verl engine does, so it becomes ``per_version`` where that can run, else ``per_forward``; the output says which).
Default ``--weight-qdq per_forward auto``. The HEADLINE table, printed last, is the path a verl user gets by
default: FSDP2 with verl's fp32 master weights + bf16 mixed precision, ``weight_qdq=auto``, per ``G``; the text
above it says what ``G`` is in verl's terms (:data:`G_IN_VERL`).

Device check first (fp32 master; ``--no-check`` skips it), per mode, on one model per weight_qdq with the same
inputs: per_forward run 3 times (the CONTROL: is the backward run-to-run deterministic on this device?), per_version
twice, then both with SDPA forced to the math backend (deterministic attention backward), and the QDQ weights
themselves (per_version's all-gathered shards vs per_forward's QDQ of the all-gathered weight). Printed per tensor
(output, input grad, every weight grad): ``=`` (``torch.equal``) or the max abs difference and the number of
differing elements, then a verdict that separates a numerics difference of per_version (forward output or QDQ
weights differ, or differences beyond the control) from run-to-run nondeterminism of the default backward.

Timing: one timed unit = one weight version (the version counter of every master parameter is bumped with
``torch.autograd.graph.increment_version``: no device work, the same in every row, standing in for
``optimizer.step``, whose own cost is not timed) then ``G`` forward+backward micro-batches (``--micro-batches``).
All variants of one setting are resident and timed in ``--rounds`` interleaved rounds (variant order rotated per
round; ``round(--units / G)`` units per G per variant per round, CUDA events and a sync per unit), so drift hits
every row alike; ms per micro-batch = median over units of unit time / G (p25-p75 shown). Reported per row:
``added ms`` = mode - bf16 at the same setting and G (the QAT cost, undiluted by FSDP's own cost) and ``x issue`` =
(bf16 without FSDP + added ms) / bf16 without FSDP: the issue's ratio (goal w4a16 <= 1.10, trace <= 1.20) against
the plain layer's forward+backward, timed in the same run (with the per_forward QAT modes without FSDP as a
cross-check). ``per_version`` refreshes once per unit (column ``refresh/unit``), so at G > 1 its refresh is amortized
over G micro-batches, as over the micro-batches of one optimizer step in verl.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from verl_quads.bench.timing import device_name, median_time_s, print_table
from verl_quads.bench.widths import add_qwen3_moe_width_args
from verl_quads.config import QuantConfig

MODES = ("bf16", "w4a16", "w4a4_qat", "trace")

#: What the bench's G (micro-batches per weight version) is in verl 0.9.1 (read in verl/workers/engine_workers.py
#: and verl/trainer/ppo/v1/trainer_base.py; printed with the headline table).
G_IN_VERL = (
    "G = forward+backward micro-batches per weight version on one rank. In verl 0.9.1 one weight version lasts one "
    "actor mini-batch: _update_actor sends mini_batch_size = ppo_mini_batch_size * rollout.n samples; "
    "ActorRolloutRefWorker.update_actor -> TrainingWorker.train_mini_batch splits the rank's batch into mini-batches "
    "of mini_batch_size / data-parallel size (ppo_epochs passes), and each mini-batch is one engine.train_batch = "
    "forward_backward_batch over its micro-batches + ONE optimizer step. So G = ppo_mini_batch_size * rollout.n / "
    "(ppo_micro_batch_size_per_gpu * data-parallel size) with fixed micro-batches (data-parallel size = world size "
    "without sequence parallelism); with use_dynamic_bsz=True at least the mini-batch's tokens on the rank / "
    "ppo_max_token_len_per_gpu, rounded up. Weight versions per training step = train_batch_size / "
    "ppo_mini_batch_size * ppo_epochs. The old-log-prob pass of the step (compute_log_prob: forward only, every "
    "sample of the rank in log_prob_micro_batch_size_per_gpu micro-batches) runs on the version the step's first "
    "mini-batch then trains, so that version serves more micro-batches (per_version refreshes once, before the "
    "log-prob pass). The bench's micro-batch is --tokens tokens: G here ~ tokens per rank per version / --tokens. "
    "Example, recipes/grpo_math_qwen3_30b_a3b.args (8 GPUs, ppo_mini_batch_size 64, rollout.n 8, dynamic bsz 16384): "
    "64 * 8 / 8 = 64 samples per rank per version, i.e. 64 * L / 4096 bench micro-batches for mean sample length L "
    "(16 at L = 1024), 4 versions per step (train_batch_size 256), plus 256 samples of log-prob forwards on the "
    "first. The recipes also enable gradient checkpointing, whose recomputed forward QDQs the weights again under "
    "per_forward (not in this bench, which runs no checkpointing)."
)
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


def _time_once_s(fn) -> float:
    """Seconds of one ``fn()`` call: CUDA events around it, then a sync (CPU: perf_counter)."""
    if torch.cuda.is_available():
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        fn()
        t1.record()
        t1.synchronize()
        return t0.elapsed_time(t1) / 1e3
    import time

    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(p25, median, p75) of ``xs``."""
    import statistics

    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def _release(device: str) -> None:
    """Free deleted models now: QAT state -> per-version installer -> model is a reference cycle."""
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _diff_cell(u: torch.Tensor, v: torch.Tensor) -> str:
    """``=`` when bit-identical (torch.equal), else ``max|u-v| (number of differing elements)``."""
    if u.shape != v.shape or u.dtype != v.dtype:
        return f"shape/dtype {tuple(u.shape)}/{u.dtype} vs {tuple(v.shape)}/{v.dtype}"
    if torch.equal(u, v):
        return "="
    d = (u.float() - v.float()).abs()
    return f"{d.max().item():.3g} ({int((u != v).sum().item())})"


def run_fsdp(a: argparse.Namespace) -> str:
    """The ``--fsdp`` variant (see the module docstring)."""
    from contextlib import nullcontext

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from verl_quads.qat import InMemoryGuidanceStore, TraceBatch, apply_qat, fsdp_qdq, trace_context
    from verl_quads.qat.model import _QATExperts, _QATLinear

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
        #: FSDP settings: master dtype + mixed precision. "fp32 master" is verl's (every gather casts fp32 ->
        #: bf16, gradients reduced in fp32); "bf16 master" has nothing to cast (param_dtype = master dtype).
        settings = {"fp32 master": (torch.float32, MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                        reduce_dtype=torch.float32))}
        if a.bf16_master:
            settings["bf16 master"] = (torch.bfloat16, MixedPrecisionPolicy())
        lines = [f"device: {device_name()}",
                 f"layer: hidden {a.hidden}, heads {a.heads}/{a.kv_heads}x{a.head_dim}, experts {a.experts} "
                 f"top-{a.top_k}, expert inter {a.moe_inter}, tokens {a.tokens} per micro-batch, attention "
                 f"{cfg._attn_implementation}, experts impl {cfg._experts_implementation}, NVFP4 backend {a.backend}",
                 "FSDP2 (fully_shard on the layer and a root) on a process group of 1 rank: every forward and backward "
                 "all-gathers (a copy on one rank; no all-reduce in the per_version refresh); settings: "
                 + "; ".join(f"{k}: master {d}, {m}" for k, (d, m) in settings.items())]
        print("\n".join(lines), flush=True)

        def records(root):
            """TRACE: guidance records made from the layer's own activations (the rollout would supply them)."""
            store = InMemoryGuidanceStore()
            tb = TraceBatch.padded(store, 0, ["seq0"], torch.ones(1, a.tokens, dtype=torch.long))
            tb.record_into = store
            with torch.no_grad(), trace_context(root, tb):
                root(x0, pe)
            return TraceBatch.padded(store, 0, ["seq0"], torch.ones(1, a.tokens, dtype=torch.long))

        resolved: dict = {}  # (mode, weight_qdq, setting) -> the schedule fsdp_qdq.setup put in effect
        # the schedule compared with per_forward (device check, summary): auto (the default) or per_version
        pv_wq = "auto" if "auto" in a.weight_qdq else ("per_version" if "per_version" in a.weight_qdq else None)

        def make(mode: str, weight_qdq: str, setting: str | None = "fp32 master"):
            """(root, QAT state, TraceBatch) of one variant; ``setting=None``: no FSDP, bf16 weights."""
            dtype = torch.bfloat16 if setting is None else settings[setting][0]
            root = _Root(cfg, copy.deepcopy(base.layers).to(dtype))
            state = None
            if mode != "bf16":
                qc = QuantConfig(quant=_QUANT_OF[mode], guided_layers=1, backend=a.backend, weight_qdq=weight_qdq)
                state = apply_qat(root, qc)
            if setting is not None:
                mpp = settings[setting][1]
                fully_shard(root.layers[0], mesh=mesh, mp_policy=mpp)
                fully_shard(root, mesh=mesh, mp_policy=mpp)
                if mode != "bf16" and weight_qdq in ("per_version", "auto"):
                    # as verl-quads' verl engine: per_version installs (or raises), auto decides
                    resolved[(mode, weight_qdq, setting)] = fsdp_qdq.setup(root)
            return root, state, (records(root) if mode == "trace" else None)

        def fwd_bwd(root, state, ctx, x):
            if ctx is not None:
                state.trace = ctx  # as verl-quads' verl engine sets it per micro-batch
            try:
                y = root(x, pe)
                y.backward(dy)
            finally:
                if ctx is not None:
                    state.trace = None
            return y

        # ---- device check: per_version vs per_forward, with a run-to-run control of per_forward itself ----
        def gathered_qdq_weights(root, wq: str) -> dict[str, torch.Tensor]:
            """Every quantized weight as the forward multiplies with it: per_forward QDQs the all-gathered
            weight (the module's own weight path), per_version's all-gathered weight IS the QDQ weight."""
            layer = root.layers[0]
            layer.unshard()
            out = {}
            try:
                with torch.no_grad():
                    for name, m in layer.named_modules():
                        if isinstance(m, _QATLinear):
                            out[f"{name}.weight"] = (m._qat_weight() if wq == "per_forward" else m.weight).clone()
                        elif isinstance(m, _QATExperts):
                            qw = m._qdq_weights() if wq == "per_forward" else {p: getattr(m, p) for p in m._qat_params}
                            out.update({f"{name}.{p}": t.clone() for p, t in qw.items()})
            finally:
                layer.reshard()
            return out

        def check(mode: str) -> list[str]:
            built = {"per_forward": make(mode, "per_forward"), "per_version": make(mode, pv_wq)}
            if fsdp_qdq.installed(built["per_version"][0]) is None:
                del built
                _release(device)
                return ["", f"{mode}: device check skipped: weight_qdq {pv_wq} took per_forward here (nothing to compare)"]
            names = ["output", "input grad"] + [n for n, _ in built["per_forward"][0].named_parameters()]

            def once(wq: str, math: bool = False) -> list[torch.Tensor]:
                root, state, ctx = built[wq]
                for p in root.parameters():
                    p.grad = None
                x = x0.detach().clone().requires_grad_(True)
                with sdpa_kernel([SDPBackend.MATH]) if math else nullcontext():
                    y = fwd_bwd(root, state, ctx, x)
                res = [y.detach(), x.grad] + [p.grad.to_local() for p in root.parameters()]
                for p in root.parameters():
                    p.grad = None
                return res

            pf = [once("per_forward") for _ in range(3)]  # the control: the same model and inputs, 3 runs
            pv = [once("per_version") for _ in range(2)]
            pfm = [once("per_forward", True) for _ in range(2)]  # SDPA forced to the math backend
            pvm = once("per_version", True)
            w_pf = gathered_qdq_weights(built["per_forward"][0], "per_forward")
            w_pv = gathered_qdq_weights(built["per_version"][0], "per_version")
            for _root, state, ctx in built.values():
                if ctx is not None:
                    ctx.verify()
                if state is not None:
                    state.verify()
            del built
            _release(device)
            cols = [("pf run2 vs run1", pf[1], pf[0]), ("pf run3 vs run1", pf[2], pf[0]),
                    ("pv vs pf", pv[0], pf[0]), ("pv run2 vs run1", pv[1], pv[0]),
                    ("math: pf run2 vs run1", pfm[1], pfm[0]), ("math: pv vs pf", pvm, pfm[0])]
            table = [[n, pf[0][i].float().abs().max().item()] + [_diff_cell(u[i], v[i]) for _c, u, v in cols]
                     for i, n in enumerate(names)]

            def differing(u, v) -> list[str]:
                return [n for i, n in enumerate(names) if not torch.equal(u[i], v[i])]

            ctrl = sorted(set(differing(pf[1], pf[0])) | set(differing(pf[2], pf[0])))
            pv_d, pvpv_d = differing(pv[0], pf[0]), differing(pv[1], pv[0])
            m_ctrl, m_pv = differing(pfm[1], pfm[0]), differing(pvm, pfm[0])
            w_bad = [f"{n} ({_diff_cell(w_pv[n], w_pf[n])})" for n in w_pf if n not in w_pv
                     or not torch.equal(w_pv[n], w_pf[n])] + [n for n in w_pv if n not in w_pf]
            out_ok = "output" not in pv_d and "output" not in m_pv
            if w_bad or not out_ok:
                verdict = (f"per_version DIFFERS from per_forward in the forward (QDQ weights differ: {w_bad or 'none'}; "
                           f"output bit-identical: {out_ok}): a numerics bug, not nondeterminism")
            elif not pv_d:
                verdict = "per_version bit-identical to per_forward (output, input grad, every weight grad)"
                if ctrl:
                    verdict += (f" in this run, although per_forward differs from ITSELF in {ctrl} with the default "
                                "kernels (nondeterministic backward: a match here is partly luck; the math-attention "
                                f"columns are the deterministic comparison: {'all equal' if not m_pv else m_pv})")
            elif not m_pv and not m_ctrl:
                verdict = ("per_version bit-identical to per_forward with the deterministic math attention (output, "
                           "input grad, every weight grad) and in the forward and QDQ weights with the default kernels; "
                           f"with the default kernels it differs in {pv_d}, and per_forward differs from ITSELF in "
                           f"{ctrl or 'nothing in 2 reruns'}, per_version from itself in {pvpv_d or 'nothing'}: "
                           "run-to-run nondeterminism of the default backward (SDPA), not per_version")
            elif set(pv_d) <= set(ctrl) and not m_pv:
                verdict = (f"differences only in tensors that also differ between per_forward reruns ({ctrl}) and none "
                           "with math attention: nondeterministic backward, not per_version")
            else:
                verdict = (f"per_version DIFFERS from per_forward beyond the control: default kernels {pv_d} (control "
                           f"{ctrl}), math attention {m_pv} (math control {m_ctrl})")
            return [
                print_table(f"{mode}: device check, same model + inputs ('=' bit-identical, else max |diff| (differing "
                            "elements)); pf = weight_qdq per_forward, pv = per_version (fp32 master"
                            + (", set up by weight_qdq auto" if pv_wq == "auto" else "") + "); 'math:' = SDPA "
                            "forced to the math backend (deterministic)", ["tensor", "max|pf|"] + [c[0] for c in cols],
                            table),
                f"{mode}: QDQ weights (per_version's all-gathered QDQ shards vs per_forward's QDQ of the all-gathered "
                f"weight), {len(w_pf)} tensors bit-identical: {not w_bad}" + (f"; differ: {w_bad}" if w_bad else ""),
                f"{mode}: per_version output, input gradient and {len(names) - 2} weight gradients bit-identical to "
                f"per_forward: {not pv_d}" + (f" (differ: {pv_d})" if pv_d else ""),
                f"{mode}: per_version bit-identical to per_forward with math attention: {not m_pv}; per_forward "
                f"run-to-run equal: default kernels {not ctrl}, math attention {not m_ctrl}",
                f"{mode}: verdict: {verdict}",
            ]

        def failed(what: str, e: Exception) -> str:
            import traceback

            traceback.print_exc()
            return f"{what}: FAILED {type(e).__name__}: {e}"

        checks: list[str] = []
        if "per_forward" in a.weight_qdq and pv_wq is not None and a.check:
            for mode in [m for m in a.modes if m != "bf16"]:
                try:
                    got = check(mode)
                except Exception as e:  # noqa: BLE001 - reported in the output; the rest still runs
                    got = [failed(f"{mode}: per_version vs per_forward check", e)]
                checks += got
                print("\n".join(got[1:]), flush=True)
                _release(device)

        # ---- timing: all variants of one setting alive, interleaved round-robin ----
        class _Variant:
            def __init__(self, key, root, state, ctx):
                self.key, self.root, self.state, self.ctx = key, root, state, ctx
                self.params = list(root.parameters())
                self.x = x0.detach().clone().requires_grad_(True)
                self.qdq = fsdp_qdq.installed(root) if state is not None else None

            def unit(self, n_micro: int) -> None:
                """One weight version (version bump standing in for optimizer.step: no device work) + n_micro
                forward+backward micro-batches."""
                for p in self.params:
                    torch.autograd.graph.increment_version(p)
                    p.grad = None
                for _ in range(n_micro):
                    self.x.grad = None
                    fwd_bwd(self.root, self.state, self.ctx, self.x)

            def free(self) -> None:
                for p in self.params:
                    p.grad = None
                self.x.grad = None

        def interleaved(variants: list, gs: list[int]) -> dict:
            """Per (key, G): ms-per-micro-batch samples (one per unit) and refreshes per unit. Rounds rotate
            the variant order; each variant's grads are freed after its turn."""
            samples: dict = {}
            units: dict = {}
            alive = list(variants)
            for v in list(alive):
                try:
                    for G in gs:
                        for _ in range(a.warmup):
                            v.unit(G)
                    v.free()
                except Exception as e:  # noqa: BLE001
                    checks.append(failed(f"{v.key} warm-up", e))
                    alive.remove(v)
            r0 = {v.key: v.qdq.refreshes if v.qdq is not None else 0 for v in alive}
            for r in range(a.rounds):
                k = r % max(1, len(alive))
                for v in alive[k:] + alive[:k]:
                    try:
                        for G in gs:
                            for _ in range(max(1, round(a.units / G))):
                                samples.setdefault((v.key, G), []).append(_time_once_s(lambda v=v, G=G: v.unit(G)) / G)
                                units[v.key] = units.get(v.key, 0) + 1
                        v.free()
                    except Exception as e:  # noqa: BLE001
                        checks.append(failed(f"{v.key} timing", e))
                        alive.remove(v)
            refr = {v.key: ((v.qdq.refreshes - r0[v.key]) / units[v.key] if v.qdq is not None else 0.0)
                    for v in alive if v.key in units}
            for v in alive:
                if v.ctx is not None:
                    v.ctx.verify()
                if v.state is not None:
                    v.state.verify()
            return {"samples": samples, "refreshes": refr}

        qmodes = [m for m in a.modes if m != "bf16"]
        results: dict = {}
        # the baseline first: the plain layer (bf16 weights, no FSDP) and the per_forward QAT modes on it;
        # then each FSDP setting: bf16 + every mode x weight_qdq
        groups = [("no FSDP", None, [("bf16", "-")] + [(m, "per_forward") for m in qmodes], [1])]
        groups += [(s, s, [("bf16", "-")] + [(m, wq) for m in qmodes for wq in a.weight_qdq], list(a.micro_batches))
                   for s in settings]
        for label, setting, todo, gs in groups:
            vs = []
            for m, wq in todo:
                try:
                    vs.append(_Variant((label, m, wq), *make(m, "per_forward" if wq == "-" else wq, setting)))
                except Exception as e:  # noqa: BLE001 - reported; the other variants still run
                    checks.append(failed(f"{label} {m} {wq}", e))
            results[label] = interleaved(vs, gs)
            del vs
            _release(device)

        nan = float("nan")
        base_nofsdp = nan
        plain_rows = []
        if results["no FSDP"]["samples"]:
            s = results["no FSDP"]["samples"]
            base_nofsdp = _quartiles(s[(("no FSDP", "bf16", "-"), 1)])[1] * 1e3 if (("no FSDP", "bf16", "-"), 1) in s else nan
            for (key, _G), xs in s.items():
                lo, med, hi = (t * 1e3 for t in _quartiles(xs))
                plain_rows.append([key[1], med, f"{lo:.3g}-{hi:.3g}", len(xs), med - base_nofsdp, med / base_nofsdp])
        rows, added = [], {}
        for setting in settings:
            s, refr = results[setting]["samples"], results[setting]["refreshes"]
            for (key, G), xs in s.items():
                lo, med, hi = (t * 1e3 for t in _quartiles(xs))
                b = s.get(((setting, "bf16", "-"), G))
                add = med - _quartiles(b)[1] * 1e3 if b else nan
                added[(setting, key[1], key[2], G)] = add
                rows.append([setting, key[1], key[2], G, med, f"{lo:.3g}-{hi:.3g}", len(xs), add,
                             (base_nofsdp + add) / base_nofsdp, f"{refr.get(key, nan):.2g}"])
        summary = []
        for setting in settings:
            for m in qmodes:
                for G in a.micro_batches:
                    pf_add = added.get((setting, m, "per_forward", G), nan)
                    pv_add = added.get((setting, m, pv_wq, G), nan)
                    summary.append([m, setting, G, pf_add, pv_add, pf_add - pv_add, (base_nofsdp + pf_add) / base_nofsdp,
                                    (base_nofsdp + pv_add) / base_nofsdp])
        res_txt = "; ".join(f"{m} {wq} ({st}) -> {r}" for (m, wq, st), r in sorted(resolved.items(), key=str)
                            if wq == "auto") or "auto not timed"
        headline = []
        for m in qmodes:
            for G in a.micro_batches:
                key = ("fp32 master", m, "auto", G)
                if key in added:
                    xs = results["fp32 master"]["samples"][(("fp32 master", m, "auto"), G)]
                    headline.append([m, f"auto -> {resolved.get((m, 'auto', 'fp32 master'), '?')}", G,
                                     _quartiles(xs)[1] * 1e3, added[key], (base_nofsdp + added[key]) / base_nofsdp])
        how = (f"timing: per setting all variants resident, {a.rounds} interleaved rounds (variant order rotated), each "
               f"round round(--units {a.units} / G) timed units per G per variant after {a.warmup} warm-up units; a unit = "
               "one weight version (version bump standing in for optimizer.step, not timed) + G forward+backward "
               "micro-batches, CUDA events + sync per unit; ms = median over units of unit time / G (p25-p75 shown); "
               "added ms = mode - bf16 at the same setting and G; x issue = (bf16 no-FSDP + added) / bf16 no-FSDP "
               f"(bf16 no-FSDP = {base_nofsdp:.3g} ms, the issue's baseline: goal w4a16 <= 1.10, trace <= 1.20); "
               "per_version refreshes once per unit (refresh/unit column), i.e. amortized over G micro-batches")
        print(how, flush=True)
        tables = [how]
        tables.append(print_table("one MoE decoder layer WITHOUT FSDP (bf16 weights; QAT modes per_forward), ms per "
                                  "forward+backward", ["mode", "ms", "p25-p75", "n", "added ms", "x bf16"], plain_rows))
        tables.append(print_table(
            "one MoE decoder layer under FSDP2 (1 rank), ms per micro-batch",
            ["setting", "mode", "weight_qdq", "G", "ms", "p25-p75", "n", "added ms", "x issue", "refresh/unit"], rows))
        tables.append(print_table(
            "QAT added ms per micro-batch (mode - bf16, same FSDP setting and G) and the issue's ratio on the no-FSDP "
            "bf16 baseline", ["mode", "setting", "G", "per_forward added", f"{pv_wq} added", f"{pv_wq} saves",
                              "x issue per_forward", f"x issue {pv_wq}"], summary))
        if headline:
            import importlib.metadata as md

            tables.append(f"weight_qdq auto resolved (fsdp_qdq.setup, as in verl-quads' verl engine; torch "
                          f"{md.version('torch')}): {res_txt}")
            tables.append(G_IN_VERL)
            print(tables[-2] + "\n" + tables[-1], flush=True)
            tables.append(print_table(
                "HEADLINE: the default path of a verl user (FSDP2, fp32 master + bf16 mixed precision as verl sets it, "
                "quant_config.weight_qdq=auto), ms per micro-batch of --tokens tokens at G micro-batches per weight "
                "version; x issue = (bf16 no-FSDP + added) / bf16 no-FSDP (goal w4a16 <= 1.10, trace <= 1.20)",
                ["mode", "weight_qdq", "G", "ms", "added ms", "x issue"], headline))
        return "\n".join(lines + checks + tables)
    finally:
        cleanup()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="verl-quads bench qat", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    add_qwen3_moe_width_args(p)
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
    p.add_argument("--weight-qdq", nargs="+", default=["per_forward", "auto"],
                   choices=("per_forward", "per_version", "auto"),
                   help="--fsdp: weight QDQ schedules to time (auto: quant_config's default, set up as verl-quads' "
                        "verl engine does; the headline table needs it)")
    p.add_argument("--micro-batches", nargs="+", type=int, default=[1, 4, 16],
                   help="--fsdp: forward+backward micro-batches per weight version (G; 16 ~ the Qwen3-30B-A3B recipe "
                        "at 1024 tokens per sample, see G_IN_VERL)")
    p.add_argument("--rounds", type=int, default=8,
                   help="--fsdp: interleaved timing rounds (every variant of a setting timed in each)")
    p.add_argument("--units", type=int, default=4,
                   help="--fsdp: micro-batches per G per variant per round (round(units / G) timed units, >= 1)")
    p.add_argument("--no-bf16-master", dest="bf16_master", action="store_false",
                   help="--fsdp: skip the second FSDP setting (bf16 master weights: nothing to cast at the gather)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="--fsdp: skip the per_version vs per_forward device check")
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
