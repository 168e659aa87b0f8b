"""Issue #5 probe: the Gluon W4A16 prototype (:mod:`verl_quads.nvfp4.gluon_gemm`) vs cuBLAS BF16 and the current
default W4A16 dispatch (``triton_gemm.nvfp4_linear(..., "w4a16")``) at dense decode shapes, cold L2.

Timing as ``verl-quads bench rollout --sweep-decode``: one CUDA graph replays one call per weight copy (copies so
that >= 256 MB are read per replay: every call reads a weight no other call left in L2), time / copies, median
of :func:`verl_quads.bench.timing.graph_time_s`. Every Gluon config is checked against the torch reference
(:mod:`verl_quads.rollout.emulation`: x_f32 @ w_f32.T, one cast) with the tests' bound (1 bf16 ulp + 4 K eps_f32
|x| @ |w|.T per element); max |err| / max |ref| is printed.

    python -m verl_quads.bench.gluon_probe [--shapes 8192x8192,4096x4096] [--ms 1,2,4,8,16] [--configs all|quick]
    python -m verl_quads.bench.gluon_probe --sass   # offline sm_90 compile, K-loop SASS counts (no GPU)
"""

from __future__ import annotations

import argparse
import time

import torch

from verl_quads.bench.rollout import L2_FLUSH_BYTES, _err, _rotating, _time


def _configs(which: str):
    """(kind, config, weight format) triples: ``std`` = the standard-layout kernel (gluon_w4a16_std, the one the
    dispatch uses), ``perm`` = the permuted-layout prototype (format 2; format 1 once, for comparison)."""
    from verl_quads.nvfp4.gluon_gemm import GluonConfig as G

    std = [G(4, 1, 0, 2), G(4, 1, 0, 2, prefetch=False), G(8, 1, 0, 2, prefetch=False), G(8, 1, 0, 2),
           G(4, 1, 0, 4), G(4, 2, 0, 2)]
    perm = [(G(4, 2, 0, 2), 2), (G(4, 2, 0, 2), 1), (G(4, 4, 0, 4), 2)]
    if which == "quick":
        return [("std", c, 0) for c in std[:3]] + [("perm", c, f) for c, f in perm[:2]]
    return [("std", c, 0) for c in std] + [("perm", c, f) for c, f in perm]


def _time_rot(fn_of_copy, copies: int) -> float:
    """Seconds per call of ``fn_of_copy(i)`` over ``copies`` weight copies (cold L2), timed as ``bench rollout``
    times its rotating copies (one CUDA graph of all of them; eager median where a graph cannot be captured)."""
    return _time(_rotating(fn_of_copy, copies))[0] / copies


