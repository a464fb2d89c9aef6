"""A run's first line in the memory tier: the memory steps a line saves before its first commit
to the url are restored after a crash, because the url holds the line's record (one object,
written at the line's first memory save); a url emptied since holds none, a rewind's line gets
its own, and another run's line is never restored in its place. Real processes killed with
SIGKILL, on a local directory and S3 (moto); memory:// (one process) with a close that
flushes nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from muon_ckpt import CheckpointManager
from muon_ckpt.store import Storage
from tests import REPO
from tests._ckpt import train
from tests._memtier import _assert_same, _fresh, _memory, _run_dir, _state


@pytest.fixture(params=["local", "s3"])
def run_url(request, tmp_path):
    """``(url, storage_options)`` of an empty run root, on a local directory or S3."""
    if request.param == "local":
        return str(tmp_path / "run"), {}
    bucket, opts = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/run", opts


def _job(mode, url, opts, tmp_path, steps=6, first=False):
    """The job of ``tests/memory/_line_job.py`` in ``mode``, killed after its last memory
    save; the state of its last step."""
    env = {**os.environ, "PYTHONPATH": REPO, "STEPS": str(steps), "FIRST": "1" if first else ""}
    state = str(tmp_path / f"{mode}.pt")
    args = [mode, url, json.dumps(opts), str(tmp_path / "mem"), state]
    r = subprocess.run(
        [sys.executable, "-m", "tests.memory._line_job", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == -signal.SIGKILL and "saved" in r.stdout, (r.returncode, r.stderr)
    assert "restorable only once" not in r.stderr, r.stderr  # (the old caveat's WARNING)
    return torch.load(state)


def _restart(url, opts, tmp_path):
    """A restart's load on this node: (step, tier, state)."""
    model, opt = _fresh(seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    mgr = CheckpointManager(
        url,
        model=model,
        optimizer=opt,
        interval=100,
        memory=_memory(tmp_path),
        storage_options=opts,
    )
    step = mgr.load()
    tier = mgr.last_load_tier
    mgr.close()
    return step, tier, _state(model, opt)


def _root(url, opts):
    """The names in the run's root."""
    return sorted(Storage(url, opts).list_dirs())


def _empty(url, opts):
    """The user deletes the run's folder (prefix)."""
    if "://" not in url:
        shutil.rmtree(url)
    else:
        Storage(url, opts).fs.rm(url, recursive=True)


def test_memory_steps_before_the_urls_first_commit_are_restored_after_a_crash(run_url, tmp_path):
    """Memory steps 1 and 2 of a fresh run, killed before the url's first commit: the url
    holds one record of the line (one write for both steps) and no step, and the restart
    resumes step 2 from memory, bitwise."""
    url, opts = run_url
    want = _job("fresh", url, opts, tmp_path, steps=2)
    (record,) = [n for n in _root(url, opts) if n.startswith("line-")]
    assert not [n for n in _root(url, opts) if n.startswith("step-")]
    step, tier, got = _restart(url, opts, tmp_path)
    assert (step, tier) == (2, "memory")
    _assert_same(want, got)
    assert record in _root(url, opts)  # (a load writes nothing)


def test_a_first_save_to_the_url_that_the_tier_also_keeps_records_its_line(tmp_path):
    """Step 0 saved to the url and the tier, then memory steps 1 and 2: the line is recorded
    by step 0's save (should its write to the url not commit, the tier's copy is restorable)
    and not again; the restart resumes step 2 from memory, bitwise."""
    url, opts = str(tmp_path / "run"), {}
    want = _job("fresh", url, opts, tmp_path, steps=2, first=True)
    names = _root(url, opts)
    (record,) = [n for n in names if n.startswith("line-")]
    assert names == sorted(["data", "index.json", "lease.json", record, "step-00000000"])
    assert json.loads((tmp_path / "run" / record).read_bytes())["step"] == 0
    step, tier, got = _restart(url, opts, tmp_path)
    assert (step, tier) == (2, "memory")
    _assert_same(want, got)


def test_after_the_url_was_emptied_its_memory_steps_are_not_restored(run_url, tmp_path):
    """The same crash, then the run's folder (prefix) deleted: its record went with it, and
    the restart starts afresh though the tier still holds steps 1 and 2."""
    url, opts = run_url
    _job("fresh", url, opts, tmp_path, steps=2)
    _empty(url, opts)
    held = sorted(p.name for p in _run_dir(tmp_path).iterdir() if p.name.startswith("step-"))
    assert held == ["step-00000001", "step-00000002"]
    assert _restart(url, opts, tmp_path)[:2] == (None, None)


def test_a_rewinds_memory_steps_restore_and_the_abandoned_lines_do_not(tmp_path):
    """Steps 1-6 in memory, killed; a restart resumes 6, rewinds to 2 and saves 3 and 4 of a
    new line (its own record), killed. The tier also still holds the abandoned line's steps 5
    and 6 (put back as a kill before retention leaves them): the restart resumes the new
    line's step 4, bitwise, never step 6."""
    url, opts = str(tmp_path / "run"), {}
    _job("fresh", url, opts, tmp_path)
    aside = tmp_path / "aside"
    for s in (5, 6):
        shutil.copytree(_run_dir(tmp_path) / f"step-{s:08d}", aside / f"step-{s:08d}")
    want = _job("rewind", url, opts, tmp_path)
    assert len([n for n in _root(url, opts) if n.startswith("line-")]) == 2
    for s in (5, 6):
        assert not (_run_dir(tmp_path) / f"step-{s:08d}").exists()  # (retention dropped it)
        shutil.copytree(aside / f"step-{s:08d}", _run_dir(tmp_path) / f"step-{s:08d}")
    step, tier, got = _restart(url, opts, tmp_path)
    assert (step, tier) == (4, "memory")
    _assert_same(want, got)


def test_a_new_run_in_the_url_never_restores_the_previous_runs_tier(tmp_path):
    """Run A keeps steps 1-6 in memory and is killed; run B starts in the same url with
    new_run=True, keeps step 1 and is killed before its tier's retention dropped A's steps
    (put back). The restart resumes B's step 1, bitwise: B's line was recorded after A's."""
    url, opts = str(tmp_path / "run"), {}
    _job("fresh", url, opts, tmp_path)
    shutil.copytree(_run_dir(tmp_path), tmp_path / "aside")
    want = _job("new-run", url, opts, tmp_path)
    for p in (tmp_path / "aside").iterdir():
        if p.name.startswith("step-") and not (_run_dir(tmp_path) / p.name).exists():
            shutil.copytree(p, _run_dir(tmp_path) / p.name)
    assert (_run_dir(tmp_path) / "step-00000006").is_dir()
    step, tier, got = _restart(url, opts, tmp_path)
    assert (step, tier) == (1, "memory")
    _assert_same(want, got)


def test_on_memory_storage_a_close_without_flush_keeps_the_first_lines_steps(tmp_path):
    """memory:// lives in one process: a close that flushes nothing stands for the crash.
    The restart resumes step 2 from memory, bitwise; once the url is emptied, nothing."""
    import uuid

    url = f"memory:///muon-ckpt-test-{uuid.uuid4().hex[:12]}/run"
    model, opt = _fresh()
    mgr = CheckpointManager(
        url, model=model, optimizer=opt, interval=100, memory=_memory(tmp_path, flush=False)
    )
    assert mgr.load() is None
    for s in (1, 2):
        train(model, opt, 1, seed=s)
        assert mgr.save(s)
        mgr.wait()
    want = _state(model, opt)
    mgr.close()
    names = _root(url, {})
    assert [n for n in names if n.startswith("line-")] and not [n for n in names if "step" in n]
    step, tier, got = _restart(url, {}, tmp_path)
    assert (step, tier) == (2, "memory")
    _assert_same(want, got)
    _empty(url, {})
    assert _restart(url, {}, tmp_path)[:2] == (None, None)
