"""One rank of a training run, in an interpreter of its own, that ends the way a test asks
(tests/manager/test_run_edges.py): by returning, raising, Ctrl-C in the loop, a signal in the middle
of a save, or preemption. Run as ``python -m tests.manager._edge_script CONFIG_JSON``; with
``WORLD_SIZE`` > 1 in the environment it joins a gloo process group (``env://``).

It trains ``tiny_run`` (one thread: the same bits in every process), saves with the manager
and writes, for every step it saved, a snapshot of the state at the ``save()`` call to
``<out>/state-<step>.pt``, and progress lines (``pending N``, ``saved N``, ``done``) to
``<out>/progress-<rank>``.

With ``gate``, each background write waits at the manager's test gate, opened by an event,
never a time: the next save opens the one before it; the last one is opened by the exit's
"before exiting" line (or, ``end`` "destroy"/"steal", by the script after it); with
``preempt``, the pending one is opened once ``<out>/signalled`` exists (the parent wrote it
after its SIGTERM), just before the save that takes the signal.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from muon_ckpt import CheckpointError, CheckpointManager
from tests.conftest import tiny_run, tiny_snapshot, tiny_train


class _Signals:
    """A Stateful for ``extra`` whose saving sends this process a signal: at ``state_dict()``
    (inside a snapshot), while DCP pickles its value (inside the write), or (``zip``) while
    ``torch.save`` writes a tensor item's zip records into the step's file (``in_zip``)."""

    def __init__(self, when: str | None) -> None:
        self.when = when
        self.armed = False

    def state_dict(self) -> dict[str, Any]:
        if self.armed and self.when == "snapshot":
            self.armed = False
            os.kill(os.getpid(), signal.SIGINT)
        return {"note": _Pickled(self) if self.armed and self.when == "write" else "plain"}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def in_zip(signals: _Signals) -> None:
    """A SIGINT that lands inside torch.save's zip writer: in the third write to the step's
    file that ``torch.save`` makes in the main thread (the one that takes signals; with
    ``io_threads=1`` the only one that writes), once some records are written. The zip
    writer's context manager then fails on the way out ("unexpected pos"), a RuntimeError
    whose __context__ is the KeyboardInterrupt."""
    from muon_ckpt.save import _streams

    real = _streams._CrcStream.write
    writes = [0]  # by torch.save, in the main thread, since the signal was armed

    def from_zip_writer() -> bool:
        f = sys._getframe(2)  # what called write(): DCP's stream wrapper, torch.save's _save
        for _ in range(2):
            if f is not None and f.f_code.co_name == "_save" and "serial" in f.f_code.co_filename:
                return True
            f = f.f_back if f is not None else None
        return False

    def write(self: Any, b: Any) -> int:
        main = threading.current_thread() is threading.main_thread()
        if signals.armed and main and from_zip_writer():
            writes[0] += 1
            if writes[0] == 3:
                signals.armed = False
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)  # the interrupt is raised here, inside the zip writer's write
        return real(self, b)

    _streams._CrcStream.write = write  # type: ignore[method-assign]


class _OpenAtExit(logging.Handler):
    """Opens ``gate`` when the manager logs that the exit waits for the pending save."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: threading.Event | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if "before exiting" in record.getMessage() and self.gate is not None:
            self.gate.set()


def _until_signalled(out: str) -> None:
    deadline = time.monotonic() + 120  # (a loaded host: generous, and never waited out)
    while not os.path.exists(os.path.join(out, "signalled")):
        assert time.monotonic() < deadline, "no SIGTERM from the parent"
        time.sleep(0.005)


class _Pickled:
    def __init__(self, owner: _Signals) -> None:
        self.owner = owner

    def __reduce__(self) -> Any:
        if self.owner.armed:
            self.owner.armed = False
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)  # the main thread takes the interrupt while DCP writes
        return (str, ("pickled",))


def main(cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    out = cfg["out"]
    progress = open(os.path.join(out, f"progress-{rank}"), "a", buffering=1)  # noqa: SIM115
    model, opt = tiny_run(seed=0)
    signals = _Signals(cfg.get("signal_in"))
    if signals.when == "zip":
        in_zip(signals)
    mgr = CheckpointManager(
        cfg["url"],
        model=model,
        optimizer=opt,
        extra={"signals": signals},
        storage_options=cfg.get("opts") or {},
        interval=cfg.get("interval"),
        async_save=cfg.get("async_save", True),
        io_threads=cfg.get("io_threads"),
    )
    if cfg.get("preempt"):
        mgr.watch_preemption()
    start = mgr.load() or 0
    gate = last_gate = None
    at_exit = _OpenAtExit()
    if cfg.get("gate"):
        gate = mgr._saves.gate = threading.Event()  # a background write waits for its gate
        logging.getLogger("muon_ckpt").addHandler(at_exit)
    for step in range(start + 1, cfg["steps"] + 1):
        tiny_train(model, opt, 1, seed=step)
        if rank == 0:
            torch.save(tiny_snapshot(model, opt), os.path.join(out, f"state-{step}.pt"))
        if step == cfg.get("interrupt_at"):
            signals.armed = True
            try:
                mgr.save(step)
            except CheckpointError as e:  # the loop README recommends: must not catch Ctrl-C
                progress.write(f"caught CheckpointError {e}\n")
            except KeyboardInterrupt:
                progress.write(f"interrupted {step}\n")
                progress.write(f"steps {mgr.steps()}\n")
                mgr.save(step, force=True)  # the interrupted step, saved again: it commits
                mgr.close()
                progress.write(f"saved again {step}: steps {mgr.steps()}\n")
                return
            continue
        if last_gate is not None and not last_gate.is_set():
            if cfg.get("preempt"):  # the signal came while it was pending
                _until_signalled(out)
            last_gate.set()
        saved = mgr.save(step)
        if saved and gate is not None:
            progress.write(f"pending {step}\n")
            last_gate = at_exit.gate = gate
            gate = mgr._saves.gate = threading.Event()
        elif saved:
            progress.write(f"saved {step}\n")
        if cfg.get("slow"):
            time.sleep(cfg["slow"])
    progress.write("done\n")
    end = cfg.get("end", "return")
    if end == "raise":
        raise RuntimeError("the training loop failed")
    if end == "sigint":  # wait in the 'loop' for the parent's Ctrl-C
        while True:
            time.sleep(0.01)
    if end == "destroy":  # the process group goes before the pending save could finish
        dist.destroy_process_group()
        if last_gate is not None:
            last_gate.set()
    if end == "steal":  # another job takes the lease: the pending save fails at its commit
        now = time.time()
        thief = {"owner": "y" * 32, "host": "other-host", "pid": 1, "heartbeat": now}
        with open(os.path.join(cfg["url"], "lease.json"), "w") as f:
            json.dump({**thief, "expires": now + 300}, f)
        if last_gate is not None:
            last_gate.set()
    if end == "close":
        mgr.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
