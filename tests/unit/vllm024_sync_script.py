"""Run by tests/unit/test_rollout_vllm024.py in a subprocess whose ``PYTHONPATH`` puts vLLM 0.24.0's
Python sources first: verl's colocated weight sync into vLLM 0.24's own ``Qwen3MoeForCausalLM``.

vLLM 0.24.0 on PyPI is a CUDA build; on this machine its Python runs but its compiled ops and a GPU do
not exist. What stands in for them (and only them):

- the platform: 0.24's own ``CpuPlatform`` (device ``cpu``, gloo) with the platform kind of an out-of-tree
  accelerator, so ``current_platform.is_cpu()`` is False and the unquantized layers keep their weights as
  on CUDA (on CPU 0.24 would repack them into oneDNN handles: a CPU-only path, not the users' one);
- the router's ``topk_softmax`` CUDA op (``torch.ops._moe_C``): a torch softmax + top-k, only for the
  MoE block forward at the end.

Everything else is the real code: 0.24's model classes, weight loaders, ``process_weights_after_loading``
and layerwise reload; verl 0.9.1's ``vLLMColocateWorkerExtension`` (its ``__new__`` included) with our
``vllm.general_plugins`` entry point's patch, verl's ``BucketedWeightSender`` / ``BucketedWeightReceiver``
(ZMQ + shared memory) between a sender thread and the worker; our trainer-side packing.

Steps for engine mode ``MODE`` (argv[1]; :func:`main`): (1) the engine loads the BF16 checkpoint
(quantized in ``process_weights_after_loading``); (2) sync A = the trainer's stream of the same,
untrained weights: nothing changes (the engine's own quantization == the trainer's packing, bit for
bit); (3) new weights (every parameter scaled by 1 + 5% noise), sync B: every packed parameter == the
stream (``torch.equal``), every unquantized one == the trainer's tensor, no parameter storage moved;
(4) sync A again: the engine holds exactly the state after (2) (A-B-A); (5) a stream for another
rollout mode is refused with the modes named and changes nothing; (6) the MoE block (0.24's runner) and
a fused linear forward reach our methods: equal to calling them directly. ``MODE`` = ``export``:
:func:`main_export` (a verl-quads export served by 0.24). Prints ``RESULT <json>`` lines and
``VLLM024-SYNC-OK`` at the end.
"""

import asyncio
import json
import os
import sys
import tempfile
import threading
import types

os.environ["VERL_RAY_JOB_ID"] = f"vq024_{os.getpid()}"  # private ZMQ socket name on a shared host

import torch  # noqa: E402
import vllm  # noqa: E402

assert vllm.__version__ == "0.24.0", vllm.__version__


def use_gpu_paths_platform() -> None:
    """Make vLLM's ``current_platform`` 0.24's CPU platform (device ``cpu``, gloo) reporting an out-of-tree
    accelerator, so that layers take their GPU code paths on CPU tensors. Call before building configs."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import PlatformEnum

    class HostTensorsGpuPathsPlatform(CpuPlatform):
        _enum = PlatformEnum.OOT

    platforms._current_platform = HostTensorsGpuPathsPlatform()


def result(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def raw(t):
    """The bytes of a tensor (float8 scales compare by encoding, 0-dim global scales too)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(a, b):
    """Names whose tensors differ (shape or bytes) between states a and b."""
    return sorted(n for n in a if a[n].shape != b[n].shape or not torch.equal(raw(a[n]), raw(b[n])))


def quantized_split(model, names):
    """(names of ``quads_nvfp4`` kernel parameters, the other names) among ``names`` (vLLM parameter names;
    routed experts live in a ``routed_experts`` child of the synced ``mlp.experts`` module)."""
    from verl_quads.sync.receiver import quads_layers

    layers = quads_layers(model)
    quant = {n for n in names if n.rpartition(".")[0].removesuffix(".routed_experts") in layers}
    return quant, [n for n in names if n not in quant]


def engine(model_dir, hf_overrides=None, enforce_eager=True):
    """(vllm_config, 0.24's model built and loaded by 0.24's loader, verl's worker extension around it)."""
    use_gpu_paths_platform()
    import verl  # noqa: F401  (verl next to vLLM, as in a user's GPU environment)
    from verl_quads.rollout import vllm_plugin

    vllm_plugin.register()  # the vllm.general_plugins entry point, as vLLM calls it
    assert vllm_plugin.skipped_patches() == {}, vllm_plugin.skipped_patches()
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension as Ext

    assert getattr(Ext.update_weights_from_ipc, "__verl_quads_patch__", None) == "vllm_packed_weight_sync"

    from vllm.config import CacheConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model

    mc = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), dtype="bfloat16", quantization="quads_nvfp4",
                     hf_overrides=hf_overrides or {}, max_model_len=128, enforce_eager=enforce_eager, seed=0)
    vc = VllmConfig(model_config=mc, load_config=LoadConfig(), cache_config=CacheConfig(enable_prefix_caching=False),
                    parallel_config=ParallelConfig(
                        worker_extension_cls="verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"))
    global _config_ctx
    _config_ctx = set_current_vllm_config(vc)  # held for the whole run (vLLM layers read it when built)
    _config_ctx.__enter__()
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"file://{tempfile.mkdtemp()}/init", backend="gloo")
    initialize_model_parallel(1)
    model = get_model(vllm_config=vc)
    assert type(vc.quant_config).__name__ == "QuadsNVFP4Config", vc.quant_config

    class Worker(Ext):  # vLLM mixes the extension into its worker class the same way
        pass

    worker = Ext.__new__(Worker, vllm_config=vc)
    worker.model_runner = types.SimpleNamespace(model=model, vllm_config=vc)
    worker.device, worker.local_rank = torch.device("cpu"), 0
    return vc, model, worker


