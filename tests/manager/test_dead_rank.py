"""A rank that died makes the others' save() and load() raise CheckpointCollectiveError,
not a raw torch error: README promises CheckpointCollectiveError
for "a rank ... died" and that ``except CheckpointError`` catches every failure of a save.

Rank 0 hosts the process group's store (``env://``); once its script has ended (the parent
waits for its exit, never a time), rank 1's next call fails at its handshake with the store.
Before the fix that was torch's ``DistNetworkError`` ("Broken pipe").
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests import REPO

BOUND_S = 120.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_calls_after_the_store_hosting_rank_died_raise_checkpoint_collective_error(tmp_path):
    port = _port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.manager._dead_rank_job", str(tmp_path / "run")],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        out0, err0 = procs[0].communicate(timeout=BOUND_S)
        assert procs[0].returncode == 0 and "saved 1" in out0, err0
        out1, err1 = procs[1].communicate("go\n", timeout=BOUND_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lines = dict(ln.split(": ", 1) for ln in out1.splitlines() if ": " in ln)
    for call in ("save", "load"):
        got = lines.get(call, f"(none; stderr: {err1[-2000:]})")
        assert got.startswith("CheckpointCollectiveError: "), (call, got)
        assert "a rank died" in got, (call, got)
        assert "rank 1" in got, (call, got)
    assert lines.get("close") == "returned", out1  # (it gives up on the store quietly)
