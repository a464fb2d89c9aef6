"""What a job may trust of what it read under the write lease once the lease is no longer its
own: taken over by another job after it expired (a load reads the run again, a save in flight
commits nothing), or renewed by another manager of the same process (each reads what the other
committed; neither collects the other's data). On S3 (moto), where what was read under the lease
is trusted without a listing; the other job is a real process (``tests._lease_job``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from muon_ckpt import CheckpointManager
from muon_ckpt.store import LEASE, Storage
from tests import REPO
from tests._faults import FaultProxy
from tests._lease_job import REWOUND

_BOUND = 120.0  # the longest a test waits for a condition (a test that hangs)


def _filled(model: nn.Module, value: float) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _holds(model: nn.Module, value: float) -> bool:
    """Every parameter is ``value``, bitwise."""
    return all(torch.equal(p, torch.full_like(p, value)) for p in model.parameters())


def _job(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO}
    cmd = [sys.executable, "-W", "ignore", "-m", "tests._lease_job", *args]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _rewind(url: str, opts: dict) -> subprocess.Popen:
    """Another job takes the run over: it loads step 2 and saves step 3 from it (``REWOUND``),
    retiring the steps after 2 of the line it abandons."""
    return _job("rewind", url, json.dumps(opts))


def _until(done, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + _BOUND
    while not done():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"{what}: the job exited ({proc.returncode}): {proc.stderr.read()}"
            )
        assert time.monotonic() < deadline, f"{what}: not within {_BOUND} s"
        time.sleep(0.02)


def _expired(url: str, opts: dict) -> None:
    """Wait until the run's lease record has expired (another job may take it over)."""
    st = Storage(url, opts)
    expires = json.loads(st.read_bytes(LEASE))["expires"]
    _until(lambda: time.time() > expires, "the lease expiring")


def _fresh(url: str, opts: dict, step: int | None = None) -> tuple[int | None, nn.Module]:
    """What a new job loads from ``url``: the step and the model."""
    model = nn.Linear(8, 8)
    return CheckpointManager(url, model=model, storage_options=opts).load(step=step), model


def test_a_job_whose_lease_was_taken_over_loads_the_new_holders_step(s3_bucket):
    """A job silent past ``lease_seconds`` lost its lease to another job, which loaded step 2
    and saved step 3 (replacing this job's). This job's load reads the run again, rather than
    trust the step 3 it read under its lease (whose data the other job deleted): it loads the
    other job's step 3, and its next save continues that line, keeping it."""
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/run"
    model = nn.Linear(8, 8)
    mgr = CheckpointManager(url, model=model, storage_options=opts, lease_seconds=0.5)
    for s in (1, 2, 3):
        _filled(model, s)
        mgr.save(s)
    _expired(url, opts)
    other = _rewind(url, opts)
    assert other.wait(timeout=_BOUND) == 0, other.stderr.read()
    assert mgr.load() == 3 and _holds(model, REWOUND)
    _filled(model, 40.0)
    assert mgr.save(4)
    mgr.close()
    for step, value in ((3, REWOUND), (4, 40.0)):
        got, model = _fresh(url, opts, step)
        assert got == step and _holds(model, value), step


def test_a_job_whose_lease_was_taken_over_does_not_resume_a_retired_step(s3_server, s3_bucket):
    """The other job's step 3 retires this job's steps 3 and 4, and the other job was killed
    before it deleted step 4: this job's load resumes the other job's step 3, as a restart
    does, not the step 4 it read under its lease."""
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/run"
    model = nn.Linear(8, 8)
    mgr = CheckpointManager(url, model=model, storage_options=opts, lease_seconds=0.5)
    for s in (1, 2, 3, 4):
        _filled(model, s)
        mgr.save(s)
    _expired(url, opts)
    proxy = FaultProxy(s3_server, stall_s=None).start()  # (a stall ends, unforwarded, at stop)
    try:
        proxy.rule("*", r"step-00000004", "stall", kind="DELETE")
        proxy.rule("*", r".", "stall", body=rb"step-00000004", kind="DELETE")
        other = _rewind(url, {**opts, "endpoint_url": proxy.url})
        stalled = lambda: any(e[1] == "DELETE" and e[4] for e in list(proxy.log))  # noqa: E731
        _until(stalled, "the other job deleting step 4", other)
        other.kill()
        other.wait(timeout=_BOUND)
        assert _fresh(url, opts)[0] == 3  # (step 4 stands, retired)
        assert mgr.load() == 3 and _holds(model, REWOUND)
    finally:
        proxy.stop()


