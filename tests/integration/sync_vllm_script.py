"""Run by tests/integration/test_sync_vllm.py in a fresh process: packed weight sync, verl engine -> vLLM.

What runs is verl's and vLLM's own code, in the process layout verl uses (trainer process + vLLM
engine-core process, talking through verl's ZMQ/shared-memory bucket transfer):

1. a real vLLM CPU engine (engine core in its own process) with ``quantization="quads_nvfp4"`` in
   mode ``MODE`` and verl's ``vLLMColocateWorkerExtension`` as worker extension (our ``vllm.general_plugins``
   entry point patches its ``update_weights_from_ipc`` there);
2. verl's FSDP2 engine built through ``EngineRegistry`` from verl's composed config with
   ``actor_rollout_ref.actor.quant=MODE`` (our registered QAT engine), two optimizer steps;
3. each sync: ``engine.get_per_tensor_param()`` -> ``BucketedWeightSender`` (thread) while the engine
   core runs ``update_weights_from_ipc`` via ``collective_rpc`` — what verl's ``ServerAdapter`` does;
4. after each sync, vLLM's quads_nvfp4 parameters are read back from the engine-core process and
   compared with ``torch.equal`` to the trainer's QAT effective weights (computed by the QAT code from
   the engine's own parameters); then the failure cases (shape, name, mode, unquantized stream)
   must leave vLLM's weights untouched.

Prints ``RESULT <json>`` lines.
"""

import asyncio
import json
import os
import sys
import threading
import time

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
os.environ["VERL_RAY_JOB_ID"] = f"vqsync{os.getpid()}"  # private ZMQ socket name on a shared host

import torch  # noqa: E402


