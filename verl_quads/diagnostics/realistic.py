"""A small Qwen3-MoE with real activation outliers, trained on local text, then probed (GPU script).

No pretrained MoE can be downloaded, and random weights have no outlier channels, so quantization
error on them is not representative. This script, runnable with torch + transformers only (no vLLM;
the probe's rollout is then verl-quads' own rollout arithmetic over the HF model, and says so):

1. collects text that exists offline on the machine: the ``.py`` files of the installed Python
   packages (``site-packages``, sorted paths, each file's first ``--max-file-bytes`` bytes), split
   into train / held-out by file;
2. trains a byte-level BPE tokenizer on the first 4 MB of it (``tokenizers``, locally) and encodes
   every file separately, in parallel (files separated by ``<|endoftext|>``);
3. builds a ``Qwen3MoeForCausalLM`` (default 8 layers, hidden 1024, 32 experts top-4, expert
   intermediate 512) from a fixed seed on the device and trains it with AdamW (bf16 autocast on
   CUDA) on random windows of the train tokens for ``--seconds`` seconds at most (less if the rest
   of the run would not fit ``--max-total-s``). Recipe options: ``--lr``, ``--adam-betas``,
   ``--weight-decay-on`` (all parameters, or weight matrices only), ``--bos`` (a BOS / attention-sink
   token at the start of every window and prompt), ``--tie-embeddings``;
   :mod:`verl_quads.diagnostics.outlier_sweep` compares them on CPU;
4. reports activation outlier statistics per layer (kurtosis, max/median of per-channel absmax of
   the attention and MLP GEMM inputs) for the random-init and the trained model;
5. saves the checkpoint + tokenizer, and runs the probe statistics (``--seeds`` >= 3 batches, prompts
   = held-out snippets) for the given modes, then ``trace`` for several numbers of guided layers with
   the guidance cache size each costs;
6. (``--rule-ratios``) compares QUADS residual selection rules on the trained model's GEMM inputs:
   per-call vs per-token selection, residual energy vs output-aware score (energy weighted by the
   weight's squared column norms), and per-token 16-blocks vs per-token single channels
   (``residual_granularity="channel"``), as relative GEMM output error (:func:`selection_rule_errors`).
   End to end, the probe's ``quads@R`` modes run the product default (per-token channel rule over a sampled
   threshold since session 33; ``quads@R:channel`` the exact channel rule);
   ``--block-ratios 0.125,0.25,0.5`` adds ``quads@R:block`` modes (per-token 16-channel blocks, the
   default before session 6) for the comparison, and ``--modes ...,quads@0.5:call`` per-call selection.

Prints tables and the per-phase seconds; writes ``realistic.json`` (rewritten after every phase) (+ the probe's ``probe.json``/``probe.txt``/``probe.png``) in
``--out``. ``--toy`` shrinks everything for a CPU smoke test.
"""

from __future__ import annotations

import json
import math
import random
import site
import sys
import sysconfig
import time
from pathlib import Path

import torch


