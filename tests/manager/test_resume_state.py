"""The resume contract, what a load puts back: ``extra`` the same on every rank and
``rank_extra`` per rank; keys free of wrapper prefixes (compiled, DDP, activation
checkpointing, and the prefixed keys of older checkpoints); relaxed (``strict=False``) and
partial (``parts``) loads; hyperparameters stored once per group and following their params;
a module's extra state (``get_extra_state``), whatever its kind.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from muon_ckpt import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
)
from muon_ckpt.store import Storage
from tests._ckpt import TinyNet, make_muon, muon_state_sd, train, write_step
from tests._dist import run_on_ranks, run_script
from tests.conftest import assert_same, tiny_run, tiny_snapshot, tiny_train
from tests.manager._resume import Counter, FailsToApply, Records, flip_byte_in, largest_file


# ---------------------------------------------------------------------- per-rank state
def _body_rank_extra(rank, world_size, url, phase):
    model, opt = tiny_run()
    mine = Counter(pos=100 + rank)
    mine.seen[:] = rank
    mgr = CheckpointManager(url, model=model, optimizer=opt, rank_extra={"data": mine})
    if phase == "save":
        # Per-rank values under extra (shared) are refused, before anything is written.
        wrong = CheckpointManager(url, model=model, optimizer=opt, extra={"data": Counter(rank)})
        with pytest.raises(CheckpointError) as ei:
            wrong.save(1)
        assert wrong.steps() == []
        tiny_train(model, opt, 1)
        mgr.save(1)
        return str(ei.value)
    mine.pos, mine.seen[:] = -1, -1.0
    try:
        mgr.load()
    except CheckpointMismatchError as e:
        msg = str(e)
        assert mine.pos == -1  # nothing loaded
        mgr.load(elastic=True)  # everything but rank_extra
        return msg, mine.pos, tiny_snapshot(model, opt)
    return None, (mine.pos, mine.seen.tolist()), tiny_snapshot(model, opt)


def test_extra_must_match_across_ranks_and_rank_extra_is_per_rank(tmp_path):
    url = str(tmp_path / "run")
    for msg in run_on_ranks(_body_rank_extra, 2, url, "save"):
        assert "extra['data'] differs between ranks [0] vs [1]" in msg and "rank_extra" in msg
    (e0, p0, s0), (e1, p1, s1) = run_on_ranks(_body_rank_extra, 2, url, "load")
    assert e1 is None and all(torch.equal(s0[k], s1[k]) for k in s0)
    assert e0 is None and p0 == (100, [0.0] * 3) and p1 == (101, [1.0] * 3)
    (msg, pos, snap1) = _body_rank_extra(0, 1, url, "load")
    assert "saved on 2 rank(s), this run has 1" in msg and "load(elastic=True)" in msg
    assert pos == -1  # skipped, as asked
    assert_same(snap1, s0)


# ---------------------------------------------------------------------- wrapper prefixes
def test_compiled_and_plain_models_load_each_other(tmp_path):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    compiled = torch.compile(plain)  # state_dict() keys carry "_orig_mod."; nothing compiles
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    plain(torch.randn(2, 4)).sum().backward()
    opt.step()
    CheckpointManager(str(tmp_path / "a"), model=compiled, optimizer=opt).save(1)
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert CheckpointManager(str(tmp_path / "a"), model=fresh, optimizer=opt2).load() == 1
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), fresh.parameters()))
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    # And back: plain save, compiled load.
    CheckpointManager(str(tmp_path / "b"), model=fresh, optimizer=opt2).save(2)
    torch.manual_seed(2)
    again = torch.compile(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)))
    assert CheckpointManager(str(tmp_path / "b"), model=again).load() == 2
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), fresh.parameters()))
    # A checkpoint written with the prefixed keys (muon-ckpt 0.2) still loads.
    old = {f"model._orig_mod.{k}": v.clone() for k, v in plain.state_dict().items()}
    write_step(str(tmp_path / "old"), 3, old)
    torch.manual_seed(3)
    third = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    assert CheckpointManager(str(tmp_path / "old"), model=third).load() == 3
    assert all(torch.equal(a, b) for a, b in zip(third.parameters(), plain.parameters()))


def _body_ddp(rank, world_size, url):
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    ddp = nn.parallel.DistributedDataParallel(inner)
    opt = make_muon(inner)  # names from the inner model; keys from the DDP wrapper
    ddp(torch.randn(2, 4)).sum().backward()
    opt.step()
    CheckpointManager(url, model=ddp, optimizer=opt).save(1)
    return sorted(Storage(url).listdir("step-00000001"))


def test_ddp_checkpoint_loads_into_the_plain_model(tmp_path):
    url = str(tmp_path / "run")
    run_on_ranks(_body_ddp, 1, url)
    from muon_ckpt.store import Catalog

    keys = set(Catalog(Storage(url)).checked(1)[1].state_dict_metadata)
    assert "model.0.weight" in keys and not any("module." in k for k in keys)
    torch.manual_seed(5)
    plain = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    opt = make_muon(plain)
    assert CheckpointManager(url, model=plain, optimizer=opt).load() == 1


# ---------------------------------------------------------------------- relaxed and partial loads
def test_param_moved_to_another_group_loads_with_strict_false(tmp_path):
    url = str(tmp_path / "run")
    model, opt = tiny_run()
    tiny_train(model, opt, 2)
    CheckpointManager(url, model=model, optimizer=opt).save(2)
    # Now second.weight is an AdamW param: its Muon momentum has no AdamW meaning.
    torch.manual_seed(7)
    model2, _ = tiny_run(seed=7)
    from optim.muon import Muon

    mats = [model2.first.weight]
    rest = [model2.first.bias, model2.second.weight, model2.second.bias]
    opt2 = Muon([{"params": mats, "lr": 0.02}, {"params": rest, "use_muon": False, "lr": 1e-3}])
    before = tiny_snapshot(model2, opt2)
    with pytest.raises(CheckpointMismatchError, match=r"second\.weight.*strict=False"):
        CheckpointManager(url, model=model2, optimizer=opt2).load()
    assert_same(tiny_snapshot(model2, opt2), before)
    mgr = CheckpointManager(url, model=model2, optimizer=opt2)
    with Records() as rec:
        assert mgr.load(strict=False) == 2
    report = mgr.last_load_report
    assert "optim.state.second.weight.moment1" in report.missing
    assert "optim.state.second.weight.momentum_buffer" in report.unexpected
    assert any("partially" in m for m in rec.at(logging.WARNING))
    assert torch.equal(model2.second.weight, model.second.weight)  # the model loaded fully
    assert torch.equal(
        opt2.state[model2.first.weight]["momentum_buffer"],
        opt.state[model.first.weight]["momentum_buffer"],
    )
    assert torch.equal(
        opt2.state[model2.first.bias]["moment1"], opt.state[model.first.bias]["moment1"]
    )
    assert not opt2.state[model2.second.weight]["moment1"].any()  # starts fresh
    assert opt2.param_groups[1]["use_muon"] is False  # the group keeps its own kind
    tiny_train(model2, opt2, 1)  # and trains on


def test_load_only_the_model(tmp_path):
    url = str(tmp_path / "run")
    model, opt = tiny_run()
    pos = Counter(3)
    tiny_train(model, opt, 1)
    CheckpointManager(url, model=model, optimizer=opt, extra={"data": pos}).save(1)
    model2, opt2 = tiny_run(seed=3)
    pos2 = Counter(0)
    mgr = CheckpointManager(url, model=model2, optimizer=opt2, extra={"data": pos2})
    assert mgr.load(parts=["model"]) == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert not opt2.state and pos2.pos == 0
    with pytest.raises(ValueError, match=r"parts must be a non-empty subset"):
        mgr.load(parts=("model", "optimizer"))


# ---------------------------------------------------------------------- hyperparameters per group
def test_hyperparameters_are_stored_once_per_group_and_follow_their_params(tmp_path):
    from muon_ckpt.store import Catalog

    url = str(tmp_path / "run")
    model, opt = tiny_run()  # group 0: Muon (first.weight, second.weight); 1: AdamW (biases)
    tiny_train(model, opt, 1)
    opt.param_groups[0]["lr"], opt.param_groups[1]["lr"] = 0.03, 0.004
    CheckpointManager(url, model=model, optimizer=opt).save(1)
    keys = set(Catalog(Storage(url)).checked(1)[1].state_dict_metadata)
    groups = sorted(k for k in keys if k.startswith("optim.param_groups."))
    hparams = [k for k in opt.param_groups[0] if k not in ("params", "names")]
    leads = ("first.weight", "first.bias")
    assert groups == sorted(
        f"optim.param_groups.{lead}.{h}" for lead in leads for h in [*hparams, "params"]
    )
    # Groups in another order here: each gets the values of the group that held its params.
    from optim.muon import Muon

    model2, _ = tiny_run(seed=3)
    mats = [model2.first.weight, model2.second.weight]
    vecs = [model2.first.bias, model2.second.bias]
    opt2 = Muon([{"params": vecs, "use_muon": False, "lr": 9.0}, {"params": mats, "lr": 9.0}])
    assert CheckpointManager(url, model=model2, optimizer=opt2).load() == 1
    assert opt2.param_groups[0]["lr"] == 0.004 and opt2.param_groups[0]["use_muon"] is False
    assert opt2.param_groups[1]["lr"] == 0.03 and opt2.param_groups[1]["use_muon"] is True


def test_per_param_hyperparameters_of_older_checkpoints_still_load(tmp_path):
    url = str(tmp_path / "old")
    torch.manual_seed(0)
    model = TinyNet()
    opt = make_muon(model)
    train(model, opt, 1)
    sd = muon_state_sd(model, opt)  # muon-ckpt 0.2 keys: optim.param_groups.<fqn>.lr per param
    for g, lr in zip(opt.param_groups, (0.05, 0.006), strict=True):
        for n in g["names"]:
            sd[f"optim.param_groups.{n}.lr"] = lr
    write_step(url, 1, sd)
    torch.manual_seed(1)
    model2 = TinyNet()
    opt2 = make_muon(model2)
    assert CheckpointManager(url, model=model2, optimizer=opt2).load() == 1
    assert [g["lr"] for g in opt2.param_groups] == [0.05, 0.006]


def test_extra_digest_does_not_depend_on_the_process(tmp_path):
    script = """
