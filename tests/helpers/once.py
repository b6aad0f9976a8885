"""Build-once cache for what several test modules share within one pytest process (one xdist worker).

A fixture defined in one test module and re-exported by another gets its own FixtureDef there, so even a session
scope would build it again per module; the tiny triton-engine models took 5-23 s each to build (save, adapters,
conversion) on CI's 2 loaded cores, three modules over. This module is imported under one name
(``tests.helpers.once``), so its dict is the same object for every test module in the process."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_BUILT: dict[object, object] = {}


def once(key: object, build: Callable[[], T]) -> T:
    """``build()`` the first time ``key`` is asked for in this process; the same object every later time. Only for
    deterministic builds whose result the tests read and never change."""
    if key not in _BUILT:
        _BUILT[key] = build()
    return _BUILT[key]  # type: ignore[return-value]  # the value is what this key's own build returned
