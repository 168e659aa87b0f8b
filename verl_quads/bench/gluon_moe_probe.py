"""Issue #5 probe: the grouped Gluon W4A16 kernel (:mod:`verl_quads.nvfp4.gluon_moe`) for the MoE expert GEMMs at
Qwen3-30B-A3B width (128 experts, top-8 random routing; w13 [128, 1536, 2048], w2 [128, 2048, 768]) vs BF16
``torch._grouped_mm`` and the current default W4A16 dispatch (``triton_gemm.nvfp4_gemm`` with the routing as
``moe_forward`` builds it), per token count (default 4, 16, 64, 256), and the whole routed-experts layer: the
default ``triton_gemm.moe_forward`` (w4a16; gate fused into the w13 GEMM where it applies) vs the same with
``fuse_gate=False`` (the separate ``moe_silu_mul`` launch) vs the same layer with the two expert GEMMs on the Gluon
kernel (gate separate, and fused: ``silu_mul``) vs the BF16 layer (``torch._grouped_mm``); the fused layers are
checked ``torch.equal`` to their unfused twins before they are timed.

Timing (CUDA graph replays, :func:`verl_quads.bench.timing.graph_time_s`): ``warm`` = one call per replay (the
active experts' weights stay in L2 between replays when they fit, as in the main bench); ``cold`` = one call per
weight copy per replay (copies so that >= 256 MB of the kernel's active weight bytes are read per replay; time /
copies). Every Gluon config is checked per active expert against the torch reference
(:mod:`verl_quads.rollout.emulation`) with the tests' bound (1 bf16 ulp + 4 K eps_f32 |x| @ |w|.T per element).

    python -m verl_quads.bench.gluon_moe_probe [--tokens 4,16,64,256] [--gemms w13,w2] [--configs quick|all]
        [--no-layer]
"""

from __future__ import annotations

import argparse
import math
import re

import torch

from verl_quads.bench.gluon_probe import _time_rot
from verl_quads.bench.rollout import L2_FLUSH_BYTES

E, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
SHAPES = {"w13": (2 * INTER, HIDDEN), "w2": (HIDDEN, INTER)}


def _configs(which: str):
    """``quick``: one-pass tiles (nt = block_m / 8) and passes of 8 rows (nt 1), register prefetch on / off, two
    chunks per iteration (kc 2), 8 warps, split target, a register cap; ``all`` adds a few more."""
    from verl_quads.nvfp4.gluon_moe import GroupedConfig as C

    quick = [C(4, 1, 0, 2), C(4, 1, 0, 2, prefetch=False), C(4, 2, 0, 2), C(8, 1, 0, 2), C(4, 1, 0, 4),
             C(4, 1, 0, 2, nt=1), C(4, 1, 0, 2, prefetch=False, nt=1), C(4, 2, 0, 2, nt=1),
             C(8, 1, 0, 2, nt=1), C(4, 1, 0, 2, nt=2), C(4, 1, 0, 4, nt=1), C(4, 1, 0, 2, maxnreg=96)]
    more = [C(4, 1, 0, 8), C(8, 1, 0, 4), C(2, 1, 0, 4), C(2, 1, 0, 4, nt=1), C(8, 2, 0, 2, nt=1),
            C(4, 1, 0, 2, maxnreg=128, nt=1)]
    wide = _wide_configs()
    if which == "fused13":  # the w13 T=256 candidates under the fused gate (--w13-fused): register caps x K stages
        return [C(4, 1, 0, 2, maxnreg=r, rg=2, dec=3, xs=True, nts=2, xsc=xc, xsb=2) for r in (0, 128, 160, 168)
                for xc in (1, 2, 4)]
    return {"quick": quick, "all": quick + more + wide, "wide": [c for c in wide if c.label in _WIDE_PICK]}[which]


