"""Issue #5 floor probe: how fast can a kernel with the dense Gluon W4A16 kernel's grid and split READ its weight?

:func:`floor_kernel` reads exactly the bytes :func:`verl_quads.nvfp4.gluon_gemm.gluon_w4a16_std` reads from the
weight (the packed codes as int32 words, 16 bytes per thread, row and 128-element chunk, and the e4m3 scale bytes,
2 per thread, row and chunk, at the offsets of :func:`~verl_quads.nvfp4.gluon_gemm.std_weight_offsets`) with the same
grid ``(grid_n, split)`` and chunk ranges (:func:`~verl_quads.nvfp4.gluon_gemm.std_plan` of a GluonConfig), and does
the minimum with them: an int32 sum per thread, one reduction and one int32 store per program (no decode, no MMA, no
activation, no split-K fixup). Its time is the launch + weight-read floor of that grid: what the GEMM could reach.

Modes (``MODE``): 0 ``reg``: ``UNR`` chunks of register loads issued per iteration before any is summed (UNR chunks
in flight per thread); 1 ``ring``: the weight words through a per-thread ``WS``-stage shared-memory ring by cp.async
(each thread copies the 16 bytes it later reads; Triton 3.6 adds a CTA barrier after each wait and one before each
refill), the scale bytes of the program's chunks (``UNR`` >= chunks per program) loaded into registers up front;
2 ``empty``: no loads (the launch + one store per program: the graph-replay floor of the grid). Suffix ``f``: then
the GEMM's epilogue for one activation row (split-K partial store, acq_rel counter, the last program's re-reads and
bf16 store: the fixup chain's cost is ``regNf`` - ``regN``); ``fM`` (e.g. ``emptyf16``): for M activation rows (the
GEMM's MMA tile of 8 or 16 rows). H200 session 13 (batch E1, d8192 grid w4 rg2 64 x 8, cold / warm us): empty 1.51 /
5.72, emptyf 3.65 / 4.58, emptyf16 8.98 / 10.1 with the fixup of the time (split_fixup: 4-byte accesses, a loop of
two partials per L2 round trip); with its replacement split_fixup_v (16-byte, unrolled) emptyf 3.33 / 5.82, emptyf16
5.51 / 6.48: the 16-row fixup chain 7.5 -> 4.0 us.

Timed as :mod:`verl_quads.bench.gluon_probe` times the GEMM: one CUDA graph of one call per weight copy (>= 256 MB
per replay: cold L2) and one call alone (warm L2). Correctness check before timing: the int32 result of every
program equals the torch sum of the same bytes (``torch.equal``).

    python -m verl_quads.bench.gluon_floor [--shapes d8192,d4096] [--cfgs w4:rg2:o2,w4:o2] [--modes reg2,reg2f,empty]
"""

from __future__ import annotations

import argparse

import torch

from verl_quads.nvfp4 import gluon_gemm as gg

