"""The memory tier obeys the run's rules as the url does: a memory step is a committed step
of the run. A job without the write lease writes nothing to the tier; a rewind's ``close()``
never flushes the loaded state under a later step number; a newer format, in the url or in
the tier, is refused rather than loaded past."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from muon_ckpt import CheckpointLeaseError, CheckpointVersionError
from muon_ckpt.store import MANIFEST, Storage, step_dirname
from tests._ckpt import train
from tests._memtier import _assert_same, _fresh, _load_fresh, _mgr, _run_dir, _state

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tier_steps(tmp_path) -> list[str]:
    return sorted(p.name for p in _run_dir(tmp_path).iterdir() if p.name.startswith("step-"))


def test_a_job_without_the_lease_writes_nothing_to_the_tier(tmp_path):
    """Two real processes: the holder keeps step 3 in the tier and stays alive; a second job
    on the same url and tier resumes step 3, and each of its saves, memory-only or to the
    url, first or not, is refused with the holder named; the holder's steps stay."""
    url, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    ready, done, state = (str(tmp_path / n) for n in ("ready", "done", "state.pt"))
    cmd = [sys.executable, "-m", "tests._lease_job", "hold-memory", url, mem, ready, done, state]
    env = {**os.environ, "PYTHONPATH": _REPO}
    holder = subprocess.Popen(cmd, cwd=_REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(ready):
            assert holder.poll() is None, holder.stderr.read() if holder.stderr else ""
            assert time.monotonic() < deadline, "the holder never saved step 3"
            time.sleep(0.05)
        held = _tier_steps(tmp_path)
        assert held[-1] == "step-00000003"
        for first in (5, 4):  # a memory-only save first, then a save due for both
            model, opt = _fresh(seed=7)
            mgr = _mgr(tmp_path, model, opt, interval=2)
            assert mgr.load() == 3 and mgr.last_load_tier == "memory"
            train(model, opt, 1, seed=first)
            with pytest.raises(CheckpointLeaseError, match=f"pid {holder.pid}"):
                mgr.save(first)
            with pytest.raises(CheckpointLeaseError):
                mgr.save(first + 2)
            mgr.close()
            assert _tier_steps(tmp_path) == held
        assert Storage(url).listdir().count(step_dirname(4)) == 0
    finally:
        open(done, "w").close()
        holder.wait(timeout=60)
    want = torch.load(state)
    step, tier, got = _load_fresh(tmp_path)
    assert (step, tier) == (3, "memory")
    _assert_same(want, got)


def _trained(tmp_path, steps):
    """A run that trains and saves ``steps`` (url: every 5th): its manager, not closed, and
    the state at each step."""
    model, opt = _fresh()
    mgr = _mgr(tmp_path, model, opt)
    mgr.load()
    states = {}
    for s in steps:
        train(model, opt, 1, seed=s)
        mgr.save(s)
        mgr.wait()
        states[s] = _state(model, opt)
    return mgr, states


def test_close_after_a_rewind_never_flushes_the_loaded_state_under_a_later_step(tmp_path):
    mgr, states = _trained(tmp_path, range(1, 8))  # url: 5; memory: 7
    assert mgr.load(step=5) == 5  # a rewind, in the job that saved 7; no step after it
    mgr.close()  # the state is step 5's: step 7 must not be written with it
    assert mgr.steps() == [5]
    shutil.rmtree(tmp_path / "mem")  # what another node reads: the url's bytes
    step, tier, got = _load_fresh(tmp_path)
    assert (step, tier) == (5, "storage")
    _assert_same(states[5], got)


def test_close_still_flushes_the_newest_memory_step_with_its_own_bytes(tmp_path):
    mgr, states = _trained(tmp_path, range(1, 8))
    mgr.close()
    assert mgr.steps() == [5, 7]
    shutil.rmtree(tmp_path / "mem")
    step, tier, got = _load_fresh(tmp_path)
    assert (step, tier) == (7, "storage")
    _assert_same(states[7], got)


def _newer(path) -> None:
    m = json.loads(path.read_text())
    m["format_version"] = 99
    path.write_text(json.dumps(m))


def test_a_newer_format_in_the_url_is_refused_as_without_a_tier(tmp_path):
    mgr, _ = _trained(tmp_path, range(1, 11))  # url: 5, 10; memory: 10
    mgr._memory.mark = None
    mgr.close()
    run = tmp_path / "run"
    shutil.copytree(run / step_dirname(10), run / step_dirname(12))
    m = json.loads((run / step_dirname(12) / MANIFEST).read_text())
    m["step"] = 12
    (run / step_dirname(12) / MANIFEST).write_text(json.dumps(m))
    _newer(run / step_dirname(12) / MANIFEST)  # a newer muon-ckpt moved the run on to 12
    model, opt = _fresh(seed=5)
    before = _state(model, opt)
    mgr = _mgr(tmp_path, model, opt)
    with pytest.raises(CheckpointVersionError, match=r"[Uu]pgrade muon-ckpt"):
        mgr.load()
    _assert_same(before, _state(model, opt))
    assert mgr.load(step=10) == 10  # an older step asked for by name loads, as from the url
    mgr._memory.mark = None
    mgr.close()


def test_a_newer_format_in_the_tier_is_refused(tmp_path):
    mgr, _ = _trained(tmp_path, range(1, 8))  # url: 5; memory: 7
    mgr._memory.mark = None
    mgr.close()
    _newer(_run_dir(tmp_path) / step_dirname(7) / "rank-00000" / MANIFEST)
    model, opt = _fresh(seed=5)
    before = _state(model, opt)
    mgr = _mgr(tmp_path, model, opt)
    with pytest.raises(CheckpointVersionError, match="prune --memory"):
        mgr.load()
    _assert_same(before, _state(model, opt))
    mgr.close()