#: the --configs wide selection (session 10 call 1: 15 configs per GEMM fit one ~150 s H200 command)
#: session 10 call 2: GLUON_MOE_TABLE's T=256 entries (w13: w8 ... xs nts2 xsc4 xsb2, w2: w4 ... xs) and candidates:
#: gluon_gemm's mask + multiply decode (d3), 2 row groups per warp (rg2; call 1's label filter had dropped every rg / pd
#: config: GluonConfig grew rg / pfd labels, names doubled)
_WIDE_PICK = ("w8 kc1 sa2 pf1 xs nts2 xsc4 xsb2", "w8 kc1 sa2 pf1 d3 xs nts2 xsc4 xsb2",
              "w4 kc1 sa2 pf1 rg2 d3 xs nts2 xsc4 xsb2", "w4 kc1 sa2 pf1 xs",
              "w4 kc1 sa2 pf1 d3 xs", "w4 kc1 sa2 pf1 rg2 d3 nt2 xs",
              # session 11: GLUON_MOE_TABLE's T=256 / 64 entries (w13 r128 ... nts2 xsc1 xsb2, w2 r128 ... xs nts2; T=64
              # both r128 ... nts1 xsc1 xsb2) and runners-up (x staged in 2-chunk stages; 8 warps)
              "w4 kc1 sa2 pf1 r128 rg2 d3 xs nts2 xsc1 xsb2", "w4 kc1 sa2 pf1 r128 rg2 d3 xs nts2",
              "w4 kc1 sa2 pf1 r128 rg2 d3 xs nts1 xsc1 xsb2", "w4 kc1 sa2 pf1 r128 rg2 d3 xs nts2 xsc2 xsb2",
              "w8 kc1 sa2 pf1 r128 rg2 d3 xs nts2 xsc1 xsb2")


def _wide_configs():
    """Session 10, T = 256..1024 (~16..64 slots per expert): the two best one-kernel configs of session 9 at T=256 as
    baselines; RG row groups per warp (``rg``: 128 / 256 weight rows per program, one activation load per warp for
    all of them); the activation staged in shared memory once per program (``xs``, cp.async; ``pfd`` 2: weight
    prefetch two iterations ahead), in K stages of ``xsc`` chunks with ``xsb`` 2 buffers (the next stage copied
    while this one is used); adaptive n-tiles (``nts``: a tile with <= 8 nts rows runs nts n-tiles, else nt: one
    pass, no weight re-read, for the 17..32-row tiles)."""
    from verl_quads.nvfp4.gluon_moe import GroupedConfig as C

    return [C(4, 1, 0, 2, nt=2), C(4, 1, 0, 2, prefetch=False),
            C(4, 1, 0, 2, prefetch=False, nt=2, rg=2), C(4, 1, 0, 2, nt=2, rg=2), C(4, 1, 0, 2, prefetch=False, rg=2),
            C(4, 1, 0, 2, prefetch=False, nt=1, rg=2), C(2, 1, 0, 2, prefetch=False, nt=2, rg=4),
            C(4, 1, 0, 2, prefetch=False, nt=2, xs=True), C(4, 1, 0, 2, nt=2, xs=True),
            C(4, 1, 0, 2, nt=2, xs=True, pfd=2), C(4, 1, 0, 2, xs=True), C(4, 1, 0, 2, nt=1, xs=True),
            C(4, 1, 0, 2, nt=2, rg=2, xs=True), C(4, 1, 0, 2, nt=2, rg=2, xs=True, pfd=2),
            C(8, 1, 0, 2, nt=2, xs=True), C(8, 1, 0, 2, nt=2, rg=2, xs=True),
            C(4, 1, 0, 2, nts=2, xs=True, xsc=4, xsb=2), C(4, 1, 0, 2, nts=2, xs=True, xsc=4, xsb=2, pfd=2),
            C(4, 1, 0, 2, nts=2, xs=True, xsc=8, xsb=2), C(4, 1, 0, 2, nt=2, xs=True, xsc=4, xsb=2),
            C(4, 1, 0, 2, nts=2, rg=2, xs=True, xsc=4, xsb=2), C(8, 1, 0, 2, nts=2, xs=True, xsc=4, xsb=2),
            C(4, 1, 0, 2, prefetch=False, nts=2, rg=2), C(4, 1, 0, 2, nts=2, xs=True, xsc=4),
            C(8, 1, 0, 2, pfd=2, xs=True, nts=2, xsc=4, xsb=2), C(4, 1, 0, 2, pfd=2, xs=True),
            C(8, 1, 0, 2, dec=3, xs=True, nts=2, xsc=4, xsb=2), C(4, 1, 0, 2, rg=2, dec=3, xs=True, nts=2, xsc=4, xsb=2),
            C(4, 1, 0, 2, dec=3, xs=True), C(4, 1, 0, 2, rg=2, dec=3, nt=2, xs=True),
            # session 11: 1-2 chunk activation stages, register caps for 4 CTAs / SM (2 at 8 warps), nts2 for w2,
            # nts1 at T=64
            C(4, 1, 0, 2, rg=2, dec=3, xs=True, nts=2, xsc=2, xsb=2, maxnreg=128),
            C(4, 1, 0, 2, rg=2, dec=3, xs=True, nts=2, xsc=1, xsb=2, maxnreg=128),
            C(8, 1, 0, 2, rg=2, dec=3, xs=True, nts=2, xsc=1, xsb=2, maxnreg=128),
            C(4, 1, 0, 2, rg=2, dec=3, xs=True, nts=2, maxnreg=128),
            C(4, 1, 0, 2, rg=2, dec=3, xs=True, nts=1, xsc=1, xsb=2, maxnreg=128)]


