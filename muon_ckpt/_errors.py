"""The error classes of muon_ckpt. Everything raised on purpose derives from CheckpointError;
an interrupt is never one of them (``interrupt_in``)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from muon_ckpt._interrupts import interrupts_kept

__all__ = [
    "CheckpointCollectiveError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointLeaseError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointStorageError",
    "CheckpointVersionError",
    "handled",
    "interrupt_in",
    "passes_interrupts",
    "raise_interrupt",
]

P = ParamSpec("P")
R = TypeVar("R")


class CheckpointError(Exception):
    """Base class of every error muon_ckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint (or not the requested step) at the URL."""


class CheckpointCorruptError(CheckpointError):
    """A file of a committed checkpoint is missing, truncated, or fails its checksum."""


class CheckpointMismatchError(CheckpointError):
    """The model/optimizer does not match the checkpoint (missing key, shape or dtype)."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """The step is already committed and the caller did not ask to overwrite it."""


class CheckpointStorageError(CheckpointError):
    """The storage failed (unreachable, refused, timed out, credentials...); the message
    names the URL and the cause."""


class CheckpointLeaseError(CheckpointError):
    """Another job holds the run's write lease: one writer per run."""


class CheckpointCollectiveError(CheckpointError):
    """A rank did not join a save/load in time, joined another call, or a collective failed."""


class CheckpointVersionError(CheckpointError):
    """A step was written by a newer muon-ckpt (a newer format): upgrade muon-ckpt. Such a
    step is never loaded, deleted or written beside by this version."""


def handled() -> BaseException | None:
    """The exception being handled where this is called (``sys.exc_info()``): an operation
    captures it as it starts, so that ``interrupt_in`` leaves it out (``since``)."""
    return sys.exc_info()[1]


def interrupt_in(e: BaseException, since: BaseException | None = None) -> BaseException | None:
    """The interrupt (a BaseException that is not an Exception: KeyboardInterrupt, SystemExit)
    anywhere in ``e``: ``e`` itself, the failures DCP's CheckpointException wraps (its
    ``failures``), and the ``__cause__``/``__context__`` chain of each, nearest first; None
    when there is none. A Ctrl-C must leave a save or load as itself, whatever it broke on
    the way: torch.save's zip writer, interrupted, fails on its way out with a RuntimeError
    whose ``__context__`` is the KeyboardInterrupt.

    ``since``: what was being handled when the operation began (``handled()``), and its
    chain, are not looked at: a save called in an ``except KeyboardInterrupt:`` block that
    fails for a reason of its own is that failure (Python makes the caught interrupt its
    ``__context__``)."""
    seen: set[int] = set() if since is None else {id(since)}
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):  # DCP's CheckpointException (a BaseException): look in
            todo += [v[0] if isinstance(v, tuple) else v for _, v in sorted(failures.items())]
        elif not isinstance(x, Exception):
            return x
        todo += [x.__cause__, x.__context__]
    return None


def raise_interrupt(e: BaseException | None, since: BaseException | None) -> None:
    """Raise the interrupt in ``e``'s chain (``interrupt_in``), if there is one: where a
    failure would be answered otherwise (a fallback to the next source), an interrupt is not."""
    stop = interrupt_in(e, since) if e is not None else None
    if stop is not None:
        raise stop from None


def passes_interrupts(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` (a public call: save, load, wait, close) raises an interrupt found anywhere in
    the chain of what it raises (``interrupt_in``) as itself, after the clean-up its failure
    got: ``except CheckpointError`` around it never swallows a Ctrl-C. One that Python dropped
    on the way (``_interrupts.interrupts_kept``) is raised when ``fn`` has ended."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        since = handled()
        with interrupts_kept() as dropped:
            try:
                out = fn(*args, **kwargs)
            except BaseException as e:
                stop = interrupt_in(e, since)
                if stop is None and dropped:  # (Ctrl-C came, and is found nowhere in e)
                    raise dropped[0] from e
                if stop is None or stop is e:
                    raise
                raise stop from None
            if dropped:  # raised where Python drops it (a weakref callback): raised here
                raise dropped[0]
            return out

    return call
