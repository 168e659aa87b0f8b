"""Keep the code rows of PRIME-RL/Eurus-2-RL-Data for recipes/grpo_code_qwen3_30b_a3b.args.

``python3 recipes/prepare_code_data.py <downloaded dataset dir> <out dir>``: reads every
``*.parquet`` under the first directory (the dataset is already in verl's RL layout: ``data_source``,
``prompt``, ``ability``, ``reward_model``, ``extra_info``), keeps ``ability == "code"`` and writes
``train.parquet`` / ``validation.parquet`` (by the file name's split) into the output directory.
Fails if a file lacks verl's fields or no code rows are found. Runs where the data was downloaded.
"""

import sys
from pathlib import Path

import pandas as pd

FIELDS = {"data_source", "prompt", "ability", "reward_model"}


def main(src: str, out: str) -> None:
    files = sorted(Path(src).expanduser().rglob("*.parquet"))
    if not files:
        raise SystemExit(f"no .parquet files under {src}")
    parts: dict[str, list[pd.DataFrame]] = {"train": [], "validation": []}
    for f in files:
        split = "validation" if "valid" in f.name or "test" in f.name else "train"
        df = pd.read_parquet(f)
        missing = FIELDS - set(df.columns)
        if missing:
            raise SystemExit(f"{f}: not in verl's RL layout, missing {sorted(missing)}")
        parts[split].append(df[df["ability"] == "code"])
    Path(out).expanduser().mkdir(parents=True, exist_ok=True)
    for split, dfs in parts.items():
        df = pd.concat(dfs) if dfs else pd.DataFrame()
        if df.empty:
            raise SystemExit(f"no code rows for split {split!r} in {src}")
        path = Path(out).expanduser() / f"{split}.parquet"
        df.to_parquet(path)
        print(f"{path}: {len(df)} rows, data_source {sorted(df['data_source'].unique())}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
