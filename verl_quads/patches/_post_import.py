"""Run a callback right after a module is imported (or now, if it already is).

Used to register things with heavy upstream modules (e.g. verl's training engines) without
importing them eagerly from a plugin entry point, which runs on every ``import verl`` in every
Ray worker. Implemented with a ``sys.meta_path`` finder that wraps the real loader of exactly
the named module; nothing else is affected.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable

_callbacks: dict[str, list[Callable]] = {}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name):
        self._inner, self._name = inner, name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        for cb in _callbacks.pop(self._name, []):
            cb(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


_finder = _Finder()


def when_imported(module_name: str, callback: Callable) -> None:
    """Call ``callback(module)`` once ``module_name`` is imported (immediately if it already is)."""
    mod = sys.modules.get(module_name)
    if mod is not None and getattr(getattr(mod, "__spec__", None), "_initializing", False) is False:
        callback(mod)
        return
    _callbacks.setdefault(module_name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
