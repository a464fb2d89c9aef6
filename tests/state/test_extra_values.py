"""Python values a step holds come back from a load: NumPy values in ``extra`` / ``rank_extra``
(NumPy's RNG state, scalars, arrays) save and load in new processes, as the values the docs
name (scalars as Python numbers, arrays as tensors, the RNG state as a tuple
``np.random.set_state`` takes); a value a load could not read back (an instance of a class of
the user's) is refused by ``save()`` naming its key, before anything is written."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from muon_ckpt import CheckpointError, CheckpointManager
from tests._dist import run_on_ranks


class Holder:
    """A Stateful whose ``state_dict()`` is its value."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return self.value

    def load_state_dict(self, value):
        self.value = value


class Opaque:
    """A class of the user's: ``torch.load(weights_only=True)`` refuses it."""

    def __init__(self, n):
        self.n = n


def _numpy_state(rank: int) -> tuple[dict, dict, np.ndarray]:
    """This rank's NumPy values, and the draws its RNG state gives next."""
    rs = np.random.RandomState(10 + rank)
    state = rs.get_state()
    after = rs.random_sample(5)
    shared = {
        "position": np.int64(40),
        "metric": np.float32(0.1),
        "flag": np.bool_(True),
        "order": np.arange(6, dtype=np.int32)[::-1],
        "nested": [np.float64(2.5), (np.int8(-3), "x")],
    }
    own = {"rng": state, "seen": np.uint64(2**63 + rank), "weights": np.full(3, rank, np.float16)}
    return shared, own, after


def _save(rank: int, world: int, url: str) -> None:
    shared, own, _ = _numpy_state(rank)
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(
        url,
        model=model,
        extra={"data": Holder(shared)},
        rank_extra={"mine": Holder(own)},
        async_save=True,
    ) as mgr:
        mgr.save(1)


def _load(rank: int, world: int, url: str) -> dict:
    model = torch.nn.Linear(2, 2)
    fresh, own, _ = _numpy_state(99)  # the same structure, other values
    data, mine = Holder(fresh), Holder(own)
    with CheckpointManager(
        url, model=model, extra={"data": data}, rank_extra={"mine": mine}
    ) as mgr:
        step = mgr.load()
    np.random.set_state(mine.value["rng"])  # usable as NumPy's own
    out = {
        "step": step,
        "data": data.value,
        "mine": mine.value,
        "draws": np.random.random_sample(5),
    }
    return _picklable(out)


def _picklable(v):
    """``v`` with its tensors as (dtype name, NumPy array): pickle cannot carry a uint32
    tensor back to the test process (torch 2.13's ``Tensor.__reduce_ex__``)."""
    if isinstance(v, torch.Tensor):
        return ("tensor", str(v.dtype), v.numpy())
    if isinstance(v, dict):
        return {k: _picklable(x) for k, x in v.items()}
    if type(v) in (list, tuple):
        return type(v)(_picklable(x) for x in v)
    return v


def test_numpy_values_in_extra_and_rank_extra_load_in_new_processes(tmp_path):
    url = str(tmp_path / "run")
    run_on_ranks(_save, 2, url)
    outs = run_on_ranks(_load, 2, url)
    for rank, out in enumerate(outs):
        shared, own, after = _numpy_state(rank)
        assert out["step"] == 1
        got = out["data"]
        assert type(got["position"]) is int and got["position"] == 40
        assert type(got["metric"]) is float and got["metric"] == float(np.float32(0.1))
        assert type(got["flag"]) is bool and got["flag"] is True
        assert got["order"][:2] == ("tensor", "torch.int32")
        assert np.array_equal(got["order"][2], shared["order"])
        assert got["nested"] == [2.5, (-3, "x")]
        mine = out["mine"]
        name, keys, pos, has_gauss, cached = mine["rng"]
        want = own["rng"]
        assert (name, pos, has_gauss, cached) == (want[0], want[2], want[3], want[4])
        assert keys[:2] == ("tensor", "torch.uint32") and np.array_equal(keys[2], want[1])
        assert np.array_equal(out["draws"], after)  # np.random.set_state took it
        assert type(mine["seen"]) is int and mine["seen"] == 2**63 + rank
        assert mine["weights"][:2] == ("tensor", "torch.float16")
        assert np.array_equal(mine["weights"][2], own["weights"])


def _steps(url: str) -> list[str]:
    return sorted(p for p in os.listdir(url) if p.startswith("step-"))


