"""Who a process is, as this host can tell: for the lease's "its holder has ended" shortcut.

A pid means something only inside one PID namespace of one boot of one machine: two
containers sharing a hostname (host networking, a pod restarted while the old one terminates)
each have their own pid 1, and a pid is reused once its process ends. So a holder is taken for
ended only when its record names this hostname, this boot (``/proc/sys/kernel/random/boot_id``)
and this process's PID namespace (``/proc/self/ns/pid``), and no process runs with its pid and
start time (``/proc/<pid>/stat``). Where any of these cannot be read, or ``/proc`` belongs to
another PID namespace than this process's (``unshare --pid`` without remounting it), nothing
is known and the lease only expires by time.
"""

from __future__ import annotations

import os
import socket
from typing import Any

__all__ = ["holder_gone", "identity", "pid_is_ours"]

_FIELDS = ("host", "boot_id", "pid_ns")  # must equal this process's for a pid to mean anything
_START = 19  # starttime (field 22 of /proc/<pid>/stat), counted after the ")" of the name


def _stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the process name (state first); None when
    there is no such process or it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[-1].split()
    except OSError:
        return None
    return fields if len(fields) > _START else None


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), None when unknown."""
    fields = _stat(pid)
    try:
        return None if fields is None else int(fields[_START])
    except ValueError:
        return None


def identity(pid: int | None = None) -> dict[str, Any] | None:
    """``host``, ``boot_id``, ``pid_ns``, ``pid`` and ``pid_start`` of process ``pid`` (this
    one by default) of this PID namespace; None where they cannot all be known."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return None  # /proc of another PID namespace: its pids are not ours
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        ns = os.readlink("/proc/self/ns/pid")
    except (OSError, UnicodeDecodeError):
        return None
    pid = os.getpid() if pid is None else pid
    start = _start_time(pid)
    if not boot or not ns or start is None:
        return None
    return {
        "host": socket.gethostname(),
        "boot_id": boot,
        "pid_ns": ns,
        "pid": pid,
        "pid_start": start,
    }


def _ended(pid: int, start: int) -> bool:
    """Whether process ``pid`` that started at ``start`` is known to have ended (absent, a
    zombie, or its pid now another process's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # another user's process: it exists
    except OSError:
        return False
    fields = _stat(pid)
    if fields is None:
        return False  # there, but hidden (/proc mounted with hidepid): alive for all we know
    return fields[0] == b"Z" or fields[_START] != str(start).encode()


def pid_is_ours(rec: dict[str, Any]) -> bool:
    """Whether the pid a record names is a pid of this PID namespace, host and boot."""
    me = identity()
    return me is not None and all(rec.get(k) == me[k] for k in _FIELDS)


def holder_gone(rec: dict[str, Any]) -> bool:
    """Whether the process a lease record names is known to have ended: its pid is one of ours
    (``pid_is_ours``), and it is this process's (a former owner in this process) or no longer
    runs with the recorded start time."""
    if not pid_is_ours(rec):
        return False
    pid, start = rec.get("pid"), rec.get("pid_start")
    if type(pid) is not int or type(start) is not int or pid <= 0:
        return False
    return pid == os.getpid() or _ended(pid, start)
