"""Run by tests/integration/test_qat_verl_engine.py in a fresh process (it initialises torch.distributed).

For each mode given on the command line: compose verl's config with ``actor_rollout_ref.actor.quant=<mode>``,
build verl's FSDP2 engine through ``EngineRegistry`` exactly as verl's worker does, initialise it
(model load, QAT, FSDP2, optimizer), run forward/backward and one optimizer step, and compare with
``verl_quads.qat.apply_qat`` on a plain HF model loaded the same way. Prints one JSON line per mode.
"""

import dataclasses
import json
import os
import sys

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import verl  # noqa: E402,F401  (loads the verl-quads plugin)
from hydra import compose, initialize_config_module  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402


def main(model_dir: str, port: str, modes: list[str]) -> None:
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=0, world_size=1)
    from transformers import AutoModelForCausalLM
    from verl.workers.engine import EngineRegistry

    from verl_quads.qat import GuidanceError, apply_qat

    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    for spec in modes:
        quant, _, weight_qdq = spec.partition(":")  # e.g. "quads:per_version"
        extra = [f"actor_rollout_ref.actor.quant_config.weight_qdq={weight_qdq}"] if weight_qdq else []
        with initialize_config_module("verl.trainer.config", version_base=None):
            cfg = compose("ppo_trainer", overrides=extra + [
                f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.strategy=fsdp2",
                f"actor_rollout_ref.actor.quant={quant}", "actor_rollout_ref.actor.rollout_n=1",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.actor.optim.lr=1e-2",
                "actor_rollout_ref.model.use_remove_padding=False",
                "+actor_rollout_ref.model.override_config.attn_implementation=sdpa", "trainer.device=cpu"])
        actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
        engine = EngineRegistry.new(model_type="language_model", backend=actor.engine.strategy,
                                    model_config=model_config, engine_config=actor.engine,
                                    optimizer_config=actor.optim, checkpoint_config=actor.checkpoint)
        engine.initialize()
        module = engine.module
        kinds = sorted({type(m).__name__ for m in module.modules() if type(m).__name__.startswith(("QAT", "FSDPQAT"))})
        # Reference: the HF model loaded like verl's actor (fp32 master), params cast to the FSDP2
        # mixed-precision param dtype (bf16), buffers fp32, then verl-quads QAT directly.
        ref = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="sdpa")
        for p in ref.parameters():
            p.data = p.data.to(torch.bfloat16)
        # the reference QDQs in its forward (per_forward; per_version needs FSDP2): same values bit for bit
        apply_qat(ref, dataclasses.replace(actor.quant_settings, weight_qdq="per_forward"))
        qat_state = getattr(module, "_verl_quads_qat", None)
        out = {"quant": spec, "engine": type(engine).__name__, "qat_classes": kinds,
               "weight_qdq": None if qat_state is None else qat_state.weight_qdq}  # what fsdp_qdq.setup chose
        try:
            logits = module(input_ids=ids).logits
        except GuidanceError as e:
            out["error"] = str(e)
            print("RESULT " + json.dumps(out), flush=True)
            continue
        with torch.no_grad():
            ref_logits = ref(input_ids=ids).logits
        out["logits_equal_ref"] = bool(torch.equal(logits.detach().float(), ref_logits.float()))
        before = {n: p.detach().full_tensor().clone() for n, p in module.named_parameters()}
        engine.optimizer_zero_grad()
        logits.float().logsumexp(-1).mean().backward()
        engine.optimizer_step()
        if qat_state is not None and qat_state.fsdp_qdq is not None:  # per_version: stale caches freed by the step
            out["caches_freed_by_step"] = all(e.cache is None for e in qat_state.fsdp_qdq.entries)
        after = {n: p.detach().full_tensor() for n, p in module.named_parameters()}
        out["changed"] = sum(not torch.equal(before[n], after[n]) for n in before)
        out["params"] = len(before)
        # the next forward uses the stepped weights (per_version: refreshed in the root pre-forward hook)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(after[n])  # fp32 master -> bf16, FSDP2's cast
            out["after_step_equal_ref"] = bool(torch.equal(module(input_ids=ids).logits.float(),
                                                           ref(input_ids=ids).logits.float()))
        out["finite"] = all(bool(torch.isfinite(v).all()) for v in after.values())
        out["names_stock"] = all(".parametrizations." not in n and "_orig_mod" not in n for n in after)
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