if gg.gluon is not None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    @gluon.jit
    def floor_kernel(w_ptr, s_ptr, out_ptr, gs_ptr, y_ptr, part_ptr, cnt_ptr, N, KW, KB, C, CPS, FM,
                     NW: gl.constexpr, RG: gl.constexpr, MODE: gl.constexpr, UNR: gl.constexpr, WS: gl.constexpr,
                     FIX: gl.constexpr, SPLIT: gl.constexpr, NT: gl.constexpr = 1):
        """Program (pid_n, pid_k) of the std kernel's grid: the int32 sum of its weight words and scale bytes
        (chunks ``[pid_k CPS, min(C, (pid_k + 1) CPS))``, rows of :func:`std_weight_offsets`) to
        ``out_ptr[pid_n * split + pid_k]`` (int32). MODE / UNR / WS: module docstring. Chunks past the range are
        not read (masked). FIX: then the GEMM's epilogue for FM activation rows (``y_ptr`` bf16 ``[FM, N]``, an MMA tile
        of 8 NT rows): every output of the program gets ``(sum & 255) * 256 / gs``, through
        the split-K fixup when SPLIT > 1 (float32 partials ``part_ptr``, counters ``cnt_ptr``) -- the epilogue's chain
        of stores, atomic and re-reads."""
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        c_lo, c_hi = gg._k_range(pid_k, CPS, C)
        # MODE 0: UNR chunks per load (the KC dimension of the offsets: UNR 16-byte vectors per thread and row)
        woff, kcw, soff, kcs = gg.std_weight_offsets(pid_n, N, KW, KB, NW, UNR, 4, RG)
        accw = woff * 0
        accs = soff * 0
        if MODE == 0:
            for c0 in range(c_lo, c_hi, UNR):
                wv = gl.load(w_ptr + woff + c0 * 16, mask=(kcw + c0) < c_hi, other=0)
                sv = gl.load(s_ptr + soff + c0 * 8, mask=(kcs + c0) < c_hi, other=0)
                accw += wv
                accs += sv.to(gl.int32)
        elif MODE == 1:
            # the ring's weight words [R, 2, 8, 4, 1, 4]; the scales of all (<= UNR) chunks loaded once, up front
            woff1, kcw1, soff1, kcs1 = gg.std_weight_offsets(pid_n, N, KW, KB, NW, 1, 4, RG)
            accw = woff1 * 0
            accs = gl.load(s_ptr + soff + c_lo * 8, mask=(kcs + c_lo) < c_hi, other=0).to(gl.int32)
            SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [5, 4, 3, 2, 1, 0])
            sw = gl.allocate_shared_memory(gl.int32, [WS] + woff1.shape, SL)
            for i in gl.static_range(WS - 1):
                async_copy.async_copy_global_to_shared(sw.index(i), w_ptr + woff1 + (c_lo + i) * 16,
                                                       mask=(kcw1 + c_lo + i) < c_hi)
                async_copy.commit_group()
            for c0 in range(c_lo, c_hi):
                j = c0 - c_lo
                # refill the stage read one iteration ago (its values were summed: the read is complete)
                async_copy.async_copy_global_to_shared(sw.index((j + WS - 1) % WS),
                                                       w_ptr + woff1 + (c0 + WS - 1) * 16,
                                                       mask=(kcw1 + c0 + WS - 1) < c_hi)
                async_copy.commit_group()
                async_copy.wait_group(WS - 1)
                accw += sw.index(j % WS).load(woff1.type.layout)
            async_copy.wait_group(0)
        tot = gl.sum(gl.sum(gl.sum(gl.sum(gl.sum(gl.sum(accw, 5), 4), 3), 2), 1), 0)
        tot += gl.sum(gl.sum(gl.sum(gl.sum(gl.sum(gl.sum(accs, 5), 4), 3), 2), 1), 0)
        gl.store(out_ptr + pid_n * gl.num_programs(1) + pid_k, tot)
        if FIX:
            MMA: gl.constexpr = gg.mma_layout(NW)
            BN: gl.constexpr = NW * RG * 16
            acc = gl.zeros([BN, 8 * NT], gl.float32, MMA) + (tot & 255).to(gl.float32)
            gg._epilogue(acc, gs_ptr, gs_ptr, y_ptr, part_ptr, cnt_ptr, FM, N, pid_n, pid_k, MMA, BN, NT, SPLIT, False,
                         NW)


MODES = {"reg": 0, "ring": 1, "empty": 2}


def parse_mode(spec: str) -> tuple[int, int, int, int, int]:
    """``reg2`` -> (MODE 0, UNR 2, WS 1, FIX 0, rows 1); ``ring4`` -> (1, 8, 4, 0, 1) (the scales of up to 8 chunks
    per program loaded up front; ``ring4u16``: up to 16); ``empty`` -> (2, 1, 1, 0, 1); suffix ``f`` (``reg2f``,
    ``emptyf``): FIX 1 (the GEMM's epilogue / split-K fixup for one activation row after the read), ``fM``: for M
    (1..16) rows (``emptyf16`` -> (2, 1, 1, 1, 16))."""
    import re

    m = re.fullmatch(r"(reg|ring|empty)(\d*)(?:u(\d+))?(?:f(\d*))?", spec)
    if not m or not 1 <= int(m.group(4) or 1) <= 16:
        raise ValueError(f"gluon_floor: mode must be regN, ringN[uM] or empty (+ f[M]), got {spec!r}")
    kind, a, u = m.group(1), m.group(2), m.group(3)
    fix = (1, int(m.group(4) or 1)) if m.group(4) is not None else (0, 1)
    if kind == "reg":
        return (0, int(a or 1), 1) + fix
    if kind == "ring":
        if int(a or 0) < 2:
            raise ValueError(f"gluon_floor: ring needs >= 2 stages, got {spec!r}")
        return (1, int(u or 8), int(a)) + fix
    return (2, 1, 1) + fix


