"""Which training settings give the realistic model's GEMM inputs outlier channels (CPU, small scale).

Trains one small Qwen3-MoE per *variant* of the training recipe of :mod:`verl_quads.diagnostics.realistic`
(same local text, tokenizer, seed, data order and number of optimizer steps; only the variant's
settings differ), then measures on held-out windows, with the project's own functions:

- activation outliers of every GEMM input (:func:`verl_quads.diagnostics.outliers.activation_outlier_stats`:
  kurtosis, max/median per-channel absmax), summarized over the decoder layers;
- how much of the NVFP4 activation error QUADS removes (:func:`verl_quads.diagnostics.realistic.selection_rule_errors`,
  per-token selection, median over GEMM calls of error / naive error at k = 0.25 and 0.5: lower is better);
- the held-out loss (so that a variant which only breaks the model is visible).

Nothing is injected: every outlier comes from training. Prints one table row per variant; ``--out``
gets the JSON. Example (CPU, ~2 min per variant on a loaded 2-core host): ``python -m verl_quads.diagnostics.outlier_sweep --steps 300``.

Measured 2026-11-30 (CPU, defaults: 4 layers, hidden 128, 8 experts top-2, 300 steps of 16 x 64 tokens,
seed 0, one run per variant; max/med = largest over the 8 GEMM inputs of max/median channel absmax,
kurt = largest kurtosis, quads/naive = median GEMM error ratio at k = 0.5)::

    variant                       loss train/held  max/med  kurt  quads/naive
    base (lr 1e-3)                  4.84 / 4.62      1.5     3.0     0.551
    wd_matrices                     4.85 / 4.64      1.5     3.0     0.548
    bos                             4.81 / 4.51      1.6     2.9     0.542
    beta2_0.999                     4.82 / 4.58      1.9     3.0     0.550
    tied                            5.02 / 4.78      1.6     2.9     0.540
    wd_matrices+bos                 4.81 / 4.52      1.5     2.9     0.553
    lr3e-3                          4.68 / 4.42      2.0     3.2     0.532
    wd_matrices+bos+lr3e-3          4.70 / 4.42      1.8     3.0     0.533
    ... +beta2_0.999                4.69 / 4.43      2.2     3.5     0.531
    lr1e-2                          5.00 / 4.68      3.1     7.7     0.477
    wd_matrices+bos+lr1e-2          5.01 / 4.67      3.8    13.1     0.495
    lr3e-2                          5.24 / 4.92      7.5    20.7     0.450

The learning rate is the lever (outliers grow monotonically with it, and QUADS removes more of the
error); weight decay on norms/embedding, BOS, tying and beta2 move little at this scale.

At the H200 model's width (``--layers 2 --hidden 1024 --heads 8 --kv-heads 2 --experts 8 --top-k 2
--inter 256 --vocab 2048 --seq 64 --batch 8 --steps 250``, ~280-500 s each on the shared CPU)::

    variant                       loss train/held  max/med  kurt  quads/naive k=.25 / k=.5
    base (lr 1e-3)                  4.81 / 4.53      4.4     6.5     0.728 / 0.527
    wd_matrices+bos                 4.84 / 4.37      6.6     9.7     0.718 / 0.510
    lr3e-3                          5.01 / 4.66      8.4    59.6     0.559 / 0.338
    wd_matrices+bos+lr3e-3          5.02 / 4.55     10.1    93.9     0.507 / 0.330

(one outlier channel, the same in every layer after layer 0's attention input; the BOS variants'
held-out loss includes the BOS-prefixed windows, so it is not comparable with the others').
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

#: variant name -> settings overriding :data:`BASE` (the sessions-1..3 recipe).
BASE = {"lr": 1e-3, "betas": (0.9, 0.95), "wd_on": "all", "bos": False, "tie": False}
VARIANTS = {
    "base": {},
    "wd_matrices": {"wd_on": "matrices"},
    "bos": {"bos": True},
    "lr3e-3": {"lr": 3e-3},
    "beta2_0.999": {"betas": (0.9, 0.999)},
    "tied": {"tie": True},
    "wd_matrices+bos": {"wd_on": "matrices", "bos": True},
    "wd_matrices+bos+lr3e-3": {"wd_on": "matrices", "bos": True, "lr": 3e-3},
    "lr1e-2": {"lr": 1e-2},
    "lr3e-2": {"lr": 3e-2},
    "wd_matrices+bos+lr1e-2": {"wd_on": "matrices", "bos": True, "lr": 1e-2},
    "wd_matrices+bos+lr3e-3+beta2_0.999": {"wd_on": "matrices", "bos": True, "lr": 3e-3, "betas": (0.9, 0.999)},
}


def summarize(stats: dict) -> dict:
    """max / median over the GEMM inputs of max_over_median and kurtosis, and layer 0's values."""
    mom = sorted(v["max_over_median"] for v in stats.values())
    kur = sorted(v["kurtosis"] for v in stats.values())
    return {"mom_max": mom[-1], "mom_median": mom[len(mom) // 2], "kurt_max": kur[-1], "kurt_median": kur[len(kur) // 2],
            "l0_attn_mom": stats["layer0.attn_in"]["max_over_median"], "l0_mlp_mom": stats["layer0.mlp_in"]["max_over_median"]}


def main(argv: list[str] | None = None) -> dict:
    import argparse

    from verl_quads.diagnostics import realistic as R
    from verl_quads.diagnostics.outliers import activation_outlier_stats

    p = argparse.ArgumentParser(prog="python -m verl_quads.diagnostics.outlier_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per variant (equal for all)")
    p.add_argument("--max-seconds", type=float, default=600.0, help="per-variant wall-time cap (reported if hit)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--inter", type=int, default=64)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-files", type=int, default=600)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    names = [v for v in a.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}; known: {list(VARIANTS)}")
    t0 = time.perf_counter()
    train_docs, held_docs, prov = R.collect_source_text(a.max_files, 20000, a.seed)
    tokdir = Path(a.out or "/tmp") / "outlier_sweep_tok"
    tok = R.train_tokenizer(train_docs, tokdir, a.vocab, sample_bytes=2 << 20, bos=True)  # BOS id unused unless a variant asks
    ids, held = R.encode_docs(tok, train_docs), R.encode_docs(tok, held_docs)
    bos_id = tok.convert_tokens_to_ids(R.BOS)
    print(f"data: {ids.numel() / 1e6:.2f}M train / {held.numel() / 1e6:.2f}M held-out tokens from {prov['n_files']} files "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)
    n_eval = 8
    win = torch.stack([held[i * a.seq : (i + 1) * a.seq] for i in range(n_eval)])
    rows = {}
    for name in names:
        v = {**BASE, **VARIANTS[name]}
        model = R.build_model(len(tok), a.layers, a.hidden, a.heads, a.kv_heads, a.experts, a.top_k, a.inter, a.seed,
                              tie=v["tie"], device=a.device)
        tr = R.train(model, ids, seconds=a.max_seconds, seq=a.seq, batch=a.batch, lr=v["lr"], device=a.device, seed=a.seed,
                     betas=v["betas"], wd_on=v["wd_on"], bos_id=bos_id if v["bos"] else None, max_steps=a.steps)
        x = win.clone()
        if v["bos"]:
            x = torch.cat([torch.full((n_eval, 1), bos_id, dtype=x.dtype), x[:, :-1]], 1)
        x = x.to(a.device)
        with torch.no_grad():
            held_loss = model(input_ids=x, labels=x).loss.item()
        st = activation_outlier_stats(model, x[:4])
        sr = R.selection_rule_errors(model, x[:4], (0.25, 0.5))
        rows[name] = {"settings": {k: list(val) if isinstance(val, tuple) else val for k, val in v.items()},
                      "steps": tr["steps"], "seconds": round(tr["seconds"], 1), "train_loss": tr["loss_last"],
                      "heldout_loss": held_loss, **summarize(st),
                      "naive_err": sr["mean"]["naive"],
                      "quads_ratio@0.25": sr["median_ratio_to_naive"]["per_token@0.25"],
                      "quads_ratio@0.5": sr["median_ratio_to_naive"]["per_token@0.5"], "outliers": st}
        r = rows[name]
        print(f"{name:24s} steps {r['steps']} ({r['seconds']:.0f}s) loss {r['train_loss']:.2f}/{r['heldout_loss']:.2f} "
              f"max/med max {r['mom_max']:.1f} med {r['mom_median']:.1f} kurt max {r['kurt_max']:.1f} "
              f"quads err/naive {r['quads_ratio@0.25']:.3f}/{r['quads_ratio@0.5']:.3f}", flush=True)
        del model
    m = {"layers": a.layers, "hidden": a.hidden, "experts": a.experts, "top_k": a.top_k, "inter": a.inter,
         "vocab": len(tok), "seq": a.seq, "batch": a.batch, "steps": a.steps}
    print(f"\n== outlier sweep: {m} on {a.device}, held-out windows; max/med = max over channels / median channel "
          "of per-channel absmax, over the 2*layers GEMM inputs ==")
    print(f"{'variant':24s} {'steps':>5s} {'sec':>5s} {'loss tr/held':>12s} {'max/med max':>11s} {'median':>7s} "
          f"{'L0 attn/mlp':>12s} {'kurt max':>8s} {'median':>7s} {'quads/naive k=.25':>17s} {'k=.5':>6s}")
    for name, r in rows.items():
        print(f"{name:24s} {r['steps']:5d} {r['seconds']:5.0f} {r['train_loss']:5.2f}/{r['heldout_loss']:5.2f}  "
              f"{r['mom_max']:11.1f} {r['mom_median']:7.1f} {r['l0_attn_mom']:5.1f}/{r['l0_mlp_mom']:6.1f} "
              f"{r['kurt_max']:8.1f} {r['kurt_median']:7.1f} {r['quads_ratio@0.25']:17.3f} {r['quads_ratio@0.5']:6.3f}")
    rep = {"model": m, "provenance": prov, "rows": rows, "wall_s": time.perf_counter() - t0}
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "outlier_sweep.json").write_text(json.dumps(rep, indent=1, default=float))
    return rep


if __name__ == "__main__":
    main(sys.argv[1:])
