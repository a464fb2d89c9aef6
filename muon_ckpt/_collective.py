"""The few collectives the manager needs; each degrades to a no-op without a process group.

Decisions (which step to load, whether a save committed) are made on rank 0 and broadcast,
together with any exception, so that every rank returns the same value or raises the same error.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from muon_ckpt._errors import CheckpointError

T = TypeVar("T")


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def _portable(exc: BaseException) -> BaseException:
    """The exception itself if it survives pickling, else a CheckpointError carrying its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return CheckpointError(f"{type(exc).__name__}: {exc}")


def on_rank0(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only; every rank returns its result or raises its exception."""
    box: list[Any] = [None]
    if rank() == 0:
        try:
            box[0] = (True, fn())
        except Exception as e:
            if not is_dist():
                raise
            box[0] = (False, _portable(e))
    if is_dist():
        dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` as a list on rank 0; None elsewhere."""
    if not is_dist():
        return [obj]
    out: list[Any] | None = [None] * world_size() if rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_ok(ok: bool, what: str) -> None:
    """Raise on every rank if any rank reports failure (used where ranks may diverge)."""
    if not is_dist():
        return
    flags: list[Any] = [None] * world_size()
    dist.all_gather_object(flags, ok)
    bad = [r for r, f in enumerate(flags) if not f]
    if bad:
        raise CheckpointError(f"{what} failed on rank(s) {bad}; see their logs for the cause")
