"""One rank's storage fault ends the save, not the job: a fault-injecting
proxy (``tests/_faults.py``, one port per rank) between each rank's s3fs and the moto server.

A request fails within ``storage_timeout``, its retries included, so a rank whose storage
fails reaches the save's next agreement point with its error and every rank raises the same
``CheckpointStorageError`` naming that rank, the request and the object, long before
``collective_timeout``; a collective that does time out (a slow rank) is a
``CheckpointCollectiveError`` naming the rank and the timeout on every rank. Either way the
previous step stays the newest, and the same manager saves and loads once the fault is gone
(its process group is made again)."""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from muon_ckpt import (
    CheckpointCollectiveError,
    CheckpointError,
    CheckpointManager,
    CheckpointStorageError,
)
from muon_ckpt.store._retry import ATTEMPTS
from tests._dist import run_on_ranks
from tests._faults import FaultControl, FaultProxy
from tests.conftest import s3_options

STORAGE_TIMEOUT = 3.0  # seconds: one request's budget, its retries included (healthy requests on a loaded host fit it)


def _model(v: float) -> nn.Module:
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    return _fill(m, v)


def _fill(m: nn.Module, v: float) -> nn.Module:
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(v)
    return m


def _holds(m: nn.Module, v: float) -> bool:
    return all(torch.equal(p, torch.full_like(p, v)) for p in m.parameters())


@pytest.fixture
def proxy(s3_server: str) -> Iterator[FaultProxy]:
    p = FaultProxy(s3_server, ranks=2).start()
    try:
        yield p
    finally:
        p.stop()


def _url(bucket: str) -> str:
    return f"s3://{bucket}/run-{uuid.uuid4().hex[:6]}"


def _faulted_save(rank, world, url, urls, control, rule, timeouts):
    """Save step 1; then, with ``rule`` set on the proxy (by rank 0), save step 2 (it must
    fail); then, the fault cleared, save step 3 and load it with the same manager."""
    faults = FaultControl(control)
    storage_timeout, collective_timeout = timeouts
    model = _model(1.0)
    mgr = CheckpointManager(
        url,
        model=model,
        storage_options=s3_options(urls[rank]),
        storage_timeout=storage_timeout,
        collective_timeout=collective_timeout,
    )
    mgr.save(1)
    if rank == 0:
        faults.rule(**rule)
    dist.barrier()
    _fill(model, 2.0)
    t0 = time.monotonic()
    try:
        mgr.save(2)
        raised = None
    except CheckpointError as e:
        raised = (type(e).__name__, str(e))
    took = time.monotonic() - t0
    faults.release()  # a held request answers once a rank is past the save it made fail
    dist.barrier()
    if rank == 0:
        faults.clear()
    dist.barrier()
    kept = mgr.steps()  # the previous step is still the newest
    _fill(model, 3.0)
    saved = mgr.save(3)
    _fill(model, -1.0)
    loaded = mgr.load()
    mgr.close()
    return raised, took, kept, saved, loaded, _holds(model, 3.0)


def _check_recovered(out: list[Any]) -> None:
    for _, _, kept, saved, loaded, holds in out:
        assert kept == [1] and saved and loaded == 3 and holds, (kept, saved, loaded, holds)


def test_a_rank_whose_puts_fail_ends_the_save_on_every_rank_with_its_error(proxy, s3_bucket):
    """Every PUT of rank 1 answers 503 SlowDown: both ranks raise the same
    CheckpointStorageError naming rank 1, the PUT and its object, within a few budgets
    (collective_timeout is 60 s; it was reached, then the manager's group stayed broken and
    every later call raised); step 1 stays the newest; the same manager then saves step 3
    and loads it."""
    bucket, _ = s3_bucket
    rule = {"method": "PUT", "path": ".", "fault": "503", "kind": "PUT", "rank": 1}
    out = run_on_ranks(
        _faulted_save,
        2,
        _url(bucket),
        proxy.urls,
        proxy.control_url,
        rule,
        (STORAGE_TIMEOUT, 20.0),
        timeout=240,
    )
    (kind0, msg0), (kind1, msg1) = out[0][0], out[1][0]
    assert kind0 == kind1 == "CheckpointStorageError" and msg0 == msg1, (msg0, msg1)
    assert re.search(
        r"PUT s3://\S+/data/\S+/__1_\d+\.distcp on rank 1 failed: 503 SlowDown", msg0
    ), msg0
    assert f"storage_timeout={STORAGE_TIMEOUT:g} s" in msg0, msg0
    assert all(took < 20.0 for _, took, *_ in out), [o[1] for o in out]  # not the timeout
    _check_recovered(out)


