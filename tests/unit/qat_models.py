"""Tiny random transformers-5 models for the QAT tests (built in-process, no downloads)."""

from __future__ import annotations

import torch


def tiny_model(family: str, *, seed: int = 0, dtype=torch.bfloat16, layers: int = 2, experts_impl: str | None = None):
    """A tiny random causal LM of ``family`` in ``qwen3_moe``, ``olmoe``, ``qwen3`` (dense)."""
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=64, num_hidden_layers=layers, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False)
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(head_dim=32, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True, **common)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(intermediate_size=32, num_experts=4, num_experts_per_tok=2, eos_token_id=None,
                             pad_token_id=None, bos_token_id=None, **common)
        cls = tf.OlmoeForCausalLM
    elif family == "qwen3":
        cfg = tf.Qwen3Config(head_dim=32, intermediate_size=96, **common)
        cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    if experts_impl is not None:
        cfg._experts_implementation = experts_impl
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg)
    # Non-trivial values everywhere (HF init leaves some params at 0/1): keep the QDQ honest.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    return model.to(dtype)


def tokens(batch: int = 2, seq: int = 8, vocab: int = 96, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)
