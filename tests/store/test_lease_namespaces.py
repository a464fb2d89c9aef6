"""The write lease across PID namespaces: two jobs with one hostname in
separate PID namespaces (host-networked containers, a pod restarted while the old one
terminates) must not see each other's pid as dead, or as their own. The namespace cases run
for real under ``unshare``; the rule itself is tested on records everywhere."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time

import pytest

from muon_ckpt.store import LEASE, Storage, _identity, _lease, step_dirname
from tests import REPO


def _unshare_prefix() -> list[str] | None:
    """A command prefix that runs a program as pid 1 of a new PID namespace with its own
    /proc, or None where this machine allows none."""
    if shutil.which("unshare") is None:
        return None
    for prefix in (
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"],
        ["unshare", "-r", "--pid", "--fork", "--mount-proc", "--kill-child"],
    ):
        probe = subprocess.run([*prefix, "sh", "-c", "echo $$"], capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == "1":
            return prefix
    return None


_PREFIX = _unshare_prefix()
needs_unshare = pytest.mark.skipif(
    _PREFIX is None,
    reason="no PID namespace can be made here (unshare missing, or neither root nor "
    "unprivileged user namespaces allowed); the rule is tested on records below",
)


def _job(*args: str, namespace: bool) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO}
    cmd = [sys.executable, "-m", "tests._lease_job", *args]
    return subprocess.Popen(
        [*(_PREFIX or []), *cmd] if namespace else cmd,
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _hold(url: str, tmp_path, *, namespace: bool) -> tuple[subprocess.Popen, str]:
    """A job holding the lease of ``url`` (step 1 saved) until ``done`` exists."""
    ready, done = str(tmp_path / "ready"), str(tmp_path / "done")
    holder = _job("hold", url, ready, done, namespace=namespace)
    deadline = time.monotonic() + 120
    while not os.path.exists(ready):
        if holder.poll() is not None:
            raise AssertionError(f"the holder exited with {holder.returncode}: {holder.stderr}")
        assert time.monotonic() < deadline, "the holder never saved step 1"
        time.sleep(0.02)
    return holder, done


class _Contender:
    """A second job of ``url`` in a PID namespace of its own; ``save(step)``: it tries again,
    as a resuming job does (a new manager: load, then save), and says what came of it."""

    def __init__(self, url: str) -> None:
        self.proc = _job("save", url, namespace=True)

    def save(self, step: int) -> dict:
        self.proc.stdin.write(f"{step}\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else ""
        assert line, f"no answer (exit {self.proc.poll()}): {self._stderr()}"
        return json.loads(line)

    def _stderr(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.communicate(timeout=60)[1][-3000:]

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=120) == 0, self._stderr()


@needs_unshare
@pytest.mark.parametrize("holder_ns", [False, True], ids=["holder-in-host-namespace", "both-pid-1"])
def test_a_job_in_another_pid_namespace_does_not_take_a_live_lease(holder_ns, tmp_path):
    """The contender runs as pid 1 of a PID namespace of its own: it cannot see the holder's
    pid (holder-in-host-namespace) or sees it as its own (both-pid-1, the holder is pid 1 of
    another namespace). Either way the holder is alive: the lease is refused."""
    url = str(tmp_path / "run")
    holder, done = _hold(url, tmp_path, namespace=holder_ns)
    contender = _Contender(url)
    try:
        try:
            got = contender.save(2)
            assert got["pid"] == 1
            assert got["saved"] is False, "the second job took the lease of a live job"
            assert "another job holds this run's write lease" in got["error"]
            assert "another PID namespace" in got["error"]
            assert not Storage(url).exists(step_dirname(2))
        finally:
            open(done, "w").close()
            holder.communicate(timeout=60)
        # Gone, but in another namespace: it cannot be checked from here, so the lease holds
        # until it expires (the old record is still there, naming pid 1 or the holder's pid).
        if holder_ns:
            assert contender.save(2)["saved"] is False
        rec = json.loads(Storage(url).read_bytes(LEASE))
        rec["expires"] = time.time() - 1
        Storage(url).write_bytes(json.dumps(rec).encode(), LEASE)
        assert contender.save(2)["saved"] is True
    finally:
        contender.close()


# ------------------------------------------------------------------ the rule, on records
def _reaped_pid() -> int:
    """The pid of a process of this host that has ended and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_dead_holder_shortcut_needs_host_boot_namespace_and_process_to_match():
    me = _identity.identity()
    if me is None:
        pytest.skip("this system has no /proc for this PID namespace: the shortcut never applies")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = {**_identity.identity(sleeper.pid), "expires": time.time() + 300}
        assert alive["pid"] == sleeper.pid and alive["host"] == me["host"]
        assert not _identity.holder_gone(alive)
        # The same pid with another start time: the holder's pid was reused after it ended.
        assert _identity.holder_gone({**alive, "pid_start": alive["pid_start"] - 1})
    finally:
        sleeper.kill()
        sleeper.wait()
    assert _identity.holder_gone(alive)  # ended: taken over at once
    dead = {**alive, "pid": _reaped_pid()}
    assert _identity.holder_gone(dead)
    # Anything that says "not this host as this process sees it", or cannot be read: the pid
    # means nothing here, and the lease only expires by time.
    for other in (
        {"host": me["host"] + "-other"},
        {"boot_id": "00000000-0000-0000-0000-000000000000"},  # another boot (or machine)
        {"pid_ns": "pid:[1]"},  # another container on this host
        {"pid_ns": None},
        {"pid_start": None},
    ):
        assert not _identity.holder_gone({**dead, **other}), other
    for missing in ("boot_id", "pid_ns", "pid_start"):  # a lease written by an older version
        assert not _identity.holder_gone({k: v for k, v in dead.items() if k != missing}), missing
    # Our own pid in another namespace (both pid 1): another process, alive for all we know.
    assert not _identity.holder_gone({**me, "pid_ns": "pid:[1]"})
    # Our own pid and start time: this very process (an owner id of a former life).
    assert _identity.holder_gone(dict(me))


def test_a_forked_child_is_another_owner(tmp_path):
    """A process forked after the import (a launcher that forks its jobs) gets an owner id of
    its own: it must not renew its parent's lease as if it were its own."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its owner id, leave without running pytest's teardown
        os.close(r)
        os.write(w, _lease.owner().encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child_owner = f.read()
    os.waitpid(pid, 0)
    assert child_owner and child_owner != _lease.owner()
