"""Weight QDQ once per weight version, on the FSDP2 shards (``quant_config.weight_qdq=per_version``, and what the
default ``weight_qdq=auto`` picks where it can run: :func:`setup`).

With ``weight_qdq=per_forward`` every forward of a QAT module QDQs its unsharded weight after
FSDP2's all-gather, and FSDP2 re-gathers in every forward AND backward, while the weights change only at
``optimizer.step``. ``per_version`` instead QDQs each rank's master SHARD once per weight version into a
cached buffer in the all-gather dtype, and FSDP2 all-gathers that buffer: the unsharded parameter the
module sees IS the QDQ weight, so the module runs its stock forward (:func:`verl_quads.qat.apply_qat`
leaves weight QDQ out of the forward; W4A4/TRACE activation QDQ is unchanged).

Bit-identical to ``per_forward`` (tests/unit/test_qat_fsdp2.py): the QDQ input is the same bf16 cast of the
fp32 master (``copy_`` into the cache = FSDP's own cast), NVFP4 16-element blocks run along K = the last
dim of ``[out, in]`` linears and ``[E, out, in]`` experts (``[E, in, out]`` transposed experts: K = dim 1)
and FSDP2 shards dim 0 (only ``Shard(0)`` is accepted), so no block is split; the global scales are those of
the WHOLE tensor: every rank writes its local amaxes into one float32 buffer (one slot per linear weight, E
slots per expert weight with this rank's experts at their global index: dim-0 chunks hold whole experts,
an expert is never split across ranks; zero elsewhere), and ONE ``all_reduce(MAX)`` over the shard group
makes them global; fused groups (q/k/v, gate/up) then take the max over their members' slots, experts one
scale per expert ``[E, 1, 1]``, exactly the amax values ``per_forward`` feeds the same QDQ call.
Gradients: the STE makes d loss / d master = d loss / d QDQ weight, which is the gradient of the unsharded
parameter that FSDP reduce-scatters into the sharded gradient, as in the stock path. On the H200 (torch 2.11,
``python -m verl_quads.bench.qat --fsdp`` device check, one Qwen3-30B-A3B-width layer, 4096 tokens): QDQ weights
and forward output bit-identical for w4a16 / w4a4_qat / trace, and every gradient too with SDPA on the math
backend; with the default SDPA (flash) backward, whose dq accumulation is nondeterministic, the input and
q_proj gradients differ run to run for ``per_forward`` itself, so compare gradients under deterministic attention.

Refresh: :meth:`ShardQDQ.refresh` runs in a forward pre-hook on the root FSDP module (registered before
FSDP's own root hook, so it runs before any all-gather of the step; all ranks are in lockstep there, as
FSDP itself requires). It compares each master shard (``FSDPParam._sharded_param_data``: the object and its
in-place version counter, which the optimizer's in-place update, ``load_state_dict``'s ``copy_`` and
``module.to`` all change) with the version its cache was made from and, if any changed, recomputes all
caches (one amax pass, one all-reduce, one QDQ per weight). The all-gather hook
(``verl_quads/patches/fsdp2_qdq_all_gather.py``) re-checks the version of the shard it is about to send
and raises instead of gathering a stale cache (e.g. a weight changed between forward and backward, or a
submodule called directly after a change). Assumes SPMD: every rank changes its weights together (a rank
that changed alone would enter the refresh's all-reduce alone). Not seen: an in-place change through
``param.data`` (a DTensor's ``.data`` has a fresh version counter and bumps none of the three; measured on
torch 2.13); the training-time paths of verl 0.9.1 do not do that (AdamW, ``load_state_dict``, ``module.to``
for param offload, ``fsdp2_sharded_load_from_cpu``'s ``param._local_tensor.copy_`` are all seen).

NaN/Inf weights: NaN amaxes become +Inf before the all-reduce (MAX then carries them to every rank);
the global amaxes are noted per weight for :meth:`QATState.verify` (the same deferred check, message and
names as ``per_forward``: verl's engine calls it after each ``forward_backward_batch``); with
``apply_qat(check_finite=True)`` the refresh raises at once.

Memory: one cache per quantized weight, the padded local shard in the all-gather dtype (2 bytes per
parameter per rank / world size for bf16), kept while the model lives (FSDP's stock path instead allocates
the cast copy per gather). Refused: FSDP2 CPU offload (``offload_policy``), sharding other than ``Shard(0)``,
DTensor (tensor-parallel) parameters, quantized weights not managed by ``fully_shard``.
Without FSDP2 ``per_version`` is an error (the forward refuses to run without an installed cache); use
``per_forward`` there. :func:`release` drops the caches; verl-quads' engine calls it after every
``optimizer_step`` (the caches are stale then anyway) and on offload (verl's ``param_offload``: ``engine.to("cpu")``
moves the master shards with ``module.to``), so they hold no device memory between training passes (e.g. through the
rollout); the next root forward remakes them.

``weight_qdq=auto`` (the default): :func:`setup`, called once on the root module after ``fully_shard`` (verl-quads'
verl engine calls it for every QAT model it builds), installs this per-version QDQ when the root is an FSDP2
module, the FSDP2 patch accepts the installed torch (``fsdp2_qdq_all_gather.SUPPORTED_TORCH``) and every quantized
weight can be served (``Shard(0)``, no CPU offload policy, no tensor-parallel DTensor, one shard group); otherwise
the model keeps ``per_forward`` (the same values). The choice and its reason are logged once at INFO, at WARNING
when an FSDP2 model had to take ``per_forward`` (unsupported torch, or a refused weight). A model made with
``auto`` on which :func:`setup` never ran (no FSDP2, e.g. a hand-written loop) takes ``per_forward`` at its first
QAT forward, logged at INFO then. Explicit ``per_version`` where it cannot run raises (:func:`install`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from verl_quads.nvfp4 import fake_quantize
from verl_quads.qat.weights import abs_max

__all__ = ["PerVersionUnsupported", "ShardQDQ", "install", "installed", "refresh", "release", "setup"]

logger = logging.getLogger("verl_quads")


class PerVersionUnsupported(ValueError):
    """``weight_qdq=per_version`` cannot serve this model exactly (the message names the weight or the torch
    version and what is allowed). ``weight_qdq=auto`` then keeps ``per_forward``; explicit ``per_version`` raises
    it."""


def _state_of(model: nn.Module):
    state = getattr(model, "_verl_quads_qat", None)
    if state is None:
        raise RuntimeError("verl-quads QAT: weight_qdq=per_version on a model without apply_qat")
    return state


def _fsdp_states(model: nn.Module) -> list:
    """FSDP2 states of every ``fully_shard``-ed module under ``model`` (root first)."""
    from torch.distributed.fsdp import FSDPModule

    return [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch releases with one group per state
        g = getattr(state, "_fsdp_param_group", None)
        groups = [g] if g is not None else []
    return list(groups)


@dataclass
class _Entry:
    """One quantized weight: its FSDP param, where its amaxes live in the buffer, its cache."""

    name: str  # e.g. model.layers.0.self_attn.q_proj.weight (as QATState.note_weight names it)
    fsdp_param: object
    kind: str  # "linear" | "experts"
    transposed: bool
    slot: int  # first slot in the amax buffer
    n_slots: int  # 1 (linear) or E (experts)
    group: tuple[int, int] = (0, 0)  # linear: [start, stop) slots of its fused group
    local_start: int = 0  # experts: global index of this rank's first expert
    made_from: tuple = ()  # (sharded param, flat shard, local tensor) objects the cache was made from
    version: tuple = ()  # their in-place version counters then
    cache: torch.Tensor | None = None  # padded flat shard, all-gather dtype, QDQ'd

    def master(self) -> tuple[tuple, tuple]:
        """The master shard's identity and version: FSDP's sharded DTensor parameter (whose counter in-place
        updates through the parameter bump: optimizers, ``load_state_dict``), its padded flat data and its
        local tensor (in-place changes of the local tensor itself bump only theirs); new objects after
        ``module.to`` / ``load_state_dict(assign=True)`` (FSDP's ``reset_sharded_param``)."""
        fp = self.fsdp_param
        objs = (fp.sharded_param, fp._sharded_param_data, fp.sharded_param._local_tensor)
        return objs, tuple(t._version for t in objs)

    def stale(self) -> bool:
        objs, version = self.master()
        return version != self.version or any(a is not b for a, b in zip(objs, self.made_from)) or not self.made_from

    def gather_input(self) -> torch.Tensor:
        """The all-gather input (called by the FSDP patch): the cache, if made from the current master."""
        if self.stale():
            objs, version = self.master()
            new = not self.made_from or any(a is not b for a, b in zip(objs, self.made_from))
            raise RuntimeError(
                f"verl-quads QAT (weight_qdq=per_version): the master shard of {self.name} changed since its NVFP4 "
                f"QDQ cache was made (versions {self.version} -> {version}{', new tensor' if new else ''}); "
                "refusing to all-gather stale weights. The cache "
                "refreshes in the root FSDP module's forward pre-hook: change weights only between root forwards "
                "(not between a forward and its backward), call the root module, or call "
                "verl_quads.qat.fsdp_qdq.refresh(model) on every rank first"
            )
        return self.cache

    def real(self) -> torch.Tensor:
        """This rank's unpadded shard inside the cache, N-D."""
        fp = self.fsdp_param
        full = self.cache.view(fp.padded_sharded_param_size)
        n = fp.sharded_size[0] if self.cache.numel() else 0
        return full.narrow(0, 0, n)


@dataclass
class ShardQDQ:
    """The per-version weight QDQ of one FSDP2 model (``QATState.fsdp_qdq``)."""

    model: nn.Module
    entries: list[_Entry]
    n_slots: int
    process_group: object  # shard group (None: one rank)
    backend: str
    hook: object = None
    refreshes: int = 0  # how many refreshes ran (tests, bench)
    _lazy_done: bool = False
    _states: list = field(default_factory=list)

    @torch.no_grad()
    def refresh(self, force: bool = False) -> bool:
        """Recompute every cache if any master shard changed (or ``force``). Collective over the shard
        group when it does work: call on every rank. Returns whether it refreshed."""
        if not self._lazy_done:
            # FSDP's root lazy init may re-pad / replace master shards (reset_sharded_param): do it first,
            # as FSDP's own root pre-forward would, so the caches are made from the final tensors.
            root = self._states[0] if self._states else None
            if root is not None and hasattr(root, "_lazy_init"):
                root._lazy_init()
            self._lazy_done = True
        if not force and not any(e.stale() for e in self.entries):
            return False
        state = _state_of(self.model)
        first = self.entries[0].fsdp_param._sharded_param_data
        buf = torch.zeros(self.n_slots, dtype=torch.float32, device=first.device)
        srcs = []
        for e in self.entries:
            fp = e.fsdp_param
            src = fp._sharded_param_data
            dtype = fp.param_dtype or fp.orig_dtype
            if e.cache is None or e.cache.shape != src.shape or e.cache.dtype != dtype or e.cache.device != src.device:
                e.cache = torch.empty(src.shape, dtype=dtype, device=src.device)
            e.cache.copy_(src)  # the cast FSDP would all-gather (padding rows stay 0)
            srcs.append(e.master())
            w = e.real()
            if w.numel() == 0:
                continue
            if e.kind == "linear":
                buf[e.slot : e.slot + 1].copy_(abs_max(w).reshape(1))
            else:
                a = abs_max(w, dim=(1, 2))  # [E_local], whole experts (dim-0 chunks)
                buf[e.slot + e.local_start : e.slot + e.local_start + a.numel()].copy_(a)
        torch.nan_to_num_(buf, nan=float("inf"))  # a NaN must survive MAX on every backend
        if self.process_group is not None:
            import torch.distributed as dist

            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.process_group)
        if state.check_finite:
            self._raise_if_not_finite(buf)
        else:
            for e in self.entries:
                a = buf[e.slot] if e.kind == "linear" else buf[e.slot : e.slot + e.n_slots].view(-1, 1, 1)
                state.note_weight(e.name, a)
        # the QDQ gets NaN for a non-finite amax (global scale 1.0, as per_forward's NaN amax): the weights are
        # garbage then and the check above / QATState.verify names them
        qbuf = torch.where(buf < float("inf"), buf, float("nan"))
        for e, (objs, version) in zip(self.entries, srcs):
            w = e.real()
            if w.numel():
                if e.kind == "linear":
                    lo, hi = e.group
                    amax = (qbuf[lo] if hi - lo == 1 else qbuf[lo:hi]).to(w.dtype)  # as per_forward's _qat_amax
                else:
                    amax = qbuf[e.slot + e.local_start : e.slot + e.local_start + w.shape[0]].view(-1, 1, 1).to(w.dtype)
                x = w.transpose(-1, -2) if e.transposed else w
                q = fake_quantize(x, amax=amax, backend=self.backend, check_finite=state.check_finite)
                if not e.transposed and q.numel() == e.cache.numel() and q.is_contiguous():
                    e.cache = q.view(-1)  # an unpadded shard: the QDQ output is the whole cache (no copy back)
                else:
                    x.copy_(q)
            e.made_from, e.version = objs, version
        for st in self._states[:1]:
            # FSDP's root pre-forward makes the copy-in stream wait for the current stream (our writes)
            # unless an explicit post-optimizer event is set; drop that so it waits for the refresh too
            ctx = getattr(st, "_state_ctx", None)
            if ctx is not None and getattr(ctx, "post_optim_event", None) is not None:
                ctx.post_optim_event = None
        self.refreshes += 1
        return True

    def _raise_if_not_finite(self, buf: torch.Tensor) -> None:
        ok = (buf < float("inf")).tolist()
        bad = []
        for e in self.entries:
            flags = ok[e.slot : e.slot + e.n_slots]
            if not all(flags):
                if e.kind == "experts":
                    experts = [i for i, f in enumerate(flags) if not f]
                    bad.append(f"{e.name} (experts {experts[:16]}{' ...' if len(experts) > 16 else ''})")
                else:
                    bad.append(e.name)
        if bad:
            raise ValueError(
                f"verl-quads QAT: NaN/Inf weights at forward time in {', '.join(bad)}; only finite weights can be "
                "quantized (the master weights diverged or a checkpoint is corrupt)"
            )

    def remove(self) -> None:
        """Detach from FSDP (back to stock all-gathers) and drop the caches."""
        from verl_quads.patches.fsdp2_qdq_all_gather import ATTR

        for e in self.entries:
            e.fsdp_param.__dict__.pop(ATTR, None)
            e.cache = None
        if self.hook is not None:
            self.hook.remove()
        st = getattr(self.model, "_verl_quads_qat", None)
        if st is not None and st.fsdp_qdq is self:
            st.fsdp_qdq = None
            st.weight_qdq = None

    def release(self) -> None:
        """Drop the caches (device memory: the padded shards in the all-gather dtype); the next :meth:`refresh`
        remakes them. The all-gather hook refuses a released cache like a stale one."""
        for e in self.entries:
            e.cache, e.made_from, e.version = None, (), ()


