"""A multi-rank load's local plan crosses DCP's round trip through rank 0 (every rank's plan
gathered, rank 0's global plan, each plan scattered back) as a key, not its read items: rank 0
sees stand-ins without items and hands them back, each rank reads its own items. Where rank
0's global step is not provably the identity (a planner or reader that is not ours), the plans
travel whole, as DCP sends them; a plan that comes back changed fails the load; nothing stays
kept under a key once a load ends, failed or not.

Real processes (gloo) and real files; what crosses the wire is seen where torch's object
collectives pickle and unpickle (``_object_to_tensor``, ``_tensor_to_object``), in each rank.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan

from muon_ckpt import CheckpointCorruptError, CheckpointError, _plans
from muon_ckpt.load._planner import KeyedPlan, SafeLoadPlanner, StandIn, keyed
from muon_ckpt.load._reader import VerifyingReader
from muon_ckpt.store import open_storage
from tests._ckpt import biggest_data_file, flip_byte
from tests._dist import run_on_ranks

_LAYERS = 24  # (48 tensors: a plan of ~7 KB when its items travel, ~0.1 KB as a key)


def _model(world: int, seed: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(_LAYERS)])
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model


def _local(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.to_local().clone() for k, v in model.state_dict().items()}


@contextlib.contextmanager
def _wire() -> Iterator[tuple[list, list]]:
    """The load plans torch's object collectives pickle in this process (class, items,
    bytes) and unpickle (class, items)."""
    import torch.distributed.distributed_c10d as c10d

    sent: list[tuple[str, int, int]] = []
    got: list[tuple[str, int]] = []
    to_tensor, to_object = c10d._object_to_tensor, c10d._tensor_to_object

    def spy_to_tensor(obj: Any, *args: Any) -> Any:
        out = to_tensor(obj, *args)
        if isinstance(obj, LoadPlan):
            sent.append((type(obj).__name__, len(obj.items), out[0].numel()))
        return out

    def spy_to_object(*args: Any) -> Any:
        obj = to_object(*args)
        if isinstance(obj, LoadPlan):
            got.append((type(obj).__name__, len(obj.items)))
        return obj

    c10d._object_to_tensor, c10d._tensor_to_object = spy_to_tensor, spy_to_object
    try:
        yield sent, got
    finally:
        c10d._object_to_tensor, c10d._tensor_to_object = to_tensor, to_object


# ---------------------------------------------------------------------- through the manager
def _body_save(rank: int, world: int, url: str) -> None:
    from muon_ckpt import CheckpointManager

    with CheckpointManager(url, model=_model(world, 0)) as m:
        m.save(1)


def _body_load(rank: int, world: int, url: str) -> tuple[list, list, int, list[str]]:
    from muon_ckpt import CheckpointManager

    want = _local(_model(world, 0))
    model = _model(world, 1)
    with _wire() as (sent, got), CheckpointManager(url, model=model) as m:
        assert m.load() == 1
    have = _local(model)
    differ = [k for k, v in want.items() if not torch.equal(v, have[k])]
    return sent, got, _plans.held(), differ


@pytest.fixture(scope="module")
def saved_on_2(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("round_trip") / "run")
    run_on_ranks(_body_save, 2, url)
    return url


def test_each_rank_s_load_plan_crosses_rank_0_as_a_key_and_reads_its_own_items(saved_on_2):
    (sent0, got0, held0, differ0), (sent1, got1, held1, differ1) = run_on_ranks(
        _body_load, 2, saved_on_2
    )
    assert differ0 == differ1 == [], (differ0, differ1)  # (each rank read its own shards)
    # Each plan pickled (gathered; rank 0: scattered too) is a key of about 100 bytes,
    # however many items it holds
    assert all(size < 512 for *_, size in sent0 + sent1), (sent0, sent1)
    assert [s[0] for s in sent0] == ["KeyedPlan", "KeyedPlan", "StandIn"], sent0
    assert [s[0] for s in sent1] == ["KeyedPlan"], sent1
    assert min(sent0[0][1], sent1[0][1]) >= 2 * _LAYERS, (sent0, sent1)
    # Rank 0 saw its own plan and a stand-in for rank 1's, then each rank got its own back
    own = got0[0][1]
    assert got0 == [("KeyedPlan", own), ("StandIn", 0), ("KeyedPlan", own)], got0
    assert got1 == [("KeyedPlan", sent1[0][1])], got1
    assert held0 == held1 == 0  # (nothing kept once the load ended)


def _body_corrupt(rank: int, world: int, url: str) -> tuple[int, str]:
    from muon_ckpt import CheckpointManager

    with CheckpointManager(url, model=_model(world, 1)) as m:
        try:
            m.load(step=1)
        except CheckpointCorruptError as e:  # (held while the error and its frames live)
            return _plans.held(), type(e).__name__
    return _plans.held(), "loaded"


def test_nothing_stays_kept_under_a_key_after_a_failed_load(tmp_path):
    url = str(tmp_path / "run")
    run_on_ranks(_body_save, 2, url)
    storage = open_storage(url)
    name = biggest_data_file(storage, 1)
    flip_byte(os.path.join(url, "step-00000001", name), 600)
    out = run_on_ranks(_body_corrupt, 2, url)
    assert out == [(0, "CheckpointCorruptError")] * 2, out


# ---------------------------------------------------------------------- DCP with others'
class _Counting(SafeLoadPlanner):
    """Not ours at rank 0's global step: it looks at the plans (their items counted)."""

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        self.seen = [len(p.items) for p in global_plan]
        return global_plan


