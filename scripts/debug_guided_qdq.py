"""Debug the one-launch guided QDQ (``triton_kernels.fake_quantize_guided``) on a GPU, bit for bit.

Compares, per case, ``_guided_kernel`` MODE 1 (the candidate: the code's sign bit OR-ed into the float32
product's bits) and MODE 2 (commit 1cd2ec7's formulation: ``where(code >= 8, -v, v)``) with the definition
``dequantize(quantize_guided(x, record))`` of the torch reference, comparing the output BYTES (so -0.0 and
+0.0 differ; ``torch.equal`` on float tensors does not see that). Also checks, per case, the guided codes
(triton ``quantize_guided`` packed bytes == torch's) and the two-launch triton path (triton quantize_guided,
then triton ``dequantize``) against the same bytes, and probes how the device negates +0.0 in a Triton
kernel (triton 3.6 lowers a float ``-v`` to ``0.0 - v``, which is +0.0 for v = +0.0; triton 3.9 emits fneg).

Cases: shapes 16x16 .. 4096x2048 (``--small``: up to 33x96), bf16 / fp16 / fp32 inputs (bf16 written by
both GPU store modes, ``KERNELS["bf16_store"]`` native and int), per-tensor and per-row global scales;
records: the round-to-nearest record of x applied to a noisy x (with -0.0 / +0.0 entries), that record on x
itself, random guidance bits under x's scales, a fully random record (scale bytes 0..126, global scales
2^-20..2^20), and inputs whose scaled value is a float32 denormal (tiny entries next to a 1e30 entry; bf16
and fp32 subnormal inputs under a unit scale) with every guidance bit 1 (the reference gives +-0.5 there).

On a mismatch it prints the count and the first 10 differing elements (x, block-scale byte and value, global
scale, guidance bit, reference code, both outputs in hex); a summary table comes last. Exit status 1 if
MODE 1 (the candidate) differs anywhere, else 0.

H200 (repo root; about 30 s, most of it compiles): ``PYTHONPATH=. python scripts/debug_guided_qdq.py``
CPU: ``TRITON_INTERPRET=1 PYTHONPATH=. python scripts/debug_guided_qdq.py --small`` (about 1 min).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import verl_quads.nvfp4 as nv
from verl_quads.nvfp4 import triton_kernels as tk
from verl_quads.nvfp4.guidance import unpack_bits
from verl_quads.nvfp4.reference import unpack_codes

import triton
import triton.language as tl

MODES = {1: "sign-OR (candidate)", 2: "where(-v) (1cd2ec7)"}
_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@triton.jit
def _neg_probe_kernel(x_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, -tl.load(x_ptr + i))


def neg_probe(dev):
    """How this device's Triton negates float32 +0.0, -0.0, 1.0 (bit patterns of ``-x``)."""
    x = torch.tensor([0.0, -0.0, 1.0, 0.0], device=dev)
    o = torch.empty_like(x)
    _neg_probe_kernel[(1,)](x, o, N=4)
    return [f"{int(v):08x}" for v in o.view(torch.int32).cpu().tolist()[:3]]


def _x(m, k, dtype, dev, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) / torch.rand(m, k, generator=g).clamp(min=0.02)
    if k > 512:
        x[:, ::512] *= 40
    x = x.to(dtype)
    # signed zeros: a whole block, and scattered entries
    x[0, :16] = -0.0
    x.view(-1)[7::97] = -0.0
    x.view(-1)[11::89] = 0.0
    return x.to(dev)


def _noisy(x, seed, eps=0.01):
    g = torch.Generator().manual_seed(seed)
    n = (x.float().cpu() * (1 + eps * torch.randn(x.shape, generator=g))).to(x.dtype).to(x.device)
    n.view(-1)[3::101] = -0.0
    return n


def _gs(x, kind):
    a = x.float().abs()
    return nv.global_scale_from_amax(a.amax(-1, keepdim=True) if kind == "row" else a.amax())


def _rand_bits(rec, seed, fill=None):
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, tuple(rec.bits.shape), generator=g, dtype=torch.uint8) if fill is None else \
        torch.full(tuple(rec.bits.shape), fill, dtype=torch.uint8)
    return nv.GuidanceRecord(b.to(rec.bits.device), rec.block_scale, rec.global_scale, rec.shape)


