"""Probe of the dense decode-once path (:mod:`verl_quads.nvfp4.dequant_gemm`) against the fused kernels and cuBLAS.

``python -m verl_quads.bench.dequant_probe --m 64,256,1024,4096`` times, per dense shape and M (CUDA graphs, warm L2,
median, us): cuBLAS BF16 (``torch.matmul``, the baseline), the fused kernels (``nvfp4_gemm``'s dispatch with
``DEQUANT_MIN_ROWS`` emptied for the call), the decode-once path (``DequantConfig()``) and its three steps (block
values of the weight, the float32-output matmul, the epilogue), for ``w4a16`` and ``naive`` operands. Every output is
checked against the rollout's torch reference (1 ulp + float32 summation bound). The block-values kernel is also
reported as bytes moved (packed + scales read, bf16 written) per second next to the copy bandwidth measured in the
same run. The last table is what DEQUANT_MIN_ROWS is read from.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

SHAPES = {"d8192": (8192, 8192), "d4096": (4096, 4096), "qkv": (5120, 2048), "o_proj": (2048, 4096),
          "up": (24576, 4096)}


@contextlib.contextmanager
def _fused_only():
    from verl_quads.nvfp4 import dequant_gemm as dg

    saved = dict(dg.DEQUANT_MIN_ROWS)
    dg.DEQUANT_MIN_ROWS.clear()
    try:
        yield
    finally:
        dg.DEQUANT_MIN_ROWS.update(saved)


def run(shapes: list[str], ms: list[int], modes: list[str]) -> str:
    from verl_quads.bench.rollout import _copy_bandwidth, _err
    from verl_quads.bench.timing import device_name, graph_time_s, print_table
    from verl_quads.nvfp4 import dequant_gemm as dg
    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.rollout import emulation as em

    bw = _copy_bandwidth()
    out = [f"device: {device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s"]
    print(out[0], flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, bv_rows = [], []
    for name in shapes:
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", generator=g) * 0.02
        q = em.quantize_weight(w)
        gs = q.global_scale.reshape(())
        wf = em.weight_f32(q.packed, q.block_scale, gs)
        wbf = wf.to(torch.bfloat16)
        t_bv = graph_time_s(lambda: dg.block_values(q.packed, q.block_scale, torch.bfloat16))
        moved = q.packed.numel() + q.block_scale.numel() + 2 * n * k
        bv_rows.append([name, f"{t_bv * 1e6:.1f}", f"{moved / t_bv / 1e12:.2f}", f"{moved / t_bv / bw:.0%}"])
        wv = dg.block_values(q.packed, q.block_scale, torch.bfloat16)
        for m in ms:
            x = (torch.randn(m, k, device="cuda", generator=g)).to(torch.bfloat16)
            t_bf16 = graph_time_s(lambda: torch.matmul(x, wbf.t()))
            t_mm = graph_time_s(lambda: torch.mm(x, wv.t(), out_dtype=torch.float32))
            for mode in modes:
                act, _ = tg.quantize_activation(x, mode)
                xf, _ = em.quantize_activation(x, em.ActQuant(mode, 0.5, False, residual_granularity="block"))
                ref = em.gemm(xf, wf, None, x.dtype)
                bound = 4 * k * torch.finfo(torch.float32).eps * (xf.abs() @ wf.abs().t())
                cfg = dg.DequantConfig()
                with _fused_only():
                    y_f = tg.nvfp4_gemm(act, q.packed, q.block_scale, gs)
                    t_f = graph_time_s(lambda: tg.nvfp4_gemm(act, q.packed, q.block_scale, gs))
                y_d = tg.nvfp4_gemm(act, q.packed, q.block_scale, gs, config=cfg)
                t_d = graph_time_s(lambda: tg.nvfp4_gemm(act, q.packed, q.block_scale, gs, config=cfg))
                ok = _err(y_f, ref, bound)[1] and _err(y_d, ref, bound)[1]
                rows.append([name, m, mode, f"{t_bf16 * 1e6:.1f}", f"{t_f * 1e6:.1f}", f"{t_d * 1e6:.1f}",
                             f"{t_bv * 1e6:.1f}", f"{t_mm * 1e6:.1f}", f"{t_bf16 / t_f:.2f}x", f"{t_bf16 / t_d:.2f}x",
                             f"{t_f / t_d:.2f}x", "ok" if ok else "FAIL"])
                print(" | ".join(str(v) for v in rows[-1]), flush=True)
    out.append(print_table("block values of the weight (bf16 out): time, bytes moved per second, vs copy",
                           ["shape", "us", "TB/s", "of copy BW"], bv_rows))
    out.append(print_table(
        "dense GEMMs, us (warm L2, CUDA graphs): cuBLAS BF16, fused kernels, decode-once (DequantConfig) and its "
        "weight block values / float32-output matmul; speed-ups vs cuBLAS; fused / decode-once",
        ["shape", "M", "mode", "cuBLAS bf16", "fused", "decode-once", "(block values", "mm f32)", "fused x",
         "decode-once x", "fused/once", "check"], rows))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m verl_quads.bench.dequant_probe", description=__doc__)
    p.add_argument("--shapes", default="d8192,d4096,qkv,o_proj,up")
    p.add_argument("--m", default="32,64,128,256,512,1024,2048,4096")
    p.add_argument("--modes", default="w4a16,naive")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("dequant_probe: needs a CUDA GPU (cuBLAS float32-output matmul)")
    run(a.shapes.split(","), [int(v) for v in a.m.split(",")], a.modes.split(","))  # prints as it goes


if __name__ == "__main__":
    main()