from muon_ckpt.state import extra_digests
class S:
    def state_dict(self):
        return {"b": {"shard-a", "shard-b", "shard-c", 7}, "a": {2: "x", "k": (1.5, None)}}
    def load_state_dict(self, sd):
        pass
print(extra_digests({"s": S()})["s"])
"""
    seeds = [run_script(["-c", script], env={"PYTHONHASHSEED": str(n)}) for n in (1, 2)]
    assert all(r.returncode == 0 for r in seeds), [r.stderr for r in seeds]
    assert seeds[0].stdout == seeds[1].stdout


def test_tensor_learning_rates_load_in_place_and_survive_a_failed_load(tmp_path):
    url = str(tmp_path / "run")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    lr = torch.tensor(0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    mgr = CheckpointManager(url, model=model, optimizer=opt)
    mgr.save(1)
    held = opt.param_groups[0]["lr"]  # what a scheduler or a captured graph would hold
    held.fill_(0.5)
    assert mgr.load() == 1
    assert opt.param_groups[0]["lr"] is held and held.item() == pytest.approx(0.01)
    st = Storage(url)
    flip_byte_in(st, "step-00000001", largest_file(st, "step-00000001"))
    held.fill_(0.25)
    with pytest.raises(CheckpointCorruptError):
        mgr.load(step=1)
    assert opt.param_groups[0]["lr"] is held and held.item() == 0.25


class _WithExtraState(nn.Module):
    """A module with extra state (``get_extra_state``/``set_extra_state``) of a given kind."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.kind = kind
        self.counter = 0
        self.table = torch.zeros(4)

    def get_extra_state(self):
        if self.kind == "dict":
            return {"counter": self.counter, "table": self.table.clone()}
        if self.kind == "int":
            return self.counter
        return self.table.clone()

    def set_extra_state(self, state) -> None:
        if self.kind == "dict":
            self.counter = state["counter"]
            self.table.copy_(state["table"])
        elif self.kind == "int":
            self.counter = state
        else:
            self.table.copy_(state)