def collect_source_text(max_files: int, max_file_bytes: int, seed: int = 0) -> tuple[list[str], list[str], dict]:
    """(train documents, held-out documents, provenance) from installed packages' ``.py`` files.

    One document per file (its first ``max_file_bytes`` bytes, decoded as UTF-8 with replacement);
    the first 5% of the shuffled files are held out.
    """
    roots = sorted({p for p in [sysconfig.get_paths()["purelib"], *site.getsitepackages()] if Path(p).is_dir()})
    files = sorted(f for r in roots for f in Path(r).rglob("*.py") if f.is_file())
    if not files:
        raise RuntimeError(f"realistic: no .py files under {roots}")
    rng = random.Random(seed)
    rng.shuffle(files)
    files = files[:max_files]
    texts = []
    for f in files:
        try:
            texts.append(f.read_bytes()[:max_file_bytes].decode("utf-8", errors="replace"))
        except OSError:
            continue
    n_hold = max(1, len(texts) // 20)
    prov = {"roots": roots, "n_files": len(texts), "n_heldout_files": n_hold, "max_file_bytes": max_file_bytes,
            "selection": f"all *.py under roots, shuffled with random.Random({seed}), first {max_files}; "
                         f"the first {n_hold} held out",
            "train_bytes": sum(len(t) for t in texts[n_hold:]), "heldout_bytes": sum(len(t) for t in texts[:n_hold])}
    return texts[n_hold:], texts[:n_hold], prov


#: Special tokens of the locally trained tokenizer: document separator, and the BOS (attention-sink) token
#: that ``--bos`` puts at the start of every training window and of every prompt.
EOS, BOS = "<|endoftext|>", "<|bos|>"


def train_tokenizer(docs: list[str], out_dir: Path, vocab_size: int, *, sample_bytes: int = 4 << 20, bos: bool = False):
    """Byte-level BPE trained on the first ``sample_bytes`` characters of ``docs`` (in order), saved as a HF
    fast tokenizer. ``bos``: the tokenizer prepends :data:`BOS` to every encoding with special tokens (so
    the probe's ``tok(prompt)`` starts with it, as training windows do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = [EOS] + ([BOS] if bos else [])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def sample():
        left = sample_bytes
        for d in docs:
            if left <= 0:
                return
            d = d[:left]
            left -= len(d)
            yield from (d[i : i + 10000] for i in range(0, len(d), 10000))

    tok.train_from_iterator(sample(), trainer=trainer)
    kw = {}
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                           special_tokens=[(BOS, tok.token_to_id(BOS))])
        kw["bos_token"] = BOS
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, **kw)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def encode_docs(tok, docs: list[str]) -> torch.Tensor:
    """int64 ``[n]``: every document's tokens (no special tokens) followed by the :data:`EOS` id.

    Encodes the documents in parallel (``tokenizers``' ``encode_batch_fast``: Rust threads, no offsets;
    ``TOKENIZERS_PARALLELISM=true`` for the call), in slices of 2000 documents; one string of the whole
    text took 173 s for 164 MB on the H200 host.
    """
    import os

    bt = tok.backend_tokenizer
    eos = tok.convert_tokens_to_ids(EOS)
    enc = getattr(bt, "encode_batch_fast", bt.encode_batch)
    out: list[int] = []
    # with TOKENIZERS_PARALLELISM unset the batch once ran on one thread here (3.4 s wall = 3.4 s CPU for
    # 600 files; 1.4 s wall / 2.5 s CPU with it set, 2 cores); set it for these calls only
    prev = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        for i in range(0, len(docs), 2000):
            for e in enc(docs[i : i + 2000], add_special_tokens=False):
                out.extend(e.ids)
                out.append(eos)
    finally:
        if prev is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = prev
    import numpy as np

    return torch.from_numpy(np.fromiter(out, dtype=np.int64, count=len(out)))  # 4x faster than torch.tensor(list)


def build_model(vocab: int, layers: int, hidden: int, heads: int, kv_heads: int, experts: int, top_k: int, inter: int,
                seed: int, *, tie: bool = False, device: str = "cpu"):
    """Qwen3-MoE from ``seed``, built (and randomly initialized) directly on ``device`` (float32)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads if hidden // heads >= 32 else 32,
        max_position_embeddings=4096, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k,
        decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=tie, router_aux_loss_coef=0.01,
        output_router_logits=False,
    )
    torch.manual_seed(seed)
    if device.startswith("cuda"):
        torch.cuda.manual_seed_all(seed)
    with torch.device(device):
        return Qwen3MoeForCausalLM(cfg)


#: ``--weight-decay-on``: which parameters AdamW decays. ``all``: every parameter (sessions 1-3);
#: ``matrices``: linear / expert weight matrices only (not RMSNorm gains, not the token embedding).
WD_MODES = ("all", "matrices")


def param_groups(model, weight_decay: float, wd_on: str) -> list[dict]:
    """AdamW parameter groups for ``wd_on`` (:data:`WD_MODES`)."""
    if wd_on not in WD_MODES:
        raise ValueError(f"weight decay target must be one of {WD_MODES}, got {wd_on!r}")
    if wd_on == "all":
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    emb = {id(p) for p in model.get_input_embeddings().parameters()}
    decay, no = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no if p.dim() < 2 or id(p) in emb else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no, "weight_decay": 0.0}]


