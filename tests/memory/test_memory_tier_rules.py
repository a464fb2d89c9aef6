"""The memory tier obeys the run's rules as the url does: a memory step is a committed step
of the run. A job without the write lease writes nothing to the tier; a rewind's ``close()``
never flushes the loaded state under a later step number; a newer format, in the url or in
the tier, is refused rather than loaded past."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from muon_ckpt import CheckpointLeaseError, CheckpointVersionError
from muon_ckpt.store import MANIFEST, Storage, step_dirname
from tests import REPO
from tests._ckpt import train
from tests._memtier import _assert_same, _fresh, _load_fresh, _mgr, _run_dir, _state


def _tier_steps(tmp_path) -> list[str]:
    return sorted(p.name for p in _run_dir(tmp_path).iterdir() if p.name.startswith("step-"))


def test_a_job_without_the_lease_writes_nothing_to_the_tier(tmp_path):
    """Two real processes: the holder keeps step 3 in the tier and stays alive; a second job
    on the same url and tier resumes step 3, and each of its saves, memory-only or to the
    url, first or not, is refused with the holder named; the holder's steps stay."""
    url, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    ready, done, state = (str(tmp_path / n) for n in ("ready", "done", "state.pt"))
    cmd = [sys.executable, "-m", "tests._lease_job", "hold-memory", url, mem, ready, done, state]
    env = {**os.environ, "PYTHONPATH": REPO}
    holder = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
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


def test_a_load_from_memory_retires_a_newer_corrupt_url_step_as_a_url_load_does(tmp_path):
    """url: 5; memory: 7; then a CORRUPT url step 8 (its manifest unreadable). A load takes
    memory step 7 and, as a load of url step 5 would, passes over step 8: the next save of
    step 8 takes its number (it is not refused as "already present but CORRUPT")."""
    mgr, _ = _trained(tmp_path, range(1, 8))
    mgr._saves.memory.mark = None
    mgr.close()
    bad = tmp_path / "run" / step_dirname(8)
    bad.mkdir()
    (bad / MANIFEST).write_text("{ not a manifest")
    model, opt = _fresh(seed=5)
    mgr = _mgr(tmp_path, model, opt)
    assert mgr.load() == 7 and mgr.last_load_tier == "memory"
    train(model, opt, 1, seed=8)
    assert mgr.save(8, force=True)
    mgr.wait()
    want = _state(model, opt)
    mgr._saves.memory.mark = None
    mgr.close()
    assert mgr.steps() == [5, 8]
    shutil.rmtree(tmp_path / "mem")  # the url alone
    step, tier, got = _load_fresh(tmp_path)
    assert (step, tier) == (8, "storage")
    _assert_same(want, got)


def _newer(path) -> None:
    m = json.loads(path.read_text())
    m["format_version"] = 99
    path.write_text(json.dumps(m))


def test_a_newer_format_in_the_url_is_refused_as_without_a_tier(tmp_path):
    mgr, _ = _trained(tmp_path, range(1, 11))  # url: 5, 10; memory: 10
    mgr._saves.memory.mark = None
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
    mgr._saves.memory.mark = None
    mgr.close()


def test_a_newer_format_in_the_tier_is_refused(tmp_path):
    mgr, _ = _trained(tmp_path, range(1, 8))  # url: 5; memory: 7
    mgr._saves.memory.mark = None
    mgr.close()
    _newer(_run_dir(tmp_path) / step_dirname(7) / "rank-00000" / MANIFEST)
    model, opt = _fresh(seed=5)
    before = _state(model, opt)
    mgr = _mgr(tmp_path, model, opt)
    with pytest.raises(CheckpointVersionError, match="prune --memory"):
        mgr.load()
    _assert_same(before, _state(model, opt))
    mgr.close()


def _digest(sd) -> str:
    h = hashlib.sha256()
    for k in sorted(sd):
        v = sd[k]
        h.update(k.encode())
        h.update(
            v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            if torch.is_tensor(v)
            else repr(v).encode()
        )
    return h.hexdigest()


