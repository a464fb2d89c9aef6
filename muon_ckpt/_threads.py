"""The threads a save or a load starts: ``run_all`` (tasks on a few plain threads), ``beside``
(one helper thread for the length of a block) and ``join``. The main thread starts and joins
them with Ctrl-C deferred (``_interrupts``): a thread never outlives the call that started
it, whatever the interrupt broke.

Not an executor: a save may be finished by the interpreter's exit hook (``_exit``), when
``concurrent.futures`` refuses new work ("cannot schedule new futures after interpreter
shutdown"); plain threads start whenever the interpreter is still whole.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from muon_ckpt._interrupts import Stop, interrupts_deferred

__all__ = ["beside", "join", "pool", "run_all", "start", "submit_all"]

T = TypeVar("T")


def start(thread: threading.Thread) -> None:
    """``thread.start()`` with Ctrl-C deferred: an interrupted start leaves a thread running
    that ``join`` may refuse ("cannot join thread before it is started")."""
    with interrupts_deferred():
        thread.start()


def join(thread: threading.Thread) -> None:
    """``thread.join()``; Ctrl-C meanwhile is raised once the thread has ended."""
    with interrupts_deferred():
        thread.join()


@contextlib.contextmanager
def beside(fn: Callable[..., Any], *args: Any, name: str = "muon_ckpt-helper") -> Iterator[None]:
    """``fn(*args)`` on a helper thread while the block runs; the block ends once the thread
    has ended (it reads memory the caller may free next), even when the block raises.
    Ctrl-C inside is raised then."""
    th = threading.Thread(target=fn, args=args, name=name, daemon=True)
    with interrupts_deferred():
        th.start()
        try:
            yield
        finally:
            th.join()


@contextlib.contextmanager
def pool(threads: int, name: str) -> Iterator[ThreadPoolExecutor]:
    """A thread pool whose threads have all ended when the block ends, its queued work not
    started cancelled on the way out of a failure (Ctrl-C meanwhile is raised then). Submit
    to it with ``submit_all``: a submit may start a thread."""
    ex = ThreadPoolExecutor(threads, thread_name_prefix=name)
    try:
        yield ex
    finally:
        with interrupts_deferred():
            ex.shutdown(wait=True, cancel_futures=True)


def submit_all(ex: ThreadPoolExecutor, fn: Callable[[T], Any], tasks: Iterable[T]) -> list[Future]:
    """``ex.submit(fn, task)`` for every task, with Ctrl-C deferred until all are queued: an
    interrupted submit may leave a thread the pool does not know of (never joined), and
    the caller's clean-up needs every future."""
    with interrupts_deferred():
        return [ex.submit(fn, t) for t in tasks]


def run_all(threads: int, fn: Callable[[T], None], tasks: Iterable[T], *, name: str = "") -> None:
    """``fn(task)`` for every task, on up to ``threads`` threads, in order of ``tasks``. The
    first failure is raised once every started task has ended; tasks not started by then are
    skipped. An interrupt of the caller (Ctrl-C) also stops new tasks and waits for the
    started ones (they may be writing into memory the caller frees or restores next), then
    propagates."""
    todo = list(tasks)
    if threads <= 1 or len(todo) <= 1:
        for t in todo:
            fn(t)
        return
    lock = threading.Lock()
    taken = 0
    errors: list[BaseException] = []
    stopped = Stop()  # set by Ctrl-C

    def worker() -> None:
        nonlocal taken
        while True:
            with lock:
                if errors or stopped.is_set or taken == len(todo):
                    return
                task, taken = todo[taken], taken + 1
            try:
                fn(task)
            except BaseException as e:
                with lock:
                    errors.append(e)
                return

    workers = [
        threading.Thread(target=worker, name=f"muon_ckpt{name}-{i}", daemon=True)
        for i in range(min(threads, len(todo)))
    ]
    started = []
    with interrupts_deferred(stopped.set):
        try:
            for w in workers:
                w.start()
                started.append(w)
        finally:
            if len(started) < len(workers):  # (no thread to start): the started ones stop
                stopped.set()
            for w in started:
                w.join()
    if errors:
        raise errors[0]
