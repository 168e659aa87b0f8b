"""vLLM side of the packed weight sync: validate the whole stream, then load it in place.

Runs inside vLLM's worker process, in place of verl's ``update_weights_from_ipc`` when the engine's
quantization is ``quads_nvfp4`` (wired by ``verl_quads/patches/vllm_packed_weight_sync.py``):

1. receive every bucket through verl's ``BucketedWeightReceiver`` and stage the tensors (cloned:
   the IPC bucket buffer is reused). Staging costs the packed size (~0.28x of the quantized layers'
   bf16 size plus the unquantized tensors) on the engine's device for the duration of the sync;
   it is what makes "validate everything before the first write" possible.
2. :func:`plan_load` checks, before anything is written: the header (trainer mode vs engine mode),
   the set of quantized modules (trainer vs engine), every packed tensor's name, dtype and shape
   against the ``quads_nvfp4`` parameter it targets, complete coverage of every quantized layer, and
   for unquantized tensors that they name a module of this model and do not target a quantized
   layer. Any problem raises :class:`~verl_quads.sync.format.SyncError` and the engine keeps its
   previous weights.
3. :func:`apply_load`: unquantized tensors through vLLM's ``model.load_weights`` with vLLM's
   layerwise reload initialised only on the modules that receive them (on vLLM CPU, linear/embedding
   kernels repack their weights, so a plain re-load is impossible; the reload re-processes those
   layers and copies the results into the original storage); then each packed tensor is written with
   ``param.data.copy_`` into the ``quads_nvfp4`` parameter (storage never moves, no re-quantization,
   ``process_weights_after_loading`` is not re-run for quantized layers).

Tensor parallelism: the trainer sends every packed tensor whole (full-tensor global scales, which every
rank keeps unchanged); each vLLM rank takes its own slice (:func:`local_shard`: output rows of column-
parallel layers, per fused member for q/k/v and gate/up, packed K bytes and block-scale columns of
row-parallel layers, the intermediate dim of the experts). Exact: packing and 16-element blocks run along
K, and vLLM requires K per rank to be a multiple of 16 (``quads_nvfp4``'s ``create_weights``), so a
slice of the packed tensor is the packing of the slice. Expert parallelism is refused.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from verl_quads.sync.format import (
    EXPERT_PARAMS,
    HEADER_NAME,
    LINEAR_PARAMS,
    SyncError,
    SyncModeError,
    decode_header,
    is_renamed,
    vllm_module_of,
)

logger = logging.getLogger("verl_quads")
DUMP_ENV = "VERL_QUADS_SYNC_DUMP_DIR"
_dump_counter = itertools.count()


def engine_quant_config(vllm_config):
    """The engine's ``QuadsNVFP4Config`` or None."""
    from verl_quads.rollout.quant_config import QuadsNVFP4Config

    qc = getattr(vllm_config, "quant_config", None)
    return qc if isinstance(qc, QuadsNVFP4Config) else None


#: vLLM 0.32 keeps the routed experts' parameters in a child ``routed_experts`` of the model's
#: ``mlp.experts`` module; the sync names experts by the checkpoint's module (``mlp.experts``).
_ROUTED_CHILD = ".routed_experts"