def _check(y, xf, wf_of, slots_of, rows_of, k):
    """(worst |err| in bf16 ulps, within the bound at every element of every active expert)."""
    worst, ok = 0.0, True
    for ex, slots in slots_of.items():
        wf = wf_of(ex)
        xr = xf[rows_of(slots)]
        ref = (xr @ wf.t()).to(torch.bfloat16).float()
        ulp = torch.where(ref.abs() > 0, 2.0 ** torch.floor(torch.log2(ref.abs().clamp(min=1e-30))) * 2.0 ** -7,
                          torch.full_like(ref, 1e-38))
        bound = ulp + 4 * k * torch.finfo(torch.float32).eps * (xr.abs() @ wf.abs().t())
        d = (y[slots].float() - ref).abs()
        worst = max(worst, float((d / ulp).max()))
        ok = ok and bool((d <= bound).all())
    return worst, ok


def run(tokens: list[int], gemms: list[str], which: str = "quick", layer: bool = True, only: str = "",
        layer_cfgs: dict | None = None, fused13: bool = False) -> str:
    """``fused13``: each w13 Gluon config also with the gate fused into its epilogue (``silu_mul``; rows "fused gate
    ...", where :func:`~verl_quads.nvfp4.gluon_moe.silu_mul_refusal` allows it; check = bytes equal to moe_silu_mul
    of the unfused result)."""
    from verl_quads.bench.timing import device_name, print_table
    from verl_quads.nvfp4 import gluon_dispatch as gd
    from verl_quads.nvfp4 import gluon_moe as gm
    from verl_quads.nvfp4 import moe_routing as mr
    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.rollout import emulation as em

    dev = "cuda"
    print(device_name(), flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    rows, summary = [], []
    routings, groutings, xs, ids_of, sw_of = {}, {}, {}, {}, {}
    for t in tokens:
        ids_of[t] = torch.rand(t, E, device=dev, generator=g).argsort(-1)[:, :TOP_K]
        sw_of[t] = torch.softmax(torch.randn(t, TOP_K, device=dev, generator=g), -1)
        s = t * TOP_K
        # routing as moe_forward builds it for w4a16 on sm_90 (moe_block_m where both GEMMs have entries: T=1024 32)
        bm = gd.GLUON_MOE_ROUTING_BLOCK_M.get(gd.gluon_moe_bucket(s)) or tg.grouped_block_m(-(-s // min(E, s)))
        routings[t] = mr.moe_align(ids_of[t], E, bm)
        # the Gluon kernel takes routing block_m 8 / 16 / 32 / 64: past 64 its own 64-row tile table
        groutings[t] = (routings[t] if routings[t].block_m in gm.BLOCK_M_NT
                        else mr.moe_align(ids_of[t], E, max(gm.BLOCK_M_NT)))
        x = torch.randn(t, HIDDEN, device=dev, generator=g)
        x[:, ::293] *= 30.0
        xs[t] = x.to(torch.bfloat16)
    min_active = min(int(ids_of[t].unique().numel()) for t in tokens)
    weights = {}
    for name in gemms + ([n for n in SHAPES if n not in gemms] if layer else []):
        n, k = SHAPES[name]
        q = em.quantize_weight(torch.randn(E, n, k, device=dev, generator=g) * 0.02, reduce_dims=(1, 2))
        per_expert = n * k * 9 // 16
        copies = max(1, min(8, math.ceil(L2_FLUSH_BYTES / (min_active * per_expert))))
        wq = [(q.packed.clone(), q.block_scale.clone(), q.global_scale.reshape(-1).clone()) for _ in range(copies)]
        b0 = em.weight_f32(q.packed, q.block_scale, q.global_scale.reshape(E, 1, 1)).to(torch.bfloat16)
        bf = [b0.clone().transpose(-2, -1) for _ in range(copies)]  # [E, K, N] views for torch._grouped_mm
        del b0
        weights[name] = (q, wq, bf)
        print(f"{name}: [{E}, {n}, {k}], {copies} weight copies", flush=True)
    cfgs = [c for c in _configs(which) if not only or re.search(only, c.label)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg_of = {f"gluon {c.label}": c for c in cfgs}
    best = {}  # (gemm, tokens) -> the fastest correct config (cold)
    for name in gemms:
        n, k = SHAPES[name]
        q, wq, bf = weights[name]
        gs = q.global_scale.reshape(-1)
        for t in tokens:
            s = t * TOP_K
            routing, grouting = routings[t], groutings[t]
            flat = ids_of[t].reshape(-1)
            active = flat.unique().tolist()
            abytes = len(active) * n * k * 9 // 16
            copies = max(1, min(len(wq), math.ceil(L2_FLUSH_BYTES / abytes)))
            g2 = torch.Generator(device=dev).manual_seed(t)
            if name == "w13":
                x = xs[t]
                a_rows = routing.sorted_tokens
                ga_rows = grouting.sorted_tokens
                rows_of = lambda sl: torch.div(sl, TOP_K, rounding_mode="floor")  # noqa: E731
            else:
                x = (torch.randn(s, k, device=dev, generator=g2)).to(torch.bfloat16)
                a_rows = ga_rows = None
                rows_of = lambda sl: sl  # noqa: E731
            xf = x.float()
            slots_of = {ex: (flat == ex).nonzero().squeeze(-1) for ex in active}
            wf_of = lambda ex: em.weight_f32(q.packed[ex], q.block_scale[ex], gs[ex])  # noqa: E731
            tag = f"{name} T={t} (S={s}, {len(active)} experts, bm {routing.block_m}" + (
                f", gluon bm {grouting.block_m})" if grouting is not routing else ")")
            res = {}
            # BF16 torch._grouped_mm on the sorted rows (offsets precomputed: free routing metadata)
            counts = torch.bincount(flat, minlength=E)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            order = torch.sort(flat, stable=True).indices
            xsorted = x[rows_of(order)].contiguous()
            try:
                for mode, cp in (("cold", copies), ("warm", 1)):
                    res[("bf16 torch._grouped_mm", mode)] = _time_rot(
                        lambda i: torch._grouped_mm(xsorted, bf[i], offs=offs), cp)
            except Exception as ex:  # pragma: no cover
                print(f"{tag}: torch._grouped_mm failed ({type(ex).__name__}: {ex})", flush=True)
            op, _ = tg.quantize_activation(x, "w4a16")
            y = tg.nvfp4_gemm(op, *wq[0], routing=routing, a_rows=a_rows, out_rows=s)
            werr, ok = _check(y, xf, wf_of, slots_of, rows_of, k)
            for mode, cp in (("cold", copies), ("warm", 1)):
                res[("default dispatch", mode)] = _time_rot(
                    lambda i: tg.nvfp4_gemm(op, *wq[i], routing=routing, a_rows=a_rows, out_rows=s,
                                            zero_unrouted=False), cp)
            res[("default dispatch", "check")] = (werr, ok)
            key = (gd.gluon_moe_bucket(s), n, k) if hasattr(gd, "gluon_moe_bucket") else None
            if key in gd.GLUON_MOE_TABLE:  # the dispatch this table entry replaced (same run, same L2 state)
                entry = gd.GLUON_MOE_TABLE.pop(key)
                try:
                    y = tg.nvfp4_gemm(op, *wq[0], routing=routing, a_rows=a_rows, out_rows=s)
                    res[("dispatch without its GLUON_MOE_TABLE entry", "check")] = _check(y, xf, wf_of, slots_of,
                                                                                          rows_of, k)
                    for mode, cp in (("cold", copies), ("warm", 1)):
                        res[("dispatch without its GLUON_MOE_TABLE entry", mode)] = _time_rot(
                            lambda i: tg.nvfp4_gemm(op, *wq[i], routing=routing, a_rows=a_rows, out_rows=s,
                                                    zero_unrouted=False), cp)
                finally:
                    gd.GLUON_MOE_TABLE[key] = entry
            for cfg in cfgs:
                label = f"gluon {cfg.label}"
                try:
                    y = gm.gluon_w4a16_grouped(x, *wq[0], grouting, a_rows=ga_rows, out_rows=s, cfg=cfg)
                    werr, ok = _check(y, xf, wf_of, slots_of, rows_of, k)
                    for mode, cp in (("cold", copies), ("warm", 1)):
                        res[(label, mode)] = _time_rot(
                            lambda i, cfg=cfg: gm.gluon_w4a16_grouped(x, *wq[i], grouting, a_rows=ga_rows, out_rows=s,
                                                                      cfg=cfg, zero_unrouted=False), cp)
                    res[(label, "check")] = (werr, ok)
                    plan = gm.grouped_plan(n, k, min(E, s), cfg, torch.cuda.get_device_properties(0).multi_processor_count)
                    res[(label, "plan")] = f"grid {plan[0]}x{grouting.tile_expert.numel()}x{plan[1]}"
                    if fused13 and name == "w13" and not gm.silu_mul_refusal(n, k, min(E, s), cfg, sms):
                        # the same config with the gate in its epilogue: check: == moe_silu_mul of y, bit for bit
                        fl = f"fused gate {cfg.label}"
                        a_f = gm.gluon_w4a16_grouped(x, *wq[0], grouting, a_rows=ga_rows, out_rows=s, cfg=cfg,
                                                     silu_mul=True)
                        res[(fl, "check")] = (float("nan"), torch.equal(a_f, tg.moe_silu_mul(y, ids_of[t])))
                        for mode, cp in (("cold", copies), ("warm", 1)):
                            res[(fl, mode)] = _time_rot(
                                lambda i, cfg=cfg: gm.gluon_w4a16_grouped(x, *wq[i], grouting, a_rows=ga_rows,
                                                                          out_rows=s, cfg=cfg, zero_unrouted=False,
                                                                          silu_mul=True), cp)
                except Exception as ex:
                    print(f"{tag} {label}: FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
            base_c = res.get(("bf16 torch._grouped_mm", "cold"), float("nan"))
            base_w = res.get(("bf16 torch._grouped_mm", "warm"), float("nan"))
            labels = [lb for lb, md in res if md == "cold"]
            for lb in labels:
                chk = res.get((lb, "check"))
                tc, tw = res[(lb, "cold")], res[(lb, "warm")]
                rows.append([tag, lb + (f" ({res[(lb, 'plan')]})" if (lb, "plan") in res else ""),
                             "-" if chk is None else ("ok" if chk[1] else "WRONG"), tc * 1e6, base_c / tc, tw * 1e6,
                             base_w / tw, abytes / tc / 1e12, "-" if chk is None else f"{chk[0]:.2f}"])
                print(f"  {tag} {lb}: cold {tc * 1e6:.1f} us ({base_c / tc:.2f}x bf16), warm {tw * 1e6:.1f} us "
                      f"({base_w / tw:.2f}x){'' if chk is None else ' check ' + ('ok' if chk[1] else 'WRONG')}",
                      flush=True)
            good = [lb for lb in labels if lb.startswith("gluon") and res[(lb, "check")][1]]
            if good:
                bc = min(good, key=lambda lb: res[(lb, "cold")])
                best[(name, t)] = cfg_of[bc]
                bw = min(good, key=lambda lb: res[(lb, "warm")])
                dc, dw = res[("default dispatch", "cold")], res[("default dispatch", "warm")]
                summary.append(f"{tag}: default {dc * 1e6:.1f} / {dw * 1e6:.1f} us (cold / warm), best gluon cold "
                               f"{bc} {res[(bc, 'cold')] * 1e6:.1f} us ({dc / res[(bc, 'cold')]:.2f}x default, "
                               f"{base_c / res[(bc, 'cold')]:.2f}x bf16), warm {bw} {res[(bw, 'warm')] * 1e6:.1f} us "
                               f"({dw / res[(bw, 'warm')]:.2f}x default, {base_w / res[(bw, 'warm')]:.2f}x bf16)")
    out = print_table("Grouped W4A16 expert GEMMs (us; x bf16 = torch._grouped_mm BF16 time / time, same L2 state; "
                      "TB/s = active NVFP4 weight bytes / cold time; ulp = worst |err| in bf16 ulps)",
                      ["point", "kernel", "check", "cold us", "x bf16", "warm us", "x bf16 warm", "TB/s", "ulp"],
                      rows) if rows else ""
    print("\n".join(summary), flush=True)
    if layer:
        for (name, t), c in (layer_cfgs or {}).items():
            best[(name, t)] = c
        out += "\n" + _layer(tokens, weights, ids_of, sw_of, xs, groutings, best)
    return out + "\n" + "\n".join(summary)


def _layer(tokens, weights, ids_of, sw_of, xs, routings, best) -> str:
    """The whole routed-experts layer, w4a16: default moe_forward (fused gate where it applies) and with
    ``fuse_gate=False`` vs the same steps with the Gluon GEMMs (per GEMM and token count the fastest correct config
    of the GEMM rows above, else the GLUON_MOE_TABLE entry, else GroupedConfig(4, 1, 0, 2)), gate separate and fused
    into the w13 GEMM, vs BF16 (torch._grouped_mm). Column ``same``: the fused layer ``torch.equal`` its unfused
    twin (checked before timing)."""
    from verl_quads.bench.timing import print_table
    from verl_quads.nvfp4 import gluon_dispatch as gd
    from verl_quads.nvfp4 import gluon_moe as gm
    from verl_quads.nvfp4 import moe_routing as mr
    from verl_quads.nvfp4 import triton_gemm as tg
    from verl_quads.nvfp4.gluon_moe import GroupedConfig as C

    dflt = C(4, 1, 0, 2)
    q13, w13, bf13 = weights["w13"]
    q2, w2, bf2 = weights["w2"]
    copies = min(len(w13), len(w2))
    rows, parts = [], []
    for t in tokens:
        x, ids, sw = xs[t], ids_of[t], sw_of[t]
        s = t * TOP_K
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=E)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        bm = routings[t].block_m
        cap = torch.cuda.get_device_capability()
        c13 = best.get(("w13", t)) or gd.gluon_moe_table_entry(s, *SHAPES["w13"], bm, cap) or dflt
        c2 = best.get(("w2", t)) or gd.gluon_moe_table_entry(s, *SHAPES["w2"], bm, cap) or dflt
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        why13 = gm.silu_mul_refusal(*SHAPES["w13"], min(E, s), c13, sms)

        def default(i):
            return tg.moe_forward(x, sw, ids, *w13[i], *w2[i], "w4a16")

        def unfused(i):
            return tg.moe_forward(x, sw, ids, *w13[i], *w2[i], "w4a16", fuse_gate=False)

        def before(i):  # moe_forward without this bucket's GLUON_MOE_TABLE entries
            keys = [k for k in gd.GLUON_MOE_TABLE if k[0] == gd.gluon_moe_bucket(s)]
            saved = {k: gd.GLUON_MOE_TABLE.pop(k) for k in keys}
            try:
                return tg.moe_forward(x, sw, ids, *w13[i], *w2[i], "w4a16")
            finally:
                gd.GLUON_MOE_TABLE.update(saved)

        def gluon(i):
            r = mr.moe_align(ids, E, bm)
            h = gm.gluon_w4a16_grouped(x, *w13[i], r, a_rows=r.sorted_tokens, out_rows=s, cfg=c13,
                                       zero_unrouted=False)
            a = tg.moe_silu_mul(h, ids)
            y = gm.gluon_w4a16_grouped(a, *w2[i], r, out_rows=s, cfg=c2, zero_unrouted=False)
            return tg.moe_combine(y, sw, ids)

        def gluon_fused(i):
            r = mr.moe_align(ids, E, bm)
            a = gm.gluon_w4a16_grouped(x, *w13[i], r, a_rows=r.sorted_tokens, out_rows=s, cfg=c13,
                                       zero_unrouted=False, silu_mul=True)
            y = gm.gluon_w4a16_grouped(a, *w2[i], r, out_rows=s, cfg=c2, zero_unrouted=False)
            return tg.moe_combine(y, sw, ids)

        def bf16(i):
            order = torch.sort(flat, stable=True).indices
            tok = torch.div(order, TOP_K, rounding_mode="floor")
            h = torch._grouped_mm(x[tok], bf13[i], offs=offs)
            a = torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]
            y = torch._grouped_mm(a, bf2[i], offs=offs)
            out = torch.zeros(t, HIDDEN, dtype=torch.float32, device=x.device)
            return out.index_add_(0, tok, y.float() * sw.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)

        yd, yg = default(0), gluon(0)
        rel = float((yd.float() - yg.float()).norm() / yd.float().norm().clamp_min(1e-30))
        same = {"default moe_forward w4a16": str(torch.equal(yd, unfused(0)))}
        res = {}
        variants = [("bf16 layer (torch._grouped_mm)", bf16), ("default moe_forward w4a16", default),
                    ("moe_forward w4a16 fuse_gate=False", unfused),
                    (f"gluon GEMMs layer (w13 {c13.label}; w2 {c2.label})", gluon)]
        if not why13:
            lb = f"gluon GEMMs layer, gate fused (w13 {c13.label}; w2 {c2.label})"
            same[lb] = str(torch.equal(gluon_fused(0), yg))
            variants.append((lb, gluon_fused))
        else:
            print(f"layer T={t}: no fused gate with w13 {c13.label}: {why13}", flush=True)
        if hasattr(gd, "gluon_moe_bucket") and any(k[0] == gd.gluon_moe_bucket(s) for k in gd.GLUON_MOE_TABLE):
            variants.insert(3, ("moe_forward without the GLUON_MOE_TABLE entries here", before))
        for lb, fn in variants:
            try:
                res[lb] = (_time_rot(fn, copies), _time_rot(fn, 1))
            except Exception as ex:  # pragma: no cover
                print(f"layer T={t} {lb}: FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
        bc, bw = res.get("bf16 layer (torch._grouped_mm)", (float("nan"),) * 2)
        for lb, (tc, tw) in res.items():
            rows.append([f"moe layer T={t}", lb, tc * 1e6, bc / tc, tw * 1e6, bw / tw,
                         f"{rel:.1e}" if lb.startswith("gluon") else "-", same.get(lb, "-")])
            print(f"  layer T={t} {lb}: cold {tc * 1e6:.1f} us ({bc / tc:.2f}x bf16), warm {tw * 1e6:.1f} us "
                  f"({bw / tw:.2f}x)", flush=True)
        # the Gluon layer's parts, each launched alone on the outputs of the previous ones (cold: GEMMs over the
        # weight copies; the other parts touch no weights)
        r = mr.moe_align(ids, E, bm)
        h = gm.gluon_w4a16_grouped(x, *w13[0], r, a_rows=r.sorted_tokens, out_rows=s, cfg=c13, zero_unrouted=False)
        a = tg.moe_silu_mul(h, ids)
        y = gm.gluon_w4a16_grouped(a, *w2[0], r, out_rows=s, cfg=c2, zero_unrouted=False)

        steps = (("moe_align", lambda i: mr.moe_align(ids, E, bm), 1),
                 ("w13 gluon", lambda i: gm.gluon_w4a16_grouped(x, *w13[i], r, a_rows=r.sorted_tokens, out_rows=s,
                                                                cfg=c13, zero_unrouted=False), copies),
                 ("moe_silu_mul", lambda i: tg.moe_silu_mul(h, ids), 1),
                 *((("w13 gluon + gate fused (replaces the two above)",
                     lambda i: gm.gluon_w4a16_grouped(x, *w13[i], r, a_rows=r.sorted_tokens, out_rows=s, cfg=c13,
                                                      zero_unrouted=False, silu_mul=True), copies),)
                   if not why13 else ()),
                 ("w2 gluon", lambda i: gm.gluon_w4a16_grouped(a, *w2[i], r, out_rows=s, cfg=c2, zero_unrouted=False),
                  copies),
                 ("moe_combine", lambda i: tg.moe_combine(y, sw, ids), 1))
        if not why13:
            a_f = gm.gluon_w4a16_grouped(x, *w13[0], r, a_rows=r.sorted_tokens, out_rows=s, cfg=c13, silu_mul=True)
            a_u = tg.moe_silu_mul(gm.gluon_w4a16_grouped(x, *w13[0], r, a_rows=r.sorted_tokens, out_rows=s, cfg=c13),
                                  ids)
            print(f"layer T={t}: w13 + gate fused == unfused: {torch.equal(a_f, a_u)}", flush=True)
        tp_of = {}
        for lb, fn, cp in steps:
            tp_of[lb] = tp = _time_rot(fn, cp)
            parts.append([f"moe layer T={t}", lb, tp * 1e6, tp / bc])
        fused = [lb for lb in tp_of if lb.startswith("w13 gluon + gate fused")]
        total = sum(tp for lb, tp in tp_of.items() if lb not in fused)
        parts.append([f"moe layer T={t}", "sum of parts", total * 1e6, total / bc])
        if fused:
            tf = total - tp_of["w13 gluon"] - tp_of["moe_silu_mul"] + tp_of[fused[0]]
            parts.append([f"moe layer T={t}", "sum of parts, gate fused", tf * 1e6, tf / bc])
        for lb, tp in _align_kernels(ids, bm):
            parts.append([f"moe layer T={t}", lb, tp * 1e6, tp / bc])
    out = print_table("MoE layer, w4a16 (us; x bf16 = BF16 layer time / time; rel = ||y_gluon - y_default|| / "
                      "||y_default||; same = torch.equal to the unfused twin)",
                      ["point", "layer", "cold us", "x bf16", "warm us", "x bf16 warm", "rel", "same"], rows)
    return out + "\n" + print_table("Gluon layer parts (us, each alone; GEMMs cold L2; share = time / BF16 layer cold)",
                                    ["point", "part", "us", "share"], parts)


def _align_kernels(ids, bm):
    """At S >= 1 slots (else none): moe_align's two launches (its path past
    MOE_ALIGN_ONE_LAUNCH_MAX slots) timed one by one, as moe_align launches them, its one launch
    (``_moe_align_one_launch``: moe_align's up to MOE_ALIGN_ONE_LAUNCH_MAX slots), an empty launch, and moe_align
    itself (checked == moe_align_reference)."""
    import triton

    from verl_quads.nvfp4 import moe_routing as mr

    flat = ids.reshape(-1).contiguous()
    s = flat.numel()
    if s == 0:
        return []
    r = mr.moe_align(ids, E, bm)
    i32 = dict(dtype=torch.int32, device=flat.device)
    t_max = r.tile_expert.numel()
    ep = triton.next_power_of_2(E + 2)
    chunk = 128 * max(1, -(-s // (128 * 64)))
    p = -(-s // chunk)
    hist, start = torch.empty(p, ep, **i32), torch.empty(ep, **i32)
    te, tr0, tr1, so, st = (torch.empty(t_max, **i32), torch.empty(t_max, **i32), torch.empty(t_max, **i32),
                            torch.empty(s, **i32), torch.empty(s, **i32))
    mr._moe_hist_kernel[(p,)](flat, hist, s, E, C=chunk, EP=ep)
    ref = mr.moe_align_reference(ids, E, bm)
    same = all(torch.equal(getattr(r, f), getattr(ref, f)) for f in
               ("sorted_slots", "tile_expert", "tile_row0", "tile_row1", "sorted_tokens"))
    mr._moe_align_one_launch(flat, E, TOP_K, bm, (te, tr0, tr1, so, st))
    one_same = all(torch.equal(a, getattr(ref, f)) for a, f in zip(
        (te, tr0, tr1, so, st), ("tile_expert", "tile_row0", "tile_row1", "sorted_slots", "sorted_tokens")))
    return [(f"  align: hist ({p} programs)", _time_rot(
        lambda i: mr._moe_hist_kernel[(p,)](flat, hist, s, E, C=chunk, EP=ep), 1)),
        (f"  align: scan + tile table + scatter ({p} programs)", _time_rot(
            lambda i: mr._moe_scan_scatter_kernel[(p,)](flat, hist, te, tr0, tr1, so, st, s, E, TOP_K, p, t_max,
                                                        C=chunk, EP=ep, PP=triton.next_power_of_2(p), BM=bm, TT=32,
                                                        num_warps=8), 1)),
        (f"  align: one launch ({'== reference' if one_same else 'WRONG'})", _time_rot(
            lambda i: mr._moe_align_one_launch(flat, E, TOP_K, bm, (te, tr0, tr1, so, st)), 1)),
        ("  align: empty launch (torch add 1 elt)", _time_rot(lambda i: start[:1].add_(0), 1)),
        (f"  moe_align ({'== reference' if same else 'WRONG'})", _time_rot(lambda i: mr.moe_align(ids, E, bm), 1))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="4,16,64,256")
    ap.add_argument("--gemms", default="w13,w2", help="GEMM rows to time ('': none, the layer only)")
    ap.add_argument("--configs", default="quick", choices=["quick", "all", "wide", "fused13"])
    ap.add_argument("--only", default="", help="regex: only the configs whose label matches")
    ap.add_argument("--no-layer", action="store_true")
    ap.add_argument("--w13-fused", action="store_true", help="w13 rows: each config also with the gate fused")
    ap.add_argument("--layer", default="", help="layer configs by label, e.g. 'w13:T=256:w4 kc1 sa2 pf1 nt2;w2:...' "
                    "(else the fastest correct config of this run's GEMM rows, else w4 kc1 sa2 pf1)")
    a = ap.parse_args(argv)
    by_label = {c.label: c for c in _configs("all")}
    layer_cfgs = {}
    for item in filter(None, a.layer.split(";")):
        name, tt, label = item.split(":", 2)
        layer_cfgs[(name, int(tt.removeprefix("T=")))] = by_label[label]
    run([int(v) for v in a.tokens.split(",")], [g for g in a.gemms.split(",") if g], a.configs, not a.no_layer, a.only,
        layer_cfgs, a.w13_fused)  # --gemms '': the layer only


if __name__ == "__main__":
    main()