def install(model: nn.Module) -> ShardQDQ:
    """Attach per-version weight QDQ to ``model``: the ROOT ``fully_shard``-ed module of a model that
    :func:`~verl_quads.qat.apply_qat` made QAT with ``weight_qdq=per_version``. Call after ``fully_shard``
    (all of it) and before the first forward. Applies the FSDP2 all-gather patch, registers the refresh
    pre-hook and returns the :class:`ShardQDQ` (also ``QATState.fsdp_qdq``). Raises (naming the weight
    and what is allowed) for anything it cannot serve exactly."""
    from torch.distributed.fsdp import FSDPModule

    from verl_quads.patches import fsdp2_qdq_all_gather as patch
    from verl_quads.patches._guard import PatchVersionError

    state = _state_of(model)
    if state.config.weight_qdq not in ("per_version", "auto"):
        raise ValueError(
            f"verl-quads QAT: install() is for quant_config.weight_qdq=per_version (or auto); this model has "
            f"{state.config.weight_qdq!r}"
        )
    if state.fsdp_qdq is not None:
        raise RuntimeError("verl-quads QAT: per-version weight QDQ is already installed on this model")
    if not isinstance(model, FSDPModule):
        raise PerVersionUnsupported(
            "verl-quads QAT: quant_config.weight_qdq=per_version needs the root module wrapped by FSDP2 "
            f"(fully_shard); got {type(model).__name__}. Without FSDP2 use weight_qdq=per_forward (or auto)"
        )
    try:
        patch.apply()
    except PatchVersionError as e:
        raise PerVersionUnsupported(
            f"verl-quads QAT: quant_config.weight_qdq=per_version needs the FSDP2 all-gather patch, which supports "
            f"torch {', '.join(patch.SUPPORTED_TORCH)} only: {e}. Use weight_qdq=per_forward (or auto, which takes "
            "per_forward on this torch)"
        ) from e
    states = _fsdp_states(model)
    by_param: dict[tuple[int, str], object] = {}
    for st in states:
        for pg in _param_groups(st):
            for fp in pg.fsdp_params:
                info = fp._module_info
                by_param[(id(info.module), info.param_name)] = fp
                for m, n in zip(getattr(info, "shared_modules", ()), getattr(info, "shared_param_names", ())):
                    by_param[(id(m), n)] = fp

    # (name, module, param name, kind, transposed, group key) in model order; fused groups contiguous
    todo: list[tuple[str, nn.Module, str, str, bool]] = []
    done: set[str] = set()
    for name, (kind, _gemm, _layer, _act) in state.modules.items():
        mod = model.get_submodule(name)
        if kind == "linear":
            for m in mod._qat_group:
                if m._qat_name in done:
                    continue
                done.add(m._qat_name)
                todo.append((m._qat_name, m, "weight", "linear", False))
        else:
            transposed = bool(getattr(mod, "is_transposed", False))
            for p in mod._qat_params:
                todo.append((f"{name}.{p}", mod, p, "experts", transposed))

    entries: list[_Entry] = []
    slot, pgroup = 0, "unset"
    for name, mod, pname, kind, transposed in todo:
        full = name if kind == "experts" else f"{name}.weight"
        fp = by_param.get((id(mod), pname))
        if fp is None:
            raise PerVersionUnsupported(
                f"verl-quads QAT (weight_qdq=per_version): {full} is not managed by FSDP2; apply fully_shard to the "
                "decoder layers and the root (as verl does) before install(), or use weight_qdq=per_forward"
            )
        where = f"verl-quads QAT (weight_qdq=per_version): {full}"
        if getattr(fp, "offload_to_cpu", False):
            raise PerVersionUnsupported(f"{where}: FSDP2 CPU offload (offload_policy) is not supported; use weight_qdq=per_forward")
        if getattr(fp, "is_dtensor", False):
            raise PerVersionUnsupported(f"{where}: DTensor (tensor-parallel) parameters are not supported; use weight_qdq=per_forward")
        if fp.fsdp_placement.dim != 0:
            raise PerVersionUnsupported(
                f"{where}: sharded on dim {fp.fsdp_placement.dim}; only Shard(0) (FSDP2's default, which keeps every "
                "16-element K block and every expert whole on one rank) is supported"
            )
        mi = fp.mesh_info
        group = getattr(mi, "shard_process_group", None)
        if getattr(mi, "shard_mesh_size", 1) == 1:
            group = None
        if pgroup == "unset":
            pgroup = group
        elif group is not pgroup:
            raise PerVersionUnsupported(f"{where}: quantized weights on different FSDP shard groups are not supported")
        n = 1 if kind == "linear" else int(fp._orig_size[0])
        e = _Entry(name=full, fsdp_param=fp, kind=kind, transposed=transposed, slot=slot, n_slots=n)
        if kind == "experts":
            rank = getattr(mi, "shard_mesh_rank", 0)
            e.local_start = rank * int(fp.padded_sharded_param_size[0])
        entries.append(e)
        slot += n
    if not entries:
        raise PerVersionUnsupported("verl-quads QAT (weight_qdq=per_version): the model has no quantized weights")
    index = {e.name: i for i, e in enumerate(entries)}
    for name, (kind, *_rest) in state.modules.items():
        if kind != "linear":
            continue
        mod = model.get_submodule(name)
        slots = [entries[index[f"{m._qat_name}.weight"]].slot for m in mod._qat_group]
        if slots != list(range(slots[0], slots[0] + len(slots))):
            raise AssertionError(f"verl-quads QAT: fused group of {name} got non-contiguous amax slots {slots}")
        entries[index[f"{name}.weight"]].group = (slots[0], slots[0] + len(slots))

    qdq = ShardQDQ(model=model, entries=entries, n_slots=slot, process_group=pgroup,
                   backend=state.backend, _states=states)
    for e in entries:
        e.fsdp_param.__dict__[patch.ATTR] = e.gather_input
    # before FSDP's root pre-forward (which all-gathers the root's parameters and waits for this stream)
    def _pre_forward(_module, _args) -> None:  # returns None: the inputs pass unchanged
        qdq.refresh()

    qdq.hook = model.register_forward_pre_hook(_pre_forward, prepend=True)
    state.fsdp_qdq = qdq
    state.weight_qdq = "per_version"
    return qdq


