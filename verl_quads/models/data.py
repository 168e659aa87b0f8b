"""Tiny gsm8k-style RL datasets in verl's parquet layout (made locally, no downloads).

verl's ``RLHFDataset`` reads parquet rows with these fields (the layout of verl's own
``examples/data_preprocess/gsm8k.py``): ``data_source``, ``prompt`` (a chat list),
``ability``, ``reward_model`` (``{"style": "rule", "ground_truth": ...}``) and ``extra_info``.
``data_source="openai/gsm8k"`` routes verl's default reward to its gsm8k rule scorer.
"""

from __future__ import annotations

import random
from pathlib import Path

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Mark", "Albert", "Ken", "Alexis", "Tina"]
THINGS = ["clips", "apples", "dollars", "pages", "eggs", "books", "cookies", "marbles"]


def make_gsm8k_rows(n: int, *, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` synthetic addition word problems as verl RL rows (gsm8k schema)."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for i in range(n):
        who, what = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        question = f"{who} has {a} {what} and buys {b} more {what}. How many {what} does {who} have now?"
        answer = str(a + b)
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {
                    "split": split,
                    "index": i,
                    "answer": f"{a} + {b} = {answer}\n#### {answer}",
                    "question": question,
                },
            }
        )
    return rows


def write_gsm8k_parquet(out_dir: str | Path, *, n_train: int = 64, n_test: int = 16, seed: int = 0) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``test.parquet`` into ``out_dir``; return their paths."""
    import pandas as pd

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", n_train), ("test", n_test)):
        path = out / f"{split}.parquet"
        pd.DataFrame(make_gsm8k_rows(n, seed=seed, split=split)).to_parquet(path)
        paths.append(path)
    return paths[0], paths[1]


def digit_reward(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """A dense reward for random tiny models (use via verl's ``custom_reward_function``).

    A random policy never writes ``#### <answer>``, so verl's gsm8k rule reward is 0 for every
    sample, every GRPO group has zero advantage and the policy gradient vanishes. This reward
    is the fraction of response characters that are digits of the ground truth, which varies
    within a group and so gives GRPO a real learning signal. Signature: verl's
    ``compute_score(data_source, solution_str, ground_truth, extra_info)``.
    """
    if not solution_str:
        return 0.0
    wanted = set(str(ground_truth))
    return sum(ch in wanted for ch in solution_str) / len(solution_str)
