"""Issue #5 feasibility probe: can ANY kernel meet "dense W4A16 >= 2.5x cuBLAS BF16 at M <= 16" on this GPU?

For each dense shape (``d4096``, ``d8192``) it times, in one run and with the two timing methods of
:mod:`verl_quads.bench.rollout` (``1-call``: one call per CUDA graph on one weight, warm L2, the main table's method;
``C-call``: one graph of C calls, each on its own copy, >= 256 MB per replay, cold L2, ``--model-graph``'s method):

- the baseline, cuBLAS BF16 ``x @ w.T``, at each M, and the goal's time ``bf16 / 2.5``;
- our ``triton`` W4A16 GEMM (:func:`verl_quads.nvfp4.triton_gemm.nvfp4_gemm`, the default dispatch) at each M;
- ``empty``: a kernel of 132 programs that only store their program id (the launch's own cost in that method);
- ``read``: the bytes the W4A16 GEMM must read, ``N K / 2`` code bytes + ``N K / 16`` scale bytes, laid out as ONE
  flat int32 buffer and summed by :func:`read_sum_kernel` (int32 loads, ``VEC`` consecutive words per thread,
  ``ITERS`` tiles issued per program before the adds, ``num_warps``), the fastest of :data:`READ_CONFIGS`; and
  ``torch.sum`` of the same buffer (a vendor-tuned reduction). No decode, no MMA, no activation, one store per
  program: what a GEMM of these bytes cannot beat on this device in that timing method.

Verdict per point: the goal is below the read floor (no W4A16 kernel can meet it in this timing), or the margin
the decode + MMA + epilogue must fit in. Correctness before timing: every program's int32 sum equals torch's sum of
the same words (``torch.equal``).

    python -m verl_quads.bench.dense_floor [--shapes d4096,d8192] [--m 1,4,16]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the package's torch-only install
    triton = None

EMPTY_PROGRAMS = 132  # the H200's SM count: one program per SM


@dataclass(frozen=True)
class ReadConfig:
    """One launch of :func:`read_sum_kernel`: ``vec`` int32 words per thread and tile, ``iters`` tiles per program,
    ``num_warps``; a tile is ``vec * 32 * num_warps`` words."""

    vec: int = 4
    iters: int = 4
    num_warps: int = 4

    @property
    def tile(self) -> int:
        return self.vec * 32 * self.num_warps

    @property
    def words_per_program(self) -> int:
        return self.tile * self.iters

    @property
    def label(self) -> str:
        return f"v{self.vec} i{self.iters} w{self.num_warps}"


#: Swept per shape; the fastest correct one is the read floor (16 / 32 bytes per thread and tile, 1-8 tiles in flight).
READ_CONFIGS = tuple(ReadConfig(v, i, w) for w in (4, 8) for v in (4, 8) for i in (1, 2, 4, 8))


if triton is not None:

    @triton.jit
    def read_sum_kernel(w_ptr, out_ptr, n_words, VEC: tl.constexpr, ITERS: tl.constexpr, NW: tl.constexpr):
        """out[pid] = the int32 (wrapping) sum of words ``[pid P, (pid + 1) P)`` of w (int32, P = ITERS tiles of
        ``VEC * 32 * NW`` words; words past ``n_words`` count 0). All ITERS tiles are loaded before any is added."""
        TILE: tl.constexpr = VEC * 32 * NW
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * (TILE * ITERS)
        offs = tl.max_contiguous(tl.multiple_of(tl.arange(0, TILE), VEC), VEC)
        acc = tl.zeros([TILE], tl.int32)
        for i in tl.static_range(ITERS):
            o = base + i * TILE + offs
            acc += tl.load(w_ptr + o, mask=o < n_words, other=0)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    @triton.jit
    def empty_kernel(out_ptr):
        """out[pid] = pid: a launch that reads nothing."""
        pid = tl.program_id(0)
        tl.store(out_ptr + pid, pid)


def weight_words(n: int, k: int) -> int:
    """int32 words holding one NVFP4 ``[n, k]`` weight's bytes: ``n k / 2`` codes + ``n k / 16`` e4m3 scales."""
    if n <= 0 or k <= 0 or k % 64:
        raise ValueError(f"dense_floor: need n > 0 and k a positive multiple of 64, got n={n}, k={k}")
    return n * k * 9 // 16 // 4


