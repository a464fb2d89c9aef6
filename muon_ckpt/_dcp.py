"""DCP, called one way: ``save``/``load`` of a flat state dict, and the one place that turns
DCP's failures back into muon-ckpt's errors (an interrupt leaves as itself).

In a single process DCP warns on every call ("torch.distributed is disabled, unavailable or
uninitialized, assuming the intent is to save in a single process"), which is the normal
case here. ``save``/``load`` filter that one message, the first time they run without a
process group: a filter of our own (catch_warnings() is not thread-safe, and background
saves run in a thread), added at the call, not at import.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import muon_ckpt._collective as coll
from muon_ckpt._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStorageError,
    handled,
    interrupt_in,
)
from muon_ckpt.store import is_storage_failure

__all__ = ["UntrustedItem", "dcp_failure", "failures", "load", "save"]

# What a failed dcp.save/dcp.load raises: DCP's CheckpointException derives from BaseException.
DCP_ERRORS = (Exception, CheckpointException)
_quiet = threading.Lock()
_quieted = False


class UntrustedItem(Exception):
    """A stored item is not the tensor its chunk declares, or could expand beyond its bytes
    (``load._declared``). Raised while reading, where a damaged item fails the same way: the
    readers report the file's checksum mismatch where there is one
    (``load._corruption.prefer_corruption``), else this as a CheckpointCorruptError
    (``prefer_corruption``, ``dcp_failure``)."""


def _single_process(alone: bool | None = None) -> bool:
    """Whether this call runs without a process group (``alone``; None: when there is none);
    then DCP's warning about it is filtered (once, for good: see the module docstring)."""
    global _quieted
    if alone is None:
        alone = not (dist.is_available() and dist.is_initialized())
    if not alone:
        return False
    with _quiet:
        if not _quieted:
            warnings.filterwarnings(
                "ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized"
            )
            _quieted = True
    return True


def save(
    sd: dict[str, Any],
    writer: Any,
    planner: Any,
    group: Any,
    what: str,
    *,
    alone: bool | None = None,
) -> None:
    """``dcp.save`` of ``sd`` on ``group``'s ranks, or in this process alone (``alone``; None:
    when there is no process group); a failure is a CheckpointError naming ``what``
    (``failures``)."""
    alone = _single_process(alone)
    with failures(what, group, collective=not alone), coll.lane(None if alone else group):
        coll.arrive("the start of DCP's save")
        try:
            dcp.save(sd, storage_writer=writer, planner=planner, process_group=group, no_dist=alone)
        finally:  # (a writer whose rank 0 marks DCP's finish: marked also where it never ran)
            if (ended := getattr(writer, "ended", None)) is not None:
                ended()


def load(
    sd: dict[str, Any],
    reader: Any,
    planner: Any,
    group: Any,
    what: str,
    *,
    alone: bool | None = None,
) -> None:
    """``dcp.load`` into ``sd`` on ``group``'s ranks, or in this process alone (``alone``;
    None: when there is no process group); a failure is a CheckpointError naming ``what``
    (``failures``)."""
    alone = _single_process(alone)
    with failures(what, group, collective=not alone), coll.lane(None if alone else group):
        coll.arrive("the start of DCP's load")
        dcp.load(sd, storage_reader=reader, planner=planner, process_group=group, no_dist=alone)


@contextlib.contextmanager
def failures(what: str, group: Any = None, *, collective: bool = False) -> Iterator[None]:
    """DCP's failures as muon-ckpt's errors (``dcp_failure``), an interrupt as itself (DCP
    turns everything raised inside it into a CheckpointException: ``interrupt_in``); one of
    its own collectives on ``group`` (``collective``: it makes some) that failed (raised as
    it is, not wrapped) as the error every rank raises for it (``coll.comm_failure``)."""
    since = handled()
    try:
        yield
    except DCP_ERRORS as e:
        stop = interrupt_in(e, since)
        if stop is not None:  # Ctrl-C (or an exit) in the middle: itself, not a failure
            raise stop from None
        if collective and isinstance(e, RuntimeError):
            raise coll.comm_failure(e, what, group) from e
        raise dcp_failure(e, what) from e


def dcp_failure(e: BaseException, what: str) -> CheckpointError:
    """The CheckpointError to raise for a failed ``dcp.save``/``dcp.load``: DCP wraps the
    failures of every rank (``CheckpointException.failures``); a CheckpointError raised by one
    of ours inside DCP comes back as itself (same class and message), an untrusted stored item
    (``_declared``) as a CheckpointCorruptError, anything else as a
    CheckpointError (a CheckpointStorageError when the storage failed) naming ``what`` and
    the first cause."""
    if isinstance(e, CheckpointError):
        return e
    failures: dict[int, Any] = getattr(e, "failures", None) or {}
    causes = [v[0] if isinstance(v, tuple) else v for _, v in sorted(failures.items())]
    for c in causes:
        if isinstance(c, CheckpointError):
            return type(c)(str(c))
        if isinstance(c, UntrustedItem):  # (its file's checksum found nothing, or none ran)
            return CheckpointCorruptError(str(c))
    first = causes[0] if causes else e
    ranks = f" on rank(s) {sorted(failures)}" if failures else ""
    cls = CheckpointStorageError if is_storage_failure(first) else CheckpointError
    return cls(f"{what} failed{ranks}: {type(first).__name__}: {first}")
