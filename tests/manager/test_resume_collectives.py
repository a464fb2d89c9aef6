"""The resume contract's collectives are bounded: a snapshot failing on one rank, ranks
calling different things, or a rank that never calls is an error on every rank within
``collective_timeout``, naming the ranks; ``close()`` works after rank 0's process (the
default group's store) has gone.
"""

from __future__ import annotations

import os
import time

from muon_ckpt import CheckpointError, CheckpointManager
from tests._dist import run_on_ranks
from tests.conftest import tiny_run, tiny_train
from tests.manager._resume import Counter

# ---------------------------------------------------------------------- bounded collectives
SLOW = 120  # a collective_timeout no rank reaches: ranks that disagree say so before it


class Broken(Counter):
    def state_dict(self) -> dict:
        raise RuntimeError("this extra cannot be saved")


def _body_bounded(rank, world_size, url):
    model, opt = tiny_run()
    out = []
    # A snapshot that fails on one rank, with the async budget's extra gather in the way.
    extra = {"data": Broken() if rank == 1 else Counter()}
    mgr = CheckpointManager(
        url, model=model, optimizer=opt, rank_extra=extra, async_save=True, max_staging_bytes=2**30
    )
    try:
        mgr.save(1)
        out.append(None)
    except CheckpointError as e:  # whatever the extra raised (its cause)
        out.append(f"{type(e).__name__}: {e} (cause: {e.__cause__!r})")
    # Different calls: every rank finds out at once, long before the timeout.
    mgr = CheckpointManager(url, model=model, optimizer=opt, collective_timeout=SLOW)
    t0 = time.monotonic()
    try:
        mgr.save(1 if rank == 0 else 2)
        out.append((None, 0.0))
    except CheckpointError as e:
        out.append((str(e), time.monotonic() - t0))
    # A rank that never calls: the others give up after collective_timeout, naming it.
    mgr = CheckpointManager(url, model=model, optimizer=opt, collective_timeout=1)
    gave_up = f"{url}.rank-0-gave-up"
    if rank == 1:  # stays (calls nothing) until rank 0 has given up
        deadline = time.monotonic() + 120
        while not os.path.exists(gave_up) and time.monotonic() < deadline:
            time.sleep(0.05)
        return out
    t0 = time.monotonic()
    try:
        mgr.save(1)
        out.append((None, 0.0))
    except CheckpointError as e:
        out.append((str(e), time.monotonic() - t0))
    open(gave_up, "w").close()
    return out


def test_collectives_give_up_in_bounded_time_naming_the_ranks(tmp_path):
    url = str(tmp_path / "run")
    out0, out1 = run_on_ranks(_body_bounded, 2, url, timeout=240)
    assert out0[0] and "taking the snapshot failed on rank(s) [1]" in out0[0]
    assert out1[0].startswith("CheckpointError: saving step 1: taking the snapshot failed: ")
    assert out1[0].endswith("(cause: RuntimeError('this extra cannot be saved'))")
    out0, out1 = out0[1:], out1[1:]
    for err, took in (out0[0], out1[0]):
        assert err and "rank 0: save(step=1), rank 1: save(step=2)" in err and took < SLOW
    err, took = out0[1]
    assert err and "save(step=1) on rank 0: rank(s) [1] of 2 did not call it within 1 s" in err
    assert took >= 1
    assert CheckpointManager(url).steps() == []  # nothing half-written was committed


def body_close_after_rank_0_left(rank, world_size, url):
    """Rank 0 saves, closes and its process ends (with it the default group's store, which
    it hosts); the other rank closes afterwards."""
    import torch.distributed as dist

    model, opt = tiny_run()
    mgr = CheckpointManager(url, model=model, optimizer=opt)
    tiny_train(model, opt, 1)
    mgr.save(1)
    mgr.save(2)
    if rank == 0:
        mgr.close()
        return "closed"
    store = dist.distributed_c10d._get_default_store()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until rank 0's process, the store's host, is gone
        try:
            store.check(["probe"])
        except RuntimeError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("rank 0's store still answers after 60 s")
    mgr.close()  # must not raise: forgetting its handshake keys is housekeeping
    return "closed"


def test_close_after_rank_0_has_left(tmp_path):
    assert run_on_ranks(body_close_after_rank_0_left, 2, str(tmp_path / "run")) == ["closed"] * 2
