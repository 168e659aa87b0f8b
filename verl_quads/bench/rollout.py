"""``verl-quads bench rollout``: the ``triton`` rollout backend's fused NVFP4 GEMMs vs BF16 (CUDA).

No vLLM needed: calls :mod:`verl_quads.nvfp4.triton_gemm` directly. Rows (issue #5's benchmark):

- ``moe``: the whole routed-experts layer at Qwen3-30B-A3B width (hidden 2048, expert intermediate
  768, 128 experts, top-8, random routing): :func:`triton_gemm.moe_forward` (moe_align + ONE grouped
  launch per GEMM) vs a BF16 layer of the same structure on ``torch._grouped_mm``; plus
  ``moe_align`` alone;
- dense linears ``d4096`` (4096x4096), ``d8192`` (8192x8192), and Qwen3-30B-A3B's ``qkv``
  (2048 -> 5120) and ``o_proj`` (4096 -> 2048): baselines BF16 ``torch.matmul`` (cuBLAS) and FP8
  rowwise ``torch._scaled_mm`` (e4m3 operands + per-row/per-column float32 scales, activation
  quantization included; skipped with the reason printed where unsupported);
- per shape and M (default 1, 4, 16, 64, 256, 1024, 4096 tokens): ``w4a16``, ``naive`` (W4A4
  emulated: activation quantized per token by the core), ``quads k=R (G)`` for R in ``--ratios``
  (per-token residual selection with the product's default rule G = ``QuantConfig().residual_granularity``,
  read at run time and passed explicitly; graph-capturable) and ``quads-bf16 k=R (G)`` (the opt-in
  ``residual_combine="bf16"`` operand: the core's QDQ activation in bf16, then the w4a16 GEMM), plus one
  comparison row ``quads-bf16 k=R (other)`` per other selection rule (``channel`` and ``block`` under the default
  ``channel_sampled``); ``--variants`` keeps a subset of the rows; each timed as the whole call
  (activation quantization included) captured in a CUDA graph; ``x bf16`` = BF16 time / this time
  (> 1: faster); weight bandwidth counts the NVFP4 bytes the GEMM must read (codes + block scales;
  the active experts' only) as a fraction of the device-to-device copy bandwidth of the same run.

At the end the goals of issue #5 are checked (PASS/FAIL with the measured ratios): W4A16 MoE layer
>= 2.5x BF16 grouped at M <= 256; W4A16 dense 4096/8192 >= 2.5x cuBLAS BF16 at M <= 16; QUADS
k=0.5 <= 1.10x the time of naive (W4A4-emulated) at every M (checked for the default rule's ``quads`` and
``quads-bf16``; the comparison rule's ratios are printed as information).

``--shapes`` also accepts ``w13`` / ``w2`` (one grouped expert GEMM alone) and ``--sweep`` times a
few launch configurations of the w4a16 / naive GEMM per (shape, M) to tune
:func:`triton_gemm.pick_config`.

``--sweep-decode`` (issue #5, decode): every variant of the W4A16 weight-streaming kernel
(:class:`triton_stream.StreamConfig`: tile, split-K, warps, stages, CUDA-core FMA vs tensor-core dot,
``bits`` vs ``f16`` E2M1 decode, prefetch) at M = 1, 4, 16 for d4096, d8192 and the MoE layer's two
grouped GEMMs (w13, w2; random top-8 routing over 128 experts), timed with cold L2 (each timed replay
calls the GEMM once per weight copy / routing, >= 256 MB read), each checked against the torch
reference (max |err| / max |ref| and the per-element 1 ulp + float32 summation bound); prints weight
bytes/s as a fraction of the copy bandwidth of the same run, the ratio to cuBLAS BF16 /
``torch._grouped_mm`` BF16, the fastest correct variant per shape, the MoE layer with those variants,
and a paste-ready ``DECODE_TABLE``.

``--sweep-mid`` (issue #5, 16..256 rows: ~1-16 rows per expert in the MoE layer): at M = 256, 16, 64
(most important first, for ``--budget-s``) for the MoE layer's w13 / w2 grouped GEMMs and dense GEMMs, a
focused set of tensor-core :class:`triton_gemm.GemmConfig` launch configurations (swap or not, block_m /
block_n / block_k, split_k, warps, stages: <= 25 in stage 1, split / stages / warps variations of the
fastest two in stage 2) and at M <= 64 a few tensor-core :class:`triton_stream.StreamConfig` variants, for
``w4a16`` and ``naive`` (stage 1 only), cold L2, each checked against the torch reference; the BF16
baselines; a torch.profiler table of the MoE layer's kernels at the largest M (is it the GEMM?); a
summary (default dispatch vs fastest correct per point) and a paste-ready ``MID_TABLE``.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

import torch

from verl_quads.bench.timing import device_name, graph_time_s, median_time_s, print_table

SHAPES = {  # name: (grouped, N, K)
    "d4096": (False, 4096, 4096),
    "d8192": (False, 8192, 8192),
    "qkv": (False, 5120, 2048),
    "o_proj": (False, 2048, 4096),
    "w13": (True, 1536, 2048),
    "w2": (True, 2048, 768),
}
DEFAULT_SHAPES = "moe,d4096,d8192,qkv,o_proj"
DEFAULT_MS = "1,4,16,64,256,1024,4096"
NUM_EXPERTS, TOP_K = 128, 8
DEVICE = "cuda"  # a CPU smoke run (TRITON_INTERPRET=1, tiny SHAPES) may set "cpu"
#: issue #5's W4A16 speed goal: the MoE layer at M <= 256 and dense GEMMs at M <= 16 this many times faster than BF16
W4A16_GOAL = 2.5


class _Rows(list):
    """Table rows, each also printed when added (a run stopped by a time limit keeps what it measured)."""

    def append(self, row):
        print(" | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row), flush=True)
        super().append(row)


def _time(fn, eager: bool = False) -> tuple[float, str]:
    t = None if eager else graph_time_s(fn)
    if t is not None:
        return t, "graph"
    return median_time_s(fn, 3, 10, 3), "eager"


def _copy_bandwidth() -> float:
    src = torch.empty((512 if DEVICE == "cuda" else 4) * 2**20, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    t = median_time_s(lambda: dst.copy_(src))
    return 2 * src.numel() / t


def _sweep_configs(rows_per_group: int, block_m: int | None = None):
    from verl_quads.nvfp4.triton_gemm import GemmConfig, pick_block_m

    bm0 = block_m or pick_block_m(rows_per_group)
    bms = (bm0,) if bm0 <= 64 else (64, 128)
    splits = (1, 4, 8) if bm0 <= 64 else (1,)
    for bm, bn, bk, split, (warps, stages) in itertools.product(bms, (64, 128), (64, 128), splits,
                                                                ((4, 3), (8, 4))):
        if bm == 128 and bn == 128 and bk == 128:
            continue
        yield GemmConfig(block_m=bm, block_n=bn, block_k=bk, block_k2=64, split_k=split, num_warps=warps,
                         num_stages=stages)


def _bf16_grouped(x_sorted: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor, counts: list[int]):
    """(callable, label): ``torch._grouped_mm`` if it runs here, else a per-expert loop."""
    try:
        torch._grouped_mm(x_sorted, w_t, offs=offs)
        torch.cuda.synchronize()
        return (lambda: torch._grouped_mm(x_sorted, w_t, offs=offs)), "bf16 torch._grouped_mm"
    except Exception as e:  # pragma: no cover - depends on torch build / GPU
        print(f"torch._grouped_mm unavailable ({type(e).__name__}: {e}); baseline = per-expert matmul loop", flush=True)
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)

    def loop():
        for i, c in enumerate(counts):
            if c:
                x_sorted[starts[i]:starts[i + 1]] @ w_t[i]

    return loop, "bf16 per-expert matmul loop"


def _moe_layer_rows(ms: list[int], ratios: list[float], bw: float, dev: str, g: torch.Generator,
                    times: dict, variants: tuple[str, ...] = ()) -> list[list[object]]:
    """Whole routed-experts layer (hidden 2048, intermediate 768, 128 experts top-8, random routing):
    :func:`triton_gemm.moe_forward` (one grouped launch per GEMM, routing sort included) vs a BF16
    layer of the same structure (stable sort by expert, ``torch._grouped_mm`` w13, silu * up,
    ``torch._grouped_mm`` w2, router-weighted ``index_add_``; expert offsets precomputed, i.e. the
    baseline gets its routing metadata for free)."""
    from verl_quads import nvfp4 as nv
    from verl_quads.nvfp4 import moe_routing as mr
    from verl_quads.nvfp4 import triton_gemm as tg

    e, hidden, inter = NUM_EXPERTS, SHAPES["w13"][2], SHAPES["w13"][1] // 2
    qs, bf = {}, {}
    for name, (n, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
        w = torch.randn(e, n, k, device=dev, generator=g) * 0.02
        q = nv.quantize(w, nv.global_scale_from_amax(w.abs().amax(dim=(1, 2), keepdim=True)), backend="triton")
        qs[name] = (q.packed, q.block_scale, q.global_scale.reshape(-1))
        bf[name] = w.to(torch.bfloat16).transpose(-2, -1)  # [E, K, N] for _grouped_mm
        del w
    rows = _Rows()
    for m in ms:
        tag = f"moe layer M={m}"
        x = torch.randn(m, hidden, device=dev, generator=g).to(torch.bfloat16)
        x[:, ::293] *= 30.0
        ids = torch.rand(m, e, device=dev, generator=g).argsort(-1)[:, :TOP_K]
        sw = torch.softmax(torch.randn(m, TOP_K, device=dev, generator=g), -1)
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=e)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        active = int(flat.unique().numel())
        wbytes = active * 3 * hidden * inter * 9 // 16
        bf_bytes = active * 3 * hidden * inter * 2

        def bf16_layer():
            order = torch.sort(flat, stable=True).indices
            tok = torch.div(order, TOP_K, rounding_mode="floor")
            h = torch._grouped_mm(x[tok], bf["w13"], offs=offs)
            a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            y = torch._grouped_mm(a, bf["w2"], offs=offs)
            out = torch.zeros(m, hidden, dtype=torch.float32, device=dev)
            return out.index_add_(0, tok, y.float() * sw.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)

        try:
            bf16_layer()
            t_base, how = _time(bf16_layer)
            rows.append([tag, "bf16 layer (torch._grouped_mm)", how, t_base * 1e6, 1.0, bf_bytes / t_base / 1e9,
                         bf_bytes / t_base / bw])
        except Exception as ex:  # pragma: no cover - depends on the torch build
            print(f"{tag}: bf16 layer baseline failed ({type(ex).__name__}: {ex})", flush=True)
            t_base = float("nan")
        bm = tg.moe_block_m(m * TOP_K, e, x, qs["w13"][0], qs["w2"][0])  # w4a16's routing (w4a16 values = x)
        t_align, how = _time(lambda: mr.moe_align(ids, e, bm))
        rows.append([tag, "moe_align (routing sort + tile table)", how, t_align * 1e6, "-", "-", "-"])
        for label, mode, r, comb, gran in _variants(ratios, variants):
            def fn(mode=mode, r=r, comb=comb, gran=gran):
                return tg.moe_forward(x, sw, ids, *qs["w13"], *qs["w2"], mode, residual_ratio=r,
                                      residual_per_token=True, residual_combine=comb, residual_granularity=gran)

            t, how = _time(fn)
            rows.append([tag, f"triton {label} layer", how, t * 1e6, t_base / t, wbytes / t / 1e9, wbytes / t / bw])
            times[("moe", m, label)] = t
            _record_combine_gap(times, ("moe", m), label, comb, fn, x, r, gran)
        times[("moe", m, "bf16")] = t_base
    return rows


def _record_combine_gap(times: dict, key: tuple, label: str, comb: str, fn, x: torch.Tensor, r: float,
                        gran: str) -> None:
    """Output of the ``quads k=R (G)`` variant kept (one extra call); for ``quads-bf16 k=R (G)``, its relative
    distance to it (same rule G), ``||y_bf16 - y_fp4x2|| / ||y_fp4x2||`` (float32 norms), stored as
    ``times[(*key, "gap quads-bf16 k=R (G)")]`` (the one activation rounding to bf16 + summation order, measured
    on the device), and whether the bf16 operand of ``x`` (the first GEMM's input) is the torch reference's
    bytes for rule ``gran`` (``times[(*key, "same quads-bf16 k=R (G)")]``; also for a comparison row without
    its fp4x2 twin)."""
    if not label.startswith("quads"):
        return
    y = fn().float()
    if comb == "fp4x2":
        times[(*key, "out " + label)] = y
        return
    from verl_quads import nvfp4 as nv
    from verl_quads.nvfp4 import triton_gemm as tg

    ref = times.pop((*key, "out " + label.replace("quads-bf16", "quads")), None)
    if ref is not None:
        times[(*key, "gap " + label)] = float((y - ref).norm() / ref.norm().clamp_min(1e-30))
    op, _ = tg.quantize_activation(x, "quads", residual_ratio=r, residual_per_token=True, residual_combine="bf16",
                                   residual_granularity=gran)
    want = nv.residual_fake_quantize(x, r, nv.per_row_global_scale(x), per_token=True, granularity=gran,
                                     backend="torch")
    times[(*key, "same " + label)] = bool(torch.equal(op.values, want))


VARIANTS = ("w4a16", "naive", "quads", "quads-bf16", "compare")


def default_granularity() -> str:
    """The product's default QUADS selection rule, ``verl_quads.config.QuantConfig().residual_granularity``,
    read when called (not at import)."""
    from verl_quads.config import QuantConfig

    return QuantConfig().residual_granularity


def _variants(ratios: list[float], variants: tuple[str, ...] = ()) -> list[tuple[str, str, float, str, str]]:
    """(label, act_mode, residual ratio, residual_combine, residual_granularity): w4a16, naive, and for each R
    ``quads k=R (G)`` (two FP4 operands) and ``quads-bf16 k=R (G)`` (``residual_combine="bf16"``) with the
    default rule G (:func:`default_granularity`), then ``quads-bf16 k=R (G')`` for each other rule G' (the
    comparison rows); per-token selection. ``variants``: keep only these kinds (:data:`VARIANTS`; empty: all)."""
    from verl_quads.config import RESIDUAL_GRANULARITIES

    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"bench rollout --variants: unknown {bad}; allowed: {list(VARIANTS)}")
    keep = set(variants or VARIANTS)
    gran = default_granularity()
    out = [v for v in (("w4a16", "w4a16", 0.0, "fp4x2", "block"), ("naive", "naive", 0.0, "fp4x2", "block"))
           if v[0] in keep]
    for r in ratios:
        if "quads" in keep:
            out.append((f"quads k={r:g} ({gran})", "quads", r, "fp4x2", gran))
        if "quads-bf16" in keep:
            out.append((f"quads-bf16 k={r:g} ({gran})", "quads", r, "bf16", gran))
        if "compare" in keep:
            out += [(f"quads-bf16 k={r:g} ({o})", "quads", r, "bf16", o) for o in RESIDUAL_GRANULARITIES if o != gran]
    return out


def _fp8_rowwise(x: torch.Tensor, w_bf16: torch.Tensor):
    """(callable, None) for FP8 rowwise ``torch._scaled_mm`` (activation quantized per row inside the
    call, weight per output channel beforehand), or (None, reason) where it cannot run."""
    try:
        fp8 = torch.float8_e4m3fn
        ws = (w_bf16.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0)  # [N, 1]
        w8 = (w_bf16.float() / ws).to(fp8)
        ws_t = ws.reshape(1, -1).contiguous()

        def fn():
            xs = x.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
            x8 = (x.float() / xs).to(fp8)
            return torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=ws_t, out_dtype=torch.bfloat16)

        fn()
        torch.cuda.synchronize()
        return fn, None
    except Exception as e:  # pragma: no cover - depends on GPU / torch build
        return None, f"{type(e).__name__}: {str(e)[:160]}"


def _goal_lines(times: dict, ms: list[int], ratios: list[float], gran: str | None = None) -> list[str]:
    """PASS/FAIL of issue #5's goals from the measured times (seconds); the QUADS goal judges the rows of
    the default rule ``gran`` (:func:`default_granularity` if None), the other rules' rows are information."""
    from verl_quads.config import RESIDUAL_GRANULARITIES

    gran = gran or default_granularity()
    out = [f"goals (issue #5; QUADS rows: the default selection rule residual_granularity={gran!r}):"]

    def check(name, pairs, want, larger_is_better=True, info=False):
        if not pairs:
            if not info:
                out.append(f"  {name}: not measured")
            return
        vals = ", ".join(f"M={m}: {v:.2f}x" for m, v in pairs)
        ok = all((v >= want) if larger_is_better else (v <= want) for _, v in pairs)
        verdict = "PASS" if ok else "FAIL"
        out.append(f"  {f'(comparison, not the goal: {verdict.lower()})' if info else verdict} {name}: {vals}")

    check(f"W4A16 MoE layer >= {W4A16_GOAL}x BF16 grouped at M <= 256",
          [(m, times[("moe", m, "bf16")] / times[("moe", m, "w4a16")]) for m in ms
           if m <= 256 and ("moe", m, "w4a16") in times and ("moe", m, "bf16") in times], W4A16_GOAL)
    for shape in ("d4096", "d8192"):
        check(f"W4A16 dense {shape} >= {W4A16_GOAL}x cuBLAS BF16 at M <= 16",
              [(m, times[(shape, m, "bf16")] / times[(shape, m, "w4a16")]) for m in ms
               if m <= 16 and (shape, m, "w4a16") in times], W4A16_GOAL)
    if 0.5 in ratios:
        others = [f"quads-bf16 k=0.5 ({o})" for o in RESIDUAL_GRANULARITIES if o != gran]
        for shape in sorted({k[0] for k in times}):
            for v in (f"quads k=0.5 ({gran})", f"quads-bf16 k=0.5 ({gran})", *others):
                check(f"{shape}: {v} time / naive time <= 1.10 at every M",
                      [(m, times[(shape, m, v)] / times[(shape, m, "naive")]) for m in ms
                       if (shape, m, v) in times and (shape, m, "naive") in times], 1.10,
                      larger_is_better=False, info=v in others)
    return out


def run(shapes: list[str], ms: list[int], ratios: list[float], sweep: bool, variants: tuple[str, ...] = ()) -> str:
    from verl_quads import nvfp4 as nv
    from verl_quads.nvfp4 import moe_routing as mr
    from verl_quads.nvfp4 import triton_gemm as tg

    dev = DEVICE
    gran = default_granularity()
    _variants(ratios, variants)  # unknown --variants: fail before any timing
    out = [f"device: {device_name()}",
           f"QUADS selection rule of the quads rows: residual_granularity={gran!r} (QuantConfig() default), "
           "per token; other rules: the comparison rows"]
    print("\n".join(out), flush=True)
    bw = _copy_bandwidth()
    out.append(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)")
    print(out[-1], flush=True)
    rows = _Rows()
    best_cfgs = []
    times: dict = {}
    g = torch.Generator(device=dev).manual_seed(0)
    if "moe" in shapes:
        rows += _moe_layer_rows(ms, ratios, bw, dev, g, times, variants)
        print(f"moe layer rows done", flush=True)
    for name in shapes:
        if name == "moe":
            continue
        grouped, n, k = SHAPES[name]
        e = NUM_EXPERTS if grouped else 1
        w = torch.randn(e, n, k, device=dev, generator=g, dtype=torch.float32) * 0.02
        amax = w.abs().amax(dim=(1, 2), keepdim=True)
        q = nv.quantize(w, nv.global_scale_from_amax(amax), backend="triton")
        w_packed, w_scale, w_gs = q.packed, q.block_scale, q.global_scale.reshape(-1)
        w_bf16 = w.to(torch.bfloat16)
        if not grouped:
            w_packed, w_scale, w_gs, w_bf16 = w_packed[0], w_scale[0], w_gs.reshape(()), w_bf16[0]
        del w
        for m in ms:
            tag = f"{name} M={m}"
            fp8_fn = None
            if grouped:
                s = m * TOP_K
                ids = torch.rand(m, e, device=dev, generator=g).argsort(-1)[:, :TOP_K]
                active = int(ids.unique().numel())
                n_rows = m if name == "w13" else s
                x = torch.randn(n_rows, k, device=dev, generator=g).to(torch.bfloat16)
                routing = mr.moe_align(ids, e, tg.grouped_block_m(-(-s // min(e, s))))
                a_rows = routing.sorted_tokens if name == "w13" else routing.sorted_slots
                counts = torch.bincount(ids.reshape(-1), minlength=e)
                offs = torch.cumsum(counts, 0).to(torch.int32)
                x_sorted = x[a_rows.long()].contiguous()
                base_fn, base_label = _bf16_grouped(x_sorted, w_bf16.transpose(-2, -1), offs, counts.tolist())
                wbytes = active * n * k * 9 // 16
                bf16_bytes = active * n * k * 2
                t_align, how = _time(lambda: mr.moe_align(ids, e, routing.block_m))
                rows.append([tag, "moe_align (routing sort + tile table)", how, t_align * 1e6, "-", "-", "-"])
            else:
                x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
                base_fn, base_label = (lambda: x @ w_bf16.t()), "bf16 torch.matmul"
                wbytes = n * k * 9 // 16
                bf16_bytes = n * k * 2
                routing = a_rows = None
            x[:, ::293] *= 30.0
            t_base, how = _time(base_fn)
            times[(name, m, "bf16")] = t_base
            rows.append([tag, base_label, how, t_base * 1e6, 1.0, bf16_bytes / t_base / 1e9, bf16_bytes / t_base / bw])
            if not grouped:
                fp8_fn, why = _fp8_rowwise(x, w_bf16)
                if fp8_fn is None:
                    print(f"{tag}: FP8 rowwise torch._scaled_mm skipped ({why})", flush=True)
                else:
                    t, how = _time(fp8_fn)
                    rows.append([tag, "fp8 rowwise torch._scaled_mm (+act quant)", how, t * 1e6, t_base / t,
                                 n * k / t / 1e9, n * k / t / bw])

            def gemm(op, cfg=None):
                if grouped:
                    return tg.nvfp4_gemm(op, w_packed, w_scale, w_gs, config=cfg, routing=routing, a_rows=a_rows,
                                         out_rows=m * TOP_K)
                return tg.nvfp4_gemm(op, w_packed, w_scale, w_gs, config=cfg)

            for label, mode, r, comb, rule in _variants(ratios, variants):
                cfg = None
                if sweep and mode in ("w4a16", "naive"):
                    op, _ = tg.quantize_activation(x, mode)
                    per = -(-(m * TOP_K) // min(e, m * TOP_K)) if grouped else m
                    cands = [c for c in _sweep_configs(per, routing.block_m if grouped else None)
                             if not grouped or c.block_m == routing.block_m]
                    timed = []
                    for c in cands:
                        try:
                            timed.append((graph_time_s(lambda c=c: gemm(op, c), iters=10, inner=5), c))
                        except Exception as ex:  # a config that does not compile/fit: skip it
                            print(f"  config {c} failed: {type(ex).__name__}: {str(ex)[:120]}", flush=True)
                    timed = [t for t in timed if t[0] is not None]
                    if timed:
                        t_best, cfg = min(timed, key=lambda t: t[0])
                        best_cfgs.append(f"{tag} {mode}: {cfg} {t_best * 1e6:.1f} us "
                                         f"(default {graph_time_s(lambda: gemm(op)) * 1e6:.1f} us)")
                        print(best_cfgs[-1], flush=True)

                def full(mode=mode, r=r, cfg=cfg, comb=comb, rule=rule):
                    o, _ = tg.quantize_activation(x, mode, residual_ratio=r, residual_per_token=True,
                                                  residual_combine=comb, residual_granularity=rule)
                    return gemm(o, cfg)

                t, how = _time(full)
                times[(name, m, label)] = t
                _record_combine_gap(times, (name, m), label, comb, full, x, r, rule)
                rows.append([tag, f"triton {label}", how, t * 1e6, t_base / t, wbytes / t / 1e9, wbytes / t / bw])
            torch.cuda.empty_cache()
        print(f"{name} rows done", flush=True)
    out.append(print_table(
        "NVFP4 fused GEMMs (triton backend) vs BF16; MoE layer and Qwen3 shapes at Qwen3-30B-A3B width",
        ["shape", "kernel", "timing", "us", "x bf16", "weight GB/s", "of copy BW"], rows))
    if best_cfgs:
        out.append("best launch configs (--sweep):\n" + "\n".join(best_cfgs))
    gaps = [f"  {k[0]} M={k[1]} {k[2][5:]}: "
            + (f"{times[(k[0], k[1], 'gap ' + k[2][5:])]:.2e}" if (k[0], k[1], 'gap ' + k[2][5:]) in times
               else "- (no fp4x2 row of this rule)")
            + f"; operand == torch reference bytes: {v}" for k, v in times.items() if k[2].startswith("same ")]
    if gaps:
        out.append("quads-bf16 vs quads (fp4x2) output, ||y_bf16 - y_fp4x2|| / ||y_fp4x2||:\n" + "\n".join(gaps))
        print(out[-1], flush=True)
    times = {k: v for k, v in times.items() if isinstance(v, float)}
    goals = _goal_lines(times, ms, ratios, gran)
    out += goals
    print("\n".join(goals), flush=True)
    return "\n".join(out)


# --- --model-graph: dense GEMMs timed as one layer of a captured decode step (issue #5) -----------

MODEL_GRAPH_SHAPES = "d4096,d8192"
MODEL_GRAPH_MAX_COPIES = 64


def model_graph_copies(bytes_per_copy: int, flush_bytes: int | None = None) -> int:
    """Weight copies one ``--model-graph`` replay walks so that it reads >= ``flush_bytes`` (default
    :data:`L2_FLUSH_BYTES`, > 2x the H200's L2) of weights: every call finds its weights outside L2, as each
    layer of a model does; at least 2, at most :data:`MODEL_GRAPH_MAX_COPIES`."""
    flush = L2_FLUSH_BYTES if flush_bytes is None else flush_bytes
    return max(2, min(MODEL_GRAPH_MAX_COPIES, -(-flush // max(1, bytes_per_copy))))


def model_graph_weights(n: int, k: int, dev, g: torch.Generator, flush_bytes: int | None = None):
    """One random dense weight ``[n, k]`` (``randn * 0.02`` from ``g``) in the copies ``--model-graph`` walks:
    (bf16 copies, NVFP4 ``(packed, block_scale)`` copies, 0-d float32 global scale); each form's copy count is
    :func:`model_graph_copies` of its own bytes (the NVFP4 form: codes + block scales)."""
    from verl_quads import nvfp4 as nv

    w = torch.randn(n, k, device=dev, generator=g, dtype=torch.float32) * 0.02
    q = nv.quantize(w, nv.global_scale_from_amax(w.abs().amax()), backend="triton")
    w_bf16 = w.to(torch.bfloat16)
    del w
    c16 = model_graph_copies(w_bf16.numel() * 2, flush_bytes)
    c4 = model_graph_copies(q.packed.numel() + q.block_scale.numel(), flush_bytes)
    bf16_copies = [w_bf16] + [w_bf16.clone() for _ in range(c16 - 1)]
    fp4_copies = [(q.packed, q.block_scale)] + [(q.packed.clone(), q.block_scale.clone()) for _ in range(c4 - 1)]
    return bf16_copies, fp4_copies, q.global_scale.reshape(())


def _bf16_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The dense BF16 baseline, ``x @ w.T`` (cuBLAS): ``x`` ``[M, K]``, ``w`` ``[N, K]``."""
    return x @ w.t()


def run_model_graph(shapes: list[str], ms: list[int], ratios: list[float], variants: tuple[str, ...] = (),
                    flush_bytes: int | None = None) -> str:
    """Dense GEMMs timed as they run inside a rollout engine's captured decode step: ONE CUDA graph holds
    ``C`` back-to-back calls, each on its own weight copy (``C`` from :func:`model_graph_copies`: cold L2 for
    every call, like successive layers), and the time per call is the replay time / ``C``. The main table
    captures one call per graph and reuses one weight (warm L2), so each of its times carries one graph launch
    (a few us at decode; an empty kernel measured 3.3-5.7 us there, session 12) that a model's graph pays once
    per step, not per layer. Same variants, same activation quantization per call, BF16 ``torch.matmul``
    (cuBLAS) baseline timed the same way in the same run (its own copy count: bytes differ); the per-call
    times of the main table's method (one call per graph, one weight) are printed next to it."""
    from verl_quads.nvfp4 import triton_gemm as tg

    dev = DEVICE
    out = [f"device: {device_name()}",
           "--model-graph: per call = replay time of ONE CUDA graph of C calls (each on its own weight copy, "
           f">= {(L2_FLUSH_BYTES if flush_bytes is None else flush_bytes) >> 20} MB of weights per replay: cold L2) / C; "
           "'1-call graph' = the main table's method (one call per graph, one weight: warm L2)"]
    print("\n".join(out), flush=True)
    rows = _Rows()
    times: dict = {}
    g = torch.Generator(device=dev).manual_seed(0)
    for name in shapes:
        grouped, n, k = SHAPES[name]
        if grouped:
            raise ValueError(f"--model-graph times dense shapes only, not {name!r}")
        bf16_copies, fp4_copies, gs = model_graph_weights(n, k, dev, g, flush_bytes)
        c16, c4 = len(bf16_copies), len(fp4_copies)
        for m in ms:
            tag = f"{name} M={m}"
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            x[:, ::293] *= 30.0
            t1, how1 = _time(lambda: _bf16_matmul(x, bf16_copies[0]))
            tc, howc = _time(_rotating(lambda i: _bf16_matmul(x, bf16_copies[i]), c16))
            tc /= c16
            times[(name, m, "bf16")] = (t1, tc)
            rows.append([tag, "bf16 torch.matmul", c16, how1, t1 * 1e6, 1.0, howc, tc * 1e6, 1.0])
            for label, mode, r, comb, rule in _variants(ratios, variants):
                def call(i, mode=mode, r=r, comb=comb, rule=rule):
                    o, _ = tg.quantize_activation(x, mode, residual_ratio=r, residual_per_token=True,
                                                  residual_combine=comb, residual_granularity=rule)
                    return tg.nvfp4_gemm(o, fp4_copies[i][0], fp4_copies[i][1], gs)

                t1, how1 = _time(lambda: call(0))
                tc, howc = _time(_rotating(call, c4))
                tc /= c4
                times[(name, m, label)] = (t1, tc)
                t16 = times[(name, m, "bf16")]
                rows.append([tag, f"triton {label}", c4, how1, t1 * 1e6, t16[0] / t1, howc, tc * 1e6, t16[1] / tc])
        del bf16_copies, fp4_copies
        if dev == "cuda":
            torch.cuda.empty_cache()
    out.append(print_table(
        "dense NVFP4 GEMMs vs BF16 as one layer of a captured decode step (--model-graph)",
        ["shape", "kernel", "copies C", "1-call timing", "1-call us", "x bf16", "C-call timing", "per call us",
         "x bf16 "], rows))
    goal = [f"goal (issue #5, --model-graph timing): W4A16 dense >= {W4A16_GOAL}x cuBLAS BF16 at M <= 16"]
    for name in shapes:
        pairs = [(m, times[(name, m, "bf16")][1] / times[(name, m, "w4a16")][1]) for m in ms
                 if m <= 16 and (name, m, "w4a16") in times]
        if pairs:
            ok = all(v >= W4A16_GOAL for _, v in pairs)
            goal.append(f"  {'PASS' if ok else 'FAIL'} {name}: " + ", ".join(f"M={m}: {v:.2f}x" for m, v in pairs))
    out += goal
    print("\n".join(goal), flush=True)
    return "\n".join(out)


# --- --sweep-decode: the W4A16 weight-streaming kernel's variants at decode shapes (issue #5) -------

L2_FLUSH_BYTES = 256 * 2**20  # > 2x the H200's 50 MB L2: each timed call reads weights no other call left in L2
DECODE_SHAPES = "moe,d8192,d4096"  # most important first: a run cut by --budget-s keeps these


def _focus_variants(rows: int, grouped: bool, current, tokens: int = 1):
    """``--focus`` (short sweep, issue #5), at most 9 per GEMM (12 with one activation row per chunk and a
    CUDA-core entry or none: the
    roofline candidates below; meant for ``--m 1,16`` at moe,d8192 in
    one ~150 s run on the H200; grouped GEMMs at >= 4 tokens: the entry, its ``x_pairs`` / pipelined twins and
    pipelined 2/4-row chunks, at most 10; one row per chunk (M=1): the entry, its ``x_pairs`` / pipelined twins and a
    few block-scale tiles with them, at most 12), in this order (a budget cut drops the last): the current DECODE_TABLE
    entry (``current``, may be None); its ``f16x2`` + ``late_scale`` twin (CUDA-core entries: pair
    decode, block scale per word: ~1 SASS instruction per weight element fewer in the offline sm_90
    count) or its ``bf16x2`` twin (tensor-core entries: bf16 pair decode + packed bf16 scale multiply,
    ~1.5 fewer); CUDA-core ``f16x2`` + ``late_scale`` variants over tile / pipeline / split-K target
    (with 4 rows per chunk when rows > 2, i.e. also against the tensor-core entry at M=16). The
    nibble-major activation (``xperm``) and pipelined ``bits`` variants of the previous focus run were
    slower or are already in the table: not repeated."""
    from verl_quads.nvfp4.triton_stream import StreamConfig

    bm = 1 if rows <= 1 else (2 if rows <= 2 else 4)
    out = [current] if current is not None else []
    if grouped and tokens >= 4:
        # session 8, issue #5 phase 1 (MoE at 16-64 tokens, ~1.6-4 slots per active expert): multi-row chunks with
        # row skipping (rs1: a chunk's invalid rows skip their FMAs at run time; removed from StreamConfig in session
        # 9) lost on the H200 (G1 at cd62c4a, cold L2, us):
        # w13 M=16 bm1 n16 kw128 w4 (entry) 109, bm2 rs1 same tile 136 (bm2 without rs1: 153), bm2 rs1 n64 kw32 w8 161,
        # bm4 rs1 n64 kw32 w8 235; w2 M=16 entry 58.9, bm2 rs1 n64 kw32 w8 86.2; at M=64 every CUDA-core variant >= 2.8x
        # the tensor-core kernel. Why (offline sm_90): each activation row of a chunk adds 8 gathers + 8 shared-memory
        # conversions (16 BAR) per K step, and 8-warp tiles (block_kw < threads) issue the gathers in the FMA layout
        # instead (w13 M=16 bm1 n16 kw128 w8: 467 us). Now: the entry's x_pairs / pipelined (p3: the activation via
        # cp.async, read back in the FMA layout, no conversion) twins and 2-row p3 chunks (bm2 p3 x2: 128 registers,
        # 13 BAR per step for both rows).
        p3 = dict(decode="f16x2", late_scale=True, block_scale=True, fixup=True, x_pairs=True, prefetch=False, pipe=3)
        if current is not None and current.late_scale and current.mma == 0:
            out += [replace(current, x_pairs=True), replace(current, x_pairs=True, prefetch=False, pipe=3),
                    replace(current, x_pairs=True, prefetch=True, pipe=1)]
        if bm <= 2:
            # H200 G2 at 7f3745b, M=16 (us): w13 entry 109, x2 112, p3 x2 107 (now the entry), bm2 p3 x2 113 / n64 kw32
            # 112, bm2 n8 kw128 wl x2 176 (rs1 185), bm1 wl x2 199 (wl: one word per thread, removed); w2 entry 57.4,
            # x2 53.5 (now the entry), p3 x2 61.3.
            out += [StreamConfig(block_m=2, block_n=16, block_kw=128, num_warps=4, **p3),
                    StreamConfig(block_m=2, block_n=64, block_kw=32, num_warps=4, **p3)]
        else:
            out += [StreamConfig(block_m=4, block_n=16, block_kw=128, num_warps=4, **p3),
                    StreamConfig(block_m=2, block_n=16, block_kw=128, num_warps=4, **p3)]
        return list(dict.fromkeys(out))[:10]
    if bm == 1 and (current is None or current.mma == 0):
        # issue #5 session 7, H200 roofline (docs/bench_rollout_h200_gemv_roofline_s7.txt): the per-word block-scale
        # byte loads bound the reads (old d8192 entry read-only 39.8 us; 13.4 without scale loads; 18.3 with a
        # per-block scale tile); block_scale loads that tile. Its candidates then (n256/n128 kw16 w4, n64 kw32 w2/w4, n16
        # kw128 w4, n8 kw128 w2, n16 kw64 w2, all bs) are measured (docs/bench_rollout_h200_session8.txt) and the
        # winners are in DECODE_TABLE.
        late = dict(decode="f16x2", late_scale=True, fixup=True)
        bs = dict(late, block_scale=True)
        # session 8, issue #5 phase 2 (the bs tiling reads at 46% of copy BW at d8192). Offline sm_90 of the d8192 entry
        # (n16 kw128 w4): per K step 8 two-byte activation gathers (1 per thread, lanes 16 bytes apart), each converted
        # through shared memory to the FMA layout (20 BAR per step). With block_kw < threads Triton instead issues the
        # gathers in the FMA layout (lanes 64 bytes apart, 32 per thread): H200 G1 (cd62c4a) n16 kw128 w8 467 us vs w4
        # 109 at MoE w13 M=16, so those tiles are out. Candidates: x_pairs (int32 activation pairs: half the gathers),
        # pf2 (two K steps of weight loads in flight), Triton's pipeliner (p3, cp.async), n16 kw256 w8 (same
        # per-thread tile, 2x threads per program). Offline, p3 also drops the conversions: the activation goes to shared
        # memory by cp.async and is read back in the FMA layout (n16 kw128 w4 p3 x2: 4 BAR per step, 95 registers).
        # wl: one word per thread and row, the gathers' own layout (offline: 2 BAR per step, 128 registers).
        # H200 G2 at 7f3745b (cold L2, us): d8192 entry 19.6, x2 18.0, p3 x2 17.3 (now the entry), p4 x2 17.9, n16 kw256 w8
        # p3 x2 18.9, wl 30.0, wl x2 40.2, pf2 24.7, x2 pf2 21.4, n8 kw128 wl x2 29.0; w13 M=1 entry 12.2, x2 / p3 x2 11.2;
        # w2 M=1 entry 8.61, x2 7.36, p3 x2 8.49, wl 28.3. The losers (wl, pf2) were removed from StreamConfig
        # (session 9).
        # G3 at 0cd88e7: qkv x2 5.45 (entry 5.96), o_proj n16 kw256 w8 p3 x2 5.33 (6.21), d4096 n8 kw128 w2 p3 x2 6.95
        # (8.34): now the entries. Next: the pipelined x2 entries' split-K target (occ 8), 2 stages, and tiles around them.
        if current is not None and current.late_scale and current.mma == 0:
            out += [replace(current, x_pairs=True), replace(current, x_pairs=True, prefetch=False, pipe=3)]
            if current.pipe > 1:
                out += [replace(current, occ=8), replace(current, pipe=2)]
        p3 = dict(bs, x_pairs=True, prefetch=False)
        out += [StreamConfig(block_m=1, block_n=16, block_kw=128, num_warps=4, pipe=3, **p3),
                StreamConfig(block_m=1, block_n=16, block_kw=128, num_warps=4, x_pairs=True, **bs),
                StreamConfig(block_m=1, block_n=8, block_kw=128, num_warps=2, pipe=3, **p3),
                StreamConfig(block_m=1, block_n=16, block_kw=256, num_warps=8, pipe=3, **p3),
                StreamConfig(block_m=1, block_n=32, block_kw=128, num_warps=8, pipe=3, **p3),
                StreamConfig(block_m=1, block_n=8, block_kw=256, num_warps=4, pipe=3, **p3),
                StreamConfig(block_m=1, block_n=16, block_kw=64, num_warps=2, pipe=3, **p3)]
        return list(dict.fromkeys(out))[:12]
    if current is not None and current.mma == 0:
        out.append(replace(current, decode="f16x2", late_scale=True))
    elif current is not None:
        out.append(replace(current, decode="bf16x2"))
    late = dict(decode="f16x2", late_scale=True, fixup=True, num_warps=4)
    out += [StreamConfig(block_m=bm, block_n=128, block_kw=16, prefetch=False, pipe=3, **late),
            StreamConfig(block_m=bm, block_n=128, block_kw=16, prefetch=False, pipe=3, occ=8, **late),
            StreamConfig(block_m=bm, block_n=256 if bm == 1 else 64, block_kw=16, **late),  # bm4 n256 spills
            StreamConfig(block_m=bm, block_n=64, block_kw=32, **late)]
    # session 8: the per-block scale tile (block_scale, the M=1 entries' win) with 2/4-row chunks
    bs = dict(late, block_scale=True)
    out += [StreamConfig(block_m=bm, block_n=16, block_kw=128, **bs),
            StreamConfig(block_m=bm, block_n=64, block_kw=32, **bs),
            StreamConfig(block_m=bm, block_n=32, block_kw=64, **bs)]
    return list(dict.fromkeys(out))[:9]  # a twin may repeat one of the grid


def _decode_variants(rows: int, grouped: bool, tokens: int):
    """(stage-1 configs, stage-2 variations of a config): a grid over tile shape and warps for the
    CUDA-core kernel (dense M <= 4 or any grouped GEMM: ~1-3 rows per expert at decode) and the
    tensor-core one (dense M >= 4, grouped at >= 16 tokens), then decode / prefetch / split-K / stages
    variations of the fastest correct few. ``rows``: M (dense) or rows per active expert (grouped)."""
    from verl_quads.nvfp4.triton_stream import StreamConfig

    first = []
    if grouped or rows <= 4:
        bm = 1 if rows <= 1 else (2 if rows <= 2 else 4)
        for bn, bkw, warps in ((32, 16, 2), (64, 16, 4), (64, 32, 4), (128, 8, 4), (128, 16, 4), (128, 32, 8),
                               (256, 8, 8), (256, 16, 4), (256, 16, 8)):
            first.append(StreamConfig(block_m=bm, block_n=bn, block_kw=bkw, num_warps=warps))
        for bn, bkw in ((128, 16), (64, 32)):  # software-pipelined K loop (asynchronous 16-byte weight copies)
            first.append(StreamConfig(block_m=bm, block_n=bn, block_kw=bkw, num_warps=4, prefetch=False, pipe=3))
        for bn, bkw in ((128, 16), (128, 8)):  # nibble-major activation copy: vector activation loads
            first.append(StreamConfig(block_m=bm, block_n=bn, block_kw=bkw, num_warps=4, xperm=True))
        if grouped and tokens >= 4:  # some experts get 2-4 rows: fewer chunks per tile
            for bm2 in (2, 4):
                first += [StreamConfig(block_m=bm2, block_n=128, block_kw=16, num_warps=4),
                          StreamConfig(block_m=bm2, block_n=64, block_kw=16, num_warps=4)]
    if (not grouped and rows >= 4) or (grouped and tokens >= 16):
        for bn, bkw, mma, stages in ((64, 16, 1, 1), (128, 16, 1, 1), (64, 32, 1, 1), (128, 16, 2, 1),
                                     (64, 16, 1, 3), (128, 32, 1, 3)):
            first.append(StreamConfig(block_m=16, block_n=bn, block_kw=bkw, mma=mma, num_warps=4, num_stages=stages))

    def second(c: StreamConfig, split_auto: int):
        out = [replace(c, fixup=not c.fixup)]
        if c.pipe == 1 and not c.late_scale:
            out += [replace(c, decode="f16"), replace(c, prefetch=not c.prefetch)]
        if c.mma == 0:
            out += [replace(c, occ=8), replace(c, xperm=not c.xperm)]
        for f in (2, 0.5):
            s = int(split_auto * f)
            if s >= 1 and s != split_auto:
                out.append(replace(c, split_k=s))
        if c.mma:
            out.append(replace(c, num_stages=3 if c.num_stages == 1 else 1))
        return out

    return first, second


def _auto_split(cfg, m_rows_live: int, n: int, k: int) -> int:
    """The split_k that split_k=0 resolves to in the stream kernel's launch (:func:`triton_stream.stream_split`)."""
    from verl_quads.nvfp4.triton_stream import stream_split

    return stream_split(replace(cfg, split_k=0), k // 8, m_rows_live, -(-n // cfg.block_n), torch.device(DEVICE))[0]


def _err(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> tuple[float, bool]:
    """(max |y - ref| / max |ref|, every element within 1 bf16 ulp(ref) + the float32 summation bound)."""
    r = ref.float()
    d = (y.float() - r).abs()
    ulp = torch.where(r.abs() > 0, 2.0 ** torch.floor(torch.log2(r.abs().clamp(min=1e-30))) * torch.finfo(y.dtype).eps,
                      torch.full_like(r, torch.finfo(y.dtype).tiny))
    return float(d.max() / r.abs().max().clamp(min=1e-30)), bool((d <= ulp + bound).all())


def _rotating(fn_of_copy, copies: int):
    """One timed call = ``fn_of_copy(i)`` for every weight copy i (cold L2 for each); time / copies."""
    def fn():
        for i in range(copies):
            fn_of_copy(i)
    return fn


def _gemm_weights(grouped: bool, n: int, k: int, dev: str, g: torch.Generator):
    """Random NVFP4 weights of one bench GEMM: ``(packed, block_scale, global_scale, float32 dequantized, bf16
    source)``; grouped: ``[E, n, k]`` with one global scale per expert (``[E]``), else ``[n, k]`` with a 0-d one
    (the bf16 source keeps its leading ``[1]`` then: ``[1, n, k]``)."""
    from verl_quads import nvfp4 as nv
    from verl_quads.rollout import emulation as em

    e = NUM_EXPERTS if grouped else 1
    w = torch.randn(e, n, k, device=dev, generator=g) * 0.02
    q = nv.quantize(w, nv.global_scale_from_amax(w.abs().amax(dim=(1, 2), keepdim=True)), backend="triton")
    wp, wsc, wgs = q.packed, q.block_scale, q.global_scale.reshape(-1)
    if grouped:
        return wp, wsc, wgs, em.weight_f32(wp, wsc, wgs.reshape(e, 1, 1)), w.to(torch.bfloat16)
    wp, wsc, wgs = wp[0], wsc[0], wgs.reshape(())
    return wp, wsc, wgs, em.weight_f32(wp, wsc, wgs), w.to(torch.bfloat16)


def run_sweep_decode(shapes: list[str], ms: list[int], budget_s: float = 1e9, focus: bool = False) -> str:
    """Time every streaming-kernel variant (and the current default kernel, and the BF16 baseline) at
    decode shapes with cold L2 (rotating weight copies / routings), check each variant against the
    torch reference, and print the fastest correct variant per shape with a paste-ready
    ``DECODE_TABLE``. Past ``budget_s`` seconds of wall time only the baselines, the tensor-core kernel
    and the first stage-1 config of each remaining shape are timed (the table is still printed).
    ``focus``: only :func:`_focus_variants` (<= 6 per GEMM), no stage 2."""
    import time

    from verl_quads.nvfp4 import moe_routing as mr
    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.nvfp4 import triton_stream as ts

    dev = DEVICE
    out = [f"device: {device_name()}"]
    print(out[0], flush=True)
    bw = _copy_bandwidth()
    out.append(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s (read + write); timings: CUDA graph of one call "
               f"per weight copy (or routing), copies so that >= {L2_FLUSH_BYTES >> 20} MB are read per replay (cold L2)")
    print(out[-1], flush=True)
    rows = _Rows()
    table: dict = {}
    summary = []
    t_start = time.perf_counter()

    def over_budget() -> bool:
        return time.perf_counter() - t_start > budget_s
    g = torch.Generator(device=dev).manual_seed(0)
    gemms = []  # (name, grouped, n, k)
    for s in shapes:
        if s == "moe":
            gemms += [("moe w13", True) + SHAPES["w13"][1:], ("moe w2", True) + SHAPES["w2"][1:]]
        else:
            gemms.append((s,) + SHAPES[s])
    for name, grouped, n, k in gemms:
        e = NUM_EXPERTS if grouped else 1
        wp, wsc, wgs, wf, w_bf16 = _gemm_weights(grouped, n, k, dev, g)
        for m in ms:
            tag = f"{name} M={m}"
            if grouped:
                s_slots = m * TOP_K
                x = torch.randn(m if name.endswith("w13") else s_slots, k, device=dev, generator=g).to(torch.bfloat16)
                x[:, ::293] *= 30.0
                per = -(-s_slots // min(e, s_slots))
                ids0 = torch.rand(m, e, device=dev, generator=g).argsort(-1)[:, :TOP_K]
                active = int(ids0.unique().numel())
                wbytes, bbytes = active * n * k * 9 // 16, active * n * k * 2
                copies = max(1, min(64, -(-L2_FLUSH_BYTES // wbytes)))
                id_sets = [ids0] + [torch.rand(m, e, device=dev, generator=g).argsort(-1)[:, :TOP_K]
                                    for _ in range(copies - 1)]
                routs = [mr.moe_align(ids, e, tg.pick_block_m(per)) for ids in id_sets]
                a_rows = [r.sorted_tokens if name.endswith("w13") else r.sorted_slots for r in routs]
                x_sorted = [x[ar.long()].contiguous() for ar in a_rows]
                offs = [torch.cumsum(torch.bincount(ids.reshape(-1), minlength=e), 0).to(torch.int32) for ids in id_sets]
                w_t = w_bf16.transpose(-2, -1)

                def base(i):
                    return torch._grouped_mm(x_sorted[i], w_t, offs=offs[i])

                base_label = "bf16 torch._grouped_mm"

                def run_cfg(cfg, i=0):
                    return tg.nvfp4_gemm(op, wp, wsc, wgs, routing=routs[i], a_rows=a_rows[i], out_rows=s_slots,
                                         config=cfg)

                # reference for routing 0: slot r of expert ids0.flat[r] reads x row a(r)
                flat = ids0.reshape(-1)
                xr = x.float()[(torch.arange(s_slots, device=dev) // TOP_K) if name.endswith("w13")
                               else torch.arange(s_slots, device=dev)]
                ref = torch.empty(s_slots, n, device=dev)
                bound = torch.empty(s_slots, n, device=dev)
                for ex in flat.unique().tolist():
                    sel = flat == ex
                    ref[sel] = xr[sel] @ wf[ex].t()
                    bound[sel] = 4 * k * torch.finfo(torch.float32).eps * (xr[sel].abs() @ wf[ex].abs().t())
                ref = ref.to(torch.bfloat16)
            else:
                x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
                x[:, ::293] *= 30.0
                per = m
                wbytes, bbytes = n * k * 9 // 16, n * k * 2
                copies = max(1, min(64, -(-L2_FLUSH_BYTES // wbytes)))
                bcopies = max(1, min(64, -(-L2_FLUSH_BYTES // bbytes)))
                wps = [wp] + [wp.clone() for _ in range(copies - 1)]
                wscs = [wsc] + [wsc.clone() for _ in range(copies - 1)]
                wbs = [w_bf16[0]] + [w_bf16[0].clone() for _ in range(bcopies - 1)]

                def base(i):
                    return x @ wbs[i].t()

                base_label = "bf16 torch.matmul (cuBLAS)"

                def run_cfg(cfg, i=0):
                    return tg.nvfp4_gemm(op, wps[i], wscs[i], wgs, config=cfg)

                xr = x.float()
                ref = (xr @ wf.t()).to(torch.bfloat16)
                bound = 4 * k * torch.finfo(torch.float32).eps * (xr.abs() @ wf.abs().t())
            op, _ = tg.quantize_activation(x, "w4a16")
            ncb = len(wbs) if not grouped else copies
            t_base = _time(_rotating(base, ncb))[0] / ncb
            rows.append([tag, base_label, "-", t_base * 1e6, 1.0, bbytes / t_base / 1e9, bbytes / t_base / bw, "-", "-"])

            def measure(label, cfg):
                try:
                    rel, ok = _err(run_cfg(cfg), ref, bound)
                    t = _time(_rotating(lambda i: run_cfg(cfg, i), copies))[0] / copies
                except Exception as ex:  # a config that does not compile or fit: reported, skipped
                    print(f"  {tag} {label}: failed {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                    return None
                rows.append([tag, label, "ok" if ok else "WRONG", t * 1e6, t_base / t, wbytes / t / 1e9, wbytes / t / bw,
                             f"{rel:.2e}", cfg.label if isinstance(cfg, ts.StreamConfig) else "-"])
                return t, ok

            default = tg.pick_config(per, routs[0].tile_expert.numel() if grouped else -(-m // tg.pick_block_m(m)),
                                     n, k, torch.device(dev), block_m=routs[0].block_m if grouped else None,
                                     grouped=grouped)
            r_def = measure("tensor-core kernel (pick_config, before #5 decode)", default)
            first, second = _decode_variants(per, grouped, m)
            if focus:
                first = _focus_variants(per, grouped, ts.decode_config(s_slots if grouped else m, n, k, grouped), m)
            timed = []
            for i_cfg, cfg in enumerate(first):
                if i_cfg and over_budget():
                    print(f"  {tag}: wall-time budget {budget_s:.0f} s spent, {len(first) - i_cfg} stage-1 configs "
                          "skipped", flush=True)
                    break
                r = measure(f"stream {cfg.label}", cfg)
                if r and r[1]:
                    timed.append((r[0], cfg))
            timed.sort(key=lambda t: t[0])
            for _, cfg in timed[:0 if (over_budget() or focus) else 2]:
                live = min(e, s_slots) if grouped else -(-m // cfg.block_m)
                for c2 in second(cfg, _auto_split(cfg, live, n, k)):
                    r = measure(f"stream {c2.label}", c2)
                    if r and r[1]:
                        timed.append((r[0], c2))
            timed.sort(key=lambda t: t[0])
            if timed:
                t_best, best = timed[0]
                line = (f"{tag}: best stream {best.label} {t_best * 1e6:.1f} us = {t_base / t_best:.2f}x {base_label}, "
                        f"{wbytes / t_best / bw:.0%} of copy BW; tensor-core kernel "
                        f"{(r_def[0] * 1e6) if r_def else float('nan'):.1f} us")
                summary.append(line)
                print(line, flush=True)
                bucket = ts.decode_bucket(s_slots if grouped else m)
                if bucket is not None and (r_def is None or not r_def[1] or t_best < r_def[0]):
                    table[(grouped, bucket, n, k)] = best
            del op
            torch.cuda.empty_cache()
        del wf, w_bf16
        torch.cuda.empty_cache()
    out.append(print_table(
        "W4A16 decode: weight-streaming kernel variants vs BF16 (cold L2); 'check': within 1 bf16 ulp + fp32 "
        "summation bound of the torch reference at every element",
        ["shape", "kernel", "check", "us", "x bf16", "weight GB/s", "of copy BW", "max err/max|ref|", "config"], rows))
    out.append("best per shape:\n" + "\n".join(summary))
    if "moe" in shapes and table:
        # the whole routed-experts layer with the table just found (moe_forward dispatches w4a16 through it);
        # timed like the main bench (one routing: the active experts' NVFP4 weights may stay in L2)
        saved = dict(ts.DECODE_TABLE)
        ts.DECODE_TABLE.update(table)
        try:
            layer_rows = _moe_layer_rows(ms, [], bw, dev, g, {})
        finally:
            ts.DECODE_TABLE.clear()
            ts.DECODE_TABLE.update(saved)
        out.append(print_table("MoE layer (moe_forward) with the DECODE_TABLE below (w4a16 only; naive unchanged); "
                               "one routing, warm L2 as in the main bench",
                               ["shape", "kernel", "timing", "us", "x bf16", "weight GB/s", "of copy BW"], layer_rows))
    snippet = ["DECODE_TABLE = {  # verl-quads bench rollout --sweep-decode, " + device_name()]
    for key, c in sorted(table.items()):
        snippet.append(f"    {key}: StreamConfig(block_m={c.block_m}, block_n={c.block_n}, block_kw={c.block_kw}, "
                       f"split_k={c.split_k}, num_warps={c.num_warps}, num_stages={c.num_stages}, mma={c.mma}, "
                       f"decode={c.decode!r}, prefetch={c.prefetch}, fixup={c.fixup}"
                       + (f", occ={c.occ}" if c.occ != 4 else "")
                       + (f", pipe={c.pipe}" if c.pipe != 1 else "") + (", xperm=True" if c.xperm else "")
                       + (", late_scale=True" if c.late_scale else "")
                       + (", block_scale=True" if c.block_scale else "")
                       + (", x_pairs=True" if c.x_pairs else "")
                       + "),")
    snippet.append("}")
    out.append("\n".join(snippet))
    print("\n".join(snippet), flush=True)
    return "\n".join(out)


# --- --sweep-mid: the tensor-core GEMM's launch configs at 16..256 rows (issue #5, mid M) ------------

MID_SHAPES = "moe,d8192,d4096"
# stage-1 tiles (swap, block_n, block_k, num_warps, num_stages) per block_m: small row tiles favour the
# swapped MMA (weight rows on the MMA's M side); big ones the plain layout. Each at the split_k that fills
# the GPU (the rule of pick_config); stage 2 varies split_k / stages / warps around the fastest two.
_MID_SWAP = ((64, 128, 4, 3), (128, 128, 4, 3), (128, 64, 4, 3), (64, 256, 4, 3), (256, 128, 8, 3), (128, 256, 8, 4))
_MID_PLAIN = ((64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3), (128, 128, 4, 4), (256, 128, 8, 4))


def _mid_live_tiles(per_group_rows: list[int], bm: int) -> int:
    """M-tiles that do work: sum over groups of cdiv(rows, bm) (a dense GEMM is one group)."""
    return sum(-(-r // bm) for r in per_group_rows if r > 0)


def _mid_split(live_m_tiles: int, bn: int, bk: int, n: int, k: int, sms: int, occ: int) -> int:
    """split_k by pick_config's rule: double while the grid stays <= ``occ`` programs per SM and every K
    range keeps >= 2 steps of ``bk``."""
    tiles = live_m_tiles * -(-n // bn)
    split = 1
    while tiles * split * 2 <= occ * sms and k // (bk * split * 2) >= 2:
        split *= 2
    return split


def _mid_block_ms(rows: int, grouped: bool) -> list[int]:
    """block_m values tried at ~``rows`` rows per group: pick_block_m's, half of it (if >= 16) and, for a
    grouped GEMM whose groups are about full, twice it (random routing: many groups then exceed bm)."""
    from verl_quads.nvfp4.triton_gemm import pick_block_m

    bm0 = pick_block_m(rows)
    out = ([bm0 // 2] if bm0 > 16 else []) + [bm0]
    if grouped and rows >= bm0 // 2 and bm0 < 64 and rows > 4:
        out.append(2 * bm0)
    return out


def _mid_smem_ok(cfg, a4: bool) -> bool:
    """Whether a GemmConfig's shared memory stays under the H200's 227 KB per block by a conservative
    estimate: ``num_stages`` copies of the activation tile (bf16, or packed NVFP4 for W4A4) + the packed
    weight tile + its scales, plus one decoded bf16 weight tile (the offline sm_90 compile of
    bm128 n256 k128 st4 w4a16 needed 246 KB, this estimate 264 KB)."""
    act = cfg.block_m * cfg.block_k * (1 if a4 else 4) // 2
    w = cfg.block_n * cfg.block_k // 2 + cfg.block_n * cfg.block_k // 16
    return cfg.num_stages * (act + w) + cfg.block_n * cfg.block_k * 2 <= 232448


def _mid_stage1(rows: int, grouped: bool, per_group_rows: list[int], n: int, k: int, sms: int, a4: bool,
                default):
    """Stage-1 GemmConfigs for ``--sweep-mid``: ``default`` first, then per block_m of :func:`_mid_block_ms`
    the swapped tiles (block_m <= 64; w4a16: with ``natural`` K-order tiles, the old (even, odd) split measured
    1.2-2x slower in session 5) and the plain tiles (W4A4 / ``a4``: 3 of each), split_k by
    :func:`_mid_split` (occupancy 4 programs per SM when block_m <= 32, else 2, as pick_config), those
    passing :func:`_mid_smem_ok`. At most 25 configs, no duplicates."""
    from verl_quads.nvfp4.triton_gemm import GemmConfig

    out = [default]
    for bm in _mid_block_ms(rows, grouped):
        live = _mid_live_tiles(per_group_rows, bm)
        occ = 4 if bm <= 32 else 2
        swap = _MID_SWAP[:3] if a4 else _MID_SWAP
        plain = _MID_PLAIN[:3] if a4 else _MID_PLAIN
        if bm >= 128:
            swap = swap[:2]
        elif bm <= 16 and not a4:
            plain = plain[:3]
        for is_swap, tiles in ((True, swap), (False, plain)):
            for bn, bk, warps, stages in tiles:
                c = GemmConfig(block_m=bm, block_n=bn, block_k=bk, block_k2=64,
                               split_k=_mid_split(live, bn, bk, n, k, sms, occ), num_warps=warps, num_stages=stages,
                               swap=is_swap, natural=is_swap and not a4)
                if _mid_smem_ok(c, a4):
                    out.append(c)
    return list(dict.fromkeys(out))[:25]


def _mid_stage2(cfg, k: int):
    """Stage-2 variations of a fast w4a16 config: split_k x2 and /2 (K ranges of >= 2 steps), stages +-1
    (2..4), the other warp count (those passing :func:`_mid_smem_ok`)."""
    out = []
    for s in (cfg.split_k * 2, cfg.split_k // 2):
        if s >= 1 and k // (cfg.block_k * s) >= 2:
            out.append(replace(cfg, split_k=s))
    for st in (cfg.num_stages - 1, cfg.num_stages + 1):
        if 2 <= st <= 4:
            out.append(replace(cfg, num_stages=st))
    out.append(replace(cfg, num_warps=8 if cfg.num_warps == 4 else 4))
    return [c for c in out if _mid_smem_ok(c, False)]


def _mid_stream(rows: int, current):
    """StreamConfig (tensor-core, ``mma`` 1/2) variants of the weight-streaming kernel at M <= 64:
    the current DECODE_TABLE entry (may be None) and 4 tiles with bits / bf16x2 decode."""
    from verl_quads.nvfp4.triton_stream import StreamConfig

    out = [current] if current is not None else []
    bm = 16 if rows <= 16 else 32
    out += [StreamConfig(block_m=bm, block_n=128, block_kw=16, mma=2, prefetch=False),
            StreamConfig(block_m=bm, block_n=128, block_kw=16, mma=2, decode="bf16x2", prefetch=False),
            StreamConfig(block_m=bm, block_n=128, block_kw=32, mma=1, decode="bf16x2", prefetch=False, num_stages=3),
            StreamConfig(block_m=bm, block_n=64, block_kw=32, mma=1, decode="bf16x2", prefetch=False)]
    return list(dict.fromkeys(out))[:5]


def _cfg_label(cfg) -> str:
    """Short name of a GemmConfig / StreamConfig for tables, e.g. ``tc swap bm16 n64 k128 s1 w4 st3``."""
    from verl_quads.nvfp4.triton_stream import StreamConfig

    if cfg is None:
        return "default"
    if isinstance(cfg, StreamConfig):
        return "stream " + cfg.label
    return (f"tc {'swap ' if cfg.swap else ''}{'nat ' if cfg.natural else ''}bm{cfg.block_m} n{cfg.block_n} "
            f"k{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}")


def moe_nvfp4_weights(dev: str, g: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Random routed-expert weights at Qwen3-30B-A3B width (``NUM_EXPERTS`` experts, w13 ``[E, 2I, H]``, w2
    ``[E, H, I]``), NVFP4 with one global scale per expert: ``{"w13": (packed, block_scale, global_scale [E]),
    "w2": (...)}`` as :func:`triton_gemm.moe_forward` takes them."""
    from verl_quads import nvfp4 as nv

    hidden, inter = SHAPES["w13"][2], SHAPES["w13"][1] // 2
    qs = {}
    for name, (n, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
        w = torch.randn(NUM_EXPERTS, n, k, device=dev, generator=g) * 0.02
        q = nv.quantize(w, nv.global_scale_from_amax(w.abs().amax(dim=(1, 2), keepdim=True)), backend="triton")
        qs[name] = (q.packed, q.block_scale, q.global_scale.reshape(-1))
        del w
    return qs


def _profile_moe_layer(m: int, modes: tuple[str, ...], calls: int = 5) -> str:
    """Where the time of :func:`triton_gemm.moe_forward` goes at ``m`` tokens (Qwen3-30B-A3B width,
    random top-8 routing, default configs): a torch.profiler trace of ``calls`` eager calls per mode,
    the top 10 device kernels by total time (per layer call: microseconds, launches, share), with the
    block_m / GemmConfig / StreamConfig each GEMM resolves to."""
    from verl_quads.bench.profile import kernel_table
    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.nvfp4 import triton_stream as ts

    dev = DEVICE
    g = torch.Generator(device=dev).manual_seed(1)
    e, hidden, inter = NUM_EXPERTS, SHAPES["w13"][2], SHAPES["w13"][1] // 2
    qs = moe_nvfp4_weights(dev, g)
    x = torch.randn(m, hidden, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.rand(m, e, device=dev, generator=g).argsort(-1)[:, :TOP_K]
    sw = torch.softmax(torch.randn(m, TOP_K, device=dev, generator=g), -1)
    s = m * TOP_K
    per = -(-s // min(e, s))
    bm = tg.grouped_block_m(per)
    bm16 = tg.moe_block_m(s, e, x, qs["w13"][0], qs["w2"][0])  # w4a16's routing (w4a16 values = x)
    t_max = -(-s // bm) + min(e, s)
    text = [f"where the time goes: moe_forward at M={m} ({s} token-slots, ~{per} rows per expert, block_m {bm}"
            f"{f' (w4a16: {bm16}, the Gluon kernels)' if bm16 != bm else ''}, {t_max} M-tiles in the grid); "
            f"torch.profiler, {calls} eager calls per mode, device kernels only"]
    for name, n, k in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
        stream = ts.decode_config(s, n, k, True)
        tc, tc4 = (tg.pick_config(per, t_max, n, k, torch.device(dev), block_m=bm, grouped=True, a4=a4)
                   for a4 in (False, True))
        text.append(f"  {name} [{n}x{k}] default: w4a16 -> {_cfg_label(stream) if stream else _cfg_label(tc)}; "
                    f"naive -> {_cfg_label(tc4)}")
    for mode in modes:
        def fn(mode=mode):
            return tg.moe_forward(x, sw, ids, *qs["w13"], *qs["w2"], mode)

        total, _, kernels = kernel_table(fn, calls)
        rows = [[name[:70], f"{us:.1f}", f"{cnt:g}", f"{us / max(total, 1e-9):.0%}"] for name, us, cnt in kernels[:10]]
        text.append(print_table(f"moe_forward {mode} M={m}: top device kernels, {total:.1f} us of kernel time per "
                                "layer call", ["kernel", "us per call", "launches per call", "share"], rows))
    del qs
    torch.cuda.empty_cache()
    return "\n".join(text)


def _mid_point_inputs(name: str, grouped: bool, n: int, k: int, m: int, dev: str, g, num_experts: int, top_k: int):
    """(x, ids): the activation ``[rows, K]`` bf16 of one --sweep-mid point (w13: M token rows; w2: M*top_k
    slot rows; dense: M rows; an outlier column every 293) and, for a grouped GEMM, random top-k expert ids
    ``[M, top_k]`` (None for dense)."""
    rows = (m if name.endswith("w13") else m * top_k) if grouped else m
    x = torch.randn(rows, k, device=dev, generator=g).to(torch.bfloat16)
    x[:, ::293] *= 30.0
    ids = torch.rand(m, num_experts, device=dev, generator=g).argsort(-1)[:, :top_k] if grouped else None
    return x, ids


def _mid_compile_jobs(jobs: list, num_experts: int, top_k: int, device: str = "cuda") -> list[str]:
    """Worker of ``--sweep-mid``'s parallel precompile: run each job ``(name, grouped, n, k, m, mode, cfg)``
    once on random data of the point's shapes (Triton's JIT compiles it for exactly the specialization the
    timed launch has and stores it in its on-disk cache, where the parent process finds it). Returns one
    line per failed job (the parent reports it again when it measures that config)."""
    from verl_quads.nvfp4 import moe_routing as mr
    from verl_quads.nvfp4 import triton_gemm as tg

    g = torch.Generator(device=device).manual_seed(0)
    cache: dict = {}
    failed = []
    for name, grouped, n, k, m, mode, cfg in jobs:
        e = num_experts if grouped else 1
        if (name, m) not in cache:
            x, ids = _mid_point_inputs(name, grouped, n, k, m, device, g, num_experts, top_k)
            if (n, k, grouped) not in cache:
                cache[(n, k, grouped)] = (torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device),
                                          torch.full((e, n, k // 16), 1.0, device=device).to(torch.float8_e4m3fn),
                                          torch.ones(e, device=device))
            cache[(name, m)] = (x, ids, {md: tg.quantize_activation(x, md)[0] for md in ("w4a16", "naive")})
        x, ids, ops = cache[(name, m)]
        wp, wsc, wgs = cache[(n, k, grouped)]
        try:
            if grouped:
                s = m * top_k
                bm = cfg.block_m if isinstance(cfg, tg.GemmConfig) else tg.grouped_block_m(-(-s // min(e, s)))
                r = mr.moe_align(ids, e, bm)
                tg.nvfp4_gemm(ops[mode], wp, wsc, wgs, routing=r,
                              a_rows=r.sorted_tokens if name.endswith("w13") else r.sorted_slots, out_rows=s, config=cfg)
            else:
                tg.nvfp4_gemm(ops[mode], wp[0], wsc[0], wgs.reshape(()), config=cfg)
        except Exception as ex:  # reported; the parent measures (and reports) it again
            failed.append(f"{name} M={m} {mode} {_cfg_label(cfg)}: {type(ex).__name__}: {str(ex)[:120]}")
    if device == "cuda":
        torch.cuda.synchronize()
    return failed


class _MidPool:
    """--sweep-mid's parallel precompile: ``workers`` spawned processes (the GPU host's CPU cores; one
    Triton compile of the tensor-core kernel takes ~1-4 s of one core) run :func:`_mid_compile_jobs` so
    that the timed loop finds its kernels in Triton's on-disk cache. :meth:`submit` deals jobs round-robin
    (priority order kept per worker) and returns at once; :meth:`wait` collects them, giving up after a
    timeout (the timed loop then compiles what is missing itself) and returns one status line."""

    def __init__(self, workers: int):
        import multiprocessing as mp

        self.workers = workers
        self.pool = mp.get_context("spawn").Pool(workers) if workers > 0 else None
        self.res = None

    def submit(self, jobs: list) -> None:
        import time

        self.t0, self.n = time.perf_counter(), len(jobs)
        if self.pool is not None and jobs:
            chunks = [jobs[i::self.workers] for i in range(self.workers)]
            self.res = self.pool.starmap_async(_mid_compile_jobs, [(c, NUM_EXPERTS, TOP_K, DEVICE) for c in chunks],
                                               chunksize=1)

    def wait(self, timeout_s: float) -> str:
        import time

        if self.res is None:
            return "precompile: nothing to do"
        try:
            failed = sum(self.res.get(timeout=timeout_s), [])
            status = (f"precompile: {self.n} launch configs run once (compiled) in {self.workers} processes in "
                      f"{time.perf_counter() - self.t0:.0f} s; {len(failed)} failed" + "".join(f"\n  {f}" for f in failed))
        except Exception as ex:  # timeout or a worker crash: the timed loop compiles what is missing
            status = f"precompile stopped after {time.perf_counter() - self.t0:.0f} s ({type(ex).__name__}: {str(ex)[:120]})"
            self.close()
        self.res = None
        return status

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None


def run_sweep_mid(shapes: list[str], ms: list[int], budget_s: float = 1e9, profile: bool = True,
                  workers: int = 0) -> str:
    """``--sweep-mid`` (issue #5): at M tokens (default 256, 16, 64) for the MoE layer's two grouped GEMMs
    (``w13`` 1536x2048 / ``w2`` 2048x768, 128 experts, random top-8: ~M/16 rows per expert) and dense
    GEMMs, time with cold L2 (rotating weight copies / routings, >= 256 MB read per replay, CUDA graph)
    the BF16 baseline, the default dispatch of ``w4a16`` and ``naive`` (W4A4-emulated), and a focused set
    of tensor-core GemmConfigs (stage 1: :func:`_mid_stage1`; stage 2: :func:`_mid_stage2` of the fastest
    two correct; W4A4: stage 1 only) plus, at M <= 64, :func:`_mid_stream` variants for ``w4a16``. Every
    config is checked against the torch reference (1 bf16 ulp + float32 summation bound); a WRONG one is
    never "best". Points in the order shapes x ms (the MoE GEMMs first); stage 1 of every point, then
    stage 2 and the stream variants of every point. Prints each measurement as it happens, then the
    summary table (default vs best per point) and a paste-ready MID_TABLE. Past ``budget_s`` wall seconds
    only the baselines and default dispatches are still timed. ``profile``: first a torch.profiler kernel
    table of the MoE layer at the largest M (:func:`_profile_moe_layer`). ``workers`` > 0: the configs are
    first compiled in that many processes (:class:`_MidPool`; stage 1 and stream configs while the
    weights are built, stage 2 after stage 1)."""
    import time

    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.nvfp4 import gemm_shared
    from verl_quads.nvfp4 import triton_stream as ts

    dev = DEVICE
    t_start = time.perf_counter()
    sms = gemm_shared.num_sms(torch.device(dev))
    gemms = []  # (name, grouped, n, k)
    for s in shapes:
        if s == "moe":
            gemms += [("moe w13", True) + SHAPES["w13"][1:], ("moe w2", True) + SHAPES["w2"][1:]]
        else:
            gemms.append((s,) + SHAPES[s])
    # the points and their candidates first (the precompile needs them); random inputs drawn here
    g = torch.Generator(device=dev).manual_seed(0)
    points = []
    for s in shapes:
        for m in ms:
            for name, grouped, n, k in gemms:
                if (s == "moe") != grouped or (not grouped and name != s):
                    continue
                e = NUM_EXPERTS if grouped else 1
                x, ids0 = _mid_point_inputs(name, grouped, n, k, m, dev, g, NUM_EXPERTS, TOP_K)
                slots = m * TOP_K if grouped else m
                per = -(-slots // min(e, slots)) if grouped else m
                group_rows = torch.bincount(ids0.reshape(-1), minlength=e).tolist() if grouped else [m]
                bm_def = tg.grouped_block_m(per) if grouped else tg.pick_block_m(per)
                m_tiles = (-(-slots // bm_def) + min(e, slots)) if grouped else -(-m // bm_def)
                tc_def = {md: tg.pick_config(per, m_tiles, n, k, torch.device(dev), block_m=bm_def if grouped else None,
                                             grouped=grouped, a4=md != "w4a16") for md in ("w4a16", "naive")}
                stream_def = ts.decode_config(slots, n, k, grouped)
                cands = {md: _mid_stage1(per, grouped, group_rows, n, k, sms, md != "w4a16", tc_def[md])
                         for md in ("w4a16", "naive")}
                streams = _mid_stream(per if grouped else m, stream_def) if m <= 64 else []
                points.append(dict(name=name, grouped=grouped, n=n, k=k, m=m, x=x, ids0=ids0, per=per,
                                   group_rows=group_rows, tc_def=tc_def, stream_def=stream_def, cands=cands,
                                   streams=streams))
    out = [f"device: {device_name()}"]
    print(out[0], flush=True)
    pool_jobs = []
    for p in points:
        base = (p["name"], p["grouped"], p["n"], p["k"], p["m"])
        pool_jobs += [base + ("w4a16", c) for c in p["cands"]["w4a16"] + p["streams"]]
        pool_jobs += [base + ("naive", c) for c in p["cands"]["naive"]]
    pool = _MidPool(workers)
    pool.submit(list(dict.fromkeys(pool_jobs)))  # compiles while this process builds the weights (nothing timed)
    try:
        return _sweep_mid_measure(points, gemms, shapes, ms, budget_s, profile, pool, out, g, t_start)
    finally:
        pool.close()


def _sweep_mid_measure(points, gemms, shapes, ms, budget_s, profile, pool, out, g, t_start) -> str:
    """:func:`run_sweep_mid` after the candidates are known: weights, baselines, stage 1 for every point,
    stage 2 (compiled by ``pool`` meanwhile), tables."""
    import time

    from verl_quads.nvfp4 import moe_routing as mr
    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.rollout import emulation as em

    dev = DEVICE

    def over_budget() -> bool:
        return time.perf_counter() - t_start > budget_s

    weights = {}
    for name, grouped, n, k in gemms:
        weights[name] = _gemm_weights(grouped, n, k, dev, g)
    out.append(pool.wait(max(30.0, budget_s / 2)))
    print(out[-1], flush=True)
    bw = _copy_bandwidth()
    out.append(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s (read + write); timings: CUDA graph of one call "
               f"per weight copy (or routing), copies so that >= {L2_FLUSH_BYTES >> 20} MB are read per replay (cold "
               "L2), median of 7 x 3 replays")
    print(out[-1], flush=True)
    if profile and "moe" in shapes and dev == "cuda":
        try:
            out.append(_profile_moe_layer(max(ms), ("w4a16", "naive")))
        except Exception as ex:  # pragma: no cover - profiler support depends on the build
            out.append(f"profile failed: {type(ex).__name__}: {str(ex)[:200]}")
        print(out[-1], flush=True)
    rows = _Rows()

    def timeit(fn) -> float:
        t = graph_time_s(fn, iters=7, inner=3)
        return t if t is not None else median_time_s(fn, 1, 3, 1)

    # phase 1, per point: inputs, reference, BF16 baseline, default dispatch and stage 1 of both modes
    for p in points:
        name, grouped, n, k, m, x, per = p["name"], p["grouped"], p["n"], p["k"], p["m"], p["x"], p["per"]
        wp, wsc, wgs, wf, w_bf16 = weights[name]
        e = NUM_EXPERTS if grouped else 1
        tag = f"{name} M={m}"
        if grouped:
            s_slots = m * TOP_K
            ids0 = p["ids0"]
            active = int(ids0.unique().numel())
            wbytes, bbytes = active * n * k * 9 // 16, active * n * k * 2
            copies = max(1, min(16, -(-L2_FLUSH_BYTES // wbytes)))
            id_sets = [ids0] + [torch.rand(m, e, device=dev, generator=g).argsort(-1)[:, :TOP_K]
                                for _ in range(copies - 1)]
            routs: dict = {}

            def rout(bm, i, id_sets=id_sets, routs=routs, e=e):
                if (bm, i) not in routs:
                    routs[(bm, i)] = mr.moe_align(id_sets[i], e, bm)
                return routs[(bm, i)]

            def arows(r, name=name):
                return r.sorted_tokens if name.endswith("w13") else r.sorted_slots

            xs0 = [x[arows(rout(16, i)).long()].contiguous() for i in range(copies)]
            offs = [torch.cumsum(torch.bincount(ids.reshape(-1), minlength=e), 0).to(torch.int32) for ids in id_sets]
            w_t = w_bf16.transpose(-2, -1)
            bcopies = copies
            bases = [_bf16_grouped(xs0[i], w_t, offs[i], torch.bincount(id_sets[i].reshape(-1), minlength=e).tolist())
                     for i in range(copies)]
            base_label = bases[0][1]

            def base(i, bases=bases):
                return bases[i][0]()

            bm_def = tg.grouped_block_m(per)

            def run_cfg(op, cfg, i=0, s_slots=s_slots, bm_def=bm_def, wp=wp, wsc=wsc, wgs=wgs, rout=rout, arows=arows):
                bm = cfg.block_m if isinstance(cfg, tg.GemmConfig) else bm_def
                r = rout(bm, i)
                return tg.nvfp4_gemm(op, wp, wsc, wgs, routing=r, a_rows=arows(r), out_rows=s_slots, config=cfg)

            flat = ids0.reshape(-1)
            slot_rows = (torch.arange(s_slots, device=dev) // TOP_K) if name.endswith("w13") else \
                torch.arange(s_slots, device=dev)

            def reference(xq, flat=flat, slot_rows=slot_rows, s_slots=s_slots, n=n, k=k, wf=wf):
                xr = xq[slot_rows]
                ref = torch.empty(s_slots, n, device=dev)
                bound = torch.empty(s_slots, n, device=dev)
                for ex in flat.unique().tolist():
                    sel = flat == ex
                    ref[sel] = xr[sel] @ wf[ex].t()
                    bound[sel] = 4 * k * torch.finfo(torch.float32).eps * (xr[sel].abs() @ wf[ex].abs().t())
                return ref.to(torch.bfloat16), bound
        else:
            wbytes, bbytes = n * k * 9 // 16, n * k * 2
            copies = max(1, min(64, -(-L2_FLUSH_BYTES // wbytes)))
            bcopies = max(1, min(64, -(-L2_FLUSH_BYTES // bbytes)))
            wps = [wp] + [wp.clone() for _ in range(copies - 1)]
            wscs = [wsc] + [wsc.clone() for _ in range(copies - 1)]
            wbs = [w_bf16[0]] + [w_bf16[0].clone() for _ in range(bcopies - 1)]

            def base(i, x=x, wbs=wbs):
                return x @ wbs[i].t()

            base_label = "bf16 torch.matmul (cuBLAS)"

            def run_cfg(op, cfg, i=0, wps=wps, wscs=wscs, wgs=wgs):
                return tg.nvfp4_gemm(op, wps[i], wscs[i], wgs, config=cfg)

            def reference(xq, wf=wf, k=k):
                return ((xq @ wf.t()).to(torch.bfloat16),
                        4 * k * torch.finfo(torch.float32).eps * (xq.abs() @ wf.abs().t()))
        t_base = timeit(_rotating(base, bcopies)) / bcopies
        p["t_base"] = t_base
        rows.append([tag, base_label, "-", t_base * 1e6, 1.0, bbytes / t_base / bw, "-"])
        ops = {mode: tg.quantize_activation(x, mode)[0] for mode in ("w4a16", "naive")}
        refs = {mode: reference(em.quantize_activation(x, em.ActQuant(mode, backend="auto"))[0])
                for mode in ("w4a16", "naive")}

        def measure(mode, cfg, label=None, copies=copies, run_cfg=run_cfg, tag=tag, t_base=t_base, wbytes=wbytes,
                    ops=ops, refs=refs):
            op = ops[mode]
            try:
                rel, ok = _err(run_cfg(op, cfg), *refs[mode])
                t = timeit(_rotating(lambda i: run_cfg(op, cfg, i), copies)) / copies
            except Exception as ex:  # a config that does not compile or fit: reported, skipped
                print(f"  {tag} {mode} {_cfg_label(cfg)}: failed {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                return None
            rows.append([tag, f"{mode} {label or _cfg_label(cfg)}", "ok" if ok else "WRONG", t * 1e6, t_base / t,
                         wbytes / t / bw, f"{rel:.1e}"])
            return t if ok else None

        p["measure"] = measure
        stream_def = p["stream_def"]
        p["timed"], p["t_def"] = {}, {}
        for mode in ("w4a16", "naive"):
            tc_def = p["tc_def"][mode]
            resolved = stream_def if (mode == "w4a16" and stream_def) else tc_def
            t_def = measure(mode, None, f"default = {_cfg_label(resolved)}")  # nvfp4_gemm's own dispatch
            timed = [(t_def, resolved)] if t_def is not None else []
            cands = p["cands"][mode]  # cands[0] is tc_def: measured here only if the dispatch took the stream kernel
            for i_c, cfg in enumerate(cands):
                if over_budget():
                    print(f"  {tag} {mode}: budget {budget_s:.0f} s spent, {len(cands) - i_c} configs skipped", flush=True)
                    break
                if cfg == tc_def and (mode != "w4a16" or stream_def is None):
                    continue
                t = measure(mode, cfg)
                if t is not None:
                    timed.append((t, cfg))
            p["timed"][mode], p["t_def"][mode] = timed, t_def
        print(f"{tag}: stage 1 done, {time.perf_counter() - t_start:.0f} s", flush=True)
    # stage 2 of every point (w4a16: split / stages / warps around the fastest two), compiled in parallel first
    jobs = []
    for p in points:
        tried = {c for _, c in p["timed"]["w4a16"]} | set(p["cands"]["w4a16"])
        p["stage2"] = []
        for _, cfg in sorted(p["timed"]["w4a16"], key=lambda tc: tc[0])[:2]:
            if isinstance(cfg, tg.GemmConfig):
                p["stage2"] += [c2 for c2 in _mid_stage2(cfg, p["k"]) if c2 not in tried and c2 not in p["stage2"]]
        jobs += [(p["name"], p["grouped"], p["n"], p["k"], p["m"], "w4a16", c) for c in p["stage2"]]
    if not over_budget():
        pool.submit(list(dict.fromkeys(jobs)))
        out.append(pool.wait(max(20.0, budget_s - (time.perf_counter() - t_start))))
        print(out[-1], flush=True)
    summary = []
    table: dict = {}
    for p in points:
        name, grouped, n, k, m, per, t_base = p["name"], p["grouped"], p["n"], p["k"], p["m"], p["per"], p["t_base"]
        tc_def, stream_def, measure, timed = p["tc_def"], p["stream_def"], p["measure"], p["timed"]["w4a16"]
        for cfg in p["stage2"] + [sc for sc in p["streams"] if sc not in {c for _, c in timed}]:
            if over_budget():
                print(f"  {name} M={m}: budget {budget_s:.0f} s spent, stage 2 / stream configs skipped", flush=True)
                break
            t = measure("w4a16", cfg)
            if t is not None:
                timed.append((t, cfg))
        res = {}
        for mode in ("w4a16", "naive"):
            ts = p["timed"][mode]
            best = min(ts, key=lambda tc: tc[0]) if ts else (float("nan"), None)
            res[mode] = (p["t_def"][mode], best)
            table[(grouped, per, n, k, mode)] = best[1]
        (wd, (wb, wcfg)), (nd, (nb, ncfg)) = res["w4a16"], res["naive"]

        def fmt(t):
            return f"{t * 1e6:.1f}" if t is not None and t == t else "n/a"

        summary.append([name, m, per, fmt(t_base), fmt(wd), _cfg_label(stream_def or tc_def["w4a16"]), fmt(wb),
                        _cfg_label(wcfg), f"{wd / wb:.2f}" if wd and wb == wb else "-",
                        f"{t_base / wb:.2f}" if wb == wb else "-", fmt(nd), _cfg_label(tc_def["naive"]), fmt(nb), _cfg_label(ncfg),
                        f"{t_base / nb:.2f}" if nb == nb else "-"])
        print(f"{name} M={m}: w4a16 default {fmt(wd)} us, best {fmt(wb)} us ({_cfg_label(wcfg)}); naive default "
              f"{fmt(nd)} us, best {fmt(nb)} us ({_cfg_label(ncfg)}); bf16 {fmt(t_base)} us; "
              f"{time.perf_counter() - t_start:.0f} s", flush=True)
    out.append(print_table(
        "--sweep-mid: every measurement (cold L2); check: within 1 bf16 ulp + fp32 summation bound of the torch "
        "reference at every element", ["point", "kernel / config", "check", "us", "x bf16", "of copy BW",
                                       "max err/max|ref|"], rows))
    out.append(print_table(
        "--sweep-mid summary (us, cold L2): default dispatch vs fastest correct config per point; x bf16 = BF16 time / "
        "this time", ["gemm", "M", "rows/group", "bf16", "w4a16 default", "(its config)", "w4a16 best", "(config)",
                      "default/best", "best x bf16", "naive default", "(its config)", "naive best", "(config)",
                      "naive best x bf16"], summary))
    snippet = ["MID_TABLE = {  # verl-quads bench rollout --sweep-mid, " + device_name()
               + "; key (grouped, rows per group, N, K, mode)"]
    for key, c in table.items():
        snippet.append(f"    {key}: {c!r},")
    snippet.append("}")
    out.append("\n".join(snippet))
    print("\n".join(snippet), flush=True)
    out.append(f"wall time {time.perf_counter() - t_start:.0f} s")
    print(out[-1], flush=True)
    return "\n".join(out)


def stream_sass_count(cfg, grouped: bool = False) -> tuple[int, float, dict]:
    """Offline (no GPU): compile ``_w4a16_stream_kernel`` for ``cfg`` for sm_90 with triton's bundled
    ptxas (bf16 activations, split-K partials, aligned sizes as the JIT specializes them), disassemble
    it with the wheel's ``cuobjdump`` and count the SASS instructions of the K loop (the longest loop
    closed by a backward branch; the main loop of a software-pipelined kernel). Returns (instructions
    in the loop body, per weight element per thread = body / (block_n * block_kw * 8 / threads), opcode
    histogram). Thread-instructions per weight element is what bounds a weight-streaming kernel by
    instruction issue (H200: ~3.3e13 thread-instructions/s)."""
    import collections
    import re

    from verl_quads.bench.sass import compile_sm90, sass_and_loop
    from verl_quads.nvfp4 import triton_stream as ts

    const = ts.stream_constexprs(cfg, grouped=grouped, tm=16 if grouped else cfg.block_m, partial=True, fixup=cfg.fixup,
                                  has_bias=False, out_code=1, dt=1, even=True, interpreting=False)
    ptrs = ["x_ptr", "w_ptr", "ws_ptr", "wgs_ptr", "bias_ptr", "out_ptr", "part_ptr", "cnt_ptr", "arow_ptr", "orow_ptr",
            "tile_e_ptr", "tile_r0_ptr", "tile_r1_ptr"]
    types = ["*bf16", "*i32", "*u8", "*fp32", "*fp32", "*i16", "*fp32", "*i32", "*i32", "*i32", "*i32", "*i32", "*i32"]
    sig = dict(zip(ptrs, types))
    sig.update({n: "i32" for n in ("M", "N", "K", "KW", "KB", "OUT_ROWS", "KW_PER_SPLIT", "SPLIT")})
    sig.update({c: "constexpr" for c in const})
    kern = compile_sm90(ts._w4a16_stream_kernel, sig, const, ("N", "K", "KW", "KB", "KW_PER_SPLIT"), cfg.num_warps,
                        cfg.num_stages)
    _, body = sass_and_loop(kern)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    per_thread = cfg.block_n * cfg.block_kw * 8 / (32 * cfg.num_warps)
    return len(body), len(body) / per_thread, dict(ops.most_common())


def run_sass_count(shapes: list[str], ms: list[int]) -> str:
    """``--sass-count``: :func:`stream_sass_count` of the ``--focus`` variants (incl. the current
    DECODE_TABLE entry) of each decode GEMM, as a table (no GPU needed)."""
    from verl_quads.nvfp4 import triton_stream as ts

    gemms = []
    for s in shapes:
        gemms += ([("moe w13", True) + SHAPES["w13"][1:], ("moe w2", True) + SHAPES["w2"][1:]] if s == "moe"
                  else [(s,) + SHAPES[s]])
    rows, seen = [], {}
    for name, grouped, n, k in gemms:
        for m in ms:
            slots = m * TOP_K if grouped else m
            per = -(-slots // min(NUM_EXPERTS, slots)) if grouped else m
            cur = ts.decode_config(slots, n, k, grouped)
            for cfg in _focus_variants(per, grouped, cur, m):
                key = (cfg, grouped)
                if key not in seen:
                    seen[key] = stream_sass_count(cfg, grouped)
                body, per_el, ops = seen[key]
                rows.append([f"{name} M={m}", cfg.label + (" (table)" if cfg == cur else ""), body, per_el, cfg.block_m,
                             ", ".join(f"{o} {c}" for o, c in list(ops.items())[:8])])
    return print_table("W4A16 stream kernel, offline sm_90 compile: SASS instructions in the K loop (bf16 activations, "
                       "split-K partials); per weight element per thread (x block_m activation rows)",
                       ["shape", "config", "K-loop SASS", "per weight element", "rows", "top opcodes"], rows)


# --- --gemv-roofline: where the W4A16 decode GEMV's time goes (issue #5) ------------------------------

ROOF_BLOCK_N = (64, 128, 256, 512)
ROOF_BLOCK_KW = (8, 16, 32, 64)
ROOF_WARPS = (2, 4, 8)


def _roof_tilings():
    """The read-only grid's tilings (block_n, block_kw, warps) with 4..64 words per thread per K step (one
    16-byte vector at least; more would spill or exceed the register file at 1 program/SM)."""
    return [(bn, bkw, w) for bn in ROOF_BLOCK_N for bkw in ROOF_BLOCK_KW for w in ROOF_WARPS
            if 4 <= bn * bkw // (32 * w) <= 64]


def run_gemv_roofline(budget_s: float = 120.0, points=None, tilings=None, sections: str = "abcdef") -> str:
    """``--gemv-roofline``: dense 8192x8192 (M=1, 16) and the MoE layer's grouped w13 (8 experts of [1536, 2048])
    and w2 (8 of [2048, 768]) at M=1 (8 token-slots, one per expert), cold L2 (each timed replay reads rotating
    copies: dense weight clones / disjoint groups of 8 of the 128 experts, >= 256 MB; MoE w2's 16 groups are
    101 MB, ~2x the L2). Rows: (a) device-to-device copy of the packed bytes (codes + scales), the BF16 baseline
    (cuBLAS / ``torch._grouped_mm``), the default ``nvfp4_gemm`` w4a16 dispatch; (b)-(d) the probes of
    :mod:`verl_quads.bench.gemv_probe` with the DECODE_TABLE entry's grid and loop (read-only, + decode,
    + FMA); (e) read-only probes over a grid of tilings (block_n x block_kw x warps at occ 4 with prefetch),
    then for the fastest few: programs per SM (occ 1, 2, 8), no prefetch with 1, 2, 4 K steps unrolled,
    Triton's pipeliner (pipe 3), and load hints (.cg / evict_first). Past ``budget_s`` the grid stops (tables
    are still printed). Per row: us, weight GB/s (NVFP4 bytes the GEMM must read), % of the copy bandwidth of
    the same run (read + write of 512 MB, the sweep's measure), share of the default kernel's time."""
    import time

    from verl_quads.bench import gemv_probe as gp
    from verl_quads.nvfp4 import moe_routing as mr
    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.nvfp4 import triton_stream as ts

    dev = DEVICE
    t_start = time.perf_counter()
    out = [f"device: {device_name()}"]
    print(out[0], flush=True)
    bw = _copy_bandwidth()
    out.append(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s (read + write of 512 MB); timings: CUDA graph "
               f"of one call per weight copy, >= {L2_FLUSH_BYTES >> 20} MB read per replay (cold L2)")
    print(out[-1], flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = _Rows()
    grid_rows = _Rows()
    fastest: dict = {}
    first_grid: list = []
    acc_rows = _Rows()

    def over_budget() -> bool:
        return time.perf_counter() - t_start > budget_s

    points = points or [("d8192", False, 8192, 8192, 1), ("d8192", False, 8192, 8192, 16),
                        ("moe w13", True, 1536, 2048, 1), ("moe w2", True, 2048, 768, 1)]  # (name, grouped, N, K, M)
    for name, grouped, n, k, m in points:
        tag = f"{name} M={m}"
        e = NUM_EXPERTS if grouped else 1
        wp, wsc, wgs, wf, w_bf16 = _gemm_weights(grouped, n, k, dev, g)
        del wf
        if grouped:
            s_slots = m * TOP_K
            wbytes, bbytes = TOP_K * n * k * 9 // 16, TOP_K * n * k * 2
            copies = e // TOP_K  # disjoint groups of 8 consecutive experts
            x = torch.randn(m if name.endswith("w13") else s_slots, k, device=dev, generator=g).to(torch.bfloat16)
            id_sets = [torch.arange(c * TOP_K, (c + 1) * TOP_K, device=dev).reshape(1, TOP_K) for c in range(copies)]
            routs = [mr.moe_align(ids, e, tg.pick_block_m(1)) for ids in id_sets]
            a_rows = [r.sorted_tokens if name.endswith("w13") else r.sorted_slots for r in routs]
            x_sorted = [x[ar.long()].contiguous() for ar in a_rows]
            offs = [torch.cumsum(torch.bincount(ids.reshape(-1), minlength=e), 0).to(torch.int32) for ids in id_sets]
            w_t = w_bf16.transpose(-2, -1)
            wps = [wp[c * TOP_K:(c + 1) * TOP_K] for c in range(copies)]
            wscs = [wsc[c * TOP_K:(c + 1) * TOP_K] for c in range(copies)]
            experts = [ids.reshape(-1).to(torch.int32) for ids in id_sets]
            arows = torch.arange(TOP_K, device=dev, dtype=torch.int32) if not name.endswith("w13") else \
                torch.zeros(TOP_K, device=dev, dtype=torch.int32)

            def base(i):
                return torch._grouped_mm(x_sorted[i], w_t, offs=offs[i])

            base_label, nb = "bf16 torch._grouped_mm", copies
            op, _ = tg.quantize_activation(x, "w4a16")

            def full(i, cfg=None):
                return tg.nvfp4_gemm(op, wp, wsc, wgs, routing=routs[i], a_rows=a_rows[i], out_rows=s_slots, config=cfg)

            def probe_w(i):  # the probes index the full weight with the group's expert ids
                return wp, wsc, experts[i]
        else:
            wbytes, bbytes = n * k * 9 // 16, n * k * 2
            copies = max(1, min(64, -(-L2_FLUSH_BYTES // wbytes)))
            nb = max(1, min(64, -(-L2_FLUSH_BYTES // bbytes)))
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            wps = [wp] + [wp.clone() for _ in range(copies - 1)]
            wscs = [wsc] + [wsc.clone() for _ in range(copies - 1)]
            wbs = [w_bf16[0]] + [w_bf16[0].clone() for _ in range(nb - 1)]
            zero = torch.zeros(1, device=dev, dtype=torch.int32)
            arows = zero

            def base(i):
                return x @ wbs[i].t()

            base_label = "bf16 torch.matmul (cuBLAS)"
            op, _ = tg.quantize_activation(x, "w4a16")

            def full(i, cfg=None):
                return tg.nvfp4_gemm(op, wps[i], wscs[i], wgs, config=cfg)

            def probe_w(i):
                return wps[i], wscs[i], zero
        dst_p = torch.empty_like(wps[0])
        dst_s = torch.empty_like(wscs[0])

        def copy(i):
            dst_p.copy_(wps[i])
            dst_s.copy_(wscs[i])

        def row(kind, label, t, t_full, extra=""):
            rows.append([tag, kind, label, t * 1e6, wbytes / t / 1e9, wbytes / t / bw,
                         f"{t / t_full:.2f}" if t_full else "-", extra])

        t_copy = _time(_rotating(copy, copies))[0] / copies
        t_base = _time(_rotating(base, nb))[0] / nb
        t_def = _time(_rotating(full, copies))[0] / copies
        cur = ts.decode_config(s_slots if grouped else m, n, k, grouped)
        row("(a) copy", f"d2d copy of the packed bytes ({2 * wbytes / t_copy / 1e9:.0f} GB/s read+write)", t_copy, t_def)
        rows.append([tag, "(a) bf16", base_label, t_base * 1e6, bbytes / t_base / 1e9, bbytes / t_base / bw,
                     f"{t_base / t_def:.2f}", "bf16 bytes"])
        row("(a) default", f"nvfp4_gemm w4a16 = {cur.label if cur else 'tensor-core kernel (no DECODE_TABLE entry)'}",
            t_def, t_def, f"{t_base / t_def:.2f}x bf16")
        pcfg = cur if (cur is not None and cur.mma == 0) else ts.decode_config(1, n, k, grouped)

        def time_probe(cfg, stage, **kw):
            launch_of = []
            info = None
            for i in range(copies):
                w_i, s_i, e_i = probe_w(i)
                fn, info = gp.make_probe(cfg, stage, w_i, s_i, x, e_i, arows, **kw)
                launch_of.append(fn)
            t = _time(_rotating(lambda i: launch_of[i](), copies))[0] / copies
            return t, info

        if pcfg is not None:
            what = "entry" if pcfg == cur else "M=1 entry (reads do not depend on M)"
            for stage, kind in ((0, "(b) read"), (1, "(c) +decode"), (2, "(d) +FMA")):
                if m > 1 and stage > 0:
                    continue
                try:
                    t, info = time_probe(pcfg, stage)
                except Exception as ex:
                    print(f"  {tag} {kind}: failed {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                    continue
                row(kind, f"{gp.STAGES[stage]} probe, {what} {pcfg.label}", t, t_def,
                    f"grid {info['grid']} = {info['programs'] / _num_sms_dev():.1f}/SM, {info['kw_per']} words/range")
        if m > 1 or over_budget() or not (set(sections) & {"e", "f"}):
            del wps, wscs, wp, wsc, w_bf16, op
            torch.cuda.empty_cache()
            continue
        if "e" in sections:
            # (e) read-only grid
            # the first grid point times every tiling; later ones the 8 fastest of it (compiled already: timing only)
            cands = first_grid or [StreamConfigRO(bn, bkw, w) for bn, bkw, w in (tilings or _roof_tilings())]
            timed = []
            for c in cands:
                if over_budget():
                    print(f"  {tag}: budget {budget_s:.0f} s spent, read-only grid cut", flush=True)
                    break
                try:
                    t, info = time_probe(c, 0)
                except Exception as ex:
                    print(f"  {tag} read {c.label}: failed {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                    continue
                timed.append((t, c))
                grid_rows.append([tag, f"n{c.block_n} kw{c.block_kw} w{c.num_warps}", "occ4 pf", t * 1e6, wbytes / t / 1e9,
                                  wbytes / t / bw, f"{info['programs'] / _num_sms_dev():.1f}", info['kw_per']])
            timed.sort(key=lambda r: r[0])
            first_grid = first_grid or [c for _, c in timed[:8]]
            top = [c for _, c in timed[:3]]
            if pcfg is not None:
                top.append(StreamConfigRO(pcfg.block_n, pcfg.block_kw, pcfg.num_warps))
            for c in dict.fromkeys(top):
                variants = [(f"occ{o} pf", replace(c, occ=o), {}) for o in (1, 2, 8)]
                variants += [(f"occ4 u{u}", replace(c, prefetch=False), dict(unroll=u)) for u in (1, 2, 4)]
                variants += [("occ4 pipe3", replace(c, prefetch=False, pipe=3), {}),
                             ("occ4 pf .cg", c, dict(cache=".cg")), ("occ4 pf evict_first", c, dict(evict="evict_first"))]
                for vlabel, vc, kw in variants:
                    if over_budget():
                        break
                    try:
                        t, info = time_probe(vc, 0, **kw)
                    except Exception as ex:
                        print(f"  {tag} read {vc.label} {vlabel}: failed {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                        continue
                    grid_rows.append([tag, f"n{c.block_n} kw{c.block_kw} w{c.num_warps}", vlabel, t * 1e6, wbytes / t / 1e9,
                                      wbytes / t / bw, f"{info['programs'] / _num_sms_dev():.1f}", info['kw_per']])
                    timed.append((t, vc))
            good = [r for r in grid_rows if r[0] == tag and r[5] >= 0.70]
            fastest[tag] = (min((r for r in grid_rows if r[0] == tag), key=lambda r: r[3], default=None), len(good),
                            sum(r[0] == tag for r in grid_rows))
        if "f" in sections:  # (f) access patterns: linear reads, scale loads, whole-row tiles
            words_of = [probe_w(i)[0] for i in range(copies)]
            wbytes_codes = words_of[0].numel() * words_of[0].element_size() if not grouped else TOP_K * n * k // 2
            if grouped:
                words_of = wps  # the group's 8 experts are one contiguous slice
            sms = _num_sms_dev()
            for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8)):
                for ppsm in (1, 2, 4, 8):
                    for unroll in (1, 2):
                        if over_budget():
                            break
                        try:
                            fl = [gp.make_flat_read(words_of[i], ppsm * sms, block, unroll, warps)[0] for i in range(copies)]
                            t = _time(_rotating(lambda i: fl[i](), copies))[0] / copies
                        except Exception as ex:
                            print(f"  {tag} flat read: failed {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                            continue
                        acc_rows.append([tag, "linear read (codes only)", f"block {block} w{warps} {ppsm}/SM u{unroll}",
                                         t * 1e6, wbytes_codes / t / 1e9, wbytes_codes / t / bw])
            variants = []
            tiles = [StreamConfigRO(pcfg.block_n, pcfg.block_kw, pcfg.num_warps)] if pcfg is not None else []
            tiles += first_grid[:2] or [StreamConfigRO(64, 32, 2), StreamConfigRO(64, 64, 2)]  # H200 G1's fastest two
            for c in dict.fromkeys(tiles):
                variants += [(c, "scales per word (kernel)", {}), (c, "no scale loads", dict(scales=0)),
                             (c, "scales per block tile", dict(scales=2))]
            # few rows, long K runs per row (split-K 1 at these sizes: whole rows per program), 1-8 warps
            for bn, bkw, warps in ((4, 128, 1), (4, 256, 2), (8, 64, 1), (8, 128, 1), (8, 128, 2), (8, 256, 2),
                                   (16, 64, 2), (16, 128, 2), (16, 128, 4), (16, 256, 4), (32, 64, 2), (32, 128, 4),
                                   (16, 256, 8), (32, 256, 8), (64, 128, 8)):
                c = StreamConfigRO(bn, bkw, warps)
                variants += [(c, "whole rows, scales per word", {}), (c, "whole rows, no scale loads", dict(scales=0))]
                if bn <= 16:
                    variants += [(replace(c, prefetch=False), "whole rows, u2 (no prefetch)", dict(unroll=2)),
                                 (replace(c, prefetch=False), "whole rows, u4 (no prefetch)", dict(unroll=4))]
            for c, what, kw in variants:
                if over_budget():
                    break
                try:
                    t, info = time_probe(c, 0, **kw)
                except Exception as ex:
                    print(f"  {tag} read {c.label} {what}: failed {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                    continue
                b_used = wbytes_codes if kw.get("scales") == 0 else wbytes
                acc_rows.append([tag, f"read-only n{c.block_n} kw{c.block_kw} w{c.num_warps} pf, grid {info['grid']}",
                                 what, t * 1e6, b_used / t / 1e9, b_used / t / bw])
        del wps, wscs, wp, wsc, w_bf16, op
        torch.cuda.empty_cache()
    out.append(print_table(
        "W4A16 decode GEMV roofline (cold L2): (a) copy / BF16 / default kernel; probes with the DECODE_TABLE entry's "
        "grid and loop: (b) read-only, (c) read + decode (+ block scale, summed), (d) read + decode + FMA (no epilogue, "
        "no split-K fixup); 'of copy BW': weight bytes/s over the copy bandwidth; 'share': time / default kernel's",
        ["shape", "row", "what", "us", "weight GB/s", "of copy BW", "share", "note"], rows))
    out.append(print_table(
        "(e) read-only probe over tilings (cold L2): occ = programs-per-SM target of split_k (the kernel's rule), "
        "pf = prefetch (next step loaded before this one is used), uN = N K steps unrolled without prefetch, pipe3 = "
        "Triton pipeliner (cp.async), .cg / evict_first = tl.load hints",
        ["shape", "tiling", "loop", "us", "weight GB/s", "of copy BW", "programs/SM", "words/K range"], grid_rows))
    if acc_rows:
        out.append(print_table(
            "(f) access patterns, read-only (cold L2): a linear read of the same code bytes by a Triton kernel (contiguous "
            "chunk per program, 'block' int32 words per load), the stream tiling's scale loads (per word as the kernel, "
            "none: codes only, per 16-element block tile), whole-row tiles (block_n rows x block_kw words, split-K auto); "
            "GB/s of the bytes read (codes only where no scales)",
            ["shape", "probe", "variant", "us", "GB/s", "of copy BW"], acc_rows))
    for tag, (best, n_good, n_all) in fastest.items():
        if best:
            line = (f"{tag}: fastest read-only {best[1]} {best[2]} {best[3]:.1f} us = {best[5]:.0%} of copy BW; "
                    f"{n_good} of {n_all} read-only rows >= 70% of copy BW")
            out.append(line)
            print(line, flush=True)
    out.append(f"wall time {time.perf_counter() - t_start:.0f} s")
    print(out[-1], flush=True)
    return "\n".join(out)


def _num_sms_dev() -> int:
    from verl_quads.nvfp4.gemm_shared import num_sms as _num_sms

    return _num_sms(torch.device(DEVICE))


def StreamConfigRO(block_n: int, block_kw: int, num_warps: int):
    """A CUDA-core StreamConfig with only the read side set (block_m 1, prefetch, split_k auto at occ 4)."""
    from verl_quads.nvfp4.triton_stream import StreamConfig

    return StreamConfig(block_m=1, block_n=block_n, block_kw=block_kw, num_warps=num_warps, prefetch=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="verl-quads bench rollout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help=f"comma-separated, from {['moe'] + list(SHAPES)} (moe: the whole routed-experts layer)")
    p.add_argument("--m", default=DEFAULT_MS, help="comma-separated token counts M")
    p.add_argument("--ratios", default="0.25,0.5,1.0", help="QUADS residual ratios k (comma-separated)")
    p.add_argument("--sweep", action="store_true", help="try launch configs per shape and use the fastest")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated row kinds to time, from {list(VARIANTS)} (compare: quads-bf16 with the "
                        "non-default selection rule); naive is the baseline of the QUADS goal")
    p.add_argument("--sweep-decode", action="store_true",
                   help="time every W4A16 weight-streaming kernel variant at decode M (default --m 1,4,16, shapes "
                        f"{DECODE_SHAPES}) with cold L2, check each against the torch reference, print the fastest "
                        "correct per shape and a paste-ready triton_stream.DECODE_TABLE")
    p.add_argument("--sweep-mid", action="store_true",
                   help="issue #5, 16..256 rows: time a focused set of tensor-core GemmConfigs (swap, block_m/n/k, "
                        "split_k, warps, stages; stage 2 around the fastest two) and, at M <= 64, stream-kernel "
                        "variants, for w4a16 and naive, at default --m 256,16,64 for the MoE w13/w2 grouped GEMMs "
                        f"and dense GEMMs (default shapes {MID_SHAPES}), cold L2, each checked against the torch "
                        "reference; first a torch.profiler kernel table of the MoE layer at the largest M; prints "
                        "default vs best per point and a paste-ready MID_TABLE. Use --budget-s.")
    p.add_argument("--no-profile", action="store_true", help="--sweep-mid: skip the torch.profiler kernel table")
    p.add_argument("--workers", type=int, default=8,
                   help="--sweep-mid: processes that compile the candidate configs first (0: compile in the timed loop)")
    p.add_argument("--budget-s", type=float, default=1e9,
                   help="--sweep-decode / --sweep-mid: wall seconds after which each remaining shape times only its baselines and "
                        "first config (so a run under a time limit still prints its table)")
    p.add_argument("--focus", action="store_true",
                   help="--sweep-decode: short targeted sweep (<= 6 configs per GEMM: the current DECODE_TABLE entry, "
                        "its f16x2+late_scale (CUDA-core) or bf16x2 (tensor-core) twin, f16x2+late_scale tiles; no "
                        "stage 2); e.g. --sweep-decode --focus --shapes moe,d8192 --m 1,16 --budget-s 120")
    p.add_argument("--sass-count", action="store_true",
                   help="no GPU needed: compile the --focus variants of the decode GEMMs (--shapes, --m) for sm_90 and "
                        "count the SASS instructions per weight element in their K loop")
    p.add_argument("--gemv-roofline", action="store_true",
                   help="issue #5: where the W4A16 decode GEMV's time goes (dense 8192 M=1/16, MoE w13/w2 M=1, cold L2): "
                        "copy / BF16 / default kernel vs read-only, +decode, +FMA probes with the DECODE_TABLE entry's "
                        "grid, and a read-only grid over tilings, programs per SM, unrolling and load hints "
                        "(--budget-s caps the grid, default 120 s)")
    p.add_argument("--roof-sections", default="abcdef",
                   help="--gemv-roofline: sections to run (a-d: baselines + probes of the table entry, always; e: read-only "
                        "tiling grid; f: access patterns: linear reads, scale loads, whole-row tiles)")
    p.add_argument("--model-graph", action="store_true",
                   help="issue #5, dense decode as in a model: per-call time inside ONE CUDA graph of C calls, each on "
                        "its own weight copy (cold L2, like successive layers; no per-call graph launch), next to the "
                        f"main table's one-call-per-graph time; default --shapes {MODEL_GRAPH_SHAPES} --m 1,4,16")
    p.add_argument("--out", default=None, help="also write the tables to this file")
    a = p.parse_args(argv)
    variants = tuple(v for v in a.variants.split(",") if v)
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"verl-quads bench rollout: unknown --variants {bad}; allowed: {list(VARIANTS)}")

    def shapes_and_ms(default_shapes: str, default_ms: str, what: str,
                      allowed: tuple[str, ...] = ("moe", "d4096", "d8192", "qkv", "o_proj")) -> tuple[list[str], list[int]]:
        """--shapes / --m of a special mode: the mode's own defaults where the user kept the general ones."""
        shapes = [s for s in (a.shapes if a.shapes != DEFAULT_SHAPES else default_shapes).split(",") if s]
        bad = [s for s in shapes if s not in allowed]
        if bad:
            raise SystemExit(f"verl-quads bench rollout {what}: unknown shape(s) {bad}; allowed: {list(allowed)} "
                             "(moe: the w13 and w2 grouped GEMMs)")
        return shapes, [int(v) for v in (a.m if a.m != DEFAULT_MS else default_ms).split(",")]

    if a.sass_count:
        text = run_sass_count(*shapes_and_ms("moe,d8192", "1,16", "--sass-count", ("moe", *SHAPES)))
    elif not torch.cuda.is_available():
        raise SystemExit("verl-quads bench rollout needs a CUDA GPU (CPU numbers are not the point)")
    elif a.gemv_roofline:
        text = run_gemv_roofline(a.budget_s if a.budget_s < 1e9 else 120.0, sections=a.roof_sections)
    elif a.model_graph:
        shapes, ms = shapes_and_ms(MODEL_GRAPH_SHAPES, "1,4,16", "--model-graph", tuple(s for s in SHAPES if not SHAPES[s][0]))
        text = run_model_graph(shapes, ms, [float(v) for v in a.ratios.split(",") if v], variants)
    elif a.sweep_mid:
        shapes, ms = shapes_and_ms(MID_SHAPES, "256,16,64", "--sweep-mid")
        text = run_sweep_mid(shapes, ms, a.budget_s, profile=not a.no_profile, workers=a.workers)
    elif a.sweep_decode:
        shapes, ms = shapes_and_ms(DECODE_SHAPES, "1,4,16", "--sweep-decode")
        text = run_sweep_decode(shapes, ms, a.budget_s, a.focus)
    else:
        shapes = [s for s in a.shapes.split(",") if s]
        bad = [s for s in shapes if s not in SHAPES and s != "moe"]
        if bad:
            raise SystemExit(f"verl-quads bench rollout: unknown shape(s) {bad}; allowed: {['moe'] + list(SHAPES)}")
        text = run(shapes, [int(v) for v in a.m.split(",")], [float(v) for v in a.ratios.split(",") if v], a.sweep,
                   variants)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
