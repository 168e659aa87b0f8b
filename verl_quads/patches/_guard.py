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


def patches_in_chain(fn) -> list[str]:
    """Names of the verl-quads patches wrapped around ``fn``, outermost first.

    Follows the ``__verl_quads_original__`` links that :func:`install_method_patch` leaves; a
    function without marks gives ``[]``.
    """
    names = []
    while fn is not None and hasattr(fn, "__verl_quads_original__"):
        names.append(fn.__dict__.get("__verl_quads_patch__"))
        fn = fn.__verl_quads_original__
    return names


def install_method_patch(owner, name: str, patch: str, make_patched) -> bool:
    """Replace ``owner.<name>`` (a class or a module attribute) by ``make_patched(current)``.

    The result is marked with ``__verl_quads_patch__ = patch`` and ``__verl_quads_original__ =
    current``, so patches stack and each can be found (:func:`patches_in_chain`). Idempotent: if
    ``patch`` is anywhere in the current chain (another patch may have wrapped it since), nothing
    changes. Returns True if installed now.
    """
    import functools

    current = getattr(owner, name)
    if patch in patches_in_chain(current):
        return False
    patched = functools.wraps(current)(make_patched(current))
    patched.__verl_quads_patch__ = patch
    patched.__verl_quads_original__ = current
    setattr(owner, name, patched)
    return True


def install_config_augmenter(patch: str, augment) -> bool:
    """Wrap Hydra's ``ConfigRepository.load_config`` so that ``augment(config_path, node)`` may
    replace a loaded config node (it returns the new node, or None to leave it). One wrapper per
    ``patch`` (idempotent); the Hydra-version guard is the caller's. Returns True if installed now.
    """
    from hydra._internal.config_repository import ConfigRepository

    def make_patched(inner):
        def load_config(self, config_path):
            ret = inner(self, config_path)
            if ret is not None:
                new = augment(config_path, ret.config)
                if new is not None:
                    ret.config = new
            return ret

        return load_config

    return install_method_patch(ConfigRepository, "load_config", patch, make_patched)
