"""A save's outcome is the storage's: a step whose manifest rank 0 wrote is committed on every
rank, even where the broadcast of that outcome timed out (rank 0's manifest PUT slower than
``collective_timeout``): each rank then reads the manifest of the save's generation and
returns the step with a WARNING; and retention, which runs on rank 0 after the commit with no
agreement after it, cannot fail a committed save however slow its deletions are. A fault-
injecting proxy (``tests/_faults.py``, one port per rank) sits between each rank's s3fs and
the moto server."""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from muon_ckpt import CheckpointError, CheckpointManager
from tests._dist import run_on_ranks
from tests._faults import FaultControl, FaultProxy
from tests.conftest import s3_options

COLLECTIVE_TIMEOUT = 2.0
DELAY = 3 * COLLECTIVE_TIMEOUT  # rank 0's delayed request outlasts the others' wait for it


@pytest.fixture
def proxy(s3_server: str) -> Iterator[FaultProxy]:
    p = FaultProxy(s3_server, ranks=2, delay_s=DELAY).start()
    try:
        yield p
    finally:
        p.stop()


def _fill(m: nn.Module, v: float) -> nn.Module:
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(v)
    return m


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _settling() -> bool:
    """Whether a thread of this process decides a save's outcome from the storage (its
    broadcast timed out: ``settle``)."""
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name == "settle" and frame.f_code.co_filename.endswith("_commit.py"):
                return True
            frame = frame.f_back
    return False


def _release_when(faults: FaultControl, saved: threading.Event) -> None:
    """Rank 1: rank 0's held request answers once this rank waited past collective_timeout
    for it and decides the outcome from the storage (or its save ended: the test fails)."""
    deadline = time.monotonic() + 120  # (never reached: the test fails first)
    while not (saved.is_set() or _settling()) and time.monotonic() < deadline:
        time.sleep(0.005)
    faults.release()


def _slow_rank0_save(rank, world, url, urls, control, rule, keep_last, async_save):
    """Save step 1; with ``rule`` set (rank 0's request delayed, or held until rank 1 waited
    past collective_timeout for it), save step 2; then, the fault cleared, list the steps and
    load the newest."""
    faults = FaultControl(control)
    seen = _Warnings()
    logging.getLogger("muon_ckpt").addHandler(seen)
    model = _fill(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), 1.0)
    mgr = CheckpointManager(
        url,
        model=model,
        storage_options=s3_options(urls[rank]),
        keep_last=keep_last,
        storage_timeout=30.0,
        collective_timeout=COLLECTIVE_TIMEOUT,
        async_save=async_save,
    )
    mgr.save(1)
    mgr.wait()
    if rank == 0:
        faults.rule(**rule)
    dist.barrier()
    _fill(model, 2.0)
    saved = threading.Event()
    if rank == 1 and rule["fault"] == "hold":
        threading.Thread(target=_release_when, args=(faults, saved), daemon=True).start()
    try:
        mgr.save(2)
        mgr.wait()
        raised = None
    except CheckpointError as e:
        raised = f"{type(e).__name__}: {e}"
    saved.set()
    dist.barrier()  # (rank 0 is past its held request: it is in this save)
    if rank == 0:
        faults.clear()
    dist.barrier()
    steps = mgr.steps()
    _fill(model, -1.0)
    loaded = mgr.load()
    holds = all(torch.equal(p, torch.full_like(p, 2.0)) for p in model.parameters())
    mgr.close()
    return raised, steps, loaded, holds, seen.lines


def _url(bucket: str) -> str:
    return f"s3://{bucket}/run-{uuid.uuid4().hex[:6]}"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_commit_whose_outcome_broadcast_times_out_is_reported_committed(
    proxy: FaultProxy, s3_bucket: Any, async_save: bool
) -> None:
    """Rank 0's PUT of step 2's manifest answers after collective_timeout: rank 1 gives up
    waiting for the outcome, rank 0 commits. Every rank returns step 2 as committed (a WARNING
    says the ranks could not agree on it), lists it and loads it bitwise (it raised on every
    rank, "not committed", while step 2 was the newest committed step)."""
    bucket, _ = s3_bucket
    rule = {
        "method": "PUT",
        "path": r"step-00000002/manifest\.json",
        "fault": "hold",
        "rank": 0,
    }
    out = run_on_ranks(
        _slow_rank0_save,
        2,
        _url(bucket),
        proxy.urls,
        proxy.control_url,
        rule,
        None,
        async_save,
        timeout=240,
    )
    for raised, steps, loaded, holds, _ in out:
        assert raised is None and steps == [1, 2] and loaded == 2 and holds, out
    assert any("step 2 was committed" in line for line in out[1][4]), out[1][4]


def test_a_retention_delete_slower_than_the_collective_timeout_does_not_fail_the_save(
    proxy: FaultProxy, s3_bucket: Any
) -> None:
    """With keep_last=1, rank 0's delete of step 1 answers after collective_timeout: save(2)
    returns on every rank (it raised on rank 1 while step 2 was committed), step 1 is deleted
    and step 2 loads bitwise."""
    bucket, _ = s3_bucket
    rule = {
        "method": "POST",
        "path": r"\?delete",
        "body": "step-00000001",
        "fault": "delay",
        "kind": "DELETE",
        "rank": 0,
    }
    out = run_on_ranks(
        _slow_rank0_save,
        2,
        _url(bucket),
        proxy.urls,
        proxy.control_url,
        rule,
        1,
        False,
        timeout=240,
    )
    for raised, steps, loaded, holds, _ in out:
        assert raised is None and steps == [2] and loaded == 2 and holds, out
