import pytest
import torch

import verl_quads.nvfp4 as nv


def test_swizzle_roundtrip_and_tile_layout():
    m, k = 200, 16 * 12  # pads rows to 256 and scale columns 12 -> 12
    scale = (torch.rand(m, k // 16) * 400).to(torch.float8_e4m3fn)
    sw = nv.swizzle_block_scale(scale)
    assert sw.shape == (256, 12)
    assert torch.equal(nv.unswizzle_block_scale(sw, m, k).view(torch.uint8), scale.view(torch.uint8))
    # hand-checked position: row r, scale column c lands at flat offset
    # (r // 128) * (128 * kp) + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    flat = sw.view(torch.uint8).flatten()
    kp = 12
    for r, c in [(0, 0), (5, 3), (33, 1), (127, 11), (130, 6), (199, 9)]:
        off = (r // 128) * (128 * kp) + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
        assert flat[off] == scale.view(torch.uint8)[r, c]


def test_swizzle_keeps_expert_dim():
    scale = (torch.rand(3, 130, 5) * 100).to(torch.float8_e4m3fn)
    sw = nv.swizzle_block_scale(scale)
    assert sw.shape == (3, 256, 8)
    assert torch.equal(nv.unswizzle_block_scale(sw, 130, 80).view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(nv.swizzle_block_scale(scale[1]).view(torch.uint8), sw[1].view(torch.uint8))


def test_compressed_tensors_convention_roundtrip_and_their_unpacker():
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    w = torch.randn(48, 64, dtype=torch.bfloat16)
    q = nv.quantize(w, backend="torch")
    sd = nv.to_compressed_tensors(q, "model.layers.0.mlp.down_proj")
    assert set(sd) == {
        "model.layers.0.mlp.down_proj.weight_packed",
        "model.layers.0.mlp.down_proj.weight_scale",
        "model.layers.0.mlp.down_proj.weight_global_scale",
    }
    assert sd["model.layers.0.mlp.down_proj.weight_global_scale"].shape == (1,)
    back = nv.from_compressed_tensors(sd, "model.layers.0.mlp.down_proj")
    assert torch.equal(back.packed, q.packed) and torch.equal(back.global_scale, q.global_scale)
    # compressed-tensors' own decode of our packing: value * scale / global_scale
    vals = unpack_fp4_from_uint8(q.packed, 48, 64, dtype=torch.float32)
    theirs = (vals.reshape(48, 4, 16) * (q.block_scale.float() / q.global_scale).unsqueeze(-1)).reshape(48, 64)
    assert torch.equal(theirs.to(torch.bfloat16), nv.dequantize(q, torch.bfloat16, backend="torch"))


def test_modelopt_convention_stores_the_inverse_scale():
    w = torch.randn(16, 32)
    q = nv.quantize(w, backend="torch")
    sd = nv.to_modelopt(q, "p")
    assert torch.equal(sd["p.weight"], q.packed)
    assert sd["p.weight_scale_2"].item() == pytest.approx(w.abs().amax().item() / 2688.0, rel=1e-6)
    back = nv.from_modelopt(sd, "p", torch.float32)
    assert torch.equal(back.packed, q.packed)
    assert back.global_scale.item() == pytest.approx(q.global_scale.item(), rel=2e-7)
