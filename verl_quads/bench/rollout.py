"""``verl-quads bench rollout``: the ``triton`` rollout backend's fused NVFP4 GEMMs vs BF16 (CUDA).

No vLLM needed: calls :mod:`verl_quads.nvfp4.triton_gemm` directly at Qwen3-30B-A3B's shapes --
``qkv`` (2048 -> (32 + 4 + 4) * 128 = 5120), ``o_proj`` (4096 -> 2048), and the routed experts as ONE
grouped launch per GEMM (``w13``: 128 experts x [1536, 2048]; ``w2``: 128 x [2048, 768]; top-8 random
routing) -- at prefill M = 4096 and decode M = 1 / 8 / 64 tokens (experts: M x 8 token-slots).

In one run, on one device, per (shape, M):

- ``bf16``: the baseline, timed in the same run: ``x @ w.T`` (``torch.matmul``, cuBLAS) for dense
  shapes, ``torch._grouped_mm`` over the expert-sorted rows for the experts (per-expert Python loop
  of matmuls when ``_grouped_mm`` is unavailable; the row says which);
- ``w4a16``, ``naive`` (W4A4 emulated: activation quantized per token by the core, read packed),
  ``quads k=R`` (per-call residual selection; for w2 one selection per expert: a
  host-synchronizing loop, timed eagerly) and ``quads k=R per-token`` (one call, graph-capturable): the whole GEMM call
  including the activation's quantization, and "gemm only" (operand prepared outside the timing);
- time is device time of the call captured in a CUDA graph (``graph``), or an eager call's time
  where it cannot be captured (``eager``); ``x bf16`` is the BF16 time divided by this time
  (> 1: faster than BF16); weight bandwidth counts the weight bytes the GEMM must read (NVFP4
  codes + block scales; the active experts' only), as a fraction of the device-to-device copy
  bandwidth measured in the same run.

``moe``: the whole routed-experts layer, :func:`triton_gemm.moe_forward` vs a BF16 layer built
from ``torch._grouped_mm`` (same structure), per mode.

``--sweep`` first tries a set of launch configurations per (shape, M) for the w4a16 and naive
GEMMs and uses the fastest (printed), so the heuristic of :func:`triton_gemm.pick_config` can be
tuned from one run.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from verl_quads.bench.timing import device_name, graph_time_s, median_time_s, print_table

SHAPES = {  # name: (grouped, N, K)
    "qkv": (False, 5120, 2048),
    "o_proj": (False, 2048, 4096),
    "w13": (True, 1536, 2048),
    "w2": (True, 2048, 768),
}
NUM_EXPERTS, TOP_K = 128, 8
DEVICE = "cuda"  # a CPU smoke run (TRITON_INTERPRET=1, tiny SHAPES) may set "cpu"


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


def _moe_layer_rows(ms: list[int], ratio: float, bw: float, dev: str, g: torch.Generator) -> list[list[object]]:
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
    rows = []
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
        for label, mode, per_token in (("w4a16", "w4a16", True), ("naive", "naive", True),
                                       (f"quads k={ratio} per-token", "quads", True),
                                       (f"quads k={ratio} per-expert selection", "quads", False)):
            def fn(mode=mode, per_token=per_token):
                return tg.moe_forward(x, sw, ids, *qs["w13"], *qs["w2"], mode, residual_ratio=ratio,
                                      residual_per_token=per_token)

            t, how = _time(fn, eager=not per_token)
            rows.append([tag, f"triton {label} layer", how, t * 1e6, t_base / t, wbytes / t / 1e9, wbytes / t / bw])
    return rows


def run(shapes: list[str], ms: list[int], ratio: float, sweep: bool) -> str:
    from verl_quads import nvfp4 as nv
    from verl_quads.nvfp4 import triton_gemm as tg

    dev = DEVICE
    out = [f"device: {device_name()}"]
    print(out[0], flush=True)
    bw = _copy_bandwidth()
    out.append(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)")
    print(out[-1], flush=True)
    rows = []
    best_cfgs = []
    g = torch.Generator(device=dev).manual_seed(0)
    if "moe" in shapes:
        rows += _moe_layer_rows(ms, ratio, bw, dev, g)
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
            if grouped:
                s = m * TOP_K
                ids = torch.rand(m, e, device=dev, generator=g).argsort(-1)[:, :TOP_K]
                active = int(ids.unique().numel())
                n_rows = m if name == "w13" else s
                x = torch.randn(n_rows, k, device=dev, generator=g).to(torch.bfloat16)
                routing = tg.moe_align(ids, e, tg.pick_block_m(-(-s // min(e, s))))
                a_rows = (torch.div(routing.sorted_slots, TOP_K, rounding_mode="floor") if name == "w13"
                          else routing.sorted_slots)
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
            rows.append([tag, base_label, how, t_base * 1e6, 1.0, bf16_bytes / t_base / 1e9, bf16_bytes / t_base / bw])

            def gemm(op, cfg=None):
                kw = dict(routing=routing, a_rows=a_rows, out_rows=(m * TOP_K if grouped else None))
                return tg.nvfp4_gemm(op, w_packed, w_scale, w_gs, config=cfg, **kw) if grouped else \
                    tg.nvfp4_gemm(op, w_packed, w_scale, w_gs, config=cfg)

            variants = [("w4a16", "w4a16", False), ("naive", "naive", False),
                        (f"quads k={ratio}", "quads", False), (f"quads k={ratio} per-token", "quads", True)]
            for label, mode, per_token in variants:
                cfg = None
                eager = False
                if mode == "quads" and name == "w2" and not per_token:
                    # per-expert selection (the reference's per-expert call; GEMM1's input x is one call
                    # shared by all experts): a host-synchronizing loop, timed eagerly with the bincount
                    sorted_x = x[a_rows.long()]
                    eager = True
                    flat_ids = ids.reshape(-1)

                    def full():
                        clist = torch.bincount(flat_ids, minlength=e).tolist()
                        return gemm(tg.quads_grouped_operand(sorted_x, clist, list(range(e)), e, ratio))

                    op = tg.quads_grouped_operand(sorted_x, counts.tolist(), list(range(e)), e, ratio)
                    ar = torch.arange(s, dtype=torch.int32, device=dev)

                    def gemm_only():
                        return tg.nvfp4_gemm(op, w_packed, w_scale, w_gs, routing=routing, a_rows=ar, out_rows=s)
                else:
                    op, _ = tg.quantize_activation(x, mode, residual_ratio=ratio, residual_per_token=per_token)
                    if sweep and mode in ("w4a16", "naive"):
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

                    def full(mode=mode, per_token=per_token, cfg=cfg):
                        o, _ = tg.quantize_activation(x, mode, residual_ratio=ratio, residual_per_token=per_token)
                        return gemm(o, cfg)

                    def gemm_only(op=op, cfg=cfg):
                        return gemm(op, cfg)

                for what, fn in (("", full), (" (gemm only)", gemm_only)):
                    t, how = _time(fn, eager=eager and fn is full)
                    rows.append([tag, f"triton {label}{what}", how, t * 1e6, t_base / t, wbytes / t / 1e9,
                                 wbytes / t / bw])
            torch.cuda.empty_cache()
    out.append(print_table(
        "NVFP4 fused GEMMs (triton backend) vs BF16, Qwen3-30B-A3B shapes",
        ["shape", "kernel", "timing", "us", "x bf16", "weight GB/s", "of copy BW"], rows))
    if best_cfgs:
        out.append("best launch configs (--sweep):\n" + "\n".join(best_cfgs))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="verl-quads bench rollout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="moe,qkv,o_proj,w13,w2",
                   help=f"comma-separated, from {['moe'] + list(SHAPES)} (moe: the whole routed-experts layer)")
    p.add_argument("--m", default="4096,1,8,64,256", help="comma-separated token counts M")
    p.add_argument("--ratio", type=float, default=0.5, help="QUADS residual ratio k")
    p.add_argument("--sweep", action="store_true", help="try launch configs per shape and use the fastest")
    p.add_argument("--out", default=None, help="also write the tables to this file")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("verl-quads bench rollout needs a CUDA GPU (CPU numbers are not the point)")
    shapes = [s for s in a.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES and s != "moe"]
    if bad:
        raise SystemExit(f"verl-quads bench rollout: unknown shape(s) {bad}; allowed: {list(SHAPES)}")
    text = run(shapes, [int(v) for v in a.m.split(",")], a.ratio, a.sweep)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