def test_a_slow_rank_is_named_with_the_timeout_and_the_manager_recovers(proxy, s3_bucket):
    """Rank 1's storage answers late (no error), once rank 0 gave up waiting for it after
    collective_timeout=5: every rank raises the same CheckpointCollectiveError naming rank 1
    and the timeout (rank 0 gave raw gloo text, rank 1 a plain CheckpointError); the same
    manager then saves and loads."""
    bucket, _ = s3_bucket
    rule = {"method": "*", "path": ".", "fault": "hold", "rank": 1}
    out = run_on_ranks(
        _faulted_save,
        2,
        _url(bucket),
        proxy.urls,
        proxy.control_url,
        rule,
        (30.0, 5.0),
        timeout=240,
    )
    (kind0, msg0), (kind1, msg1) = out[0][0], out[1][0]
    assert kind0 == kind1 == CheckpointCollectiveError.__name__ and msg0 == msg1, (msg0, msg1)
    assert "rank(s) [1] of 2 did not reach" in msg0 and "collective_timeout (5 s)" in msg0, msg0
    assert "save(step=2)" in msg0, msg0
    _check_recovered(out)


def test_a_slow_metadata_write_on_rank_0_is_named_as_rank_0(proxy, s3_bucket):
    """Rank 0's PUT of the step's .metadata (DCP's finish) answers after collective_timeout
    (once rank 1 gave up waiting for it): every rank raises the same CheckpointCollectiveError
    naming rank 0 (rank 1, waiting for it, was named, with raw gloo text); the same manager
    then saves and loads."""
    bucket, _ = s3_bucket
    rule = {"method": "PUT", "path": r"\.metadata", "fault": "hold", "rank": 0}
    out = run_on_ranks(
        _faulted_save,
        2,
        _url(bucket),
        proxy.urls,
        proxy.control_url,
        rule,
        (30.0, 3.0),
        timeout=240,
    )
    (kind0, msg0), (kind1, msg1) = out[0][0], out[1][0]
    assert kind0 == kind1 == CheckpointCollectiveError.__name__ and msg0 == msg1, (msg0, msg1)
    assert "rank(s) [0] of 2 did not reach" in msg0 and ".metadata" in msg0, msg0
    assert "gloo" not in msg0.lower(), msg0
    _check_recovered(out)


def _regroups(rank, world, url, urls, control, rounds):
    """``rounds`` times: a save that times out (rank 1's PUTs held until rank 0 gave up), then
    one that commits (the groups made again); this process's open files and OS threads after
    each."""
    faults = FaultControl(control)
    mgr = CheckpointManager(
        url,
        model=_model(1.0),
        storage_options=s3_options(urls[rank]),
        storage_timeout=30.0,
        collective_timeout=2.0,
    )
    counts = []
    for i in range(rounds):
        if rank == 0:
            faults.rule("PUT", ".", "hold", kind="PUT", rank=1)
        dist.barrier()
        with pytest.raises(CheckpointCollectiveError):
            mgr.save(2 * i + 1)
        faults.release()
        dist.barrier()
        if rank == 0:
            faults.clear()
        dist.barrier()
        assert mgr.save(2 * i + 2)
        counts.append((len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))))
    mgr.close()
    return counts


def test_groups_made_again_after_timeouts_do_not_leak(proxy, s3_bucket):
    """Each collective timeout makes the manager's gloo groups again at the next call: the
    old ones are destroyed (each left about 4 sockets and 3 threads per rank behind), so the
    open files and threads of a rank stay flat over repeated timeouts."""
    bucket, _ = s3_bucket
    rounds = 4
    out = run_on_ranks(
        _regroups, 2, _url(bucket), proxy.urls, proxy.control_url, rounds, timeout=240
    )
    for counts in out:
        (fds0, threads0), (fds, threads) = counts[0], counts[-1]
        assert threads <= threads0 + 1 and fds <= fds0 + 2, counts


def _faulted_load(rank, world, url, urls, control, rule, storage_timeout=STORAGE_TIMEOUT):
    """Save step 1; with ``rule`` set on the proxy (by rank 0), load (it must raise, never
    start fresh); the fault cleared, load again with the same manager."""
    faults = FaultControl(control)
    model = _model(1.0)
    mgr = CheckpointManager(
        url,
        model=model,
        storage_options=s3_options(urls[rank]),
        storage_timeout=storage_timeout,
        collective_timeout=10.0,
    )
    mgr.save(1)
    if rank == 0:
        faults.rule(**rule)
    dist.barrier()
    _fill(model, 2.0)
    try:
        raised = ("returned", mgr.load())
    except CheckpointError as e:
        raised = (type(e).__name__, str(e))
    unchanged = _holds(model, 2.0)  # (a load that raises changes nothing)
    dist.barrier()
    if rank == 0:
        faults.clear()
    dist.barrier()
    loaded = mgr.load()
    mgr.close()
    return raised, unchanged, loaded, _holds(model, 1.0)


