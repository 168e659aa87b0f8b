"""Gluon W4A16 kernel for the GROUPED MoE expert GEMMs (issue #5: 4..256 tokens, ~1..16 token-slots per expert), Hopper.

The grouped twin of :func:`verl_quads.nvfp4.gluon_gemm.gluon_w4a16_std` (the dense standard-layout kernel): same
weight layout (the standard packed NVFP4 ``[E, N, K/2]`` uint8 + e4m3 ``[E, N, K/16]`` + float32 ``[E]``), the same
offsets, loads, decode, ``mma.sync m16n8k16`` and K loop (weights on the MMA's M side, the tile's activation rows on
its N side; :func:`~verl_quads.nvfp4.gluon_gemm.std_weight_offsets` / :func:`~verl_quads.nvfp4.gluon_gemm.k_loop`
called as they are, on the expert's weight pointers), the same numerics (exact products, float32 sums, ``* (256 / gs_e)`` once, one bf16 cast):
the same bound vs the torch reference as every other kernel.

Routing: the tile table of :func:`verl_quads.nvfp4.triton_gemm.moe_align` (``GroupedRouting``, as the stream and
tensor-core kernels get it). One launch per GEMM, grid ``(N tiles, M-tiles T_max, split)``: program (n, t, k) reads
expert ``tile_expert[t]`` (tiles with expert -1, past the last expert's, do nothing) and its sorted rows
``[tile_row0[t], tile_row1[t])`` (at most ``block_m`` rows) in passes of 8 NT rows (the MMA's N; ``GroupedConfig.nt``,
default block_m / 8: one pass; each further pass re-reads the weight tile), activation row ``a_rows[r]`` of sorted
row r (rows past the tile's end read the tile's last row; not stored), output row ``sorted_slots[r]``.
Split-K (``split`` > 1): float32 partials ``[split, out_rows, N]``; the last program of each (tile, N tile) (per-tile
counter, acq_rel atomic) sums them in the fixed order 0, 1, ... (deterministic), as the dense kernel.

Needs triton >= 3.6 with Gluon and an sm_80+ GPU; never runs under the Triton interpreter (no fallback here:
:func:`gluon_w4a16_grouped` raises where it cannot run). tests/gpu/test_gluon_moe_gpu.py checks it;
``python -m verl_quads.bench.gluon_moe_probe`` times it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from verl_quads.nvfp4.format import BLOCK_SIZE
from verl_quads.nvfp4.gluon_gemm import ROWS, STD_CHUNK, GluonConfig, _num_sms, _plan, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl

    from verl_quads.nvfp4.gluon_gemm import (_k_range, k_loop, mma_layout, split_fixup, std_weight_offsets,
                                             std_x_offsets, std_x_rows)

    @gluon.jit
    def _moe_epilogue(acc, gw, out_ptr, part_ptr, cnt_ptr, orow_ptr, r0, r1, N, OUT_ROWS, pid_n, pid_k, ci,
                      MMA: gl.constexpr, BN: gl.constexpr, NT: gl.constexpr, SPLIT: gl.constexpr):
        """acc [BN weight rows, 8 NT sorted rows from r0] times ``256 / gs_e`` -> out[sorted_slots[r0 + j], n] in
        bf16 (rows < r1); SPLIT > 1: float32 partials at ``part[pid_k, out row, n]``, the last program of the (tile,
        N tile, row pass) -- counter ``ci`` -- sums them in the fixed order 0, 1, ..."""
        LR: gl.constexpr = gl.SliceLayout(1, MMA)
        LC: gl.constexpr = gl.SliceLayout(0, MMA)
        post = gl.div_rn(gl.full([BN], 1.0, gl.float32, LR), gw) * 256.0
        y = acc * gl.expand_dims(post, 1)
        cols = pid_n * BN + gl.arange(0, BN, layout=LR)
        r = r0 + gl.arange(0, NT * 8, layout=LC)
        valid = r < r1
        o = gl.load(orow_ptr + r, mask=valid, other=0)
        ncol = gl.expand_dims(cols, 1)
        orow = gl.expand_dims(o, 0)
        om = (ncol < N) & gl.expand_dims(valid, 0)
        if SPLIT == 1:
            gl.store(out_ptr + orow * N + ncol, y.to(gl.bfloat16), mask=om)
        else:  # partials [SPLIT, OUT_ROWS, N]: the dense kernel's fixup (no bias)
            split_fixup(y, part_ptr, orow, ncol, OUT_ROWS, N, pid_k, om, out_ptr, orow * N + ncol, cnt_ptr, ci, out_ptr,
                        cols, SPLIT, False)

    @gluon.jit
    def _w4a16_moe_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr,
                          arow_ptr, orow_ptr, te_ptr, tr0_ptr, tr1_ptr,
                          N, K, KW, KB, C, CPS, OUT_ROWS, GRID_N,
                          NW: gl.constexpr, KC: gl.constexpr, NT: gl.constexpr, PASSES: gl.constexpr,
                          SPLIT: gl.constexpr, EVEN: gl.constexpr, PF: gl.constexpr, WPT: gl.constexpr):
        """Grouped standard-layout W4A16: program (pid_n, pid_m, pid_k) computes rows ``16 (pid_n NW + w) + [0, 16)``
        of expert ``tile_expert[pid_m]``'s output for the tile's sorted rows, in passes of 8 NT rows (at most PASSES
        = block_m / (8 NT); each pass runs the K loop, later passes re-read the weight tile, mostly from L2), chunks
        ``[pid_k CPS, ...)``; ``w_ptr`` int32 ``[E, N, KW]``, ``s_ptr`` uint8 ``[E, N, KB]``, ``x_ptr`` bf16 ``[rows, K]``. Offsets, loads, decode, MMA and K loop: the dense kernel's (gluon_gemm
        std_weight_offsets / k_loop) on the expert's weight pointers and the pass's gathered activation rows."""
        MMA: gl.constexpr = mma_layout(NW)
        BN: gl.constexpr = NW * 16
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        e = gl.load(te_ptr + pid_m)
        if e >= 0:  # tiles past the last expert's: nothing
            r0 = gl.load(tr0_ptr + pid_m)
            r1 = gl.load(tr1_ptr + pid_m)
            c_lo, c_hi = _k_range(pid_k, CPS, C)
            e64 = e.to(gl.int64)
            w_e = w_ptr + e64 * N * KW
            s_e = s_ptr + e64 * N * KB
            woff, kcw, soff, kcs = std_weight_offsets(pid_n, N, KW, KB, NW, KC, WPT)
            gw = gl.load(gs_ptr + e + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA)) * 0)
            slot = std_x_rows(NT, NW, WPT)
            for p in gl.static_range(PASSES):
                rs = r0 + p * (NT * 8)
                if rs < r1:
                    # the pass's activation rows (sorted rows past r1 read row r1 - 1: not stored)
                    xoff, kcx = std_x_offsets(gl.load(arow_ptr + gl.minimum(rs + slot, r1 - 1)), K, NW, KC, WPT)
                    acc = k_loop(gl.zeros([BN, NT * 8], gl.float32, MMA), w_e, s_e, x_ptr, woff, soff, xoff, kcw, kcs,
                                 kcx, c_lo, c_hi, K, NW, KC, NT, EVEN, PF, True, WPT)
                    _moe_epilogue(acc, gw, out_ptr, part_ptr, cnt_ptr, orow_ptr, rs, r1, N, OUT_ROWS, pid_n, pid_k,
                                  (pid_m * GRID_N + pid_n) * PASSES + p, MMA, BN, NT, SPLIT)


# ----------------------------------------------------------------------------------------------- host

#: routing block_m (the tile's row count) -> NT (8-row MMA n-tiles) of a one-pass launch
BLOCK_M_NT = {8: 1, 16: 2, 32: 4}


@dataclass(frozen=True)
class GroupedConfig(GluonConfig):
    """:class:`~verl_quads.nvfp4.gluon_gemm.GluonConfig` plus ``nt``: 8-row MMA n-tiles per pass over a tile's rows
    (0: block_m / 8, one pass; fewer: the tile's rows in passes of 8 nt, each pass re-reading the weight tile --
    cheaper MMA / activation work per pass where tiles hold few rows, e.g. 1 token-slot per expert)."""

    nt: int = 0

    @property
    def label(self) -> str:
        return super().label + (f" nt{self.nt}" if self.nt else "")


def _nt(cfg: GluonConfig, block_m: int) -> int:
    full = BLOCK_M_NT[block_m]
    nt = getattr(cfg, "nt", 0) or full
    if nt not in (1, 2, 4) or full % nt:
        raise ValueError(f"gluon_w4a16_grouped: nt {nt} must be 1, 2 or 4 and divide block_m / 8 = {full}")
    return nt

_COUNTERS: dict = {}


def grouped_supported(x: torch.Tensor, w_packed: torch.Tensor, block_m: int) -> bool:
    """Whether :func:`gluon_w4a16_grouped` can run this GEMM: Gluon importable, not under the Triton interpreter,
    bf16 activation ``[rows, K]`` on a CUDA device of compute capability 8.0+, a ``[E, N, K/2]`` weight,
    K % 128 == 0, routing block_m in :data:`BLOCK_M_NT`."""
    return (gluon is not None and os.environ.get("TRITON_INTERPRET") != "1" and x.is_cuda
            and x.dtype == torch.bfloat16 and x.dim() == 2 and w_packed.dim() == 3
            and x.shape[1] % STD_CHUNK == 0 and block_m in BLOCK_M_NT
            and torch.cuda.get_device_capability(x.device)[0] >= 8)


def grouped_plan(n: int, k: int, live: int, cfg: GluonConfig, sms: int = 132) -> tuple[int, int, int, bool]:
    """(grid_n, split, chunks per split, even) of a grouped launch for ``[E, n, k]`` weights with ~``live`` live
    M-tiles (the host does not know how many experts are active: min(E, slots), as the stream kernel's split)."""
    nw = cfg.num_warps
    grid_n = -(-(-(-n // ROWS)) // nw)
    _, split, cps, even = _plan(max(1, live) * grid_n * nw, k // STD_CHUNK, cfg, sms)
    return grid_n, split, cps, even


def gluon_w4a16_grouped(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, w_gs: torch.Tensor,
                        routing, a_rows: torch.Tensor | None = None, out_rows: int | None = None,
                        cfg: GluonConfig = GluonConfig(kc=1, occ=2), zero_unrouted: bool = True) -> torch.Tensor:
    """Grouped W4A16: ``x`` bf16 ``[rows, K]``, NVFP4 experts ``w_packed`` uint8 ``[E, N, K/2]``, ``w_scale`` e4m3
    ``[E, N, K/16]``, ``w_gs`` float32 ``[E]``; ``routing`` a :class:`~verl_quads.nvfp4.triton_gemm.GroupedRouting`
    (block_m 8, 16 or 32); sorted row i reads ``x[a_rows[i]]`` (default ``routing.sorted_slots[i]``, as
    :func:`~verl_quads.nvfp4.triton_gemm.nvfp4_gemm`) and is written to row ``routing.sorted_slots[i]`` of the bf16
    ``[out_rows, N]`` result (default S rows); rows of slots with no local expert are 0 (``zero_unrouted=False``:
    left unset). Raises where the kernel cannot run (no fallback)."""
    if gluon is None:
        raise RuntimeError("gluon_w4a16_grouped needs triton >= 3.6 (triton.experimental.gluon)")
    if x.dim() != 2 or w_packed.dim() != 3:
        raise ValueError(f"gluon_w4a16_grouped: x [rows, K] and w [E, N, K/2], got {tuple(x.shape)} / "
                         f"{tuple(w_packed.shape)}")
    m, k = x.shape
    e, n, kh = w_packed.shape
    bm = routing.block_m
    if not grouped_supported(x, w_packed, bm) or kh * 2 != k or w_packed.dtype != torch.uint8 or tuple(
            w_scale.shape) != (e, n, k // BLOCK_SIZE) or w_scale.dtype != torch.float8_e4m3fn or w_gs.numel() != e:
        raise ValueError(f"gluon_w4a16_grouped: needs bf16 x [rows, K % 128 == 0] on CUDA (no interpreter), uint8 "
                         f"[E, N, K/2] / e4m3 [E, N, K/16] / float32 [E] weights and routing block_m in "
                         f"{tuple(BLOCK_M_NT)}; got x {x.dtype} {tuple(x.shape)}, w {tuple(w_packed.shape)}, "
                         f"block_m {bm}")
    nt = _nt(cfg, bm)
    passes = BLOCK_M_NT[bm] // nt
    s = routing.sorted_slots.numel()
    rows_out = s if out_rows is None else out_rows
    if m * k >= 2**31 or e * n * k >= 2**33 or max(1, rows_out) * n * 64 >= 2**31:
        raise ValueError("gluon_w4a16_grouped: int32 offsets overflow at this size")
    dev = x.device
    x = x.contiguous()
    arow = routing.sorted_slots if a_rows is None else a_rows.to(torch.int32).contiguous()
    orow = routing.sorted_slots
    t_max = routing.tile_expert.numel()
    if t_max >= 65536:
        raise ValueError(f"gluon_w4a16_grouped: {t_max} M-tiles exceed the grid's y dimension")
    out = (torch.zeros if zero_unrouted else torch.empty)(rows_out, n, dtype=torch.bfloat16, device=dev)
    if rows_out == 0 or n == 0 or t_max == 0:
        return out
    live = min(routing.num_experts, s)
    grid_n, split, cps, even = grouped_plan(n, k, live, cfg, _num_sms(dev))
    if split > 1:
        part = torch.empty(split, rows_out, n, dtype=torch.float32, device=dev)
        key = str(dev)
        cnt = _COUNTERS.get(key)
        need = t_max * grid_n * passes
        if cnt is None or cnt.numel() < need:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("gluon_w4a16_grouped: first use of a larger grid inside CUDA-graph capture")
            cnt = torch.zeros(max(need, 1 << 16), dtype=torch.int32, device=dev)
            _COUNTERS[key] = cnt
    else:
        part, cnt = out, arow
    _w4a16_moe_kernel[(grid_n, t_max, split)](
        x, w_packed.view(torch.int32), w_scale.view(torch.uint8), w_gs.reshape(-1), out, part, cnt,
        arow, orow, routing.tile_expert, routing.tile_row0, routing.tile_row1,
        n, k, k // 8, k // BLOCK_SIZE, k // STD_CHUNK, cps, rows_out, grid_n,
        NW=cfg.num_warps, KC=cfg.kc, NT=nt, PASSES=passes, SPLIT=split, EVEN=even, PF=int(cfg.prefetch),
        WPT=4, num_warps=cfg.num_warps, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    return out


__all__ = ["BLOCK_M_NT", "GroupedConfig", "grouped_supported", "grouped_plan", "gluon_w4a16_grouped"]
