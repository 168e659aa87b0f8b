"""The ``quads_nvfp4`` plugin inside a real vLLM engine on a CUDA GPU (issue #5).

Where it runs: a machine with a CUDA GPU and vLLM (the H200 of the device tool with vLLM 0.24.0 = verl 0.9.1's pin,
carried there by scripts/h200_vllm024/; results: docs/vllm024_engine_h200.txt). CI has neither and skips it; the same checks on vLLM's CPU
build are tests/integration/test_rollout_vllm.py, whose tiny random Qwen3-MoE checkpoint, helpers and references this
module reuses. What only a GPU engine exercises, and is checked here:

- the ``triton`` backend chosen by device inside the engine (the CPU engine runs ``torch``);
- vLLM's default execution on GPUs: the model compiled (torch.compile, our custom ops) and replayed from CUDA
  graphs (``enforce_eager=False``), for ``w4a16`` / ``naive`` / ``quads``: with the same kernels as eager the same
  tokens and logprobs bit for bit; with Inductor's fusions the engine runs, its differences to eager are printed;
- reload A -> B -> A under CUDA graphs: A's tokens and logprobs bit for bit, every parameter at its old address
  (a graph replays fixed addresses);
- routing capture out of CUDA graphs (non-blocking copies): every request's record, the eager engine's routing;
- the layers' output on the engine's real activations == ``verl_quads.nvfp4`` QDQ + a plain matmul;
- ``trace``: an eager engine records guidance that reproduces the rollout's codes; a CUDA-graph engine (Dynamo-eager,
  the same kernels) records the eager engine's guidance bit for bit, its decode steps replaying the graphs' copies
  into the store's persistent buffers; with Inductor every computed position has a record.

Attention runs vLLM's ``TRITON_ATTN`` backend (the FlashAttention extension is not carried to the device; attention
is not ours). Engines run in-process, one at a time.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (runs on the H200 via the device tool)", allow_module_level=True)
vllm = pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
import test_rollout_vllm as cpu  # noqa: E402  (helpers of the CPU engine tests; importing it collects nothing here)

from verl_quads import nvfp4  # noqa: E402
from verl_quads.rollout.capture import collect_guidance, get_store  # noqa: E402
from verl_quads.rollout.emulation import ActQuant, per_token_global_scale  # noqa: E402

COMPILED_MODES = ("w4a16", "naive", "quads")
CAPTURE_SIZES = [1, 2, 4, 8]


class _Engine(cpu._Engines):
    """One in-process engine at a time (vLLM's process-global distributed state allows no more); teardown as the
    CPU tests' (``close`` / ``close_failed``), engines started with the GPU settings of this module."""

    def start(self, path: Path, mode: str | None, eager: bool, compilation: dict | None = None):
        self.close()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kw = {}
        if mode is not None:
            kw = dict(quantization="quads_nvfp4",
                      hf_overrides={"quantization_config": {"quant_method": "quads_nvfp4", "quant": mode}})
        t0 = time.perf_counter()
        self.llm = vllm.LLM(
            str(path), enforce_eager=eager, dtype="bfloat16", max_model_len=128, seed=0, enable_prefix_caching=False,
            kv_cache_memory_bytes=64 << 20, max_num_seqs=8, attention_backend="TRITON_ATTN",
            compilation_config={"cudagraph_capture_sizes": CAPTURE_SIZES, **(compilation or {})}, **kw,
        )
        print(f"\n[engine] vllm {vllm.__version__} mode={mode} eager={eager} start {time.perf_counter() - t0:.1f}s")
        return self.llm

    def close(self):
        super().close()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def engine():
    e = _Engine()
    yield e
    e.close()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_qwen3_moe_gpu")
    return cpu.build_checkpoint(root / "A", seed=0), cpu.build_checkpoint(root / "B", seed=1)


def _graphs_on(llm) -> bool:
    from vllm.config import CompilationMode, CUDAGraphMode

    cc = llm.llm_engine.vllm_config.compilation_config
    return cc.mode != CompilationMode.NONE and cc.cudagraph_mode != CUDAGraphMode.NONE


def _check_layers_on_cuda(llm, mode):
    lin, moe = cpu.quantized_layers(cpu.model_of(llm))
    assert len(lin) == 2 * cpu.LAYERS and len(moe) == cpu.LAYERS
    for name, layer in {**lin, **moe}.items():
        assert layer.quant_method.act.mode == mode, name
        assert layer.quant_method.backend == "triton", name  # chosen by device (CUDA, no FP4 tensor cores)
        assert mode != "quads" or layer.quant_method.act.residual_combine == "bf16", name  # auto -> bf16 (triton)
        assert all(p.is_cuda for p in layer.parameters(recurse=False)), name


def _routing(llm) -> list:
    """Pop every request's routing record from the engine (``collect_routing``), in request order."""
    from verl_quads.rollout.capture import collect_routing

    return sorted(collect_routing(llm).values(), key=lambda r: int(r.external_id))


def _measured(llm, prompts):
    """A warm-up generate, then the measured one: (result, seconds, routing records of the measured requests)."""
    cpu.generate(llm, prompts)
    _routing(llm)
    res, dt = cpu.generate(llm, prompts)
    return res, dt, _routing(llm)


def _compare(ref, other) -> tuple[bool, float]:
    """(same tokens, max |logprob difference|) of two ``cpu.generate`` results."""
    same = [t for t, _ in ref] == [t for t, _ in other]
    return same, max(abs(a - b) for (_, la), (_, lb) in zip(ref, other) for a, b in zip(la, lb))


@pytest.mark.parametrize("mode", (None,) + COMPILED_MODES)
def test_compiled_cuda_graph_engine_generates_as_eager(engine, ckpts, mode):
    """Three engines per mode (``None`` = stock BF16, the baseline): eager; compiled by Dynamo with the ``eager``
    backend and every vLLM custom op (the same kernels as eager) replaying CUDA graphs at decode -> the SAME tokens and
    logprobs bit for bit (4 prompts: the decode batch is a captured size, no padding rows); vLLM's default (Inductor,
    which fuses vLLM's own RMSNorm / SiLU / residual adds and rounds them differently in bf16) with CUDA graphs ->
    finite logprobs, its difference to eager printed, not asserted: on this tiny random model even the stock BF16
    engine leaves eager's tokens there (H200, vLLM 0.24.0: one of 4 prompts, max |logprob diff| 0.24), and W4A4
    activations amplify such bf16 differences by FP4 rounding (naive 0.90, all 4 prompts diverge; quads 0.063 and
    w4a16 0.016, same tokens; docs/vllm024_engine_h200.txt)."""
    prompts = cpu.PROMPTS + ["Weng earns 12 an hour. How much"]
    llm = engine.start(ckpts[0], mode, eager=True)
    if mode is not None:
        _check_layers_on_cuda(llm, mode)
    eager, dt_e, routing_e = _measured(llm, prompts)  # the warm-up run compiles the Triton kernels
    results = {}
    for name, cc in (("dynamo-eager+graphs", {"backend": "eager", "custom_ops": ["all"]}), ("inductor+graphs", {})):
        llm = engine.start(ckpts[0], mode, eager=False, compilation=cc)
        assert _graphs_on(llm)
        if mode is not None:
            _check_layers_on_cuda(llm, mode)
        res, dt, routing = _measured(llm, prompts)
        for toks, lps in res:
            assert len(toks) == cpu.MAX_TOKENS and all(math.isfinite(x) and x <= 0.0 for x in lps)
        results[name] = res
        # routing capture (every quantized mode; non-blocking copies out of the graphs): one record per request,
        # every computed position (prompt + generated tokens but the last), valid expert ids
        assert len(routing) == (0 if mode is None else len(prompts))
        for p, r in zip(prompts, routing):
            t = len(llm.get_tokenizer()(p).input_ids) + cpu.MAX_TOKENS - 1
            assert r.positions.tolist() == list(range(t))
            assert r.layers == list(range(cpu.LAYERS)) and tuple(r.experts.shape) == (t, cpu.LAYERS, cpu.TOP_K)
            assert int(r.experts.max()) < cpu.EXPERTS
        if name == "dynamo-eager+graphs":  # same kernels as eager -> the same routing, position for position
            assert [(r.positions.tolist(), r.experts.tolist()) for r in routing] == \
                [(r.positions.tolist(), r.experts.tolist()) for r in routing_e]
        same, diff = _compare(eager, res)
        print(f"[generate] mode={mode} {name}: {dt * 1e3:.0f} ms (eager {dt_e * 1e3:.0f} ms) for {len(prompts)} prompts x "
              f"{cpu.MAX_TOKENS} tokens; same tokens as eager: {same}, max |logprob diff| {diff:.3e}")
        for (te, _), (tg, _) in zip(eager, res):
            print(f"  eager {te} {name} {tg}")
    assert results["dynamo-eager+graphs"] == eager  # tokens and float logprobs: bit for bit


def test_reload_A_B_A_under_cuda_graphs_is_bit_exact_and_keeps_storage(engine, ckpts):
    llm = engine.start(ckpts[0], "quads", eager=False)
    assert _graphs_on(llm)
    cpu.check_reload_a_b_a(llm, *ckpts)


def test_methods_on_cuda_match_nvfp4_qdq_plus_plain_matmul(engine, ckpts):
    from verl_quads.rollout.linear import QuadsNVFP4LinearMethod
    from verl_quads.rollout.moe import QuadsNVFP4MoEMethod

    llm = engine.start(ckpts[0], "naive", eager=True)
    lin, moe, records = cpu.capture_activations(llm)
    ck = cpu.checkpoint_tensors(ckpts[0])
    # quads: the default rule (channel_sampled since session 33) and the exact channel rule
    cases = [("w4a16", ActQuant("w4a16", 0.5)), ("naive", ActQuant("naive", 0.5)),
             ("quads", ActQuant("quads", 0.5, residual_combine="bf16")),
             ("quads", ActQuant("quads", 0.5, residual_combine="bf16", residual_granularity="channel"))]
    n_checked = 0
    for mode, act in cases:
        for kind, name, inp, _ in records[:: max(1, len(records) // 24)]:
            if kind == "linear":
                y = QuadsNVFP4LinearMethod(act, backend="triton").apply(lin[name], inp)
                ref = cpu.ref_linear(inp.cpu(), cpu.linear_bf16_weight(ck, name), mode, combine="bf16",
                                     granularity=act.residual_granularity)
                ref = ref.to(inp.dtype)
            else:
                x, tw, ti = inp
                layer = moe[name]
                y = QuadsNVFP4MoEMethod(layer.moe_config, act, "triton").apply(layer, x, tw, ti, None, None)
                ref = cpu.ref_experts(x.cpu(), tw.cpu(), ti.cpu(), *cpu.expert_bf16_weights(ck, name), mode,
                                      combine="bf16", granularity=act.residual_granularity).to(x.dtype)
            assert y.is_cuda
            # same fp32 products; only the summation order differs -> at most bf16 rounding flips
            torch.testing.assert_close(y.cpu(), ref, rtol=2**-7, atol=1e-5,
                                       msg=f"{mode} {act.residual_granularity} {name}")
            n_checked += 1
    assert n_checked >= 4 * 8


def test_trace_eager_engine_guidance_reproduces_codes(engine, ckpts):
    llm = engine.start(ckpts[0], "trace", eager=True)
    get_store().clear()
    lin, moe, records = cpu.capture_activations(llm)
    guidance = collect_guidance(llm)
    assert len(guidance) == len(cpu.PROMPTS)
    n_checked = 0
    for kind, name, inp, step in records:
        assert step is not None
        rows, positions = step
        layer_idx = int(name.split("layers.")[1].split(".")[0])
        gemm = "mlp.experts.w13" if kind == "moe" else name.split(f"layers.{layer_idx}.")[1]
        x = (inp[0] if kind == "moe" else inp).cpu()
        for r, (rid, pos) in enumerate(zip(rows, positions.tolist())):
            rec = guidance[rid].record(pos, layer_idx, gemm)
            rollout = nvfp4.quantize(x[r], per_token_global_scale(x[r][None])[0], backend="torch")
            guided = nvfp4.quantize_guided(x[r], rec, backend="torch")
            assert torch.equal(guided.packed, rollout.packed), (rid, pos, name)
            assert torch.equal(guided.block_scale.view(torch.uint8), rollout.block_scale.view(torch.uint8))
            n_checked += 1
    assert n_checked >= sum(g.num_tokens for g in guidance.values()) * cpu.LAYERS * 3


def _guidance_in_prompt_order(llm) -> list:
    return sorted(collect_guidance(llm).values(), key=lambda g: int(g.external_id))


def test_trace_cuda_graph_engine_records_the_eager_engines_guidance(engine, ckpts):
    """TRACE under vLLM's default execution (compiled, CUDA graphs). Dynamo with the eager backend and every vLLM
    custom op (the same kernels as eager) + graphs: the same tokens and, per request, the same positions and the same
    records of every guided GEMM (bits, block scales, global scales, w2 expert ids) as the eager engine, bit for
    bit; its decode steps (4 prompts: a captured batch size) replay graphs, so those records come from the replayed
    copies into the store's persistent buffers, the prefill's from the ops' Python (not captured: too many tokens).
    Inductor + graphs: every request has every guided GEMM's record at every computed position (its bf16 fusions
    change activations slightly: the share of equal bits is printed)."""
    prompts = cpu.PROMPTS + ["Weng earns 12 an hour. How much"]
    llm = engine.start(ckpts[0], "trace", eager=True)
    _check_layers_on_cuda(llm, "trace")
    get_store().clear()
    ref, _ = cpu.generate(llm, prompts)
    g_ref = _guidance_in_prompt_order(llm)
    assert len(g_ref) == len(prompts)
    for name, cc in (("dynamo-eager+graphs", {"backend": "eager", "custom_ops": ["all"]}), ("inductor+graphs", {})):
        llm = engine.start(ckpts[0], "trace", eager=False, compilation=cc)
        assert _graphs_on(llm)
        get_store().clear()
        cpu.generate(llm, prompts)  # warm-up (compiles the Triton kernels)
        collect_guidance(llm)
        res, dt = cpu.generate(llm, prompts)
        got = _guidance_in_prompt_order(llm)
        assert len(got) == len(prompts)
        equal_bits, total_bits = 0, 0
        for p, a, b in zip(prompts, g_ref, got):
            t = len(llm.get_tokenizer()(p).input_ids) + cpu.MAX_TOKENS - 1
            assert b.positions.tolist() == list(range(t)), name
            assert set(b.records) == set(a.records) and len(b.records) == cpu.LAYERS * 4, name
            assert set(b.expert_ids) == set(a.expert_ids) == set(range(cpu.LAYERS)), name
            for key, ra in a.records.items():
                rb = b.records[key]
                assert rb.shape == ra.shape and rb.bits.shape == ra.bits.shape, (name, key)
                equal_bits += int((rb.bits == ra.bits).sum())
                total_bits += rb.bits.numel()
                if name == "dynamo-eager+graphs":
                    assert torch.equal(rb.bits, ra.bits), (p, key)
                    assert torch.equal(rb.block_scale.view(torch.uint8), ra.block_scale.view(torch.uint8)), (p, key)
                    assert torch.equal(rb.global_scale, ra.global_scale), (p, key)
            if name == "dynamo-eager+graphs":
                assert all(torch.equal(b.expert_ids[l], a.expert_ids[l]) for l in a.expert_ids), p
        if name == "dynamo-eager+graphs":
            assert res == ref  # tokens and logprobs
        print(f"[trace] {name}: {dt * 1e3:.0f} ms for {len(prompts)} prompts x {cpu.MAX_TOKENS} tokens; guidance "
              f"bytes equal to eager's: {equal_bits / total_bits:.4f}")