def test_a_load_whose_listing_fails_on_every_rank_raises_then_recovers(proxy, s3_bucket):
    """Every LIST answers 503 on both ranks: load() raises the same CheckpointStorageError on
    both (never "starting fresh"), within the budget of the listing rather than at
    collective_timeout (10 s: it was reached, and the manager stayed broken); the fault
    cleared, the same manager loads step 1."""
    bucket, _ = s3_bucket
    rule = {"method": "GET", "path": ".", "fault": "503", "kind": "LIST"}
    out = run_on_ranks(
        _faulted_load, 2, _url(bucket), proxy.urls, proxy.control_url, rule, timeout=240
    )
    (kind0, msg0), (kind1, msg1) = out[0][0], out[1][0]
    assert kind0 == kind1 == "CheckpointStorageError" and msg0 == msg1, (msg0, msg1)
    assert "LIST s3://" in msg0 and "503 SlowDown" in msg0, msg0
    for _, unchanged, loaded, holds in out:
        assert unchanged and loaded == 1 and holds


def test_a_load_whose_data_reads_fail_on_one_rank_raises_a_storage_error_on_both(proxy, s3_bucket):
    """Every GET of a data file on rank 1 answers 503: load() raises CheckpointStorageError
    naming rank 1 and the GET on both ranks (it was a plain CheckpointError: the kind of
    rank 1's failure was lost where the ranks agree on their reads); the fault cleared, the
    same manager loads step 1."""
    bucket, _ = s3_bucket
    rule = {"method": "GET", "path": r"\.distcp", "fault": "503", "kind": "GET", "rank": 1}
    out = run_on_ranks(  # (a budget for a loaded host: the 503s end it in any case)
        _faulted_load, 2, _url(bucket), proxy.urls, proxy.control_url, rule, 5.0, timeout=240
    )
    for (kind, msg), unchanged, loaded, holds in out:
        assert kind == "CheckpointStorageError", (kind, msg)
        assert re.search(r"GET s3://\S+\.distcp on rank 1 failed: 503 SlowDown", msg), msg
        assert unchanged and loaded == 1 and holds


def test_retries_are_bounded_by_storage_timeout(proxy, s3_bucket):
    """A PUT that answers 503 SlowDown every time is sent at most ATTEMPTS times, all within
    storage_timeout (it was sent 25 times over 30-50 s, s3fs's retries around botocore's,
    whatever storage_timeout said); the error says how many and in what time."""
    bucket, _ = s3_bucket
    url = _url(bucket)
    mgr = CheckpointManager(
        url,
        model=_model(1.0),
        storage_options=s3_options(proxy.url),
        storage_timeout=STORAGE_TIMEOUT,
    )
    proxy.rule("PUT", r"__0_0\.distcp", "503", kind="PUT")
    with pytest.raises(CheckpointError) as ei:
        mgr.save(1)
    sent = [x for x in proxy.log if x[1] == "PUT" and x[3].endswith("__0_0.distcp")]
    assert 2 <= len(sent) <= ATTEMPTS, (len(sent), str(ei.value))
    assert isinstance(ei.value, CheckpointStorageError), repr(ei.value)
    m = re.search(r"gave up after (\d+) attempt\(s\) in ([0-9.]+) s", str(ei.value))
    assert m and int(m.group(1)) == len(sent), str(ei.value)
    assert "503 SlowDown" in str(ei.value), str(ei.value)  # the answer, also when the last
    # attempt was abandoned at the budget's end. No attempt runs past storage_timeout; what
    # the time shows beyond it is the event loop's lag on a loaded host (it was 30-50 s).
    assert float(m.group(2)) < 5 * STORAGE_TIMEOUT, str(ei.value)
    proxy.clear()
    assert mgr.save(2) and mgr.steps() == [2]


def test_the_probe_survives_one_transient_503(proxy, s3_bucket):
    """The constructor's probe (HEAD of the bucket) is retried within its budget: one 503
    SlowDown no longer kills the job at its start."""
    bucket, _ = s3_bucket
    proxy.rule("HEAD", ".", "503", times=1)
    mgr = CheckpointManager(_url(bucket), model=_model(1.0), storage_options=s3_options(proxy.url))
    assert proxy.injected == {"503": 1}
    probes = [x for x in proxy.log if x[1] == "HEAD" and x[3].strip("/") == bucket]
    assert [x[4] for x in probes] == ["503", None]
    assert mgr.save(1) and mgr.steps() == [1]


def test_the_probe_retries_connection_resets(proxy, s3_bucket):
    """Two connection resets (no answer) on the constructor's probe are retried within its
    budget (the first ended the job at its start, taken for an endpoint that refuses
    connections); an endpoint that refuses them still fails at once (test_storage_errors)."""
    bucket, _ = s3_bucket
    proxy.rule("HEAD", ".", "reset", times=2)
    mgr = CheckpointManager(_url(bucket), model=_model(1.0), storage_options=s3_options(proxy.url))
    probes = [x for x in proxy.log if x[1] == "HEAD" and x[3].strip("/") == bucket]
    assert [x[4] for x in probes] == ["reset", "reset", None], probes
    assert mgr.save(1) and mgr.steps() == [1]
