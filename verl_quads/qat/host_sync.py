"""Find device->host synchronisations in a piece of PyTorch code, on any device (CPU included).

A CUDA stream runs asynchronously from the Python thread that enqueues its kernels. An op whose
*result on the host* depends on device data (a Python ``bool``/``int``/``float``/list of a tensor, an
output whose SHAPE depends on the values, a blocking copy between host and device) makes the host
wait until the GPU has drained everything enqueued before it; afterwards the GPU idles while the host
enqueues the next kernels. In a training step that turns into wall time the kernel profile does not
show (``docs/bench_qat_h200.txt``: wall grows 4.3 ms while kernel time grows ~1 ms).

:class:`HostSyncRecorder` is a context manager that records every such op executed inside it. It
works on CPU tensors too (nothing syncs on CPU, but the same ops *would* sync on CUDA), so a CPU test
can prove that a CUDA run would not sync. What counts (checked against torch 2.13's CUDA kernels,
``aten/src/ATen/native/cuda``; a :class:`torch.utils._python_dispatch.TorchDispatchMode` sees ops
after autograd and after CompositeImplicitAutograd decompositions, so e.g. ``Tensor.item`` and
``bool(t)`` arrive as ``_local_scalar_dense``):

- ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``, ``if t:``): a
  ``cudaMemcpyAsync`` D2H of one element followed by a stream synchronize. ``aten.item`` /
  ``aten.is_nonzero`` are listed as well in case a build dispatches them undecomposed.
- data-dependent output shapes: ``aten.nonzero`` (also ``torch.where(cond)`` and ``argwhere``),
  ``aten.masked_select``, ``aten.index.Tensor`` / ``aten.index_put_`` / ``aten._index_put_impl_``
  with a bool/uint8 index (a boolean mask index is ``nonzero`` + gather/scatter), ``aten._unique``,
  ``aten._unique2``, ``aten.unique_dim``, ``aten.unique_consecutive``, ``aten.repeat_interleave.Tensor``
  without ``output_size`` (sums the repeats on the host), ``aten.bincount`` (its CUDA kernel reads
  ``max()`` and ``min()`` of the input to size the output), ``aten.histc`` with ``min == max`` (reads
  the input's min/max; transformers' grouped-MM path passes explicit bounds, which do not sync).
- host-side comparisons: ``aten.equal`` (CUDA: ``eq(...).all().item()``), ``aten.allclose`` (CUDA
  decomposes to ``isclose().all().item()``), ``aten.is_same_size`` is NOT one (metadata only).
- copies between the host and a device: ``aten._to_copy`` / ``aten.copy_`` whose source and
  destination devices differ and whose ``non_blocking`` is false (torch's ``copy_`` runs
  ``cudaMemcpyAsync`` then ``cudaStreamSynchronize`` for a blocking copy in EITHER direction, so a
  blocking H2D copy of a pageable tensor stalls too). On a CPU-only run such copies do not occur, so
  this class can only find them on a GPU (``verl-quads bench qat`` on CUDA uses it for that).
- Python-level methods that never reach the dispatcher on CPU tensors but D2H-copy a device tensor:
  ``Tensor.tolist``, ``Tensor.numpy``, ``Tensor.cpu``, ``Tensor.__array__`` (recorded through a
  :class:`torch.overrides.TorchFunctionMode`; on a CPU tensor ``cpu()`` is a no-op but it would copy
  a device tensor, so it is recorded regardless of the device).

NOT syncs (so not recorded): ``aten._assert_async`` (a device-side assert), ``aten.nonzero_static``,
``any``/``all``/``sum`` themselves (they stay on the device until something reads them on the host),
``sort``/``argsort``/``cumsum``/``histc`` with explicit bounds, ``index_select``/advanced indexing
with integer indices, ``torch.empty``/``zeros`` with host-known shapes, reading ``.shape``/``.dtype``.

Limits: a sync inside a C++/CUDA extension or inside a Triton launcher (which reads only tensor
metadata and data pointers) is invisible to the dispatcher; ``torch.cuda.synchronize()`` and
``Event.synchronize()`` are not aten ops. Ops run by the Triton interpreter (``TRITON_INTERPRET=1``,
CPU tests) while it emulates a kernel are skipped: on a GPU the same launch is one asynchronous
kernel (see :data:`IGNORE_FRAMES`).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: Ops that always force the host to wait for the device (see the module docstring).
ALWAYS_SYNC = {
    "aten._local_scalar_dense",
    "aten.item",
    "aten.is_nonzero",
    "aten.nonzero",
    "aten.argwhere",
    "aten.masked_select",
    "aten._unique",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
    "aten.bincount",
    "aten.equal",
    "aten.allclose",
}

#: Python methods (TorchFunctionMode) that copy a device tensor to the host.
PY_SYNC_METHODS = {"tolist", "numpy", "cpu", "__array__"}

#: Frames (path fragments) whose ops are not recorded: the Triton interpreter emulating one kernel on
#: CPU. On a GPU the launch is a single asynchronous kernel.
IGNORE_FRAMES = ("triton/runtime/interpreter.py",)


def _packet(func) -> str:
    """``aten.nonzero`` for ``aten.nonzero.default`` (the overload packet's name)."""
    return str(getattr(func, "overloadpacket", func))


def _is_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()))


