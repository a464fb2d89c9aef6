"""A save killed with SIGKILL at a random point never leaves a step that steps() reports;
load() then returns the previous committed step, and the next save cleans up.

A child process saves steps 1, 2, 3, ... back to back (parameters filled with the step number,
keep_last=3, so kills also land in retention); the parent kills it after a random delay, or,
in every other trial, the moment it sees a step's data files without their manifest. With
``async_save`` the child refills the parameters as soon as save() returns, while the step is
still being written in the background: a kill then lands in a background write, and a step
that did commit must hold the values of its save() call.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch
from torch import nn

from muon_ckpt import CheckpointManager
from muon_ckpt.store import (
    DATA,
    MANIFEST,
    Storage,
    parse_data_dirname,
    parse_step_dirname,
    step_dirname,
)
from tests._dist import _context


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])  # ~2 MiB of fp32


def child_save_forever(url: str, opts: dict, progress: str, async_save: bool) -> None:
    torch.set_num_threads(1)
    model = _model()
    mgr = CheckpointManager(
        url, model=model, storage_options=opts, keep_last=3, io_threads=2, async_save=async_save
    )
    fd = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        os.write(fd, f"begin {step}\n".encode())
        mgr.save(step)
        os.write(fd, f"saved {step}\n".encode())


def _progress(path: str) -> tuple[int, int]:
    begun = saved = 0
    if not os.path.exists(path):
        return begun, saved
    with open(path) as f:
        for line in f:
            what, _, n = line.strip().partition(" ")
            if what == "begin":
                begun = max(begun, int(n))
            elif what == "saved" and n:
                saved = max(saved, int(n))
    return begun, saved


def _orphans(st: Storage) -> set[str]:
    """The data directories (``<url>/data/<step>-<id>``) of saves without a manifest: a
    save mid-write (or one a kill cut short)."""
    return {
        name
        for name in st.listdir(DATA)
        if (step := parse_data_dirname(name)) is not None
        and st.listdir(DATA, name)
        and not st.exists(step_dirname(step), MANIFEST)
    }


def _writing_uncommitted(st: Storage) -> bool:
    """A save's data files are there but not its manifest yet: a save is mid-write."""
    return bool(_orphans(st))


def _kill_mid_save(
    url: str, opts: dict, progress: str, rng: random.Random, mid_write: bool, async_save: bool
) -> tuple[int, int]:
    """Start a saving child, then SIGKILL it: after a random delay, or (``mid_write``) as soon
    as a step's data files are visible without their manifest, so that some kills surely land
    between the data and the commit marker, whatever the speed of the storage."""
    p = _context().Process(
        target=child_save_forever, args=(url, opts, progress, async_save), daemon=True
    )
    p.start()
    deadline = time.monotonic() + 120
    while _progress(progress)[1] < 1 + async_save:  # step 1 committed
        assert p.is_alive(), f"child exited with {p.exitcode}"
        assert time.monotonic() < deadline, "child never committed step 1"
        time.sleep(0.01)
    if mid_write:
        st = Storage(url, opts)
        while not _writing_uncommitted(st) and time.monotonic() < deadline:
            assert p.is_alive(), f"child exited with {p.exitcode}"
    else:
        time.sleep(rng.uniform(0.0, 0.5))
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    assert p.exitcode == -signal.SIGKILL
    return _progress(progress)


def _check_after_kill(url: str, opts: dict, begun: int, saved: int, async_save: bool) -> bool:
    """The invariants; returns whether the kill left an uncommitted step behind."""
    st = Storage(url, opts)
    dirs = {parse_step_dirname(n): n for n in st.listdir() if parse_step_dirname(n) is not None}
    uncommitted = {s for s, n in dirs.items() if not st.exists(n, MANIFEST)}
    orphans = _orphans(st)
    model = _model()
    mgr = CheckpointManager(url, model=model, storage_options=opts)
    steps = mgr.steps()
    assert steps and not set(steps) & uncommitted
    assert set(steps) <= set(range(1, begun + 1))
    # The last save that returned is committed (asynchronous: the one before it, which that
    # save waited for); a later one only if its manifest landed.
    certain = saved - 1 if async_save else saved
    assert certain in steps and steps[-1] in range(certain, begun + 1)
    assert mgr.load() == steps[-1]
    assert all(torch.all(p == steps[-1]) for p in model.parameters())
    if len(steps) > 1:
        assert mgr.load(step=steps[-2]) == steps[-2]
        assert all(torch.all(p == steps[-2]) for p in model.parameters())
    # The next save removes the leftovers and commits.
    assert mgr.save(begun + 1)
    left = [n for n in st.listdir() if parse_step_dirname(n) is not None]
    assert all(st.exists(n, MANIFEST) for n in left), f"leftovers not cleaned: {left}"
    assert not _orphans(st) & orphans, f"data of crashed saves not cleaned: {orphans}"
    assert mgr.steps()[-1] == begun + 1
    return bool(uncommitted or orphans)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("backend,trials", [("local", 6), ("s3", 4)])
def test_resume_after_kill_mid_save(backend, trials, async_save, tmp_path, request):
    rng = random.Random(1234)
    if backend == "s3":
        bucket, opts = request.getfixturevalue("s3_bucket")
        base = f"s3://{bucket}"
    else:
        base, opts = str(tmp_path), {}
    interrupted = 0
    for t in range(trials):
        url = f"{base}/trial{t}"
        progress = str(tmp_path / f"progress{t}.txt")
        begun, saved = _kill_mid_save(url, opts, progress, rng, t % 2 == 1, async_save)
        interrupted += _check_after_kill(url, opts, begun, saved, async_save)
    # The kills really landed inside saves (not only between them).
    print(f"{backend}: {interrupted}/{trials} kills interrupted a save")
    assert interrupted >= 1, f"no kill out of {trials} interrupted a save"
