"""``quads_nvfp4`` routed-experts method (vLLM ``FusedMoEMethodBase``).

Parameters of a ``RoutedExperts`` layer with E local experts, hidden H, expert intermediate I:

- load format (from a BF16 checkpoint, through the layer's own ``weight_loader``):
  ``w13_weight``: params_dtype ``[E, 2I, H]`` (gate rows then up rows), ``w2_weight``: ``[E, H, I]``.
- load format of a packed NVFP4 checkpoint (compressed-tensors per-expert ``weight_packed`` /
  ``weight_scale`` / ``weight_global_scale``, ``packed=True``): the kernel-format tensors below, filled
  through the layer's own vLLM weight loader (per expert, gate -> first half of w13, up -> second,
  tensor-parallel slices of the intermediate dim by rank), except ``w13_weight_global_scale`` float32
  ``[E, 2]`` (gate, up; must be equal per expert, then reduced to ``[E]``).
- kernel format (made by :meth:`process_weights_after_loading`, which deletes the BF16 ones):
  ``w13_weight_packed`` uint8 ``[E, 2I, H/2]``, ``w13_weight_scale`` float8_e4m3fn ``[E, 2I, H/16]``,
  ``w13_weight_global_scale`` float32 ``[E]`` (one per expert, gate and up share it);
  ``w2_weight_packed`` uint8 ``[E, H, I/2]``, ``w2_weight_scale`` e4m3 ``[E, H, I/16]``,
  ``w2_weight_global_scale`` float32 ``[E]``. Fixed shapes, rewritten in place on reload.

Forward (torch backend; routing is done by vLLM's runner and passed in as ``topk_ids``/``topk_weights``):
``x`` is quantized once (per-token global scales) for all experts; per active expert, GEMM1 in
float32 -> cast to the input dtype; ``silu(gate) * up`` in float32 -> cast; the GEMM2 input is
quantized (per token-slot row; ``quads``: residual block selection per expert call); GEMM2 in
float32 -> cast; the router-weighted sum over the top-k slots in float32, one final cast.
A per-expert Python loop: a reference, not a product path. The ``triton`` backend
(:meth:`QuadsNVFP4MoEMethod.forward_triton`) runs the same arithmetic as one grouped launch per GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.utils import set_weight_attrs

from verl_quads.rollout import emulation
from verl_quads.rollout.emulation import ActQuant
from verl_quads.rollout.linear import set_kernel_param

KERNEL_PARAMS = tuple(f"{w}_weight_{p}" for w in ("w13", "w2") for p in ("packed", "scale", "global_scale"))


class QuadsNVFP4MoEMethod(FusedMoEMethodBase):
    """NVFP4 routed experts, activations per ``act``.

    Args:
        moe: vLLM's ``FusedMoEConfig`` of the layer.
        act: activation quantization of both expert GEMMs.
        backend: concrete backend: ``torch`` (the per-expert reference below) or ``triton``
            (grouped fused NVFP4 GEMMs, :meth:`forward_triton`); ``native`` is refused in
            :meth:`create_weights` unless the user opted into triton experts
            (:func:`verl_quads.rollout.native.experts_backend`).
        capture_layer: decoder layer index when guidance is captured (trace), else None.
        packed: the checkpoint holds packed NVFP4 tensors (compressed-tensors names), loaded as they are.
    """

    def __init__(self, moe, act: ActQuant, backend: str = "torch", capture_layer: int | None = None,
                 packed: bool = False):
        super().__init__(moe)
        self.packed = packed
        if backend not in ("torch", "triton", "native"):
            raise NotImplementedError(
                f"quads_nvfp4 MoE: backend {backend!r} is not implemented (implemented: torch, triton; "
                "native only with VERL_QUADS_NATIVE_EXPERTS=triton)"
            )
        if getattr(moe, "has_bias", False):
            raise NotImplementedError("quads_nvfp4 MoE: expert biases are not supported")
        act_name = getattr(getattr(moe, "activation", None), "value", None)
        if act_name not in (None, "silu"):
            raise NotImplementedError(f"quads_nvfp4 MoE: activation {act_name!r} not supported (only gated silu)")
        self.act = act
        self.backend = backend
        self.capture_layer = capture_layer
        self.routing_layer: int | None = None  # decoder layer whose routing is captured (set in create_weights)

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **extra):
        from verl_quads.rollout.capture import enable_routing_capture

        if self.backend == "native":  # refuse at engine start unless triton experts were chosen explicitly
            from verl_quads.rollout.native import experts_backend

            self.backend = experts_backend(getattr(layer, "layer_name", ""))

        # routing capture (quads/routing_disagreement), every quantized mode unless VERL_QUADS_ROUTING=0
        self.routing_layer = enable_routing_capture(getattr(layer, "layer_name", ""))
        if self.capture_layer is not None:
            from verl_quads.rollout.capture import MOE_GUIDED_GEMMS, get_store

            w13, w2 = MOE_GUIDED_GEMMS  # their records: the layer input [T, H]; each slot's input [T, top_k, I]
            experts = int(getattr(self.moe, "num_experts", num_experts))  # global ids: what topk_ids hold
            if experts > 2**15 - 1:
                raise NotImplementedError(
                    f"verl-quads TRACE: {getattr(layer, 'layer_name', 'MoE layer')} has {experts} experts; the "
                    "guidance rows store expert ids as int16 (at most 32767 experts)")
            get_store().register_trace_gemm(self.capture_layer, w13, k=hidden_size)
            get_store().register_trace_gemm(self.capture_layer, w2, k=intermediate_size_per_partition,
                                            slots=self.moe.experts_per_token)
        for name, dim in (("hidden", hidden_size), ("intermediate", intermediate_size_per_partition)):
            if dim % 16:
                raise ValueError(f"quads_nvfp4 MoE: {name} size {dim} is not a multiple of 16 (NVFP4 block)")
        for gemm, k in (("w13", hidden_size), ("w2", intermediate_size_per_partition)):  # their activation rows
            emulation.check_gemm_input_length(self.act, self.backend, k,
                                              f"{getattr(layer, 'layer_name', '') or 'MoE layer'} experts {gemm}")
        if self.packed:
            self._create_packed(layer, num_experts, hidden_size, intermediate_size_per_partition, extra)
            return
        w13 = torch.nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size_per_partition, hidden_size, dtype=params_dtype),
            requires_grad=False,
        )
        w2 = torch.nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        for name, p in (("w13_weight", w13), ("w2_weight", w2)):
            layer.register_parameter(name, p)
            set_weight_attrs(p, extra)

    @staticmethod
    def _create_packed(layer, e: int, h: int, i: int, extra: dict) -> None:
        """Packed-checkpoint parameters (module docstring). vLLM's expert weight loader picks the path by
        name and ``quant_method``: ``*_weight_packed`` as model weights, ``*_weight_scale`` as group scales,
        ``*_weight_global_scale`` as per-tensor scales (``[E, 2]`` for w1/w3, ``[E]`` for w2)."""
        from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported

        group, tensor = FusedMoeWeightScaleSupported.GROUP.value, FusedMoeWeightScaleSupported.TENSOR.value
        for name, shape, dtype, qm in (
            ("w13_weight_packed", (e, 2 * i, h // 2), torch.uint8, None),
            ("w13_weight_scale", (e, 2 * i, h // 16), torch.float8_e4m3fn, group),
            ("w13_weight_global_scale", (e, 2), torch.float32, tensor),
            ("w2_weight_packed", (e, h, i // 2), torch.uint8, None),
            ("w2_weight_scale", (e, h, i // 16), torch.float8_e4m3fn, group),
            ("w2_weight_global_scale", (e,), torch.float32, tensor),
        ):
            p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            layer.register_parameter(name, p)
            set_weight_attrs(p, extra)
            if qm is not None:
                set_weight_attrs(p, {"quant_method": qm})

    def _finish_packed_load(self, layer) -> None:
        """Checkpoint global scales -> kernel format: w13 ``[E, 2]`` (gate, up; must be equal) -> ``[E]``;
        w2 ``[E]`` checked (positive, finite: an expert missing from the checkpoint leaves 0)."""
        from verl_quads.rollout.linear import shared_global_scale

        name = getattr(layer, "layer_name", type(layer).__name__)
        for stem in ("w13", "w2"):
            gs = layer._parameters[f"{stem}_weight_global_scale"].data
            rows = gs.reshape(gs.shape[0], -1)
            one = torch.stack([shared_global_scale(rows[x], f"{name} expert {x} {stem}") for x in range(rows.shape[0])])
            set_kernel_param(layer, f"{stem}_weight_global_scale", one)

    def get_fused_moe_quant_config(self, layer):
        return None  # this method runs its own GEMMs; no vLLM modular kernel is built

    def process_weights_after_loading(self, layer) -> None:
        if self.packed and layer._parameters.get("w13_weight_global_scale") is not None \
                and layer._parameters["w13_weight_global_scale"].dim() == 2:
            self._finish_packed_load(layer)
            return
        for stem in ("w13", "w2"):
            w = layer._parameters.get(f"{stem}_weight")
            if w is None:
                missing = [n for n in KERNEL_PARAMS if n.startswith(stem) and n not in layer._parameters]
                if missing:
                    raise RuntimeError(f"quads_nvfp4 MoE: layer has neither {stem}_weight nor {missing}")
                continue
            q = emulation.quantize_weight(w.data, reduce_dims=(1, 2))
            set_kernel_param(layer, f"{stem}_weight_packed", q.packed)
            set_kernel_param(layer, f"{stem}_weight_scale", q.block_scale)
            set_kernel_param(layer, f"{stem}_weight_global_scale", q.global_scale.reshape(-1))
            delattr(layer, f"{stem}_weight")

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        if self.routing_layer is not None:  # copy into a persistent buffer: CUDA-graph safe (capture.py)
            from verl_quads.rollout.capture import record_routing

            record_routing(self.routing_layer, topk_ids)
        if self.backend == "triton":
            return self.forward_triton(layer, x, topk_weights, topk_ids)
        return self.forward_reference(layer, x, topk_weights, topk_ids)

    @staticmethod
    def _routing_inputs(layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        """(x, local expert ids int64 [T, k] (-1: not a local expert), float32 slot weights [T, k])."""
        k = topk_ids.shape[1]
        ids = topk_ids.to(torch.int64)
        expert_map = getattr(layer, "expert_map", None)
        if expert_map is not None:
            ids = expert_map.to(x.device)[ids].to(torch.int64)
        if getattr(layer, "apply_router_weight_on_input", False):
            if k != 1:
                raise NotImplementedError("apply_router_weight_on_input needs top_k == 1")
            x = (x.to(torch.float32) * topk_weights.to(torch.float32)).to(x.dtype)
            slot_weights = torch.ones_like(topk_weights, dtype=torch.float32)
        else:
            slot_weights = topk_weights.to(torch.float32)
        return x, ids, slot_weights

    def _capture_w2(self, rec2, t: int, k: int, inter: int, ids: torch.Tensor) -> None:
        from verl_quads.nvfp4 import GuidanceRecord
        from verl_quads.rollout.capture import get_store

        rec2 = GuidanceRecord(
            rec2.bits.reshape(t, k, -1),
            rec2.block_scale.reshape(t, k, -1),
            rec2.global_scale.reshape(t, k, 1),
            torch.Size((t, k, inter)),
        )
        get_store().add(self.capture_layer, "mlp.experts.w2", rec2, expert_ids=ids)

    def forward_triton(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        """Routed-experts output ``[T, H]`` in x's dtype, ``triton`` backend: the same arithmetic as
        :meth:`forward_reference` (same activation codes; float32 summation order differs) with ONE
        grouped launch per expert GEMM (:func:`verl_quads.nvfp4.triton_gemm.moe_forward`). Without
        guidance capture it runs as the custom op ``torch.ops.verl_quads.nvfp4_moe`` (opaque to
        torch.compile); with capture (trace) as Python handing the records to the guidance store, which copies
        them into persistent buffers. On CUDA vLLM runs every MoE layer through its own custom op
        (``torch.ops.vllm.moe_forward``), so this Python runs eagerly or while a CUDA graph is captured, whose
        replays repeat the copies."""
        from verl_quads.nvfp4 import triton_gemm as tg

        t, _ = x.shape
        k = topk_ids.shape[1]
        x, ids, slot_weights = self._routing_inputs(layer, x, topk_weights, topk_ids)
        q = self.act
        weights = (layer.w13_weight_packed, layer.w13_weight_scale, layer.w13_weight_global_scale,
                   layer.w2_weight_packed, layer.w2_weight_scale, layer.w2_weight_global_scale)
        if not (q.capture and self.capture_layer is not None):
            return torch.ops.verl_quads.nvfp4_moe(x, slot_weights, ids, *weights, q.mode, q.residual_ratio,
                                                  q.residual_per_token, q.residual_combine, q.residual_granularity)
        from verl_quads.rollout.capture import get_store
        from verl_quads.rollout.trace_rows import GemmRows

        inter = layer.w2_weight_packed.shape[-1] * 2

        def record_out(gemm: str):
            # the quantize kernels write the records straight into the store's rows (no copies per forward)
            if gemm == "mlp.experts.w2":
                return get_store().record_rows(self.capture_layer, gemm, GemmRows(inter, k), t, x.device, ids)
            return get_store().record_rows(self.capture_layer, gemm, GemmRows(x.shape[1]), t, x.device)

        return tg.moe_forward(x, slot_weights, ids, *weights, q.mode, residual_ratio=q.residual_ratio,
                              residual_per_token=q.residual_per_token, record_out=record_out,
                              residual_combine=q.residual_combine, residual_granularity=q.residual_granularity)

    def forward_reference(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        """Routed-experts output ``[T, H]`` in x's dtype (see module docstring for the arithmetic)."""
        t, _ = x.shape
        k = topk_ids.shape[1]
        x, ids, slot_weights = self._routing_inputs(layer, x, topk_weights, topk_ids)

        xf, rec = emulation.quantize_activation(x, self.act)
        if rec is not None and self.capture_layer is not None:
            from verl_quads.rollout.capture import get_store

            get_store().add(self.capture_layer, "mlp.experts.w13", rec)

        inter = layer.w2_weight_packed.shape[-1] * 2
        act_all = torch.zeros(t, k, inter, dtype=x.dtype, device=x.device)
        experts = [int(e) for e in torch.unique(ids).tolist() if e >= 0]
        rows = {}
        for e in experts:
            tok, slot = (ids == e).nonzero(as_tuple=True)
            rows[e] = (tok, slot)
            w13 = emulation.weight_f32(layer.w13_weight_packed[e], layer.w13_weight_scale[e], layer.w13_weight_global_scale[e])
            h = emulation.gemm(xf[tok], w13, None, x.dtype)
            a = (F.silu(h[:, :inter].to(torch.float32)) * h[:, inter:].to(torch.float32)).to(x.dtype)
            act_all[tok, slot] = a

        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        if self.act.mode == "quads":
            a_f = {e: emulation.quantize_activation(act_all[tok, slot], self.act)[0] for e, (tok, slot) in rows.items()}
        else:
            flat_f, rec2 = emulation.quantize_activation(act_all.reshape(t * k, inter), self.act)
            flat_f = flat_f.reshape(t, k, inter)
            a_f = {e: flat_f[tok, slot] for e, (tok, slot) in rows.items()}
            if rec2 is not None and self.capture_layer is not None:
                self._capture_w2(rec2, t, k, inter, ids)
        for e, (tok, slot) in rows.items():
            w2 = emulation.weight_f32(layer.w2_weight_packed[e], layer.w2_weight_scale[e], layer.w2_weight_global_scale[e])
            y = emulation.gemm(a_f[e], w2, None, x.dtype)
            out.index_add_(0, tok, y.to(torch.float32) * slot_weights[tok, slot].unsqueeze(-1))
        return out.to(x.dtype)


__all__ = ["KERNEL_PARAMS", "QuadsNVFP4MoEMethod"]
