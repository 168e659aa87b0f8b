"""``quads_nvfp4`` linear method (vLLM ``LinearMethodBase``) for the quantized linear layers.

Parameters of a layer (names follow compressed-tensors' NVFP4 scheme so packed checkpoints and the
weight sync map onto them directly):

- load format (created in :meth:`create_weights`), one of:

  - BF16 checkpoint: ``weight``: params_dtype ``[N, K]`` (N = sum of the fused output partitions,
    e.g. q|k|v), quantized by :meth:`process_weights_after_loading`;
  - packed NVFP4 checkpoint (compressed-tensors ``nvfp4-pack-quantized``, ``packed=True``): the three
    kernel-format tensors below, except ``weight_global_scale`` float32 ``[S]`` with one entry per
    checkpoint shard (S = 3 for q/k/v, 2 for gate/up, else 1), filled through the layer's own vLLM
    weight loader (fused shards by shard id, tensor-parallel slices by rank); after loading the S
    values must be equal (one shared scale per fused GEMM) and become the 0-d kernel parameter.
- kernel format (created by :meth:`process_weights_after_loading`, which then deletes ``weight``):
  ``weight_packed``: uint8 ``[N, K/2]`` (two E2M1 codes per byte, even element in the low nibble);
  ``weight_scale``: float8_e4m3fn ``[N, K/16]`` (linear, un-swizzled layout);
  ``weight_global_scale``: float32 0-d, the encode scale ``448*6/amax`` over the whole (fused)
  tensor, so q/k/v and gate/up share one (``QuantConfig`` decision).

These are ``nn.Parameter``s of fixed shape: a later ``process_weights_after_loading`` (vLLM's
layerwise reload) writes into them with ``copy_``; their storage never moves (CUDA graphs stay valid).
Nothing is repacked to oneDNN: this method owns the layer's forward.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.utils import set_weight_attrs

from verl_quads.nvfp4.custom_ops import linear_custom_op, op_or_function
from verl_quads.rollout import emulation
from verl_quads.rollout.emulation import ActQuant

KERNEL_PARAMS = ("weight_packed", "weight_scale", "weight_global_scale")


def set_kernel_param(layer: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Write ``value`` into parameter ``name``: in place if it exists with that shape/dtype, else register it."""
    old = layer._parameters.get(name)
    if old is not None and old.shape == value.shape and old.dtype == value.dtype and not old.is_meta:
        old.data.copy_(value)
        return
    if old is not None:
        delattr(layer, name)
    layer.register_parameter(name, torch.nn.Parameter(value.contiguous(), requires_grad=False))


def shared_global_scale(per_shard: torch.Tensor, name: str) -> torch.Tensor:
    """The one float32 0-d global scale of a fused GEMM from its checkpoint shards' ``[S]`` scales.

    Raises if they differ (the fused GEMM has one scale; re-quantizing a shard would change its codes)
    or if any is not a positive finite number (e.g. a shard missing from the checkpoint left 0).
    """
    v = per_shard.reshape(-1).to(torch.float32)
    if not bool(torch.isfinite(v).all()) or not bool((v > 0).all()):
        raise ValueError(
            f"quads_nvfp4: {name}: checkpoint weight_global_scale {v.tolist()} (per fused shard) must be positive "
            "and finite; a shard missing from the checkpoint leaves 0"
        )
    if not bool((v == v[0]).all()):
        raise ValueError(
            f"quads_nvfp4: {name}: the fused shards' weight_global_scale differ ({v.tolist()}); vLLM runs them as one "
            "GEMM with one global scale, so the checkpoint must give q/k/v (gate/up) the same scale "
            "(verl-quads export and llm-compressor do)"
        )
    return v[0].clone().reshape(())


