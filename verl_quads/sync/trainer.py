"""Trainer side of the packed weight sync: full trainer weights -> the stream of :mod:`.format`.

:func:`pack_for_rollout` turns the trainer's ``(name, full tensor)`` stream (HF names, the
unsharded master weights, before verl's ``unfuse_moe_params``) into the packed stream. For every
module the QAT forward quantizes (``QATState.modules``), it emits exactly what that forward uses:

- the weight is first cast to ``param_dtype`` (what the QAT forward sees: under FSDP2 mixed
  precision the all-gathered parameter is ``param_dtype``, bf16 by default, of the fp32 master);
- global scales come from the QAT code (:func:`verl_quads.qat.weights.linear_global_scale` over a
  fused group, :func:`~verl_quads.qat.weights.expert_global_scale` per expert);
- codes and block scales from :func:`verl_quads.nvfp4.quantize` with that scale, so
  ``dequantize(packed) == fake_quantize(w, gs)`` = the QAT effective weight, bit for bit.

Everything else passes through unchanged. :func:`engine_per_tensor_param` is the verl engine hook
(``FSDPEngineWithLMHead.get_per_tensor_param`` replacement for QAT engines and for ``quant=naive``).

``quant=naive`` (stock trainer, NVFP4 W4A4 rollout): the trainer runs no QAT, but its sync is the same
packed stream, planned by :func:`plan_for_stock_trainer` (the modules ``apply_qat`` would quantize,
found by a dry run of it). The engine then holds ``nvfp4.fake_quantize`` of the trainer's
``param_dtype`` weights with the same scale sharing (q/k/v and gate/up one global scale, experts one
per expert), i.e. exactly what the engine computes when it quantizes a BF16 checkpoint at load
(``QuadsNVFP4LinearMethod.process_weights_after_loading``: amax over the fused weight). The trainer
not quantizing its own forward is what ``naive`` means.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from verl_quads import nvfp4
from verl_quads.config import QuantConfig
from verl_quads.qat.weights import EXPERT_PARAMS as HF_EXPERT_PARAMS
from verl_quads.qat.weights import expert_global_scale, linear_global_scale, qdq_expert_weight, qdq_linear_weight
from verl_quads.sync.format import FUSED_LINEAR, HEADER_NAME, SyncError, encode_header, vllm_module_of

logger = logging.getLogger("verl_quads")
DUMP_ENV = "VERL_QUADS_SYNC_DUMP_DIR"
_dump_counter = itertools.count()


@dataclass
class SyncStats:
    """Bytes of one sync. ``bf16_quantized_bytes``: what the quantized weights would cost as bf16."""

    packed_bytes: int = 0
    bf16_quantized_bytes: int = 0
    passthrough_bytes: int = 0
    header_bytes: int = 0
    quantized_numel: int = 0
    tensors: int = 0

    @property
    def total_bytes(self) -> int:
        return self.packed_bytes + self.passthrough_bytes + self.header_bytes

    @property
    def quantized_ratio(self) -> float:
        """Packed bytes / bf16 bytes of the quantized layers (~0.281: 4.5 bits + per-tensor scales)."""
        return self.packed_bytes / max(1, self.bf16_quantized_bytes)

    def summary(self) -> str:
        return (
            f"packed sync: {self.tensors} tensors, {self.total_bytes / 2**20:.3f} MiB total; quantized layers "
            f"{self.packed_bytes / 2**20:.3f} MiB vs {self.bf16_quantized_bytes / 2**20:.3f} MiB bf16 "
            f"({self.quantized_ratio:.4f}x); other tensors {self.passthrough_bytes / 2**20:.3f} MiB as sent"
        )


@dataclass
class SyncPlan:
    """Which trainer modules are sent packed, under which vLLM module.

    ``linear_groups``: vLLM module -> HF member modules (fused order, e.g. q, k, v).
    ``experts``: HF experts module -> whether its 3-D weights are stored ``[E, in, out]``.
    """

    config: QuantConfig
    linear_groups: dict[str, list[str]] = field(default_factory=dict)
    experts: dict[str, bool] = field(default_factory=dict)

    @property
    def member_to_group(self) -> dict[str, str]:
        return {m: g for g, ms in self.linear_groups.items() for m in ms}

    def vllm_modules(self) -> list[str]:
        return sorted(list(self.linear_groups) + [vllm_module_of(e) for e in self.experts])


def plan_from_model(model: torch.nn.Module) -> SyncPlan:
    """Plan for a model prepared by :func:`verl_quads.qat.apply_qat` (reads ``model._verl_quads_qat``)."""
    state = getattr(model, "_verl_quads_qat", None)
    if state is None:
        raise SyncError("packed sync: the trainer model has no verl-quads QAT state (apply_qat was not run)")
    plan = SyncPlan(config=state.config)
    order = {leaf: i for members in FUSED_LINEAR for i, leaf in enumerate(members)}
    for name, (kind, *_rest) in state.modules.items():
        if kind == "linear":
            plan.linear_groups.setdefault(vllm_module_of(name), []).append(name)
        elif kind == "experts":
            plan.experts[name] = bool(getattr(model.get_submodule(name), "is_transposed", False))
        else:  # pragma: no cover - QATState only records these two kinds
            raise SyncError(f"packed sync: unknown QAT module kind {kind!r} for {name}")
    for members in plan.linear_groups.values():
        members.sort(key=lambda n: order.get(n.rpartition(".")[2], 0))
    return plan


def plan_for_stock_trainer(model: torch.nn.Module, config: QuantConfig) -> SyncPlan:
    """Plan for a trainer that runs no QAT (trainer mode ``none``) but syncs to an NVFP4 engine (``naive``).

    The quantized modules are the ones :func:`verl_quads.qat.apply_qat` selects for ``config``'s
    ``ignore`` list (same rule as the engine's): found by applying QAT in mode ``w4a16`` and removing it
    again, so ``model`` is left with its original classes and no QAT state. Call it on the bare HF
    module, before FSDP wrapping. Raises if the model already carries QAT, or if ``config`` has a
    trainer mode (then :func:`plan_from_model` is the plan) or no NVFP4 rollout.
    """
    import dataclasses

    from verl_quads.qat import apply_qat, remove_qat

    if config.trainer_mode != "none" or config.rollout_mode == "none":
        raise SyncError(
            f"packed sync: plan_for_stock_trainer is for quant=naive (stock trainer, NVFP4 rollout); got "
            f"actor.quant={config.quant!r} (trainer mode {config.trainer_mode!r}, rollout mode {config.rollout_mode!r})"
        )
    if getattr(model, "_verl_quads_qat", None) is not None:
        raise SyncError("packed sync: the trainer model already carries verl-quads QAT; use plan_from_model")
    apply_qat(model, dataclasses.replace(config, quant="w4a16"), backend="torch")
    try:
        plan = plan_from_model(model)
    finally:
        remove_qat(model)
    plan.config = config
    return plan


def _pack_linear(members: dict[str, torch.Tensor], param_dtype: torch.dtype, backend: str) -> nvfp4.NVFP4Tensor:
    ws = [w.to(param_dtype) for w in members.values()]
    for n, w in zip(members, ws):
        if w.dim() != 2:
            raise SyncError(f"packed sync: {n}.weight has shape {tuple(w.shape)}, expected [out, in]")
    gs = linear_global_scale(ws)
    return nvfp4.quantize(torch.cat(ws, dim=0) if len(ws) > 1 else ws[0], gs, backend=backend)


def _pack_experts(w: torch.Tensor, transposed: bool, param_dtype: torch.dtype, backend: str) -> nvfp4.NVFP4Tensor:
    w = w.to(param_dtype)
    if transposed:
        w = w.transpose(-1, -2).contiguous()
    return nvfp4.quantize(w, expert_global_scale(w), backend=backend)


def qat_effective_linear(ws: list[torch.Tensor], param_dtype: torch.dtype) -> torch.Tensor:
    """The QAT forward's weight of a fused linear group (its own code path), members concatenated."""
    ws = [w.to(param_dtype) for w in ws]
    gs = linear_global_scale(ws)
    return torch.cat([qdq_linear_weight(w, gs, "torch") for w in ws], dim=0)


def qat_effective_experts(w: torch.Tensor, transposed: bool, param_dtype: torch.dtype) -> torch.Tensor:
    """The QAT forward's fused-expert weight (its own code path), returned in vLLM's ``[E, out, in]``."""
    q = qdq_expert_weight(w.to(param_dtype), transposed, "torch")
    return q.transpose(-1, -2) if transposed else q


def _vllm_layout_linear(ws: list[torch.Tensor], param_dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([w.to(param_dtype) for w in ws], dim=0)


def _vllm_layout_experts(w: torch.Tensor, transposed: bool, param_dtype: torch.dtype) -> torch.Tensor:
    w = w.to(param_dtype)
    return w.transpose(-1, -2).contiguous() if transposed else w


def pack_for_rollout(
    named: Iterable[tuple[str, torch.Tensor]],
    plan: SyncPlan,
    param_dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str = "auto",
    stats: SyncStats | None = None,
    effective: dict[str, torch.Tensor] | None = None,
    source: dict[str, torch.Tensor] | None = None,
    version: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Packed sync stream (header first) from full trainer tensors ``named`` (HF names).

    ``stats`` (filled while the stream is consumed) counts bytes; ``effective``, if given, receives the
    QAT effective weight (computed by the QAT code path, :func:`qat_effective_linear` /
    :func:`qat_effective_experts`) of every packed tensor in ``param_dtype`` under
    ``<vllm module>.weight`` or ``<vllm module>.w13_weight`` / ``.w2_weight`` (vLLM layout); for a
    stock trainer (``naive``) that is the same function of its weights, ``fake_quantize`` with the
    shared scales, which no trainer forward uses. ``source``, if given, receives under the same names
    the unquantized weights that were packed, cast to ``param_dtype``, in vLLM's layout (fused members
    concatenated along dim 0 in fused order; experts ``[E, out, in]``), e.g. for tests that check the
    packed result against their own QDQ. Raises :class:`SyncError` at the end of the stream if a
    planned module's weights never arrived.
    """
    stats = stats if stats is not None else SyncStats()
    header = encode_header(
        plan.config.quant, plan.config.trainer_mode, plan.config.rollout_mode, plan.vllm_modules(), version
    )
    stats.header_bytes += header.numel()
    stats.tensors += 1
    yield HEADER_NAME, header

    member_to_group = plan.member_to_group
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()

    def emit(vmod: str, prefix: str, q: nvfp4.NVFP4Tensor, numel: int, gs: torch.Tensor, qat_effective, src):
        if source is not None:
            source[f"{vmod}.{prefix}weight"] = src().detach()
        stats.packed_bytes += q.packed.numel() + q.block_scale.numel() + gs.numel() * 4
        stats.bf16_quantized_bytes += 2 * numel
        stats.quantized_numel += numel
        stats.tensors += 3
        if effective is not None:
            effective[f"{vmod}.{prefix}weight"] = qat_effective().detach()
        yield f"{vmod}.{prefix}weight_packed", q.packed
        yield f"{vmod}.{prefix}weight_scale", q.block_scale
        yield f"{vmod}.{prefix}weight_global_scale", gs

    for name, t in named:
        mod, _, leaf = name.rpartition(".")
        if leaf == "weight" and mod in member_to_group:
            group = member_to_group[mod]
            got = pending.setdefault(group, {})
            got[mod] = t
            members = plan.linear_groups[group]
            if len(got) == len(members):
                ordered = {m: got.pop(m) for m in members}
                del pending[group]
                q = _pack_linear(ordered, param_dtype, backend)
                done.add(group)
                eff = functools.partial(qat_effective_linear, list(ordered.values()), param_dtype)
                src = functools.partial(_vllm_layout_linear, list(ordered.values()), param_dtype)
                yield from emit(group, "", q, q.packed.numel() * 2, q.global_scale.reshape(()), eff, src)
            continue
        if mod in plan.experts and leaf in HF_EXPERT_PARAMS:
            stem = HF_EXPERT_PARAMS[leaf]
            q = _pack_experts(t, plan.experts[mod], param_dtype, backend)
            done.add(f"{mod}.{stem}")
            eff = functools.partial(qat_effective_experts, t, plan.experts[mod], param_dtype)
            src = functools.partial(_vllm_layout_experts, t, plan.experts[mod], param_dtype)
            yield from emit(vllm_module_of(mod), f"{stem}_", q, q.packed.numel() * 2, q.global_scale.reshape(-1), eff, src)
            continue
        stats.passthrough_bytes += t.numel() * t.element_size()
        stats.tensors += 1
        yield name, t

    expected = set(plan.linear_groups) | {f"{e}.w13" for e in plan.experts} | {f"{e}.w2" for e in plan.experts}
    missing = sorted(expected - done)
    if pending or missing:
        partial = {g: sorted(set(plan.linear_groups[g]) - set(v)) for g, v in pending.items()}
        raise SyncError(
            f"packed sync: quantized weights never arrived from the trainer: {missing[:8]}"
            + (f"; fused groups missing members {partial}" if partial else "")
        )


def _param_dtype(engine) -> torch.dtype:
    from verl.utils.torch_dtypes import PrecisionType

    mp = getattr(engine.engine_config, "mixed_precision", None)
    return PrecisionType.to_dtype(mp.get("param_dtype", "bf16")) if mp is not None else torch.bfloat16


def engine_per_tensor_param(engine, plan: SyncPlan | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The packed stream of a verl FSDP2 engine whose module carries verl-quads QAT, or of a stock
    engine in ``quant=naive`` with ``plan`` from :func:`plan_for_stock_trainer` (made before wrapping).

    Same source as verl's ``get_per_tensor_param`` (``state_dict`` with ``convert_weight_keys``, each
    DTensor gathered lazily with ``full_tensor``) but without ``unfuse_moe_params``: experts are packed
    in their fused ``[E, out, in]`` form, which is vLLM's layout. LoRA and FSDP1 are refused.
    The header carries the policy version ``engine._verl_quads_policy_version`` (0, 1, 2, ... per sync).
    """
    from torch.distributed.tensor import DTensor
    from verl.utils.device import get_device_id
    from verl.utils.fsdp_utils import fsdp_version
    from verl.utils.model import convert_weight_keys

    inner = getattr(engine.module, "_fsdp_wrapped_module", engine.module)
    if hasattr(inner, "peft_config"):
        raise NotImplementedError("verl-quads packed sync: LoRA actors are not supported")
    if fsdp_version(engine.module) != 2:
        raise NotImplementedError("verl-quads packed sync needs actor strategy fsdp2")
    plan = plan if plan is not None else plan_from_model(inner)
    params = convert_weight_keys(engine.module.state_dict(), inner)
    device = get_device_id()
    full = (
        (n, p.to(device, non_blocking=True).full_tensor() if isinstance(p, DTensor) else p) for n, p in params.items()
    )
    stats = SyncStats()
    dump_dir = os.environ.get(DUMP_ENV)
    effective: dict[str, torch.Tensor] | None = {} if dump_dir else None
    source: dict[str, torch.Tensor] | None = {} if dump_dir else None
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    version = getattr(engine, "_verl_quads_policy_version", -1) + 1
    engine._verl_quads_policy_version = version
    stream = pack_for_rollout(full, plan, _param_dtype(engine), stats=stats, effective=effective, source=source,
                             version=version)
    # experts the plan does not pack (ignored) still leave in verl's per-expert form
    yield from unfuse_moe_params(stream, engine.model_config.hf_config.model_type)
    logger.warning("verl-quads: %s", stats.summary())
    engine._verl_quads_last_sync = stats
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if dump_dir and rank0:
        path = Path(dump_dir) / f"trainer_sync_{os.getpid()}_{next(_dump_counter):03d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"effective": {k: v.cpu() for k, v in effective.items()},
                    "source": {k: v.cpu() for k, v in source.items()},
                    "header": {"quant": plan.config.quant, "trainer_mode": plan.config.trainer_mode,
                               "rollout_mode": plan.config.rollout_mode, "version": version},
                    "stats": stats.__dict__}, path)


__all__ = ["SyncStats", "SyncPlan", "plan_from_model", "plan_for_stock_trainer", "pack_for_rollout", "engine_per_tensor_param", "DUMP_ENV"]
