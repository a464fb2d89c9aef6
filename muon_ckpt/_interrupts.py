"""Ctrl-C inside muon-ckpt's calls: every SIGINT leaves a public call as its
KeyboardInterrupt, once the call has cleaned up, never lost and never aborting the process.

Python runs a signal's handler in the main thread only, between two bytecodes, wherever
that is. Two places there break the promise:

* ``Thread.start()`` and ``join()``: the KeyboardInterrupt raised inside leaves the thread
  running. It goes on writing into memory its caller frees or reuses next, and when the
  interpreter exits while it is still inside torch's C++ code, the process aborts
  ("terminate called without an active exception"). So the main thread starts and joins
  threads under ``interrupts_deferred``: the interrupt is raised once the block has ended.
* a weakref callback or a ``__del__`` that the garbage collector runs meanwhile: the
  KeyboardInterrupt raised inside is printed ("Exception ignored in ...") and dropped, and
  the call runs on as if no Ctrl-C had come. Each public call runs under ``interrupts_kept``
  and raises it again when it ends (``_errors.passes_interrupts``).

Both replace the SIGINT handler for the length of their block and hand each signal to the
handler that was in force (Python's raises KeyboardInterrupt; a handler of the user's runs
as it would have). Other threads get no signals; a handler that is not a Python function
(SIGINT ignored, or its default action) raises nothing: then the block runs as it is.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Stop", "interrupts_deferred", "interrupts_kept"]

_Handler = Callable[[int, Any], Any]


class Stop:
    """A flag that Ctrl-C sets, from inside the signal handler (an ``on_interrupt`` of
    ``interrupts_deferred``), and the threads it stops read: no new file, task or part
    starts. A plain attribute: a lock taken in a handler deadlocks the code it interrupted
    when that held it."""

    def __init__(self) -> None:
        self.is_set = False

    def set(self) -> None:
        self.is_set = True


# The stop callbacks of the deferral in force (main thread only; None: none is).
_stops: list[Callable[[], None]] | None = None


@contextlib.contextmanager
def _handling(handler: Callable[[_Handler], _Handler]) -> Iterator[_Handler | None]:
    """SIGINT handled by ``handler(previous)`` inside the block (main thread, and a Python
    handler in force); yields the previous handler, or None where nothing was replaced. The
    previous one is put back unless the block replaced ours meanwhile."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield None
        return
    ours = handler(previous)
    signal.signal(signal.SIGINT, ours)
    try:
        yield previous
    finally:
        if signal.getsignal(signal.SIGINT) is ours:
            signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def interrupts_deferred(on_interrupt: Callable[[], None] | None = None) -> Iterator[None]:
    """In the main thread, a SIGINT that arrives inside the block is handed to the handler
    that was in force when the block has ended, not where it lands; ``on_interrupt`` is
    called as it arrives (the block stops starting work). Nested blocks share the
    outermost one's."""
    global _stops
    if _stops is not None and threading.current_thread() is threading.main_thread():
        stops = _stops  # nested: the outer block delivers it
        if on_interrupt is not None:
            stops.append(on_interrupt)
        try:
            yield
        finally:
            if on_interrupt is not None:
                stops.remove(on_interrupt)
        return
    got: list[tuple[int, Any]] = []
    stops: list[Callable[[], None]] = [] if on_interrupt is None else [on_interrupt]

    def defer(previous: _Handler) -> _Handler:
        def handle(signum: int, frame: Any) -> None:
            got.append((signum, frame))
            for stop in list(stops):
                stop()

        return handle

    previous: _Handler | None = None
    try:
        with _handling(defer) as previous:
            if previous is not None:
                _stops = stops
            try:
                yield
            finally:
                if previous is not None:
                    _stops = None
    finally:  # (also when the block failed: the interrupt is what leaves, the failure its context)
        if got and previous is not None:  # (one call for several: Ctrl-C again meanwhile)
            previous(*got[0])


@contextlib.contextmanager
def interrupts_kept() -> Iterator[list[BaseException]]:
    """Yields what the SIGINT handler in force raised inside the block (in the main thread):
    the caller raises it when the block ends unless it left the block (a weakref callback
    or ``__del__`` that ran the handler dropped it; ``_errors.passes_interrupts``)."""
    raised: list[BaseException] = []

    def keep(previous: _Handler) -> _Handler:
        def handle(signum: int, frame: Any) -> None:
            try:
                previous(signum, frame)
            except BaseException as e:
                raised.append(e)
                raise

        return handle

    with _handling(keep):
        yield raised
