"""The torch reference against an independent oracle (vLLM's reference algorithm +
compressed-tensors' packer), bit for bit."""

import pytest
import torch

import verl_quads.nvfp4 as nv
from vllm_oracle import oracle_dequant, oracle_packed

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cases(dtype):
    g = torch.Generator().manual_seed(0)
    yield "normal", torch.randn(64, 256, generator=g).to(dtype)
    # heavy tails (student-t like) and outlier channels
    t = torch.randn(64, 256, generator=g) / torch.rand(64, 256, generator=g).clamp(min=1e-3).sqrt()
    t[:, 7] *= 300.0
    yield "heavy", t.clamp(-6e4, 6e4).to(dtype)
    # tiny and huge blocks side by side (scales underflow to E4M3 subnormals / zero)
    w = torch.randn(32, 128, generator=g)
    w[:, :16] *= 1e-6
    w[:, 16:32] *= 1e3
    w[:, 32:48] = 0.0
    yield "mixed_magnitude", w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_matches_vllm_reference_bit_exact(dtype):
    for name, x in _cases(dtype):
        gs = nv.global_scale_from_amax(x.abs().amax())
        q = nv.quantize(x, gs, backend="torch")
        packed, scale = oracle_packed(x, gs)
        assert torch.equal(q.block_scale.view(torch.uint8), scale.view(torch.uint8)), name
        assert torch.equal(q.packed, packed), name
        deq = nv.dequantize(q, dtype, backend="torch")
        assert torch.equal(deq, oracle_dequant(packed, scale, gs, *x.shape, dtype)), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_rounding_ties(dtype):
    # Block max 6 with global scale 448*6/6 makes the block scale exactly 448/... -> output scale 1,
    # so x itself is the scaled value: place every tie and its neighbours.
    ties = [0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.125]
    x = torch.tensor([ties, [-v for v in ties]], dtype=torch.float32)
    x[:, -1] = 6.0  # keep the block max at 6 in both rows
    x = x.to(dtype)
    gs = torch.tensor(448.0, dtype=torch.float32)  # scale = 448 * 6/6 = 448 -> output_scale = 1
    q = nv.quantize(x, gs, backend="torch")
    got = nv.dequantize(q, torch.float32, backend="torch")
    want_pos = [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0]
    assert got[0].tolist() == want_pos
    assert got[1].tolist() == [-v for v in want_pos[:-1]] + [6.0]
    packed, scale = oracle_packed(x, gs)
    assert torch.equal(q.packed, packed)


def test_packing_order_and_negative_zero():
    # element 2i in the low nibble; a negative value rounding to zero keeps its sign bit (code 8)
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1], x[0, 2], x[0, 15] = 6.0, -3.0, -0.1, 0.5
    q = nv.quantize(x, torch.tensor(448.0), backend="torch")
    codes = nv.unpack_codes(q.packed)[0].tolist()
    assert codes[:3] == [7, 8 | 5, 8 | 0]
    assert codes[15] == 1
    assert q.packed[0, 0].item() == (7 | ((8 | 5) << 4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_tensor(dtype):
    x = torch.zeros(3, 32, dtype=dtype)
    q = nv.quantize(x, backend="torch")
    assert q.global_scale.item() == 1.0
    assert torch.isfinite(q.block_scale.float()).all() and (q.block_scale.float() == 0).all()
    assert (q.packed == 0).all()
    out = nv.fake_quantize(x, backend="torch")
    assert out.dtype == dtype and torch.equal(out, x)


def test_leading_dims_and_per_expert_scales():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 8, 64, generator=g, dtype=torch.float32).to(torch.bfloat16)
    w[2] *= 50
    gs = nv.global_scale_from_amax(w.abs().amax(dim=(1, 2), keepdim=True))  # [4, 1, 1]
    q = nv.quantize(w, gs, backend="torch")
    assert q.packed.shape == (4, 8, 32) and q.block_scale.shape == (4, 8, 4)
    for e in range(4):
        qe = nv.quantize(w[e], gs[e, 0, 0], backend="torch")
        assert torch.equal(q.packed[e], qe.packed)
        assert torch.equal(q.block_scale[e].view(torch.uint8), qe.block_scale.view(torch.uint8))
    # per row [..., 1]
    x = torch.randn(5, 3, 32, generator=g)
    gs_row = nv.global_scale_from_amax(x.abs().amax(-1, keepdim=True))
    q = nv.quantize(x, gs_row, backend="torch")
    packed, scale = oracle_packed(x.reshape(15, 32), gs_row.reshape(15, 1))
    assert torch.equal(q.packed.reshape(15, 16), packed)


@pytest.mark.parametrize(
    "x, msg",
    [
        (torch.tensor([[float("nan")] + [0.0] * 15]), "NaN"),
        (torch.tensor([[float("inf")] + [0.0] * 15]), "Inf"),
        (torch.zeros(2, 24), "divisible by 16"),
        (torch.zeros(2, 16, dtype=torch.int32), "dtype"),
    ],
)
def test_bad_input_is_a_clear_error(x, msg):
    with pytest.raises(ValueError, match=msg) as e:
        nv.quantize(x, backend="torch")
    assert str(tuple(x.shape)) in str(e.value)


def test_check_finite_can_be_skipped_explicitly():
    x = torch.zeros(1, 16)
    nv.quantize(x, check_finite=False, backend="torch")


def test_fake_quantize_is_idempotent_and_dtype_preserving():
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    y = nv.fake_quantize(x, backend="torch")
    gs = nv.global_scale_from_amax(x.abs().amax())
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(nv.fake_quantize(y, gs, backend="torch"), y)


def test_ste_gradient_is_identity_and_forward_is_qdq():
    x = torch.randn(8, 32, requires_grad=True)
    y = nv.fake_quantize_ste(x, backend="torch")
    assert torch.equal(y.detach(), nv.fake_quantize(x.detach(), backend="torch"))
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_nbytes_is_4_5_bits_per_element_plus_scale():
    q = nv.quantize(torch.randn(128, 256), backend="torch")
    assert q.nbytes == 128 * 256 // 2 + 128 * 256 // 16 + 4
