"""A training job whose last memory step is flushed by the interpreter's exit, not by close():
``python -m tests._flush_job URL MEMDIR STATE``.

It trains and saves steps 1-7 (url: every 5th; memory tier: every step), torch.saves the
state of step 7 (model, optimizer, extra and rank_extra) to STATE, then moves on as a job
failing in the middle of step 8 does (the data position and RNG advanced by gradient
accumulation, EMA weights swapped in) and returns without close(): the exit hook closes the
manager, whose flush must commit step 7's own bytes."""

from __future__ import annotations

import sys

import torch

from muon_ckpt import CheckpointManager
from tests._memtier import (
    Position,
    _fresh,
    _memory_at,
    everything,
    moved_on,
    train_and_save,
)

_keep: list[CheckpointManager] = []  # alive at exit, as a script's global manager is


def main(url: str, memdir: str, state: str) -> None:
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
    train_and_save(mgr, model, opt, data, rng, range(1, 8))
    torch.save(everything(model, opt, data, rng), state)
    moved_on(model, data, rng)


if __name__ == "__main__":
    main(*sys.argv[1:4])
