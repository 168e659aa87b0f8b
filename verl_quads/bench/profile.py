"""``verl-quads bench profile``: where the device time of ONE rollout GEMM call goes at decode sizes (CUDA).

For each shape, M and mode, a torch.profiler trace of ``--calls`` eager calls of the rollout's ``triton`` backend
entry points -- :func:`verl_quads.nvfp4.triton_gemm.moe_forward` (the routed-experts layer at Qwen3-30B-A3B width:
hidden 2048, intermediate 768, 128 experts, top-8, random routing) and :func:`~verl_quads.nvfp4.triton_gemm.nvfp4_linear`
(dense ``N x K``) -- and every device kernel with its time per call (microseconds) and launches per call. At decode the
kernel count matters as much as the GEMM: each launch in a CUDA graph costs ~1-3 us even when it does nothing.
The numbers are device kernel time of eager calls; ``verl-quads bench rollout`` times the same calls as CUDA-graph
replays (what vLLM runs), which also include the gaps between kernels.

Modes: ``w4a16``, ``naive``, ``quads`` with the product defaults on ``triton`` (``bf16`` operand form, per-token
``channel`` rule, k = ``--ratio``) and ``quads:block`` (the block rule, same form), ``trace`` (no capture).
"""

from __future__ import annotations

import argparse

import torch

from verl_quads.bench.timing import device_name

#: mode label -> (act_mode, residual_combine, residual_granularity)
MODES = {"w4a16": ("w4a16", "bf16", "channel"), "naive": ("naive", "bf16", "channel"),
         "quads": ("quads", "bf16", "channel"), "quads:block": ("quads", "bf16", "block"),
         "trace": ("trace", "bf16", "channel")}


def kernel_table(fn, calls: int) -> tuple[float, float, list[tuple[str, float, float]]]:
    """Run ``fn`` 3 times (warm-up, compile), then profile ``calls`` calls: (kernel us per call, launches per call,
    [(kernel name, us per call, launches per call)] sorted by time)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    agg: dict[str, tuple[float, int]] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        tot, cnt = agg.get(ev.name, (0.0, 0))
        agg[ev.name] = (tot + ev.time_range.elapsed_us(), cnt + 1)
    rows = sorted(((n, t / calls, c / calls) for n, (t, c) in agg.items()), key=lambda r: -r[1])
    return sum(r[1] for r in rows), sum(r[2] for r in rows), rows


def _moe_case(m: int, dev: str, g: torch.Generator, weights: dict):
    from verl_quads.bench.rollout import NUM_EXPERTS, TOP_K

    hidden = weights["w13"][0].shape[-1] * 2
    x = torch.randn(m, hidden, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.rand(m, NUM_EXPERTS, device=dev, generator=g).argsort(-1)[:, :TOP_K]
    sw = torch.softmax(torch.randn(m, TOP_K, device=dev, generator=g), -1)
    return x, ids, sw


def run(shapes: list[str], ms: list[int], modes: list[str], ratio: float, calls: int) -> str:
    from verl_quads import nvfp4 as nv
    from verl_quads.bench.rollout import moe_nvfp4_weights
    from verl_quads.nvfp4 import triton_gemm as tg

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    out = [f"device: {device_name()}; torch.profiler, {calls} eager calls per case, device kernels only"]
    for shape in shapes:
        if shape == "moe":
            weights = moe_nvfp4_weights(dev, g)
        elif shape.startswith("d"):
            n = k = int(shape[1:])
            wq = nv.quantize(torch.randn(n, k, device=dev, generator=g) * 0.02, backend="triton")
        else:
            raise SystemExit(f"--shapes: 'moe' or 'dN' (dense N x N), got {shape!r}")
        for m in ms:
            for mode in modes:
                act, comb, gran = MODES[mode]
                if shape == "moe":
                    x, ids, sw = _moe_case(m, dev, g, weights)

                    def fn(x=x, ids=ids, sw=sw, act=act, comb=comb, gran=gran):
                        return tg.moe_forward(x, sw, ids, *weights["w13"], *weights["w2"], act, residual_ratio=ratio,
                                              residual_per_token=True, residual_combine=comb,
                                              residual_granularity=gran)
                else:
                    x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)

                    def fn(x=x, act=act, comb=comb, gran=gran):
                        return tg.nvfp4_linear(x, wq.packed, wq.block_scale, wq.global_scale, None, act,
                                               residual_ratio=ratio, residual_per_token=True, residual_combine=comb,
                                               residual_granularity=gran)
                total, launches, rows = kernel_table(fn, calls)
                out.append(f"\n== {shape} M={m} {mode}: {total:.1f} us kernel time, {launches:g} launches per call")
                out += [f"  {us:7.1f} us  x{cnt:g}  {name[:110]}" for name, us, cnt in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="verl-quads bench profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="moe,d8192", help="comma-separated: moe, dN (dense N x N)")
    p.add_argument("--m", default="1,16", help="comma-separated token counts")
    p.add_argument("--modes", default="w4a16,naive,quads,quads:block", help=f"comma-separated of {sorted(MODES)}")
    p.add_argument("--ratio", type=float, default=0.5, help="QUADS residual ratio k")
    p.add_argument("--calls", type=int, default=10)
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    bad = sorted(set(modes) - set(MODES))
    if bad:
        raise SystemExit(f"--modes: unknown {bad}; allowed {sorted(MODES)}")
    if not torch.cuda.is_available():
        raise SystemExit("verl-quads bench profile needs a CUDA GPU (it profiles device kernels)")
    print(run(a.shapes.split(","), [int(v) for v in a.m.split(",")], modes, a.ratio, a.calls), flush=True)


if __name__ == "__main__":
    main()
