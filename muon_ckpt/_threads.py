"""``run_all``: tasks on a few plain threads.

Not an executor: a save may be finished by the interpreter's exit hook (``_exit``), when
``concurrent.futures`` refuses new work ("cannot schedule new futures after interpreter
shutdown"); plain threads start whenever the interpreter is still whole.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["run_all"]

T = TypeVar("T")


def run_all(threads: int, fn: Callable[[T], None], tasks: Iterable[T], *, name: str = "") -> None:
    """``fn(task)`` for every task, on up to ``threads`` threads, in order of ``tasks``. The
    first failure is raised once every started task has ended; tasks not started by then are
    skipped. An interrupt of the caller (Ctrl-C) also waits for the started tasks (they may be
    writing into memory the caller frees or restores next), then propagates."""
    todo = list(tasks)
    if threads <= 1 or len(todo) <= 1:
        for t in todo:
            fn(t)
        return
    lock = threading.Lock()
    taken = 0
    errors: list[BaseException] = []

    def worker() -> None:
        nonlocal taken
        while True:
            with lock:
                if errors or taken == len(todo):
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
    for w in workers:
        w.start()
    try:
        for w in workers:
            w.join()
    except BaseException:
        with lock:
            errors.append(RuntimeError("interrupted"))  # no task starts from here on
        for w in workers:
            w.join()
        raise
    if errors:
        raise errors[0]
