"""Make the embedded demo model: a small Qwen3-MoE trained on CPU to partially solve arithmetic.

``python -m verl_quads.models.train_demo --out verl_quads/assets/tiny_math_moe`` builds, from
nothing but a seed (no downloads):

1. a byte-level BPE tokenizer whose pre-tokenizer splits every digit into its own token (numbers
   are then spelled digit by digit, which a small transformer can add), with Qwen's ChatML chat
   template and ``<|im_end|>`` as EOS (what verl's RL dataset and vLLM expect);
2. a ``Qwen3MoeForCausalLM`` (every layer sparse MoE, head_dim 32 for vLLM's CPU attention);
3. supervised training on seeded problems of :mod:`verl_quads.models.arith` (loss on the response
   only), for a fixed number of steps or a wall-clock budget, with the test split's problems
   excluded from training;
4. greedy and temperature-1 accuracy on the held-out test split, scored by verl's own gsm8k rule
   reward; the loss curve and the accuracies are written to ``train_log.json`` next to the weights;
5. the verl-ready parquet (train/test) in ``<out>/data``.

The shipped model should solve the task only partly (GRPO then has groups with mixed rewards):
training is stopped early on purpose (``--steps``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

from verl_quads.models import arith
from verl_quads.models.tiny import CHAT_TEMPLATE, EOS, IM_END, IM_START

DEFAULTS = dict(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, num_experts=8, top_k=2,
                moe_intermediate_size=128)


def build_tokenizer(out_dir: Path, *, seed: int, vocab_size: int = 320):
    """Byte-level BPE with single-digit tokens, trained on the task's own text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    train, _ = arith.split_problems(seed=seed)
    corpus = [arith.question(*p) for p in train] + [arith.solution(*p) for p in train] + ["user", "assistant"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=EOS,
                                   additional_special_tokens=[IM_START])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def _prompt_text(tok, a, op, b) -> str:
    return tok.apply_chat_template([{"role": "user", "content": arith.question(a, op, b)}], tokenize=False,
                                   add_generation_prompt=True)


def _batch(tok, probs, device="cpu"):
    """Right-padded input ids, attention mask and labels (-100 outside the response + EOS)."""
    import torch

    seqs, labels = [], []
    for a, op, b in probs:
        p = tok(_prompt_text(tok, a, op, b), add_special_tokens=False)["input_ids"]
        r = tok(arith.solution(a, op, b), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + r)
        labels.append([-100] * len(p) + r)
    n = max(map(len, seqs))
    ids = torch.full((len(seqs), n), tok.pad_token_id)
    lab = torch.full((len(seqs), n), -100)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(l)] = torch.tensor(l)
        mask[i, : len(s)] = 1
    return ids, mask, lab


def evaluate(model, tok, probs, *, do_sample: bool, seed: int = 0, max_new_tokens: int = 24, batch: int = 64) -> float:
    """Mean verl gsm8k reward (strict) over ``probs``: greedy or temperature-1 sampling (HF generate)."""
    import torch
    from verl.utils.reward_score.gsm8k import compute_score

    tok.padding_side = "left"
    torch.manual_seed(seed)
    scores = []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(probs), batch):
            chunk = probs[i : i + batch]
            enc = tok([_prompt_text(tok, *p) for p in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=1.0 if do_sample else None,
                                 top_p=1.0, top_k=0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            scores += [compute_score(t, str(arith._value(*p))) for t, p in zip(texts, chunk)]
    model.train()
    return sum(scores) / len(scores)


def train(out: Path, *, seed: int = 0, steps: int = 1500, max_minutes: float = 15.0, batch: int = 64, lr: float = 3e-3,
          threads: int = 2, log_every: int = 50) -> dict:
    """Build tokenizer + model in ``out``, train, evaluate, save (bf16) and return the training record."""
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # tiny weights/grads go denormal on CPU: 50x slower backward without this
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, seed=seed)
    vocab = 64 * math.ceil(len(tok) / 64)
    d = DEFAULTS
    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=d["hidden_size"], intermediate_size=2 * d["moe_intermediate_size"],
        num_hidden_layers=d["num_layers"], num_attention_heads=d["num_heads"], num_key_value_heads=d["num_kv_heads"],
        head_dim=d["head_dim"], max_position_embeddings=512, moe_intermediate_size=d["moe_intermediate_size"],
        num_experts=d["num_experts"], num_experts_per_tok=d["top_k"], decoder_sparse_step=1, norm_topk_prob=True,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        router_aux_loss_coef=0.01, output_router_logits=True,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    train_probs, test_probs = arith.split_problems(seed=seed)
    excluded = set(test_probs)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    losses, t0, step = [], time.time(), 0
    model.train()
    while step < steps and time.time() - t0 < 60 * max_minutes:
        probs = []
        while len(probs) < batch:  # fresh problems each step, never a test problem
            p = arith.problems(1, seed=rng.getrandbits(62))[0]
            if p not in excluded:
                probs.append(p)
        ids, mask, lab = _batch(tok, probs)
        outp = model(input_ids=ids, attention_mask=mask, labels=lab)
        outp.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        losses.append(float(outp.loss.detach()))
        if step % log_every == 0:
            print(f"step {step} loss {sum(losses[-log_every:]) / log_every:.4f} ({time.time() - t0:.0f}s)", flush=True)
    train_s = time.time() - t0
    model.config.output_router_logits = False
    model = model.to(torch.bfloat16)
    greedy = evaluate(model, tok, test_probs, do_sample=False)
    sampled = evaluate(model, tok, test_probs, do_sample=True, seed=seed)
    model.save_pretrained(out, safe_serialization=True)
    arith.write_parquet(out / "data", seed=seed)
    record = dict(
        seed=seed, steps=step, batch=batch, lr=lr, threads=threads, train_seconds=round(train_s, 1),
        params=sum(p.numel() for p in model.parameters()), config=dict(DEFAULTS, vocab_size=vocab),
        loss_first=sum(losses[:log_every]) / min(len(losses), log_every),
        loss_last=sum(losses[-log_every:]) / min(len(losses), log_every),
        loss_curve=[round(sum(losses[i:i + log_every]) / len(losses[i:i + log_every]), 4) for i in range(0, len(losses), log_every)],
        test_problems=len(test_probs), hf_bf16_greedy_accuracy=greedy, hf_bf16_sampled_t1_accuracy=sampled,
        scorer="verl.utils.reward_score.gsm8k.compute_score (strict)",
    )
    (out / "train_log.json").write_text(json.dumps(record, indent=1))
    return record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m verl_quads.models.train_demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--max-minutes", type=float, default=15.0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    rec = train(a.out, seed=a.seed, steps=a.steps, max_minutes=a.max_minutes, batch=a.batch, lr=a.lr, threads=a.threads)
    print(json.dumps({k: v for k, v in rec.items() if k != "loss_curve"}, indent=1))


if __name__ == "__main__":
    main()