def floor_launch(wp: torch.Tensor, wsc: torch.Tensor, cfg, mode: tuple[int, int, int, int, int],
                 out: torch.Tensor, fix_bufs=None):
    """One floor-kernel launch over weight ``wp`` uint8 [N, K/2] / ``wsc`` e4m3 [N, K/16] with ``cfg``'s grid;
    ``out`` int32 [grid_n * split]; ``fix_bufs`` (FIX modes): :func:`fix_buffers`."""
    n, kh = wp.shape
    k = 2 * kh
    grid_n, split, cps, _ = gg.std_plan(n, k, cfg, gg._num_sms(wp.device))
    if mode[0] == 1 and cps > mode[1]:
        raise ValueError(f"gluon_floor: ring mode loads the scales of <= {mode[1]} chunks up front, the grid has {cps}")
    gs, y, part, cnt = fix_bufs if mode[3] else (out, out, out, out)
    floor_kernel[(grid_n, split)](wp.view(torch.int32), wsc.view(torch.uint8), out, gs, y, part, cnt, n, k // 8,
                                  k // 16, k // gg.STD_CHUNK, cps, mode[4], NW=cfg.num_warps, RG=cfg.rg, MODE=mode[0],
                                  UNR=mode[1], WS=mode[2], FIX=mode[3], SPLIT=split, NT=1 if mode[4] <= 8 else 2,
                                  num_warps=cfg.num_warps)


def fix_buffers(n: int, grid_n: int, split: int, dev, m: int = 1) -> tuple:
    """(gs float32 [1] = 1, y bf16 [m, n], partials float32 [split, m, n], counters int32 [grid_n] = 0)."""
    return (torch.ones(1, dtype=torch.float32, device=dev), torch.empty(m, n, dtype=torch.bfloat16, device=dev),
            torch.empty(split, m, n, dtype=torch.float32, device=dev),
            torch.zeros(grid_n, dtype=torch.int32, device=dev))


def fix_reference(tot: torch.Tensor, n: int, cfg, grid_n: int, split: int, m: int = 1) -> torch.Tensor:
    """The FIX modes' ``y`` [m, n] bf16 from the per-program sums ``tot`` int32 [grid_n * split]: weight row r of
    tile r // BN gets bf16(sum over splits, in order, of float32((tot & 255) * 256)) (exact in float32), in every
    activation row."""
    v = ((tot.view(grid_n, split).long() & 255).float() * 256.0)
    z = v[:, 0].clone()
    for sk in range(1, split):
        z = z + v[:, sk]
    bn = 16 * cfg.num_warps * cfg.rg
    return z.repeat_interleave(bn)[:n].to(torch.bfloat16).view(1, n).expand(m, n)


