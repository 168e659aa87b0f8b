"""Issue #5 probe: the Gluon W4A16 prototype (:mod:`verl_quads.nvfp4.gluon_gemm`) vs cuBLAS BF16 and the current
default W4A16 dispatch (``triton_gemm.nvfp4_linear(..., "w4a16")``) at dense decode shapes, cold and warm L2.

Timing as ``verl-quads bench rollout --sweep-decode``: one CUDA graph replays one call per weight copy (copies so
that >= 256 MB are read per replay: every call reads a weight no other call left in L2), time / copies, median
of :func:`verl_quads.bench.timing.graph_time_s`; warm L2: the same with one copy (the weight stays in L2 where it
fits, as ``bench rollout``'s main table). Every Gluon config is checked against the torch reference
(:mod:`verl_quads.rollout.emulation`: x_f32 @ w_f32.T, one cast) with the tests' bound (1 bf16 ulp + 4 K eps_f32
|x| @ |w|.T per element); max |err| / max |ref| is printed.

    python -m verl_quads.bench.gluon_probe [--shapes 8192x8192,4096x4096,qkv,o] [--ms 1,2,4,8,16] [--configs all|quick]
    python -m verl_quads.bench.gluon_probe --configs std --std w8:pf0,w4:rg2:ev2:d3   # only these std configs
    python -m verl_quads.bench.gluon_probe --configs std --std w4:rg2:d3:xs1 --grp rg2:d3:xs1:xsc2:xsb2:r128
    python -m verl_quads.bench.gluon_probe --sass   # offline sm_90 compile, K-loop SASS counts (no GPU)

``--grp``: the dense GEMM run by the grouped wide kernel (:mod:`verl_quads.nvfp4.gluon_moe`) as ONE expert, with its
options. H200 session 11 (batches D1 / D2; then also with a cp.async weight ring, ring 2-4, since removed from
gluon_moe): at the same split the same bytes as the std kernel, slower at every measured point (d8192 / d4096 / qkv /
o_proj, M = 1, 4, 16): not in the dispatch.
Session 34 (``--grp-block-m``: past 16 rows, M-tiles of 32 / 64 rows;
docs/bench_gluon_grp_dense_h200_session34.txt): faster than the dispatch only at M = 32 on 8192x8192 and qkv, slower
at d4096 / o_proj and at 64-256 rows everywhere: not in the dispatch.
"""

from __future__ import annotations

import argparse
import time

import torch

from verl_quads.bench.rollout import L2_FLUSH_BYTES, _err, _rotating, _time


#: named shapes (N x K): Qwen3-30B-A3B's dense attention linears (qkv_proj: 5120 x 2048, o_proj: 2048 x 4096)
NAMED_SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "d8192": (8192, 8192), "d4096": (4096, 4096)}

_SPEC_KEYS = {"w": "num_warps", "kc": "kc", "s": "split", "o": "occ", "pf": "prefetch", "rg": "rg", "ev": "wev",
              "d": "dec", "r": "maxnreg", "pd": "pfd", "xs": "xs", "xsc": "xsc", "xsb": "xsb", "ks": "ks",
              "up": "up"}


#: extra keys of :func:`parse_grp` (the grouped kernel's GroupedConfig): nt (n-tiles per pass), nts
_GRP_KEYS = {**_SPEC_KEYS, "nt": "nt", "nts": "nts"}