def cases(shapes, dtypes, dev):
    """(name, x, record) triples."""
    out = []
    seed = 0
    for m, k in shapes:
        for dt in dtypes:
            for gk in ("row", "tensor"):
                seed += 1
                x = _x(m, k, dt, dev, seed)
                rec = nv.extract_guidance(nv.quantize(x, _gs(x, gk), backend="torch"))
                tag = f"{m}x{k} {str(dt)[6:]} gs={gk}"
                out.append((f"{tag} rtn-rec/noisy", _noisy(x, seed), rec))
                out.append((f"{tag} rtn-rec/self", x, rec))
                out.append((f"{tag} rand-bits/noisy", _noisy(x, seed + 1000), _rand_bits(rec, seed)))
                g = torch.Generator().manual_seed(seed + 2000)
                sb = torch.randint(0, 127, (m, k // 16), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
                gsr = (torch.exp2(torch.randint(-20, 20, (m, 1) if gk == "row" else (), generator=g).float())
                       * (1 + torch.rand((m, 1) if gk == "row" else (), generator=g)))
                rr = nv.GuidanceRecord(torch.randint(0, 256, (m, k // 8), generator=g, dtype=torch.uint8).to(dev),
                                       sb.to(dev), gsr.to(dev), torch.Size((m, k)))
                out.append((f"{tag} rand-record", x, rr))
    # scaled values that are float32 denormals, every guidance bit 1 (reference: +-0.5 for y != 0 off the grid)
    tiny = [1e-9, -1e-9, 3e-9, -2e-9, 1e-8, 5e-10, -7e-9, 2e-39]
    for dt in dtypes:
        big = 1e30 if dt != torch.float16 else 6e4
        sm = [t if dt != torch.float16 else t * 1e5 for t in tiny]
        row = torch.tensor([big] + sm + sm[:6] + [-0.0] + [big] * 0 + sm * 2, dtype=torch.float32)[:32]
        x = row.reshape(1, 32).repeat(4, 1).to(dt).to(dev)
        rec = nv.extract_guidance(nv.quantize(x, _gs(x, "row"), backend="torch"))
        kind = "tiny-y fp16 6e4-block" if dt == torch.float16 else f"denormal-y {str(dt)[6:]} 1e30-block"
        out.append((f"{kind} bits=1", x, _rand_bits(rec, 0, fill=255)))
        # subnormal inputs (bf16/fp32: float32 subnormals; fp16: its own subnormals) under scale 1, gs 1
        v = torch.tensor([1e-39, -1e-39, 5e-40, -3e-40, 1e-45, 0.0, -0.0, 1e-38, 2e-38, 1.0, 0.3, -0.3, 6.0,
                          1e-39, -1e-40, 4e-39] * 2).reshape(1, 32)
        if dt == torch.float16:
            v = torch.where(v.abs() < 1e-30, v * 1e32, v)  # 1e-7 .. fp16 subnormals
        xs = v.to(dt).to(dev)
        rs = nv.GuidanceRecord(torch.full((1, 4), 255, dtype=torch.uint8, device=dev),
                               torch.ones(1, 2).to(torch.float8_e4m3fn).to(dev), torch.tensor(1.0, device=dev),
                               torch.Size((1, 32)))
        out.append((f"subnormal-x {str(dt)[6:]} scale=1 gs=1 bits=1", xs, rs))
    return out


def _hex(t, dt):
    w = 4 if dt != torch.float32 else 8
    return f"{int(t) & ((1 << (4 * w)) - 1):0{w}x}"


def dump(name, x, rec, out, ref, limit=10):
    dt = x.dtype
    ob, rb = out.view(_INT[dt]).reshape(-1), ref.view(_INT[dt]).reshape(-1)
    bad = (ob != rb).nonzero().reshape(-1)
    k = x.shape[-1]
    codes = unpack_codes(nv.quantize_guided(x, rec, backend="torch").packed).reshape(-1).cpu()
    bits = unpack_bits(rec.bits).reshape(-1).cpu()
    sb = rec.block_scale.contiguous().view(torch.uint8).reshape(-1).cpu()
    gs = rec.global_scale.float().reshape(-1).cpu()
    rows = x.numel() // k
    print(f"  MISMATCH {name}: {bad.numel()} of {x.numel()} elements; first {min(limit, bad.numel())}:")
    print("    (row,col)  x[hex]      x            scale(byte,val)   gs           bit code  out[hex] ref[hex]  out          ref")
    xb = x.reshape(-1).view(_INT[dt]).cpu()
    for i in bad[:limit].tolist():
        r, c = divmod(i, k)
        blk = r * (k // 16) + c // 16
        g = gs[0] if gs.numel() == 1 else gs[r * gs.numel() // rows]
        sv = sb[blk].view(torch.float8_e4m3fn).float().item()
        print(f"    ({r},{c})  {_hex(xb[i], dt):>8}  {x.reshape(-1)[i].float().item():>12.5g}  "
              f"0x{int(sb[blk]):02x} {sv:>10.5g}  {g.item():>12.5g}  {int(bits[i])}  {int(codes[i]):>4}  "
              f"{_hex(ob[i], dt):>8} {_hex(rb[i], dt):>8}  {out.reshape(-1)[i].float().item():>12.5g} "
              f"{ref.reshape(-1)[i].float().item():>12.5g}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="shapes up to 33x96 (CPU interpreter)")
    ap.add_argument("--details", type=int, default=3, help="mismatch dumps per (mode, store)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(16, 16), (4, 64), (33, 96)] + ([] if args.small else [(256, 512), (4096, 2048)])
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    t0 = time.time()
    print(f"device {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu (interpreter)'}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    print(f"Triton -x on this device: -(+0.0) = {neg_probe(dev)[0]}, -(-0.0) = {neg_probe(dev)[1]}, -(1.0) = "
          f"{neg_probe(dev)[2]} (IEEE negation: 80000000, 00000000, bf800000)")
    stores = ["native", "int"] if dev == "cuda" else ["int"]
    table = []  # (case, variant, store, byte diffs, value diffs)
    shown: dict = {}
    fails = {m: 0 for m in MODES}
    qg_bad = tq_bad = 0
    allc = cases(shapes, dtypes, dev)
    for name, x, rec in allc:
        ref = nv.dequantize(nv.quantize_guided(x, rec, backend="torch"), x.dtype, backend="torch")
        rb = ref.view(_INT[x.dtype])
        codes_ok = torch.equal(nv.quantize_guided(x, rec, backend="triton").packed,
                               nv.quantize_guided(x, rec, backend="torch").packed)
        qg_bad += not codes_ok
        for store in (stores if x.dtype == torch.bfloat16 else stores[:1]):
            old_store, old_mode = tk.KERNELS["bf16_store"], tk.GUIDED_QDQ_MODE
            tk.KERNELS["bf16_store"] = store
            try:
                two = tk.dequantize(tk.quantize_guided(x, rec), x.dtype)  # dequantize always writes bf16 by "int"
                nb2 = int((two.view(_INT[x.dtype]) != rb).sum())
                tq_bad += nb2 > 0
                table.append((name, "triton Q then DQ", store, nb2, int((two.float() != ref.float()).sum()), codes_ok))
                for mode in MODES:
                    tk.GUIDED_QDQ_MODE = mode
                    out = tk.fake_quantize_guided(x, rec)
                    nb = int((out.view(_INT[x.dtype]) != rb).sum())
                    nv_ = int(((out.float() != ref.float()) & ~(out.isnan() & ref.isnan())).sum())
                    table.append((name, f"MODE {mode} {MODES[mode]}", store, nb, nv_, codes_ok))
                    if nb:
                        fails[mode] += 1
                        key = (mode, store)
                        if shown.get(key, 0) < args.details:
                            shown[key] = shown.get(key, 0) + 1
                            print(f"[MODE {mode} {MODES[mode]}, bf16 store {store}]")
                            dump(name, x, rec, out, ref)
            finally:
                tk.KERNELS["bf16_store"], tk.GUIDED_QDQ_MODE = old_store, old_mode
    print(f"\n{len(allc)} cases in {time.time() - t0:.1f} s. Columns: byte-diff = elements whose output bits differ "
          "from dequantize(quantize_guided) of the torch reference; value-diff = of those, the ones that differ "
          "as numbers (so byte-diff - value-diff = signed zeros); codes = triton quantize_guided packed == torch's")
    print(f"{'case':<48} {'variant':<30} {'store':<6} {'byte-diff':>9} {'value-diff':>10} codes")
    for name, var, store, nb, nv_, ok in table:
        print(f"{name:<48} {var:<30} {store:<6} {nb:>9} {nv_:>10} {'ok' if ok else 'DIFF'}")
    for m in MODES:
        print(f"VERDICT MODE {m} {MODES[m]}: " + ("bit-exact in every case" if fails[m] == 0 else
                                                  f"differs in {fails[m]} case/store combinations"))
    print(f"VERDICT triton quantize_guided codes: {'== torch in every case' if qg_bad == 0 else f'DIFFER in {qg_bad} cases'}; "
          f"triton Q then triton DQ: {'bit-exact' if tq_bad == 0 else f'bytes differ in {tq_bad} case/store combinations'}")
    return 1 if fails[1] else 0


if __name__ == "__main__":
    sys.exit(main())