def floor_reference(wp: torch.Tensor, wsc: torch.Tensor, cfg, mode_kind: int) -> torch.Tensor:
    """The expected int32 per program: sum of its rows' words (int32 view, wrapping) and scale bytes, rows past N
    reading row N - 1 as the kernel does (0 for ``empty``)."""
    n, kh = wp.shape
    k = 2 * kh
    grid_n, split, cps, _ = gg.std_plan(n, k, cfg, 132 if wp.device.type != "cuda" else gg._num_sms(wp.device))
    if mode_kind == 2:
        return torch.zeros(grid_n * split, dtype=torch.int32, device=wp.device)
    rows_per = 16 * cfg.num_warps * cfg.rg
    rows = torch.clamp(torch.arange(grid_n * rows_per, device=wp.device), max=n - 1)
    words = wp.view(torch.int32)[rows].long().view(grid_n, rows_per, k // 128, 16)
    scales = wsc.view(torch.uint8)[rows].long().view(grid_n, rows_per, k // 128, 8)
    per_chunk = words.sum(dim=(1, 3)) + scales.sum(dim=(1, 3))  # [grid_n, C]
    out = torch.zeros(grid_n, split, dtype=torch.int64, device=wp.device)
    for s in range(split):
        out[:, s] = per_chunk[:, s * cps:(s + 1) * cps].sum(dim=1)
    out = out.reshape(-1) & 0xFFFFFFFF
    return (out - ((out >> 31) << 32)).to(torch.int32)


def run(shapes, cfgs, modes) -> str:
    from verl_quads.bench.gluon_probe import NAMED_SHAPES
    from verl_quads.bench.rollout import L2_FLUSH_BYTES, _rotating, _time
    from verl_quads.bench.timing import device_name, print_table

    print(device_name(), flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in shapes:
        n, k = NAMED_SHAPES[name] if name in NAMED_SHAPES else tuple(int(v) for v in name.split("x"))
        wp = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=g)
        wsc = torch.randint(0, 127, (n, k // 16), dtype=torch.uint8, device="cuda", generator=g).view(
            torch.float8_e4m3fn)
        wbytes = n * k * 9 // 16
        copies = max(1, min(64, -(-L2_FLUSH_BYTES // wbytes)))
        wps = [wp] + [wp.clone() for _ in range(copies - 1)]
        wscs = [wsc] + [wsc.clone() for _ in range(copies - 1)]
        for cfg in cfgs:
            grid_n, split, cps, _ = gg.std_plan(n, k, cfg, gg._num_sms(wp.device))
            out = torch.empty(grid_n * split, dtype=torch.int32, device="cuda")
            for ms in modes:
                mode = parse_mode(ms)
                fb = fix_buffers(n, grid_n, split, wp.device, mode[4])
                floor_launch(wp, wsc, cfg, mode, out, fb)
                want = floor_reference(wp, wsc, cfg, mode[0])
                ok = torch.equal(out, want)
                if mode[3]:
                    ok = ok and torch.equal(fb[1], fix_reference(want, n, cfg, grid_n, split, mode[4]))
                if not ok:
                    rows.append([name, cfg.label, ms, f"{grid_n}x{split}x{cps}", "WRONG", "-", "-", "-"])
                    print(f"{name} {cfg.label} {ms}: WRONG", flush=True)
                    continue
                tc = _time(_rotating(lambda i, cfg=cfg, mode=mode, fb=fb: floor_launch(wps[i], wscs[i], cfg, mode, out,
                                                                                        fb), copies))[0] / copies
                tw = _time(lambda cfg=cfg, mode=mode, fb=fb: floor_launch(wp, wsc, cfg, mode, out, fb))[0]
                rows.append([name, cfg.label, ms, f"{grid_n}x{split}x{cps}", "ok", tc * 1e6, tw * 1e6,
                             wbytes / tc / 1e12])
                print(f"{name} {cfg.label} {ms}: {tc * 1e6:.2f} us cold, {tw * 1e6:.2f} warm", flush=True)
        del wps, wscs
        torch.cuda.empty_cache()
    return print_table("weight-read floor of the std kernel's grid (us; TB/s of NVFP4 weight + scales, cold)",
                       ["shape", "grid cfg", "mode", "grid x split x chunks", "check", "cold us", "warm us",
                        "cold TB/s"], rows)


def main(argv=None) -> None:
    from verl_quads.bench.gluon_probe import parse_std

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="d8192,d4096")
    ap.add_argument("--cfgs", default="w4:rg2:o2,w4:o2", help="grids, as gluon_probe --std configs")
    ap.add_argument("--modes", default="empty,reg1,reg2,reg4,ring3,ring5")
    a = ap.parse_args(argv)
    run(a.shapes.split(","), parse_std(a.cfgs), a.modes.split(","))


if __name__ == "__main__":
    main()