def setup(model: nn.Module) -> str:
    """Decide and set up the weight QDQ schedule of ``model`` (the ROOT module, after ``fully_shard`` if any, before
    the first forward) per its ``quant_config.weight_qdq``; returns the schedule in effect, ``per_version`` or
    ``per_forward``, also kept as ``QATState.weight_qdq``. Collective-free; on FSDP2 call it on every rank (ranks
    decide alike: same torch, same model).

    - ``per_forward``: nothing to set up.
    - ``per_version``: :func:`install`; raises (naming the weight or the torch version and what is allowed) where it
      cannot run.
    - ``auto``: :func:`install` when ``model`` is an FSDP2 module and install accepts it (supported torch, every
      quantized weight servable), else ``per_forward``. Logged once at INFO; at WARNING when an FSDP2 model had to
      take ``per_forward`` (the reason: the torch version, or the refused weight).
    """
    from torch.distributed.fsdp import FSDPModule

    from verl_quads.patches import fsdp2_qdq_all_gather as patch

    state = _state_of(model)
    wq = state.config.weight_qdq
    if state.fsdp_qdq is not None:
        return "per_version"
    if wq == "per_forward":
        state.weight_qdq = "per_forward"
        return "per_forward"
    if wq == "per_version":
        install(model)
        logger.info("verl-quads QAT: weight_qdq per_version (requested): FSDP2 all-gathers weight shards NVFP4-QDQ'd "
                    "once per weight version")
        return "per_version"
    if not isinstance(model, FSDPModule):
        state.weight_qdq = "per_forward"
        logger.info("verl-quads QAT: weight_qdq auto -> per_forward: the model (%s) is not FSDP2-sharded (fully_shard); "
                    "per_version needs FSDP2", type(model).__name__)
        return "per_forward"
    try:
        install(model)
    except PerVersionUnsupported as e:
        state.weight_qdq = "per_forward"
        from verl_quads.patches._guard import installed_version

        logger.warning("verl-quads QAT: weight_qdq auto -> per_forward on an FSDP2 model (torch %s; the per-version "
                       "patch supports torch %s): %s", (installed_version("torch") or ("", "?"))[1],
                       ", ".join(patch.SUPPORTED_TORCH), e)
        return "per_forward"
    logger.info("verl-quads QAT: weight_qdq auto -> per_version: FSDP2 model, torch supported by the all-gather patch; "
                "each rank QDQs its weight shards once per weight version, FSDP2 all-gathers the QDQ'd shards")
    return "per_version"


