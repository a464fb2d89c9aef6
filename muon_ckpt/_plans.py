"""A process's own objects under random keys: what lets a DCP plan cross DCP's gather to rank 0
and its scatter back as a small token instead of its items.

DCP sends every rank's local plan to rank 0 (``gather_object``: pickled, unpickled there) and
each plan of the global plan back (``scatter_object_list``). Where rank 0 changes nothing in a
plan's items, the rank that made the plan needs only its own object back: it ``remember``\\ s
the plan, the plan pickles as its key, and unpickling ``recall``\\ s the object in the process
that made it (a stand-in, built by the caller, anywhere else). At 2,048 ranks of an 8B model
that is ~1.4 M items not pickled twice and unpickled twice on rank 0.

* ``remember(obj) -> str``: a fresh random key (128 bits: no other process or run draws it);
  this process keeps ``obj`` under it, weakly where ``obj`` can be weakly referenced (nothing
  outlives its owner: the caller keeps it alive while it may be recalled), else until
  ``forget``;
* ``recall(key)``: this process's object for ``key``; None in any other process (a forked
  child starts with none), after ``forget``, or once a weakly kept object is gone;
* ``forget(key)``: drop it (a key not kept: nothing to do).

Thread-safe; ``held()`` counts the keys kept (for tests: none after a load, failed or not).
"""

from __future__ import annotations

import os
import secrets
import threading
import weakref
from typing import Any

__all__ = ["forget", "held", "recall", "remember"]

_lock = threading.Lock()
_weak: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_strong: dict[str, Any] = {}


def remember(obj: Any) -> str:
    """A fresh random key under which this process keeps ``obj`` (see the module)."""
    key = secrets.token_hex(16)
    with _lock:
        try:
            _weak[key] = obj
        except TypeError:  # (a list, a dict, a tuple: no weak reference to them)
            _strong[key] = obj
    return key


def recall(key: str) -> Any:
    """This process's object for ``key``, or None (see the module)."""
    with _lock:
        obj = _weak.get(key)
        return _strong.get(key) if obj is None else obj


def forget(key: str) -> None:
    """Drop ``key`` (nothing to do if it is not kept)."""
    with _lock:
        _weak.pop(key, None)
        _strong.pop(key, None)


def held() -> int:
    """How many keys this process keeps (weakly kept ones whose object is gone excluded)."""
    with _lock:
        return len(_weak) + len(_strong)


def _forked() -> None:
    """A forked child is another process: it recalls none of its parent's objects."""
    global _lock, _weak, _strong
    _lock = threading.Lock()  # (the parent's may have been held by another thread at the fork)
    _weak, _strong = weakref.WeakValueDictionary(), {}


os.register_at_fork(after_in_child=_forked)