class QuadsNVFP4LinearMethod(LinearMethodBase):
    """NVFP4 weights, activations per ``act`` (see :mod:`verl_quads.rollout.emulation`).

    Args:
        act: activation quantization of this layer's GEMM.
        backend: concrete backend: ``torch`` (reference emulation), ``triton`` (fused NVFP4
            dequantize + GEMM, :mod:`verl_quads.nvfp4.triton_gemm`; CUDA tensors) or ``native``
            (vLLM's CUTLASS FP4 GEMM on Blackwell, :mod:`verl_quads.rollout.native`; untested on hardware).
        capture_key: ``(layer index, gemm name)`` when this GEMM's guidance is captured (trace).
        packed: the checkpoint holds packed NVFP4 tensors (compressed-tensors names), loaded as they are.
    """

    def __init__(self, act: ActQuant, backend: str = "torch", capture_key: tuple[int, str] | None = None,
                 packed: bool = False):
        super().__init__()
        self.packed = packed
        if backend not in ("torch", "triton", "native"):
            raise NotImplementedError(
                f"quads_nvfp4 linear: backend {backend!r} is not implemented (implemented: torch, triton, native)"
            )
        if backend == "native" and act.mode == "quads" and act.residual_combine != "fp4x2":
            raise ValueError(
                f"quads_nvfp4 linear: residual_combine={act.residual_combine!r} is for the emulated backends "
                "(torch, triton); backend 'native' runs vLLM's FP4 GEMM on the two FP4 operands (allowed there: "
                "'fp4x2')"
            )
        if backend == "native" and act.mode == "w4a16":
            from verl_quads.rollout import native

            native.log_w4a16_choice()
        self.act = act
        self.backend = backend
        self.capture_key = capture_key

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        if input_size_per_partition % 16:
            raise ValueError(
                f"quads_nvfp4: {getattr(layer, 'prefix', type(layer).__name__)} has input size "
                f"{input_size_per_partition} per partition, not a multiple of 16 (NVFP4 block); "
                "add it to quant_config.ignore"
            )
        emulation.check_gemm_input_length(self.act, self.backend, input_size_per_partition,
                                          getattr(layer, "prefix", type(layer).__name__))
        if self.backend == "native" and self.act.mode != "w4a16":  # w4a16 runs the triton kernel
            from verl_quads.rollout import native

            native.check_linear_shape(getattr(layer, "prefix", type(layer).__name__),
                                      sum(output_partition_sizes), input_size_per_partition)
        if self.capture_key is not None:
            from verl_quads.rollout.capture import get_store

            get_store().register_trace_gemm(*self.capture_key, k=input_size_per_partition)
        if self.packed:
            self._create_packed(layer, input_size_per_partition, output_partition_sizes, extra_weight_attrs)
            return
        weight = torch.nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        set_weight_attrs(weight, extra_weight_attrs)
        layer.register_parameter("weight", weight)

    @staticmethod
    def _create_packed(layer: torch.nn.Module, k: int, output_partition_sizes: list[int], extra: dict) -> None:
        """Packed-checkpoint parameters (module docstring). The layer's vLLM ``weight_loader`` (in ``extra``)
        fills them: ``output_dim`` / ``input_dim`` drive fused-shard offsets and tensor-parallel slices
        (both exact on packed bytes and block scales: packing and blocks run along K, and K per rank is
        a multiple of 16); ``needs_scalar_to_array`` puts each shard's ``[1]`` global scale in its slot."""
        n = sum(output_partition_sizes)
        for name, shape, dtype, attrs in (
            ("weight_packed", (n, k // 2), torch.uint8, {"input_dim": 1, "output_dim": 0}),
            ("weight_scale", (n, k // 16), torch.float8_e4m3fn, {"input_dim": 1, "output_dim": 0}),
            ("weight_global_scale", (len(output_partition_sizes),), torch.float32, {"needs_scalar_to_array": True}),
        ):
            p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            set_weight_attrs(p, attrs)
            set_weight_attrs(p, extra)
            layer.register_parameter(name, p)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w = layer._parameters.get("weight")
        if w is None:
            # Already in kernel format (packed checkpoint, or packed weights loaded straight into weight_packed).
            missing = [n for n in KERNEL_PARAMS if n not in layer._parameters]
            if missing:
                raise RuntimeError(f"quads_nvfp4: layer has neither 'weight' nor {missing}")
            gs = layer._parameters["weight_global_scale"]
            if gs.dim() == 1:  # per-shard scales from a packed checkpoint -> the one shared scale
                name = getattr(layer, "prefix", type(layer).__name__)
                set_kernel_param(layer, "weight_global_scale", shared_global_scale(gs.data, name))
            self.after_packed_load(layer)
            return
        q = emulation.quantize_weight(w.data)
        set_kernel_param(layer, "weight_packed", q.packed)
        set_kernel_param(layer, "weight_scale", q.block_scale)
        set_kernel_param(layer, "weight_global_scale", q.global_scale.reshape(()))
        delattr(layer, "weight")
        self.after_packed_load(layer)

    def after_packed_load(self, layer: torch.nn.Module) -> None:
        """After the kernel-format params were (re)written in place (load, vLLM reload, packed sync):
        ``native`` re-derives its swizzled block scales and alpha in place; other backends: nothing."""
        if self.backend == "native":
            from verl_quads.rollout import native

            native.prepare_linear(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.backend == "triton":
            return self._apply_triton(layer, x, bias)
        if self.backend == "native":
            from verl_quads.rollout import native

            return native.apply_linear(layer, x, bias, self.act, self.capture_key)
        w = emulation.weight_f32(layer.weight_packed, layer.weight_scale, layer.weight_global_scale)
        x2 = x.reshape(-1, x.shape[-1])
        xf, record = emulation.quantize_activation(x2, self.act)
        if record is not None and self.capture_key is not None:
            from verl_quads.rollout.capture import get_store

            get_store().add(*self.capture_key, record)
        y = emulation.gemm(xf, w, bias, x.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _apply_triton(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The ``triton`` backend: activation quantized by the NVFP4 core (same codes as the torch
        backend), then one fused dequantize + GEMM launch reading the packed weight. Runs as a custom op
        (opaque to torch.compile): ``torch.ops.verl_quads.nvfp4_linear``, or with guidance capture (trace)
        ``torch.ops.verl_quads.nvfp4_linear_guided``, which also writes the record into the guidance store's
        persistent buffers (recorded in CUDA graphs with the GEMM); eagerly the latter's function is called
        directly (no dispatcher round trip)."""
        from verl_quads.nvfp4 import triton_gemm  # noqa: F401  (registers torch.ops.verl_quads.nvfp4_linear)

        x2 = x.reshape(-1, x.shape[-1])
        a = self.act
        args = (x2, layer.weight_packed, layer.weight_scale, layer.weight_global_scale, bias, a.mode,
                a.residual_ratio, a.residual_per_token, a.residual_combine, a.residual_granularity)
        if not (a.capture and self.capture_key is not None):
            y = torch.ops.verl_quads.nvfp4_linear(*args)
        else:
            y = op_or_function(torch.ops.verl_quads.nvfp4_linear_guided, _linear_guided, *args, *self.capture_key)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _linear_guided(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, w_gs: torch.Tensor,
                   bias: torch.Tensor | None, act_mode: str, residual_ratio: float, residual_per_token: bool,
                   residual_combine: str, residual_granularity: str, layer: int, gemm: str) -> torch.Tensor:
    """``triton`` linear ``[M, K] -> [M, N]`` whose activation quantize kernel also writes its input's guidance record
    (decoder layer ``layer``, GEMM ``gemm``) straight into the guidance store's persistent rows
    (:meth:`~verl_quads.rollout.capture.GuidanceStore.record_rows`: fixed addresses, so a CUDA graph replays the
    writes; no copies)."""
    from verl_quads.nvfp4 import triton_gemm
    from verl_quads.rollout.capture import get_store
    from verl_quads.rollout.trace_rows import GemmRows

    out = None
    if act_mode == "trace":
        out = get_store().record_rows(layer, gemm, GemmRows(x.shape[1]), x.shape[0], x.device)
    op, _ = triton_gemm.quantize_activation(
        x, act_mode, residual_ratio=residual_ratio, residual_per_token=residual_per_token, capture=True,
        residual_combine=residual_combine, residual_granularity=residual_granularity, record_out=out,
    )
    return triton_gemm.nvfp4_gemm(op, w_packed, w_scale, w_gs, bias)


linear_guided_op = linear_custom_op(
    "nvfp4_linear_guided", _linear_guided,
    "(Tensor x, Tensor w_packed, Tensor w_scale, Tensor w_gs, Tensor? bias, str act_mode, float residual_ratio, "
    "bool residual_per_token, str residual_combine, str residual_granularity, int layer, str gemm) -> Tensor",
)


__all__ = ["KERNEL_PARAMS", "QuadsNVFP4LinearMethod", "linear_guided_op", "set_kernel_param", "shared_global_scale"]
