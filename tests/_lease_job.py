"""A training job reduced to its lease, run as ``python -m tests._lease_job`` (possibly inside a
PID namespace of its own, through ``unshare``) by the lease tests.

``hold URL READY DONE``: save step 1, touch READY, wait for DONE, then exit without close()
(the lease stays behind, as after a crash). ``hold-memory URL MEMDIR READY DONE STATE``: the
same with a memory tier, after steps 1-3 (url: 2; memory: 1-3), its state torch.saved to
STATE. ``save URL``: a job that, for each STEP its stdin gives (a line), tries again as a
resuming job does (a new manager: load, then save STEP) and prints one JSON line:
``{"saved": true, "pid": ...}`` or ``{"saved": false, "error": ..., "pid": ...}``; at the
end of its stdin it exits without close() (a lease it took stays, as a running job's does).
``rewind URL OPTIONS``: a job taking the run over (``OPTIONS``: storage options as JSON) that
loads step 2 and saves step 3 from it, every parameter ``REWOUND``, then closes.
``save-on URL OPTIONS LEASE_SECONDS``: a job that saves steps 1-4 (every parameter the step's
number), prints ``saving 5``, saves step 5 and prints ``{"saved": ...}`` (and the error).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

from muon_ckpt import CheckpointError, CheckpointManager, MemoryOptions


def _hold(url: str, ready: str, done: str) -> None:
    mgr = CheckpointManager(url, model=nn.Linear(8, 8))
    mgr.save(1)
    open(ready, "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.02)
    os._exit(0)  # no close(), no atexit: the lease stays, as a crashed job leaves it


def _hold_memory(url: str, memdir: str, ready: str, done: str, state: str) -> None:
    from tests._ckpt import train
    from tests._memtier import _fresh, _state

    model, opt = _fresh()
    memory = MemoryOptions(interval=1, dir=memdir)
    mgr = CheckpointManager(url, model=model, optimizer=opt, interval=2, memory=memory)
    mgr.load()
    for s in (1, 2, 3):
        train(model, opt, 1, seed=s)
        mgr.save(s)
        mgr.wait()
    torch.save(_state(model, opt), state)
    open(ready, "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.02)
    os._exit(0)


REWOUND = 30.0  # the parameters of the step a rewinding job saves


def _filled(model: nn.Module, value: float) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _rewind(url: str, options: str) -> None:
    model = nn.Linear(8, 8)
    mgr = CheckpointManager(url, model=model, storage_options=json.loads(options))
    assert mgr.load(step=2) == 2
    _filled(model, REWOUND)
    assert mgr.save(3)
    mgr.close()


def _save_on(url: str, options: str, lease_seconds: str) -> None:
    model = nn.Linear(8, 8)
    opts = json.loads(options)
    # (a storage timeout longer than the test holds the step-5 upload: held, never failed)
    seconds = float(lease_seconds)
    mgr = CheckpointManager(
        url, model=model, storage_options=opts, lease_seconds=seconds, storage_timeout=600
    )
    for s in (1, 2, 3, 4):
        _filled(model, s)
        mgr.save(s)
    _filled(model, 5)
    print("saving 5", flush=True)
    try:
        print(json.dumps({"saved": bool(mgr.save(5))}), flush=True)
    except CheckpointError as e:
        print(json.dumps({"saved": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
    os._exit(0)


def _save(url: str) -> None:
    for line in sys.stdin:
        mgr = CheckpointManager(url, model=nn.Linear(8, 8))
        try:
            mgr.load()  # a job resuming the run: only the lease may stop it
            mgr.save(int(line))
        except CheckpointError as e:
            print(json.dumps({"saved": False, "error": str(e), "pid": os.getpid()}), flush=True)
            continue
        print(json.dumps({"saved": True, "pid": os.getpid()}), flush=True)
    os._exit(0)  # keep the lease, as a running job does


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "hold":
        _hold(*sys.argv[2:5])
    elif sys.argv[1] == "hold-memory":
        _hold_memory(*sys.argv[2:7])
    elif sys.argv[1] == "rewind":
        _rewind(*sys.argv[2:4])
    elif sys.argv[1] == "save-on":
        _save_on(*sys.argv[2:5])
    else:
        _save(sys.argv[2])