def _extra_state_of(m: nn.Module) -> tuple[int, list[float]]:
    return m.block.counter, m.block.table.tolist()


@pytest.mark.parametrize("kind", ["dict", "int", "tensor"])
def test_module_extra_state_saves_loads_and_survives_a_failed_load(tmp_path, kind):
    """A module's extra state is loaded through ``set_extra_state`` (as ``load_state_dict``
    does), whatever ``get_extra_state`` returns; a failed load leaves it as it was."""
    url = str(tmp_path / "run")

    def make() -> nn.Module:
        m = nn.Module()
        m.block = _WithExtraState(kind)
        return m

    src = make()
    src.block.counter, src.block.table[:] = 42, torch.arange(4.0)
    CheckpointManager(url, model=src, extra={"d": Counter()}).save(1)
    expect = _extra_state_of(src) if kind == "dict" else None

    dst = make()
    assert CheckpointManager(url, model=dst, extra={"d": Counter()}).load() == 1
    got = _extra_state_of(dst)
    if kind == "dict":
        assert got == expect
    elif kind == "int":
        assert got[0] == 42
    else:
        assert got[1] == [0.0, 1.0, 2.0, 3.0]
    assert torch.equal(dst.block.lin.weight, src.block.lin.weight)

    fresh = make()
    fresh.block.counter, fresh.block.table[:] = 7, -1.0
    with pytest.raises((CheckpointError, ValueError), match="cannot take the state"):
        CheckpointManager(url, model=fresh, extra={"d": FailsToApply()}).load(step=1)
    assert _extra_state_of(fresh) == (7, [-1.0] * 4)