class _Renaming(VerifyingReader):
    """A reader whose global step makes new plans: DCP's round trip, items and all."""

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return [LoadPlan(list(p.items), p.storage_data, p.planner_data) for p in plans]


def _body_dcp(rank: int, world: int, path: str, kind: str) -> tuple[list, list, list, list]:
    import torch.distributed.checkpoint as dcp

    dcp.save(_model(world, 0).state_dict(), checkpoint_id=path)
    want = _local(_model(world, 0))
    model = _model(world, 1)
    md = FileSystemReader(path).read_metadata()
    reader_cls = _Renaming if kind == "reader" else VerifyingReader
    reader = reader_cls(open_storage(path), None, metadata=md, rank=rank, world_size=world)
    planner = (_Counting if kind == "planner" else SafeLoadPlanner)(reader=reader)
    sd = model.state_dict()
    with _wire() as (sent, got):
        dcp.load(sd, storage_reader=reader, planner=planner)
    have = {k: v.to_local() for k, v in sd.items()}
    differ = [k for k, v in want.items() if not torch.equal(v, have[k])]
    return sent, got, getattr(planner, "seen", []), differ


@pytest.mark.parametrize("kind", ["planner", "reader"])
def test_a_global_step_that_is_not_ours_gets_every_plan_whole(tmp_path, kind):
    out = run_on_ranks(_body_dcp, 2, str(tmp_path / "dcp"), kind)
    (sent0, got0, seen, differ0), (sent1, _, _, differ1) = out
    assert differ0 == differ1 == [], (differ0, differ1)
    assert all(name == "LoadPlan" for name, _, _ in sent0 + sent1), sent0 + sent1
    items1 = sent1[0][1]
    assert items1 >= 2 * _LAYERS and ("LoadPlan", items1) in got0, (sent1, got0)
    if kind == "planner":
        assert seen == [sent0[0][1], items1], seen


