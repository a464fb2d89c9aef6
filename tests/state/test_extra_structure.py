"""``extra`` / ``rank_extra`` values load back as they were saved, whatever the fresh object's
``state_dict()`` holds: keys it lacks (a dict that fills up in training, a fresh torch
optimizer's state), non-string keys, empty containers and OrderedDicts, each with its type;
tensors it lacks come back as new tensors, an expanded one as a contiguous one, its own
DTensors reshard. A key the object has but the step lacks is a mismatch; two entries that DCP
would store under one key are refused by ``save()``; a step written without the record of its
structure (muon-ckpt 0.2) loads into the object's own structure, or names what it cannot."""

from __future__ import annotations

import collections
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from muon_ckpt import CheckpointError, CheckpointManager, CheckpointMismatchError, MemoryOptions
from muon_ckpt.state._structure import RECORD
from muon_ckpt.store import Storage
from tests._crafted import StepEditor, craft_step
from tests._dist import run_on_ranks


class Holder:
    """A Stateful whose ``state_dict()`` is its value."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return self.value

    def load_state_dict(self, value):
        self.value = value


class Refuses:
    """A Stateful that takes no state (its ``load_state_dict`` fails after the read)."""

    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, value):
        raise ValueError("this object cannot take the state")


def same(a, b) -> bool:
    """``a`` and ``b`` equal with the same types all the way down, dict keys (their types
    and order) included; tensors bitwise, with their dtype and shape."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        ka, kb = list(a), list(b)
        keys_same = [(type(k), k) for k in ka] == [(type(k), k) for k in kb]
        return keys_same and all(same(a[k], b[k]) for k in ka)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _trained() -> dict:
    """A state that grew in training: nothing of it is in a fresh object's state_dict()."""
    return {
        "pos": {"shard-a": 40, "shard-b": 7},
        "by_worker": {0: 40, 1: 7},
        None: 1,
        (1, 2): [3],
        "empty": {},
        "od": collections.OrderedDict([("b", 1), ("a", 2)]),
        "mixed": [torch.arange(3), {"a": 1}, []],
        "moments": {5: torch.full((2,), 0.5, dtype=torch.bfloat16)},
    }


@pytest.mark.parametrize("where", ["extra", "rank_extra"])
@pytest.mark.parametrize("async_save", [False, True])
def test_keys_a_fresh_object_lacks_load_with_their_types(tmp_path, where, async_save):
    url = str(tmp_path / "run")
    saved = _trained()
    saved_np = {**saved, "np": {np.int64(3): "x"}}  # NumPy keys as the Python numbers
    with CheckpointManager(
        url, model=nn.Linear(2, 2), async_save=async_save, **{where: {"h": Holder(saved_np)}}
    ) as mgr:
        mgr.save(10)
    want = {**saved, "np": {3: "x"}}

    fresh = Holder({})  # the restart: nothing trained yet
    assert CheckpointManager(url, model=nn.Linear(2, 2), **{where: {"h": fresh}}).load() == 10
    assert same(fresh.value, want), fresh.value

    # the same keys already there (zeros): each comes back once, never beside a str twin
    zeros = Holder({**want, "by_worker": {0: 0, 1: 0}, "np": {3: "y"}})
    assert CheckpointManager(url, model=nn.Linear(2, 2), **{where: {"h": zeros}}).load() == 10
    assert same(zeros.value, want), zeros.value


def _adamw_run(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 50))
    main = torch.optim.SGD(model[1].parameters(), lr=0.1, momentum=0.9)  # stands for Muon
    adamw = torch.optim.AdamW([*model[0].parameters(), *model[2].parameters()], lr=1e-3)
    return model, main, adamw


def _train(model, opts, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randint(0, 50, (8,), generator=g)).logsumexp(-1).mean().backward()
        for o in opts:
            o.step()
            o.zero_grad()


