"""The MoE layer's decode kernels (verl_quads/nvfp4/moe_routing.py and triton_gemm.py, issue #5): moe_align with no
slot (no launch; its one launch at decode sizes is counted in
test_moe_align_one_launch.py::test_moe_align_dispatch_is_one_launch; the register kernel that took S <= 16 slots until
session 12 tied it on the H200 and is gone), the gate ``moe_silu_mul`` and the router-weighted combine
``moe_combine``, each one launch.

On CPU under TRITON_INTERPRET=1 at small shapes. The routing is compared with torch.equal against the torch
reference (``moe_align_reference``). The gate's exp under the interpreter is numpy's float32 exp (libdevice
cannot run there), so the gate is bit-exact against the same formula in numpy (``g / (1 + exp(-g)) * u`` in
float32, IEEE division, one cast) and within a stated tolerance of torch's CPU silu (whose vectorized exp
differs from numpy's by an ulp in ~1/6 of the float32 values). Bit-identity to torch's CUDA silu is tested on
the H200 (tests/gpu/test_nvfp4_gemm_gpu.py::test_moe_silu_mul_bit_identical_to_torch_cuda).
"""

import os
import sys

import numpy as np
import pytest
import torch

from verl_quads.nvfp4 import moe_routing as mr
from verl_quads.nvfp4 import triton_gemm as tg

sys.path.insert(0, os.path.dirname(__file__))
from moe_routing import ALIGN_KERNELS, spy_align  # noqa: E402
from sm90_compile import compile_for_sm90_in_subprocess  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (scripts/test.sh sets it on CPU)",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
FIELDS = ("sorted_slots", "tile_expert", "tile_row0", "tile_row1", "sorted_tokens")


def test_moe_align_no_slots_launches_nothing(monkeypatch):
    """S == 0 (no token): empty int32 outputs on the ids' device, no launch; == the reference."""
    spies = spy_align(monkeypatch)
    ids = torch.empty(0, 8, dtype=torch.int64, device=DEV)
    got, ref = mr.moe_align(ids, 128, 16), mr.moe_align_reference(ids, 128, 16)
    assert [spies[n].launches for n in ALIGN_KERNELS] == [0, 0, 0]
    for f in FIELDS:
        t = getattr(got, f)
        assert t.numel() == 0 and t.dtype == torch.int32 and t.device == ids.device, f
        assert torch.equal(t, getattr(ref, f)), f


