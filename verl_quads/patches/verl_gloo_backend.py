"""Patch: a valid ``torch.distributed`` backend string for verl's Ray workers on CPU.

Upstream (verl 0.9.1): ``verl/utils/distributed.py::initialize_global_process_group_ray``
defaults its backend to ``f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"``, i.e. gloo for
CPU tensors plus the accelerator's collective library for device tensors. On a CPU platform
that is ``"cpu:gloo,cpu:gloo"``, which ``torch.distributed.init_process_group`` rejects (the
``cpu`` device is named twice). ``verl/workers/engine_workers.py`` calls it with no backend.

Change: when the caller passes no backend and verl's device is ``cpu``, pass ``"cpu:gloo"``;
every other call goes to the original function unchanged. The module attribute is replaced
before ``verl.workers.engine_workers`` imports the name (the patch is applied on ``import verl``
through our ``verl.plugins`` entry point).
"""

from __future__ import annotations

import sys

from verl_quads.patches._guard import install_method_patch, require_version

PATCH = "verl_gloo_backend"
SUPPORTED_VERL = ("0.9.1",)
TARGET_MODULE = "verl.utils.distributed"
TARGET_NAME = "initialize_global_process_group_ray"
CPU_BACKEND = "cpu:gloo"


def apply() -> None:
    """Wrap ``verl.utils.distributed.initialize_global_process_group_ray``. Idempotent."""
    require_version(PATCH, ("verl",), SUPPORTED_VERL)
    import verl.utils.distributed as dist

    original = getattr(dist, TARGET_NAME)

    def make_patched(original):
        def initialize_global_process_group_ray(timeout_second=None, backend=None):
            from verl.utils.device import get_device_name

            if backend is None and get_device_name() == "cpu":
                backend = CPU_BACKEND
            return original(timeout_second=timeout_second, backend=backend)

        return initialize_global_process_group_ray

    if not install_method_patch(dist, TARGET_NAME, PATCH, make_patched):
        return
    patched = getattr(dist, TARGET_NAME)
    # Modules that already did ``from verl.utils.distributed import ...`` hold the old name.
    for user in ("verl.workers.engine_workers",):
        mod = sys.modules.get(user)
        if mod is not None and getattr(mod, TARGET_NAME, None) is original:
            setattr(mod, TARGET_NAME, patched)