def train(model, ids: torch.Tensor, *, seconds: float, seq: int, batch: int, lr: float, device: str, seed: int,
          betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.1, wd_on: str = "all",
          bos_id: int | None = None, max_steps: int | None = None) -> dict:
    """AdamW on random windows of ``ids`` for ``seconds`` (or ``max_steps``); returns the loss curve summary.

    Every window is ``seq`` tokens (``bos_id`` set: the BOS token followed by ``seq - 1`` text tokens);
    linear warm-up over 100 steps, then constant ``lr``; grad-norm clip 1.0; bf16 autocast on CUDA.
    Divergence guard: every 100 steps the mean loss is checked (one host sync); while finite, the weights
    are snapshotted on the device; a non-finite mean stops training and restores the last snapshot
    (``diverged_at_step`` / ``restored_step`` in the result, printed).
    """
    model.to(device).train()
    opt = torch.optim.AdamW(param_groups(model, weight_decay, wd_on), lr=lr, betas=betas)
    g = torch.Generator().manual_seed(seed)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else torch.autocast("cpu", enabled=False)
    n_text = seq - (bos_id is not None)
    t0, step, losses = time.perf_counter(), 0, []
    snap, snap_step, diverged = None, 0, None
    while time.perf_counter() - t0 < seconds and (max_steps is None or step < max_steps):
        starts = torch.randint(0, ids.numel() - n_text, (batch,), generator=g)
        x = torch.stack([ids[s : s + n_text] for s in starts.tolist()])
        if bos_id is not None:
            x = torch.cat([torch.full((batch, 1), bos_id, dtype=x.dtype), x], 1)
        x = x.to(device, non_blocking=True)
        warm = min(1.0, (step + 1) / 100)
        for grp in opt.param_groups:
            grp["lr"] = lr * warm
        with amp:
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach())
        step += 1
        if step % 100 == 0:
            mean = torch.stack(losses[-100:]).mean().item()
            print(f"  step {step} loss {mean:.3f} ({time.perf_counter() - t0:.0f}s)", flush=True)
            if not math.isfinite(mean):
                diverged = step
                break
            snap, snap_step = {k: v.detach().clone() for k, v in model.state_dict().items()}, step
    if diverged is None and losses and not math.isfinite(torch.stack(losses[-100:]).float().mean().item()):
        diverged = step
    res = {}
    if diverged is not None:
        if snap is None:
            raise RuntimeError(f"realistic train: loss not finite by step {diverged} (lr {lr}); no finite snapshot to restore")
        model.load_state_dict(snap)
        losses = losses[:snap_step]
        print(f"  loss not finite at step {diverged}: stopped, weights of step {snap_step} restored", flush=True)
        res = {"diverged_at_step": diverged, "restored_step": snap_step}
        step = snap_step
    model.eval()
    losses = torch.stack(losses).float().cpu().tolist() if losses else [float("nan")]
    k = max(1, len(losses) // 10)
    return {"steps": step, "seconds": time.perf_counter() - t0, "loss_first": sum(losses[:k]) / k,
            "loss_last": sum(losses[-k:]) / k, "tokens": step * batch * seq, **res}


#: QUADS selection rules compared by :func:`selection_rule_errors`: (per_token, output-aware score, granularity).
SELECTION_RULES = {"per_call": (False, False, "block"), "per_token": (True, False, "block"),
                   "per_call_outaware": (False, True, "block"), "per_token_outaware": (True, True, "block"),
                   "per_token_channel": (True, False, "channel"),
                   "per_token_channel_sampled": (True, False, "channel_sampled")}


def selection_rule_errors(model, input_ids: torch.Tensor, ratios: tuple[float, ...], max_rows: int = 4096) -> dict:
    """Per-GEMM relative output error of QUADS activation quantization under each selection rule.

    Captures the GEMM inputs of a forward pass over ``input_ids`` (per decoder layer: the q/k/v input
    with ``W = [Wq; Wk; Wv]``, the o_proj input, and per routed expert its gate_up input and its
    down_proj input ``silu(x Wg^T) * (x Wu^T)`` recomputed in float32 from the captured rows), then for
    each rule of :data:`SELECTION_RULES` and ratio k measures
    ``||(Q_k(X) - X) W^T||_F / ||X W^T||_F`` in float32 with per-token global scales (the rollout's
    convention), where ``Q_k`` is :func:`verl_quads.nvfp4.residual_fake_quantize` (torch reference);
    the output-aware rules pass ``score_weight = (W.float() ** 2).sum(0)``; ``per_token_channel`` selects
    single channels (``granularity="channel"``, the same number of compensated channels per row),
    ``per_token_channel_sampled`` the same over a sampled threshold (``granularity="channel_sampled"``: about that
    many channels per row). Per-call rules select once
    per GEMM call: for experts, per expert's group of routed rows (as the rollout's MoE calls do).
    ``naive`` (k = 0) is the baseline. Returns ``{"gemms": {name: {rule@k: err}}, "mean": {rule@k: mean err},
    "median_ratio_to_naive": {...}}``.
    """
    import torch.nn.functional as F

    import verl_quads.nvfp4 as nv

    captured = []  # (name, X [rows, K] float32-able, W [N, K])
    hooks = []
    for li, layer in enumerate(model.model.layers):
        att = layer.self_attn
        wqkv = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).detach()
        hooks.append(att.q_proj.register_forward_pre_hook(
            lambda m, a, li=li, w=wqkv: captured.append((f"L{li}.qkv", a[0].detach().reshape(-1, a[0].shape[-1]), w))))
        hooks.append(att.o_proj.register_forward_pre_hook(
            lambda m, a, li=li: captured.append((f"L{li}.o_proj", a[0].detach().reshape(-1, a[0].shape[-1]), m.weight.detach()))))
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and hasattr(experts, "gate_up_proj"):
            def pre(m, args, kwargs, li=li):
                hs = args[0] if args else kwargs["hidden_states"]
                idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
                hs = hs.detach().reshape(-1, hs.shape[-1])
                for e in torch.unique(idx).tolist():
                    if e < 0 or e >= m.gate_up_proj.shape[0]:
                        continue
                    rows = (idx == e).any(-1).nonzero().squeeze(-1)
                    x = hs[rows]
                    wgu = m.gate_up_proj[e].detach()
                    captured.append((f"L{li}.e{e}.gate_up", x, wgu))
                    g, u = F.linear(x.float(), wgu.float()).chunk(2, dim=-1)
                    captured.append((f"L{li}.e{e}.down", (F.silu(g) * u).to(x.dtype), m.down_proj[e].detach()))
            hooks.append(experts.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for h in hooks:
            h.remove()
    gemms: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for name, x, w in captured:
            x = x[:max_rows]
            if x.shape[0] == 0 or x.shape[-1] % 16:
                continue
            wf = w.float()
            ref = F.linear(x.float(), wf)
            denom = ref.norm().item()
            if denom == 0:
                continue
            gs = nv.per_row_global_scale(x)
            col = wf.square().sum(0)
            row = {"naive": (F.linear(nv.fake_quantize(x, gs, backend="torch").float(), wf) - ref).norm().item() / denom}
            for k in ratios:
                for rule, (per_token, outaware, gran) in SELECTION_RULES.items():
                    q = nv.residual_fake_quantize(x, k, gs, per_token=per_token, score_weight=col if outaware else None,
                                                  granularity=gran, backend="torch", check_finite=False)
                    row[f"{rule}@{k:g}"] = (F.linear(q.float(), wf) - ref).norm().item() / denom
            gemms[name] = row
    keys = list(next(iter(gemms.values())).keys()) if gemms else []
    mean = {k: sum(r[k] for r in gemms.values()) / len(gemms) for k in keys}
    ratio_naive = {}
    for k in keys:
        rs = sorted(r[k] / r["naive"] for r in gemms.values() if r["naive"] > 0)
        ratio_naive[k] = rs[len(rs) // 2] if rs else float("nan")
    return {"gemms": gemms, "mean": mean, "median_ratio_to_naive": ratio_naive, "n_gemms": len(gemms)}


def format_rule_table(res: dict) -> str:
    """One line per rule@k: mean relative output error over the GEMMs and median ratio to naive."""
    lines = [f"== QUADS selection rules: relative GEMM output error over {res['n_gemms']} GEMM calls "
             "(attention qkv/o, each routed expert's gate_up/down) =="]
    lines.append(f"  {'rule':28s} {'mean rel err':>13s} {'median err/naive':>17s}")
    for k, v in res["mean"].items():
        lines.append(f"  {k:28s} {v:13.5f} {res['median_ratio_to_naive'][k]:17.3f}")
    return "\n".join(lines)


def guidance_bytes_per_token(cfg, guided_layers: int) -> int:
    """TRACE cache per token: for each guided layer's GEMM inputs, K/8 bits + K/16 scales + 4-byte global scale."""
    per = lambda k: k // 8 + k // 16 + 4  # noqa: E731
    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    return guided_layers * (per(h) + per(q) + per(h) + cfg.num_experts_per_tok * per(cfg.moe_intermediate_size))


def main(argv: list[str] | None = None) -> dict:
    import argparse

    t_all = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m verl_quads.diagnostics.realistic", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="realistic_out")
    p.add_argument("--ckpt", default="", help="where the trained checkpoint + tokenizer go (default: <--out>/model); "
                                              "e.g. a local /tmp path when --out is copied back from a device call")
    p.add_argument("--seconds", type=float, default=400.0,
                   help="training wall time at most (s); training also stops when only --probe-reserve-s of --max-total-s "
                        "is left (the run's clock starts when main() starts), so that everything after it still fits")
    p.add_argument("--max-total-s", type=float, default=575.0,
                   help="wall-time budget of main() (s): refuse to start if --seconds plus --probe-reserve-s exceeds it, "
                        "and cut training short to keep --probe-reserve-s for the phases after it. One device call allows "
                        "600 s including the interpreter start and imports (~10 s)")
    p.add_argument("--probe-reserve-s", type=float, default=180.0,
                   help="time kept for everything after training (s): outlier stats, selection rules, checkpoint, probe, "
                        "trace sweep (not --extra-modes). H200 session 3 (440M model, 3 seeds, 24 prompts x 16 new tokens): "
                        "~9.4 s per probed mode with decomposition, ~6 s without, ~7.8 s per --guided-sweep entry, "
                        "selection rules 10 s; the defaults (10 modes, sweep of 3) thus need ~140 s. Raise it with more "
                        "modes / seeds / prompts; the phase times printed at the end tell what each part took")
    p.add_argument("--rule-ratios", default="0.25,0.5",
                   help="QUADS selection-rule comparison (per-call vs per-token, plain vs output-aware score) at these "
                        "ratios on the trained model's GEMM inputs; empty to skip")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--inter", type=int, default=512, help="expert intermediate size")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop training after this many optimizer steps (0: no limit; --seconds still applies): "
                        "a step-bound run is comparable across seeds on a loaded host, a time-bound one is not")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--adam-betas", default="0.9,0.95", help="AdamW betas, 'b1,b2'")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--weight-decay-on", choices=WD_MODES, default="all",
                   help="'all': every parameter; 'matrices': not the RMSNorm gains nor the token embedding")
    p.add_argument("--bos", action="store_true",
                   help="a BOS token (attention sink) at the start of every training window and every probe prompt")
    p.add_argument("--tie-embeddings", action="store_true", help="tie the LM head to the token embedding")
    p.add_argument("--max-files", type=int, default=20000)
    p.add_argument("--max-file-bytes", type=int, default=20000)
    p.add_argument("--modes", default="bf16,naive,w4a16,w4a4_qat,quads@0.125,quads@0.25,quads@0.5,quads@0.75,quads@1.0,trace")
    p.add_argument("--block-ratios", default="",
                   help="comma list of QUADS ratios R: append quads@R:block (the per-token 16-channel block rule, "
                        "residual_granularity='block'; quads@R itself is the product default rule, channel_sampled) to "
                        "--modes, e.g. 0.125,0.25,0.5 (each is one more probe mode: count it in --probe-reserve-s)")
    p.add_argument("--channel-ratios", default=None, help=argparse.SUPPRESS)  # removed in session 6: refused below
    p.add_argument("--extra-modes", default="",
                   help="comma list of modes probed after everything else, without decomposition (bf16 and naive "
                        "are rerun with them as closure anchors)")
    p.add_argument("--guided-sweep", default="", help="comma list of guided-layer counts for trace (default: L/4,L/2,L)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--n-prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--toy", action="store_true", help="tiny sizes for a CPU smoke test")
    a = p.parse_args(argv)
    if a.toy:
        a.layers, a.hidden, a.heads, a.kv_heads, a.experts, a.top_k, a.inter = 2, 64, 2, 1, 4, 2, 32
        a.vocab, a.seq, a.batch, a.max_files, a.max_file_bytes = 300, 32, 4, 40, 4000
        a.n_prompts, a.prompt_tokens, a.max_new_tokens = 4, 12, 4
    if a.seconds <= 0:
        raise SystemExit(f"--seconds must be > 0, got {a.seconds}")
    if a.channel_ratios is not None:
        raise SystemExit("--channel-ratios was removed: quads@R is the product default rule (per-token "
                         "channels) and quads@R:channel the exact channel rule; use --block-ratios R,... to add the "
                         "16-channel block rule (quads@R:block) for the comparison")
    try:
        blk = [f"quads@{float(r):g}:block" for r in a.block_ratios.split(",") if r.strip()]
    except ValueError as e:
        raise SystemExit(f"--block-ratios must be a comma list of numbers in [0, 1], got {a.block_ratios!r}") from e
    a.modes = ",".join([m for m in a.modes.split(",") if m.strip()] + [m for m in blk if m not in a.modes.split(",")])
    for m in a.modes.split(","):  # a bad mode fails here, before the text / training phases
        from verl_quads.diagnostics.probe import parse_mode

        try:
            parse_mode(m)
        except ValueError as e:
            raise SystemExit(f"--modes / --block-ratios: {e}") from e
    if not a.toy and a.seconds + a.probe_reserve_s > a.max_total_s:
        raise SystemExit(
            f"--seconds {a.seconds:g} + --probe-reserve-s {a.probe_reserve_s:g} exceeds --max-total-s {a.max_total_s:g}: "
            "the probe would not fit in one device call. Lower --seconds, or shrink the probe (--modes, --seeds, "
            "--n-prompts, --rule-ratios '') and lower --probe-reserve-s, or raise --max-total-s if the call allows it."
        )
    from verl_quads.diagnostics import probe as P
    from verl_quads.diagnostics.outliers import activation_outlier_stats

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    phases: dict[str, float] = {}

    def phase(name: str, t0: float) -> float:
        phases[name] = round(time.perf_counter() - t0, 1)
        return time.perf_counter()
    betas = tuple(float(b) for b in a.adam_betas.split(","))
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise SystemExit(f"--adam-betas must be two numbers in [0, 1) as 'b1,b2', got {a.adam_betas!r}")
    train_docs, held_docs, prov = collect_source_text(a.max_files, a.max_file_bytes, a.seed)
    print(f"text: {prov['train_bytes'] / 1e6:.1f} MB train, {prov['heldout_bytes'] / 1e6:.2f} MB held-out from {prov['n_files']} files")
    ckpt = Path(a.ckpt) if a.ckpt else out / "model"
    t_ph = phase("text", t_all)
    tok = train_tokenizer(train_docs, ckpt, a.vocab, bos=a.bos)
    t_tok = time.perf_counter()
    ids = encode_docs(tok, train_docs)
    held = encode_docs(tok, held_docs)
    bos_id = tok.convert_tokens_to_ids(BOS) if a.bos else None
    prov["tokenizer"] = (f"byte-level BPE, vocab {len(tok)}, trained on the first 4 MB of the train documents; "
                         f"documents encoded separately, each followed by {EOS}"
                         + (f"; every training window and prompt starts with {BOS}" if a.bos else ""))
    prov["train_tokens"], prov["heldout_tokens"] = ids.numel(), held.numel()
    print(f"tokens: {ids.numel() / 1e6:.1f}M train, {held.numel() / 1e6:.2f}M held-out (encoded in {time.perf_counter() - t_tok:.1f}s)")
    del train_docs
    t_ph = phase("tokenizer", t_ph)
    model = build_model(len(tok), a.layers, a.hidden, a.heads, a.kv_heads, a.experts, a.top_k, a.inter, a.seed,
                        tie=a.tie_embeddings, device=a.device)
    model.config.eos_token_id = model.config.pad_token_id = tok.eos_token_id
    if a.bos:
        model.config.bos_token_id = bos_id
    win = min(256, a.seq) - a.bos
    probe_in = torch.stack([held[i * 256 : i * 256 + win] for i in range(4)])
    if a.bos:
        probe_in = torch.cat([torch.full((4, 1), bos_id, dtype=probe_in.dtype), probe_in], 1)
    stats_init = activation_outlier_stats(model.to(torch.bfloat16), probe_in.to(a.device))
    model.float()
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params; training up to {a.seconds:.0f}s on {a.device}")
    t_ph = phase("init+outliers_init", t_ph)
    train_s = a.seconds
    if not a.toy:
        left = a.max_total_s - a.probe_reserve_s - (time.perf_counter() - t_all)
        if left < a.seconds:
            print(f"training cut to {left:.0f}s (of --seconds {a.seconds:g}): {time.perf_counter() - t_all:.0f}s used before "
                  f"training, --probe-reserve-s {a.probe_reserve_s:g} kept of --max-total-s {a.max_total_s:g}", flush=True)
            train_s = max(1.0, left)
    tr = train(model, ids, seconds=train_s, seq=a.seq, batch=a.batch, lr=a.lr, device=a.device, seed=a.seed,
               betas=betas, weight_decay=a.weight_decay, wd_on=a.weight_decay_on, bos_id=bos_id,
               max_steps=a.max_steps or None)
    print(f"trained: {tr['steps']} steps, {tr['tokens'] / 1e6:.1f}M tokens, loss {tr['loss_first']:.3f} -> {tr['loss_last']:.3f}")
    tr["seconds_budget"] = train_s
    t_ph = phase("train", t_ph)
    report = {"provenance": prov, "args": vars(a), "training": tr, "outliers_init": stats_init,
              "how": "Qwen3-MoE trained from scratch on installed packages' .py files (byte-level BPE trained locally); "
                     "rollout = verl-quads rollout arithmetic over HF (no vLLM)", "phase_seconds": phases}

    def save() -> None:
        # rewritten after every phase: a device call's time limit can only cut what comes after
        report["wall_s"] = time.perf_counter() - t_all
        (out / "realistic.json").write_text(json.dumps(report, indent=1, default=float))

    model.to(torch.bfloat16)
    stats_trained = activation_outlier_stats(model, probe_in.to(a.device))
    print("\nactivation outliers (GEMM inputs): kurtosis and max/median channel absmax, random init -> trained")
    for k in stats_trained:
        i, t = stats_init[k], stats_trained[k]
        print(f"  {k:16s} kurtosis {i['kurtosis']:9.1f} -> {t['kurtosis']:9.1f}   max/median {i['max_over_median']:8.1f} -> "
              f"{t['max_over_median']:8.1f} (channel {t['max_channel']})")
    t_ph = phase("outliers_trained", t_ph)
    report["outliers_trained"] = stats_trained
    save()
    rules = None
    ratios = tuple(float(r) for r in a.rule_ratios.split(",") if r.strip())
    if ratios:
        t_r = time.perf_counter()
        rules = selection_rule_errors(model, probe_in.to(a.device), ratios)
        print()
        print(format_rule_table(rules) + f"  ({time.perf_counter() - t_r:.0f}s)")
    t_ph = phase("selection_rules", t_ph)
    report["selection_rules"] = rules
    save()
    model.save_pretrained(ckpt, safe_serialization=True)
    cfg = model.config
    del model
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    # held-out prompts: windows of held-out tokens, decoded back to text
    n_p = min(a.n_prompts, max(1, held.numel() // (a.prompt_tokens * 2)))
    prompts = tuple(tok.decode(held[i * a.prompt_tokens * 2 : i * a.prompt_tokens * 2 + a.prompt_tokens]) for i in range(n_p))
    # for a later `verl-quads probe --model <ckpt> --prompts <out>/prompts.json` on the same prompts (more seeds/modes)
    (out / "prompts.json").write_text(json.dumps(list(prompts)))
    res = P.run_probe(ckpt, modes=a.modes.split(","), prompts=prompts, seeds=tuple(range(a.seeds)),
                      max_new_tokens=a.max_new_tokens, engine="hf", device=a.device, guided_layers=cfg.num_hidden_layers)
    t_ph = phase("probe", t_ph)
    print()
    print(P.format_tables(res))
    P.write_outputs(res, out)
    report["probe"] = res.to_json()
    save()
    sweep = [int(x) for x in a.guided_sweep.split(",") if x] or sorted({max(1, cfg.num_hidden_layers // 4), max(1, cfg.num_hidden_layers // 2), cfg.num_hidden_layers})
    trace_sweep = {}
    for gl in sweep:
        r = P.run_probe(ckpt, modes=("trace",), prompts=prompts, seeds=tuple(range(a.seeds)), max_new_tokens=a.max_new_tokens,
                        engine="hf", device=a.device, guided_layers=gl, decompose=False)
        tot = r.per_mode["trace"]["total"]
        row = {"guided_layers": gl, "cache_bytes_per_token": guidance_bytes_per_token(cfg, gl), "total": tot}
        if "naive" in res.per_mode and "bf16" in res.per_mode:
            from verl_quads.diagnostics.stats import closure

            row["closure"] = {k: closure(tot[k]["mean"], res.per_mode["naive"]["total"][k]["mean"], res.per_mode["bf16"]["total"][k]["mean"])
                              for k in ("logp_gap_max", "logp_gap_p99", "logp_gap_mean")}
        trace_sweep[gl] = row
    t_ph = phase("trace_sweep", t_ph)
    print("\n== trace: closure vs guided layers (mean over seeds) ==")
    for gl, row in trace_sweep.items():
        c = row.get("closure", {})
        print(f"  guided {gl:3d}/{cfg.num_hidden_layers}: cache {row['cache_bytes_per_token']:7d} B/token  p99 "
              f"{row['total']['logp_gap_p99']['mean']:.4f}±{row['total']['logp_gap_p99']['std']:.4f}  closure p99 "
              f"{c.get('logp_gap_p99', float('nan')):.3f} max {c.get('logp_gap_max', float('nan')):.3f}")
    report["trace_sweep"] = trace_sweep
    save()
    extra = [m for m in a.extra_modes.split(",") if m.strip()]
    if extra:
        # a second, cheaper probe (no decomposition) after everything above is written, so that a device
        # call's time limit can only cut this part; bf16 and naive are rerun as its own closure anchors
        print(f"\n== extra modes (no decomposition): {','.join(extra)} ==", flush=True)
        anchors = [m for m in ("bf16", "naive") if m not in extra]
        rx = P.run_probe(ckpt, modes=anchors + extra, prompts=prompts, seeds=tuple(range(a.seeds)),
                         max_new_tokens=a.max_new_tokens, engine="hf", device=a.device,
                         guided_layers=cfg.num_hidden_layers, decompose=False)
        t_ph = phase("extra_probe", t_ph)
        print(P.format_tables(rx))
        P.write_outputs(rx, out / "extra", make_plot=False)
        report["probe_extra"] = rx.to_json()
        save()
    mom = lambda st: max(v["max_over_median"] for v in st.values())  # noqa: E731
    kur = lambda st: max(v["kurtosis"] for v in st.values())  # noqa: E731
    print(f"\n== summary ==\ntrained {tr['steps']} steps / {tr['seconds']:.0f}s, {tr['tokens'] / 1e6:.1f}M tokens, loss "
          f"{tr['loss_first']:.3f} -> {tr['loss_last']:.3f}; GEMM-input outliers over layers: max/median channel absmax "
          f"max {mom(stats_init):.1f} -> {mom(stats_trained):.1f}, kurtosis max {kur(stats_init):.1f} -> {kur(stats_trained):.1f}")
    tot = res.per_mode
    if "naive" in tot and "bf16" in tot:
        from verl_quads.diagnostics.stats import closure

        print("closure of the naive -> bf16-floor gap (p99 / max / mean, mean over seeds):")
        for m in tot:
            c = [closure(tot[m]["total"][k]["mean"], tot["naive"]["total"][k]["mean"], tot["bf16"]["total"][k]["mean"])
                 for k in ("logp_gap_p99", "logp_gap_max", "logp_gap_mean")]
            print(f"  {m:20s} {c[0]:6.3f} {c[1]:6.3f} {c[2]:6.3f}")
    print(f"\nphase seconds: {phases}")
    print(f"\nwrote {out / 'realistic.json'} ({report['wall_s']:.0f}s total)")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
