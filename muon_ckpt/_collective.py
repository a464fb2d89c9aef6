"""The few collectives the manager needs; each degrades to a no-op without a process group.

Decisions (which step to load, whether a save committed) are made on rank 0 and broadcast,
together with any exception, so that every rank returns the same value or raises the same error.
``group``: the process group to use (None: the default group). Background saves pass their own
gloo group, so that they never share a communicator with the training loop's collectives.
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


def on_rank0(fn: Callable[[], T], group: Any = None) -> T:
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
        dist.broadcast_object_list(box, src=0, group=group)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def gather_to_rank0(obj: Any, group: Any = None) -> list[Any] | None:
    """Every rank's ``obj`` as a list on rank 0; None elsewhere."""
    if not is_dist():
        return [obj]
    out: list[Any] | None = [None] * world_size() if rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, on every rank (default group)."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def new_group() -> Any:
    """A gloo group of every rank for background collectives (collective: every rank calls it
    at the same point), or None without a process group."""
    return dist.new_group(backend="gloo") if is_dist() else None
