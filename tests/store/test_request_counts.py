"""A save's storage requests do not grow with the run: the same number of
each kind with 2 and with 50 steps kept, locally (opens and listings under the root) and on
S3 (moto behind a counting proxy: LIST, HEAD, GET, PUT, COPY, multipart, DELETE).

The long run is made by ``synthetic_steps`` (copies of step 1's manifest and metadata, each
naming a data directory of its own); a new manager loads it, saves once (that save reads the
run once: the catalog remembers the manifests, ``store._memo``) and the next save is counted.
The counts are pinned as upper bounds too, so a change that adds requests to every save is
seen here (raise them only with a reason)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from muon_ckpt import CheckpointManager
from tests._ckpt import TinyNet, make_muon, train
from tests._faults import FaultProxy
from tests.store._requests import LocalCounter, ProxyCounter, synthetic_steps

_LOCAL = LocalCounter()

# The most requests of each kind one save may make, whatever the run's length (1 rank). One
# open and one PUT more than before the run's index (``store._run_index``): what spares a load
# reading every manifest.
LOCAL_MAX = {"listdir": 9, "open": 17}
S3_MAX = {"LIST": 13, "HEAD": 3, "GET": 8, "PUT": 8, "COPY": 1, "multipart": 0, "DELETE": 1}


def _counts(url: str, opts: dict[str, Any], counter: Any, steps: int) -> dict[str, int]:
    """The requests of a save into a run of ``steps`` committed steps, after one save."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = make_muon(model)
    train(model, opt, 1)
    with CheckpointManager(url, model=model, optimizer=opt, storage_options=opts) as m:
        m.save(1)
    synthetic_steps(url, opts, steps)
    with CheckpointManager(url, model=model, optimizer=opt, storage_options=opts) as m:
        assert m.load() == steps
        train(model, opt, 1)
        m.save(steps + 1)
        train(model, opt, 1)
        counter.clear()
        m.save(steps + 2)
        got = counter.read()
        assert m.steps()[-1] == steps + 2
    return got


def test_local_save_requests_flat(tmp_path: Any) -> None:
    counts = {}
    for n in (2, 50):
        root = str(tmp_path / f"run{n}")
        _LOCAL.root = root
        try:
            counts[n] = _counts(root, {}, _LOCAL, n)
        finally:
            _LOCAL.root = None
    assert counts[2] == counts[50], counts
    for kind, most in LOCAL_MAX.items():
        assert counts[50].get(kind, 0) <= most, (kind, counts)


@pytest.mark.timeout(600)
def test_s3_save_requests_flat(s3_server: str, s3_bucket: tuple[str, dict]) -> None:
    bucket, opts = s3_bucket
    proxy = FaultProxy(s3_server).start()
    try:
        opts = {**opts, "endpoint_url": proxy.url}
        counts = {
            n: _counts(f"s3://{bucket}/run{n}", opts, ProxyCounter(proxy.control_url), n)
            for n in (2, 50)
        }
    finally:
        proxy.stop()
    assert counts[2] == counts[50], counts
    for kind, most in S3_MAX.items():
        assert counts[50].get(kind, 0) <= most, (kind, counts)


def test_async_save_makes_no_request_and_rechecks_in_its_job(tmp_path: Any) -> None:
    """With async_save, save() after the first makes no storage request (admitted from what
    the catalog knows); the lease and listing come in the job, before anything is written: a
    lease another job took meanwhile fails that save at wait(), and nothing is committed."""
    import json
    import threading
    import time

    from muon_ckpt import CheckpointLeaseError

    root = str(tmp_path / "run")
    torch.manual_seed(0)
    model = TinyNet()
    opt = make_muon(model)
    train(model, opt, 1)
    with CheckpointManager(root, model=model, optimizer=opt, async_save=True) as m:
        m.save(1)
        m.wait()
        train(model, opt, 1)
        _LOCAL.root = root
        _LOCAL.clear()
        _LOCAL.thread = threading.get_ident()  # (the job's thread may start meanwhile)
        try:
            m.save(2)
            blocked = _LOCAL.read()
            _LOCAL.clear()
            _LOCAL.thread = None
            m.wait()
            assert blocked == {}, blocked
            assert _LOCAL.read().get("listdir", 0) > 0  # (the job listed the run)
        finally:
            _LOCAL.root = _LOCAL.thread = None
            _LOCAL.clear()
        now = time.time()
        other = {"owner": "another-job", "host": "elsewhere", "pid": 1, "purpose": "save"}
        with open(tmp_path / "run" / "lease.json", "w") as f:
            json.dump({**other, "heartbeat": now, "expires": now + 600}, f)
        train(model, opt, 1)
        assert m.save(3)  # (admitted: nothing asked of the storage)
        with pytest.raises(CheckpointLeaseError, match="another-job"):
            m.wait()
        assert m.steps() == [1, 2]
        (tmp_path / "run" / "lease.json").unlink()


def test_a_memory_save_makes_no_request_and_rechecks_in_its_job(tmp_path: Any) -> None:
    """A save to the memory tier alone, once the lease is this job's, makes no storage
    request in save() (admitted from what the catalog knows); the lease and listing come in
    its job, before its part is written: a lease another job took meanwhile keeps the step
    out of the tier (a WARNING), and nothing is written to the url."""
    import json
    import threading
    import time

    from muon_ckpt import CheckpointLeaseError
    from tests._memtier import _fresh, _mgr, _run_dir

    root = str(tmp_path / "run")
    model, opt = _fresh()
    with _mgr(tmp_path, model, opt) as m:
        assert m.load() is None
        train(model, opt, 1)
        m.save(5)  # (to the url and the tier: the lease taken, the run listed)
        m.wait()
        train(model, opt, 1)
        gate = m._saves.gate = threading.Event()  # (the memory job starts once it is set)
        _LOCAL.root = root
        _LOCAL.clear()
        try:
            m.save(6)
            blocked = _LOCAL.read()
            _LOCAL.clear()
            gate.set()
            m.wait()
            assert blocked == {}, blocked
            assert _LOCAL.read().get("listdir", 0) > 0  # (the job listed the run)
        finally:
            _LOCAL.root = None
            _LOCAL.clear()
            m._saves.gate = None
            gate.set()
        tier = _run_dir(tmp_path)
        assert (tier / "step-00000006").exists()
        now = time.time()
        other = {"owner": "another-job", "host": "elsewhere", "pid": 1, "purpose": "save"}
        with open(tmp_path / "run" / "lease.json", "w") as f:
            json.dump({**other, "heartbeat": now, "expires": now + 600}, f)
        train(model, opt, 1)
        assert m.save(7)  # (admitted: nothing asked of the storage)
        m.wait()
        assert not (tier / "step-00000007").exists()
        assert m.steps() == [5]
        train(model, opt, 1)
        with pytest.raises(CheckpointLeaseError, match="another-job"):
            m.save(10)  # (to the url: admitted before its snapshot, refused)
        (tmp_path / "run" / "lease.json").unlink()
