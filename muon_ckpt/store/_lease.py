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
over, and then its next save fails with the same error (it writes nothing).

Creating the first lease is atomic where the store can do it: ``O_EXCL`` locally, a
conditional upload (``If-None-Match: *``) on S3. A takeover, and stores without conditional
writes, use write-then-read-back: two jobs racing within one round trip can both read back
their own record, and the loser then fails its commit check instead (the check reads the
lease again). Clocks of different hosts are compared: keep them in sync (NTP). The lease is advisory and
written without fsync (a save pays no extra disk flush for it): after a power loss it may be
gone, and the next save creates it again.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Any

from muon_ckpt._errors import CheckpointCorruptError, CheckpointLeaseError
from muon_ckpt.store._identity import holder_gone, identity, pid_is_ours
from muon_ckpt.store._storage import Storage

__all__ = ["DEFAULT_LEASE_SECONDS", "LEASE", "Lease"]

LEASE = "lease.json"
DEFAULT_LEASE_SECONDS = 600.0
_MAX_LEASE_BYTES = 4096
_OWNER = uuid.uuid4().hex  # this process


def _new_owner() -> None:
    global _OWNER
    _OWNER = uuid.uuid4().hex


# A child forked after the import is another process: it must not hold its parent's lease.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_owner)


def owner() -> str:
    """This process's owner id, as lease records name it."""
    return _OWNER


class Lease:
    """The write lease of ``storage``'s root, held by this process once acquired."""

    def __init__(self, storage: Storage, seconds: float = DEFAULT_LEASE_SECONDS) -> None:
        self.storage = storage
        self.seconds = float(seconds)
        self.held = False  # acquired by this object (so release() gives it up)

    @property
    def url(self) -> str:
        return self.storage.url_of(LEASE)

    def _record(self) -> bytes:
        now = time.time()
        me = identity() or {"host": socket.gethostname(), "pid": os.getpid()}
        rec = {"owner": _OWNER, **me, "heartbeat": now, "expires": now + self.seconds}
        return json.dumps(rec, sort_keys=True).encode()

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
        return CheckpointLeaseError(
            f"{self.url}: {doing}: another job holds this run's write lease (owner "
            f"{rec.get('owner')}, host {rec.get('host')}, pid {rec.get('pid')}, last heartbeat "
            f"{age:.0f} s ago, expires in {left:.0f} s){_unknowable(rec)}. One job writes a "
            "run at a time: give this job another URL, stop the other one, or, if it is dead, "
            "wait for the expiry (or delete the lease file)"
        )

    def acquire(self) -> None:
        """Acquire, renew or take over the lease; CheckpointLeaseError if a live job
        holds it."""
        st = self.storage
        rec = self.read()
        if rec is None:
            st.makedirs()
            if st.create_exclusive(self._record(), LEASE):
                self.held = True
                return
            rec = self.read() or {}
        if self._mine(rec):  # renew: the check before the commit reads it again
            st.write_bytes(self._record(), LEASE, durable=False)
            return
        if not self._stale(rec):
            raise self._refuse(rec, "saving")
        st.write_bytes(
            self._record(), LEASE, durable=False
        )  # take over, then make sure no one else did
        rec = self.read()
        if not self._mine(rec):
            raise self._refuse(rec or {}, "taking over a stale lease")
        self.held = True

    def check(self) -> None:
        """Before a commit: the lease must still be this process's, or free again (released
        by another manager of this process)."""
        rec = self.read()
        if rec is None:
            return self.acquire()
        if not self._mine(rec):
            raise self._refuse(rec, "committing (the step is NOT committed)")

    def release(self) -> None:
        """Give the lease up if this object acquired it and this process still holds it."""
        if self.held and self._mine(self.read()):
            self.storage.rm(LEASE)
        self.held = False


def _unknowable(rec: dict[str, Any]) -> str:
    """Why a holder under this host name is not checked, for the refusal; "" otherwise."""
    if rec.get("host") != socket.gethostname() or pid_is_ours(rec):
        return ""
    return (
        "; it ran under this host name but in another PID namespace (a container), another "
        "boot, or where this process cannot check it, so its pid says nothing here and the "
        "lease is taken over only when it expires"
    )