def parse_std(spec: str, grouped: bool = False):
    """``w8:pf0,w4:rg2:ev2:d3`` -> GluonConfigs of the standard-layout kernel: colon-separated ``<key><int>`` with
    keys w (num_warps), kc, s (split, 0 auto), o (occ), pf (prefetch), pd (pfd), rg, ev (wev), d (dec), r (maxnreg),
    xs (0/1), xsc, xsb, ks (K slices inside a program), up (ks: a slice's chunks loaded up front);
    defaults
    w4 kc1 s0 o2 pf1 rg1 ev0 d1. ``grouped``: GroupedConfigs (:func:`parse_grp`)."""
    import re

    from verl_quads.nvfp4.gluon_gemm import GluonConfig as G

    if grouped:
        from verl_quads.nvfp4.gluon_moe import GroupedConfig as G
    keys = _GRP_KEYS if grouped else _SPEC_KEYS
    out = []
    for tok in filter(None, spec.split(",")):
        kw = {"num_warps": 4, "kc": 1, "split": 0, "occ": 2, "prefetch": True}
        for part in tok.split(":"):
            m = re.fullmatch(r"([a-z]+)(\d+)", part)
            if not m or m.group(1) not in keys:
                raise ValueError(f"gluon_probe: bad {'grp' if grouped else 'std'} config part {part!r} in {tok!r}")
            key, val = keys[m.group(1)], int(m.group(2))
            kw[key] = bool(val) if key in ("prefetch", "xs") else val
        out.append(G(**kw))
    return out


def parse_grp(spec: str):
    """``--grp`` configs: the dense GEMM run through the grouped wide kernel
    (:func:`verl_quads.nvfp4.gluon_moe.gluon_w4a16_grouped`) as ONE expert (one M-tile of rows [0, M)):
    :func:`parse_std`'s keys plus nt, nts (e.g. ``rg2:d3:xs1:xsc2:xsb2:r128``)."""
    return parse_std(spec, grouped=True)


