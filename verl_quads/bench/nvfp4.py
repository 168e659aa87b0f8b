"""``verl-quads bench nvfp4``: NVFP4 kernel throughput as a fraction of measured copy bandwidth.

In one run, on one device: device-to-device copy bandwidth (``dst.copy_(src)``, bytes read +
written), then for each kernel its time and effective bandwidth (bytes it must read + write)
as a fraction of the copy bandwidth, for the Triton kernels and the torch reference. "call us"
is an eager Python call (host overhead included, back-to-back calls); "graph us" replays the
same call captured in a CUDA graph (device time only, as inside vLLM's captured graphs); the
bandwidth columns use the graph time where there is one. Residual
compensation (k = 0.25 and 0.5; per-token selection = the fused one-kernel path, per-call = the
multi-kernel path) is also reported as a ratio to plain per-row-scale quantize / QDQ (goal <= 1.5x
at k = 0.5).

Kernel variants (``triton_kernels.KERNELS``) are timed side by side in the same run: quantize / QDQ
``[v1]`` (the old block-tile kernel) and ``[v2]`` / ``[v2 int-e2m1]`` (one thread per block; the
float or the integer E2M1 index), per-token residual ``row`` (whole row in registers), ``gather``
(second walk over the selected blocks only, 64-block tiles, 2 warps) and the default ``auto``
(``RESIDUAL_BY_BLOCKS``: the tile / warps measured fastest per row length); the new
kernels write bf16 with the GPU's conversion instruction (``[... int-bf16-store]``: with the integer
rounding v1 uses). Residual ratios are given against both plain variants.
The channel rule (``granularity="channel"``, k = 0.5) has its own rows in the table; ``--channel`` times only it
(each variant of ``triton_channel.CHANNEL_VARIANTS``, bytes checked against the torch reference first, next to plain
QDQ and the block rule, warps swept); ``--channel-probe`` times its kernel's phases (timing probes, not results).
Each timed call selects its variant and restores ``KERNELS`` afterwards; ``--sweep`` tunes each
variant's configuration first (and keeps the fastest for the table) and prints it.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import verl_quads.nvfp4 as nv
from verl_quads.bench.timing import device_name, graph_time_s, median_time_s, print_table


def _bytes_quant(m: int, k: int, in_bytes: int) -> int:
    return m * k * in_bytes + m * k // 2 + m * k // 16


@contextlib.contextmanager
def _kernels(**choice):
    """Temporarily select kernel variants (``triton_kernels.KERNELS``)."""
    from verl_quads.nvfp4 import triton_kernels as tk

    old = dict(tk.KERNELS)
    tk.KERNELS.update(choice)
    try:
        yield
    finally:
        tk.KERNELS.clear()
        tk.KERNELS.update(old)


def _with(choice: dict, fn):
    """``fn`` run under the kernel choice (a callable for the timers)."""
    def call():
        with _kernels(**choice):
            return fn()
    return call


def run(shapes: list[tuple[int, int]], dtype: torch.dtype, with_torch: bool, sweep: bool, row_sweep: bool = False,
        device: str = "cuda", sweep_new: bool = False) -> str:
    """The benchmark (``device``: "cuda"; anything else only for a functional smoke run of this code
    under the Triton interpreter with stand-in timers). ``sweep``: tune every variant's configuration
    first; ``sweep_new``: only the v2 / gather ones."""
    from verl_quads.nvfp4 import triton_kernels as tk

    dev = device
    out = [f"device: {device_name()}"]
    print(out[0], flush=True)
    if sweep or sweep_new:
        m, k = shapes[-1]
        x = torch.randn(m, k, device=dev, dtype=dtype)
        gs = nv.global_scale_from_amax(x.abs().amax())
    if sweep:
        rows = []
        best = None
        v1 = dict(quantize="v1", fake_quantize="v1")
        for split in (True, False):
            for blocks in (64, 128, 256):
                for nw in (1, 2, 4):
                    tk.TILE_CONFIG.update(blocks=blocks, num_warps=nw, split=split)
                    t = graph_time_s(_with(v1, lambda: nv.quantize(x, gs, backend="triton", check_finite=False)))
                    t2 = graph_time_s(_with(v1, lambda: nv.fake_quantize(x, gs, backend="triton", check_finite=False)))
                    rows.append([split, blocks, nw, t * 1e6, t2 * 1e6])
                    if best is None or t + t2 < best[0]:
                        best = (t + t2, dict(tk.TILE_CONFIG))
        out.append(print_table(f"tile sweep, quantize {m}x{k} {dtype}", ["split load", "blocks/program", "warps", "quantize us", "QDQ us"], rows))
        tk.TILE_CONFIG.update(best[1])
        out.append(f"chosen tile config: {best[1]}")
        print(out[-1], flush=True)
    if sweep or sweep_new:
        # v2 (one thread per block): quantize (float or integer E2M1 index) and QDQ configs separately
        rows = []
        bq = bd = None
        for blocks in (256, 512, 1024):
            for nw in (2, 4, 8):
                for fp in (True, False):
                    tk.QUANT2_CONFIG["quantize"].update(blocks=blocks, num_warps=nw, fp=fp)
                    t = graph_time_s(_with(dict(quantize="v2"), lambda: nv.quantize(x, gs, backend="triton", check_finite=False)))
                    t2 = None
                    if fp:
                        tk.QUANT2_CONFIG["qdq"].update(blocks=blocks, num_warps=nw)
                        t2 = graph_time_s(_with(dict(fake_quantize="v2"),
                                                lambda: nv.fake_quantize(x, gs, backend="triton", check_finite=False)))
                        if bd is None or t2 < bd[0]:
                            bd = (t2, dict(blocks=blocks, num_warps=nw))
                    rows.append([blocks, nw, "float" if fp else "int", t * 1e6, "-" if t2 is None else t2 * 1e6])
                    if bq is None or t < bq[0]:
                        bq = (t, dict(blocks=blocks, num_warps=nw, fp=fp))
        out.append(print_table(f"v2 kernel sweep, {m}x{k} {dtype}", ["blocks/program", "warps", "E2M1 index", "quantize us", "QDQ us"], rows))
        tk.QUANT2_CONFIG["quantize"].update(bq[1])
        tk.QUANT2_CONFIG["qdq"].update(bd[1])
        out.append(f"chosen QUANT2_CONFIG: {tk.QUANT2_CONFIG}")
        print(out[-1], flush=True)
        # gather per-token residual kernel (TILED_CONFIG["gather"]; "tiled" was removed in session 10)
        gs_row = nv.global_scale_from_amax(x.abs().amax(-1, keepdim=True).float())
        rows = []
        for kern in ("gather",):
            best = None
            for tb in (64, 128, 256):
                for nw in (2, 4, 8):
                    tk.TILED_CONFIG[kern].update(tile_blocks=tb, num_warps=nw)
                    sel = dict(residual_per_token=kern)
                    t = graph_time_s(_with(sel, lambda: nv.residual_fake_quantize(x, 0.5, gs_row, backend="triton", check_finite=False)))
                    t2 = graph_time_s(_with(sel, lambda: nv.residual_quantize(x, 0.5, gs_row, backend="triton", check_finite=False)))
                    rows.append([kern, tb, nw, t * 1e6, t2 * 1e6])
                    if best is None or t + t2 < best[0]:
                        best = (t + t2, dict(tile_blocks=tb, num_warps=nw))
            tk.TILED_CONFIG[kern].update(best[1])
        out.append(print_table(f"gather per-token residual kernel sweep, k=0.5, {m}x{k} {dtype}",
                               ["kernel", "blocks/tile", "warps", "residual QDQ us", "residual_quantize us"], rows))
        out.append(f"chosen TILED_CONFIG: {tk.TILED_CONFIG}")
        print(out[-1], flush=True)
    if row_sweep:
        m, k = shapes[-1]
        x = torch.randn(m, k, device=dev, dtype=dtype)
        gs_row = nv.global_scale_from_amax(x.abs().amax(-1, keepdim=True).float())
        rows = []
        best = None
        for ept in (8, 16, 32, 64, 128):
            tk.ROW_CONFIG.update(elems_per_thread=ept)
            row = dict(residual_per_token="row")
            t = graph_time_s(_with(row, lambda: nv.residual_fake_quantize(x, 0.5, gs_row, backend="triton", check_finite=False)))
            t2 = graph_time_s(_with(row, lambda: nv.residual_quantize(x, 0.5, gs_row, backend="triton", check_finite=False)))
            nbp = 1 << (k // 16 - 1).bit_length()
            rows.append([ept, tk._row_warps(nbp), t * 1e6, t2 * 1e6])
            if best is None or t + t2 < best[0]:
                best = (t + t2, ept)
        out.append(print_table(f"fused per-token residual kernel sweep, k=0.5, {m}x{k} {dtype}",
                               ["elems/thread", "warps", "residual QDQ us", "residual_quantize us"], rows))
        tk.ROW_CONFIG.update(elems_per_thread=best[1])
        out.append(f"chosen ROW_CONFIG: {dict(tk.ROW_CONFIG)}")
        print(out[-1], flush=True)
    rows = []
    for m, k in shapes:
        x = torch.randn(m, k, device=dev, dtype=dtype)
        x[:, :: max(1, k // 8)] *= 30.0  # outlier channels
        gs = nv.global_scale_from_amax(x.abs().amax())
        gs_row = nv.global_scale_from_amax(x.abs().amax(-1, keepdim=True).float())
        eb = x.element_size()
        src = torch.empty(m * k * eb * 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        t_copy = median_time_s(lambda: dst.copy_(src))
        bw = 2 * src.numel() / t_copy
        rows.append([f"{m}x{k}", "copy (baseline)", "-", t_copy * 1e6, "-", bw / 1e9, 1.0])
        q = nv.quantize(x, gs, backend="triton")
        v1q, v2q = dict(quantize="v1", fake_quantize="v1"), dict(quantize="v2", fake_quantize="v2")
        qcfg = tk.QUANT2_CONFIG["quantize"]
        tag_int = "v2 int-e2m1" if qcfg.get("fp") else "v2 float-e2m1"  # the other E2M1 formulation

        def _other_e2m1(fn):
            def call():
                qcfg["fp"] = not qcfg.get("fp")
                try:
                    return fn()
                finally:
                    qcfg["fp"] = not qcfg.get("fp")
            return call

        cases = []
        for tag, ch in (("v1", v1q), ("v2", v2q)):
            cases += [
                (f"quantize [{tag}]", lambda b, ch=ch: _with(ch, lambda: nv.quantize(x, gs, backend=b, check_finite=False))(),
                 _bytes_quant(m, k, eb)),
                (f"quantize (per-row gs) [{tag}]",
                 lambda b, ch=ch: _with(ch, lambda: nv.quantize(x, gs_row, backend=b, check_finite=False))(),
                 _bytes_quant(m, k, eb)),
            ]
        cases += [
            (f"quantize [{tag_int}]",
             lambda b: _other_e2m1(_with(v2q, lambda: nv.quantize(x, gs, backend=b, check_finite=False)))(),
             _bytes_quant(m, k, eb)),
            ("dequantize", lambda b: nv.dequantize(q, dtype, backend=b), _bytes_quant(m, k, eb)),
        ]
        for tag, ch in (("v1", v1q), ("v2", v2q)):
            cases += [
                (f"fake_quantize (QDQ) [{tag}]",
                 lambda b, ch=ch: _with(ch, lambda: nv.fake_quantize(x, gs, backend=b, check_finite=False))(),
                 2 * m * k * eb),
                (f"fake_quantize (QDQ, per-row gs) [{tag}]",
                 lambda b, ch=ch: _with(ch, lambda: nv.fake_quantize(x, gs_row, backend=b, check_finite=False))(),
                 2 * m * k * eb),
            ]
        cases.append(("fake_quantize (QDQ, per-row gs) [v2 int-bf16-store]",
                      lambda b: _with(dict(v2q, bf16_store="int"), lambda: nv.fake_quantize(
                          x, gs_row, backend=b, check_finite=False))(), 2 * m * k * eb))
        for ratio in (0.25, 0.5):
            for per_token, tag, kern in ((True, "per-token, fused row", "row"), (True, "per-token, gather t64w2", "gather"),
                                         (True, "per-token, default (auto)", "auto"), (False, "per-call", "row")):
                idx_bytes = m * int(ratio * k / 16) * 8 if per_token else int(ratio * k / 16) * 8
                ch = dict(residual_per_token=kern)
                cases.append((f"residual_quantize k={ratio:g} ({tag})",
                              lambda b, r=ratio, pt=per_token, ch=ch: _with(ch, lambda: nv.residual_quantize(
                                  x, r, gs_row, per_token=pt, backend=b, check_finite=False))(),
                              _bytes_quant(m, k, eb) + int(m * k * ratio) // 2 + int(m * k * ratio) // 16 + idx_bytes))
                cases.append((f"residual QDQ k={ratio:g} ({tag})",
                              lambda b, r=ratio, pt=per_token, ch=ch: _with(ch, lambda: nv.residual_fake_quantize(
                                  x, r, gs_row, per_token=pt, backend=b, check_finite=False))(),
                              2 * m * k * eb))
        # the channel rule (granularity="channel", verl_quads/nvfp4/triton_channel.py): same dense second pass
        cases.append(("residual_quantize k=0.5 (per-token, channel rule)",
                      lambda b: nv.residual_quantize(x, 0.5, gs_row, granularity="channel", backend=b, check_finite=False),
                      _bytes_quant(m, k, eb) + m * k // 2 + m * k // 16 + m * (k // 2) * 8))
        cases.append(("residual QDQ k=0.5 (per-token, channel rule)",
                      lambda b: nv.residual_fake_quantize(x, 0.5, gs_row, granularity="channel", backend=b,
                                                          check_finite=False), 2 * m * k * eb))
        col_w = torch.rand(k, device=dev, dtype=torch.float32)  # stands in for a weight's squared column norms
        for kern in ("row", "gather", "auto"):
            cases.append((f"residual QDQ k=0.5 (per-token, fused {kern}, output-aware score)",
                          lambda b, ch=dict(residual_per_token=kern): _with(ch, lambda: nv.residual_fake_quantize(
                              x, 0.5, gs_row, score_weight=col_w, backend=b, check_finite=False))(),
                          2 * m * k * eb + 4 * k))
        rec = nv.extract_guidance(nv.quantize(x, gs_row, backend="triton"))
        cases.append(("quantize_guided", lambda b: nv.quantize_guided(x, rec, backend=b, check_finite=False),
                      _bytes_quant(m, k, eb) + m * k // 8))
        times = {}
        for name, fn, nbytes in cases:
            for b in ("triton", "torch") if with_torch else ("triton",):
                t_call = median_time_s(lambda: fn(b), 2, 5 if b == "torch" else 20, 3 if b == "torch" else 10)
                t_dev = graph_time_s(lambda: fn(b)) if b == "triton" else None
                t = t_dev if t_dev is not None else t_call
                times[(name, b)] = t
                rows.append([f"{m}x{k}", name, b, t_call * 1e6, "-" if t_dev is None else t_dev * 1e6,
                             nbytes / t / 1e9, nbytes / t / bw])
        for name in [c[0] for c in cases if c[0].startswith("residual")]:
            for tag in ("v1", "v2"):
                base = ("quantize (per-row gs)" if name.startswith("residual_quantize")
                        else "fake_quantize (QDQ, per-row gs)") + f" [{tag}]"
                r = times[(name, "triton")] / times[(base, "triton")]
                rows.append([f"{m}x{k}", f"{name} / {base}", "triton", "-", "-", "-", f"{r:.2f}x"])
    out.append(print_table(f"NVFP4 kernels, input {dtype}", ["shape", "kernel", "backend", "call us", "graph us", "GB/s", "of copy BW"], rows))
    return "\n".join(out)


def run_residual_variants(shapes: list[tuple[int, int]] = ((8192, 8192), (4096, 2048)), dtype: torch.dtype = torch.bfloat16,
                          ratios: tuple[float, ...] = (0.5, 0.25), device: str = "cuda",
                          variants: list[str] | None = None) -> str:
    """Every ``triton_kernels.RESIDUAL_VARIANTS`` entry and every Gluon kernel variant (``gluon_residual.VARIANTS``,
    ``KERNELS["residual_per_token"] = "gluon"``: QDQ only, its packed columns "-") (or those named in ``variants``),
    per shape and ratio, per-row global scale: first
    checked against the default kernel's bytes on the device (``torch.equal`` of the QDQ output and of
    every field of the packed result; a mismatch is reported in the table and not timed), then timed
    (CUDA-graph replay, us). Ratios: residual QDQ / plain per-row-scale QDQ (v2) and residual_quantize /
    plain per-row-scale quantize (v2). ``device`` other than "cuda": functional smoke run only."""
    from verl_quads.nvfp4 import triton_kernels as tk

    def same_packed(a, b):
        return all(torch.equal(u, v) for u, v in (
            (a.block_idx, b.block_idx), (a.first.packed, b.first.packed), (a.second.packed, b.second.packed),
            (a.first.block_scale.view(torch.uint8), b.first.block_scale.view(torch.uint8)),
            (a.second.block_scale.view(torch.uint8), b.second.block_scale.view(torch.uint8)),
            (a.second.global_scale, b.second.global_scale)))

    from verl_quads.nvfp4 import gluon_residual as gr

    names = list(tk.RESIDUAL_VARIANTS) + list(gr.VARIANTS) if variants is None else list(variants)
    unknown = [n for n in names if n not in tk.RESIDUAL_VARIANTS and n not in gr.VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown residual variant(s) {unknown}; known: "
                         f"{sorted(tk.RESIDUAL_VARIANTS) + sorted(gr.VARIANTS)}")
    rows = []
    tm = graph_time_s if device == "cuda" else (lambda f: median_time_s(f, 0, 1, 1))  # CPU: smoke run only
    for m, k in shapes:
        x, gs_row, t_qdq, t_q = _outlier_rows_and_plain_times(m, k, dtype, device, tm)
        rows.append([f"{m}x{k}", "-", "plain v2 QDQ, quantize", t_qdq * 1e6, 1.0, t_q * 1e6, 1.0, "-"])
        print(rows[-1], flush=True)
        for ratio in ratios:
            ref_qdq = nv.residual_fake_quantize(x, ratio, gs_row, backend="triton", check_finite=False)
            ref_q = nv.residual_quantize(x, ratio, gs_row, backend="triton", check_finite=False)
            for name in names:
                if name in gr.VARIANTS:  # the Gluon kernel (gluon_residual): QDQ only, bf16
                    rows.append(_gluon_variant_row(name, x, ratio, gs_row, ref_qdq, t_qdq, m, k, tm))
                    print(rows[-1], flush=True)
                    continue
                try:
                    with tk.residual_variant(name):
                        same = torch.equal(nv.residual_fake_quantize(x, ratio, gs_row, backend="triton",
                                                                     check_finite=False), ref_qdq)
                        same = same and same_packed(
                            nv.residual_quantize(x, ratio, gs_row, backend="triton", check_finite=False), ref_q)
                except Exception as e:  # e.g. a variant the device's triton does not compile: reported, not timed
                    rows.append([f"{m}x{k}", f"{ratio:g}", name, "ERROR", f"{type(e).__name__}: {str(e)[:120]!r}",
                                 "-", "-", "no"])
                    print(rows[-1], flush=True)
                    continue
                if not same:
                    rows.append([f"{m}x{k}", f"{ratio:g}", name, "MISMATCH", "-", "-", "-", "no"])
                    print(rows[-1], flush=True)
                    continue
                t = tm(lambda: _variant_call(name, lambda: nv.residual_fake_quantize(
                    x, ratio, gs_row, backend="triton", check_finite=False)))
                t2 = tm(lambda: _variant_call(name, lambda: nv.residual_quantize(
                    x, ratio, gs_row, backend="triton", check_finite=False)))
                rows.append([f"{m}x{k}", f"{ratio:g}", name, t * 1e6, f"{t / t_qdq:.2f}x", t2 * 1e6, f"{t2 / t_q:.2f}x", "yes"])
                print(rows[-1], flush=True)
    return print_table(f"per-token residual kernel variants, per-row global scale, input {dtype} ({device_name()})",
                       ["shape", "k", "variant", "residual QDQ us", "x plain QDQ", "residual_quantize us",
                        "x plain quantize", "== default bytes"], rows)


def _gluon_variant_row(name, x, ratio, gs_row, ref_qdq, t_qdq, m, k, tm) -> list:
    """A ``run_residual_variants`` row of ``gluon_residual.VARIANTS[name]`` (``KERNELS["residual_per_token"] =
    "gluon"``): its QDQ bytes checked against the default kernel's (``ref_qdq``), then timed; no packed form."""
    from verl_quads.nvfp4 import gluon_residual as gr

    def call():
        with gr.variant(name), _kernels(residual_per_token="gluon"):
            return nv.residual_fake_quantize(x, ratio, gs_row, backend="triton", check_finite=False)

    try:
        same = torch.equal(call().view(torch.int16), ref_qdq.view(torch.int16))
    except Exception as e:  # e.g. no Gluon on this triton: reported, not timed
        return [f"{m}x{k}", f"{ratio:g}", name, "ERROR", f"{type(e).__name__}: {str(e)[:120]!r}", "-", "-", "no"]
    if not same:
        return [f"{m}x{k}", f"{ratio:g}", name, "MISMATCH", "-", "-", "-", "no"]
    t = tm(call)
    return [f"{m}x{k}", f"{ratio:g}", name, t * 1e6, f"{t / t_qdq:.2f}x", "-", "-", "yes (QDQ)"]


