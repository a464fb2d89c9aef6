"""A process that saves and loads on its parent's command while the parent sends it SIGINTs
(tests/manager/test_interrupt_storm.py). Run as
``python -m tests.manager._interrupt_child URL OPTIONS [MEMORY]`` (``storage_options`` as
JSON; ``MemoryOptions`` as JSON: a memory tier too).

Commands, one a line on stdin: ``save`` (the state filled from the step number, then a
synchronous ``save``), ``load``, ``quit``, and ``final``: the loop the README suggests
(``except CheckpointError`` around each save, nothing else), which only a Ctrl-C ends. It
answers on stdout: ``ready``, ``saving S`` / ``saved S newest N``, ``loading`` / ``loaded
N``, ``error ...``, ``done C``. Every KeyboardInterrupt is caught, counted and answered
``interrupted C newest N alive [names]``: the muon-ckpt threads still running at that
moment, once the jobs the manager holds (a memory save's runs on after ``save()``, joined by
the next call) have ended, their own threads aside (none may be: a thread left writing after
the interrupt writes into memory the next save reuses, and one still inside torch when the
interpreter exits aborts it).

``save!`` and ``load!``: the parent sends a SIGINT during the call, then the line ``sent``.
A call that returns first waits for the interrupt without reading stdin (a read that an
interrupt cuts short loses what it read): should ``sent`` become readable before the
interrupt came, the SIGINT was swallowed (answered ``swallowed``). So no command is read
while an interrupt may still come.
"""

from __future__ import annotations

import faulthandler
import json
import select
import signal
import sys
import threading

import torch
from torch import nn

from muon_ckpt import CheckpointError, CheckpointManager, MemoryOptions

SHAPES = [(1024, 1024), (2048, 1024), (1024, 1024)]  # 16 MiB of weights, as much momentum


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and an SGD whose momentum buffers exist (one step of zero gradients)."""
    model = nn.Sequential(*[nn.Linear(i, o, bias=False) for i, o in SHAPES])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return model, opt


def expected(step: int) -> list[tuple[float, float]]:
    """(weight, momentum) values of each layer at ``step``: every save's bytes differ."""
    return [(step + k / 4, -step - k / 4) for k in range(len(SHAPES))]


@torch.no_grad()
def fill(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    for p, (w, m) in zip(model.parameters(), expected(step)):
        p.fill_(w)
        opt.state[p]["momentum_buffer"].fill_(m)


def _alive(mgr: CheckpointManager) -> list[str]:
    """The muon-ckpt threads running, once the jobs the manager holds have ended (their
    threads aside: their helpers end before them)."""
    saves = mgr._saves
    held = [job for job in (saves.pending, saves.memory_job) if job is not None]
    for job in held:
        job._ended.wait()
    held = {job._thread for job in held}
    return sorted(
        t.name for t in threading.enumerate() if t.name.startswith("muon_ckpt") and t not in held
    )


def _newest(mgr: CheckpointManager) -> int:
    steps = mgr.steps()
    return steps[-1] if steps else -1


def _await_interrupt() -> None:
    """Until the parent's SIGINT raises here, or its ``sent`` line shows it never will."""
    while not select.select([sys.stdin], [], [], 0.01)[0]:
        pass
    _say("swallowed")


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1)  # the parent's diagnosis of a child that hangs
    model, opt = build()
    opts = json.loads(sys.argv[2])
    memory = MemoryOptions(**json.loads(sys.argv[3])) if len(sys.argv) > 3 else None
    mgr = CheckpointManager(
        sys.argv[1],
        model=model,
        optimizer=opt,
        keep_last=2,
        io_threads=3,
        storage_options=opts,
        memory=memory,
    )
    step = count = 0
    _say("ready")
    while True:
        try:
            cmd = sys.stdin.readline().strip()
            if cmd in ("quit", "final", ""):
                break
            if cmd.startswith("save"):
                step += 1
                fill(model, opt, step)
                _say(f"saving {step}")
                mgr.save(step)
                _say(f"saved {step} newest {_newest(mgr)}")
            elif cmd.startswith("load"):
                _say("loading")
                _say(f"loaded {mgr.load()}")
            if cmd.endswith("!"):
                _await_interrupt()
        except KeyboardInterrupt:
            count += 1
            _say(f"interrupted {count} newest {_newest(mgr)} alive {_alive(mgr)}")
        except CheckpointError as e:
            _say(f"error {type(e).__name__}: {e}")
    if cmd == "final":
        while True:  # as the README's loop: a Ctrl-C must end it, never abort the process
            step += 1
            fill(model, opt, step)
            try:
                _say(f"saving {step}")
                mgr.save(step)
            except CheckpointError as e:
                _say(f"error {type(e).__name__}: {e}")
    mgr.close()
    _say(f"done {count}")


if __name__ == "__main__":
    main()
