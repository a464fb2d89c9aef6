"""A training job whose last memory step is flushed by the interpreter's exit, not by close():
``python -m tests.memory._flush_job MODE URL MEMDIR STATE``.

``moved-on``: it trains and saves steps 1-7 (url: every 5th; memory tier: every step),
torch.saves the state of step 7 (model, optimizer, extra and rank_extra) to STATE, then
moves on as a job failing in the middle of step 8 does (the data position and RNG advanced by
gradient accumulation, EMA weights swapped in). ``queued``: step 7's memory job is held
until step 8's save() was queued behind it; STATE is step 8's. Either way it returns without
wait() or close(): the exit hook closes the manager, which writes the queued step and
flushes the newest memory step's own bytes."""

from __future__ import annotations

import sys
import threading

import torch

from muon_ckpt import CheckpointManager
from tests._ckpt import train
from tests._memtier import (
    Position,
    _fresh,
    _memory_at,
    everything,
    moved_on,
    train_and_save,
)

_keep: list[CheckpointManager] = []  # alive at exit, as a script's global manager is


def main(mode: str, url: str, memdir: str, state: str) -> None:
    model, opt = _fresh()
    data, rng = Position(1), Position(2)
    mgr = CheckpointManager(
        url,
        model=model,
        optimizer=opt,
        extra={"data": data},
        rank_extra={"rng": rng},
        interval=5,
        memory=_memory_at(memdir),
    )
    _keep.append(mgr)
    assert mgr.load() is None
    if mode == "moved-on":
        train_and_save(mgr, model, opt, data, rng, range(1, 8))
        torch.save(everything(model, opt, data, rng), state)
        moved_on(model, data, rng)
        return
    train_and_save(mgr, model, opt, data, rng, range(1, 7))
    gate = mgr._saves.gate = threading.Event()
    try:
        for s in (7, 8):
            data.advance(4)
            rng.advance(4)
            train(model, opt, 1, seed=s)
            assert mgr.save(s)  # 7: held at the gate; 8: queued behind it
        torch.save(everything(model, opt, data, rng), state)
        moved_on(model, data, rng)
    finally:
        gate.set()


if __name__ == "__main__":
    main(*sys.argv[1:5])
