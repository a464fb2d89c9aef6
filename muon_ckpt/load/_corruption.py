"""Small helpers of the read paths: parallel per-file tasks, and preferring the corruption
error over a parser's complaint."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from muon_ckpt._errors import CheckpointCorruptError
from muon_ckpt.load._declared import UntrustedItem

__all__ = ["prefer_corruption", "run_all"]

T = TypeVar("T")


def prefer_corruption(run: Callable[[], T], verdict: Callable[[], BaseException | None]) -> T:
    """``run()``; if it raises (a damaged item often fails to parse before its file's checksum
    is known), raise the corruption that ``verdict()`` finds instead, when there is one. An
    item found untrusted with no corruption of its file is a crafted step: corrupt too."""
    try:
        return run()
    except CheckpointCorruptError:
        raise
    except Exception as e:
        found = verdict()
        if isinstance(found, CheckpointCorruptError):
            raise found from e
        if isinstance(e, UntrustedItem):
            raise CheckpointCorruptError(str(e)) from e
        raise


def run_all(threads: int, fn: Callable[[T], None], tasks: list[T]) -> None:
    """``fn(task)`` for every task on ``threads`` threads; the first failure is raised once
    every started task has ended (tasks not started yet are cancelled)."""
    with ThreadPoolExecutor(threads, thread_name_prefix="muon_ckpt_read") as ex:
        futures = [ex.submit(fn, t) for t in tasks]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