def test_a_second_torch_optimizer_in_extra_resumes_bitwise(tmp_path):
    """The usual Muon set-up keeps AdamW for embeddings and head as a second optimizer, in
    ``extra``: a restart's fresh AdamW gets every moment and step count back, bitwise, and
    trains on exactly as the uninterrupted run."""
    url = str(tmp_path / "run")
    model, main, adamw = _adamw_run()
    _train(model, (main, adamw), 5, seed=1)
    CheckpointManager(url, model=model, optimizer=main, extra={"adamw": adamw}).save(5)

    model2, main2, adamw2 = _adamw_run(seed=3)  # fresh: no state, other weights
    mgr = CheckpointManager(url, model=model2, optimizer=main2, extra={"adamw": adamw2})
    assert mgr.load() == 5 and not mgr.last_load_report
    want, got = adamw.state_dict(), adamw2.state_dict()
    assert same(got["state"], want["state"]) and got["param_groups"] == want["param_groups"]
    _train(model, (main, adamw), 3, seed=2)
    _train(model2, (main2, adamw2), 3, seed=2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_failed_load_leaves_a_fresh_optimizer_in_extra_without_state(tmp_path):
    url = str(tmp_path / "run")
    model, main, adamw = _adamw_run()
    _train(model, (main, adamw), 2, seed=1)
    extra = {"adamw": adamw, "z": Holder({"n": 1})}
    CheckpointManager(url, model=model, optimizer=main, extra=extra).save(2)

    model2, _, adamw2 = _adamw_run()
    mgr = CheckpointManager(url, model=model2, extra={"adamw": adamw2, "z": Refuses()})
    with pytest.raises((CheckpointError, ValueError), match="cannot take the state"):
        mgr.load()
    assert adamw2.state_dict()["state"] == {}
    mgr = CheckpointManager(url, model=model2, extra={"adamw": adamw2, "z": Holder({})})
    assert mgr.load() == 2
    assert same(adamw2.state_dict()["state"], adamw.state_dict()["state"])


@pytest.mark.parametrize("where", ["extra", "rank_extra"])
def test_a_key_the_object_has_but_the_step_lacks_is_a_mismatch(tmp_path, where):
    url = str(tmp_path / "run")
    CheckpointManager(url, model=nn.Linear(2, 2), **{where: {"h": Holder({"a": 1})}}).save(1)
    h = Holder({"a": 0, "b": 2})
    with pytest.raises(CheckpointMismatchError, match=r"h\.b'\] that the checkpoint does not"):
        CheckpointManager(url, model=nn.Linear(2, 2), **{where: {"h": h}}).load()
    mgr = CheckpointManager(url, model=nn.Linear(2, 2), **{where: {"h": h}})
    assert mgr.load(strict=False) == 1
    assert mgr.last_load_report.missing == [f"{where}{'.0' * (where == 'rank_extra')}.h"]
    assert h.value == {"a": 0, "b": 2}


@pytest.mark.parametrize("value", [{0: 1, "0": 2}, {"a": {"b": 1}, "a.b": 2}])
def test_two_entries_dcp_stores_under_one_key_are_refused_at_save(tmp_path, value):
    url = str(tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"extra\['h'\] has two entries stored as the key"):
        CheckpointManager(url, model=nn.Linear(2, 2), extra={"h": Holder(value)}).save(1)
    assert CheckpointManager(url).steps() == []


class Workers:
    """A per-worker count built by expanding one element (every element shares memory)."""

    def __init__(self) -> None:
        self.seen = torch.zeros(1, dtype=torch.int64).expand(4)

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state) -> None:
        self.seen = state["seen"]


@pytest.mark.parametrize("where", ["extra", "rank_extra"])
def test_an_expanded_tensor_in_extra_saves_verifies_and_loads(tmp_path, where):
    url = str(tmp_path / "run")
    w = Workers()
    w.seen = torch.full((1,), 7, dtype=torch.int64).expand(4)
    with CheckpointManager(url, model=nn.Linear(2, 2), **{where: {"w": w}}) as mgr:
        mgr.save(1)
    verify = [sys.executable, "-m", "muon_ckpt.cli", "verify", url]
    assert subprocess.run(verify, capture_output=True, timeout=300).returncode == 0

    fresh = Workers()
    with CheckpointManager(url, model=nn.Linear(2, 2), **{where: {"w": fresh}}) as mgr:
        assert mgr.load() == 1
        assert same(fresh.seen, torch.full((4,), 7, dtype=torch.int64))
        mgr.save(2)  # and it saves on from there


def _without_records(ed: StepEditor) -> None:
    """The step as muon-ckpt 0.2 wrote it: DCP's map of key paths, no structure records."""
    pd = ed.md.planner_data
    for k in [k for k in pd if isinstance(k, str) and k.startswith(RECORD)]:
        del pd[k]


