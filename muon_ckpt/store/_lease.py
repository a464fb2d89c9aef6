"""The write lease: one job writes a run root at a time.

``<root>/lease.json`` names its holder (a per-process owner id, host and pid), the time of
its last heartbeat and when it expires. A save (rank 0) acquires or renews it before it
writes anything and checks it again right before the commit, so a second job writing the same
URL gets a ``CheckpointLeaseError`` naming the holder, before it has written a byte. Readers
(load, ls, verify, export, import, inspect) need no lease.

A lease is stale, and taken over, when its expiry has passed, or at once when its holder is
known to have ended: it ran on this host as this process sees it (same hostname, boot id and
PID namespace) and no process runs with its pid and start time (a crashed or killed job
restarted on the same machine resumes saving without waiting). A holder in another PID
namespace (a container sharing the hostname: host networking, a restarted pod), another boot,
or named by a record without these fields cannot be checked from here: its lease only expires
by time (``_identity``). The heartbeat is renewed at every save, so ``seconds`` must exceed the
time between two saves plus the longest save: a job silent for longer may have its lease taken
over, and then its next save fails with the same error (it writes nothing); a save in flight
past the expiry fails at its commit check where the record is another's or gone (taken over,
written and given back meanwhile). What a job read under its lease stands only while it is
``ours``: until its expiry, and until another manager of this process acquires it (the record
names the process, so the two share it, and only this process's ``_LATEST`` tells them apart).

``muon-ckpt prune`` takes the lease too (``purpose`` "prune", for ``PRUNE_LEASE_SECONDS``,
renewed before each step it deletes), so it never deletes beside a writer: it is refused while
a job holds the lease, and a save that meets a prune's lease waits until the prune gives it
back, rather than fail.

Creating the first lease is atomic, and never seen half-written, where the store can do it: a
hard link of a file written aside locally (``Storage.create_exclusive``), a conditional upload
(``If-None-Match: *``) on S3. A takeover, and stores without conditional writes, use
write-then-read-back: two jobs racing within one round trip can both read back their own
record, and the loser then fails its commit check instead (the check reads the lease again).
Clocks of different hosts are compared: keep them in sync (NTP). The lease is advisory and
written without fsync (a save pays no extra disk flush for it): after a power loss it may be
gone, and the next save creates it again.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from muon_ckpt._errors import CheckpointCorruptError, CheckpointLeaseError
from muon_ckpt.store._identity import holder_gone, identity, pid_is_ours
from muon_ckpt.store._storage import Storage

__all__ = ["DEFAULT_LEASE_SECONDS", "LEASE", "PRUNE", "PRUNE_LEASE_SECONDS", "SAVE", "Lease"]

LEASE = "lease.json"
DEFAULT_LEASE_SECONDS = 600.0
SAVE, PRUNE = "save", "prune"  # what the holder does with the lease (its record's "purpose")
PRUNE_LEASE_SECONDS = 60.0  # a prune renews it before each step it deletes
_PRUNE_POLL_SECONDS = 0.1
_PRUNE_WAIT_SECONDS = 120.0  # then a save is refused: it must not wait past collective timeouts
_MAX_LEASE_BYTES = 4096
_OWNER = uuid.uuid4().hex  # this process
# Lease url -> the token of this process's Lease object that acquired it last: the others
# may hold it by the record, but another manager of this process may have written since
_LATEST: dict[str, str] = {}

_log = logging.getLogger("muon_ckpt")


def _new_owner() -> None:
    global _OWNER
    _OWNER = uuid.uuid4().hex
    _LATEST.clear()


# A child forked after the import is another process: it must not hold its parent's lease.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_owner)


def owner() -> str:
    """This process's owner id, as lease records name it."""
    return _OWNER


