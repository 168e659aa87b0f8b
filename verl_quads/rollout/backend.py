"""Which kernel backend the rollout runs, decided once per engine from the device.

=========  ==========================================  ===============================
backend    runs on                                     status
=========  ==========================================  ===============================
torch      anywhere (vLLM CPU included)                reference emulation, tested
triton     CUDA GPUs (meant for Hopper: no FP4 MMA)     fused NVFP4 dequantize + bf16 GEMM
                                                       (:mod:`verl_quads.nvfp4.triton_gemm`)
native     sm_100+ (Blackwell) with vLLM's FP4 ops      vLLM's CUTLASS FP4 GEMM on our codes
           (``cutlass_fp4_supported()``)               (:mod:`verl_quads.rollout.native`);
                                                       UNTESTED ON HARDWARE (CPU tests mock the op)
=========  ==========================================  ===============================

``triton`` keeps weights packed (NVFP4) and dequantizes tiles inside the GEMM; W4A4 activations
are quantized by the core and read packed as well (FP4 x FP4 products are exact in bf16), so its
outputs equal the ``torch`` backend's up to float32 summation order (tests/unit/test_nvfp4_gemm.py).
It runs on any CUDA GPU Triton supports, Blackwell included (explicit ``backend='triton'``).

``native`` (design in :mod:`verl_quads.rollout.native`): vLLM's ``scaled_fp4_quant`` takes one
activation global scale per call and ``cutlass_scaled_fp4_mm`` one scalar ``alpha``, while our
activation granularity is one global scale per token (row), which the trainer needs to reproduce
a token's codes. So activations are quantized by our core, their block scales swizzled with
``swizzle_block_scale``, the FP4 GEMM runs with ``alpha = 1 / weight_global_scale`` and writes
bf16, and each output row is divided by its activation global scale in float32 before the final
cast (a second rounding vs the ``torch`` backend: bounded in native.py). ``w4a16`` linear layers
run the triton kernel; routed experts are refused unless ``VERL_QUADS_NATIVE_EXPERTS=triton``.

``auto`` picks torch on CPU, native on sm_100+, triton on other CUDA GPUs. A backend that cannot
run on this device (or is not implemented) raises :class:`BackendUnavailableError` at engine
start; nothing silently falls back to a slower or different path.
"""

from __future__ import annotations

import torch

ROLLOUT_BACKENDS = ("torch", "triton", "native")


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run on this device/build."""


def _cuda_capability() -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def resolve_backend(requested: str, *, device_type: str | None = None) -> str:
    """Return the concrete backend for ``requested`` (``auto``/``torch``/``triton``/``native``).

    ``device_type``: vLLM's platform device type (``"cpu"``, ``"cuda"``, ...); defaults to vLLM's
    ``current_platform.device_type`` when vLLM is importable, else ``"cuda"`` if a GPU is visible.
    Raises :class:`BackendUnavailableError` for a combination that cannot run.
    """
    if device_type is None:
        try:
            from vllm.platforms import current_platform

            device_type = current_platform.device_type
        except Exception:  # pragma: no cover - vLLM always present where this runs
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
    cap = _cuda_capability() if device_type == "cuda" else None
    if requested == "auto":
        if device_type != "cuda":
            backend = "torch"
        elif cap is not None and cap[0] >= 10:
            backend = "native"
        else:
            backend = "triton"
    else:
        backend = requested
    if backend not in ROLLOUT_BACKENDS:
        raise BackendUnavailableError(f"quads_nvfp4: unknown backend {requested!r}; allowed: auto, torch, triton, native")
    if backend == "torch":
        return backend
    cap_s = f"sm_{cap[0]}{cap[1]}" if cap else "an unknown GPU"
    hint = "Set quant_config.backend='torch' to run the (slow) reference emulation explicitly."
    if device_type != "cuda":
        raise BackendUnavailableError(
            f"quads_nvfp4: backend {backend!r} needs a CUDA GPU, but vLLM runs on {device_type!r}. {hint}"
        )
    if backend == "native":
        if cap is None or cap[0] < 10:
            raise BackendUnavailableError(
                f"quads_nvfp4: backend 'native' needs FP4 tensor cores (sm_100+), this GPU is {cap_s}. "
                f"Use backend='triton' on Hopper. {hint}"
            )
        from verl_quads.rollout.native import fp4_ops_unavailable_reason

        reason = fp4_ops_unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(
                f"quads_nvfp4: backend 'native' on {cap_s} needs vLLM's CUTLASS FP4 GEMM: {reason}. "
                f"Use backend='triton' (fused NVFP4 GEMMs on bf16 tensor cores). {hint}"
            )
    if backend in ("triton", "native"):  # native quantizes activations with the core's triton kernels
        from verl_quads.nvfp4 import triton_kernels

        if triton_kernels.triton is None:
            raise BackendUnavailableError(
                f"quads_nvfp4: backend {backend!r} needs the triton package, which cannot be imported: "
                f"{triton_kernels._TRITON_IMPORT_ERROR}. {hint}"
            )
        return backend
    raise BackendUnavailableError(
        f"quads_nvfp4: backend {backend!r} (for {cap_s}) is not implemented in this "
        f"verl-quads version yet. Set quant_config.backend='triton' (fused NVFP4 GEMMs on bf16 "
        f"tensor cores) or 'torch'. {hint}"
    )


__all__ = ["ROLLOUT_BACKENDS", "BackendUnavailableError", "resolve_backend"]
