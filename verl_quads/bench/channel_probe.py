"""Issue #5 probe: where a dense QUADS-bf16 call (channel rule, k = 0.5, per token) spends its time, next to naive
W4A4, and the channel kernel's variants inside that call.

Per dense shape (``d4096`` 4096x4096, ``d8192`` 8192x8192 or ``NxK``; the weight as ``bench rollout`` builds it) and M, timed
as ``bench rollout``'s main table times its rows (warm L2: one call captured in a CUDA graph, replays; us):

- ``naive``: the whole call (``quantize_activation(x, "naive")`` + ``nvfp4_gemm``), the activation quantize alone,
  the W4A4 GEMM alone on the operand quantized beforehand;
- ``quads-bf16 k=0.5 (channel)``: the whole call, the channel kernel alone (``residual_fake_quantize`` with
  ``amax="row"``: the call's activation step), the w4a16 GEMM alone on that bf16 operand (the default dispatch);
- per channel variant (``triton_channel.CHANNEL_VARIANTS`` names): the operand first checked against the torch
  reference (``torch.equal`` of the bf16 bytes; a mismatch is reported and not timed), then the kernel alone and the
  whole call, and whole call / naive call.

``--phases`` also prints the channel kernel's STOP timing probes (``bench nvfp4 --channel-probe``) at the given
``MxK`` shapes for the variants.

    python -m verl_quads.bench.channel_probe [--shapes d4096,d8192] [--ms 1,4,16,64] [--variants default,...]
        [--phases 16x4096] [--repeat 2] [--split-phases]

``--split-phases``: instead, the ``granularity="channel_sampled"`` split search's kernels alone (``split_phases``).
"""

from __future__ import annotations

import argparse

import torch

from verl_quads.bench.timing import device_name, print_table


def _weights(n: int, k: int, dev: str, g: torch.Generator):
    """The dense NVFP4 weight ``bench rollout`` times (randn * 0.02, per-tensor global scale)."""
    from verl_quads import nvfp4 as nv

    w = torch.randn(n, k, device=dev, generator=g, dtype=torch.float32) * 0.02
    q = nv.quantize(w, nv.global_scale_from_amax(w.abs().amax()), backend="triton")
    return q.packed, q.block_scale, q.global_scale.reshape(())


def _timer(dev: str):
    """us of a call: on a GPU as ``bench rollout``'s main table (warm L2, graph replay); on CPU (TRITON_INTERPRET=1)
    a functional smoke run, one call."""
    if dev == "cuda":
        from verl_quads.bench.rollout import _time

        return lambda f: _time(f)[0] * 1e6
    from verl_quads.bench.timing import median_time_s

    return lambda f: median_time_s(f, 0, 1, 1) * 1e6


def _sampled_desc(m: int, nbp: int) -> str:
    """The channel_sampled launch of ``m`` rows (``triton_channel.CHANNEL_CONFIG``) in words."""
    from verl_quads.nvfp4 import triton_channel as tc

    cfg = tc.CHANNEL_CONFIG
    warps = cfg["sample_warps"].get(nbp, tc._warps(nbp))
    cap = cfg["sample_maxnreg"].get(nbp, cfg["qdq_maxnreg"])
    if not tc._split(m, nbp):
        return f"{warps} warps, sampled, maxnreg {cap}"
    return (f"split: scores {tc._warps(nbp)} warps, search {cfg['sample_search_rows']} rows / "
            f"{cfg['sample_search_warps']} warps, row kernel {warps} warps maxnreg {cap}")


