"""``calls(fn)``: the Python and C functions ``fn()`` calls, counted (``sys.setprofile``): how
the tests pin work that must grow linearly, or not at all, with the ranks, never by timing."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def calls(fn: Callable[[], Any]) -> int:
    """The Python and C functions ``fn()`` calls, all of them (this thread)."""
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count