def read_programs(n_words: int, cfg: ReadConfig) -> int:
    return -(-n_words // cfg.words_per_program)


def read_sum(w: torch.Tensor, cfg: ReadConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch :func:`read_sum_kernel` over the flat int32 buffer ``w``: int32 ``[programs]``."""
    if w.dtype != torch.int32 or w.dim() != 1 or not w.is_contiguous():
        raise ValueError(f"read_sum: w must be a contiguous 1-D int32 tensor, got {w.dtype} {tuple(w.shape)}")
    p = read_programs(w.numel(), cfg)
    if out is None:
        out = torch.empty(p, dtype=torch.int32, device=w.device)
    read_sum_kernel[(p,)](w, out, w.numel(), VEC=cfg.vec, ITERS=cfg.iters, NW=cfg.num_warps,
                          num_warps=cfg.num_warps)
    return out


def read_sum_reference(w: torch.Tensor, cfg: ReadConfig) -> torch.Tensor:
    """The expected :func:`read_sum`: per program the wrapping int32 sum of its words (torch, int64 then wrapped)."""
    p = read_programs(w.numel(), cfg)
    pad = torch.zeros(p * cfg.words_per_program, dtype=torch.int64, device=w.device)
    pad[: w.numel()] = w.long()
    s = pad.view(p, -1).sum(dim=1) & 0xFFFFFFFF
    return (s - ((s >> 31) << 32)).to(torch.int32)


def empty_launch(out: torch.Tensor) -> torch.Tensor:
    empty_kernel[(out.numel(),)](out, num_warps=1)
    return out


def verdict(goal_us: float, floor_us: float) -> str:
    """The goal's time against a floor measured the same way (both us)."""
    if goal_us < floor_us:
        return f"goal {goal_us:.2f} us < read floor {floor_us:.2f}: unreachable in this timing"
    return f"goal {goal_us:.2f} us >= read floor {floor_us:.2f}: {goal_us - floor_us:.2f} us left for decode + MMA"


def run(shapes: list[str], ms: list[int]) -> str:
    from verl_quads.bench.rollout import (SHAPES, W4A16_GOAL, _bf16_matmul, _rotating, _time, model_graph_copies,
                                          model_graph_weights)
    from verl_quads.bench.timing import device_name, print_table
    from verl_quads.nvfp4 import triton_gemm as tg

    if not torch.cuda.is_available():
        raise RuntimeError("dense_floor times CUDA graphs: it needs a CUDA GPU")
    if triton is None:
        raise RuntimeError("dense_floor needs triton")
    dev = "cuda"
    head = [f"device: {device_name()}", "1-call = one call per CUDA graph, one weight (warm L2: the main table's "
            "method); C-call = one graph of C calls on C weight copies (cold L2: --model-graph's method), per call"]
    print("\n".join(head), flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    floor_rows, point_rows, verdicts = [], [], []

    def both(fn_of_copy, copies):
        t1 = _time(lambda: fn_of_copy(0))[0]
        tc = _time(_rotating(fn_of_copy, copies))[0] / copies
        return t1 * 1e6, tc * 1e6

    e_out = torch.empty(EMPTY_PROGRAMS, dtype=torch.int32, device=dev)
    empty_launch(e_out)
    if not torch.equal(e_out, torch.arange(EMPTY_PROGRAMS, dtype=torch.int32, device=dev)):
        raise RuntimeError("dense_floor: the empty kernel stored wrong values")
    empty = both(lambda i: empty_launch(e_out), 8)
    floor_rows.append(["-", f"empty ({EMPTY_PROGRAMS} programs, one store each)", "-", f"{empty[0]:.2f}", f"{empty[1]:.2f}", "-"])
    for name in shapes:
        grouped, n, k = SHAPES[name]
        if grouped:
            raise ValueError(f"dense_floor times dense shapes only, not {name!r}")
        words = weight_words(n, k)
        c4 = model_graph_copies(words * 4)
        bufs = [torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device=dev, generator=g)
                for _ in range(c4)]
        reads = []  # (1-call us, C-call us) of every correct read
        for cfg in READ_CONFIGS:
            out = read_sum(bufs[0], cfg)
            if not torch.equal(out, read_sum_reference(bufs[0], cfg)):
                floor_rows.append([name, f"read {cfg.label}", read_programs(words, cfg), "WRONG", "WRONG", "-"])
                continue
            t = both(lambda i, cfg=cfg, out=out: read_sum(bufs[i], cfg, out), c4)
            reads.append(t)
            floor_rows.append([name, f"read {cfg.label}", read_programs(words, cfg), f"{t[0]:.2f}", f"{t[1]:.2f}",
                               f"{words * 4 / t[1] / 1e6:.2f}"])
            print(f"{name} read {cfg.label}: {t[0]:.2f} / {t[1]:.2f} us", flush=True)
        if not reads:
            raise RuntimeError(f"dense_floor: no read configuration was correct at {name}")
        reads.append(both(lambda i: torch.sum(bufs[i]), c4))
        floor_rows.append([name, "torch.sum (int32 -> int64)", "-", f"{reads[-1][0]:.2f}", f"{reads[-1][1]:.2f}",
                           f"{words * 4 / reads[-1][1] / 1e6:.2f}"])
        floor1 = min(t[0] for t in reads)  # each method's own fastest read
        floorc = min(t[1] for t in reads)
        del bufs
        w16s, fp4s, gs = model_graph_weights(n, k, dev, g)
        c16 = len(w16s)
        for m in ms:
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            b = both(lambda i: _bf16_matmul(x, w16s[i]), c16)

            def w4(i, x=x):
                o, _ = tg.quantize_activation(x, "w4a16")
                return tg.nvfp4_gemm(o, fp4s[i][0], fp4s[i][1], gs)

            f = both(w4, len(fp4s))
            goal = (b[0] / W4A16_GOAL, b[1] / W4A16_GOAL)
            point_rows.append([f"{name} M={m}", f"{b[0]:.2f}", f"{goal[0]:.2f}", f"{f[0]:.2f}", f"{b[0] / f[0]:.2f}x",
                               f"{floor1:.2f}", f"{b[1]:.2f}", f"{goal[1]:.2f}", f"{f[1]:.2f}", f"{b[1] / f[1]:.2f}x",
                               f"{floorc:.2f}"])
            verdicts.append(f"  {name} M={m}: 1-call {verdict(goal[0], floor1)}; C-call {verdict(goal[1], floorc)}")
            print(" | ".join(point_rows[-1]), flush=True)
        del w16s, fp4s
        torch.cuda.empty_cache()
    out = head + [
        print_table("launch and weight-read floors (us per call; TB/s of the weight's NVFP4 bytes, C-call)",
                    ["shape", "kernel", "programs", "1-call us", "C-call us", "TB/s"], floor_rows),
        print_table(f"dense W4A16 goal (>= {W4A16_GOAL}x cuBLAS BF16) against the read floor (us per call; floor = "
                    "fastest read of the weight's bytes, any config or torch.sum)",
                    ["point", "bf16 1-call", "goal 1-call", "w4a16 1-call", "x bf16", "floor 1-call", "bf16 C-call",
                     "goal C-call", "w4a16 C-call", "x bf16 ", "floor C-call"], point_rows),
        "verdicts:", *verdicts]
    print("\n".join(out[-len(verdicts) - 1:]), flush=True)
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="d4096,d8192")
    ap.add_argument("--m", default="1,4,16")
    ap.add_argument("--out", default="", help="also write the tables here")
    a = ap.parse_args(argv)
    text = run(a.shapes.split(","), [int(v) for v in a.m.split(",")])
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