def test_module_extra_state_missing_from_the_checkpoint_is_named(tmp_path):
    """A module that has extra state now but had none when saved: a clear error naming the
    key; ``strict=False`` loads the rest and reports it."""
    url = str(tmp_path / "run")
    saved = nn.Module()
    saved.block = nn.Module()
    saved.block.lin = nn.Linear(3, 3)
    CheckpointManager(url, model=saved).save(1)
    m = nn.Module()
    m.block = _WithExtraState("dict")
    m.block.counter = 5
    with pytest.raises(CheckpointMismatchError, match=r"block\._extra_state"):
        CheckpointManager(url, model=m).load(step=1)
    mgr = CheckpointManager(url, model=m)
    assert mgr.load(step=1, strict=False) == 1
    assert mgr.last_load_report.missing == ["model.block._extra_state"]
    assert m.block.counter == 5
    assert torch.equal(m.block.lin.weight, saved.block.lin.weight)


def test_module_extra_state_of_another_shape_is_a_mismatch(tmp_path):
    """A tensor extra state saved with 4 elements, loaded where it has 5: strict names it;
    ``strict=False`` leaves it as it is and reports it, and loads the rest."""
    url = str(tmp_path / "run")
    src = nn.Module()
    src.block = _WithExtraState("tensor")
    CheckpointManager(url, model=src).save(1)
    dst = nn.Module()
    dst.block = _WithExtraState("tensor")
    dst.block.table = torch.full((5,), 9.0)
    with pytest.raises(CheckpointMismatchError, match=r"has shape \(4,\) in the checkpoint"):
        CheckpointManager(url, model=dst).load(step=1)
    mgr = CheckpointManager(url, model=dst)
    assert mgr.load(step=1, strict=False) == 1
    assert [k for k, _ in mgr.last_load_report.mismatched] == ["model.block._extra_state"]
    assert dst.block.table.tolist() == [9.0] * 5
    assert torch.equal(dst.block.lin.weight, src.block.lin.weight)


def test_module_extra_state_under_a_wrapper_and_under_legacy_names(tmp_path):
    """The extra state of a module under activation checkpointing (the wrapper names its
    entries as its own) loads into the wrapped module; so does one stored under a wrapped
    name (a checkpoint from before canonical names, ``model._orig_mod.<fqn>``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    import muon_ckpt.state._flat as flatten

    def wrapped() -> nn.Module:
        m = nn.Module()
        m.layer = checkpoint_wrapper(_WithExtraState("dict"))
        return m

    url = str(tmp_path / "a")
    src = wrapped()
    src.layer._checkpoint_wrapped_module.counter = 42
    CheckpointManager(url, model=src).save(1)
    dst = wrapped()
    assert CheckpointManager(url, model=dst).load() == 1
    assert dst.layer._checkpoint_wrapped_module.counter == 42

    for kind in ("int", "dict"):
        url = str(tmp_path / f"legacy-{kind}")
        src = nn.Module()
        src._orig_mod = nn.Module()  # stored as model._orig_mod.block...: names as given
        src._orig_mod.block = _WithExtraState(kind)
        src._orig_mod.block.counter = 42
        real = flatten.canonical_names
        flatten.canonical_names = lambda model, names: {n: n for n in names}
        try:
            CheckpointManager(url, model=src).save(1)
        finally:
            flatten.canonical_names = real
        dst = nn.Module()
        dst.block = _WithExtraState(kind)
        assert CheckpointManager(url, model=dst).load() == 1, kind
        assert dst.block.counter == 42, kind


def test_a_load_without_the_model_leaves_module_extra_state_alone(tmp_path):
    """``parts`` without the model: no module's extra state is read, set, or restored."""
    calls = []

    class Watched(_WithExtraState):
        def get_extra_state(self):
            calls.append("get")
            return super().get_extra_state()

        def set_extra_state(self, state) -> None:
            calls.append("set")
            super().set_extra_state(state)

    url = str(tmp_path / "run")
    model = nn.Module()
    model.block = Watched("int")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    CheckpointManager(url, model=model, optimizer=opt, extra={"d": Counter()}).save(1)
    calls.clear()
    mgr = CheckpointManager(url, model=model, optimizer=opt, extra={"d": FailsToApply()})
    with pytest.raises((CheckpointError, ValueError), match="cannot take the state"):
        mgr.load(step=1, parts=("optim", "extra"))
    assert calls == []
