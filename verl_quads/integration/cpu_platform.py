"""A CPU platform for verl (``verl.plugin.platform``), registered through verl's own registry.

verl 0.9.1 resolves its hardware platform once per process (``get_platform()``): it probes the
registered platforms (nvidia, huawei, amd) and, when none is present, falls back to ``nvidia``,
which then calls ``torch.cuda`` everywhere. There is no CPU platform upstream. This module adds
one with ``PlatformRegistry.register(platform="cpu")`` — verl's documented extension point, no
monkey-patching. Because built-ins are registered first, auto-detection only reaches ``cpu``
when no accelerator platform claims the host; ``VERL_PLATFORM=cpu`` forces it.

Choices (each is what verl's callers need on a CPU host):
- device ``"cpu"``, collective backend ``"gloo"``; no CUDA-IPC, so verl's weight transfer to
  the colocated vLLM uses its shared-memory path (``is_ipc_supported() -> False``).
- ``current_device()`` returns ``"cpu"`` (what ``torch.cpu.current_device()`` returns): verl uses
  ``get_device_id()`` as a ``device=`` argument in ~20 places, where an int would mean
  ``cuda:<int>`` to torch.
- Ray scheduling: verl counts and places "device slots" with Ray's accelerator resource and reads
  each worker's slot index from ``ray.get_runtime_context().get_accelerator_ids()``, which only
  knows accelerator resources (GPU, NPU, ...), not CPU. We therefore use Ray's ``GPU`` resource
  as a *logical* slot count on CPU hosts: start Ray with ``+ray_kwargs.ray_init.num_gpus=<n>``
  (n = trainer.n_gpus_per_node). Nothing touches a GPU; torch here is a CPU-only build.
- ``device_module`` is :data:`cpu_device_module`: ``torch.cpu`` plus the memory/IPC/RNG
  functions verl calls through ``get_torch_device()`` that ``torch.cpu`` lacks. Memory numbers
  are the process's resident set size (CPU tensors have no separate allocator statistics).
"""

from __future__ import annotations

import contextlib
import os
import platform as _py_platform
import resource
import types
from typing import Any, Optional

import torch

PLATFORM_NAME = "cpu"
VENDOR_NAME = "cpu"


def torch_is_cpu_only() -> bool:
    """True when this torch build has no accelerator backend at all (CUDA, ROCm, Ascend NPU)."""
    return torch.version.cuda is None and torch.version.hip is None and not hasattr(torch, "npu")


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


def _build_device_module() -> types.ModuleType:
    mod = types.ModuleType("verl_quads.cpu_device", "torch.cpu plus the device-module API verl calls")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(mod, name, getattr(torch.cpu, name))
    noop = lambda *a, **k: None  # noqa: E731
    mod.empty_cache = noop  # CPU memory is returned by the allocator itself
    mod.ipc_collect = noop  # no CUDA-IPC handles on CPU
    mod.set_per_process_memory_fraction = noop
    mod.reset_peak_memory_stats = noop
    mod.mem_get_info = _mem_get_info
    mod.memory_allocated = lambda device=None: _rss_bytes()
    mod.memory_reserved = lambda device=None: _rss_bytes()
    mod.max_memory_allocated = lambda device=None: _peak_rss_bytes()
    mod.max_memory_reserved = lambda device=None: _peak_rss_bytes()
    mod.get_rng_state = lambda device=None: torch.get_rng_state()
    mod.set_rng_state = lambda state, device=None: torch.set_rng_state(state)
    mod.manual_seed = torch.manual_seed
    mod.manual_seed_all = torch.manual_seed
    mod.get_device_name = lambda device=None: _py_platform.processor() or "cpu"
    return mod


cpu_device_module = _build_device_module()


def make_platform_class():
    """Create (not register) the ``PlatformBase`` subclass; verl is imported lazily."""
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl platform for hosts whose torch build has no accelerator (see module doc)."""

        device_name = PLATFORM_NAME  # type: ignore[assignment]
        vendor_name = VENDOR_NAME  # type: ignore[assignment]

        @property
        def device_module(self) -> types.ModuleType:
            return cpu_device_module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return torch_is_cpu_only()

        def current_device(self) -> str:  # type: ignore[override]
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None  # every rank shares the host CPU

        def synchronize(self, device_index: Optional[int] = None) -> None:
            torch.cpu.synchronize()

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None  # CUDA caching-allocator settings have no CPU counterpart

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            # Ray exports this for its (logical) GPU resource; on CPU nothing reads it.
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"  # logical device slots, see module doc

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU


_registered = None


def register_cpu_platform():
    """Register the CPU platform with verl's ``PlatformRegistry`` (idempotent); return its class."""
    global _registered
    if _registered is not None:
        return _registered
    from verl.plugin.platform import PlatformRegistry

    cls = make_platform_class()
    PlatformRegistry.register(platform=PLATFORM_NAME)(cls)
    _registered = cls
    return cls


def cpu_platform_selected() -> bool:
    """Whether verl in this process will run on (or already runs on) the CPU platform."""
    forced = os.environ.get("VERL_PLATFORM", "").strip().lower()
    if forced:
        return forced == PLATFORM_NAME
    return torch_is_cpu_only()


FSDP_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
FSDP_ENGINES = {"language_model": "FSDPEngineWithLMHead", "value_model": "FSDPEngineWithValueHead"}


def _register_fsdp_engines_for_cpu(module) -> None:
    """verl registers its FSDP engines for devices cuda/npu only; add the same classes for cpu."""
    from verl.workers.engine.base import EngineRegistry

    for model_type, cls_name in FSDP_ENGINES.items():
        cls = getattr(module, cls_name)
        existing = EngineRegistry._engines.get(model_type, {})
        for backend in ("fsdp", "fsdp2"):
            if PLATFORM_NAME in existing.get(backend, {}):
                continue  # someone (e.g. a verl-quads engine subclass) registered one already
            EngineRegistry.register(model_type=model_type, backend=backend, device=PLATFORM_NAME)(cls)


def register_cpu_engines() -> None:
    """Register verl's FSDP engines for device ``cpu`` once verl imports them (no eager import)."""
    from verl_quads.patches._post_import import when_imported

    when_imported(FSDP_ENGINE_MODULE, _register_fsdp_engines_for_cpu)
