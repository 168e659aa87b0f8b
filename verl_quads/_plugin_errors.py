"""Loud plugin loading.

verl imports ``verl.plugins`` entry points inside a try/except that logs failures at debug
level only, so a broken verl-quads install would silently run stock verl. Every entry point of
ours goes through :func:`loud`, which logs the failure at ERROR level with the traceback and
re-raises, so the user sees it whatever the host framework does with the exception.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, TypeVar

logger = logging.getLogger("verl_quads")
F = TypeVar("F", bound=Callable[..., object])


def loud(what: str) -> Callable[[F], F]:
    """Decorate an entry-point function: log any exception at ERROR level, then re-raise."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except BaseException:
                logger.error("verl-quads: %s failed to load; verl-quads is NOT active", what, exc_info=True)
                raise

        return wrapper  # type: ignore[return-value]

    return deco
