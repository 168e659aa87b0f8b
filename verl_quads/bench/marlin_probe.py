"""Issue #5 probe: vLLM's Marlin FP4 GEMM (the weight-only NVFP4 kernel vLLM runs on GPUs without FP4 tensor cores)
vs our ``triton`` W4A16 dispatch and cuBLAS BF16 at dense decode shapes, on the same NVFP4 weight. Needs a CUDA vLLM
(0.24: the device tool's H200 gets it from scripts/h200_vllm024/pack.sh); nothing in the product calls Marlin.

Question it answers: would a vendor fast path (Marlin) meet the dense W4A16 goal (>= 2.5x cuBLAS at M <= 16) where
our kernels measure 1.9-2.4x (d8192) and 1.25-1.85x (d4096)? Also printed: how far Marlin's result is from the
NVFP4 reference (``x @ dequantize(w).T`` in float32: max |err| / max |ref|, next to ours), and how many of the
weight's non-zero E4M3 block scales Marlin's scale conversion (``nvfp4_marlin_process_scales``: values < 2 after
``* scale_factor * 2**7`` become 0) drops -- blocks whose rollout weights would then differ from the trainer's.

Timing as :mod:`verl_quads.bench.gluon_probe`: warm = one call per CUDA graph on one weight (``bench rollout``'s
main table); cold = one graph replays one call per weight copy (>= 256 MB of weights per replay), time / copies.

    python -m verl_quads.bench.marlin_probe [--shapes d8192,d4096] [--ms 1,4,16,64]
"""

from __future__ import annotations

import argparse

import torch

from verl_quads.bench.gluon_probe import NAMED_SHAPES
from verl_quads.bench.rollout import _rotating, _time, model_graph_copies
from verl_quads.bench.timing import device_name, print_table


class _MarlinLayer(torch.nn.Module):
    """The attributes vLLM's ``prepare_fp4_layer_for_marlin`` reads: packed codes uint8 ``[N, K/2]`` (even element
    low, our :func:`verl_quads.nvfp4.pack_codes` order), E4M3 block scales ``[N, K/16]``, and the DEQUANTIZE global
    factor (``1 / global_scale`` of our encode convention) as float32 ``[1]``."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor):
        super().__init__()
        n, k2 = packed.shape
        self.output_size_per_partition, self.input_size_per_partition = n, 2 * k2
        self.params_dtype = torch.bfloat16
        self.weight = torch.nn.Parameter(packed.clone(), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scale.clone(), requires_grad=False)
        self.weight_global_scale = torch.nn.Parameter((1.0 / gs.float()).reshape(1), requires_grad=False)
        self.bias = None


def _dropped_scales(scale: torch.Tensor) -> tuple[int, int]:
    """(non-zero E4M3 scales, of them the ones Marlin's conversion sets to 0): vLLM's rule, restated --
    ``sf = 2**floor(log2(448 * 2**7 / max(s * 2**7)))`` (1 when max >= 448 * 2**7), then ``s * sf * 2**7 < 2``
    (in fp16) drops a scale."""
    s = scale.float()
    nz = s > 0
    ws = s * 2**7
    mx = ws[nz].max()
    sf = 1.0 if mx >= 448 * 2**7 else float(torch.exp2(torch.floor(torch.log2(448 * 2**7 / mx))))
    dropped = nz & (((s * sf).half().float() * 2**7) < 2)
    return int(nz.sum()), int(dropped.sum())


def run(shapes: list[str], ms: list[int]) -> str:
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
        apply_fp4_marlin_linear,
        prepare_fp4_layer_for_marlin,
    )

    from verl_quads import nvfp4 as nv
    from verl_quads.nvfp4 import triton_gemm as tg

    out = [f"device: {device_name()}"]
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in shapes:
        n, k = NAMED_SHAPES[name]
        w = torch.randn(n, k, device="cuda", generator=g) * 0.02
        w[:, ::97] *= 40.0  # a wide scale range, as trained weights have: small blocks next to large ones
        q = nv.quantize(w, nv.global_scale_from_amax(w.abs().amax()), backend="triton")
        packed, scale, gs = q.packed, q.block_scale, q.global_scale.reshape(())
        w_bf16, w_ref = w.to(torch.bfloat16), nv.dequantize(q, torch.float32)
        del w
        nz, dropped = _dropped_scales(scale)
        out.append(f"{name}: {nz} non-zero E4M3 block scales, {dropped} dropped by Marlin's scale conversion")
        layers = []
        c4 = model_graph_copies(packed.numel() + scale.numel())
        for _ in range(c4):
            lay = _MarlinLayer(packed, scale, gs)
            prepare_fp4_layer_for_marlin(lay)
            layers.append(lay)
        ours = [(packed, scale)] + [(packed.clone(), scale.clone()) for _ in range(c4 - 1)]
        c16 = model_graph_copies(w_bf16.numel() * 2)
        bf16s = [w_bf16] + [w_bf16.clone() for _ in range(c16 - 1)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            x[:, ::293] *= 30.0
            ref = x.float() @ w_ref.t()
            scale_ref = float(ref.abs().max())

            def marlin(i, fp32_reduce=True):
                lay = layers[i]
                return apply_fp4_marlin_linear(x, lay.weight, lay.weight_scale, lay.weight_global_scale, lay.workspace,
                                               size_n=n, size_k=k, use_fp32_reduce=fp32_reduce)

            def triton(i):
                op, _ = tg.quantize_activation(x, "w4a16")
                return tg.nvfp4_gemm(op, ours[i][0], ours[i][1], gs)

            def bf16(i):
                return x @ bf16s[i].t()

            cands = [("bf16 torch.matmul", bf16, c16), ("triton w4a16 (ours)", triton, c4),
                     ("marlin fp4 (vLLM)", marlin, c4),
                     ("marlin fp4 fp32_reduce=False", lambda i: marlin(i, False), c4)]
            base = None
            for label, fn, copies in cands:
                err = float((fn(0).float() - ref).abs().max()) / scale_ref
                tw, how = _time(lambda fn=fn: fn(0))
                tc, _ = _time(_rotating(fn, copies))
                tc /= copies
                if base is None:
                    base = (tw, tc)
                rows.append([f"{name} M={m}", label, how, f"{err:.2e}", tw * 1e6, base[0] / tw, tc * 1e6, base[1] / tc])
                print(rows[-1], flush=True)
        del layers, ours, bf16s
        torch.cuda.empty_cache()
    out.append(print_table("dense W4A16 at decode: vLLM Marlin FP4 vs ours vs cuBLAS BF16 (same NVFP4 weight)",
                           ["shape", "kernel", "timing", "max|err|/max|ref|", "warm us", "x bf16", "cold us",
                            "x bf16 "], rows))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="d8192,d4096")
    p.add_argument("--ms", default="1,4,16,64")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    text = run(a.shapes.split(","), [int(v) for v in a.ms.split(",")])
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
