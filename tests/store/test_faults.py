"""Storage faults never cost the last good step: an HTTP proxy
(``tests/_faults.py``) between s3fs and the moto server injects errors, resets, stalls and
damaged bodies in both directions. Whatever it does: no save reports success without a
commit, no committed step fails to load once the faults stop, the newest good step is never
lost, and every failure is a CheckpointError."""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from muon_ckpt import CheckpointError, CheckpointManager, CheckpointStorageError
from muon_ckpt.cli import main
from muon_ckpt.store import Catalog, Storage, resolve, verify
from tests._ckpt import flip_byte
from tests._faults import FaultProxy
from tests.conftest import s3_options

TIMEOUT = 1.5  # storage_timeout of the managers behind the proxy (retries included)
DIRECT_TIMEOUT = 60.0  # and of those that reach moto directly, to set up and check
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
    # A direct manager meets no fault: the small budget is for the proxied ones, and on a
    # loaded host a healthy connection to moto outlasted it.
    opts, budget = (f["direct"], DIRECT_TIMEOUT) if direct else (f["through"], TIMEOUT)
    return CheckpointManager(
        f["url"], model=model, storage_options=opts, storage_timeout=budget, **kw
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
    """Two uploads stall for good (one save once took 104 s): only the storage timeout can
    end them, so a save that commits was cut by it, and retried."""
    f, proxy = faulty, faulty["proxy"]
    mgr = _mgr(f, _model(3.0), io_threads=1)  # (one file at a time: the stalls in a row)
    proxy.stall_s = None  # a stall never answers: no end of its own for a client to wait for
    proxy.rule("PUT", r"\.distcp", "stall", times=2)
    t0 = time.monotonic()
    assert mgr.save(3)
    # Each stalled attempt is cut at a third of the budget (_retry), then tried again.
    assert time.monotonic() - t0 >= 2 * TIMEOUT / 3
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


# ---------------------------------------------------------------------- a fallback is no rewind
def _fill(model: nn.Module, v: float) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(v)
    return model


def _data_paths(st: Storage, step: int) -> list[str]:
    """The keys (from the run's root) of the data files step ``step``'s save wrote."""
    m = Catalog(st).manifest(step)
    return [n.removeprefix("../") for n in m.files if n.startswith(f"../data/{m.data}/")]


def _cli_opts(opts: dict[str, Any]) -> list[str]:
    return [f"--storage-option={k}={json.dumps(v)}" for k, v in opts.items()]


def test_a_read_fault_on_the_newest_step_is_read_again_not_taken_for_damage(faulty):
    """Each of step 2's data files answers its first GET with a flipped byte: the load reads
    it once more and resumes step 2, and the next save keeps it. (It fell back to step 1, and
    the next save took the fallback for a rewind and deleted step 2, intact on the store.)"""
    f, proxy = faulty, faulty["proxy"]
    st = Storage(f["url"], f["direct"])
    model = _model(1.0)
    with _mgr(f, model, direct=True) as mgr:
        mgr.save(1)
        _fill(model, 2.0)
        mgr.save(2)
    keys = _data_paths(st, 2)
    for key in keys:
        proxy.rule("GET", re.escape(key), "corrupt_unchecked_response", times=1)
    got = _model(-1.0)
    mgr = _mgr(f, got)
    assert mgr.load() == 2
    assert all(torch.all(p == 2.0) for p in got.parameters())
    _fill(got, 3.0)
    mgr.save(3)
    mgr.close()
    assert proxy.injected == {"corrupt_unchecked_response": len(keys)}
    assert Catalog(st).committed_steps() == [1, 2, 3]
    assert verify(resolve(st, 2)).ok
    _loads_whole(f, 2)


def test_a_step_passed_over_for_read_faults_is_retired_but_kept(faulty, capsys, tmp_path):
    """Every GET of step 2's data files answers with a flipped byte (a path that damages
    what it carries), while the store holds them intact: the load reads them twice, passes
    over step 2 and resumes step 1; the save after it retires step 2 from the line (a restart
    resumes step 3) but deletes none of its files; ``ls`` says it was passed over and why,
    and ``verify`` that it is intact (``export --step 2`` reads it)."""
    f, proxy = faulty, faulty["proxy"]
    st = Storage(f["url"], f["direct"])
    model = _model(1.0)
    with _mgr(f, model, direct=True) as mgr:
        mgr.save(1)
        _fill(model, 2.0)
        mgr.save(2)
    files = Storage(f["url"], f["direct"]).walk_files()
    for key in _data_paths(st, 2):
        proxy.rule("GET", re.escape(key), "corrupt_unchecked_response")
    got = _model(-1.0)
    mgr = _mgr(f, got)
    assert mgr.load() == 1
    _fill(got, 3.0)
    mgr.save(3)
    mgr.close()
    proxy.clear()
    assert Catalog(st).committed_steps() == [1, 3]
    now = st.walk_files()
    kept = {k: v for k, v in files.items() if k not in ("lease.json", "index.json")}
    assert kept.items() <= now.items()
    (two,) = [i for i in Catalog(st).scan() if i.step == 2]
    assert two.status == "superseded" and "crc32c" in (two.passed_over or ""), two
    assert verify(resolve(st, 2)).ok
    assert main(["ls", f["url"], *_cli_opts(f["direct"])]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s+2\s+PASSED-OVER\s", out, re.M), out
    assert "step 2: passed over: passed over by a load that could not read it (" in out, out
    assert main(["verify", f["url"], *_cli_opts(f["direct"])]) == 0
    out = capsys.readouterr().out
    assert "step 2: OK, intact on the storage (the load met a read fault)" in out, out
    out = str(tmp_path / "two.safetensors")  # what it holds is still there to take
    assert main(["export", f["url"], out, "--step", "2", *_cli_opts(f["direct"])]) == 0
    assert _mgr(f, _model(-1.0), direct=True).load() == 3  # lines never mix


def test_a_really_damaged_step_passed_over_goes_with_retention(tmp_path, capsys):
    """Step 2's data damaged on the storage (a flipped byte): the load passes over it and
    resumes step 1; the save after keeps it (``verify`` fails it: damaged); retention
    (keep_last=2) deletes it with the steps of its age, and step 1 with it, once steps 3 and
    4 are kept; every step kept loads."""
    url = str(tmp_path / "run")
    st = Storage(url)
    model = _model(1.0)
    with CheckpointManager(url, model=model) as mgr:
        mgr.save(1)
        _fill(model, 2.0)
        mgr.save(2)
    key = _data_paths(st, 2)[0]
    flip_byte(st.path(key), st.size(key) // 2)
    got = _model(-1.0)
    mgr = CheckpointManager(url, model=got, keep_last=2)
    assert mgr.load() == 1
    mgr.save(3)
    assert Catalog(st).committed_steps() == [1, 3] and st.exists(key)
    assert main(["verify", url]) == 1
    assert "step 2: FAILED (1 problem(s)), damaged on the storage" in capsys.readouterr().out
    mgr.save(4)
    mgr.close()
    assert Catalog(st).committed_steps() == [3, 4]
    assert [i.step for i in Catalog(st).scan()] == [3, 4] and not st.exists(key)
    for step in (3, 4):
        fresh = _model(-1.0)
        assert CheckpointManager(url, model=fresh).load(step=step) == step
        assert all(torch.all(p == 1.0) for p in fresh.parameters())


def test_retention_keeps_the_loaded_step_while_commits_are_not_read_back(faulty):
    """With ``confirm="size"`` no commit is read back: the store accepts step 2's data damaged
    (same size) and step 2 commits unloadable. Retention (keep_last=1) still keeps step 1,
    the newest step known to verify (this manager loaded it, checking every byte), so a
    restart falls back to it; before, it was deleted and no step loaded."""
    f, proxy = faulty, faulty["proxy"]
    with _mgr(f, _model(1.0), direct=True) as mgr:
        mgr.save(1)
    got = _model(-1.0)
    mgr = _mgr(f, got, keep_last=1, confirm="size")
    assert mgr.load() == 1
    _fill(got, 2.0)
    proxy.rule("PUT", r"\.distcp", "corrupt_request")
    assert mgr.save(2)
    proxy.clear()
    mgr.close()
    assert _mgr(f, _model(), direct=True).steps() == [1, 2]
    _loads_whole(f, 1)
    assert _mgr(f, _model(-1.0), direct=True).load() == 1


def test_a_save_of_a_passed_over_steps_number_takes_its_place(tmp_path, caplog):
    """The loop resumes step 1 after passing over step 2 and saves step 2 again: the new step
    2 takes the place of the one passed over (WARNING) and loads."""
    url = str(tmp_path / "run")
    st = Storage(url)
    model = _model(1.0)
    with CheckpointManager(url, model=model) as mgr:
        mgr.save(1)
        _fill(model, 2.0)
        mgr.save(2)
    key = _data_paths(st, 2)[0]
    flip_byte(st.path(key), st.size(key) // 2)
    got = _model(-1.0)
    with CheckpointManager(url, model=got) as mgr:
        assert mgr.load() == 1
        _fill(got, 5.0)
        with caplog.at_level(logging.WARNING, logger="muon_ckpt"):
            assert mgr.save(2)
    assert "which takes its place" in caplog.text
    assert Catalog(st).committed_steps() == [1, 2] and not st.exists(key)
    fresh = _model(-1.0)
    assert CheckpointManager(url, model=fresh).load() == 2
    assert all(torch.all(p == 5.0) for p in fresh.parameters())


def test_a_slow_but_live_link_reads_an_object_larger_than_the_budget(faulty):
    """Every data GET's body arrives at 64 KiB per 0.05 s (about 1.3 MiB/s, never idle): a
    4 MiB file takes over 3 s to arrive with storage_timeout=1.5, and loads, each GET once (it
    was cut at the budget on every attempt, so that step could never be loaded on that link):
    a GET whose body keeps arriving is bounded by its read timeout, not by the budget."""
    f, proxy = faulty, faulty["proxy"]
    model = nn.Linear(1024, 1024)  # 4 MiB of weights
    with torch.no_grad():
        model.weight.fill_(2.0)
        model.bias.fill_(2.0)
    mgr = _mgr(f, model)
    assert mgr.save(2)
    proxy.rule("GET", r"\.distcp", "slow", kind="GET")
    with torch.no_grad():
        model.weight.fill_(-1.0)
        model.bias.fill_(-1.0)
    assert mgr.load() == 2
    assert all(torch.all(p == 2.0) for p in model.parameters())
    slow = [x for x in proxy.log if x[4] == "slow"]
    assert slow and len({x[3] for x in slow}) == len(slow), slow  # (no GET sent twice)