class Lease:
    """The write lease of ``storage``'s root, held by this process once acquired."""

    def __init__(
        self, storage: Storage, seconds: float = DEFAULT_LEASE_SECONDS, *, purpose: str = SAVE
    ) -> None:
        self.storage = storage
        self.seconds = float(seconds)
        self.purpose = purpose
        self.held = False  # acquired by this object (so release() gives it up)
        self._until = 0.0  # the expiry of the record of this object's last acquire; 0: none
        self._token = uuid.uuid4().hex  # this object, among this process's (``_LATEST``)
        # Called when an acquire finds the lease not this object's (none, another job's, or
        # renewed by another manager of this process): someone else may have written
        # meanwhile (``_memo``)
        self.changed_hands: Callable[[], None] = lambda: None

    @property
    def url(self) -> str:
        return self.storage.url_of(LEASE)

    @property
    def ours(self) -> bool:
        """Whether no one else can have written the run since this object's last acquire:
        its record has not expired (past that, another job may take the lease over, with no
        request of this process to tell) and no other manager of this process acquired it."""
        return time.time() < self._until and _LATEST.get(self.url) == self._token

    def _record(self) -> tuple[bytes, float]:
        """A record of this process holding the lease, and when it expires."""
        now = time.time()
        me = identity() or {"host": socket.gethostname(), "pid": os.getpid()}
        rec = {"owner": _OWNER, **me, "purpose": self.purpose}
        rec.update(heartbeat=now, expires=now + self.seconds)
        return json.dumps(rec, sort_keys=True).encode(), rec["expires"]

    def _hold(self, until: float) -> None:
        self._until = until
        _LATEST[self.url] = self._token

    def read(self) -> dict[str, Any] | None:
        """The current record; None when there is none. An unreadable one is stale."""
        try:
            data = self.storage.read_bytes(LEASE, limit=_MAX_LEASE_BYTES)
        except FileNotFoundError:
            return None
        except CheckpointCorruptError:
            return {}
        try:
            rec = json.loads(data)
        except (ValueError, RecursionError):
            return {}
        return rec if isinstance(rec, dict) else {}

    def _mine(self, rec: dict[str, Any] | None) -> bool:
        return bool(rec) and rec.get("owner") == _OWNER

    def _stale(self, rec: dict[str, Any]) -> bool:
        if not rec or not isinstance(rec.get("expires"), (int, float)):
            return True
        return time.time() > rec["expires"] or holder_gone(rec)

    def _refuse(self, rec: dict[str, Any], doing: str) -> CheckpointLeaseError:
        now = time.time()
        age = now - float(rec.get("heartbeat", now))
        left = float(rec.get("expires", now)) - now
        what = "muon-ckpt prune, " if rec.get("purpose") == PRUNE else ""
        fix = (
            "prune deletes only while no job writes the run: run it once the job has ended "
            "(close() gives the lease back), or let the job's keep_last delete old steps"
            if self.purpose == PRUNE
            else "One job writes a run at a time: give this job another URL, stop the other "
            "one, or, if it is dead, wait for the expiry (or delete the lease file)"
        )
        return CheckpointLeaseError(
            f"{self.url}: {doing}: another job holds this run's write lease ({what}owner "
            f"{rec.get('owner')}, host {rec.get('host')}, pid {rec.get('pid')}, last heartbeat "
            f"{age:.0f} s ago, expires in {left:.0f} s){_unknowable(rec)}. {fix}"
        )

    def _after_prune(self, rec: dict[str, Any] | None) -> dict[str, Any] | None:
        """``rec``; if it is a live prune's, the record once that prune gave the lease back or
        let it expire (at most ``_PRUNE_WAIT_SECONDS``): a save waits for a prune, which holds
        the lease only while it deletes, rather than fail."""
        deadline = time.monotonic() + _PRUNE_WAIT_SECONDS
        logged = False
        while (
            self.purpose != PRUNE
            and rec
            and rec.get("purpose") == PRUNE
            and not self._mine(rec)
            and not self._stale(rec)
            and time.monotonic() < deadline
        ):
            if not logged:
                _log.info("%s: waiting for muon-ckpt prune (pid %s)", self.url, rec.get("pid"))
                logged = True
            time.sleep(_PRUNE_POLL_SECONDS)
            rec = self.read()
        return rec

    def acquire(self, doing: str = "saving") -> None:
        """Acquire, renew or take over the lease (after a prune that holds it, unless this is
        one); CheckpointLeaseError naming the holder if a live job holds it."""
        st = self.storage
        rec = self._after_prune(self.read())
        if not self._mine(rec) or _LATEST.get(self.url) != self._token:
            self._until = 0.0
            self.changed_hands()
        if rec is None:
            st.makedirs()
            data, until = self._record()
            if st.create_exclusive(data, LEASE):
                self.held = True
                return self._hold(until)
            rec = self._after_prune(self.read()) or {}
        if self._mine(rec):  # renew: the check before the commit reads it again
            data, until = self._record()
            st.write_bytes(data, LEASE, durable=False)
            return self._hold(until)
        if not self._stale(rec):
            raise self._refuse(rec, doing)
        data, until = self._record()
        st.write_bytes(data, LEASE, durable=False)  # take over, then make sure no one else did
        rec = self.read()
        if not self._mine(rec):
            raise self._refuse(rec or {}, "taking over a stale lease")
        self.held = True
        self._hold(until)

    def check(self) -> None:
        """Before a commit: the lease must still be this process's, or free again (released
        by another manager of this process) while this object's hold has not expired. Gone
        after that expiry, another job may have taken it over, written and given it back."""
        rec = self.read()
        if rec is None and self._until and time.time() >= self._until:
            late = time.time() - self._until
            self._until = 0.0
            self.changed_hands()
            raise CheckpointLeaseError(
                f"{self.url}: committing (the step is NOT committed): this job's write lease "
                f"expired {late:.0f} s before the commit (lease_seconds={self.seconds:g}) and "
                "is gone: another job may have taken the run over and written meanwhile. "
                "Load again to resume what the run holds now; raise lease_seconds above the "
                "longest save plus the time between two saves"
            )
        if rec is None:
            return self.acquire()
        if not self._mine(rec):
            self._until = 0.0
            self.changed_hands()
            raise self._refuse(rec, "committing (the step is NOT committed)")

    def release(self) -> None:
        """Give the lease up if this object acquired it and this process still holds it."""
        if self.held and self._mine(self.read()):
            self.storage.rm(LEASE)
        self.held = False
        self._until = 0.0
        if _LATEST.get(self.url) == self._token:
            _LATEST.pop(self.url, None)  # (another manager's may replace it meanwhile)


def _unknowable(rec: dict[str, Any]) -> str:
    """Why a holder under this host name is not checked, for the refusal; "" otherwise."""
    if rec.get("host") != socket.gethostname() or pid_is_ours(rec):
        return ""
    return (
        "; it ran under this host name but in another PID namespace (a container), another "
        "boot, or where this process cannot check it, so its pid says nothing here and the "
        "lease is taken over only when it expires"
    )
