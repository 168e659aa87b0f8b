"""``verl-quads export``: compressed-tensors NVFP4 checkpoint of the embedded model.

Checked with compressed-tensors 0.17's own code (its ``NVFP4PackedCompressor.decompress`` and its
``QuantizationConfig`` parser), against verl-quads' NVFP4 core (``nvfp4.fake_quantize``) with the
shared global scales computed here (q/k/v one, gate/up one per expert, down one per expert), and
against the packed weight sync (``pack_for_rollout``): the export read back as a sync stream is the
sync stream, tensor for tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from verl_quads import nvfp4
from verl_quads.config import QuantConfig
from verl_quads.sync.export import (
    EXPORT_META,
    ExportError,
    export_checkpoint,
    export_to_sync_stream,
    main,
    meta_model,
)
from verl_quads.sync.format import HEADER_NAME, decode_header

ct = pytest.importorskip("compressed_tensors")
ASSET = Path(__file__).resolve().parents[2] / "verl_quads" / "assets" / "tiny_math_moe"
LAYERS, EXPERTS = 4, 8


def _src() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(ASSET / "model.safetensors"))


def _shared_gs(*ws: torch.Tensor) -> torch.Tensor:
    """Encode scale 448*6/amax over a group of bf16 weights (computed here, not by the exporter)."""
    amax = max(float(w.to(torch.bfloat16).float().abs().max()) for w in ws)
    return nvfp4.global_scale_from_amax(torch.tensor(amax, dtype=torch.float32))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "tiny_nvfp4"
    res = export_checkpoint(ASSET, out, QuantConfig(quant="quads"), keep_effective=True)
    return out, res


def _ct_module(out: Path, prefix: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        return {k[len(prefix) + 1 :]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix + ".weight_")}


def _ct_decompress(out: Path, prefix: str) -> torch.Tensor:
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(qc["config_groups"]["group_0"])
    sd = _ct_module(out, prefix)
    assert set(sd) == {"weight_packed", "weight_scale", "weight_global_scale"}, (prefix, sorted(sd))
    assert sd["weight_packed"].dtype == torch.uint8 and sd["weight_scale"].dtype == torch.float8_e4m3fn
    assert sd["weight_global_scale"].dtype == torch.float32 and sd["weight_global_scale"].shape == (1,)
    return NVFP4PackedCompressor.decompress(sd, scheme)["weight"]


def test_round_trip_compressed_tensors_decompressor_equals_core_fake_quantize(exported):
    out, _ = exported
    src = _src()
    checked = 0
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        qkv = [src[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"]
        gs = _shared_gs(*qkv)
        for n, w in zip("qkv", qkv):
            got = _ct_decompress(out, f"{p}.self_attn.{n}_proj")
            want = nvfp4.fake_quantize(w.to(torch.bfloat16), gs, backend="torch")
            assert got.dtype == want.dtype and torch.equal(got, want), f"{p}.self_attn.{n}_proj"
            checked += 1
        o = src[f"{p}.self_attn.o_proj.weight"]
        assert torch.equal(_ct_decompress(out, f"{p}.self_attn.o_proj"), nvfp4.fake_quantize(o, _shared_gs(o), backend="torch"))
        checked += 1
        for e in range(EXPERTS):
            ep = f"{p}.mlp.experts.{e}"
            g, u, d = (src[f"{ep}.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
            gs_e = _shared_gs(g, u)
            for n, w in (("gate_proj", g), ("up_proj", u)):
                assert torch.equal(_ct_decompress(out, f"{ep}.{n}"), nvfp4.fake_quantize(w, gs_e, backend="torch")), f"{ep}.{n}"
            assert torch.equal(_ct_decompress(out, f"{ep}.down_proj"), nvfp4.fake_quantize(d, _shared_gs(d), backend="torch"))
            checked += 3
    assert checked == LAYERS * (4 + 3 * EXPERTS)


def test_round_trip_equals_trainer_qat_effective_weights(exported):
    """The trainer's own QAT forward weights (apply_qat on the real HF model) decompress out of the export."""
    from transformers import AutoModelForCausalLM

    from verl_quads.qat import apply_qat

    out, _ = exported
    model = AutoModelForCausalLM.from_pretrained(str(ASSET), dtype=torch.bfloat16)
    apply_qat(model, QuantConfig(quant="quads"), backend="torch")
    layer = model.model.layers[1]
    q = layer.self_attn.q_proj
    from verl_quads.qat.weights import linear_global_scale, qdq_linear_weight

    gs = linear_global_scale([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
    assert torch.equal(_ct_decompress(out, "model.layers.1.self_attn.q_proj"), qdq_linear_weight(q.weight, gs, "torch").detach())
    experts = layer.mlp.experts
    qw = experts._qdq_weights()  # the QAT forward's fused expert weights [E, 2I, H] / [E, H, I]
    inter = qw["down_proj"].shape[-1]
    for e in (0, 5):
        assert torch.equal(_ct_decompress(out, f"model.layers.1.mlp.experts.{e}.gate_proj"), qw["gate_up_proj"][e, :inter].detach())
        assert torch.equal(_ct_decompress(out, f"model.layers.1.mlp.experts.{e}.up_proj"), qw["gate_up_proj"][e, inter:].detach())
        assert torch.equal(_ct_decompress(out, f"model.layers.1.mlp.experts.{e}.down_proj"), qw["down_proj"][e].detach())


def test_config_parses_with_compressed_tensors(exported):
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    out, res = exported
    cfg = json.loads((out / "config.json").read_text())
    qc = QuantizationConfig.model_validate(cfg["quantization_config"])
    assert qc.quant_method == "compressed-tensors" and qc.format == "nvfp4-pack-quantized"
    assert qc.quantization_status == "compressed"
    group = qc.config_groups["group_0"]
    preset = preset_name_to_scheme("NVFP4A16", ["Linear"])
    assert group.weights == preset.weights and group.input_activations is None and group.targets == ["Linear"]
    # ignore = the 2-D weight modules QuantConfig.ignore keeps BF16 (embeddings, lm_head, routers)
    want = ["lm_head", "model.embed_tokens"] + [f"model.layers.{i}.mlp.gate" for i in range(LAYERS)]
    assert sorted(qc.ignore) == sorted(want) == sorted(res.ignore)
    # vLLM's parser accepts it and recognises the NVFP4 (W4A16) scheme
    vllm = pytest.importorskip("vllm")  # noqa: F841
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    vc = CompressedTensorsConfig.from_config(cfg["quantization_config"])
    assert CompressedTensorsConfig._is_nvfp4_format(vc.target_scheme_map["Linear"]["weights"])
    assert vc.target_scheme_map["Linear"]["input_activations"] is None


def test_untouched_tensors_and_files(exported):
    out, res = exported
    src = _src()
    from safetensors.torch import load_file

    got = load_file(str(out / "model.safetensors"))
    for n, t in src.items():
        if ".mlp.experts." in n or any(f"self_attn.{p}_proj.weight" in n for p in "qkvo"):
            assert n not in got
        else:
            assert torch.equal(got[n], t), n
    assert all(got[k].dtype == torch.uint8 for k in got if k.endswith("weight_packed"))
    assert (out / "tokenizer.json").read_bytes() == (ASSET / "tokenizer.json").read_bytes()
    meta = json.loads((out / EXPORT_META).read_text())
    assert meta["quant_config"]["quant"] == "quads" and 0.28 < meta["stats"]["quantized_ratio"] < 0.29


def test_export_read_back_is_the_packed_sync_stream(exported):
    """export_to_sync_stream(export) == pack_for_rollout(trainer weights), name for name, bit for bit."""
    from transformers import AutoModelForCausalLM

    from verl_quads.qat import apply_qat
    from verl_quads.sync.trainer import pack_for_rollout, plan_from_model

    out, _ = exported
    model = AutoModelForCausalLM.from_pretrained(str(ASSET), dtype=torch.float32)  # fp32 master weights
    apply_qat(model, QuantConfig(quant="quads"), backend="torch")
    sync = dict(pack_for_rollout(model.state_dict().items(), plan_from_model(model), torch.bfloat16, backend="torch"))
    back = dict(export_to_sync_stream(out))
    assert decode_header(back.pop(HEADER_NAME)) == decode_header(sync.pop(HEADER_NAME))
    packed = [n for n in sync if "weight_packed" in n or "weight_scale" in n or "weight_global_scale" in n]
    assert len(packed) == LAYERS * (2 * 3 + 2 * 3)
    for n in packed:
        assert back[n].dtype == sync[n].dtype and torch.equal(back[n].reshape(-1).view(torch.uint8), sync[n].reshape(-1).view(torch.uint8)), n
        assert back[n].shape == sync[n].shape, n
    # the unquantized tensors: same values (the checkpoint's bf16 vs the fp32 master cast to bf16)
    for n, t in sync.items():
        if n not in packed:
            assert torch.equal(back[n], t.to(back[n].dtype)), n


def test_verl_checkpoint_layouts(tmp_path):
    hf = tmp_path / "global_step_3" / "actor" / "huggingface"
    shutil.copytree(ASSET, hf)
    res = export_checkpoint(tmp_path / "global_step_3", tmp_path / "out")
    assert len(res.quantized_modules) == 2 * LAYERS + LAYERS
    fsdp = tmp_path / "global_step_4" / "actor"
    fsdp.mkdir(parents=True)
    (fsdp / "model_world_size_2_rank_0.pt").write_bytes(b"")
    (fsdp / "huggingface").mkdir()
    shutil.copy(ASSET / "config.json", fsdp / "huggingface" / "config.json")
    with pytest.raises(ExportError, match="verl.model_merger merge --backend fsdp"):
        export_checkpoint(tmp_path / "global_step_4", tmp_path / "out2")


def _copy_with(tmp_path: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    d = tmp_path / "src"
    shutil.copytree(ASSET, d)
    sd = load_file(str(d / "model.safetensors"))
    edit(sd)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_bad_inputs_fail_naming_the_tensor(tmp_path):
    def nan(sd):
        sd["model.layers.2.self_attn.k_proj.weight"][3, 5] = float("nan")

    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight .*1 NaN"):
        export_checkpoint(_copy_with(tmp_path / "a", nan), tmp_path / "a" / "out")

    def nan_expert(sd):
        sd["model.layers.0.mlp.experts.6.down_proj.weight"][0, 0] = float("inf")

    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.6\.down_proj\.weight .*1 Inf"):
        export_checkpoint(_copy_with(tmp_path / "b", nan_expert), tmp_path / "b" / "out")

    with pytest.raises(ExportError, match="quant='none' has no NVFP4 weights"):
        export_checkpoint(ASSET, tmp_path / "c", QuantConfig(quant="none"))
    with pytest.raises(ExportError, match=r"ignore all or none"):
        cfg = QuantConfig(quant="quads", ignore=QuantConfig().ignore + (r"\.k_proj$",))
        export_checkpoint(ASSET, tmp_path / "d", cfg)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "x").write_text("")
    with pytest.raises(ExportError, match="not empty"):
        export_checkpoint(ASSET, tmp_path / "e")
    with pytest.raises(ExportError, match="holds no HF model"):
        export_checkpoint(tmp_path / "e", tmp_path / "f")
    out = tmp_path / "g"
    export_checkpoint(ASSET, out)
    with pytest.raises(ExportError, match="already has a quantization_config"):
        export_checkpoint(out, tmp_path / "h")


def test_k_not_multiple_of_16_fails_naming_the_tensor(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, moe_intermediate_size=24, num_experts=2, num_experts_per_tok=1)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.\d\.down_proj\.weight has shape \(32, 24\).*divisible by 16"):
        export_checkpoint(tmp_path / "m", tmp_path / "out")
    # keeping the experts BF16 makes it exportable (they are named in the ignore list then)
    res = export_checkpoint(tmp_path / "m", tmp_path / "out2", QuantConfig(quant="quads", ignore=QuantConfig().ignore + (r"\.experts$",)))
    assert res.quantized_modules == ["model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.qkv_proj"]


def test_cli(tmp_path, capsys):
    main(["--model", str(ASSET), "--out", str(tmp_path / "o"), "--quant-config", '{"quant": "w4a16"}'])
    assert "0.2813x" in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / EXPORT_META).read_text())["quant_config"]["quant"] == "w4a16"
    with pytest.raises(SystemExit, match="unknown key"):
        main(["--model", str(ASSET), "--out", str(tmp_path / "p"), "--quant-config", '{"bogus": 1}'])
    from verl_quads.cli import main as cli_main

    cli_main(["export", "--model", str(ASSET), "--out", str(tmp_path / "q")])
    assert (tmp_path / "q" / "model.safetensors").is_file()


def test_meta_model_plan_matches_the_trainer():
    """The exporter decides what to quantize with apply_qat on a meta-device copy of the model."""
    from verl_quads.sync.trainer import plan_from_model

    plan = plan_from_model(meta_model(ASSET, QuantConfig(quant="quads")))
    assert plan.linear_groups["model.layers.0.self_attn.qkv_proj"] == [
        f"model.layers.0.self_attn.{n}_proj" for n in "qkv"
    ]
    assert sorted(plan.experts) == [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