# ---------------------------------------------------------------------- one process
def _pickled_plan_bytes(ranks: int, tensors: int) -> int:
    """The bytes rank 0 unpickles in the gather of ``ranks`` plans of ``tensors`` reads each
    (the other ranks' as from other processes) and pickles for the scatter."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    def plan(r: int) -> KeyedPlan:
        size = torch.Size([4, 8])
        at = [MetadataIndex(f"w{i}", torch.Size([4 * r, 0]), r) for i in range(tensors)]
        zero = torch.Size([0, 0])
        return keyed(LoadPlan([ReadItem(LoadItemType.TENSOR, a, zero, a, zero, size) for a in at]))

    plans = [plan(r) for r in range(ranks)]
    sent = list(map(pickle.dumps, plans))
    for p in plans[1:]:
        _plans.forget(p.key)
    got = list(map(pickle.loads, sent))
    assert got[0] is plans[0] and all(type(p) is StandIn and not p.items for p in got[1:])
    back = list(map(pickle.dumps, got))
    assert pickle.loads(back[0]) is plans[0]
    _plans.forget(plans[0].key)
    return sum(map(len, sent)) + sum(map(len, back))


def test_rank_0_s_round_trip_grows_with_the_ranks_not_with_their_items():
    """Pinned by the bytes pickled, not by counting calls: pickle's work is in C, where
    counting Python calls sees none of it."""
    n = _pickled_plan_bytes(64, 16)
    assert _pickled_plan_bytes(64, 256) == n  # (16 times the items: the same bytes)
    assert _pickled_plan_bytes(128, 16) <= 2.05 * n
    assert _plans.held() == 0


def test_a_plan_that_comes_back_as_anything_but_itself_fails_the_load():
    planner = SafeLoadPlanner()
    planner._sent = mine = keyed(LoadPlan([]))
    key = mine.key
    assert pickle.loads(pickle.dumps(mine)) is mine  # (in the process that made it: itself)
    with pytest.raises(CheckpointError, match="did not hand this rank its own plan back"):
        planner.finish_plan(pickle.loads(pickle.dumps(StandIn([], key=key))))
    assert _plans.recall(key) is None  # (forgotten, failed or not)
    planner._sent = mine = keyed(LoadPlan([]))
    with pytest.raises(CheckpointError, match="got LoadPlan with 0"):
        planner.finish_plan(LoadPlan([]))
    planner._sent = mine = keyed(LoadPlan([]))
    assert planner.finish_plan(mine) is mine and _plans.held() == 0


def test_a_stand_in_given_other_items_on_rank_0_comes_back_as_a_stand_in():
    import dataclasses

    mine = keyed(LoadPlan([]))
    # (the key unknown: another process's plan; then rank 0 changes its items or not)
    _plans.forget(mine.key)
    seen = pickle.loads(pickle.dumps(mine))
    assert type(seen) is StandIn
    _plans.forget(mine.key)
    key2 = _plans.remember(mine)  # (the owner again, under the stand-in's key)
    seen.key = key2
    assert pickle.loads(pickle.dumps(seen)) is mine
    for items in ([], ()):  # (other items, none included: a changed plan)
        moved = dataclasses.replace(seen, items=items)
        assert type(pickle.loads(pickle.dumps(moved))) is StandIn
    sd = dataclasses.replace(seen, storage_data="s")
    back = pickle.loads(pickle.dumps(sd))
    assert type(back) is KeyedPlan and back.items is mine.items and back.storage_data == "s"
    _plans.forget(key2)


def test_a_planner_with_a_reader_that_is_not_ours_plans_as_dcp_does(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path), no_dist=True)
    md = FileSystemReader(str(tmp_path)).read_metadata()
    ours = VerifyingReader(open_storage(str(tmp_path)), None, metadata=md)
    theirs = FileSystemReader(str(tmp_path))
    kinds = {}
    for name, planner in {
        "ours": SafeLoadPlanner(reader=ours),
        "no reader": SafeLoadPlanner(),
        "DCP's reader": SafeLoadPlanner(reader=theirs),
        "a renaming reader": SafeLoadPlanner(reader=_Renaming(ours.step, None, metadata=md)),
        "a planner not ours": _Counting(reader=ours),
    }.items():
        planner.set_up_planner({"w": torch.zeros(4)}, md, True)
        kinds[name] = type(planner.create_local_plan()).__name__
        planner.forget()
    assert kinds == {
        "ours": "KeyedPlan",
        "no reader": "LoadPlan",
        "DCP's reader": "LoadPlan",
        "a renaming reader": "LoadPlan",
        "a planner not ours": "LoadPlan",
    }
    gc.collect()
    assert _plans.held() == 0
