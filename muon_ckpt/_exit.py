"""A pending save is committed before the interpreter exits, whatever ends the script.

At exit, Python runs the threading module's exit hooks, then joins the threads that are not
daemons, then runs ``atexit``. One of those hooks is ``concurrent.futures``': after it, no
executor takes work (asyncio's ``getaddrinfo`` for S3, for one), so a background save that
still has requests to make would fail ("cannot schedule new futures after interpreter
shutdown"). Managers with a pending save are closed by a hook registered after
``concurrent.futures``' (the hooks run last-registered first): the save finishes while the
interpreter is whole, on every rank, and its failure is logged at ERROR naming the step.
The exit code cannot be changed from there without skipping the other exit handlers
(``os._exit``), so it stays what the script made it. The managers are held weakly: while it
has a save pending (not yet waited for), it is also held strongly: a script whose last
reference to it is gone (its ``main()`` returned) still has that save committed, or its
failure logged; a manager dropped with nothing pending can be freed.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any, Protocol

__all__ = ["finish_at_exit", "let_go"]

_log = logging.getLogger("muon_ckpt")


class _Closing(Protocol):
    def _close_at_exit(self) -> None: ...


_managers: weakref.WeakSet[Any] = weakref.WeakSet()
_held: dict[int, Any] = {}  # id -> a manager with a save pending
_lock = threading.Lock()
_registered = False


def finish_at_exit(manager: _Closing, pending: bool = False) -> None:
    """Close ``manager`` (``_close_at_exit``) when the interpreter exits, unless it is gone;
    ``pending``: it has a save pending, and is held until ``let_go``."""
    global _registered
    with _lock:
        _managers.add(manager)
        if pending:
            _held[id(manager)] = manager
        if _registered:
            return
        import concurrent.futures.thread  # noqa: F401  (its hook first, so ours runs before)

        register = getattr(threading, "_register_atexit", None)  # CPython >= 3.9
        if register is not None:
            register(_close_all)
        else:  # pragma: no cover - other interpreters: after the threads were joined
            atexit.register(_close_all)
        _registered = True


def let_go(manager: Any) -> None:
    """``manager`` has no save pending any more: held weakly again."""
    with _lock:
        _held.pop(id(manager), None)


def _close_all() -> None:
    for manager in list(_managers):
        try:
            manager._close_at_exit()
        except BaseException as e:  # one manager's failure must not keep the others open
            _log.error("closing %r at exit failed: %s: %s", manager, type(e).__name__, e)
