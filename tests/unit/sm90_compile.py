"""Shared by the kernel tests: compile Triton kernels for sm_90 on a machine without a GPU.

The interpreter does not run the GPU compiler's checks (it has accepted code that triton's code generator or
ptxas then rejected), so the kernel tests also compile their kernels ahead of time with the ptxas bundled with
triton, in a fresh Python without TRITON_INTERPRET. Nothing runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def compile_for_sm90_in_subprocess(script: str, gpu_skip_reason: str) -> None:
    """Run ``script`` (Python source that compiles kernels with triton's ``ASTSource``/``GPUTarget`` API and
    prints "compiled") in a subprocess without TRITON_INTERPRET and assert it succeeded. Skips where that API
    is missing or where a GPU is present (``gpu_skip_reason``: which tests compile and run them there)."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the triton version
        pytest.skip(f"triton's ahead-of-time compile API is not available: {e}")
    if torch.cuda.is_available():
        pytest.skip(gpu_skip_reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]
