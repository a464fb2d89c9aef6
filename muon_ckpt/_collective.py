"""The few collectives the manager needs; each degrades to a no-op without a process group.

Decisions (which step to load, whether a save committed) are made on rank 0 and broadcast,
together with any exception, so that every rank returns the same value or raises the same error.
``group``: the process group to use (None: the default group). Background saves pass their own
gloo group, so that they never share a communicator with the training loop's collectives.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import pickle
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from muon_ckpt._errors import CheckpointCollectiveError, CheckpointError

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
        with communicating("a broadcast from rank 0"):
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
    with communicating("a gather to rank 0"):
        dist.gather_object(obj, out, dst=0, group=group)
    return out


def all_gather(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, on every rank."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * world_size()
    with communicating("an all-gather"):
        dist.all_gather_object(out, obj, group=group)
    return out


def new_group(timeout: float) -> Any:
    """A gloo group of every rank whose collectives give up after ``timeout`` seconds
    (collective: every rank calls it at the same point), or None without a process group.

    The manager runs all its collectives on it (DCP's included), foreground and background:
    they never share a communicator with the training loop, and a rank that stops answering
    costs the others ``timeout`` seconds, not the default group's (often 10-30 min) timeout.
    """
    if not is_dist():
        return None
    with communicating("making the manager's process group"):
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))


def _store() -> Any:
    # torch has no public accessor for the default group's store; this one has existed since
    # torch 1.x and is what torch's own store-based barriers use.
    return dist.distributed_c10d._get_default_store()


def handshake(tag: str, call: str, timeout: float) -> None:
    """Every rank announces ``call`` (e.g. ``"save(step=5)"``) under ``tag`` and waits until
    every rank has announced the same call; raises CheckpointCollectiveError naming the ranks that
    did not within ``timeout`` seconds, or that announced a different call.

    Runs on the default group's key-value store (no communicator), so a rank that never calls
    costs the others ``timeout`` seconds and an error that names it, instead of a hang inside
    the first collective. ``tag`` must be unique per call and the same on every rank. Whether
    the handshake succeeded is decided once, atomically (``compare_set`` of a verdict key: the
    first rank to see every key, or to time out, sets it), so a rank that arrives just after
    another gave up follows that verdict instead of going on alone.
    """
    if not is_dist():
        return
    # (its store's host, rank 0 under ``env://``, gone: torch's DistNetworkError "Broken pipe")
    with communicating(f"{call}: the handshake on the process group's store"):
        _handshake(_store(), tag, call, timeout)


def _handshake(store: Any, tag: str, call: str, timeout: float) -> None:
    me, n = rank(), world_size()
    store.set(f"{tag}/{me}", call)
    keys = [f"{tag}/{r}" for r in range(n)]
    deadline = time.monotonic() + timeout
    pause = 0.001
    while not (complete := store.check(keys)) and time.monotonic() < deadline:
        time.sleep(pause)  # polled: store.wait() logs a C++ warning on every timeout
        pause = min(pause * 2, 0.05)
    if complete:
        mine = "ok"
    else:
        missing = [r for r in range(n) if not store.check([keys[r]])]
        mine = f"rank(s) {missing} of {n} did not call it within {timeout:g} s"
    verdict = store.compare_set(f"{tag}/verdict", "", mine).decode()
    if verdict != "ok":
        raise CheckpointCollectiveError(
            f"{call} on rank {me}: {verdict} (collective_timeout); save() and load() are "
            "collectives: call them on every rank, with the same step"
        )
    calls = dict(enumerate(v.decode() for v in store.multi_get(keys)))
    if len(set(calls.values())) > 1:
        raise CheckpointCollectiveError(
            f"{call} on rank {me}: the ranks called different things: "
            + ", ".join(f"rank {r}: {c}" for r, c in calls.items())
            + "; save() and load() are collectives: call them on every rank, with the same step"
        )


def forget(tag: str, call: str) -> None:
    """Remove this rank's key of an earlier ``handshake`` (once every rank is past it), and
    rank 0 the verdict, at ``call``."""
    if not is_dist():
        return
    with communicating(f"{call}: the process group's store"):
        store = _store()
        store.delete_key(f"{tag}/{rank()}")
        if rank() == 0:
            store.delete_key(f"{tag}/verdict")


def comm_failure(e: RuntimeError, what: str) -> CheckpointCollectiveError:
    """A collective that raised (gloo timeout, a peer gone) as an error naming ``what`` and this
    rank."""
    return CheckpointCollectiveError(
        f"{what} on rank {rank()}: a collective failed (a rank died, or did not answer within "
        f"collective_timeout): {type(e).__name__}: {e}"
    )


@contextlib.contextmanager
def communicating(what: str) -> Iterator[None]:
    try:
        yield
    except RuntimeError as e:  # torch's communication errors (DistError derives from it)
        raise comm_failure(e, what) from e


class Calls:
    """The save/load calls of one manager: each begins with a ``handshake`` (every rank is in
    the same call, or every rank that is raises), and the first makes the manager's gloo
    group (``group``) and counts the hosts the ranks run on (``hosts``). Tags are per url and
    per manager of that url in this process: the same on every rank when every rank makes the
    same managers, whatever else a rank makes."""

    _made: dict[str, int] = {}  # managers of each url made in this process

    def __init__(self, url: str, timeout: float, *, background_groups: bool = False) -> None:
        url_id = hashlib.blake2b(url.encode(), digest_size=8).hexdigest()
        n = Calls._made[url_id] = Calls._made.get(url_id, 0) + 1
        self._tag = f"muon_ckpt/{url_id}/{n}"
        self._timeout = timeout
        self._count = 0  # calls so far: the handshake's sequence number
        self.group: Any = None  # gloo group of every save/load collective
        # With a memory tier, a save's write and a memory save's job run in the background
        # at the same time as the calls: each on a gloo group of its own.
        self._background_groups = background_groups
        self.write_group: Any = None  # a save's write and commit (else ``group``)
        self.memory_group: Any = None  # a memory save's replication and agreement
        self.hosts = 1

    def join(self, call: str) -> None:
        """Every rank is in the same ``call`` (bounded by the timeout)."""
        if not is_dist():
            return
        self._count += 1
        if self._count > 2:
            forget(f"{self._tag}/{self._count - 2}", call)  # every rank is past that one
        handshake(f"{self._tag}/{self._count}", call, self._timeout)
        self.ensure_group()

    def ensure_group(self) -> None:
        """Make the gloo group (a collective: every rank reaches it in the same call)."""
        if is_dist() and self.group is None:
            self.group = new_group(self._timeout)
            self.hosts = len(set(all_gather(socket.gethostname(), self.group)))
            self.write_group = self.group
            if self._background_groups:
                self.write_group = new_group(self._timeout)
                self.memory_group = new_group(self._timeout)

    def close(self) -> None:
        """Remove the last handshake's keys (housekeeping: the store's host may be gone)."""
        if self._count > 1:  # every rank is past that one (not surely past the last)
            with contextlib.suppress(CheckpointCollectiveError):
                forget(f"{self._tag}/{self._count - 1}", "close()")