def quads_layers(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, tuple[str, ...]]]:
    """Sync name -> (module, its kernel parameter names) for every ``quads_nvfp4``-quantized layer.

    The sync name is the vLLM module name, except that routed experts are named by their checkpoint
    module (``...mlp.experts``, not vLLM 0.32's ``...mlp.experts.routed_experts``).
    """
    from verl_quads.rollout.linear import QuadsNVFP4LinearMethod
    from verl_quads.rollout.moe import QuadsNVFP4MoEMethod

    out = {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if isinstance(qm, QuadsNVFP4LinearMethod):
            out[name] = (mod, LINEAR_PARAMS)
        elif isinstance(qm, QuadsNVFP4MoEMethod):
            out[name.removesuffix(_ROUTED_CHILD)] = (mod, EXPERT_PARAMS)
    return out


def _rows(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    if start + size > t.shape[0]:
        raise SyncError(f"packed weight sync: tensor of {t.shape[0]} rows has no rows [{start}, {start + size})")
    return t.narrow(0, start, size)


def local_shard(module: torch.nn.Module, leaf: str, t: torch.Tensor) -> torch.Tensor:
    """This tensor-parallel rank's part of a whole packed tensor ``t`` (stream layout) for ``module``.

    ``leaf`` is the kernel parameter (``weight_packed`` / ``weight_scale`` / ``weight_global_scale``,
    ``w13_*`` / ``w2_*`` for experts). Global scales are the full tensor's and are not sliced. Linear
    layers: ``QKVParallelLinear`` (q rows by rank, k/v rows by ``rank // num_kv_head_replicas``),
    ``MergedColumnParallelLinear`` (each member's rows by rank), ``ColumnParallelLinear`` (rows),
    ``RowParallelLinear`` (columns of the packed bytes / block scales), ``ReplicatedLinear`` (whole).
    Experts: ``w13`` gate and up rows by rank, ``w2`` columns by rank. Returns ``t`` itself at TP=1.
    """
    if leaf.endswith("global_scale"):
        return t
    moe = getattr(module, "moe_config", None)
    if moe is not None:
        par = moe.moe_parallel_config
        if par.use_ep or par.ep_size > 1:
            raise SyncError(f"packed weight sync: {leaf}: expert parallelism (ep_size={par.ep_size}) is not supported")
        tp, r = int(par.tp_size), int(par.tp_rank)
        if tp == 1:
            return t
        if leaf.startswith("w13"):
            inter = t.shape[1] // 2
            per = inter // tp
            return torch.cat([t.narrow(1, r * per, per), t.narrow(1, inter + r * per, per)], dim=1)
        per = t.shape[-1] // tp
        return t.narrow(-1, r * per, per)
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    tp, r = int(getattr(module, "tp_size", 1)), int(getattr(module, "tp_rank", 0))
    if tp == 1 or isinstance(module, ReplicatedLinear):
        return t
    if isinstance(module, RowParallelLinear):
        per = t.shape[-1] // tp
        return t.narrow(-1, r * per, per)
    if isinstance(module, QKVParallelLinear):
        q = module.total_num_heads * module.head_size
        k = module.total_num_kv_heads * module.head_size
        v = module.total_num_kv_heads * module.v_head_size
        if q + k + v != t.shape[0]:
            raise SyncError(f"packed weight sync: {leaf}: {t.shape[0]} rows sent, q/k/v of the model have {q}+{k}+{v}")
        kv_rank = r // module.num_kv_head_replicas
        qs, ks, vs = module.num_heads * module.head_size, module.num_kv_heads * module.head_size, \
            module.num_kv_heads * module.v_head_size
        return torch.cat([_rows(t, r * qs, qs), _rows(t, q + kv_rank * ks, ks), _rows(t, q + k + kv_rank * vs, vs)])
    if isinstance(module, MergedColumnParallelLinear):
        if sum(module.output_sizes) != t.shape[0]:
            raise SyncError(f"packed weight sync: {leaf}: {t.shape[0]} rows sent, members have {module.output_sizes}")
        parts, start = [], 0
        for size in module.output_sizes:
            per = size // tp
            parts.append(_rows(t, start + r * per, per))
            start += size
        return torch.cat(parts)
    if isinstance(module, ColumnParallelLinear):
        per = module.output_size_per_partition
        return _rows(t, r * per, per)
    raise SyncError(f"packed weight sync: {leaf}: no tensor-parallel slicing for layer type {type(module).__name__}")


@dataclass
class LoadPlan:
    """What :func:`apply_load` writes. ``packed``: (vLLM param name, parameter, tensor)."""

    header: dict
    packed: list[tuple[str, torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)
    unquantized: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    owners: dict[str, torch.nn.Module] = field(default_factory=dict)

    @property
    def packed_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, _, t in self.packed)


def _reference_shape(module: torch.nn.Module, leaf: str) -> torch.Size | None:
    """Shape a parameter had when created (vLLM's reload metadata), else its live shape."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        info = LAYERWISE_INFO.get(module)
        if info is not None and info.restore_metadata and leaf in info.restore_metadata[0]:
            return info.restore_metadata[0][leaf].shape
    except ImportError:  # pragma: no cover
        pass
    t = module._parameters.get(leaf)
    if t is None:
        t = module._buffers.get(leaf)
    return None if t is None else t.shape


def plan_load(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]], engine_mode: str) -> LoadPlan:
    """Validate a whole staged sync against ``model`` (see module docstring). Writes nothing."""
    names = [n for n, _ in weights]
    if HEADER_NAME not in names:
        raise SyncModeError(
            f"packed weight sync: the trainer sent unquantized weights (no {HEADER_NAME}: trainer "
            f"actor.quant=none or a stock verl engine) to a vLLM engine in quads_nvfp4 mode {engine_mode!r}. "
            "Set actor_rollout_ref.actor.quant on the trainer to the engine's mode."
        )
    header = decode_header(dict(weights)[HEADER_NAME])
    if header["rollout_mode"] != engine_mode:
        raise SyncModeError(
            f"packed weight sync: trainer actor.quant={header['quant']!r} (trainer mode {header['trainer_mode']!r}, "
            f"rollout mode {header['rollout_mode']!r}) vs vLLM engine in quads_nvfp4 mode {engine_mode!r}"
        )
    layers = quads_layers(model)
    if sorted(layers) != header["modules"]:
        only_t = sorted(set(header["modules"]) - set(layers))
        only_e = sorted(set(layers) - set(header["modules"]))
        raise SyncError(
            "packed weight sync: the trainer and the engine quantize different modules (ignore lists differ?): "
            f"only on the trainer {only_t[:8]}, only in the engine {only_e[:8]}"
        )
    modules = dict(model.named_modules())
    plan = LoadPlan(header=header)
    seen: set[str] = set()
    for name, t in weights:
        if name == HEADER_NAME:
            continue
        mod_name, _, leaf = name.rpartition(".")
        if mod_name in layers and leaf in layers[mod_name][1]:
            param = layers[mod_name][0]._parameters.get(leaf)
            if param is not None and param.shape != t.shape:  # TP > 1: this rank's slice of the whole tensor
                t = local_shard(layers[mod_name][0], leaf, t)
            if param is None:
                raise SyncError(f"packed weight sync: {name}: the engine's layer has no parameter {leaf!r}")
            if param.dtype != t.dtype or param.shape != t.shape:
                raise SyncError(
                    f"packed weight sync: {name}: trainer sent {t.dtype} {tuple(t.shape)}, engine holds "
                    f"{param.dtype} {tuple(param.shape)}"
                )
            if name in seen:
                raise SyncError(f"packed weight sync: {name} sent twice")
            seen.add(name)
            plan.packed.append((name, param, t))
            continue
        target = vllm_module_of(mod_name)
        if target in layers and leaf != "bias":
            raise SyncModeError(
                f"packed weight sync: {name} arrives unquantized but {target} is an NVFP4 layer of the engine "
                f"(mode {engine_mode!r}); the trainer (actor.quant={header['quant']!r}) did not pack it"
            )
        owner = modules.get(target)
        if owner is None:
            raise SyncError(f"packed weight sync: {name}: the engine's model has no module {target!r}")
        if not is_renamed(mod_name) and target not in layers:
            ref = _reference_shape(owner, leaf)
            if ref is None:
                raise SyncError(f"packed weight sync: {name}: module {target} has no tensor {leaf!r}")
            # vocab-parallel embeddings may pad the first dim; under TP > 1 a rank holds a slice (vLLM's own
            # loader slices): each dim may then be up to tp_size times the rank's
            tp = int(getattr(owner, "tp_size", 1) or 1)
            if tp == 1:
                bad = len(ref) != t.dim() or tuple(ref[1:]) != tuple(t.shape[1:]) or (t.dim() and t.shape[0] > ref[0])
            else:
                bad = len(ref) != t.dim() or any(n > d * tp for n, d in zip(t.shape, ref))
            if bad:
                raise SyncError(f"packed weight sync: {name}: trainer sent {tuple(t.shape)}, engine expects {tuple(ref)}"
                                + (f" per rank (tensor parallel {tp})" if tp > 1 else ""))
        plan.unquantized.append((name, t))
        if target not in layers:
            plan.owners[target] = owner
    expected = {f"{m}.{p}" for m, (_, ps) in layers.items() for p in ps}
    missing = sorted(expected - seen)
    if missing:
        raise SyncError(f"packed weight sync: {len(missing)} quantized tensors missing from the trainer's stream, e.g. {missing[:6]}")
    return plan


@torch.no_grad()
def apply_load(model: torch.nn.Module, model_config, plan: LoadPlan) -> None:
    """Write a validated plan: unquantized tensors via vLLM's reload, packed tensors in place."""
    if plan.unquantized:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        for owner in plan.owners.values():
            initialize_layerwise_reload(owner)
        model.load_weights(iter(plan.unquantized))
        finalize_layerwise_reload(model, model_config)
    for _, param, t in plan.packed:
        param.data.copy_(t)
    modules = dict(model.named_modules())  # methods that derive tensors from these params refresh them
    for mod_name in dict.fromkeys(name.rpartition(".")[0] for name, _, _ in plan.packed):
        hook = getattr(getattr(modules.get(mod_name), "quant_method", None), "after_packed_load", None)
        if hook is not None:  # (the native backend's swizzled block scales, in place)
            hook(modules[mod_name])


def read_back_quads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every ``quads_nvfp4`` kernel parameter (vLLM names), e.g. for tests and dumps."""
    return {
        f"{m}.{p}": getattr(mod, p).detach().clone() for m, (mod, ps) in quads_layers(model).items() for p in ps
    }


def update_weights_packed(ext, peft_config: dict | None = None, base_sync_done: bool = False, use_shm: bool = False):
    """Replacement of verl's ``vLLMColocateWorkerExtension.update_weights_from_ipc`` for quads_nvfp4 engines.

    ``ext`` is the worker (with verl's extension mixed in). Returns the :class:`LoadPlan` applied.
    """
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

    vllm_config = ext.model_runner.vllm_config
    qc = engine_quant_config(vllm_config)
    if qc is None:
        raise SyncError("packed weight sync called on an engine without quads_nvfp4 quantization")
    if peft_config:
        raise NotImplementedError("verl-quads packed weight sync: LoRA (peft_config) is not supported")
    if ext._use_mtp_drafter_weight_sync():
        raise NotImplementedError("verl-quads packed weight sync: MTP drafter weight sync is not supported")
    if ext.device is None:
        from verl.utils.device import get_device_name

        ext.device = torch.device("cpu") if get_device_name() == "cpu" else torch.device(f"{get_device_name()}:{ext.local_rank}")

    staged: list[tuple[str, torch.Tensor]] = []

    def on_bucket(weights, is_last):
        staged.extend((n, t.clone()) for n, t in weights)

    receiver = BucketedWeightReceiver(zmq_handle=ext._get_zmq_handle(), device=ext.device, use_shm=use_shm)
    receiver.receive_weights(on_bucket_received=on_bucket)
    model = ext.model_runner.model
    plan = plan_load(model, staged, qc.mode)
    apply_load(model, vllm_config.model_config, plan)
    if qc.mode == "trace":  # TRACE records made from now on carry the trainer's policy version
        from verl_quads.rollout.capture import get_store

        get_store().policy_version = int(plan.header["version"])
    logger.warning(
        "verl-quads: packed sync loaded %d NVFP4 tensors (%.3f MiB) in place + %d unquantized tensors",
        len(plan.packed), plan.packed_bytes / 2**20, len(plan.unquantized),
    )
    dump_dir = os.environ.get(DUMP_ENV)
    if dump_dir:
        path = Path(dump_dir) / f"packed_sync_{os.getpid()}_{next(_dump_counter):03d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"header": plan.header, "vllm": read_back_quads(model)}, path)
    return plan


def refuse_packed_on_unquantized(weights, engine_desc: str) -> None:
    """For engines without quads_nvfp4: fail if the trainer sent a packed stream (mode mismatch)."""
    for name, t in weights:
        if name == HEADER_NAME:
            h = decode_header(t)
            raise SyncModeError(
                f"weight sync: trainer actor.quant={h['quant']!r} (trainer mode {h['trainer_mode']!r}) sends packed "
                f"NVFP4 weights for rollout mode {h['rollout_mode']!r}, but the vLLM engine is {engine_desc} "
                "(mode 'none'); start vLLM with quantization='quads_nvfp4' in that mode"
            )


__all__ = [
    "LoadPlan",
    "engine_quant_config",
    "local_shard",
    "quads_layers",
    "plan_load",
    "apply_load",
    "read_back_quads",
    "update_weights_packed",
    "refuse_packed_on_unquantized",
]
