"""The save's plans cross DCP's gather and scatter as columns up and dropped positions back:
rank 0 never holds a rank's write items, each rank writes its own, and the global plan made
from the columns is DCP's own (the same dedup, ties included, the same metadata), also where
a rank's columns claim too little (then every item is counted)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import BytesIOWriteData, SavePlan, WriteItem

from muon_ckpt.save import StagedSavePlanner
from muon_ckpt.save._global import SavePlanner
from muon_ckpt.save._plan import LocalPlan, Received
from tests._dist import run_on_ranks
from tests.save.test_planning import _plans

_CASES = [
    pytest.param((6, 1, {"a": (10, 3), "w2": (4, 7)}), id="fsdp-uneven-and-empty-shards"),
    pytest.param((8, 2, {"a": (16, 2), "b": (5,)}), id="hsdp-replicated-shards"),
    pytest.param((5, 5, {"a": (3, 3)}), id="replicated-everywhere"),
    pytest.param((1, 1, {"a": (3, 3)}), id="one-rank"),
]


def _sent(plans: list[SavePlan], replicated: bool = False) -> tuple[list[LocalPlan], list[Any]]:
    """Each plan as our planner makes it, and what rank 0 unpickles of it (DCP's gather)."""
    local = [LocalPlan(p.items, p.storage_data, p.planner_data, True, replicated) for p in plans]
    return local, [pickle.loads(pickle.dumps(p)) for p in local]


def _back(final: list[SavePlan]) -> list[SavePlan]:
    """What each rank unpickles of rank 0's global plan (DCP's scatter)."""
    return [pickle.loads(pickle.dumps(p)) for p in final]


@pytest.mark.parametrize("replicated", [False, True], ids=["fsdp-claimed", "hsdp-claimed"])
@pytest.mark.parametrize("case", _CASES)
def test_the_plans_cross_as_columns_and_the_global_plan_is_dcps_own(case, replicated):
    n, replicas, shapes = case
    local, received = _sent(_plans(n, shapes, replicas, objects=3), replicated)
    assert all(type(p) is Received and p.items == [] and p.cols is not None for p in received)
    final, md = StagedSavePlanner(None).create_global_plan(received)
    mine = _back(final)
    theirs, want = DefaultSavePlanner().create_global_plan(_plans(n, shapes, replicas, 3))
    assert [p.items for p in mine] == [p.items for p in theirs]
    assert md.state_dict_metadata == want.state_dict_metadata
    assert list(md.planner_data.items()) == list(want.planner_data.items())
    for own, got in zip(local, mine):  # (each rank's very own items, not copies)
        ids = {id(it) for it in own.items}
        assert all(id(it) in ids for it in got.items)
        assert got.planner_data is own.planner_data


@pytest.mark.parametrize("case", _CASES)
def test_columns_that_claim_too_little_still_give_dcps_plan(case):
    """A rank's list of the items another may hold (``doubt``) is only where the count
    starts: emptied, every duplicate is still found (a tiling that fails, an object twice)."""
    n, replicas, shapes = case
    _, received = _sent(_plans(n, shapes, replicas, objects=3))
    for p in received:
        p.cols.doubt = []
    final, md = StagedSavePlanner(None).create_global_plan(received)
    theirs, want = DefaultSavePlanner().create_global_plan(_plans(n, shapes, replicas, 3))
    assert [p.items for p in _back(final)] == [p.items for p in theirs]
    assert md.state_dict_metadata == want.state_dict_metadata


def test_a_plan_of_items_of_their_own_travels_as_its_items():
    plans = _plans(3, {"a": (6, 2)})
    odd = WriteItem(
        index=plans[1].items[-1].index,
        type=plans[1].items[-1].type,
        bytes_io_data=BytesIOWriteData(5),
    )
    plans[1] = SavePlan([*plans[1].items[:-1], odd], planner_data=plans[1].planner_data)
    _, received = _sent(plans)
    assert type(received[1]) is SavePlan and received[1].items[-1] == odd
    assert type(received[0]) is Received
    final, md = StagedSavePlanner(None).create_global_plan(received)
    theirs, want = DefaultSavePlanner().create_global_plan(plans)
    assert [p.items for p in _back(final)] == [p.items for p in theirs]
    assert md.state_dict_metadata == want.state_dict_metadata


def _unpickle(data: bytes, out: mp.Queue) -> None:
    try:
        pickle.loads(data)
        out.put("no error")
    except RuntimeError as e:
        out.put(str(e))


def test_a_plan_back_in_a_process_that_did_not_make_it_is_refused():
    local, received = _sent(_plans(2, {"a": (4, 2)}))
    final, _ = StagedSavePlanner(None).create_global_plan(received)
    data = pickle.dumps(final[1])
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_unpickle, args=(data, out))
    child.start()
    got = out.get(timeout=120)
    child.join(timeout=120)
    assert "did not make it" in got, got
    assert pickle.loads(data).items == local[1].items  # (here, where it was made: its own)


class _Recording(SavePlanner):
    """Our planner, noting what rank 0's global plan receives and what each rank writes."""

    def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
        self.seen = [(type(p).__name__, len(p.items)) for p in all_plans]
        return super().create_global_plan(all_plans)

    def finish_plan(self, new_plan):  # type: ignore[no-untyped-def]
        self.written = len(new_plan.items)
        return super().finish_plan(new_plan)


def _save_and_load(rank: int, world: int, path: str) -> tuple[Any, int, int, bool]:
    torch.manual_seed(rank)
    rows = 7  # (uneven: 3, 3, 1 over 3 ranks)
    mine = torch.randn(
        -(-rows // world) if rank < world - 1 else rows - (world - 1) * -(-rows // world), 5
    )
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    shape, stride = torch.Size([rows, 5]), (5, 1)
    sd = {
        "w": DTensor.from_local(mine, mesh, [Shard(0)], shape=shape, stride=stride),
        "step": torch.tensor(3.0),
        "note": {"lr": 0.1},
    }
    planner = _Recording()
    dcp.save(sd, checkpoint_id=path, planner=planner)
    back = {
        "w": DTensor.from_local(
            torch.zeros_like(mine), mesh, [Shard(0)], shape=shape, stride=stride
        )
    }
    back.update(step=torch.tensor(0.0), note={"lr": 0.0})
    dcp.load(back, checkpoint_id=path)
    same = torch.equal(back["w"].to_local(), mine) and back["step"].item() == 3.0
    w = dist.barrier(async_op=True)  # (the last collective's Work kept alive: pytorch#190489)
    w.wait()
    return (
        getattr(planner, "seen", None),
        planner.written,
        mine.shape[0],
        same and back["note"] == {"lr": 0.1},
    )


def test_a_real_save_sends_rank_0_no_write_items(tmp_path):
    out = run_on_ranks(_save_and_load, 3, str(tmp_path / "ckpt"))
    seen = out[0][0]
    assert seen == [("Received", 0)] * 3, seen
    assert all(o[0] is None for o in out[1:])  # (the global plan is rank 0's alone)
    assert all(o[3] for o in out), "a rank's tensors differ after the load"
    # Each rank writes its own shard, and the scalar and the object go to one rank each
    # (DCP's dedup: where the fewest bytes are so far)
    assert sum(o[1] for o in out) == 3 + 2 and all(o[1] >= 1 for o in out), out
    assert os.path.exists(tmp_path / "ckpt" / ".metadata")
