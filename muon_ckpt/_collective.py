"""The few collectives the manager needs; each degrades to a no-op without a process group.

Decisions (which step to load, whether a save committed) are made on rank 0 and broadcast,
together with any exception, so that every rank returns the same value or raises the same error.
``group``: the process group to use (None: the default group). Background saves pass their own
gloo group, so that they never share a communicator with the training loop's collectives.

The groups a manager makes (``Calls``) are tracked: before each collective on one, a rank
records in the default group's store how many it has reached (``arrive``; DCP's calls mark
theirs through ``lane``). When a collective fails (a gloo timeout, a peer gone), the rank
reads every rank's count and names those behind it, which did not arrive, and the ranks
agree on one message (a verdict set once in the store): every rank raises the same
``CheckpointCollectiveError`` naming the ranks and ``collective_timeout``. A group whose
collective failed is broken (gloo closes its connections); the ranks agree at the next
call's ``handshake`` to make the manager's groups again, so the next save and load work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import pickle
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

from muon_ckpt._errors import CheckpointCollectiveError, CheckpointError

T = TypeVar("T")
_VERDICT_WAIT = 5.0  # seconds a rank that arrived last waits for the verdict of one that did not


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
        arrive("a broadcast from rank 0", group)
        with communicating("a broadcast from rank 0", group):
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
    arrive("a gather to rank 0", group)
    with communicating("a gather to rank 0", group):
        dist.gather_object(obj, out, dst=0, group=group)
    return out


def all_gather(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, on every rank."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * world_size()
    arrive("an all-gather", group)
    with communicating("an all-gather", group):
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


def handshake(tag: str, call: str, timeout: float, flag: bool = False) -> bool:
    """Every rank announces ``call`` (e.g. ``"save(step=5)"``) under ``tag`` and waits until
    every rank has announced the same call; raises CheckpointCollectiveError naming the ranks that
    did not within ``timeout`` seconds, or that announced a different call. Returns whether
    any rank raised its ``flag`` (every rank learns the same).

    Runs on the default group's key-value store (no communicator), so a rank that never calls
    costs the others ``timeout`` seconds and an error that names it, instead of a hang inside
    the first collective. ``tag`` must be unique per call and the same on every rank. Whether
    the handshake succeeded is decided once, atomically (``compare_set`` of a verdict key: the
    first rank to see every key, or to time out, sets it), so a rank that arrives just after
    another gave up follows that verdict instead of going on alone.
    """
    if not is_dist():
        return flag
    # (its store's host, rank 0 under ``env://``, gone: torch's DistNetworkError "Broken pipe")
    with communicating(f"{call}: the handshake on the process group's store"):
        return _handshake(_store(), tag, call, timeout, flag)


def _handshake(store: Any, tag: str, call: str, timeout: float, flag: bool) -> bool:
    me, n = rank(), world_size()
    store.set(f"{tag}/{me}", call + ("\n" if flag else ""))
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
    said = [v.decode() for v in store.multi_get(keys)]
    calls = {r: v.rstrip("\n") for r, v in enumerate(said)}
    if len(set(calls.values())) > 1:
        raise CheckpointCollectiveError(
            f"{call} on rank {me}: the ranks called different things: "
            + ", ".join(f"rank {r}: {c}" for r, c in calls.items())
            + "; save() and load() are collectives: call them on every rank, with the same step"
        )
    return any(v.endswith("\n") for v in said)


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


@dataclasses.dataclass
class _Track:
    """What this rank knows of one of a manager's groups (``Calls``): the agreement points it
    reached on it (each rank's count is in the store under ``tag``), the call they belong to,
    and whether a collective on it failed."""

    tag: str
    timeout: float
    call: str = "a save or load"
    points: int = 0
    last: str = ""  # the point this rank reached last
    broken: bool = False


_tracks: weakref.WeakKeyDictionary[Any, _Track] = weakref.WeakKeyDictionary()
_lane = threading.local()  # .group: the group of the DCP call this thread is in (``lane``)


def _track_of(group: Any) -> _Track | None:
    group = group if group is not None else getattr(_lane, "group", None)
    return None if group is None else _tracks.get(group)


@contextlib.contextmanager
def lane(group: Any) -> Iterator[None]:
    """DCP's collectives in this thread run on ``group``: ``arrive`` without a group, called
    where DCP's storage work ends (its writer's and reader's), marks a point on it."""
    before, _lane.group = getattr(_lane, "group", None), group
    try:
        yield
    finally:
        _lane.group = before


def arrive(what: str, group: Any = None) -> None:
    """This rank reached the next agreement point (``what``) of ``group`` (None: the group
    of the DCP call this thread is in); a no-op on groups no manager made."""
    t = _track_of(group)
    if t is None or not is_dist():
        return
    t.points, t.last = t.points + 1, what
    _store().set(f"{t.tag}/at/{rank()}", str(t.points))


def post(name: str, value: str, group: Any = None) -> None:
    """Leave ``value`` under ``name`` in the store for the ranks of ``group`` (a manager's): what
    a rank whose collective with this one failed reads (``posted``); best effort."""
    t = _track_of(group)
    if t is not None and is_dist():
        with contextlib.suppress(Exception):  # (the store gone: the readers' bound ends it)
            _store().set(f"{t.tag}/{name}", value)


def posted(name: str, prefix: str, timeout: float, group: Any = None) -> str | None:
    """The value ``post``ed under ``name`` that starts with ``prefix``, waited for up to
    ``timeout`` seconds; None if none came (or the store is gone)."""
    t = _track_of(group)
    if t is None or not is_dist():
        return None
    deadline, key = time.monotonic() + timeout, f"{t.tag}/{name}"
    with contextlib.suppress(Exception):
        store = _store()
        while True:
            if store.check([key]) and (got := store.get(key).decode()).startswith(prefix):
                return got
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
    return None


def comm_failure(e: BaseException, what: str, group: Any = None) -> CheckpointCollectiveError:
    """A collective on ``group`` that raised (gloo timeout, a peer gone) as the error every
    rank raises: the ranks that did not arrive at ``what`` and collective_timeout (on a
    manager's group, which is then rebuilt at the next call), else ``what`` and this rank."""
    t = _track_of(group)
    if t is None:  # (another group: the manager's may have been waited on too)
        for other in list(_tracks.values()):
            other.broken = True
        return CheckpointCollectiveError(
            f"{what} on rank {rank()}: a collective failed (a rank died, or did not answer "
            f"within collective_timeout): {type(e).__name__}: {e}"
        )
    t.broken = True
    what = t.last or what  # (DCP's own collectives follow the point its storage work marks)
    try:
        verdict = _verdict(t, what, e)
    except Exception as failed:  # (the store is gone too: this rank's view)
        verdict = f"{t.call}: {what} failed on rank {rank()} ({type(failed).__name__})"
    return CheckpointCollectiveError(
        f"{verdict}; the manager's process group is made again at its next save() or load()"
    )


def _verdict(t: _Track, what: str, e: BaseException) -> str:
    """The message every rank raises for the failed collective at ``t``'s point: set once in
    the store by the first rank that saw ranks behind it (that did not arrive); a rank that
    arrived last waits a little for it."""
    store, n = _store(), world_size()
    at = [int(v) for v in store.multi_get([f"{t.tag}/at/{r}" for r in range(n)])]
    behind = [r for r in range(n) if at[r] < t.points]
    key = f"{t.tag}/verdict/{t.points}"
    if behind:
        mine = (
            f"{t.call}: rank(s) {behind} of {n} did not reach {what} within "
            f"collective_timeout ({t.timeout:g} s)"
        )
    else:
        deadline = time.monotonic() + min(t.timeout, _VERDICT_WAIT)
        while not store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.01)
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        mine = (
            f"{t.call}: {what} failed on rank {rank()}: a rank stopped answering or left "
            f"(collective_timeout {t.timeout:g} s): {type(e).__name__}: {first}"
        )
    return store.compare_set(key, "", mine).decode()


