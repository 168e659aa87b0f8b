"""The shared patch installer (``verl_quads/patches/_guard.py``): stacking and idempotency."""

from __future__ import annotations

from verl_quads.patches._guard import install_method_patch, patches_in_chain


class _Target:
    def f(self, x):
        return x


def _adding(n):
    def make(inner):
        def f(self, x):
            return inner(self, x) + n

        return f

    return make


def test_patches_stack_and_each_installs_once():
    cls = type("T", (_Target,), {})
    assert patches_in_chain(cls.f) == []
    assert install_method_patch(cls, "f", "a", _adding(1)) is True
    assert install_method_patch(cls, "f", "b", _adding(10)) is True
    assert patches_in_chain(cls.f) == ["b", "a"]
    # "a" is below "b" now: re-installing it must not wrap a second time.
    assert install_method_patch(cls, "f", "a", _adding(1)) is False
    assert install_method_patch(cls, "f", "b", _adding(10)) is False
    assert cls().f(0) == 11
    assert cls.f.__verl_quads_original__.__verl_quads_original__ is _Target.f
    assert cls.f.__name__ == "f"  # functools.wraps keeps the upstream name for tracebacks
