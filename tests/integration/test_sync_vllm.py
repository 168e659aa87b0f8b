"""Packed NVFP4 weight sync through verl's update route into a real vLLM CPU engine (issue 6).

Runs ``sync_vllm_script.py`` in a fresh process (it initialises torch.distributed and starts a vLLM
engine-core process). Harness, not a full GRPO run: verl's FSDP2 engine built from verl's composed
config with ``actor_rollout_ref.actor.quant=quads`` (our QAT engine via ``EngineRegistry``), two
optimizer steps, ``engine.get_per_tensor_param()`` -> verl's ``BucketedWeightSender`` (ZMQ +
shared memory) -> verl's ``vLLMColocateWorkerExtension.update_weights_from_ipc`` in vLLM's worker
(patched by our vLLM plugin entry point). Asserts:

- after every sync (initial + after each of two optimizer steps): for every quantized layer, vLLM's
  dequantization of its quads_nvfp4 parameters equals the trainer's QAT effective weight
  (``torch.equal``); unquantized weights (embeddings, norms, router, lm_head, read back through
  vLLM's CPU kernels) equal the trainer's bf16 weights; the weights did change;
- bytes of the quantized layers ~0.28x of bf16;
- a wrong shape, a missing tensor, an unknown name, a trainer/engine mode mismatch and a stock
  (unquantized) stream each fail with an error naming the tensor / both modes, and leave every
  parameter and buffer of the vLLM model bit-identical.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.verl, pytest.mark.vllm]


def test_packed_sync_verl_engine_to_vllm(tmp_path):
    from verl_quads.models.tiny import build_tiny_qwen3_moe

    model = build_tiny_qwen3_moe(tmp_path / "model")
    script = Path(__file__).with_name("sync_vllm_script.py")
    port = str(random.randint(20000, 40000))
    proc = subprocess.run([sys.executable, str(script), str(model), port, "quads"], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    res = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    syncs = [r for r in res if r["event"] == "sync"]
    assert [s["index"] for s in syncs] == [0, 1, 2]
    for s in syncs:
        print(s)
        assert s["mismatched"] == [] and s["compared"] == 21, s  # 8 quantized + 13 unquantized weights
        assert s["n_quads_params"] == 8  # 2 layers x (qkv_proj, o_proj, experts w13, experts w2)
        assert 0.28125 <= s["ratio"] < 0.2825, s
    assert syncs[0]["n_changed_vs_engine_start"] == 0  # trainer packing == vLLM quantizing the same checkpoint
    assert syncs[1]["n_changed_vs_engine_start"] > 0
    changed = next(r for r in res if r["event"] == "trainer_changed")
    assert changed["n_changed"] == changed["n"]
    assert next(r for r in res if r["event"] == "generate_after_sync")["ok"]
    failures = {r["case"]: r for r in res if r["event"] == "failure_case"}
    expect = {
        "shape": r"qkv_proj\.weight_packed: trainer sent torch\.uint8 \(127, 32\), engine holds torch\.uint8 \(128, 32\)",
        "missing": r"missing from the trainer's stream.*qkv_proj\.weight_packed",
        "renamed": r"qkv_projX\.weight_packed: the engine's model has no module",
        "mode": r"trainer actor\.quant='w4a16'.*vs vLLM engine in quads_nvfp4 mode 'quads'",
        "unquantized": r"unquantized weights.*quads_nvfp4 mode 'quads'",
    }
    import re

    assert set(failures) == set(expect)
    for case, pattern in expect.items():
        f = failures[case]
        assert re.search(pattern, f["error"]), (case, f["error"])
        assert f["untouched"] and f["raw_diff"] == [] and f["n_raw"] > 0, (case, f)
    assert next(r for r in res if r["event"] == "generate_after_failures")["ok"]