def _gate_h(s, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(s, 2 * inter, generator=g) * torch.exp2(torch.randint(-10, 10, (s, 2 * inter), generator=g).float())
    # signed zeros, |h| where exp(-g) overflows / underflows, large magnitudes
    h[0, :12] = torch.tensor([-0.0, 0.0, -100.0, 100.0, -88.5, 88.5, -87.5, 87.5, -20.0, 20.0, 3e4, -3e4])
    h[1, inter: inter + 4] = torch.tensor([-0.0, 0.0, -0.0, 6e4])
    return h.to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_moe_silu_mul_matches_the_formula_and_torch(dtype):
    """``moe_silu_mul`` == ``(g / (1 + exp(-g)) * u)`` computed in numpy float32 (IEEE division; the
    interpreter's exp IS numpy's float32 exp) cast once: bit-exact (signed zeros included). Against torch's
    CPU expression ``(silu(g.float()) * u.float()).to(dtype)``: bf16 / fp16 within 1 ulp of the output dtype
    and >= 99% bit-equal; float32 within 4 float32 ulps (torch's CPU exp is another 1-ulp implementation)."""
    s, inter = 7, 80  # 80 columns: two programs of 64, the second masked
    h = _gate_h(s, inter, dtype)
    a = tg.moe_silu_mul(h)
    assert a.dtype == dtype and a.shape == (s, inter)
    g = h[:, :inter].float().cpu().numpy()
    u = h[:, inter:].float().cpu().numpy()
    with np.errstate(over="ignore"):
        formula = torch.from_numpy(g / (np.float32(1.0) + np.exp(-g)) * u).to(dtype)
    assert torch.equal(a.cpu(), formula)
    assert torch.equal(torch.signbit(a.cpu().float()), torch.signbit(formula.float()))
    ref = (torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()).to(dtype).cpu()
    r = ref.float()
    d = torch.where(a.cpu() == ref, 0.0, (a.cpu().float() - r).abs())  # equal infinities: 0
    eps = torch.finfo(dtype).eps * (4 if dtype == torch.float32 else 1)
    ulp = torch.where(r.abs() > 0, 2.0 ** torch.floor(torch.log2(r.abs().clamp(min=1e-38))) * eps,
                      torch.full_like(r, torch.finfo(dtype).tiny))
    assert bool((d <= ulp).all()), float((d / ulp).max())
    equal = float((a.cpu() == ref).float().mean())
    print(f"moe_silu_mul {dtype}: {equal:.2%} bit-equal to torch's CPU silu expression")
    if dtype != torch.float32:
        assert equal >= 0.99


def test_moe_silu_mul_rejects_bad_input():
    with pytest.raises(ValueError, match=r"h must be \[S, 2I\]"):
        tg.moe_silu_mul(torch.zeros(3, 5, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="dtype"):
        tg.moe_silu_mul(torch.zeros(3, 4, dtype=torch.float64, device=DEV))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_combine_fixed_order_and_torch_bound(dtype):
    """``moe_combine`` sums a token's k slots in float32 in the order j = 0..k-1: under the interpreter
    (separate multiply and add, no FMA) bit-exact to that loop written in torch, then one cast; within the
    float32 summation bound of torch's ``(y.reshape(T, k, H).float() * w[..., None]).sum(1)``; the same
    bits run to run. A slot of no local expert (row of zeros) contributes 0."""
    t, k, hidden = 3, 8, 72  # 72 columns: two programs of 64, the second masked
    g = torch.Generator().manual_seed(1)
    y = (torch.randn(t * k, hidden, generator=g) * 4).to(dtype)
    y[5] = 0  # token 0, slot 5: not local
    w = torch.rand(t, k, generator=g)
    y, w = y.to(DEV), w.to(DEV)
    out = tg.moe_combine(y, w)
    assert out.dtype == dtype and out.shape == (t, hidden)
    assert torch.equal(out, tg.moe_combine(y, w))
    yf = y.float().reshape(t, k, hidden)
    if not torch.cuda.is_available():
        acc = torch.zeros(t, hidden, device=DEV)
        for j in range(k):
            acc = acc + yf[:, j] * w[:, j: j + 1]
        assert torch.equal(out, acc.to(dtype))
    ref = (yf * w.unsqueeze(-1)).sum(1)
    bound = 2 * k * torch.finfo(torch.float32).eps * (yf.abs() * w.unsqueeze(-1)).sum(1)
    r, d = ref.to(dtype).float(), (out.float() - ref).abs()
    half_ulp = torch.where(r.abs() > 0, 2.0 ** torch.floor(torch.log2(r.abs().clamp(min=1e-38))), 0.0) * (
        torch.finfo(dtype).eps / 2)
    assert bool((d <= half_ulp * 2 + bound).all())


def test_moe_combine_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"y must be \[T\*k, H\]"):
        tg.moe_combine(torch.zeros(5, 8, device=DEV), torch.zeros(2, 2, device=DEV))


def test_unrouted_slots_are_not_read():
    """With ``slot_experts``, rows of slots whose expert id is < 0 are not read (moe_forward leaves them unset:
    no zero-fill launches): NaN there changes nothing; the result == the one from all-zero rows without ids."""
    ids = torch.tensor([[0, -1], [2, 1], [-1, -1]], device=DEV)
    inter, hidden = 40, 24
    g = torch.Generator().manual_seed(5)
    h = torch.randn(6, 2 * inter, generator=g).to(torch.bfloat16).to(DEV)
    h[ids.reshape(-1) < 0] = 0
    h_nan = h.clone()
    h_nan[ids.reshape(-1) < 0] = float("nan")
    assert torch.equal(tg.moe_silu_mul(h_nan, ids), tg.moe_silu_mul(h))
    assert not tg.moe_silu_mul(h_nan, ids)[ids.reshape(-1) < 0].any()
    y = torch.randn(6, hidden, generator=g).to(torch.bfloat16).to(DEV)
    y[ids.reshape(-1) < 0] = 0
    y_nan = y.clone()
    y_nan[ids.reshape(-1) < 0] = float("nan")
    w = torch.rand(3, 2, generator=g).to(DEV)
    assert torch.equal(tg.moe_combine(y_nan, w, ids), tg.moe_combine(y, w))
    with pytest.raises(ValueError, match="slot_experts"):
        tg.moe_combine(y, w, ids[:2])


@pytest.mark.parametrize("mode", ["w4a16", "naive"])
def test_moe_forward_equals_its_zero_filled_composition(mode):
    """moe_forward (GEMM outputs' unrouted rows unset, the gate/combine skip them) == the same steps with
    zero-filled GEMM outputs and no ids (the previous composition), bit for bit, with slots of no local expert."""
    from verl_quads.rollout import emulation as em

    t, k, e, hidden, inter = 3, 2, 4, 64, 32
    g = torch.Generator().manual_seed(2)
    x = torch.randn(t, hidden, generator=g).to(torch.bfloat16).to(DEV)
    q13 = em.quantize_weight((torch.randn(e, 2 * inter, hidden, generator=g) * 0.05).to(DEV), reduce_dims=(1, 2))
    q2 = em.quantize_weight((torch.randn(e, hidden, inter, generator=g) * 0.05).to(DEV), reduce_dims=(1, 2))
    w13 = (q13.packed, q13.block_scale, q13.global_scale.reshape(-1))
    w2 = (q2.packed, q2.block_scale, q2.global_scale.reshape(-1))
    ids = torch.tensor([[1, -1], [3, 0], [-1, 1]], device=DEV)
    sw = torch.rand(t, k, generator=g).to(DEV)
    got = tg.moe_forward(x, sw, ids, *w13, *w2, mode)
    routing = mr.moe_align(ids, e, tg.grouped_block_m(-(-t * k // min(e, t * k))))
    op1, _ = tg.quantize_activation(x, mode)
    h = tg.nvfp4_gemm(op1, *w13, routing=routing, a_rows=routing.sorted_tokens, out_rows=t * k)
    assert not h[ids.reshape(-1) < 0].any()  # the default still zero-fills
    op2, _ = tg.quantize_activation(tg.moe_silu_mul(h), mode)
    y = tg.nvfp4_gemm(op2, *w2, routing=routing, out_rows=t * k)
    assert torch.equal(got, tg.moe_combine(y, sw))


_SM90_MOE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from verl_quads.nvfp4 import moe_routing as mr
from verl_quads.nvfp4 import triton_gemm as tg

def comp(fn, sig, const, nw):
    attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(sig) if sig[nm][0] == "*"}
    full = dict(sig, **{c: "constexpr" for c in const})
    return triton.compile(ASTSource(fn=fn, signature=full, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})

ptrs = {p: "*i32" for p in ("ids_ptr", "te_ptr", "tr0_ptr", "tr1_ptr", "sorted_ptr", "tok_ptr")}
ints = {n: "i32" for n in ("S", "E", "TOPK", "T_MAX", "P")}
for s, ep in ((8, 128), (16, 256), (8, 512)):  # decode M=1 / M=2 (8 / 16 slots) at 128 / 256 / 512 experts
    t_max, nq = -(-s // 16) + min(ep, s), ep // 16  # as _moe_align_one_launch (eb 16) at block_m 16
    k = comp(mr._moe_align_fused_kernel, dict(ptrs, **ints),
             dict(SP=16, C=mr._moe_align_chunk(s), EP=ep, BM=16, EB=16, MT=2,
                  TD=max(16, triton.next_power_of_2(-(-t_max // nq)))), 8)
    assert k.asm["cubin"] and "ld.global" in k.asm["ptx"]
for dt, code in (("bf16", 3), ("fp16", 2), ("fp32", 0)):
    out = "*i16" if dt == "bf16" else "*" + dt
    k = comp(tg._moe_silu_mul_kernel, {"h_ptr": "*" + dt, "out_ptr": out, "ids_ptr": "*i64", "I": "i32",
                                       "H_STRIDE": "i32"}, dict(BLOCK=1024, OUT=code, ACC_EXP=True, IDS=True), 4)
    # libdevice's expf (range reduction + ex2.approx of the reduced argument) and IEEE division
    assert k.asm["cubin"] and "div.rn.f32" in k.asm["ptx"] and "ex2.approx" in k.asm["ptx"], dt
    k = comp(tg._moe_combine_kernel, {"y_ptr": "*" + dt, "w_ptr": "*fp32", "out_ptr": out, "ids_ptr": "*i32",
                                      "H": "i32"}, dict(TOPK=8, BLOCK=1024, OUT=code, IDS=True), 4)
    assert k.asm["cubin"], dt
print("compiled")
"""


def test_moe_decode_kernels_compile_for_sm90_without_a_gpu():
    """moe_align's one launch at decode sizes, the gate (libdevice expf: GPU only, the interpreter takes tl.exp)
    and the combine compile for sm_90 with triton's bundled ptxas (subprocess without TRITON_INTERPRET). Compiles
    only."""
    compile_for_sm90_in_subprocess(
        _SM90_MOE, "on a GPU the kernels are compiled and run by tests/gpu/test_nvfp4_gemm_gpu.py")
