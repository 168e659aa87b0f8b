"""Dense NVFP4 GEMM through decoded block values + a float32-output matmul (verl_quads/nvfp4/dequant_gemm.py).

``block_values`` must equal the core's reference dequantization with a global scale of 1 bit for bit (the values
are exact in bf16 / fp16 / float32); the GEMM is checked against the rollout's torch reference with the bound of
tests/unit/test_nvfp4_gemm.py (1 ulp of the output dtype + the float32 summation bound). On CPU the two Triton
kernels run under TRITON_INTERPRET=1 and the matmul is a float32 torch.mm of the same exact values; the cuBLAS
``out_dtype=float32`` call runs in tests/gpu/test_dequant_gemm_gpu.py on the H200.
"""

import os
import sys

import pytest
import torch

from verl_quads.nvfp4 import moe_routing as mr
from verl_quads.nvfp4 import triton_gemm as tg
from verl_quads.nvfp4.dequant_gemm import DequantConfig, block_values, dequant_dense_config, dequant_min_rows
from verl_quads.nvfp4.format import NVFP4Tensor
from verl_quads.nvfp4.reference import dequantize_to_float32
from verl_quads.rollout import emulation as em

sys.path.insert(0, os.path.dirname(__file__))
from test_nvfp4_gemm import DEV, _reference, _ulps, _w, _x  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (scripts/test.sh sets it on CPU)",
)


def _ref_values(packed, scale, dtype):
    one = torch.ones((), dtype=torch.float32, device=packed.device)
    q = NVFP4Tensor(packed, scale, one, torch.Size((packed.shape[0], packed.shape[1] * 2)), torch.float32)
    return dequantize_to_float32(q).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("r, k", [(37, 112), (16, 512), (5, 272)])
