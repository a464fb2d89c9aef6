"""A pending save is committed before the interpreter exits, whatever ends the script.

At exit, Python runs the threading module's exit hooks, then joins the threads that are not
daemons, then runs ``atexit``. One of those hooks is ``concurrent.futures``': after it, no
executor takes work (asyncio's ``getaddrinfo`` for S3, for one), so a background save that
still has requests to make would fail ("cannot schedule new futures after interpreter
shutdown"). Managers with a pending save are closed by a hook registered after
``concurrent.futures``' (the hooks run last-registered first): the save finishes while the
interpreter is whole, on every rank, and its failure is logged at ERROR naming the step.
Until then this module holds the manager: a script whose last reference to it is gone (its
``main()`` returned) still has its save committed.
The exit code cannot be changed from there without skipping the other exit handlers
(``os._exit``), so it stays what the script made it.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any, Protocol

__all__ = ["finish_at_exit", "finished"]

_log = logging.getLogger("muon_ckpt")


class _Closing(Protocol):
    def _close_at_exit(self) -> None: ...


_managers: dict[int, Any] = {}  # id -> a manager with a save pending
_lock = threading.Lock()
_registered = False


def finish_at_exit(manager: _Closing) -> None:
    """Close ``manager`` (``_close_at_exit``) when the interpreter exits, unless ``finished``
    was called for it first."""
    global _registered
    with _lock:
        _managers[id(manager)] = manager
        if _registered:
            return
        import concurrent.futures.thread  # noqa: F401  (its hook first, so ours runs before)

        register = getattr(threading, "_register_atexit", None)  # CPython >= 3.9
        if register is not None:
            register(_close_all)
        else:  # pragma: no cover - other interpreters: after the threads were joined
            atexit.register(_close_all)
        _registered = True


def finished(manager: Any) -> None:
    """``manager`` has nothing pending (or is closed): the exit need not close it."""
    with _lock:
        _managers.pop(id(manager), None)


def _close_all() -> None:
    with _lock:
        managers = list(_managers.values())
    for manager in managers:
        try:
            manager._close_at_exit()
        except BaseException as e:  # one manager's failure must not keep the others open
            _log.error("closing %r at exit failed: %s: %s", manager, type(e).__name__, e)