def sync(worker, items):
    """verl's transfer: BucketedWeightSender in a thread, the worker's (patched) update_weights_from_ipc here.
    Returns the exception the worker raised, or None."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    handle = worker._get_zmq_handle()
    err = []

    def send():
        try:
            sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=1, use_shm=True)
            asyncio.run(sender.async_send_weights(iter(items)))
        except BaseException as e:  # noqa: BLE001
            err.append(repr(e))

    th = threading.Thread(target=send)
    th.start()
    raised = None
    try:
        worker.update_weights_from_ipc(use_shm=True)
    except Exception as e:  # noqa: BLE001
        raised = e
    th.join(timeout=120)
    assert not th.is_alive() and not err, err
    return raised


def main(mode: str) -> None:
    from verl_quads.models.tiny import build_tiny_qwen3_moe

    path = build_tiny_qwen3_moe(os.path.join(tempfile.mkdtemp(), "m"))
    vc, model, worker = engine(path, {"quantization_config": {"quant_method": "quads_nvfp4", "quant": mode}})
    assert vc.quant_config.mode == mode

    from transformers import AutoModelForCausalLM
    from verl.utils.model import convert_weight_keys

    from verl_quads.config import QuantConfig
    from verl_quads.qat import apply_qat
    from verl_quads.sync.format import HEADER_NAME, SyncModeError, decode_header, encode_header
    from verl_quads.sync.receiver import read_back_quads
    from verl_quads.sync.trainer import pack_for_rollout, plan_for_stock_trainer, plan_from_model

    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    if mode == "naive":  # stock trainer: the engine quantizes what it sends
        plan = plan_for_stock_trainer(trainer, QuantConfig(quant="naive"))
    else:
        apply_qat(trainer, mode, backend="torch")
        plan = plan_from_model(trainer)

    def stream(version):
        sd = convert_weight_keys(trainer.state_dict(), trainer)
        return list(pack_for_rollout(((n, p.detach().clone()) for n, p in sd.items()), plan, torch.bfloat16,
                                     backend="torch", version=version))

    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    loaded = state(model)
    n_quads = len(read_back_quads(model))
    assert n_quads == 4 * 3 * trainer.config.num_hidden_layers, n_quads  # qkv, o, w13, w2 x (packed, scale, gs)

    a = stream(0)
    assert sync(worker, a) is None
    after_a = state(model)
    result(event="sync_a_untrained", params=len(after_a), changed=same(loaded, after_a), quads=n_quads)
    assert same(loaded, after_a) == [], same(loaded, after_a)

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # new weights B (an update; TRACE's trainer forward would need rollout guidance)
        for p in trainer.parameters():
            p.mul_(1 + 0.05 * torch.randn(p.shape, generator=gen).to(p.dtype))
    b = stream(1)
    assert sync(worker, b) is None
    if mode == "trace":  # guidance captured from now on carries the synced policy version
        from verl_quads.rollout.capture import get_store

        assert get_store().policy_version == 1, get_store().policy_version
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        assert getattr(GPUModelRunner._model_forward, "_verl_quads_wrapped", False)  # 0.24's runner hook
    sent = dict(b)
    got = read_back_quads(model)
    bad_packed = same(got, {n: sent[n].reshape(got[n].shape) for n in got})
    after_b = state(model)
    hf = convert_weight_keys(trainer.state_dict(), trainer)
    _, unq = quantized_split(model, list(after_b))
    bad_unq = sorted(n for n in unq if not torch.equal(after_b[n], hf[n].to(torch.bfloat16)))
    moved = sorted(n for n, p in model.named_parameters() if p.data_ptr() != ptrs[n])
    result(event="sync_b_trained", packed=len(got), bad_packed=bad_packed, unquantized=len(unq), bad_unquantized=bad_unq,
           moved=moved, changed=len(same(after_a, after_b)))
    assert not bad_packed and not bad_unq and not moved, (bad_packed, bad_unq, moved)
    streamed_unq = set(quantized_split(model, [n for n, _ in b if n != HEADER_NAME])[1])
    assert set(unq) == streamed_unq, (sorted(unq), sorted(streamed_unq))  # every other engine weight was sent
    assert len(same(after_a, after_b)) == len(after_b), "every parameter changes with the update"

    assert sync(worker, a) is None
    aba = same(after_a, state(model))
    result(event="sync_a_again", changed_vs_first_a=aba)
    assert aba == []

    h = decode_header(b[0][1])
    other = "trace" if mode != "trace" else "quads"
    wrong = [(HEADER_NAME, encode_header(h["quant"], h["trainer_mode"], other, h["modules"], 2))] + b[1:]
    err = sync(worker, wrong)
    untouched = same(after_a, state(model))
    result(event="mode_mismatch", error=f"{type(err).__name__}: {err}"[:300], changed=untouched)
    assert isinstance(err, SyncModeError) and repr(other) in str(err) and repr(mode) in str(err), err
    assert untouched == []

    import vllm.model_executor.layers.fused_moe.router.fused_topk_router as topk_router
    from vllm.forward_context import set_forward_context

    def torch_topk_softmax(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize=False):
        p = gating_output.float().softmax(-1)
        w, i = p.topk(topk_weights.shape[1], -1)
        topk_weights.copy_(w / w.sum(-1, keepdim=True) if renormalize else w)
        topk_ids.copy_(i)
        return topk_weights, topk_ids

    topk_router.vllm_topk_softmax = torch_topk_softmax  # stands in for the CUDA op torch.ops._moe_C.topk_softmax
    x = torch.randn(5, trainer.config.hidden_size, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(7))
    block = model.model.layers[0].mlp
    experts = dict(block.named_modules())["experts.routed_experts"]
    with set_forward_context(None, vc):
        y = block(x)
    w, i = torch.nn.functional.linear(x, block.gate.weight).float().softmax(-1).topk(trainer.config.num_experts_per_tok, -1)
    direct = experts.quant_method.apply(experts, x, w / w.sum(-1, keepdim=True), i.to(torch.int32), None, None)
    qkv = model.model.layers[0].self_attn.qkv_proj
    with set_forward_context(None, vc):
        z = qkv(x)[0]
    result(event="forward", moe_equal=torch.equal(y, direct), qkv_equal=torch.equal(z, qkv.quant_method.apply(qkv, x)),
           moe_method=type(experts.quant_method).__name__)
    assert torch.equal(y, direct) and torch.equal(z, qkv.quant_method.apply(qkv, x))
    print("VLLM024-SYNC-OK", flush=True)


def main_export() -> None:
    """A verl-quads export (compressed-tensors NVFP4, w4a16) served by 0.24: the model directory asked for
    ``quantization="quads_nvfp4"`` (no hf_overrides) is claimed by our ``override_quantization_method``
    hook and its packed tensors are loaded as they are through 0.24's own weight loaders (fused q/k/v and
    gate/up shards, per-expert tensors): every packed parameter == the export read back as a sync stream
    (``export_to_sync_stream``, an independent re-assembly), and syncing that stream changes nothing."""
    from verl_quads.config import QuantConfig
    from verl_quads.models.tiny import build_tiny_qwen3_moe
    from verl_quads.sync.export import export_checkpoint, export_to_sync_stream
    from verl_quads.sync.receiver import read_back_quads

    tmp = tempfile.mkdtemp()
    path = build_tiny_qwen3_moe(os.path.join(tmp, "m"))
    out = os.path.join(tmp, "m_nvfp4")
    export_checkpoint(path, out, QuantConfig(quant="w4a16"))
    vc, model, worker = engine(out)
    assert vc.quant_config.packed_checkpoint and vc.quant_config.mode == "w4a16", vc.quant_config
    items = export_to_sync_stream(out)
    sent = dict(items)
    got = read_back_quads(model)
    bad_packed = same(got, {n: sent[n].reshape(got[n].shape) for n in got})
    loaded = state(model)
    _, unq = quantized_split(model, list(loaded))
    bad_unq = sorted(n for n in unq if n not in sent or not torch.equal(raw(loaded[n]), raw(sent[n])))
    assert sync(worker, items) is None
    changed = same(loaded, state(model))
    result(event="export_served", packed=len(got), bad_packed=bad_packed, unquantized=len(unq),
           bad_unquantized=bad_unq, changed_by_sync=changed)
    assert len(got) == 24 and len(unq) == len(loaded) - len(got), (len(got), len(unq), len(loaded))
    assert not bad_packed and not bad_unq and changed == []
    print("VLLM024-SYNC-OK", flush=True)


def main_trace_not_eager() -> None:
    """A trace engine that would run compiled / with CUDA graphs (vLLM's default on GPUs) is refused while it
    builds its layers, naming the setting and verl's key."""
    from verl_quads.models.tiny import build_tiny_qwen3_moe

    path = build_tiny_qwen3_moe(os.path.join(tempfile.mkdtemp(), "m"))
    try:
        engine(path, {"quantization_config": {"quant_method": "quads_nvfp4", "quant": "trace"}}, enforce_eager=False)
    except ValueError as e:
        result(event="trace_not_eager", error=str(e)[:400])
        assert "needs an eager engine" in str(e) and "actor_rollout_ref.rollout.enforce_eager=True" in str(e), e
        print("VLLM024-SYNC-OK", flush=True)
        return
    raise AssertionError("a compiled / CUDA-graph trace engine was not refused")


if __name__ == "__main__":
    {"export": main_export, "trace_not_eager": main_trace_not_eager}.get(sys.argv[1], lambda: main(sys.argv[1]))()
