"""A job that keeps every step in the memory tier and the url every 100 steps, and is killed
(SIGKILL) after its last memory save: ``python -m tests.memory._line_job MODE URL OPTIONS
MEMDIR STATE`` (OPTIONS: the storage options as JSON).

``fresh``: a first run; it saves steps 1-6 (``STEPS`` in the environment: how many; with
``FIRST=1``, step 0 to the url first).
``rewind``: it resumes (step 6, from memory), rewinds to step 2 and saves steps 3 and 4 of
the new line. ``new-run``: a new run in the same url (``new_run=True``, nothing loaded); it
saves step 1. Each torch.saves the state of its last step to STATE, prints ``saved`` and
kills itself: nothing is closed, flushed or committed to the url."""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

from muon_ckpt import CheckpointManager
from tests._ckpt import train
from tests._memtier import _fresh, _memory_at, _state


def main(mode: str, url: str, options: str, memdir: str, state: str) -> None:
    model, opt = _fresh()
    mgr = CheckpointManager(
        url,
        model=model,
        optimizer=opt,
        interval=100,
        memory=_memory_at(memdir, keep=6),  # (the rewind loads step 2 from memory)
        storage_options=json.loads(options),
        new_run=mode == "new-run",
    )
    if mode == "fresh":
        assert mgr.load() is None
        if os.environ.get("FIRST") == "1":
            assert mgr.save(0, force=True)
        steps = range(1, int(os.environ.get("STEPS", "6")) + 1)
    elif mode == "rewind":
        assert mgr.load() == 6 and mgr.last_load_tier == "memory"
        assert mgr.load(step=2) == 2 and mgr.last_load_tier == "memory"
        steps = range(3, 5)
    else:
        steps = range(1, 2)
    for s in steps:
        train(model, opt, 1, seed=100 * s + len(mode))
        assert mgr.save(s)
        mgr.wait()
    torch.save(_state(model, opt), state)
    print("saved", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(*sys.argv[1:])
