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
  emulated: activation quantized per token by the core), ``quads k=R`` for R in ``--ratios``
  (per-token residual selection, the default; graph-capturable) and ``quads-bf16 k=R`` (the opt-in
  ``residual_combine="bf16"`` operand: the core's QDQ activation in bf16, then the w4a16 GEMM); each timed as the whole call
  (activation quantization included) captured in a CUDA graph; ``x bf16`` = BF16 time / this time
  (> 1: faster); weight bandwidth counts the NVFP4 bytes the GEMM must read (codes + block scales;
  the active experts' only) as a fraction of the device-to-device copy bandwidth of the same run.

At the end the goals of issue #5 are checked (PASS/FAIL with the measured ratios): W4A16 MoE layer
>= 2.5x BF16 grouped at M <= 256; W4A16 dense 4096/8192 >= 2.5x cuBLAS BF16 at M <= 16; QUADS
k=0.5 <= 1.10x the time of naive (W4A4-emulated) at every M (checked for ``quads`` and ``quads-bf16``).

``--shapes`` also accepts ``w13`` / ``w2`` (one grouped expert GEMM alone) and ``--sweep`` times a
few launch configurations of the w4a16 / naive GEMM per (shape, M) to tune
:func:`triton_gemm.pick_config`.

``--sweep-decode`` (issue #5, decode): every variant of the W4A16 weight-streaming kernel
(:class:`triton_gemm.StreamConfig`: tile, split-K, warps, stages, CUDA-core FMA vs tensor-core dot,
``bits`` vs ``f16`` E2M1 decode, prefetch) at M = 1, 4, 16 for d4096, d8192 and the MoE layer's two
grouped GEMMs (w13, w2; random top-8 routing over 128 experts), timed with cold L2 (each timed replay
calls the GEMM once per weight copy / routing, >= 256 MB read), each checked against the torch
reference (max |err| / max |ref| and the per-element 1 ulp + float32 summation bound); prints weight
bytes/s as a fraction of the copy bandwidth of the same run, the ratio to cuBLAS BF16 /
``torch._grouped_mm`` BF16, the fastest correct variant per shape, the MoE layer with those variants,
and a paste-ready ``DECODE_TABLE``.
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
NUM_EXPERTS, TOP_K = 128, 8
DEVICE = "cuda"  # a CPU smoke run (TRITON_INTERPRET=1, tiny SHAPES) may set "cpu"


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


def _sweep_configs(rows_per_group: int):
    from verl_quads.nvfp4.triton_gemm import GemmConfig, pick_block_m

    bm0 = pick_block_m(rows_per_group)
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
                    times: dict) -> list[list[object]]:
    """Whole routed-experts layer (hidden 2048, intermediate 768, 128 experts top-8, random routing):
    :func:`triton_gemm.moe_forward` (one grouped launch per GEMM, routing sort included) vs a BF16
    layer of the same structure (stable sort by expert, ``torch._grouped_mm`` w13, silu * up,
    ``torch._grouped_mm`` w2, router-weighted ``index_add_``; expert offsets precomputed, i.e. the
    baseline gets its routing metadata for free)."""
    from verl_quads import nvfp4 as nv
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
        bm = tg.pick_block_m(-(-(m * TOP_K) // min(e, m * TOP_K)))
        t_align, how = _time(lambda: tg.moe_align(ids, e, bm))
        rows.append([tag, "moe_align (routing sort + tile table)", how, t_align * 1e6, "-", "-", "-"])
        for label, mode, r, comb in _variants(ratios):
            def fn(mode=mode, r=r, comb=comb):
                return tg.moe_forward(x, sw, ids, *qs["w13"], *qs["w2"], mode, residual_ratio=r,
                                      residual_per_token=True, residual_combine=comb)

            t, how = _time(fn)
            rows.append([tag, f"triton {label} layer", how, t * 1e6, t_base / t, wbytes / t / 1e9, wbytes / t / bw])
            times[("moe", m, label)] = t
            _record_combine_gap(times, ("moe", m), label, comb, fn, x, r)
        times[("moe", m, "bf16")] = t_base
    return rows


def _record_combine_gap(times: dict, key: tuple, label: str, comb: str, fn, x: torch.Tensor, r: float) -> None:
    """Output of the ``quads k=R`` variant kept (one extra call); for ``quads-bf16 k=R``, its relative
    distance to it, ``||y_bf16 - y_fp4x2|| / ||y_fp4x2||`` (float32 norms), stored as ``times[(*key,
    "gap quads-bf16 k=R")]`` (the one activation rounding to bf16 + summation order, measured on the device),
    and whether the bf16 operand of ``x`` (the first GEMM's input) is the torch reference's bytes
    (``times[(*key, "same quads-bf16 k=R")]``)."""
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
    op, _ = tg.quantize_activation(x, "quads", residual_ratio=r, residual_per_token=True, residual_combine="bf16")
    want = nv.residual_fake_quantize(x, r, nv.per_row_global_scale(x), per_token=True, backend="torch")
    times[(*key, "same " + label)] = bool(torch.equal(op.values, want))


def _variants(ratios: list[float]) -> list[tuple[str, str, float, str]]:
    """(label, act_mode, residual ratio, residual_combine): w4a16, naive, and for each R quads k=R (two FP4
    operands, the default) and quads-bf16 k=R (``residual_combine="bf16"``), per-token selection."""
    out = [("w4a16", "w4a16", 0.0, "fp4x2"), ("naive", "naive", 0.0, "fp4x2")]
    for r in ratios:
        out += [(f"quads k={r:g}", "quads", r, "fp4x2"), (f"quads-bf16 k={r:g}", "quads", r, "bf16")]
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


def _goal_lines(times: dict, ms: list[int], ratios: list[float]) -> list[str]:
    """PASS/FAIL of issue #5's goals from the measured times (seconds)."""
    out = ["goals (issue #5):"]

    def check(name, pairs, want, larger_is_better=True):
        if not pairs:
            out.append(f"  {name}: not measured")
            return
        vals = ", ".join(f"M={m}: {v:.2f}x" for m, v in pairs)
        ok = all((v >= want) if larger_is_better else (v <= want) for _, v in pairs)
        out.append(f"  {'PASS' if ok else 'FAIL'} {name}: {vals}")

    check("W4A16 MoE layer >= 2.5x BF16 grouped at M <= 256",
          [(m, times[("moe", m, "bf16")] / times[("moe", m, "w4a16")]) for m in ms
           if m <= 256 and ("moe", m, "w4a16") in times and ("moe", m, "bf16") in times], 2.5)
    for shape in ("d4096", "d8192"):
        check(f"W4A16 dense {shape} >= 2.5x cuBLAS BF16 at M <= 16",
              [(m, times[(shape, m, "bf16")] / times[(shape, m, "w4a16")]) for m in ms
               if m <= 16 and (shape, m, "w4a16") in times], 2.5)
    if 0.5 in ratios:
        for shape in sorted({k[0] for k in times}):
            for v in ("quads k=0.5", "quads-bf16 k=0.5"):
                check(f"{shape}: {v} time / naive time <= 1.10 at every M",
                      [(m, times[(shape, m, v)] / times[(shape, m, "naive")]) for m in ms
                       if (shape, m, v) in times and (shape, m, "naive") in times], 1.10,
                      larger_is_better=False)
    return out


def run(shapes: list[str], ms: list[int], ratios: list[float], sweep: bool) -> str:
    from verl_quads import nvfp4 as nv
    from verl_quads.nvfp4 import triton_gemm as tg

    dev = DEVICE
    out = [f"device: {device_name()}"]
    print(out[0], flush=True)
    bw = _copy_bandwidth()
    out.append(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)")
    print(out[-1], flush=True)
    rows = _Rows()
    best_cfgs = []
    times: dict = {}
    g = torch.Generator(device=dev).manual_seed(0)
    if "moe" in shapes:
        rows += _moe_layer_rows(ms, ratios, bw, dev, g, times)
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
                routing = tg.moe_align(ids, e, tg.pick_block_m(-(-s // min(e, s))))
                a_rows = routing.sorted_tokens if name == "w13" else routing.sorted_slots
                counts = torch.bincount(ids.reshape(-1), minlength=e)
                offs = torch.cumsum(counts, 0).to(torch.int32)
                x_sorted = x[a_rows.long()].contiguous()
                base_fn, base_label = _bf16_grouped(x_sorted, w_bf16.transpose(-2, -1), offs, counts.tolist())
                wbytes = active * n * k * 9 // 16
                bf16_bytes = active * n * k * 2
                t_align, how = _time(lambda: tg.moe_align(ids, e, routing.block_m))
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

            for label, mode, r, comb in _variants(ratios):
                cfg = None
                if sweep and mode in ("w4a16", "naive"):
                    op, _ = tg.quantize_activation(x, mode)
                    per = -(-(m * TOP_K) // min(e, m * TOP_K)) if grouped else m
                    cands = [c for c in _sweep_configs(per) if not grouped or c.block_m == routing.block_m]
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

                def full(mode=mode, r=r, cfg=cfg, comb=comb):
                    o, _ = tg.quantize_activation(x, mode, residual_ratio=r, residual_per_token=True,
                                                  residual_combine=comb)
                    return gemm(o, cfg)

                t, how = _time(full)
                times[(name, m, label)] = t
                _record_combine_gap(times, (name, m), label, comb, full, x, r)
                rows.append([tag, f"triton {label}", how, t * 1e6, t_base / t, wbytes / t / 1e9, wbytes / t / bw])
            torch.cuda.empty_cache()
        print(f"{name} rows done", flush=True)
    out.append(print_table(
        "NVFP4 fused GEMMs (triton backend) vs BF16; MoE layer and Qwen3 shapes at Qwen3-30B-A3B width",
        ["shape", "kernel", "timing", "us", "x bf16", "weight GB/s", "of copy BW"], rows))
    if best_cfgs:
        out.append("best launch configs (--sweep):\n" + "\n".join(best_cfgs))
    gaps = [f"  {k[0]} M={k[1]} {k[2][4:]}: {v:.2e}; operand == torch reference bytes: "
            f"{times.get((k[0], k[1], 'same ' + k[2][4:]))}" for k, v in times.items() if k[2].startswith("gap ")]
    if gaps:
        out.append("quads-bf16 vs quads (fp4x2) output, ||y_bf16 - y_fp4x2|| / ||y_fp4x2||:\n" + "\n".join(gaps))
        print(out[-1], flush=True)
    times = {k: v for k, v in times.items() if isinstance(v, float)}
    out += _goal_lines(times, ms, ratios)
    print("\n".join(_goal_lines(times, ms, ratios)), flush=True)
    return "\n".join(out)


# --- --sweep-decode: the W4A16 weight-streaming kernel's variants at decode shapes (issue #5) -------

L2_FLUSH_BYTES = 256 * 2**20  # > 2x the H200's 50 MB L2: each timed call reads weights no other call left in L2
DECODE_SHAPES = "moe,d8192,d4096"  # most important first: a run cut by --budget-s keeps these


def _focus_variants(rows: int, grouped: bool, current):
    """``--focus`` (short sweep, issue #5), at most 6 per GEMM (meant for ``--m 1,16`` at moe,d8192 in
    one ~150 s run on the H200), in this order (a budget cut drops the last): the current DECODE_TABLE
    entry (``current``, may be None); its ``f16x2`` + ``late_scale`` twin (CUDA-core entries: pair
    decode, block scale per word: ~1 SASS instruction per weight element fewer in the offline sm_90
    count) or its ``bf16x2`` twin (tensor-core entries: bf16 pair decode + packed bf16 scale multiply,
    ~1.5 fewer); CUDA-core ``f16x2`` + ``late_scale`` variants over tile / pipeline / split-K target
    (with 4 rows per chunk when rows > 2, i.e. also against the tensor-core entry at M=16). The
    nibble-major activation (``xperm``) and pipelined ``bits`` variants of the previous focus run were
    slower or are already in the table: not repeated."""
    from verl_quads.nvfp4.triton_gemm import StreamConfig

    bm = 1 if rows <= 1 else (2 if rows <= 2 else 4)
    out = [current] if current is not None else []
    if current is not None and current.mma == 0:
        out.append(replace(current, decode="f16x2", late_scale=True))
    elif current is not None:
        out.append(replace(current, decode="bf16x2"))
    late = dict(decode="f16x2", late_scale=True, fixup=True, num_warps=4)
    out += [StreamConfig(block_m=bm, block_n=128, block_kw=16, prefetch=False, pipe=3, **late),
            StreamConfig(block_m=bm, block_n=128, block_kw=16, prefetch=False, pipe=3, occ=8, **late),
            StreamConfig(block_m=bm, block_n=256 if bm == 1 else 64, block_kw=16, **late),  # bm4 n256 spills
            StreamConfig(block_m=bm, block_n=64, block_kw=32, **late)]
    return list(dict.fromkeys(out))[:6]  # a twin may repeat one of the grid


def _decode_variants(rows: int, grouped: bool, tokens: int):
    """(stage-1 configs, stage-2 variations of a config): a grid over tile shape and warps for the
    CUDA-core kernel (dense M <= 4 or any grouped GEMM: ~1-3 rows per expert at decode) and the
    tensor-core one (dense M >= 4, grouped at >= 16 tokens), then decode / prefetch / split-K / stages
    variations of the fastest correct few. ``rows``: M (dense) or rows per active expert (grouped)."""
    from verl_quads.nvfp4.triton_gemm import StreamConfig

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
    """The split_k that split_k=0 resolves to (mirrors triton_gemm._stream_gemm)."""
    from verl_quads.nvfp4.triton_gemm import _num_sms

    kw = k // 8
    n_tiles = -(-n // cfg.block_n)
    split = 1
    while m_rows_live * n_tiles * split * 2 <= cfg.occ * _num_sms(torch.device(DEVICE)) and kw // (cfg.block_kw * split * 2) >= 2:
        split *= 2
    return split


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


def run_sweep_decode(shapes: list[str], ms: list[int], budget_s: float = 1e9, focus: bool = False) -> str:
    """Time every streaming-kernel variant (and the current default kernel, and the BF16 baseline) at
    decode shapes with cold L2 (rotating weight copies / routings), check each variant against the
    torch reference, and print the fastest correct variant per shape with a paste-ready
    ``DECODE_TABLE``. Past ``budget_s`` seconds of wall time only the baselines, the tensor-core kernel
    and the first stage-1 config of each remaining shape are timed (the table is still printed).
    ``focus``: only :func:`_focus_variants` (<= 6 per GEMM), no stage 2."""
    import time

    from verl_quads import nvfp4 as nv
    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.rollout import emulation as em

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
        w = torch.randn(e, n, k, device=dev, generator=g) * 0.02
        q = nv.quantize(w, nv.global_scale_from_amax(w.abs().amax(dim=(1, 2), keepdim=True)), backend="triton")
        wp, wsc, wgs = q.packed, q.block_scale, q.global_scale.reshape(-1)
        wf = em.weight_f32(wp, wsc, wgs.reshape(e, 1, 1)) if grouped else em.weight_f32(wp[0], wsc[0], wgs.reshape(()))
        if not grouped:
            wp, wsc, wgs = wp[0], wsc[0], wgs.reshape(())
        w_bf16 = w.to(torch.bfloat16)
        del w
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
                routs = [tg.moe_align(ids, e, tg.pick_block_m(per)) for ids in id_sets]
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
                             f"{rel:.2e}", cfg.label if isinstance(cfg, tg.StreamConfig) else "-"])
                return t, ok

            default = tg.pick_config(per, routs[0].tile_expert.numel() if grouped else -(-m // tg.pick_block_m(m)),
                                     n, k, torch.device(dev), block_m=routs[0].block_m if grouped else None)
            r_def = measure("tensor-core kernel (pick_config, before #5 decode)", default)
            first, second = _decode_variants(per, grouped, m)
            if focus:
                first = _focus_variants(per, grouped, tg.decode_config(s_slots if grouped else m, n, k, grouped))
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
                bucket = tg.decode_bucket(s_slots if grouped else m)
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
        saved = dict(tg.DECODE_TABLE)
        tg.DECODE_TABLE.update(table)
        try:
            layer_rows = _moe_layer_rows(ms, [], bw, dev, g, {})
        finally:
            tg.DECODE_TABLE.clear()
            tg.DECODE_TABLE.update(saved)
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
                       + (", late_scale=True" if c.late_scale else "") + "),")
    snippet.append("}")
    out.append("\n".join(snippet))
    print("\n".join(snippet), flush=True)
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
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from verl_quads.nvfp4 import triton_gemm as tg

    const = tg._stream_constexprs(cfg, grouped=grouped, tm=16 if grouped else cfg.block_m, partial=True, fixup=cfg.fixup,
                                  has_bias=False, out_code=1, dt=1, even=True, interpreting=False)
    ptrs = ["x_ptr", "w_ptr", "ws_ptr", "wgs_ptr", "bias_ptr", "out_ptr", "part_ptr", "cnt_ptr", "arow_ptr", "orow_ptr",
            "tile_e_ptr", "tile_r0_ptr", "tile_r1_ptr"]
    types = ["*bf16", "*i32", "*u8", "*fp32", "*fp32", "*i16", "*fp32", "*i32", "*i32", "*i32", "*i32", "*i32", "*i32"]
    sig = dict(zip(ptrs, types))
    sig.update({n: "i32" for n in ("M", "N", "K", "KW", "KB", "OUT_ROWS", "KW_PER_SPLIT", "SPLIT")})
    sig.update({c: "constexpr" for c in const})
    aligned = ("N", "K", "KW", "KB", "KW_PER_SPLIT")
    attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(sig) if sig[nm][0] == "*" or nm in aligned}
    kern = triton.compile(ASTSource(fn=tg._w4a16_stream_kernel, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kern.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    body: list[str] = []
    for addr, text in ins:
        hit = re.search(r"BRA.*0x([0-9a-f]+)", text)
        if hit and int(hit.group(1), 16) < addr:
            loop = [t for a, t in ins if int(hit.group(1), 16) <= a <= addr]
            body = loop if len(loop) > len(body) else body
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    per_thread = cfg.block_n * cfg.block_kw * 8 / (32 * cfg.num_warps)
    return len(body), len(body) / per_thread, dict(ops.most_common())


def run_sass_count(shapes: list[str], ms: list[int]) -> str:
    """``--sass-count``: :func:`stream_sass_count` of the ``--focus`` variants (incl. the current
    DECODE_TABLE entry) of each decode GEMM, as a table (no GPU needed)."""
    from verl_quads.nvfp4 import triton_gemm as tg

    gemms = []
    for s in shapes:
        gemms += ([("moe w13", True) + SHAPES["w13"][1:], ("moe w2", True) + SHAPES["w2"][1:]] if s == "moe"
                  else [(s,) + SHAPES[s]])
    rows, seen = [], {}
    for name, grouped, n, k in gemms:
        for m in ms:
            slots = m * TOP_K if grouped else m
            per = -(-slots // min(NUM_EXPERTS, slots)) if grouped else m
            cur = tg.decode_config(slots, n, k, grouped)
            for cfg in _focus_variants(per, grouped, cur):
                key = (cfg, grouped)
                if key not in seen:
                    seen[key] = stream_sass_count(cfg, grouped)
                body, per_el, ops = seen[key]
                rows.append([f"{name} M={m}", cfg.label + (" (table)" if cfg == cur else ""), body, per_el, cfg.block_m,
                             ", ".join(f"{o} {c}" for o, c in list(ops.items())[:8])])
    return print_table("W4A16 stream kernel, offline sm_90 compile: SASS instructions in the K loop (bf16 activations, "
                       "split-K partials); per weight element per thread (x block_m activation rows)",
                       ["shape", "config", "K-loop SASS", "per weight element", "rows", "top opcodes"], rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="verl-quads bench rollout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help=f"comma-separated, from {['moe'] + list(SHAPES)} (moe: the whole routed-experts layer)")
    p.add_argument("--m", default="1,4,16,64,256,1024,4096", help="comma-separated token counts M")
    p.add_argument("--ratios", default="0.25,0.5,1.0", help="QUADS residual ratios k (comma-separated)")
    p.add_argument("--sweep", action="store_true", help="try launch configs per shape and use the fastest")
    p.add_argument("--sweep-decode", action="store_true",
                   help="time every W4A16 weight-streaming kernel variant at decode M (default --m 1,4,16, shapes "
                        f"{DECODE_SHAPES}) with cold L2, check each against the torch reference, print the fastest "
                        "correct per shape and a paste-ready triton_gemm.DECODE_TABLE")
    p.add_argument("--budget-s", type=float, default=1e9,
                   help="--sweep-decode: wall seconds after which each remaining shape times only its baselines and "
                        "first config (so a run under a time limit still prints its table)")
    p.add_argument("--focus", action="store_true",
                   help="--sweep-decode: short targeted sweep (<= 6 configs per GEMM: the current DECODE_TABLE entry, "
                        "its f16x2+late_scale (CUDA-core) or bf16x2 (tensor-core) twin, f16x2+late_scale tiles; no "
                        "stage 2); e.g. --sweep-decode --focus --shapes moe,d8192 --m 1,16 --budget-s 120")
    p.add_argument("--sass-count", action="store_true",
                   help="no GPU needed: compile the --focus variants of the decode GEMMs (--shapes, --m) for sm_90 and "
                        "count the SASS instructions per weight element in their K loop")
    p.add_argument("--out", default=None, help="also write the tables to this file")
    a = p.parse_args(argv)
    if a.sass_count:
        shapes = [s for s in (a.shapes if a.shapes != DEFAULT_SHAPES else "moe,d8192").split(",") if s]
        text = run_sass_count(shapes, [int(v) for v in (a.m if a.m != "1,4,16,64,256,1024,4096" else "1,16").split(",")])
        if a.out:
            with open(a.out, "w") as f:
                f.write(text + "\n")
        return
    if not torch.cuda.is_available():
        raise SystemExit("verl-quads bench rollout needs a CUDA GPU (CPU numbers are not the point)")
    if a.sweep_decode:
        shapes = [s for s in (a.shapes if a.shapes != DEFAULT_SHAPES else DECODE_SHAPES).split(",") if s]
        bad = [s for s in shapes if s not in ("moe", "d4096", "d8192", "qkv", "o_proj")]
        if bad:
            raise SystemExit(f"verl-quads bench rollout --sweep-decode: unknown shape(s) {bad}; allowed: moe (w13 and "
                             "w2 grouped GEMMs), d4096, d8192, qkv, o_proj")
        ms = [int(v) for v in (a.m if a.m != "1,4,16,64,256,1024,4096" else "1,4,16").split(",")]
        text = run_sweep_decode(shapes, ms, a.budget_s, a.focus)
        if a.out:
            with open(a.out, "w") as f:
                f.write(text + "\n")
        return
    shapes = [s for s in a.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES and s != "moe"]
    if bad:
        raise SystemExit(f"verl-quads bench rollout: unknown shape(s) {bad}; allowed: {['moe'] + list(SHAPES)}")
    text = run(shapes, [int(v) for v in a.m.split(",")], [float(v) for v in a.ratios.split(",") if v], a.sweep)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