def _outlier_rows_and_plain_times(m: int, k: int, dtype: torch.dtype, device: str, tm):
    """Input of the residual benches: ``x`` ``[m, k]`` random with every ``k // 8``-th channel x30 (outliers), its
    per-row global scales (float32 ``[m, 1]``), and the baselines' times in seconds (``tm`` timer): plain v2 QDQ
    and quantize of ``x`` with those scales."""
    x = torch.randn(m, k, device=device, dtype=dtype)
    x[:, :: max(1, k // 8)] *= 30.0  # outlier channels
    gs_row = nv.global_scale_from_amax(x.abs().amax(-1, keepdim=True).float())
    with _kernels(quantize="v2", fake_quantize="v2"):
        t_qdq = tm(lambda: nv.fake_quantize(x, gs_row, backend="triton", check_finite=False))
        t_q = tm(lambda: nv.quantize(x, gs_row, backend="triton", check_finite=False))
    return x, gs_row, t_qdq, t_q


CHANNEL_BENCH_SHAPES = ((4096, 2048), (8192, 8192), (2048, 768), (256, 2048))

#: (variant of ``triton_channel.CHANNEL_VARIANTS``, elems_per_thread) timed at k = 0.5; at the other ratios only
#: ``CHANNEL_OTHER_RATIOS``.
CHANNEL_BENCH_CONFIGS = (("default", 16), ("uncapped", 16), ("full", 16), ("compact cta", 16))
CHANNEL_OTHER_RATIOS = (("default", 16),)


def _variant_ept(name: str) -> int:
    """elems_per_thread of a ``triton_channel.CHANNEL_VARIANTS`` entry (its own, else the default 16)."""
    from verl_quads.nvfp4 import triton_channel as tc

    return int(tc.CHANNEL_VARIANTS[name].get("elems_per_thread", 16))


def run_channel(shapes: list[tuple[int, int]] = CHANNEL_BENCH_SHAPES, dtype: torch.dtype = torch.bfloat16,
                ratios: tuple[float, ...] = (0.5, 0.25), device: str = "cuda",
                configs: tuple[tuple[str, int], ...] = CHANNEL_BENCH_CONFIGS,
                other_ratio_configs: tuple[tuple[str, int], ...] = CHANNEL_OTHER_RATIOS) -> str:
    """The channel rule's Triton kernel (``granularity="channel"``, :mod:`verl_quads.nvfp4.triton_channel`), per-row
    global scale: per shape and ratio, each kernel variant (``CHANNEL_VARIANTS`` name x ``elems_per_thread``, i.e.
    warps; ``configs`` at k = 0.5, ``other_ratio_configs`` at the other ratios) first checked against the torch
    reference on the same device (QDQ output bytes; packed codes, scale bytes, gs2 and channel indices of
    ``residual_quantize``; a mismatch is reported and not timed), then timed (CUDA-graph replay, us) next to plain
    per-row-scale QDQ / quantize (v2) and the block rule (default ``auto`` kernel) at the same ratio, ratios against the
    plain kernels of the same run. ``device`` other than "cuda": functional smoke run only."""
    from verl_quads.nvfp4 import triton_channel as tc

    def same(a, b):
        return all(torch.equal(u.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)) for u, v in (
            (a.first.packed, b.first.packed), (a.second.packed, b.second.packed),
            (a.first.block_scale, b.first.block_scale), (a.second.block_scale, b.second.block_scale),
            (a.second.global_scale, b.second.global_scale))) and torch.equal(a.channel_idx, b.channel_idx)

    tm = graph_time_s if device == "cuda" else (lambda f: median_time_s(f, 0, 1, 1))  # CPU: smoke run only
    rows = []
    for m, k in shapes:
        x, gs_row, t_qdq, t_q = _outlier_rows_and_plain_times(m, k, dtype, device, tm)
        rows.append([f"{m}x{k}", "-", "plain v2 QDQ, quantize", "-", t_qdq * 1e6, 1.0, t_q * 1e6, 1.0, "-"])
        print(rows[-1], flush=True)
        for ratio in ratios:
            tb = tm(lambda: nv.residual_fake_quantize(x, ratio, gs_row, backend="triton", check_finite=False))
            tb2 = tm(lambda: nv.residual_quantize(x, ratio, gs_row, backend="triton", check_finite=False))
            rows.append([f"{m}x{k}", f"{ratio:g}", "block rule (auto)", "-", tb * 1e6, f"{tb / t_qdq:.2f}x", tb2 * 1e6,
                         f"{tb2 / t_q:.2f}x", "-"])
            print(rows[-1], flush=True)
            ref_qdq = nv.residual_fake_quantize(x, ratio, gs_row, granularity="channel", backend="torch",
                                                check_finite=False)
            ref_q = nv.residual_quantize(x, ratio, gs_row, granularity="channel", backend="torch", check_finite=False)
            for variant, ept in configs if ratio == 0.5 else other_ratio_configs:
                label = f"channel {variant} e/t {ept}"
                with tc.channel_config(**{**tc.CHANNEL_VARIANTS[variant], "elems_per_thread": ept}):
                    nw = tc._launch_warps(m, k, tc._check_row(k)) if k else 1
                    try:
                        qdq = lambda: nv.residual_fake_quantize(x, ratio, gs_row, granularity="channel",
                                                                backend="triton", check_finite=False)
                        q = lambda: nv.residual_quantize(x, ratio, gs_row, granularity="channel", backend="triton",
                                                         check_finite=False)
                        ok = torch.equal(qdq().view(torch.uint8), ref_qdq.view(torch.uint8)) and same(q(), ref_q)
                        if not ok:
                            rows.append([f"{m}x{k}", f"{ratio:g}", label, nw, "MISMATCH", "-", "-", "-", "no"])
                        else:
                            t, t2 = tm(qdq), tm(q)
                            rows.append([f"{m}x{k}", f"{ratio:g}", label, nw, t * 1e6, f"{t / t_qdq:.2f}x", t2 * 1e6,
                                         f"{t2 / t_q:.2f}x", "yes"])
                    except Exception as e:  # a config the device's triton does not compile: reported, not timed
                        rows.append([f"{m}x{k}", f"{ratio:g}", label, nw, "ERROR",
                                     f"{type(e).__name__}: {str(e)[:120]!r}", "-", "-", "no"])
                print(rows[-1], flush=True)
            if ratio == 0.5:  # the rollout's call: per-token scale by torch's ops first, or derived in the kernel
                row_qdq = lambda: nv.residual_fake_quantize(x, ratio, amax="row", granularity="channel",
                                                            backend="triton", check_finite=False)
                for label, qdq, variant in (
                        ("channel default, per_row_global_scale + kernel",
                         lambda: nv.residual_fake_quantize(x, ratio, nv.per_row_global_scale(x), granularity="channel",
                                                           backend="triton", check_finite=False), "default"),
                        ("channel default, amax='row' (scale in kernel)", row_qdq, "default"),
                        ("channel full, amax='row' (scale in kernel)", row_qdq, "full")):
                    with tc.channel_config(**tc.CHANNEL_VARIANTS[variant]):
                        ok = torch.equal(qdq().view(torch.uint8), ref_qdq.view(torch.uint8))
                        t = tm(qdq) if ok else None
                        nw = tc._launch_warps(m, k, tc._check_row(k))
                    rows.append([f"{m}x{k}", f"{ratio:g}", label, nw, t * 1e6 if ok else "MISMATCH",
                                 f"{t / t_qdq:.2f}x" if ok else "-", "-", "-", "yes" if ok else "no"])
                    print(rows[-1], flush=True)
    return print_table(f"channel-rule residual kernel (granularity='channel'), per-row global scale, input {dtype} "
                       f"({device_name()})", ["shape", "k", "kernel", "warps", "residual QDQ us", "x plain QDQ",
                                             "residual_quantize us", "x plain quantize", "== torch bytes"], rows)


CHANNEL_PROBE_SHAPES = ((1, 8192), (16, 8192), (64, 8192), (16, 2048), (1024, 768), (4096, 2048))

#: ``_channel_row_kernel``'s STOP timing probes: (STOP, what the launch does before it stores one row and returns)
CHANNEL_PROBE_PHASES = ((1, "load + first pass (+ row store)"), (2, "+ threshold search"),
                        (3, "+ tie ranks, selection, R_sel amax"), (0, "whole kernel (+ second pass)"))
#: the same for a compacted-search launch (``triton_channel._compact_threshold``): its search in three parts
CHANNEL_PROBE_PHASES_COMPACT = ((1, "load + first pass (+ row store)"), (4, "+ J full-row bits"),
                                (5, "+ candidate tile stored, read back"), (2, "+ tile search (threshold)"),
                                (3, "+ tie cut, selection, R_sel amax"), (0, "whole kernel (+ second pass)"))


def _replay_search(x: torch.Tensor, ratio: float, gs: torch.Tensor, bits: int = 31):
    """The channel kernel's early-stopped MSB-first threshold search over its first ``bits`` bits, replayed in torch
    on the reference's scores R**2 (float32 bit patterns as int64 [M, K]): returns ``(eb, n, th, cnt, steps)``, the
    scores, the selection size, each row's accepted prefix and its count ([M, 1]) and the dependent full-row counts
    each row took (int64 [M]). Continue with :func:`_replay_steps`."""
    from verl_quads.nvfp4.residual import num_selected_channels

    r = x.float() - nv.dequantize(nv.quantize(x, gs, backend="torch", check_finite=False), torch.float32,
                                  backend="torch")
    eb = (r * r).view(torch.int32).long()
    n = num_selected_channels(x.shape[-1], ratio)
    m = x.shape[0]
    th = torch.zeros(m, 1, dtype=torch.int64, device=x.device)
    cnt = torch.full((m, 1), x.shape[-1], dtype=torch.int64, device=x.device)
    th, cnt, steps = _replay_steps(eb, n, th, cnt, 0, bits)
    return eb, n, th, cnt, steps


def _replay_steps(eb: torch.Tensor, n: int, th: torch.Tensor, cnt: torch.Tensor, k0: int, k1: int):
    """Bits ``k0 .. k1 - 1`` of the replayed search (see :func:`_replay_search`): ``(th, cnt, steps)``, steps = the
    counts each row still needed (a row stops once its count is exactly ``n``)."""
    steps = torch.zeros(eb.shape[0], dtype=torch.int64, device=eb.device)
    for k in range(k0, k1):
        live = cnt[:, 0] != n
        steps += live.long()
        cand = th | (1 << (30 - k))
        c = (eb >= cand).sum(-1, keepdim=True)
        take = live[:, None] & (c >= n)
        th, cnt = torch.where(take, cand, th), torch.where(take, c, cnt)
    return th, cnt, steps


def _bits_search_steps(x: torch.Tensor, ratio: float, gs: torch.Tensor) -> torch.Tensor:
    """Dependent full-row counts the channel kernel's ``_bits_threshold`` takes per row of ``x`` (int64 [M]): the
    same early-stopped MSB-first search, replayed in torch on the reference's scores R**2 (float32 bit patterns)."""
    return _replay_search(x, ratio, gs)[4]


def _compact_search_stats(x: torch.Tensor, ratio: float, gs: torch.Tensor, bits: int, cap: int) -> str:
    """How the compacted search (``triton_channel._compact_threshold`` with ``bits`` full-row steps and a ``cap``-entry
    tile) goes on the rows of ``x``, replayed in torch on the reference's scores R**2: "rows early / tile /
    continuation, candidates max / mean over the tile rows, steps over the tile max"."""
    eb, n, th, cnt, _ = _replay_search(x, ratio, gs, bits)
    early = cnt[:, 0] == n
    ncand = ((eb >> (31 - bits)) == (th >> (31 - bits))).sum(-1)
    tile = ~early & (ncand <= cap)
    steps = _replay_steps(eb, n, th, cnt, bits, 31)[2] * tile
    nc = ncand[tile].float()
    return (f"{int(early.sum())}/{int(tile.sum())}/{int((~early & ~tile).sum())} rows, cands "
            f"{int(nc.max()) if nc.numel() else 0}/{float(nc.mean()) if nc.numel() else 0:.0f}, tile steps "
            f"{int(steps.max())}")


def _phase_times(phases, launch, tm):
    """Time each STOP probe of ``phases`` ((stop, what) pairs) with ``tm`` (seconds) as ``launch(stop)``:
    ``[(stop, what, us or None, previous phase's us or None, error text or None)]``; a probe the device's triton does
    not compile is reported, not timed."""
    out, prev = [], None
    for stop, what in phases:
        try:
            t = tm(lambda: launch(stop)) * 1e6
            out.append((stop, what, t, prev, None))
            prev = t
        except Exception as e:
            out.append((stop, what, None, prev, f"{type(e).__name__}: {str(e)[:100]!r}"))
    return out


def run_channel_probe(shapes=CHANNEL_PROBE_SHAPES, dtype: torch.dtype = torch.bfloat16, ratios=(0.5, 1.0),
                      device: str = "cuda", variants: tuple[str, ...] = ("default",),
                      granularity: str = "channel") -> str:
    """Where the channel kernel's time goes (QDQ launch, per-row global scale, bench input as ``--channel``): the
    kernel's STOP timing probes (``CHANNEL_PROBE_PHASES``: the launch returns after a phase, storing one row that
    depends on it; NOT results: their bytes are not checked) timed like the whole kernel (CUDA-graph replay), with
    the rows' search length (``_bits_search_steps``: max / mean over rows; the launch waits for its slowest row).
    k = 1 selects every channel, so its search takes 0 steps: the k = 0.5 minus k = 1 difference at STOP 2 is the
    search chain. ``variants``: ``CHANNEL_VARIANTS`` names, each probed (a compacted-search variant's search column:
    ``_compact_search_stats``). ``granularity="channel_sampled"``: that rule's launches (no search-length column).
    ``device`` other than "cuda": functional smoke run only."""
    from verl_quads.nvfp4 import triton_channel as tc

    tm = graph_time_s if device == "cuda" else (lambda f: median_time_s(f, 0, 1, 1))
    rows = []
    for m, k in shapes:
        x, gs_row, t_qdq, _ = _outlier_rows_and_plain_times(m, k, dtype, device, tm)
        rows.append([f"{m}x{k}", "-", "-", "plain v2 QDQ (baseline)", "-", t_qdq * 1e6, "-"])
        print(rows[-1], flush=True)
        for ratio in ratios:
            st = _bits_search_steps(x, ratio, gs_row)
            for variant in variants:
                with tc.channel_config(**tc.CHANNEL_VARIANTS[variant]):
                    sampled = granularity == "channel_sampled"
                    comp = None if sampled else tc._compact_args(m, k, tc._check_row(k))
                    if sampled:
                        steps = "- (sampled threshold)"
                    elif comp is None:
                        steps = f"{int(st.max())} / {float(st.float().mean()):.1f}"
                    else:
                        steps = _compact_search_stats(x, ratio, gs_row, *comp[:2])
                    phases = CHANNEL_PROBE_PHASES if comp is None else CHANNEL_PROBE_PHASES_COMPACT
                    def launch(stop, sampled=sampled):
                        return tc._run(x, ratio, gs_row, None, None, False, packed=False, stop=stop, sampled=sampled)
                    for stop, what, t, prev, err in _phase_times(phases, launch, tm):
                        rows.append([f"{m}x{k}", f"{ratio:g}", variant, f"STOP {stop}: {what}", steps,
                                     "ERROR" if err else t,
                                     err or (f"{t - prev:+.2f}" if prev is not None else "-")])
                        print(rows[-1], flush=True)
    return print_table(f"channel-rule kernel phases (STOP timing probes, QDQ launch, per-row global scale), input "
                       f"{dtype} ({device_name()})", ["shape", "k", "variant", "phase",
                                                     "search steps max / mean (compact: early/tile/cont rows)", "us",
                                                     "+us vs previous phase"], rows)


RESIDUAL_PROBE_SHAPES = ((8192, 8192), (4096, 2048), (32768, 2048))

#: ``_residual_tiled_kernel``'s STOP timing probes (gather, QDQ launch): (STOP, what the launch does first)
RESIDUAL_PROBE_PHASES = ((1, "walk 1: first pass (Q(x) stored), scores"), (2, "+ threshold search"),
                         (3, "+ selection, R_sel amax, index store"), (0, "whole kernel (+ gather walk)"))


def run_residual_probe(shapes=RESIDUAL_PROBE_SHAPES, dtype: torch.dtype = torch.bfloat16, ratios=(0.5, 0.25),
                       device: str = "cuda") -> str:
    """Where the default per-token block-rule residual QDQ kernel's time goes (issue #2: k = 0.5 <= 1.5x plain QDQ;
    the ``auto`` RESIDUAL_BY_BLOCKS variant of each row length, per-row global scale, bench input as
    ``--residual-variants``): its STOP timing probes (``RESIDUAL_PROBE_PHASES``: the launch returns after a phase,
    storing one value per row that depends on it; NOT results, their bytes are not checked) timed like the whole
    kernel (CUDA-graph replay), next to plain v2 QDQ of the same input. ``device`` other than "cuda": functional
    smoke run only."""
    from verl_quads.nvfp4 import gluon_residual as gr
    from verl_quads.nvfp4 import triton_kernels as tk

    tm = graph_time_s if device == "cuda" else (lambda f: median_time_s(f, 0, 1, 1))
    rows = []
    for m, k in shapes:
        x, gs_row, t_qdq, _ = _outlier_rows_and_plain_times(m, k, dtype, device, tm)
        variant = tk._auto_residual_variant(1 << max(0, (k // 16 - 1).bit_length()))  # padded 16-blocks per row
        rows.append([f"{m}x{k}", "-", variant, "plain v2 QDQ (baseline)", t_qdq * 1e6, 1.0, "-"])
        print(rows[-1], flush=True)
        xc = x.contiguous()
        for ratio in ratios:
            # the default variant, then the Gluon kernel (gluon_residual: the same STOP phases; x staged in shared
            # memory, so its step 1 also copies the row in, and its step 3 re-reads the selected blocks)
            why = gr.check_supported(x, gs_row, None)
            if why is not None:  # e.g. no Gluon / the interpreter: said once per ratio, not an error of the probe
                rows.append([f"{m}x{k}", f"{ratio:g}", "gluon", "not run", why[:100], "-", "-"])
            for name, ctx in ((variant, lambda: tk.residual_variant(variant)),
                              ("gluon", lambda: _kernels(residual_per_token="gluon")))[:1 if why else 2]:
                with ctx():
                    times = _phase_times(RESIDUAL_PROBE_PHASES, lambda stop: tk._residual_rows(
                        x, gs_row, xc, ratio, None, packed=False, stop=stop), tm)
                for stop, what, t, prev, err in times:
                    if err:
                        rows.append([f"{m}x{k}", f"{ratio:g}", name, f"STOP {stop}: {what}", "ERROR", err, "-"])
                    else:
                        rows.append([f"{m}x{k}", f"{ratio:g}", name, f"STOP {stop}: {what}", t, t / (t_qdq * 1e6),
                                     f"{t - prev:+.1f}" if prev is not None else "-"])
                    print(rows[-1], flush=True)
    return print_table(f"per-token residual QDQ kernel phases (STOP timing probes), input {dtype} ({device_name()})",
                       ["shape", "k", "variant", "phase", "us", "x plain QDQ", "+us vs previous phase"], rows)


def _variant_call(name: str, fn):
    from verl_quads.nvfp4 import triton_kernels as tk

    with tk.residual_variant(name):
        return fn()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="verl-quads bench nvfp4", description=__doc__)
    p.add_argument("--shapes", default="4096x2048,4096x4096,8192x8192", help="comma-separated MxK")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--no-torch", action="store_true", help="skip the torch reference rows")
    p.add_argument("--sweep", action="store_true", help="sweep tile configs first and use the best")
    p.add_argument("--sweep-new", action="store_true",
                   help="sweep only the v2 / gather kernels' configs (the v1 ones keep their tuned defaults)")
    p.add_argument("--row-sweep", action="store_true",
                   help="sweep the fused per-token residual kernel's warps (ROW_CONFIG) first and use the best")
    p.add_argument("--residual-variants", action="store_true",
                   help="only time every per-token residual kernel variant (triton_kernels.RESIDUAL_VARIANTS, and the "
                        "Gluon kernel's gluon_residual.VARIANTS) at "
                        "8192x8192 and 4096x2048 (or --shapes if given), k = 0.5 and 0.25, each checked against the "
                        "default kernel's bytes first")
    p.add_argument("--channel", action="store_true",
                   help="only time the channel-rule residual kernel (granularity='channel') vs plain QDQ and the block "
                        "rule, every CHANNEL_VARIANTS variant, bytes checked against the torch reference first (default shapes "
                        "4096x2048,8192x8192,2048x768,256x2048)")
    p.add_argument("--residual-probe", action="store_true",
                   help="only time the per-token block-rule residual kernel's phases (STOP timing probes, issue #2) at "
                        "8192x8192, 4096x2048, 32768x2048 (or --shapes), k = 0.5 and 0.25")
    p.add_argument("--channel-probe", action="store_true",
                   help="only time the channel-rule kernel's phases (STOP timing probes; default shapes "
                        "1x8192,16x8192,64x8192,16x2048,1024x768,4096x2048)")
    p.add_argument("--channel-ratios", default=None,
                   help="with --channel: comma-separated ratios (default 0.5,0.25)")
    p.add_argument("--channel-variants", default=None,
                   help="with --channel: comma-separated CHANNEL_VARIANTS names timed at k = 0.5 (default: "
                        "CHANNEL_BENCH_CONFIGS); with --channel-probe: the variants probed (default: default)")
    p.add_argument("--variants", default=None,
                   help="with --residual-variants: comma-separated RESIDUAL_VARIANTS names to time (default: all)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("verl-quads bench nvfp4 needs a CUDA GPU (CPU numbers are not the point)")

    def shapes_or(default):
        """--shapes as (M, K) pairs, or the mode's own default shapes when --shapes was not given."""
        if default is not None and a.shapes == p.get_default("shapes"):
            return list(default)
        return [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]

    cvars = tuple(a.channel_variants.split(",")) if a.channel_variants else None
    if a.channel_probe:
        print(run_channel_probe(shapes_or(CHANNEL_PROBE_SHAPES), getattr(torch, a.dtype),
                                variants=cvars or ("default",)), flush=True)
        return
    if a.residual_probe:
        print(run_residual_probe(shapes_or(RESIDUAL_PROBE_SHAPES), getattr(torch, a.dtype)), flush=True)
        return
    if a.channel:
        ratios = tuple(float(r) for r in a.channel_ratios.split(",")) if a.channel_ratios else (0.5, 0.25)
        print(run_channel(shapes_or(CHANNEL_BENCH_SHAPES), getattr(torch, a.dtype), ratios=ratios,
                          configs=tuple((v, _variant_ept(v)) for v in cvars) if cvars else CHANNEL_BENCH_CONFIGS),
              flush=True)
        return
    if a.residual_variants:
        print(run_residual_variants(shapes_or([(8192, 8192), (4096, 2048)]), getattr(torch, a.dtype),
                                    variants=a.variants.split(",") if a.variants else None), flush=True)
        return
    run(shapes_or(None), getattr(torch, a.dtype), not a.no_torch, a.sweep, a.row_sweep, sweep_new=a.sweep_new)


if __name__ == "__main__":
    main()
