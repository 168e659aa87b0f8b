"""What the rollout's GEMM kernels share: the tensor-core dot of a tile (``_dot1``: :mod:`.triton_gemm`'s tensor-core
kernel and :mod:`.triton_stream`'s weight-streaming kernel), whether kernels run under the interpreter, the SM count a
split-K plan fills, the fixed-order split-K reduction and the per-tile counters of the in-kernel split-K fixups (the
stream kernel and the Gluon kernels of :mod:`.gluon_gemm` / :mod:`.gluon_moe`).

Split-K: a GEMM whose grid would not fill the GPU splits K across programs; each program writes a float32 partial
``[split, rows, N]`` and the partials are summed in the fixed order s = 0, 1, ... (deterministic, batch-invariant),
either by :func:`splitk_reduce` (one launch: sum, bias, one cast) or, in a kernel with a fixup, by the last program
of each output tile, which finds out it is last through a counter of :func:`tile_counters`.
"""

from __future__ import annotations

import os

import torch

from verl_quads.nvfp4 import device_info as di
from verl_quads.nvfp4.triton_kernels import _OUT_DTYPES, triton

if triton is not None:
    import triton.language as tl

    from verl_quads.nvfp4.triton_kernels import _store_out

    @triton.jit
    def _dot1(acc, a, w, SWAP: tl.constexpr, DT: tl.constexpr):
        """``acc + a @ w.T`` (float32 accumulation) or with SWAP the transposed ``acc + w @ a.T``."""
        if SWAP:
            if DT == 0:
                acc = tl.dot(w, tl.trans(a), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(a), acc)
        else:
            if DT == 0:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        return acc

    @triton.jit
    def _splitk_reduce_kernel(ws_ptr, bias_ptr, out_ptr, RN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                              OUT: tl.constexpr, BLOCK: tl.constexpr):
        """``out = cast(sum_s ws[s] (+ bias))`` over ``RN = rows * N`` elements; the split partials are
        summed in the fixed order s = 0, 1, ... (deterministic, batch-invariant)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < RN
        acc = tl.load(ws_ptr + offs, mask=m, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(ws_ptr + s * RN + offs, mask=m, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs % N, mask=m, other=0.0).to(tl.float32)
        _store_out(out_ptr + offs, acc, m, OUT)


def interpreting() -> bool:
    """True when Triton kernels run under ``TRITON_INTERPRET=1`` (CPU tests; some dtypes and instructions differ)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def num_sms(device: torch.device) -> int:
    """SMs a split-K plan fills on ``device``: the CUDA device's count, 1 elsewhere (the interpreter: no split-K by
    default)."""
    if device.type == "cuda":
        return di.sm_count(device)
    return 1


def splitk_reduce(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``out = cast(sum_s part[s] (+ bias))`` in ONE launch (not torch's sum + add + cast: three at decode sizes).

    ``part``: float32 ``[split, rows, N]`` (contiguous); ``bias``: ``[N]`` or None; ``out``: ``[rows, N]`` float32,
    bfloat16 or float16 (contiguous), written in place and returned. The partials are summed in the fixed order
    s = 0, 1, ..., in float32, the bias added last, then one round-to-nearest-even cast."""
    split, rows, n = part.shape
    if out.shape != (rows, n) or out.dtype not in _OUT_DTYPES:
        raise ValueError(f"splitk_reduce: out must be [{rows}, {n}] of {tuple(_OUT_DTYPES)}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    rn = rows * n
    _splitk_reduce_kernel[(-(-rn // 1024),)](
        part, bias if bias is not None else part, out.view(torch.int16) if out.dtype == torch.bfloat16 else out,
        rn, n, SPLIT=split, HAS_BIAS=bias is not None, OUT=_OUT_DTYPES[out.dtype], BLOCK=1024, num_warps=4)
    return out


_TILE_COUNTERS: dict[tuple[str, str], torch.Tensor] = {}


def tile_counters(dev: torch.device, size: int, owner: str, min_size: int = 4096) -> torch.Tensor | None:
    """Zeroed int32 per-tile counters of an in-kernel split-K fixup: at least ``size`` of them (``min_size`` at the
    first allocation), one buffer per (``owner``, device) -- ``owner`` names the kernel family ("stream",
    "gluon_dense", "gluon_grouped"), so families do not share counters -- grown when needed. Every launch leaves the
    counters it used at 0 (its last program per tile resets them), so the buffer is reused as it is.

    Returns None while a CUDA graph is being captured and the buffer must grow: a zero-fill recorded in the graph would
    not run before the next eager use. The caller then takes the reduction launch (the stream kernel: the same bits)
    or raises."""
    key = (owner, str(dev))
    buf = _TILE_COUNTERS.get(key)
    if buf is None or buf.numel() < size:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(max(size, min_size), dtype=torch.int32, device=dev)
        _TILE_COUNTERS[key] = buf
    return buf


__all__ = ["interpreting", "num_sms", "splitk_reduce", "tile_counters"]