def run(shapes: list[tuple[int, int]], ms: list[int], which: str = "all") -> str:
    from verl_quads.bench.timing import device_name, print_table
    from verl_quads.nvfp4 import gluon_gemm as gg
    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.rollout import emulation as em

    dev = "cuda"
    print(device_name(), flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    rows, summary = [], []
    cfgs = _configs(which)
    for n, k in shapes:
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        q = em.quantize_weight(w)
        wp, wsc, wgs = q.packed, q.block_scale, q.global_scale.reshape(())
        wf = em.weight_f32(wp, wsc, wgs)
        wbf = w.to(torch.bfloat16)
        del w
        wbytes, bbytes = n * k * 9 // 16, n * k * 2
        copies = max(1, min(64, -(-L2_FLUSH_BYTES // wbytes)))
        bcopies = max(1, min(64, -(-L2_FLUSH_BYTES // bbytes)))
        wps = [wp] + [wp.clone() for _ in range(copies - 1)]
        wscs = [wsc] + [wsc.clone() for _ in range(copies - 1)]
        gws = {f: [gg.permute_weight(wps[i], wscs[i], wgs, fmt=f) for i in range(copies)]
               for f in sorted({f for kind, _, f in cfgs if kind == "perm"})}
        wbs = [wbf] + [wbf.clone() for _ in range(bcopies - 1)]
        for m in ms:
            tag = f"N={n} K={k} M={m}"
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            x[:, ::293] *= 30.0
            xr = x.float()
            ref = (xr @ wf.t()).to(torch.bfloat16)
            bound = 4 * k * torch.finfo(torch.float32).eps * (xr.abs() @ wf.abs().t())
            t_cub = _time_rot(lambda i: x @ wbs[i].t(), bcopies)
            rows.append([tag, "cuBLAS bf16 torch.matmul", "-", t_cub * 1e6, 1.0, "-"])
            saved = dict(tg.GLUON_TABLE)
            for label_d, table in (("default dispatch without GLUON_TABLE", {}), ("default dispatch", saved)):
                tg.GLUON_TABLE.clear()
                tg.GLUON_TABLE.update(table)
                try:
                    y = tg.nvfp4_linear(x, wp, wsc, wgs, None, "w4a16")
                    rel, ok = _err(y, ref, bound)
                    t_def = _time_rot(lambda i: tg.nvfp4_linear(x, wps[i], wscs[i], wgs, None, "w4a16"), copies)
                finally:
                    tg.GLUON_TABLE.clear()
                    tg.GLUON_TABLE.update(saved)
                gcfg = tg.gluon_dense_config(x, wp) if table else None
                rows.append([tag, f"{label_d} (nvfp4_linear w4a16{', gluon ' + gcfg.label if gcfg else ''})",
                             "ok" if ok else "WRONG", t_def * 1e6, t_cub / t_def, f"{rel:.2e}"])
            best = None
            for kind, cfg, fmt in cfgs:
                if kind == "std":
                    label = f"std {cfg.label}"

                    def call(i, cfg=cfg):
                        return gg.gluon_w4a16_std(x, wps[i], wscs[i], wgs, None, cfg)

                    gn, split, cps, even = gg.std_plan(n, k, cfg, gg._num_sms(x.device))
                else:
                    gw = gws[fmt]
                    label = f"perm {cfg.label} f{fmt}"

                    def call(i, cfg=cfg, gw=gw):
                        return gg.gluon_w4a16(x, gw[i], cfg)

                    gn, split, cps, even = gg.plan(gw[0], cfg, gg._num_sms(x.device))
                try:
                    t0 = time.time()
                    rel, ok = _err(call(0), ref, bound)
                    t = _time_rot(call, copies)
                except Exception as ex:  # reported, skipped
                    print(f"  {tag} gluon {label}: failed {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                    continue
                rows.append([tag, f"gluon {label} (grid {gn}x{split}, {cps} chunks{' even' if even else ''})",
                             "ok" if ok else "WRONG", t * 1e6, t_cub / t, f"{rel:.2e}"])
                print(f"  {tag} gluon {label}: {t * 1e6:.1f} us ({'ok' if ok else 'WRONG'}, rel {rel:.1e}, "
                      f"{time.time() - t0:.1f} s)", flush=True)
                if ok and (best is None or t < best[0]):
                    best = (t, label)
            line = (f"{tag}: cuBLAS {t_cub * 1e6:.1f} us, default {t_def * 1e6:.1f} us ({t_cub / t_def:.2f}x)"
                    + (f", best gluon {best[1]} {best[0] * 1e6:.1f} us ({t_cub / best[0]:.2f}x cuBLAS, "
                       f"{wbytes / best[0] / 1e12:.2f} TB/s of NVFP4 weight)" if best else ", no correct gluon config"))
            summary.append(line)
            print(line, flush=True)
        del wps, wscs, gws, wbs, wf
        torch.cuda.empty_cache()
    out = print_table("W4A16 dense decode, cold L2 (us; x = cuBLAS time / time; check: 1 bf16 ulp + fp32 bound)",
                      ["shape", "kernel", "check", "us", "x cuBLAS", "max err/max|ref|"], rows)
    print("\n".join(summary), flush=True)
    return out + "\n" + "\n".join(summary)


def sass_counts(variants=None) -> str:
    """Offline sm_90 compile (no GPU) of kernel variants ``(num_warps, kc, nt, split, even, pf, asm, fmt)``: SASS
    instructions in the K loop per weight element per thread, registers, the loop's most frequent opcodes."""
    import collections
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from verl_quads.bench.sass import sass_and_loop
    from verl_quads.nvfp4 import gluon_gemm as gg

    variants = variants or [(4, 2, 1, 8, 1, 1, 1, 2), (4, 2, 1, 8, 1, 0, 1, 2),
                            (4, 4, 1, 8, 1, 1, 1, 2), (4, 2, 2, 8, 1, 1, 1, 2), (4, 2, 1, 8, 1, 1, 1, 1),
                            (4, 2, 1, 8, 1, 1, 0, 1), (4, 2, 1, 8, 0, 1, 1, 2)]
    sig = {"x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*u8", "gs_ptr": "*fp32", "out_ptr": "*bf16",
           "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "NR": "i32", "C": "i32",
           "CPS": "i32", "NW": "constexpr", "KC": "constexpr", "NT": "constexpr", "SPLIT": "constexpr",
           "EVEN": "constexpr", "PF": "constexpr", "ASM": "constexpr", "FMT": "constexpr"}
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(names)
             if sig[nm][0] == "*" or nm in ("N", "K", "C", "CPS")}
    lines = []
    for v in variants:
        ce = dict(zip(("NW", "KC", "NT", "SPLIT", "EVEN", "PF", "ASM", "FMT"), v))
        src = GluonASTSource(fn=gg._w4a16_kernel, signature=sig,
                             constexprs={(names.index(k),): val for k, val in ce.items()}, attrs=attrs)
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": ce["NW"], "num_stages": 1})
        _, loop = sass_and_loop(kern)
        tool = f"{triton.__path__[0]}/backends/nvidia/bin/cuobjdump"
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kern.asm["cubin"])
            f.flush()
            res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        regs = res.split("REG:")[1].split()[0] if "REG:" in res else "?"
        ops = collections.Counter(t.split()[1] if t.startswith("@") else t.split()[0] for t in loop)
        per = len(loop) / (ce["KC"] * 32)
        lines.append(f"{ce}: K loop {len(loop)} SASS = {per:.2f} per weight element per thread, {regs} registers; "
                     f"{dict(ops.most_common(8))}")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="8192x8192,4096x4096", help="NxK list")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--configs", default="all", choices=["all", "quick"])
    ap.add_argument("--sass", action="store_true", help="offline sm_90 compile (no GPU): K-loop SASS counts")
    a = ap.parse_args(argv)
    if a.sass:
        sass_counts()
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    run(shapes, [int(v) for v in a.ms.split(",")], a.configs)


if __name__ == "__main__":
    main()
