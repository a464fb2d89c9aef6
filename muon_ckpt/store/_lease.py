"""The write lease: one job writes a run root at a time.

``<root>/lease.json`` names its holder (a per-process owner id, host and pid), the time of
its last heartbeat and when it expires. A save (rank 0) acquires or renews it before it
writes anything and checks it again right before the commit, so a second job writing the same
URL gets a ``CheckpointLeaseError`` naming the holder, before it has written a byte. Readers
(load, ls, verify, export, import, inspect) need no lease.

A lease is stale, and taken over, when its expiry has passed, or at once when its holder ran
on this host and that process is gone (a crashed or killed job restarted on the same machine
resumes saving without waiting). The heartbeat is renewed at every save, so ``seconds`` must
exceed the time between two saves plus the longest save: a job silent for longer may have its
lease taken over, and then its next save fails with the same error (it writes nothing).

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
from muon_ckpt.store._storage import Storage

__all__ = ["DEFAULT_LEASE_SECONDS", "LEASE", "Lease"]

LEASE = "lease.json"
DEFAULT_LEASE_SECONDS = 600.0
_MAX_LEASE_BYTES = 4096
_OWNER = f"{uuid.uuid4().hex}"  # this process
_HOST = socket.gethostname()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


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
        rec = {
            "owner": _OWNER,
            "host": _HOST,
            "pid": os.getpid(),
            "heartbeat": now,
            "expires": now + self.seconds,
        }
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
        pid = rec.get("pid")
        same_host = rec.get("host") == _HOST and isinstance(pid, int)
        if same_host and (pid == os.getpid() or not _alive(pid)):  # ours, past life, or dead
            return True
        return time.time() > rec["expires"]

    def _refuse(self, rec: dict[str, Any], doing: str) -> CheckpointLeaseError:
        now = time.time()
        age = now - float(rec.get("heartbeat", now))
        left = float(rec.get("expires", now)) - now
        return CheckpointLeaseError(
            f"{self.url}: {doing}: another job holds this run's write lease (owner "
            f"{rec.get('owner')}, host {rec.get('host')}, pid {rec.get('pid')}, last heartbeat "
            f"{age:.0f} s ago, expires in {left:.0f} s). One job writes a run at a time: give "
            "this job another URL, stop the other one, or, if it is dead, wait for the expiry "
            "(or delete the lease file)"
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
