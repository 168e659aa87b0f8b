"""Straight-through fake quantization for QAT.

Forward: NVFP4 QDQ of the input (bit-identical to :func:`verl_quads.nvfp4.fake_quantize`).
Backward: the incoming gradient passes through unchanged (straight-through estimator); the
global scale is treated as a constant. So the master weight receives exactly the gradient the
BF16 model would have at the QDQ weight.
"""

from __future__ import annotations

import torch


class _FakeQuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, global_scale, amax, backend: str, check_finite: bool):  # type: ignore[override]
        from verl_quads.nvfp4 import fake_quantize

        return fake_quantize(x, global_scale, amax=amax, backend=backend, check_finite=check_finite)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None, None, None, None


def fake_quantize_ste(
    x: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    *,
    amax: torch.Tensor | str | None = None,
    backend: str = "auto",
    check_finite: bool = True,
) -> torch.Tensor:
    """QDQ with a straight-through gradient. Same shape and dtype as ``x``. ``amax``: instead of
    ``global_scale`` (see :func:`verl_quads.nvfp4.fake_quantize`; detached, no gradient).

    ``check_finite=False`` skips the finite checks of ``x`` and ``global_scale`` (each costs a
    device-to-host sync; training hot paths turn them off, a NaN then propagates as in BF16).
    """
    return _FakeQuantizeSTE.apply(x, global_scale, amax, backend, check_finite)