@pytest.mark.parametrize("async_save", [False, True])
def test_a_value_a_load_cannot_read_is_refused_at_save_naming_its_key(tmp_path, async_save):
    url = str(tmp_path / "run")
    model = torch.nn.Linear(2, 2)
    state = Holder({"epoch": 1, "sampler": {"order": [3, 1], "gen": Opaque(7)}})
    own = Holder({"pos": 5})
    mgr = CheckpointManager(
        url, model=model, extra={"data": state}, rank_extra={"mine": own}, async_save=async_save
    )
    state.value["sampler"]["gen"] = 0
    mgr.save(1)
    mgr.wait()
    state.value["sampler"]["gen"] = Opaque(8)
    with pytest.raises(
        CheckpointError, match=r"step 2: extra\['data'\]\['sampler'\]\['gen'\]"
    ) as e:
        mgr.save(2)
    assert "tests.state.test_extra_values.Opaque" in str(e.value)
    assert "nothing was written" in str(e.value)
    assert _steps(url) == ["step-00000001"] and mgr.steps() == [1]
    state.value["sampler"]["gen"] = 0
    own.value = {"pos": (1, np.dtype("float32"))}  # a NumPy dtype: no conversion, refused
    with pytest.raises(CheckpointError, match=r"rank_extra\['mine'\]\['pos'\]\[1\] of rank 0"):
        mgr.save(2)
    own.value = {"pos": np.array(["a", "b"])}  # strings: no tensor dtype
    with pytest.raises(CheckpointError, match=r"rank_extra\['mine'\]\['pos'\] of rank 0"):
        mgr.save(2)
    state.value["sampler"]["gen"] = lambda: 0  # not even picklable
    with pytest.raises(
        CheckpointError, match=r"extra\['data'\]\['sampler'\]\['gen'\].*(?i:pickle)"
    ):
        mgr.save(2)
    state.value["sampler"]["gen"] = 0
    own.value = {"pos": 6}
    assert mgr.save(2)  # the job saves on once the value is one a load reads
    mgr.close()
    assert _steps(url) == ["step-00000001", "step-00000002"]
    got, mine = Holder({"epoch": 0, "sampler": {"order": [0, 0], "gen": 1}}), Holder({"pos": 0})
    with CheckpointManager(url, model=model, extra={"data": got}, rank_extra={"mine": mine}) as m:
        assert m.load() == 2
    assert got.value == {"epoch": 1, "sampler": {"order": [3, 1], "gen": 0}} and mine.value == {
        "pos": 6
    }


class WithExtraState(torch.nn.Linear):
    def __init__(self):
        super().__init__(2, 2)
        self.counter = np.int64(0)

    def get_extra_state(self):
        return {"counter": self.counter, "scale": np.float32(0.5)}

    def set_extra_state(self, state):
        self.counter = state["counter"]
        self.scale = state["scale"]


def test_numpy_hyperparameters_and_module_extra_state_load(tmp_path):
    url = str(tmp_path / "run")
    model = WithExtraState()
    model.counter = np.int64(12)
    opt = torch.optim.SGD(model.parameters(), lr=np.float64(0.25), momentum=np.float32(0.5))
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        mgr.save(1)
    again = WithExtraState()
    opt2 = torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.0)
    with CheckpointManager(url, model=again, optimizer=opt2) as mgr:
        assert mgr.load() == 1
    assert again.counter == 12 and type(again.counter) is int and again.scale == 0.5
    group = opt2.param_groups[0]
    assert (group["lr"], group["momentum"]) == (0.25, 0.5) and type(group["lr"]) is float


def test_a_blob_converts_numpy_and_refuses_what_a_load_cannot_read():
    """``state.pack``, the integrations' per-rank blob (Lightning's callbacks, the Trainer's
    RNG states): NumPy values come back converted, anything else unreadable is refused at
    once, naming where it is."""
    from muon_ckpt.state import pack, unpack

    rng = np.random.RandomState(3)
    state = {"callbacks": {"Counter": {"n": np.int64(4), "rng": rng.get_state()}}}
    back = unpack(pack(state, "blob"))
    assert back["callbacks"]["Counter"]["n"] == 4
    again = np.random.RandomState(0)
    again.set_state(back["callbacks"]["Counter"]["rng"])
    assert again.random_sample() == rng.random_sample()
    state["callbacks"]["Counter"]["gen"] = Opaque(1)
    with pytest.raises(CheckpointError, match=r"blob\['callbacks'\]\['Counter'\]\['gen'\] is a"):
        pack(state, "blob")


@pytest.mark.parametrize("async_save", [False, True])
def test_zero_dim_tensors_in_extra_and_rank_extra_save_and_load(tmp_path, async_save):
    """A 0-dim tensor (a counter, a loss scale) in ``extra`` is staged and digested like any
    other: ``save()`` commits it and ``load()`` gives it back, dtype and shape included."""
    url = str(tmp_path / "run")
    model = torch.nn.Linear(2, 2)
    saved = Holder({"n": torch.tensor(3), "scale": torch.tensor(2.5, dtype=torch.bfloat16)})
    mgr = CheckpointManager(
        url,
        model=model,
        extra={"c": saved},
        rank_extra={"r": Holder(torch.tensor(7.0))},
        async_save=async_save,
    )
    assert mgr.save(1, force=True)
    mgr.close()
    got = Holder({"n": torch.tensor(0), "scale": torch.tensor(0.0, dtype=torch.bfloat16)})
    own = Holder(torch.tensor(0.0))
    mgr = CheckpointManager(url, model=model, extra={"c": got}, rank_extra={"r": own})
    assert mgr.load() == 1
    mgr.close()
    for k, v in saved.value.items():
        assert got.value[k].shape == () and got.value[k].dtype == v.dtype
        assert torch.equal(got.value[k], v)
    assert torch.equal(own.value, torch.tensor(7.0))