def dense_routing(m: int, dev, block_m: int = 32):
    """The routing of a dense GEMM of ``m`` activation rows run by the grouped kernel as ONE expert (``--grp``):
    sorted row i = activation row i = output row i. ``m`` <= 16: one M-tile of rows ``[0, m)``, block_m 8 for
    m <= 8, else 16 (one pass of 1 / 2 MMA n-tiles, as the dense kernel's NT); every index tensor starts 16-byte
    aligned (``tile_row1``: element 4 m of ``arange(17)`` repeated 4 times), so all m share one specialization.
    ``m`` > 16 (session 34: dense GEMMs of 17..4096 rows): ``ceil(m / block_m)`` M-tiles of ``block_m`` (32 or 64)
    rows, the last one shorter."""
    from verl_quads.nvfp4.triton_gemm import GroupedRouting

    if m < 1 or m > 4096:
        raise ValueError(f"dense_routing: m must be 1..4096, got {m}")
    if m > 16:
        if block_m not in (32, 64):
            raise ValueError(f"dense_routing: block_m must be 32 or 64 for m > 16, got {block_m}")
        t = -(-m // block_m)
        row0 = torch.arange(t, dtype=torch.int32, device=dev) * block_m
        return GroupedRouting(sorted_slots=torch.arange(m, dtype=torch.int32, device=dev),
                              tile_expert=torch.zeros(t, dtype=torch.int32, device=dev), tile_row0=row0,
                              tile_row1=torch.clamp(row0 + block_m, max=m), block_m=block_m, num_experts=1)
    rows = torch.arange(16, dtype=torch.int32, device=dev)
    ends = torch.arange(17, dtype=torch.int32, device=dev).repeat_interleave(4)
    return GroupedRouting(sorted_slots=rows[:m], tile_expert=rows[:1], tile_row0=rows[:1],
                          tile_row1=ends[4 * m:4 * m + 1], block_m=8 if m <= 8 else 16, num_experts=1)


def xs_candidates() -> dict:
    """Session 10 call 2: the activation-staging (xs) twin of every GLUON_TABLE entry (same warps / rg / prefetch /
    decode; kc 1: xs stages 128-element chunks), keyed like GLUON_TABLE. tests/gpu/test_gluon_gemm_gpu.py validates
    each through the dispatch; ``--configs table-xs`` times it next to the entry."""
    from verl_quads.nvfp4.gluon_gemm import GluonConfig as G

    w8, w4, w4pf = (G(8, 1, 0, 2, prefetch=False, dec=3, xs=True), G(4, 1, 0, 2, prefetch=False, dec=3, xs=True),
                    G(4, 1, 0, 2, dec=3, xs=True))
    return {
        (2, 8192, 8192): w8, (4, 8192, 8192): w8, (8, 8192, 8192): G(4, 1, 0, 2, rg=2, dec=3, xs=True),
        (16, 8192, 8192): G(4, 1, 0, 2, prefetch=False, rg=2, dec=3, xs=True),
        (2, 4096, 4096): w4, (4, 4096, 4096): w4, (8, 4096, 4096): w4, (16, 4096, 4096): w4,
        (2, 5120, 2048): w8, (4, 5120, 2048): w8, (8, 5120, 2048): w4, (16, 5120, 2048): w4,
        (2, 2048, 4096): w4pf, (4, 2048, 4096): w4, (8, 2048, 4096): w4, (16, 2048, 4096): G(4, 1, 0, 1, prefetch=False,
                                                                                             dec=3, xs=True),
    }


def xs_alternatives() -> dict:
    """Second xs candidates where call 1 suggests one: d8192 M <= 4 with 4 warps x 2 row groups (rg2 was within 3% of
    8 warps there), d8192 M=16 with 8 warps (slow at NT 2 without xs: 39-44 us, the activation loads)."""
    from verl_quads.nvfp4.gluon_gemm import GluonConfig as G

    return {(2, 8192, 8192): G(4, 1, 0, 2, rg=2, dec=3, xs=True), (4, 8192, 8192): G(4, 1, 0, 2, rg=2, dec=3, xs=True),
            (16, 8192, 8192): G(8, 1, 0, 2, prefetch=False, dec=3, xs=True)}


def session9_entries() -> dict:
    """GLUON_TABLE as session 9 left it (d8192 / d4096 only): the baseline rows of ``--configs table-xs``."""
    from verl_quads.nvfp4.gluon_gemm import GluonConfig as G

    g4pf, g4, g8 = G(4, 1, 0, 2), G(4, 1, 0, 2, prefetch=False), G(8, 1, 0, 2, prefetch=False)
    return {(2, 8192, 8192): g8, (4, 8192, 8192): g8, (8, 8192, 8192): g8, (16, 8192, 8192): g4pf,
            (2, 4096, 4096): g4pf, (4, 4096, 4096): g4pf, (8, 4096, 4096): g4, (16, 4096, 4096): g4}


_TMA_KEYS = {"ks": "ks", "w": "nwr", "u": "u", "ns": "ns", "d": "dec", "r": "maxnreg", "floor": "floor"}


def parse_tma(spec: str):
    """``ks2:w4:u2:ns4,ks4:w2`` -> TmaConfigs of the TMA-fed kernel (:mod:`verl_quads.nvfp4.gluon_tma`):
    colon-separated ``<key><int>`` with keys ks (K slices), w (row-group warps: nwr), u (chunks per slice and stage),
    ns (ring stages), d (dec), r (maxnreg); defaults those of TmaConfig."""
    import re

    from verl_quads.nvfp4.gluon_tma import TmaConfig

    out = []
    for tok in filter(None, spec.split(",")):
        kw = {}
        for part in tok.split(":"):
            m = re.fullmatch(r"([a-z]+)(\d+)", part)
            if not m or m.group(1) not in _TMA_KEYS:
                raise ValueError(f"parse_tma: bad part {part!r} in {tok!r} (keys {sorted(_TMA_KEYS)})")
            kw[_TMA_KEYS[m.group(1)]] = int(m.group(2))
        out.append(TmaConfig(**kw))
    return out


#: The TMA kernel's configurations compiled offline (scripts/triton36_check.py --groups tma), checked on the GPU
#: (tests/gpu/test_gluon_tma_gpu.py) and probed by ``--tma default``: GLUON_TABLE's d8192 entry (ks2 w2 u4 ns3) and the
#: session-14 runners-up (H200 cold us at d8192 M = 1 / 4 / 16, call 5: 15.1 / 14.8 / 22.6 for the entry; u2 ns4 16.7
#: / 16.3 / 18.7; w1 u4 ns4 15.1 / 18.5 / 39.9; ks4 w2 u2 ns3 16.3 / 16.4 / 24.9; u8 ns2 15.7 / 15.4 / 23.5), and the
#: entry on re-encoded words (session 15, calls 1-3: d2 14.8 / 14.4-14.5 / 22.1, d4 14.3 / 14.0-14.1 / 21.6).
TMA_SPEC = ("ks2:w2:u4:ns3,ks2:w2:u2:ns4,ks2:w1:u4:ns4,ks4:w2:u2:ns3,ks2:w2:u8:ns2,ks2:w2:u4:ns3:d1,ks2:w2:u4:ns3:d2,"
            "ks2:w2:u4:ns3:d4")
TMA_CONFIGS = parse_tma(TMA_SPEC)


def _point_configs(which: str, cfgs: list, m: int, n: int, k: int) -> list:
    """The configs timed at one (shape, M): ``table-xs``: the xs candidate(s) of the GLUON_TABLE key and the
    session-9 entry (where there was one); else ``cfgs``."""
    if which != "table-xs":
        return cfgs
    from verl_quads.nvfp4.triton_stream import decode_bucket

    key = (decode_bucket(m), n, k)
    out = [("std", c, 0) for c in (xs_candidates().get(key), xs_alternatives().get(key), session9_entries().get(key))
           if c is not None]
    return out


def _configs(which: str, std_spec: str = "", grp_spec: str = "", tma_spec: str = ""):
    """(kind, config, weight format) triples: ``std`` = the standard-layout kernel (gluon_w4a16_std, the one the
    dispatch uses), ``perm`` = the permuted-layout prototype (format 2; format 1 once, for comparison), ``grp`` =
    the grouped wide kernel as one expert (:func:`parse_grp`), ``tma`` = the TMA-fed kernel (:func:`parse_tma`).
    ``which == "std"``: only the std configs of ``std_spec`` (:func:`parse_std`), the grp configs of ``grp_spec`` and
    the tma configs of ``tma_spec``."""
    from verl_quads.nvfp4.gluon_gemm import GluonConfig as G

    if which == "std":
        return ([("std", c, 0) for c in parse_std(std_spec)] + [("grp", c, 0) for c in parse_grp(grp_spec)]
                + [("tma", c, 0) for c in parse_tma(tma_spec)])
    if which == "table-xs":
        return []

    std = [G(4, 1, 0, 2), G(4, 1, 0, 2, prefetch=False), G(8, 1, 0, 2, prefetch=False), G(8, 1, 0, 2),
           G(4, 1, 0, 4), G(4, 2, 0, 2)]
    perm = [(G(4, 2, 0, 2), 2), (G(4, 2, 0, 2), 1), (G(4, 4, 0, 4), 2)]
    if which == "quick":
        return [("std", c, 0) for c in std[:3]] + [("perm", c, f) for c, f in perm[:2]]
    return [("std", c, 0) for c in std] + [("perm", c, f) for c, f in perm]


def _time_warm(fn) -> float:
    """Seconds per call of ``fn()`` replayed alone (warm L2 where the weight fits)."""
    return _time(fn)[0]


def _time_rot(fn_of_copy, copies: int) -> float:
    """Seconds per call of ``fn_of_copy(i)`` over ``copies`` weight copies (cold L2), timed as ``bench rollout``
    times its rotating copies (one CUDA graph of all of them; eager median where a graph cannot be captured)."""
    return _time(_rotating(fn_of_copy, copies))[0] / copies


def run(shapes: list[tuple[int, int]], ms: list[int], which: str = "all", std_spec: str = "",
        defaults: bool = True, grp_spec: str = "", tma_spec: str = "", grp_block_m: int = 32) -> str:
    from verl_quads.bench.timing import device_name, print_table
    from verl_quads.nvfp4 import gluon_dispatch as gd
    from verl_quads.nvfp4 import gluon_gemm as gg
    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.rollout import emulation as em

    dev = "cuda"
    print(device_name(), flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    rows, summary = [], []
    cfgs = _configs(which, std_spec, grp_spec, tma_spec)
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
        # decodes 2 / 4 read re-encoded words (gluon_gemm.std_words): one set of copies per decode in use
        words = {d: [gg.std_words(p, d) for p in wps] for d in {c.dec for kind, c, _ in cfgs if kind in ("tma", "std")}}
        for m in ms:
            tag = f"N={n} K={k} M={m}"
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            x[:, ::293] *= 30.0
            xr = x.float()
            ref = (xr @ wf.t()).to(torch.bfloat16)
            bound = 4 * k * torch.finfo(torch.float32).eps * (xr.abs() @ wf.abs().t())
            t_cub = _time_rot(lambda i: x @ wbs[i].t(), bcopies)
            tw_cub = _time_warm(lambda: x @ wbf.t())
            rows.append([tag, "cuBLAS bf16 torch.matmul", "-", t_cub * 1e6, 1.0, tw_cub * 1e6, 1.0, "-"])
            saved = dict(gd.GLUON_TABLE)
            t_def = float("nan")
            for label_d, table in (("default dispatch without GLUON_TABLE", {}), ("default dispatch", saved)):
                if not defaults and table == {}:
                    continue
                gd.GLUON_TABLE.clear()
                gd.GLUON_TABLE.update(table)
                try:
                    y = tg.nvfp4_linear(x, wp, wsc, wgs, None, "w4a16")
                    rel, ok = _err(y, ref, bound)
                    t_def = _time_rot(lambda i: tg.nvfp4_linear(x, wps[i], wscs[i], wgs, None, "w4a16"), copies)
                    tw_def = _time_warm(lambda: tg.nvfp4_linear(x, wp, wsc, wgs, None, "w4a16"))
                finally:
                    gd.GLUON_TABLE.clear()
                    gd.GLUON_TABLE.update(saved)
                gcfg = gd.gluon_dense_config(x, wp) if table else None
                rows.append([tag, f"{label_d} (nvfp4_linear w4a16{', gluon ' + gcfg.label if gcfg else ''})",
                             "ok" if ok else "WRONG", t_def * 1e6, t_cub / t_def, tw_def * 1e6, tw_cub / tw_def,
                             f"{rel:.2e}"])
            best = bestw = None
            for kind, cfg, fmt in _point_configs(which, cfgs, m, n, k):
                wpt = words[cfg.dec] if kind in ("std", "tma") else wps
                floor = kind == "tma" and cfg.floor  # no decode / MMA: a time floor, never a result
                if kind == "std":
                    label = f"std {cfg.label}"

                    def call(i, cfg=cfg, wpt=wpt):
                        return gg.gluon_w4a16_std(x, wpt[i], wscs[i], wgs, None, cfg)

                    gn, split, cps, even = gg.std_plan(n, k, cfg, gg._num_sms(x.device))
                elif kind == "tma":
                    from verl_quads.nvfp4 import gluon_tma as gt

                    label = cfg.label

                    def call(i, cfg=cfg, wpt=wpt):
                        return gt.gluon_w4a16_tma(x, wpt[i], wscs[i], wgs, None, cfg)

                    gn, _, cps, even = gt.tma_plan(n, k, cfg)
                    split = 1
                elif kind == "grp":
                    from verl_quads.nvfp4 import gluon_moe as gm

                    label = f"grp {cfg.label}"
                    rt, gs1 = dense_routing(m, x.device, grp_block_m), wgs.reshape(1)

                    def call(i, cfg=cfg, rt=rt, gs1=gs1):  # one expert: every row routed, no zero fill
                        return gm.gluon_w4a16_grouped(x, wps[i].unsqueeze(0), wscs[i].unsqueeze(0), gs1, rt,
                                                      out_rows=m, cfg=cfg, zero_unrouted=False)

                    gn, split, cps, even = gm.grouped_plan(n, k, 1, cfg, gg._num_sms(x.device))
                else:
                    gw = gws[fmt]
                    label = f"perm {cfg.label} f{fmt}"

                    def call(i, cfg=cfg, gw=gw):
                        return gg.gluon_w4a16(x, gw[i], cfg)

                    gn, split, cps, even = gg.plan(gw[0], cfg, gg._num_sms(x.device))
                try:
                    t0 = time.time()
                    rel, ok = _err(call(0), ref, bound)
                    if floor:
                        rel, ok = float("nan"), True
                    t = _time_rot(call, copies)
                    tw = _time_warm(lambda call=call: call(0))
                except Exception as ex:  # reported, skipped
                    print(f"  {tag} gluon {label}: failed {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                    continue
                rows.append([tag, f"gluon {label} (grid {gn}x{split}, {cps} chunks{' even' if even else ''})",
                             "floor" if floor else "ok" if ok else "WRONG", t * 1e6, t_cub / t, tw * 1e6, tw_cub / tw,
                             f"{rel:.2e}"])
                print(f"  {tag} gluon {label}: {t * 1e6:.1f} us cold, {tw * 1e6:.1f} warm ({'ok' if ok else 'WRONG'}, "
                      f"rel {rel:.1e}, {time.time() - t0:.1f} s)", flush=True)
                if floor:
                    continue
                if ok and (best is None or t < best[0]):
                    best = (t, label)
                if ok and (bestw is None or tw < bestw[0]):
                    bestw = (tw, label)
            line = (f"{tag}: cuBLAS {t_cub * 1e6:.1f} / {tw_cub * 1e6:.1f} us (cold / warm), default "
                    f"{t_def * 1e6:.1f} / {tw_def * 1e6:.1f} us ({t_cub / t_def:.2f}x / {tw_cub / tw_def:.2f}x)"
                    + (f", best gluon cold {best[1]} {best[0] * 1e6:.1f} us ({t_cub / best[0]:.2f}x cuBLAS, "
                       f"{wbytes / best[0] / 1e12:.2f} TB/s of NVFP4 weight), warm {bestw[1]} {bestw[0] * 1e6:.1f} us "
                       f"({tw_cub / bestw[0]:.2f}x)" if best else ", no correct gluon config"))
            summary.append(line)
            print(line, flush=True)
        del wps, wscs, gws, wbs, wf, words
        torch.cuda.empty_cache()
    out = print_table("W4A16 dense decode, cold / warm L2 (us; x = cuBLAS time / time at the same L2 state; check: 1 "
                      "bf16 ulp + fp32 bound)",
                      ["shape", "kernel", "check", "cold us", "x cuBLAS", "warm us", "x cuBLAS w", "max err/max|ref|"],
                      rows)
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
    ap.add_argument("--shapes", default="8192x8192,4096x4096", help=f"NxK list or names {list(NAMED_SHAPES)}")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--configs", default="all", choices=["all", "quick", "std", "table-xs"],
                    help="table-xs: per (shape, M) the GLUON_TABLE entry (default dispatch row), its xs twin "
                         "(xs_candidates) and the session-9 entry")
    ap.add_argument("--std", default="", help="--configs std: the std configs (parse_std syntax)")
    ap.add_argument("--grp", default="", help="--configs std: grouped-kernel configs run as one expert (parse_grp)")
    ap.add_argument("--tma", default="", help="--configs std: TMA-kernel configs (parse_tma; 'default': "
                    "TMA_SPEC)")
    ap.add_argument("--grp-block-m", type=int, default=32, help="--grp at M > 16: rows per M-tile (32 or 64)")
    ap.add_argument("--no-bare-default", action="store_true",
                    help="skip the 'default dispatch without GLUON_TABLE' rows")
    ap.add_argument("--sass", action="store_true", help="offline sm_90 compile (no GPU): K-loop SASS counts")
    a = ap.parse_args(argv)
    if a.sass:
        sass_counts()
        return
    shapes = [NAMED_SHAPES[s] if s in NAMED_SHAPES else tuple(int(v) for v in s.split("x"))
              for s in a.shapes.split(",")]
    run(shapes, [int(v) for v in a.ms.split(",")], a.configs, a.std, not a.no_bare_default, a.grp,
        TMA_SPEC if a.tma == "default" else a.tma, a.grp_block_m)


if __name__ == "__main__":
    main()
