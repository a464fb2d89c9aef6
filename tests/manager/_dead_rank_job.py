"""One rank of a two-rank run whose rank 0 (the host of the process group's store, as
``env://`` makes it) ends its script after step 1 (tests/manager/test_dead_rank.py). Run as
``python -m tests.manager._dead_rank_job URL`` with ``RANK``, ``WORLD_SIZE`` and ``MASTER_*`` set.

Both ranks save step 1 and print ``saved 1``; rank 0 then ends. Rank 1 waits for ``go`` on
stdin (its parent sends it once rank 0 has exited), then calls ``save(2)`` and ``load()``
inside ``except CheckpointError`` as the README's loop does, printing ``save: <type>: <text>``
and ``load: ...`` (``raw`` before the type when it is not a CheckpointError), then ``close()``
(``closed``, or ``close: ...``).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from muon_ckpt import CheckpointError, CheckpointManager
from tests.conftest import tiny_run


def _try(what: str, fn) -> None:
    try:
        fn()
        print(f"{what}: returned", flush=True)
    except CheckpointError as e:
        print(f"{what}: {type(e).__name__}: {e}".replace("\n", " "), flush=True)
    except BaseException as e:
        print(
            f"{what}: raw {type(e).__module__}.{type(e).__name__}: {e}".replace("\n", " "),
            flush=True,
        )


def main(url: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, opt = tiny_run(seed=0)
    mgr = CheckpointManager(url, model=model, optimizer=opt, collective_timeout=120)
    mgr.save(1)
    print("saved 1", flush=True)
    if dist.get_rank() == 0:
        return  # this rank's script ends: its process, and the store it hosts, are gone
    sys.stdin.readline()
    _try("save", lambda: mgr.save(2))
    _try("load", mgr.load)
    _try("close", mgr.close)
    os._exit(0)  # (the default group's teardown would wait on the store that is gone)


if __name__ == "__main__":
    main(sys.argv[1])
