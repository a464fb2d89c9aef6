"""A script that ends with an asynchronous save pending, so that the interpreter's exit waits
for it, while its parent presses Ctrl-C again and again (tests/manager/test_interrupt_close.py).
Run as ``python -m tests.manager._exit_interrupt_child URL OUT``.

It saves step 1, then step 2 asynchronously, whose write waits at the manager's test gate
(storage that does not answer), prints ``pending 2`` and loops until a Ctrl-C ends it. The
gate opens once the pending save was stopped (the manager's stop flag, polled by a helper
thread), after the parent's ``open`` line on stdin: every Ctrl-C the parent sends before that
line lands while the exit hook waits. Each SIGINT the process receives is printed as
``sigint N`` (read from ``signal.set_wakeup_fd``, written when the signal arrives, whichever
handler is in force). A hook registered before the manager's runs after it at exit: it prints
``after exit hook: alive [names]``, the muon-ckpt threads still running then (none may be: the
interpreter would finish with them inside torch), and opens the gate.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import torch

from muon_ckpt import CheckpointManager
from tests.conftest import tiny_run, tiny_snapshot, tiny_train


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(url: str, out: str) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    gate = threading.Event()
    opened = threading.Event()  # the parent's ``open``
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def count() -> None:
        n = 0
        while os.read(read, 1):
            n += 1
            _say(f"sigint {n}")

    def report() -> None:  # (threading's exit hooks run last-registered first: after muon-ckpt's)
        alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("muon_ckpt"))
        _say(f"after exit hook: alive {alive}")
        gate.set()

    threading._register_atexit(report)  # type: ignore[attr-defined]
    threading.Thread(target=count, daemon=True).start()
    threading.Thread(target=lambda: (sys.stdin.readline(), opened.set()), daemon=True).start()
    model, opt = tiny_run(seed=0)
    mgr = CheckpointManager(url, model=model, optimizer=opt, async_save=True)
    saves = mgr._saves

    def open_when_stopped() -> None:
        opened.wait()
        while not gate.is_set() and not getattr(getattr(saves, "stopped", None), "is_set", False):
            time.sleep(0.005)
        gate.set()

    threading.Thread(target=open_when_stopped, daemon=True).start()
    for step in (1, 2):
        tiny_train(model, opt, 1, seed=step)
        torch.save(tiny_snapshot(model, opt), os.path.join(out, f"state-{step}.pt"))
        if step == 2:
            saves.gate = gate
        mgr.save(step)
        if step == 1:
            mgr.wait()
    _say("pending 2")
    while True:  # the training loop, which a Ctrl-C ends
        time.sleep(0.01)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