def _sync_reason(func, args, kwargs) -> str | None:
    """Why ``func(*args, **kwargs)`` would synchronise on CUDA, or None."""
    name = _packet(func)
    if name in ALWAYS_SYNC:
        return name
    if name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl", "aten._index_put_impl_"):
        idx = args[1] if len(args) > 1 else kwargs.get("indices")
        return f"{name} with a boolean mask index" if _is_bool_index(idx) else None
    if name == "aten.repeat_interleave" and func.overloadpacket is aten.repeat_interleave:
        has_tensor_repeats = any(isinstance(a, torch.Tensor) and a.dtype != torch.bool for a in args[:2])
        if has_tensor_repeats and kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None):
            return "aten.repeat_interleave without output_size"
        return None
    if name == "aten.histc":
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return "aten.histc with min == max (reads the input's range)" if lo == hi else None
    if name == "aten._to_copy":
        src = args[0]
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev) != src.device and not kwargs.get("non_blocking", False):
            return f"aten._to_copy {src.device} -> {torch.device(dev)} (blocking)"
        return None
    if name == "aten.copy_":
        dst, src = args[0], args[1]
        nb = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if isinstance(src, torch.Tensor) and dst.device != src.device and not nb:
            return f"aten.copy_ {src.device} -> {dst.device} (blocking)"
    return None


@dataclass
class SyncEvent:
    """One recorded sync: why, and the innermost ``verl_quads`` source line that caused it."""

    reason: str
    where: str

    def __str__(self) -> str:
        return f"{self.reason} at {self.where}"


def _where() -> str | None:
    """Innermost project frame (``verl_quads/...`` or a test), or None inside an ignored frame."""
    frames = traceback.extract_stack()
    if any(any(f in fr.filename for f in IGNORE_FRAMES) for fr in frames):
        return None
    for fr in reversed(frames):
        fn = fr.filename.replace("\\", "/")
        if "/verl_quads/" in fn and not fn.endswith("qat/host_sync.py"):
            return f"{fn.rsplit('/verl_quads/', 1)[1]}:{fr.lineno} ({fr.name})"
    for fr in reversed(frames):
        if "/torch/" not in fr.filename and not fr.filename.endswith("host_sync.py"):
            return f"{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno} ({fr.name})"
    return "?"


class _Dispatch(TorchDispatchMode):
    def __init__(self, rec: "HostSyncRecorder"):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            self.rec._add(reason)
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, rec: "HostSyncRecorder"):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in PY_SYNC_METHODS and args and isinstance(args[0], torch.Tensor):
            self.rec._add(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


@dataclass
class HostSyncRecorder:
    """``with HostSyncRecorder() as rec: ...`` then ``rec.events`` (list of :class:`SyncEvent`).

    ``len(rec)`` is the number of recorded syncs; ``rec.summary()`` groups them by reason and place.
    Nesting inside other dispatch modes is fine; the recorder does not change any result.
    """

    events: list[SyncEvent] = field(default_factory=list)

    def _add(self, reason: str) -> None:
        where = _where()
        if where is not None:
            self.events.append(SyncEvent(reason, where))

    def __enter__(self) -> "HostSyncRecorder":
        self._modes = [_Function(self), _Dispatch(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)

    def __len__(self) -> int:
        return len(self.events)

    def summary(self) -> str:
        """``count x reason at place`` lines, most frequent first (empty string when none)."""
        counts: dict[str, int] = {}
        for e in self.events:
            counts[str(e)] = counts.get(str(e), 0) + 1
        return "\n".join(f"{n} x {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


__all__ = ["HostSyncRecorder", "SyncEvent", "ALWAYS_SYNC", "PY_SYNC_METHODS"]