class _Writer:
    """The job under test, and what the run must look like to a reader after each action:
    ``live`` are the steps no later commit retired (the newest is what a restart resumes),
    ``digest_at`` the bytes of the newest save of each step."""

    def __init__(self, tmp_path, rng):
        self.tmp_path, self.rng = tmp_path, rng
        self.model, self.opt = _fresh()
        self.mgr = _mgr(tmp_path, self.model, self.opt, interval=3)
        self.mgr.load()
        self.cur, self.live, self.digest_at, self.rewound = 0, [], {}, None
        for _ in range(3):  # the url commits step 3: the tier's steps have a line to join
            self.step()

    def step(self):
        s = self.cur + 1
        train(self.model, self.opt, 1, seed=1000 * s + self.rng.randrange(1000))
        assert self.mgr.save(s)
        self.mgr.wait()
        if self.rewound is not None:  # this commit retires the newer steps of both tiers
            self.live = [x for x in self.live if x <= self.rewound]
            self.rewound = None
        self.live = [x for x in self.live if x != s] + [s]
        self.digest_at[s] = _digest(_state(self.model, self.opt))
        self.cur = s

    def rewind(self):
        k = self.rng.choice([x for x in self.live if x % 3 == 0])
        assert self.mgr.load(step=k) == k
        self.cur, self.rewound = k, k
        assert _digest(_state(self.model, self.opt)) == self.digest_at[k]

    def restart(self, flush):
        if not flush:  # as a job killed after its last save: nothing more is written
            self.mgr._saves.memory.mark = None
        self.mgr.close()
        self.model, self.opt = _fresh(seed=self.rng.randrange(100))
        self.mgr = _mgr(self.tmp_path, self.model, self.opt, interval=3)
        self.cur, self.rewound = self.mgr.load(), None
        assert self.cur == self.live[-1]
        assert _digest(_state(self.model, self.opt)) == self.digest_at[self.cur]


@pytest.mark.parametrize("seed", range(8))
def test_random_interleavings_resume_the_bytes_trained_to_each_step(tmp_path, seed):
    """Saves to the tier and the url, loads, rewinds, restarts with and without close()'s
    flush, in a random order; after each, a reader on the node resumes the newest live step
    of the run with exactly the bytes trained to it, and so does the job itself."""
    rng = random.Random(seed)
    w = _Writer(tmp_path, rng)
    for _ in range(30):
        act = rng.choices(["step", "rewind", "load", "restart", "crash"], [6, 2, 1, 1, 1])[0]
        if act == "step":
            w.step()
        elif act == "rewind":
            w.rewind()
        elif act == "load":
            w.cur, w.rewound = w.mgr.load(), None
            assert w.cur == w.live[-1]
        else:
            w.restart(flush=act == "restart")
        step, _, got = _load_fresh(tmp_path, seed=rng.randrange(100), interval=3)
        assert step == w.live[-1], (act, w.live)
        assert _digest(got) == w.digest_at[step], (act, step)
    w.mgr.close()


def _resources(tmp_path) -> tuple[int, int, int, int]:
    files = sum(len(f) for _, _, f in os.walk(tmp_path / "mem"))
    with open("/proc/self/maps") as m:
        maps = sum(1 for _ in m)
    return threading.active_count(), len(os.listdir("/proc/self/fd")), maps, files


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
def test_200_save_and_restore_cycles_leak_no_files_mappings_or_threads(tmp_path):
    model, opt = _fresh()
    mgr = _mgr(tmp_path, model, opt, interval=50)
    mgr.load()
    seen = []
    for s in range(1, 201):
        train(model, opt, 1, seed=s)
        assert mgr.save(s, force=s == 1)  # (the url's step 1: the tier's steps join its line)
        mgr.wait()
        assert mgr.load() == s and mgr.last_load_tier == "memory"
        if s in (20, 200):
            seen.append(_resources(tmp_path))
    mgr.close()
    (threads0, fds0, maps0, files0), (threads1, fds1, maps1, files1) = seen
    assert threads1 <= threads0 and fds1 <= fds0 and files1 == files0, seen
    assert maps1 <= maps0 + 16, seen  # (the allocator may map a few more arenas)
