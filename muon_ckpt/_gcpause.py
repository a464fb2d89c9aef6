"""``paused_gc()``: Python's cyclic garbage collector paused while a large object graph is
built (the DCP metadata of a 2,048-rank save unpickled: millions of objects, none of them
garbage yet).

Each collection of the oldest generation walks every live object; building millions of them
triggers it again and again, which made unpickling the metadata of a 256-rank save of an 8B
model 5x slower (docs/benchmarks.md, planning). Reference counting still frees everything
meanwhile; only cycles wait for the next collection. Pauses from several threads nest: the
collector runs again when the last one ends, if it ran before the first.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["paused_gc"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
