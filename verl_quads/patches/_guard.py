"""Version guards shared by the patches in this package.

Every patch names the exact upstream releases it was written against and refuses any other,
with an error that says which patch, which package, which version was found and what to do.
A patch silently applied to a release it was never read against is how "works on my machine"
bugs are made; failing at start-up is cheaper.
"""

from __future__ import annotations

import importlib.metadata as md


class PatchVersionError(RuntimeError):
    """An upstream package has a version a verl-quads patch was not written for."""


def installed_version(*dist_names: str) -> tuple[str, str] | None:
    """``(distribution, version)`` of the first installed distribution among ``dist_names``."""
    for name in dist_names:
        try:
            return name, md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def base_version(version: str) -> str:
    """``"0.32.0+cpu"`` -> ``"0.32.0"`` (local build tags do not change the code we patch)."""
    return version.split("+", 1)[0]


def require_version(patch: str, dist_names: tuple[str, ...], supported: tuple[str, ...], found: str | None = None) -> str:
    """Raise :class:`PatchVersionError` unless the installed version is one of ``supported``.

    ``found`` overrides the installed version (used by tests to exercise the guard).
    Returns the version found.
    """
    if found is None:
        got = installed_version(*dist_names)
        if got is None:
            raise PatchVersionError(
                f"verl-quads patch {patch!r} needs one of the distributions {dist_names}, none is installed"
            )
        found = got[1]
    if base_version(found) not in supported:
        raise PatchVersionError(
            f"verl-quads patch {patch!r} was written for {dist_names[0]} {', '.join(supported)}; "
            f"found {found}. Re-read the patched upstream code for this version and extend the patch "
            f"(see patches/README.md), or install a supported version."
        )
    return found


def install_method_patch(cls: type, name: str, patch: str, make_patched) -> None:
    """Replace ``cls.<name>`` by ``make_patched(current)`` once, marking the result with
    ``__verl_quads_patch__ = patch`` and ``__verl_quads_original__ = current`` (idempotent: a method
    already carrying this patch's mark is left alone)."""
    import functools

    current = getattr(cls, name)
    if getattr(current, "__verl_quads_patch__", None) == patch:
        return
    patched = functools.wraps(current)(make_patched(current))
    patched.__verl_quads_patch__ = patch
    patched.__verl_quads_original__ = current
    setattr(cls, name, patched)