def note_auto_without_setup(state) -> None:
    """``weight_qdq=auto`` reached a QAT forward with no :func:`setup` decision: ``per_forward`` (logged once)."""
    state.weight_qdq = "per_forward"
    logger.info("verl-quads QAT: weight_qdq auto -> per_forward: no per-version weight QDQ was set up on this model "
                "(verl_quads.qat.fsdp_qdq.setup(root) after fully_shard does; without FSDP2 per_forward is the only "
                "schedule)")


def release(model: nn.Module) -> bool:
    """Drop the per-version caches of ``model`` (e.g. when its parameters are offloaded to CPU); no-op without an
    installed per-version QDQ. Returns whether there were caches to drop."""
    qdq = installed(model)
    if qdq is None:
        return False
    qdq.release()
    return True


def installed(model: nn.Module) -> ShardQDQ | None:
    state = getattr(model, "_verl_quads_qat", None)
    return None if state is None else state.fsdp_qdq


def refresh(model: nn.Module, force: bool = False) -> bool:
    """Refresh the caches of ``model`` now (collective: every rank). Returns whether it refreshed."""
    qdq = installed(model)
    if qdq is None:
        raise RuntimeError("verl-quads QAT: no per-version weight QDQ installed on this model (install(model))")
    return qdq.refresh(force=force)