def result(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def read_back(worker):
    """quads_nvfp4 kernel parameters + every other weight as vLLM's CPU kernels hold it (router, lm_head
    read through their oneDNN GEMM, embeddings/norms directly)."""
    from verl_quads.patches.vllm_cpu_weight_reload import read_back_vllm_weights
    from verl_quads.sync.receiver import read_back_quads

    model = worker.model_runner.model
    out = read_back_quads(model)
    for name, t in read_back_vllm_weights(model).items():
        if ".experts." not in name and "qkv_proj" not in name and "o_proj" not in name:
            out[name] = t
    return out


def raw_state(worker):
    """Every parameter and buffer of the vLLM model as stored (packed kernel layouts included)."""
    model = worker.model_runner.model
    out = {f"p:{n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"b:{n}": b.detach().clone() for n, b in model.named_buffers()})
    return out


def main(model_dir: str, port: str, mode: str) -> None:
    import vllm

    t0 = time.time()
    llm = vllm.LLM(
        model_dir, quantization="quads_nvfp4",
        hf_overrides={"quantization_config": {"quant_method": "quads_nvfp4", "quant": mode}},
        worker_extension_cls="verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension",
        enforce_eager=True, dtype="bfloat16", max_model_len=128, seed=0, enable_prefix_caching=False,
        kv_cache_memory_bytes=32 << 20,
    )
    result(event="engine_started", seconds=round(time.time() - t0, 1))
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=8)
    prompts = ["one two three", "the cat sat"]
    gen0 = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    handle = llm.collective_rpc("_get_zmq_handle")[0]
    initial = llm.collective_rpc(read_back)[0]

    import torch.distributed as dist

    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=0, world_size=1)
    import verl  # noqa: F401  (loads the verl-quads plugin)
    from hydra import compose, initialize_config_module
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    from verl_quads.rollout.emulation import weight_f32
    from verl_quads.sync.format import HEADER_NAME, encode_header
    from verl_quads.sync.trainer import plan_from_model, qat_effective_experts, qat_effective_linear

    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.strategy=fsdp2",
            f"actor_rollout_ref.actor.quant={mode}", "actor_rollout_ref.actor.rollout_n=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.actor.optim.lr=1e-2",
            "actor_rollout_ref.model.use_remove_padding=False",
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa", "trainer.device=cpu"])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    engine = EngineRegistry.new(model_type="language_model", backend=actor.engine.strategy, model_config=model_config,
                                engine_config=actor.engine, optimizer_config=actor.optim,
                                checkpoint_config=actor.checkpoint)
    engine.initialize()
    module = engine.module
    result(event="trainer_ready", engine=type(engine).__name__)

    def trainer_effective() -> dict:
        """QAT effective weights (vLLM names/layout) from the engine's own parameters, QAT code path."""
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in module.state_dict().items()}
        plan = plan_from_model(module)
        eff = {}
        for group, members in plan.linear_groups.items():
            eff[f"{group}.weight"] = qat_effective_linear([full[m + ".weight"] for m in members], torch.bfloat16)
        for mod, transposed in plan.experts.items():
            eff[f"{mod}.w13_weight"] = qat_effective_experts(full[mod + ".gate_up_proj"], transposed, torch.bfloat16)
            eff[f"{mod}.w2_weight"] = qat_effective_experts(full[mod + ".down_proj"], transposed, torch.bfloat16)
        for n, t in full.items():
            if ".experts." not in n and "_proj." not in n:  # unquantized: embeddings, norms, router, lm_head
                eff[n] = t.to(torch.bfloat16)
        return eff

    def compare(vllm_state: dict, eff: dict) -> dict:
        """torch.equal of vLLM's dequantized weights (its own f32 dequant, cast to bf16) vs the trainer."""
        bad, n = [], 0
        for name, want in eff.items():
            if name.endswith("weight") and f"{name}_packed" in vllm_state:
                got = weight_f32(vllm_state[f"{name}_packed"], vllm_state[f"{name}_scale"],
                                 vllm_state[f"{name}_global_scale"]).to(torch.bfloat16)
            else:
                got = vllm_state[name]
            n += 1
            if got.shape != want.shape or not torch.equal(got, want):
                bad.append(name)
        return {"compared": n, "mismatched": bad}

    def sync(stream) -> tuple[float, str | None]:
        err = []

        def send():
            try:
                asyncio.run(BucketedWeightSender(zmq_handle=handle, bucket_size_mb=16, use_shm=True).async_send_weights(stream))
            except BaseException as e:  # noqa: BLE001
                err.append(repr(e))

        th = threading.Thread(target=send)
        t = time.time()
        th.start()
        rpc_error = None
        try:
            llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True})
        except Exception as e:  # noqa: BLE001
            rpc_error = f"{type(e).__name__}: {e}"
        th.join(timeout=120)
        assert not err, err
        return time.time() - t, rpc_error

    def step(seed: int):
        ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(seed))
        engine.optimizer_zero_grad()
        module(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        engine.optimizer_step()

    def params_now():
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in module.state_dict().items()}

    # sync 0: initial weights (as verl does before the first rollout), then a step + sync, twice
    p_start = params_now()
    for i in range(3):
        if i:
            step(i)
        per_tensor, _ = engine.get_per_tensor_param()
        dt, rpc_error = sync(per_tensor)
        assert rpc_error is None, rpc_error
        stats = engine._verl_quads_last_sync
        state = llm.collective_rpc(read_back)[0]
        cmp = compare(state, trainer_effective())
        changed_vs_initial = sorted(k for k in state if k in initial and not torch.equal(state[k], initial[k]))
        result(event="sync", index=i, seconds=round(dt, 2), **cmp, n_changed_vs_engine_start=len(changed_vs_initial),
               n_quads_params=sum(1 for k in state if k.endswith("_packed")), packed_bytes=stats.packed_bytes,
               bf16_bytes=stats.bf16_quantized_bytes, passthrough_bytes=stats.passthrough_bytes,
               total_bytes=stats.total_bytes, ratio=stats.quantized_ratio)
    p_end = params_now()
    result(event="trainer_changed", n_changed=sum(not torch.equal(p_start[k], p_end[k]) for k in p_start), n=len(p_start))
    gen1 = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    result(event="generate_after_sync", ok=all(len(g) > 0 for g in gen1), changed=gen0 != gen1)

    good = llm.collective_rpc(read_back)[0]
    base = list(engine.get_per_tensor_param()[0])

    def with_changes(items, *, drop=None, reshape=None, header=None, poison_embed=True):
        out = []
        for n, t in items:
            if n == HEADER_NAME and header is not None:
                t = header
            if drop is not None and n.endswith(drop):
                continue
            if reshape is not None and n.endswith(reshape):
                t = t[:-1]
            if poison_embed and n == "model.embed_tokens.weight":
                t = t * 2  # arrives before the bad tensor: must not be written either
            out.append((n, t))
        return out

    first_packed = next(n for n, _ in base if n.endswith("qkv_proj.weight_packed"))
    cases = {
        "shape": with_changes(base, reshape=first_packed),
        "missing": with_changes(base, drop=first_packed),
        "renamed": [(n.replace("qkv_proj", "qkv_projX") if n == first_packed else n, t) for n, t in with_changes(base)],
        "mode": with_changes(base, header=encode_header("w4a16" if mode != "w4a16" else "quads", "w4a16",
                                                        "w4a16" if mode != "w4a16" else "quads",
                                                        json.loads(bytes(dict(base)[HEADER_NAME].tolist()))["modules"])),
        "unquantized": [(n, t) for n, t in with_changes(base) if n != HEADER_NAME],
    }
    raw_good = llm.collective_rpc(raw_state)[0]
    for case, items in cases.items():
        _, rpc_error = sync(iter(items))
        now = llm.collective_rpc(read_back)[0]
        untouched = all(torch.equal(now[k], good[k]) for k in good)
        raw_now = llm.collective_rpc(raw_state)[0]
        raw_diff = sorted(k for k in raw_good if k not in raw_now or not torch.equal(raw_now[k], raw_good[k]))
        result(event="failure_case", case=case, error=(rpc_error or "")[-600:], untouched=untouched,
               raw_diff=raw_diff[:10], n_raw=len(raw_good))
    gen2 = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    result(event="generate_after_failures", ok=all(len(g) > 0 for g in gen2))
    llm.llm_engine.engine_core.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
