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

Ctrl-C while the hook waits (again and again, as an impatient user does) stops every
manager's saves (``_stop_saves``: no new file starts, the pending step is not committed unless
it already was) and is raised, and logged, once they have all ended: the hook never returns
with a save's thread running. Python would join that thread next, and a Ctrl-C there would
leave it inside torch when the interpreter finishes, which aborts the process.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any, Protocol

from muon_ckpt._interrupts import interrupts_deferred

__all__ = ["finish_at_exit", "let_go"]

_log = logging.getLogger("muon_ckpt")


class _Closing(Protocol):
    def _close_at_exit(self) -> None: ...

    def _stop_saves(self) -> None: ...


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
    managers = list(_managers)  # (before the deferral: its Ctrl-C stops every one of them)

    def stop() -> None:  # (in the signal handler)
        for manager in managers:
            manager._stop_saves()

    try:
        with interrupts_deferred(stop):
            for manager in managers:
                try:
                    manager._close_at_exit()
                except BaseException as e:  # one manager's failure must not keep the others open
                    _log.error("closing %r at exit failed: %s: %s", manager, type(e).__name__, e)
    except KeyboardInterrupt:  # (raised once every save has ended)
        _log.error("interrupted at exit (Ctrl-C): the pending saves were stopped")