def test_block_values_are_exact(dtype, r, k):
    """Every code with every non-NaN positive E4M3 scale byte (0 .. 126, incl. subnormals and 448): the decoded
    values equal the reference's code * scale (global scale 1) in bf16, fp16 and float32, bit for bit."""
    g = torch.Generator().manual_seed(r * k)
    packed = torch.randint(0, 256, (r, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 127, (r, k // 16), generator=g, dtype=torch.uint8)
    scale[0, : min(k // 16, 2)] = torch.tensor([126, 1], dtype=torch.uint8)[: min(k // 16, 2)]  # 448 and 2**-9
    packed, scale = packed.to(DEV), scale.view(torch.float8_e4m3fn).to(DEV)
    got = block_values(packed, scale, dtype)
    want = _ref_values(packed, scale, dtype)
    assert got.dtype == dtype and got.shape == (r, k)
    assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))  # -0.0 included
    # a row slice (the chunked GEMM's input) decodes the same rows
    assert torch.equal(block_values(packed[3:], scale[3:], dtype), got[3:])


CASES = [
    # (M, N, K, mode, dtype, bias, scratch_bytes): scratch 1 byte -> 128-row weight chunks (the minimum)
    (3, 300, 64, "w4a16", torch.bfloat16, True, 1),
    (9, 130, 112, "w4a16", torch.float16, False, 1),
    (33, 48, 208, "w4a16", torch.bfloat16, False, 64 << 20),
    (5, 260, 96, "naive", torch.bfloat16, True, 1),
    (7, 40, 96, "trace", torch.float16, False, 64 << 20),
    (4, 200, 64, "quads", torch.bfloat16, True, 1),  # residual_combine bf16: a w4a16 operand
]


@pytest.mark.parametrize("m, n, k, mode, dtype, with_bias, scratch", CASES)
def test_dequant_gemm_matches_reference(m, n, k, mode, dtype, with_bias, scratch):
    x = _x(m, k, dtype)
    q_w = em.quantize_weight(_w((n, k)))
    gs = q_w.global_scale.reshape(())
    bias = (_w((n,), seed=3) * 10).to(dtype) if with_bias else None
    combine = "bf16" if mode == "quads" else "fp4x2"
    act, _ = tg.quantize_activation(x, mode, residual_combine=combine, residual_granularity="block")
    cfg = DequantConfig(scratch_bytes=scratch)
    assert cfg.chunk_rows(m, n, k) < n or scratch > 1
    y = tg.nvfp4_gemm(act, q_w.packed, q_w.block_scale, gs, bias, config=cfg)
    if mode == "quads":  # the reference of the bf16 operand: the core's QDQ form times the weight
        xf = act.values.float()
        wf = em.weight_f32(q_w.packed, q_w.block_scale, gs)
        ref = em.gemm(xf, wf, bias, dtype)
        bound = 4 * k * torch.finfo(torch.float32).eps * (xf.abs() @ wf.abs().t())
    else:
        ref, bound = _reference(x, q_w, mode, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    ulps, ok = _ulps(y, ref, bound)
    print(f"dequant GEMM {mode} {dtype} M={m} N={n} K={k} chunk {cfg.chunk_rows(m, n, k)}: {ulps:.2f} ulp")
    assert ok, f"max diff {ulps:.2f} ulp"
    # one code changed in the LAST chunk's last row must be seen, and only in that column
    bad = q_w.packed.clone()
    bad[n - 1, 0] ^= 0x07
    y_bad = tg.nvfp4_gemm(act, bad, q_w.block_scale, gs, bias, config=cfg)
    assert not _ulps(y_bad, ref, bound)[1]
    assert torch.equal(y_bad[:, : n - 1], y[:, : n - 1])


def test_chunk_rows():
    cfg = DequantConfig(scratch_bytes=64 << 20)
    assert cfg.chunk_rows(1, 8192, 8192) == 4096  # 64 MiB of bf16 rows of 8192
    assert cfg.chunk_rows(16384, 8192, 8192) == 1024  # float32 [16384, 1024] = 64 MiB
    assert cfg.chunk_rows(4096, 100, 4096) == 100  # never more than N
    assert DequantConfig(scratch_bytes=1).chunk_rows(1, 1000, 4096) == 128  # at least 128 rows


def test_refusals_are_clear():
    x = _x(4, 64)
    q_w = em.quantize_weight(_w((32, 64)))
    gs = q_w.global_scale.reshape(())
    cfg = DequantConfig()
    with pytest.raises(ValueError, match="bf16 / fp16"):
        tg.nvfp4_gemm(tg.quantize_activation(x.float(), "w4a16")[0], q_w.packed, q_w.block_scale, gs, config=cfg)
    fp4x2, _ = tg.quantize_activation(x, "quads", residual_combine="fp4x2", residual_granularity="block")
    with pytest.raises(ValueError, match="second FP4 operand"):
        tg.nvfp4_gemm(fp4x2, q_w.packed, q_w.block_scale, gs, config=cfg)
    with pytest.raises(ValueError, match="scratch_bytes"):
        tg.nvfp4_gemm(tg.quantize_activation(x, "w4a16")[0], q_w.packed, q_w.block_scale, gs,
                      config=DequantConfig(scratch_bytes=0))
    with pytest.raises(TypeError, match="DequantConfig"):
        tg.nvfp4_gemm(tg.quantize_activation(x, "w4a16")[0], q_w.packed, q_w.block_scale, gs, config="dequant")
    with pytest.raises(ValueError, match="block_scale"):
        block_values(q_w.packed, q_w.block_scale[:, :2], torch.bfloat16)
    routing = mr.moe_align_reference(torch.zeros(4, 1, dtype=torch.int32, device=DEV), 1, 16)
    with pytest.raises(ValueError, match="dense GEMMs only"):
        tg.nvfp4_gemm(tg.quantize_activation(x, "w4a16")[0], q_w.packed[None], q_w.block_scale[None],
                      q_w.global_scale.reshape(1), routing=routing, config=cfg)


def test_default_dispatch_needs_cuda():
    """Off CUDA (here: the interpreter on CPU) the default dispatch never picks this path."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only check; the CUDA dispatch is tested in tests/gpu/test_dequant_gemm_gpu.py")
    act, _ = tg.quantize_activation(_x(4096, 64), "w4a16")
    assert dequant_dense_config(act, torch.zeros(32, 32, dtype=torch.uint8)) is None


def test_min_rows_rule_lookup():
    """The first (weight elements, rows) pair the weight reaches decides; unmeasured GPUs never take the path."""
    assert dequant_min_rows("w4a16", 8192, 8192, (9, 0)) == 512  # 67 M elements >= 48 Mi
    assert dequant_min_rows("w4a16", 4096, 4096, (9, 0)) == 128
    assert dequant_min_rows("a4", 2048, 4096, (9, 0)) == 256
    assert dequant_min_rows("w4a16", 4096, 4096, (8, 0)) is None
