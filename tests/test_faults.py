"""Storage faults never cost the last good step (issue 17, holes 4 and 6): an HTTP proxy
(``tests/_faults.py``) between s3fs and the moto server injects errors, resets, stalls and
damaged bodies in both directions. Whatever it does: no save reports success without a
commit, no committed step fails to load once the faults stop, the newest good step is never
lost, and every failure is a CheckpointError."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from muon_ckpt import CheckpointError, CheckpointManager, CheckpointStorageError
from muon_ckpt.store import Catalog, Storage
from tests._faults import FaultProxy
from tests.conftest import s3_options

TIMEOUT = 0.5  # storage_timeout of the managers behind the proxy
# One save and one load each (25: 50 operations; MUON_CKPT_FAULT_CYCLES for longer runs).
CYCLES = int(os.environ.get("MUON_CKPT_FAULT_CYCLES", "25"))
RATE = 0.05  # probability of a fault per request


def _model(v: float = 0.0) -> nn.Module:
    m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(v)
    return m


@pytest.fixture
def faulty(s3_server: str, s3_bucket: tuple[str, dict]) -> Iterator[dict[str, Any]]:
    """A run URL, the options that reach it through the fault proxy and the direct ones."""
    proxy = FaultProxy(s3_server, seed=17, stall_s=3 * TIMEOUT).start()
    bucket, direct = s3_bucket
    through = {
        **s3_options(proxy.url),
        "config_kwargs": {"retries": {"max_attempts": 2}},  # fewer silent retries: faster
    }
    try:
        yield {
            "url": f"s3://{bucket}/run-{uuid.uuid4().hex[:6]}",
            "proxy": proxy,
            "through": through,
            "direct": direct,
        }
    finally:
        proxy.stop()


def _mgr(f: dict[str, Any], model: nn.Module, *, direct: bool = False, **kw: Any) -> Any:
    opts = f["direct"] if direct else f["through"]
    return CheckpointManager(
        f["url"], model=model, storage_options=opts, storage_timeout=TIMEOUT, **kw
    )


def _loads_whole(f: dict[str, Any], step: int) -> None:
    got = _model(-1.0)
    assert _mgr(f, got, direct=True).load(step=step) == step
    assert all(torch.all(p == float(step)) for p in got.parameters()), step


def test_random_faults_never_cost_the_last_good_step(faulty):
    f, proxy = faulty, faulty["proxy"]
    committed = Catalog(Storage(f["url"], f["direct"])).committed_steps  # no faults there
    model = _model()
    mgr = _mgr(f, model, keep_last=1)
    saved, failed, loaded, load_failed = [], [], 0, 0
    steps: list[int] = []
    for step in range(1, CYCLES + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        good_before = steps
        proxy.rate = RATE
        if step % 5 == 0:  # besides the random faults: a damaged upload the store accepts
            proxy.rule("PUT", r"\.distcp", "corrupt_request", times=1)
        try:
            ok = mgr.save(step)
        except CheckpointError:
            ok = False
        try:
            mgr.load()  # through the faults: a step, or a CheckpointError
            loaded += 1
        except CheckpointError:
            load_failed += 1
        proxy.clear()
        steps = committed()
        if ok:
            saved.append(step)
            assert steps[-1] == step, f"save({step}) returned without a commit: {steps}"
        else:
            failed.append(step)
        if good_before:  # the newest good step is kept (or a newer one is there)
            assert good_before[-1] in steps or steps[-1] > good_before[-1], (good_before, steps)
    print(f"saves: {len(saved)} ok, {len(failed)} failed; loads: {loaded} ok, {load_failed}")
    print(f"faults injected: {proxy.injected}")
    assert saved and failed and loaded, (saved, failed, loaded, proxy.injected)
    # Every committed step loads, whole, once the faults stop.
    for step in committed():
        _loads_whole(f, step)
    assert len(proxy.injected) >= 6, proxy.injected  # most kinds of fault were exercised


def test_a_corrupted_upload_is_never_committed_nor_costs_the_good_step(faulty):
    """The storage accepts damaged or cut data files and answers OK: the read-back before the
    commit catches it, so keep_last=1 never deletes the last good step for an unloadable
    one."""
    f, proxy = faulty, faulty["proxy"]
    model = _model(1.0)
    mgr = _mgr(f, model, keep_last=1)
    mgr.save(1)
    for step, fault in ((2, "corrupt_request"), (3, "truncate_request")):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        proxy.rule("PUT", r"\.distcp", fault)
        with pytest.raises(CheckpointError, match=r"after the upload the storage holds"):
            mgr.save(step)
        proxy.clear()
        assert _mgr(f, _model(), direct=True).steps() == [1]
        _loads_whole(f, 1)
    mgr.save(4)  # and the run goes on
    assert _mgr(f, _model(), direct=True).steps() == [4]


def test_a_failing_retention_delete_is_a_warning(faulty, caplog):
    f, proxy = faulty, faulty["proxy"]
    model = _model(1.0)
    mgr = _mgr(f, model, keep_last=1)
    mgr.save(1)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(2.0)
    proxy.rule("DELETE", r"step-00000001", "500")  # step 1's files, one by one or in bulk
    proxy.rule("POST", r"[?&]delete", "500", body=rb"step-00000001")
    with caplog.at_level(logging.WARNING, logger="muon_ckpt"):
        assert mgr.save(2) is True  # committed: the failed clean-up does not undo that
    assert any("retention after step 2 failed" in r.message for r in caplog.records)
    proxy.clear()
    assert _mgr(f, _model(), direct=True).steps() == [1, 2]
    _loads_whole(f, 2)


def test_a_failed_manifest_write_is_a_storage_error(faulty):
    f, proxy = faulty, faulty["proxy"]
    mgr = _mgr(f, _model(1.0))
    proxy.rule("PUT", r"manifest\.json", "500")
    with pytest.raises(CheckpointStorageError, match=r"writing .*manifest\.json failed"):
        mgr.save(1)
    proxy.clear()
    assert _mgr(f, _model(), direct=True).steps() == []


def test_a_stalled_upload_is_cut_by_the_timeout_and_retried(faulty):
    f, proxy = faulty, faulty["proxy"]
    mgr = _mgr(f, _model(3.0))
    proxy.rule("PUT", r"\.distcp", "stall", times=2)
    t0 = time.monotonic()
    assert mgr.save(3)
    assert TIMEOUT <= time.monotonic() - t0 < 15  # (was unbounded: one save took 104 s)
    assert proxy.injected == {"stall": 2}
    _loads_whole(f, 3)


def test_an_overwrite_cut_short_while_moved_into_place_keeps_the_step_loadable(faulty):
    """On an object store an overwrite is committed beside the step, then moved into place
    (the old version removed, the new files copied, the manifest last). A move that fails
    half way raises, and step 20 is then read from where the new version is committed: a
    restart loads step 20, not the step before it; ``steps()`` and ``ls`` list it; the next
    save finishes the move."""
    f, proxy = faulty, faulty["proxy"]
    model = _model(10.0)
    mgr = _mgr(f, model)
    mgr.save(10)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(20.0)
    mgr.save(20)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(21.0)
    # Every server-side copy into step 20's own directory fails: the move is cut short.
    proxy.rule("PUT", r"/run-[0-9a-f]+/step-00000020/", "503")
    with pytest.raises(CheckpointError, match="is committed, but moving it into place failed"):
        mgr.save(20, overwrite=True)
    proxy.clear()
    assert mgr.steps() == [10, 20]
    restarted = _model(-1.0)
    assert _mgr(f, restarted, direct=True).load() == 20
    assert all(torch.all(p == 21.0) for p in restarted.parameters())  # the new version
    model = _model(-1.0)
    restarted_mgr = _mgr(f, model, direct=True)
    assert restarted_mgr.load() == 20
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(30.0)
    assert restarted_mgr.save(30)  # finishes the move first
    names = Storage(f["url"], f["direct"]).listdir()
    assert not [n for n in names if n.startswith("overwrite-")], names
    _loads_whole(f, 30)
    again = _model(-1.0)
    assert _mgr(f, again, direct=True).load(step=20) == 20
    assert all(torch.all(p == 21.0) for p in again.parameters())