def test_a_step_without_structure_records_loads_into_the_objects_structure(tmp_path):
    """Steps of muon-ckpt 0.2 record no structure: their values load into the keys the
    object's state_dict() has, each once with its own type; keys it lacks cannot be typed,
    so a strict load names them and ``strict=False`` loads the rest and reports them."""
    url = str(tmp_path / "run")
    model, main, adamw = _adamw_run()
    _train(model, (main, adamw), 3, seed=1)
    CheckpointManager(url, model=model, extra={"adamw": adamw, "d": Holder({0: 40})}).save(3)
    craft_step(Storage(url), 3, _without_records)

    model2, _, adamw2 = _adamw_run()
    _train(model2, (adamw2,), 1, seed=9)  # its state now has every key
    d = Holder({0: 0})
    assert CheckpointManager(url, model=model2, extra={"adamw": adamw2, "d": d}).load() == 3
    assert same(adamw2.state_dict()["state"], adamw.state_dict()["state"])
    assert same(d.value, {0: 40})

    _, _, fresh = _adamw_run()
    extra = {"adamw": fresh, "d": Holder({0: 0})}
    with pytest.raises(CheckpointMismatchError, match=r"did not record the types of dict keys"):
        CheckpointManager(url, model=nn.Sequential(*model2), extra=extra).load()
    mgr = CheckpointManager(url, model=nn.Sequential(*model2), extra=extra)
    assert mgr.load(strict=False) == 3
    assert "extra.adamw.state.0.exp_avg" in mgr.last_load_report.unexpected
    assert fresh.state_dict()["state"] == {}


def _dtensor_save(rank: int, world: int, url: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    t = distribute_tensor(full, mesh, [Shard(0)])
    CheckpointManager(url, model=nn.Linear(2, 2), extra={"h": Holder({"d": t})}).save(1)


def _dtensor_load(rank: int, world: int, url: str) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    mine = distribute_tensor(torch.zeros(4, 6), mesh, [Shard(1)])
    h = Holder({"d": mine})
    assert CheckpointManager(url, model=nn.Linear(2, 2), extra={"h": h}).load() == 1
    fresh = Holder({})
    assert CheckpointManager(url, model=nn.Linear(2, 2), extra={"h": fresh}).load() == 1
    got = h.value["d"]
    return got is mine, got.placements, got.full_tensor(), fresh.value["d"]


def test_dtensors_in_extra_reshard_and_ones_the_object_lacks_come_back_whole(tmp_path):
    url = str(tmp_path / "run")
    run_on_ranks(_dtensor_save, 2, url)
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for same_object, placements, got, whole in run_on_ranks(_dtensor_load, 2, url):
        assert same_object and str(placements) == "(Shard(dim=1),)"
        assert torch.equal(got, full)
        assert type(whole) is torch.Tensor and torch.equal(whole, full)


def _per_rank(rank: int) -> dict:
    """A rank's own state that grew in training: int and tuple keys, an empty dict."""
    return {rank: 10 * rank, "w": {(rank,): torch.full((2,), rank)}, "empty": {}}


def _tiered(rank: int, world: int, url: str, mem: str) -> tuple:
    """Both tiers hand back the structure: step 1 saved to the memory tier only, flushed to
    the url at close; a fresh object loads it from the tier, then from the url alone."""

    def manager(memory: bool, h: Holder, r: Holder) -> CheckpointManager:
        tier = MemoryOptions(interval=1, dir=f"{mem}/node{rank}", node_size=1) if memory else None
        kw = {"memory": tier} if memory else {}
        return CheckpointManager(
            url, model=nn.Linear(2, 2), interval=5, extra={"h": h}, rank_extra={"r": r}, **kw
        )

    mgr = manager(True, Holder(_trained()), Holder(_per_rank(rank)))
    assert mgr.save(1) and mgr.wait() == 1
    mgr.close()  # the flush: each rank's part, its records included, to the url
    got = []
    for memory in (True, False):
        h, r = Holder({}), Holder({})
        mgr = manager(memory, h, r)
        assert mgr.load() == 1
        got.append((mgr.last_load_tier, h.value, r.value))
        if memory:
            mgr._saves.memory.mark = None  # (nothing to flush: this manager saved nothing)
        mgr.close()
    return got


def test_the_memory_tier_and_its_flush_keep_the_structure(tmp_path):
    """The records of each rank's part reach the step the flush merges from every part."""
    url, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    for rank, got in enumerate(run_on_ranks(_tiered, 2, url, mem)):
        assert [tier for tier, _, _ in got] == ["memory", "storage"], rank
        for _, h, r in got:
            assert same(h, _trained()), h
            assert same(r, _per_rank(rank)), r
