"""A run's first line in the memory tier: the url vouches for a tier step only once it holds
a commit of the step's line (or the commit it was saved after), so memory steps saved before
the url's first commit are never restored. The first such save says so with a WARNING, and
one save to the url at the start (the documented fallback) makes every later memory step
restorable after a crash."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from tests import REPO
from tests._memtier import _assert_same, _load_fresh

# A job on one node: every step to the tier, the url every 100 steps; it saves steps 1 and 2
# (memory only), keeps step 2's state, and dies without closing (os._exit).
_JOB = r"""
import logging, os, sys, torch
from tests._ckpt import train
from tests._memtier import _fresh, _mgr, _state
from pathlib import Path
logging.basicConfig(level=logging.WARNING)
tmp, first = Path(sys.argv[1]), sys.argv[2] == "1"
model, opt = _fresh()
mgr = _mgr(tmp, model, opt, interval=100)
mgr.load()
if first:
    mgr.save(0, force=True)
for s in (1, 2):
    train(model, opt, 1, seed=s)
    mgr.save(s)
    mgr.wait()
torch.save(_state(model, opt), str(tmp / "state.pt"))
os._exit(0)
"""

_SAYS = "restorable only once the url holds a commit of this run"


def _crash(tmp_path, first):
    env = {**os.environ, "PYTHONPATH": REPO}
    cmd = [sys.executable, "-c", _JOB, str(tmp_path), "1" if first else "0"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_memory_steps_before_the_urls_first_commit_warn_and_are_not_restored(tmp_path):
    """Memory-only saves of a run whose url holds no commit: the first one warns (once), and
    after a crash the restart finds nothing to resume (the url cannot vouch for the line)."""
    err = _crash(tmp_path, first=False)
    assert err.count(_SAYS) == 1, err
    assert "memory step 1 " in err, err
    step, tier, _ = _load_fresh(tmp_path, interval=100)
    assert step is None and tier is None


def test_one_save_to_the_url_at_the_start_makes_memory_steps_restorable(tmp_path):
    """The fallback the warning names: save(0, force=True) to the url first; no warning, and
    after a crash the restart restores memory step 2 bitwise."""
    err = _crash(tmp_path, first=True)
    assert _SAYS not in err, err
    want = torch.load(str(tmp_path / "state.pt"))
    step, tier, got = _load_fresh(tmp_path, interval=100)
    assert (step, tier) == (2, "memory")
    _assert_same(want, got)