def test_a_save_that_outlives_its_lease_commits_nothing_once_another_job_took_it(
    s3_server, s3_bucket
):
    """A job's upload of step 5 is held past its ``lease_seconds``; another job takes the
    lease over, loads step 2, saves step 3 (retiring 3 and 4 of the first job's line) and
    closes, giving the lease back. The held save then fails at its commit with
    CheckpointLeaseError: step 5 is not committed, and a restart resumes the other job's
    step 3."""
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/run"
    proxy = FaultProxy(s3_server).start()
    try:
        proxy.rule("PUT", r"/run/data/00000005-[0-9a-f]+/", "hold")
        proxy.rule("*", r"/run/data/00000005-[0-9a-f]+/", "hold", kind="CREATE")
        job = _job("save-on", url, json.dumps({**opts, "endpoint_url": proxy.url}), "0.5")
        held = lambda: any("/data/00000005-" in e[3] for e in list(proxy.log))  # noqa: E731
        _until(held, "the job's upload of step 5", job)
        _expired(url, opts)
        model = nn.Linear(8, 8)
        with CheckpointManager(url, model=model, storage_options=opts) as other:
            assert other.load(step=2) == 2
            _filled(model, REWOUND)
            assert other.save(3)
        proxy.release()
        out, err = job.communicate(timeout=_BOUND)
    finally:
        proxy.stop()
    got = json.loads(out.strip().splitlines()[-1])
    assert got["saved"] is False, (out, err[-3000:])
    assert got["error"].startswith("CheckpointLeaseError:"), got
    assert "NOT committed" in got["error"] and "expired" in got["error"], got
    step, model = _fresh(url, opts)
    assert step == 3 and _holds(model, REWOUND)
    assert CheckpointManager(url, model=nn.Linear(8, 8), storage_options=opts).steps() == [1, 2, 3]


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_two_managers_of_one_process_see_what_the_other_committed(backend, tmp_path, request):
    """Two managers of one process on one url share the process's lease: one loads step 2
    and saves step 3 (replacing the other's). The other's load then finds that step 3, and
    its next save collects no data of it (every step loads, bitwise)."""
    if backend == "s3":
        bucket, opts = request.getfixturevalue("s3_bucket")
        url = f"s3://{bucket}/run"
    else:
        url, opts = str(tmp_path / "run"), {}
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    one = CheckpointManager(url, model=first, storage_options=opts)
    for s in (1, 2, 3):
        _filled(first, s)
        one.save(s)
    two = CheckpointManager(url, model=second, storage_options=opts)
    assert two.load(step=2) == 2
    _filled(second, REWOUND)
    assert two.save(3)
    assert one.load() == 3 and _holds(first, REWOUND)
    _filled(first, 40.0)
    assert one.save(4)
    for step, value in ((1, 1.0), (2, 2.0), (3, REWOUND), (4, 40.0)):
        got, model = _fresh(url, opts, step)
        assert got == step and _holds(model, value), step


def test_a_manager_saves_on_after_another_manager_of_its_process_replaced_a_step(s3_bucket):
    """As above, but the first manager saves step 4 without loading first: its save must not
    collect the data of the step 3 the other manager committed (it read step 3 under the
    process's lease before the other manager replaced it)."""
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/run"
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    one = CheckpointManager(url, model=first, storage_options=opts)
    for s in (1, 2, 3):
        _filled(first, s)
        one.save(s)
    two = CheckpointManager(url, model=second, storage_options=opts)
    assert two.load(step=2) == 2
    _filled(second, REWOUND)
    assert two.save(3)
    _filled(first, 40.0)
    assert one.save(4)
    for step, value in ((1, 1.0), (2, 2.0), (3, REWOUND), (4, 40.0)):
        got, model = _fresh(url, opts, step)
        assert got == step and _holds(model, value), step
