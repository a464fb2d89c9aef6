"""One writer per run (the lease), and ``overwrite=True`` never leaves fewer committed steps
than before, even when killed mid-way."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from typing import Any

import pytest
import torch
from torch import nn

from muon_ckpt import CheckpointError, CheckpointLeaseError, CheckpointManager
from muon_ckpt.store import LEASE, Storage, step_dirname
from tests._dist import _context


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))


def _fill(model: nn.Module, v: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(v)


def _wait_for(path: str, proc: Any, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert proc.is_alive(), f"child exited with {proc.exitcode}"
        assert time.monotonic() < deadline, f"child never wrote {path}"
        time.sleep(0.01)


# ------------------------------------------------------------------ the lease
def child_hold_lease(url: str, ready: str, done: str) -> None:
    torch.set_num_threads(1)
    model = _model()
    _fill(model, 1.0)
    mgr = CheckpointManager(url, model=model)
    mgr.save(1)
    open(ready, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.01)
    # exits without close(): the lease stays behind, as after a crash


def test_second_writer_is_refused_and_writes_nothing(tmp_path):
    url = str(tmp_path / "run")
    ready, done = str(tmp_path / "ready"), str(tmp_path / "done")
    p = _context().Process(target=child_hold_lease, args=(url, ready, done), daemon=True)
    p.start()
    try:
        _wait_for(ready, p)
        model = _model()
        mgr = CheckpointManager(url, model=model)
        assert mgr.load() == 1  # the second job resumes the run: only the lease stops it
        _fill(model, 2.0)
        with pytest.raises(CheckpointLeaseError, match=rf"another job holds .*pid {p.pid}\b"):
            mgr.save(2)
        st = Storage(url)
        assert not st.exists(step_dirname(2))  # refused before writing a byte
        assert mgr.steps() == [1]
        # Readers need no lease.
        assert CheckpointManager(url, model=_model()).load() == 1
    finally:
        open(done, "w").close()
        p.join(30)
    # The holder is gone (same host, process ended): its lease is taken over at once.
    assert mgr.save(2)
    assert mgr.steps() == [1, 2]
    got = _model()
    assert CheckpointManager(url, model=got).load() == 2
    assert all(torch.all(q == 2.0) for q in got.parameters())


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_lease_of_another_host_is_refused_until_it_expires(backend, tmp_path, request):
    if backend == "s3":
        bucket, opts = request.getfixturevalue("s3_bucket")
        url = f"s3://{bucket}/run"
    else:
        url, opts = str(tmp_path / "run"), {}
    st = Storage(url, opts)
    now = time.time()
    other = {"owner": "x" * 32, "host": "other-host", "pid": 4242, "heartbeat": now}
    st.write_bytes(json.dumps({**other, "expires": now + 300}).encode(), LEASE)
    mgr = CheckpointManager(url, model=_model(), storage_options=opts)
    with pytest.raises(CheckpointLeaseError, match=r"host other-host, pid 4242.*expires in"):
        mgr.save(1)
    assert mgr.steps() == []
    st.write_bytes(json.dumps({**other, "expires": now - 1}).encode(), LEASE)  # crashed
    assert mgr.save(1)
    assert json.loads(st.read_bytes(LEASE))["pid"] == os.getpid()
    mgr.close()  # gives the lease back: the next job may write at once
    assert not st.exists(LEASE)


def test_lease_lost_during_a_save_is_not_committed(tmp_path):
    """A job whose lease was taken over (it was silent past the expiry) fails its next
    commit and commits nothing."""
    url = str(tmp_path / "run")
    st = Storage(url)
    mgr = CheckpointManager(url, model=_model())
    mgr.save(1)
    spec_gate = __import__("threading").Event()
    mgr2 = CheckpointManager(url, model=_model(), async_save=True)
    assert mgr2.load() == 1
    mgr2._saves.gate = spec_gate  # the write starts when the test says so
    mgr2.save(2)
    now = time.time()
    thief = {"owner": "y" * 32, "host": "other-host", "pid": 1, "heartbeat": now}
    st.write_bytes(json.dumps({**thief, "expires": now + 300}).encode(), LEASE)
    spec_gate.set()
    with pytest.raises(CheckpointLeaseError, match="the step is NOT committed"):
        mgr2.wait()
    assert mgr.steps() == [1]


# ------------------------------------------------------------------ overwrite killed mid-way
def child_overwrite_forever(url: str, progress: str, base: int) -> None:
    torch.set_num_threads(1)
    model = _model()
    mgr = CheckpointManager(url, model=model, io_threads=2)
    mgr.load()
    fd = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    v = base
    while True:
        v += 1
        _fill(model, float(v))
        os.write(fd, f"begin {v}\n".encode())
        mgr.save(1, overwrite=True)
        os.write(fd, f"saved {v}\n".encode())


def test_overwrite_killed_mid_way_never_loses_the_step(tmp_path):
    url = str(tmp_path / "run")
    model = _model()
    _fill(model, 0.0)
    with CheckpointManager(url, model=model) as mgr:
        mgr.save(1)
    st = Storage(url)
    rng = random.Random(17)
    staged = "overwrite-" + step_dirname(1)
    mid, before = 0, 0.0
    for trial in range(10):
        progress, base = str(tmp_path / f"progress{trial}"), 1000 * (trial + 1)
        p = _context().Process(
            target=child_overwrite_forever, args=(url, progress, base), daemon=True
        )
        p.start()
        _wait_for(progress, p)
        if trial % 2:  # the moment the new version is being written beside the old one
            deadline = time.monotonic() + 30
            while not st.exists(staged) and time.monotonic() < deadline:
                assert p.is_alive()
        else:
            time.sleep(rng.uniform(0.0, 0.2))
        mid += st.exists(staged)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        with open(progress) as f:
            begun = max((int(ln.split()[1]) for ln in f if ln.startswith("begin")), default=base)
        got = _model()
        mgr = CheckpointManager(url, model=got)
        assert mgr.steps() == [1], f"trial {trial}: {mgr.steps()}"
        assert mgr.load() == 1
        v = next(iter(got.parameters())).flatten()[0].item()
        assert v == before or base < v <= begun, (trial, v)  # the old or a new version,
        assert all(torch.all(q == v) for q in got.parameters())  # whole
        before = v
    assert mid >= 1, "no kill landed while an overwrite was being written"


def test_an_overwrite_stopped_before_its_rename_is_read_where_it_was_committed(
    tmp_path, monkeypatch
):
    """``overwrite=True`` of a step that is not there commits beside it and renames it into
    place: stopped in between (here the rename fails, as a kill there would leave it), the
    step is read from where it was committed (``steps()``, ``load()``, ``prune`` keep it
    whole), and the next save finishes the move."""
    from muon_ckpt.store import prune

    url = str(tmp_path / "run")
    model = _model()
    _fill(model, 1.0)
    mgr = CheckpointManager(url, model=model)
    mgr.save(1)
    _fill(model, 2.0)

    def stopped(self, src: str, dst: str) -> None:
        with self._calling("renaming", src):  # (the storage's own error translation)
            raise OSError(5, "stopped before the rename")

    with monkeypatch.context() as m:
        m.setattr(Storage, "rename", stopped)
        with pytest.raises(CheckpointError):
            mgr.save(2, overwrite=True)
    st = Storage(url)
    assert st.exists("overwrite-" + step_dirname(2)) and not st.exists(step_dirname(2))
    got = _model()
    assert CheckpointManager(url, model=got).steps() == [1, 2]
    assert CheckpointManager(url, model=got).load() == 2
    assert all(torch.all(q == 2.0) for q in got.parameters())
    assert prune(Storage(url), keep=1).deleted == [1]
    got = _model()
    assert CheckpointManager(url, model=got).load() == 2
    assert all(torch.all(q == 2.0) for q in got.parameters())
    mgr = CheckpointManager(url, model=model)
    assert mgr.load() == 2
    _fill(model, 3.0)
    assert mgr.save(3)  # finishes the move first
    assert st.exists(step_dirname(2)) and not st.exists("overwrite-" + step_dirname(2))