def split_phases(shapes: list[str], ms: list[int], variants: tuple[str, ...], dev: str = "cuda") -> str:
    """The split search's kernels timed alone (``granularity="channel_sampled"`` launches past
    ``sample_split_rows``; bf16, k = 0.5, amax="row"): the sampled scores, + the batched search (the thresholds),
    the whole split QDQ; warm L2, graph replay, us."""
    from verl_quads.bench.rollout import SHAPES
    from verl_quads.nvfp4 import residual as res
    from verl_quads.nvfp4 import triton_channel as tc

    g = torch.Generator(device=dev).manual_seed(0)
    us = _timer(dev)
    rows = []
    for name in shapes:
        k = SHAPES[name][2] if name in SHAPES else int(name.split("x")[1])
        nb, nbp, sp = k // 16, tc._check_row(k), res.samples_per_block(k)
        nss = res.num_sampled_threshold_rank(k, 0.5)
        for m in ms:
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            x[:, ::293] *= 30.0
            gbuf = torch.empty(m, 1, dtype=torch.float32, device=dev)
            for v in variants:
                with tc.channel_config(**tc.CHANNEL_VARIANTS[v]):
                    def part(search):
                        return tc._split_thresholds(x, gbuf, None, nb, nbp, sp, nss, 1, True, search=search)

                    def whole():
                        return tc.residual_fake_quantize(x, 0.5, amax="row", granularity="channel_sampled",
                                                         check_finite=False)

                    t = [us(lambda: part(False)), us(lambda: part(True)), us(whole)]
                    rows.append([f"{name} M={m}", v, _sampled_desc(m, nbp), f"{t[0]:.2f}", f"{t[1]:.2f}",
                                 f"{t[2]:.2f}"])
                    print(" | ".join(str(c) for c in rows[-1]), flush=True)
    return print_table(f"channel_sampled split search, kernels alone ({device_name()}), us, warm L2 graph replay",
                       ["point", "variant", "launch", "scores", "scores + search", "whole QDQ"], rows)


