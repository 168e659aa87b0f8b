"""Registration of NVFP4 linear forwards as torch custom ops (opaque to torch.compile: vLLM compiles the model, and
Dynamo must not trace launch code or the rollout's guidance store): the core's ``verl_quads::nvfp4_linear``
(:mod:`.triton_gemm`) and the rollout's native / guided linears (:mod:`verl_quads.rollout.linear`,
:mod:`verl_quads.rollout.native`)."""

from __future__ import annotations

from typing import Callable

import torch


def linear_custom_op(name: str, fn: Callable[..., torch.Tensor], schema: str):
    """Register ``fn`` as the custom op ``verl_quads::<name>`` with ``schema``, whose first two tensors are the
    activation ``x`` ``[M, K]`` and the packed weight ``w_packed`` ``[N, K/2]``: its fake (shape) implementation
    returns ``[M, N]`` in x's dtype. ``mutates_args=()``: a guided op's writes into the guidance store's buffers are
    a side effect the compiler does not see, harmless because the op's output is always used (it is never dropped)
    and the buffers are read only after the forward (``GuidanceStore.end_step``)."""
    op = torch.library.custom_op(f"verl_quads::{name}", fn, mutates_args=(), schema=schema)

    @op.register_fake
    def _(x, w_packed, *args, **kwargs):
        return x.new_empty(x.shape[0], w_packed.shape[0])

    return op


def op_or_function(op, fn: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """``op(*args)`` while torch.compile traces (an opaque node in its graph), else ``fn(*args)``, the op's own
    function called directly: in eager engines the dispatcher round trip is host time on every call."""
    return op(*args) if torch.compiler.is_compiling() else fn(*args)


__all__ = ["linear_custom_op", "op_or_function"]
