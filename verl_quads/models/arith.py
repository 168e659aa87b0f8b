"""Seeded two-operand arithmetic as a verifiable math task, in verl's gsm8k parquet layout.

Rows carry the fields of verl's own ``examples/data_preprocess/gsm8k.py`` output: ``data_source``
(``"openai/gsm8k"``, so verl's default reward routes them to its gsm8k rule scorer
``verl/utils/reward_score/gsm8k.py``), ``prompt`` (a chat list ending with gsm8k's instruction),
``ability``, ``reward_model`` (``{"style": "rule", "ground_truth": "<n>"}``) and ``extra_info``.

verl's gsm8k scorer (strict) takes the last ``#### <number>`` in the last 300 characters of the
response and compares it as a string with ``ground_truth``: the solution format taught to the demo
model is ``"23 + 58 = 81\\n#### 81"``.

Everything is a pure function of a seed: the same arguments give the same rows.
"""

from __future__ import annotations

import random
from pathlib import Path

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
OPS = ("+", "-")


def question(a: int, op: str, b: int) -> str:
    """The user message for ``a op b``."""
    return f"What is {a} {op} {b}? {INSTRUCTION}"


def solution(a: int, op: str, b: int) -> str:
    """The target response (what the demo model is trained to write)."""
    return f"{a} {op} {b} = {_value(a, op, b)}\n#### {_value(a, op, b)}"


def _value(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    raise ValueError(f"unknown op {op!r}; allowed: {OPS}")


def problems(n: int, *, seed: int, lo: int = 10, hi: int = 99, exclude: set | None = None) -> list[tuple[int, str, int]]:
    """``n`` distinct ``(a, op, b)`` with ``lo <= a, b <= hi`` (for ``-``: ``a >= b``), seeded."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    rng = random.Random(seed)
    exclude = exclude or set()
    out, seen = [], set(exclude)
    limit = 50 * n + 1000
    while len(out) < n:
        limit -= 1
        if limit < 0:
            raise ValueError(f"cannot draw {n} distinct problems in [{lo}, {hi}] excluding {len(exclude)}")
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(OPS)
        if op == "-" and a < b:
            a, b = b, a
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        out.append((a, op, b))
    return out


def rows(probs: list[tuple[int, str, int]], *, split: str) -> list[dict]:
    """verl RL rows (gsm8k schema) for the given problems."""
    out = []
    for i, (a, op, b) in enumerate(probs):
        out.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": question(a, op, b)}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(_value(a, op, b))},
                "extra_info": {"split": split, "index": i, "answer": solution(a, op, b), "question": question(a, op, b)},
            }
        )
    return out


def split_problems(*, seed: int = 0, n_train: int = 512, n_test: int = 128):
    """Disjoint train / test problem lists (test drawn first; train excludes it)."""
    test = problems(n_test, seed=seed * 1000 + 1)
    train = problems(n_train, seed=seed * 1000 + 2, exclude=set(test))
    return train, test


def write_parquet(out_dir: str | Path, *, seed: int = 0, n_train: int = 512, n_test: int = 128) -> tuple[Path, Path]:
    """Write ``train.parquet`` / ``test.parquet`` (verl-ready) into ``out_dir``; return their paths."""
    import pandas as pd

    train, test = split_problems(seed=seed, n_train=n_train, n_test=n_test)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, probs in (("train", train), ("test", test)):
        path = out / f"{split}.parquet"
        pd.DataFrame(rows(probs, split=split)).to_parquet(path)
        paths.append(path)
    return paths[0], paths[1]