def run(shapes: list[str], ms: list[int], variants: tuple[str, ...] = ("default",), repeat: int = 1,
        dev: str = "cuda", granularity: str = "channel") -> str:
    from verl_quads import nvfp4 as nv
    from verl_quads.bench.rollout import SHAPES
    from verl_quads.nvfp4 import gluon_dispatch as gd
    from verl_quads.nvfp4 import triton_channel as tc
    from verl_quads.nvfp4 import triton_gemm as tg

    bad = [v for v in variants if v not in tc.CHANNEL_VARIANTS]
    if bad:
        raise ValueError(f"channel_probe: unknown variants {bad}; allowed {sorted(tc.CHANNEL_VARIANTS)}")
    g = torch.Generator(device=dev).manual_seed(0)
    rows, summary = [], []
    us = _timer(dev)
    for name in shapes:
        n, k = SHAPES[name][1:] if name in SHAPES else (int(v) for v in name.split("x"))
        wp, wsc, wgs = _weights(n, k, dev, g)
        for m in ms:
            tag = f"{name} M={m}"
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            x[:, ::293] *= 30.0

            def naive_q():
                return tg.quantize_activation(x, "naive")[0]

            def quads_q():
                return tg.quantize_activation(x, "quads", residual_ratio=0.5, residual_per_token=True,
                                              residual_combine="bf16", residual_granularity=granularity)[0]

            op_n = naive_q()
            t_nf, t_nq, t_ng = (us(lambda: tg.nvfp4_gemm(naive_q(), wp, wsc, wgs)), us(naive_q),
                                us(lambda: tg.nvfp4_gemm(op_n, wp, wsc, wgs)))
            rows += [[tag, "naive: whole call", "-", t_nf, 1.0, "-"],
                     [tag, "naive: activation quantize alone", "-", t_nq, t_nq / t_nf, "-"],
                     [tag, "naive: W4A4 GEMM alone", "-", t_ng, t_ng / t_nf, f"sum of parts {t_nq + t_ng:.3g}"]]
            op_q = quads_q()
            gcfg = gd.gluon_dense_config(op_q.values, wp) if dev == "cuda" else None
            t_gemm = us(lambda: tg.nvfp4_gemm(op_q, wp, wsc, wgs))
            rows.append([tag, f"quads-bf16: w4a16 GEMM alone on the bf16 operand"
                         f"{' (gluon ' + gcfg.label + ')' if gcfg else ''}", "-", t_gemm, t_gemm / t_nf, "-"])
            ref = nv.residual_fake_quantize(x, 0.5, amax="row", per_token=True, granularity=granularity,
                                            backend="torch", check_finite=False)
            for rep in range(repeat):
                for v in variants:
                    with tc.channel_config(**tc.CHANNEL_VARIANTS[v]):
                        nbp = tc._check_row(k)
                        comp = tc._compact_args(m, k, nbp)
                        if granularity == "channel_sampled":
                            desc = _sampled_desc(m, nbp)
                        else:
                            desc = (f"{tc._launch_warps(m, k, nbp)} warps, "
                                    + (f"compact J={comp[0]} cap={comp[1]}" if comp else "full-row search"))
                        label = f"quads-bf16 {granularity} {v!r}" + (f" (repeat {rep + 1})" if rep else "")
                        try:
                            same = torch.equal(quads_q().values.view(torch.int16), ref.view(torch.int16))
                            if not same:
                                rows.append([tag, label, desc, "MISMATCH", "-", "bytes != torch reference"])
                                continue
                            t_k = us(quads_q)
                            t_f = us(lambda: tg.nvfp4_gemm(quads_q(), wp, wsc, wgs))
                        except Exception as e:  # a variant the device's triton does not compile: reported
                            rows.append([tag, label, desc, "ERROR", "-", f"{type(e).__name__}: {str(e)[:120]!r}"])
                            continue
                    rows += [[tag, f"{label}: kernel alone", desc, t_k, t_k / t_nf, "== torch bytes"],
                             [tag, f"{label}: whole call", desc, t_f, t_f / t_nf,
                              f"kernel + GEMM alone {t_k + t_gemm:.3g}"]]
                    summary.append(f"{tag} {v!r}{' r' + str(rep + 1) if rep else ''}: quads-bf16 {t_f:.2f} us / "
                                   f"naive {t_nf:.2f} us = {t_f / t_nf:.3f}x (channel kernel {t_k:.2f}, GEMM "
                                   f"{t_gemm:.2f}; naive quantize {t_nq:.2f} + W4A4 GEMM {t_ng:.2f})")
                    print(summary[-1], flush=True)
        del wp, wsc
        torch.cuda.empty_cache() if dev == "cuda" else None
    out = print_table(f"QUADS-bf16 ({granularity}, k=0.5) vs naive W4A4, dense, warm L2, graph replay ({device_name()}); "
                      "x naive = time / naive whole call", ["point", "what", "launch", "us", "x naive", "note"], rows)
    return out + "\n" + "\n".join(summary)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="d4096,d8192", help="comma-separated dense shapes (bench rollout names)")
    p.add_argument("--ms", default="1,4,16,64", help="comma-separated M")
    p.add_argument("--variants", default="default", help="comma-separated triton_channel.CHANNEL_VARIANTS names")
    p.add_argument("--repeat", type=int, default=1, help="time the variants this many times (noise check)")
    p.add_argument("--phases", default="", help="comma-separated MxK: also the STOP timing probes there")
    p.add_argument("--phase-variants", default=None, help="variants of --phases (default: --variants)")
    p.add_argument("--granularity", default="channel", choices=("channel", "channel_sampled"),
                   help="the QUADS rule timed (the variants apply to its kernel)")
    p.add_argument("--split-phases", action="store_true",
                   help="only the channel_sampled split search's kernels alone (--shapes, --ms, --variants)")
    p.add_argument("--device", default="cuda", help="cuda; cpu = a functional smoke run (TRITON_INTERPRET=1)")
    a = p.parse_args(argv)
    variants = tuple(a.variants.split(","))
    if a.split_phases:
        print(split_phases(a.shapes.split(","), [int(v) for v in a.ms.split(",")], variants, a.device), flush=True)
        return
    print(run(a.shapes.split(","), [int(v) for v in a.ms.split(",")], variants, a.repeat, a.device, a.granularity),
          flush=True)
    if a.phases:  # after the main table (a run cut by a time limit keeps it)
        from verl_quads.bench.nvfp4 import run_channel_probe

        shapes = [tuple(int(v) for v in s.split("x")) for s in a.phases.split(",")]
        run_channel_probe(shapes, ratios=(0.5,), device=a.device,
                          variants=tuple((a.phase_variants or a.variants).split(",")), granularity=a.granularity)


if __name__ == "__main__":
    main()