@contextlib.contextmanager
def communicating(what: str, group: Any = None) -> Iterator[None]:
    try:
        yield
    except RuntimeError as e:  # torch's communication errors (DistError derives from it)
        raise comm_failure(e, what, group) from e


class Calls:
    """The save/load calls of one manager: each begins with a ``handshake`` (every rank is in
    the same call, or every rank that is raises), and the first makes the manager's gloo
    group (``group``) and counts the hosts the ranks run on (``hosts``); a call after a
    collective failed on any rank makes the groups again. Tags are per url and per manager of
    that url in this process: the same on every rank when every rank makes the same managers,
    whatever else a rank makes."""

    _made: dict[str, int] = {}  # managers of each url made in this process

    def __init__(
        self,
        url: str,
        timeout: float,
        *,
        background_groups: bool = False,
    ) -> None:
        url_id = hashlib.blake2b(url.encode(), digest_size=8).hexdigest()
        n = Calls._made[url_id] = Calls._made.get(url_id, 0) + 1
        self._tag = f"muon_ckpt/{url_id}/{n}"
        self._timeout = timeout
        self._count = 0  # calls so far: the handshake's sequence number
        self._made_groups = 0  # times the groups were made (the same on every rank)
        self.group: Any = None  # gloo group of every save/load collective
        # With a memory tier, a save's write and a memory save's job run in the background
        # at the same time as the calls: each on a gloo group of its own.
        self._background_groups = background_groups
        self.write_group: Any = None  # a save's write and commit (else ``group``)
        self.memory_group: Any = None  # a memory save's replication and agreement
        self.hosts = 1
        # Whether a background job runs (it may hold a group made before); set by its owner.
        self.busy: Callable[[], bool] = lambda: False
        self._retired: list[Any] = []  # groups replaced, destroyed once no job may hold them

    def _groups(self) -> list[Any]:
        return [g for g in (self.group, self.write_group, self.memory_group) if g is not None]

    def join(self, call: str) -> None:
        """Every rank is in the same ``call`` (bounded by the timeout)."""
        if not is_dist():
            return
        self._count += 1
        if self._count > 2:
            forget(f"{self._tag}/{self._count - 2}", call)  # every rank is past that one
        broken = any(t.broken for g in self._groups() if (t := _tracks.get(g)) is not None)
        if handshake(f"{self._tag}/{self._count}", call, self._timeout, broken):
            # A group whose collective failed is replaced; one still used by a background job
            # that failed with it is destroyed once that job has ended.
            self._retired += list(dict.fromkeys(self._groups()))
            self.group = self.write_group = self.memory_group = None
        if self._retired and not self.busy():
            self._destroy(self._retired)
        self.ensure_group()
        for g in self._groups():
            _tracks[g].call = call

    def ensure_group(self) -> None:
        """Make the gloo groups (a collective: every rank reaches it in the same call)."""
        if is_dist() and self.group is None:
            self._made_groups += 1
            self.group = self.write_group = self._new("group")
            if self._background_groups:
                self.write_group = self._new("write")
                self.memory_group = self._new("memory")
            self.hosts = len(set(all_gather(socket.gethostname(), self.group)))

    def _new(self, name: str) -> Any:
        """A group of every rank, tracked: its agreement points counted in the store."""
        group = new_group(self._timeout)
        tag = f"{self._tag}/{self._made_groups}/{name}"
        _tracks[group] = _Track(tag, self._timeout)
        _store().set(f"{tag}/at/{rank()}", "0")  # (every rank's is there once all_gather ran)
        return group

    def close(self) -> None:
        """Remove the last handshake's keys (housekeeping: the store's host may be gone) and
        destroy the groups (every background job has ended)."""
        if self._count > 1:  # every rank is past that one (not surely past the last)
            with contextlib.suppress(CheckpointCollectiveError):
                forget(f"{self._tag}/{self._count - 1}", "close()")
        self._retired += list(dict.fromkeys(self._groups()))
        self.group = self.write_group = self.memory_group = None
        self._destroy(self._retired)

    @staticmethod
    def _destroy(groups: list[Any]) -> None:
        """Destroy ``groups`` (local: their sockets and threads go; each rank does it)."""
        while groups:
            g = groups.pop()
            with contextlib.suppress(Exception):  # (a group torch already let go of)
                dist.destroy_process_group(g)
