"""Tiny random Qwen3-MoE checkpoints and tokenizers, built locally (no hub access needed).

Used by the CPU integration tests and the demo: a real ``Qwen3MoeForCausalLM`` (random weights)
saved as a Hugging Face checkpoint that verl's FSDP actor and vLLM both load by path.

Constraints that shape the defaults:
- vLLM's CPU attention supports head sizes 32, 64, 80, 96, ... only, so ``head_dim >= 32``.
- The tokenizer is a byte-level BPE trained here with the ``tokenizers`` library on a small
  built-in corpus (gsm8k-style sentences and digits); byte-level means every string encodes.
- The chat template is Qwen's ChatML layout (``<|im_start|>role\\n...<|im_end|>``), which is what
  verl's RL dataset applies to the ``prompt`` chat list.
"""

from __future__ import annotations

import json
from pathlib import Path

IM_START, IM_END, EOS = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    """A deterministic training corpus for the tiny BPE: math word problems, digits, markers."""
    names = ["Natalia", "Weng", "Betty", "Julie", "James", "Mark", "Albert", "Ken", "Alexis", "Tina"]
    things = ["clips", "apples", "dollars", "pages", "eggs", "books", "cookies", "marbles", "hours", "miles"]
    lines = []
    for i, (n, t) in enumerate((n, t) for n in names for t in things):
        a, b = 3 + (7 * i) % 41, 2 + (5 * i) % 23
        lines.append(
            f"{n} has {a} {t} and buys {b} more {t}. How many {t} does {n} have now? "
            f"Let's think step by step and output the final answer after \"####\"."
        )
        lines.append(f"{n} had {a} {t}. {a} + {b} = {a + b}. #### {a + b}")
    lines += [" ".join(str(d) for d in range(k, k + 10)) for k in range(0, 200, 10)]
    lines += ["The answer is #### 42", "user", "assistant", "system", "You are a helpful assistant."]
    return lines


def build_tiny_tokenizer(out_dir: str | Path, *, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer on :func:`_corpus`, save it as a HF fast tokenizer.

    Returns the ``PreTrainedTokenizerFast``. ``len(tokenizer) <= vocab_size``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 byte symbols + merges + specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=EOS,
        additional_special_tokens=[IM_START],
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def build_tiny_qwen3_moe(
    out_dir: str | Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 64,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    dtype: str = "bfloat16",
    init_device: str = "cpu",
) -> Path:
    """Build and save a tiny random ``Qwen3MoeForCausalLM`` + tokenizer into ``out_dir``.

    Every decoder layer is a sparse-MoE layer (``decoder_sparse_step=1``). Weights are drawn
    with ``torch.manual_seed(seed)`` so the same arguments give the same checkpoint (on the same
    ``init_device``: the device whose generator draws them, e.g. ``cuda`` for benchmark-sized models).
    Returns ``Path(out_dir)``.
    """
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if head_dim < 32 or head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 and >= 32 (vLLM CPU attention), got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")

    out = Path(out_dir)
    tokenizer = build_tiny_tokenizer(out, vocab_size=vocab_size)
    if len(tokenizer) > vocab_size:
        raise AssertionError(f"tokenizer has {len(tokenizer)} tokens > vocab_size {vocab_size}")
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(EOS)

    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * moe_intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    with torch.device(init_device):
        model = Qwen3MoeForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out, safe_serialization=True)
    # Record how it was made (for humans and for tests that rebuild it).
    (out / "verl_quads_tiny.json").write_text(
        json.dumps(
            dict(seed=seed, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                 num_kv_heads=num_kv_heads, head_dim=head_dim, num_experts=num_experts, top_k=top_k,
                 moe_intermediate_size=moe_intermediate_size, vocab_size=vocab_size, dtype=dtype),
            indent=1,
        )
    )
    return out
