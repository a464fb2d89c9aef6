"""A load's backup, the part of it that makes it all or nothing: how much host memory it
takes (measured, in a process of its own), and its commit point: a failure before it changes
nothing, and after it nothing is left that can fail."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import muon_ckpt._collective as coll
import muon_ckpt.load._attempt as attempt_mod
from muon_ckpt import CheckpointError, CheckpointManager
from muon_ckpt.load._planner import SafeLoadPlanner
from muon_ckpt.state import Rollback
from muon_ckpt.store import Storage
from tests._ckpt import TinyNet, make_muon, muon_state_sd, train
from tests._dist import run_script
from tests.conftest import assert_same

MiB = 1 << 20

# Peak host memory (VmHWM, reset through /proc/self/clear_refs) over the resident memory
# before each call, in MiB, of: an asynchronous save, loads by a synchronous and an
# asynchronous manager, and the next save; 32 MiB of parameters and 32 MiB of momentum.
_MEASURE = r"""
import json, sys
import torch
from torch import nn
from muon_ckpt import CheckpointManager
from optim import Muon

MiB = 1 << 20

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":")) / 1024

def peak(fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size starts again from the current one
    before = status("VmRSS")
    fn()
    return {"peak": status("VmHWM") - before, "after": status("VmRSS") - before}

torch.manual_seed(0)
model = nn.Module()
for i in range(8):
    model.register_parameter(f"w{i}", nn.Parameter(torch.randn(1024, 1024)))
opt = Muon(list(model.parameters()), chunk_size=4)
opt.init_state()
for st in opt.state.values():
    st["momentum_buffer"].normal_()
url, offload = sys.argv[1], sys.argv[2] == "offload"
if offload:
    opt.turn_on_cpu_offload()
out = {}
mgr = CheckpointManager(url, model=model, optimizer=opt, async_save=True, io_threads=2)
out["async save"] = peak(lambda: (mgr.save(1), mgr.wait()))
out["async load"] = peak(lambda: mgr.load(1))
out["async load again"] = peak(lambda: mgr.load(1))
out["async save after"] = peak(lambda: (mgr.save(2), mgr.wait()))
mgr.close()
sync = CheckpointManager(url, model=model, optimizer=opt, io_threads=2)
out["sync load"] = peak(lambda: sync.load(1))
out["sync load again"] = peak(lambda: sync.load(1))
sync.close()
print("RESULT " + json.dumps(out))
"""


def _measure(url: str, offload: bool) -> dict[str, dict[str, float]]:
    done = run_script(["-c", _MEASURE, url, "offload" if offload else "plain"])
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


# A load's reading buffers (a few MiB a thread) and the allocator's slack: well under the
# 32 MiB of one half of the state, so that a second copy of either half cannot hide in it.
_SLACK = 12


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
def test_a_load_holds_at_most_one_copy_of_what_it_overwrites_and_no_more_than_a_save(
    tmp_path, offload
):
    """The bound (docs/semantics.md, all or nothing): a load holds at most one host copy
    of the state it overwrites (64 MiB here) over the state itself, never more than an
    asynchronous save of that state holds; where such a save's buffers exist (an
    asynchronous manager), it copies into them and takes no new memory for the tensors they
    hold (all of them; with offload on, the parameters: the offloaded states' copy is the
    load's own, freed after it, as a save freezes the pool's buffer instead of copying).
    A synchronous manager frees the copy after the load (its saves copy no host tensor)."""
    m = _measure(str(tmp_path / "run"), offload)
    state, states = 64, 32  # MiB: parameters + momentum; the momentum (offloaded with offload)
    for name in ("async load", "async load again", "sync load", "sync load again"):
        assert m[name]["peak"] <= state + _SLACK, (name, m)
        assert m[name]["peak"] <= m["async save"]["peak"] + _SLACK, (name, m)
    # The asynchronous manager's loads copy into the save's buffers: no new memory, but the
    # offloaded states' own copy (freed again).
    own = states if offload else 0
    for name in ("async load", "async load again"):
        assert m[name]["peak"] <= own + _SLACK, (name, m)
        assert m[name]["after"] <= _SLACK, (name, m)
    # The next save finds its buffers still there: it takes what the first one took beyond
    # them (its writer's), not the buffers again (the pool keeps the offloaded states'
    # second buffer since the first save). The writer's own share varies by a dozen MiB
    # from run to run (its threads' reading buffers), so the bound is half the buffers
    # below the first save: buffers taken again would put it at the first save's peak.
    buffers = state - own
    assert m["async save after"]["peak"] <= m["async save"]["peak"] - buffers / 2, m
    # The synchronous one (made after the other was closed: no buffers) copies into memory
    # of its own each time, and frees it after.
    for name in ("sync load", "sync load again"):
        assert m[name]["peak"] >= state - _SLACK, (name, m)  # (the copy was taken)
        assert m[name]["after"] <= _SLACK, (name, m)


# ---------------------------------------------------------------------- the commit point
def _run(tmp_path):
    """A Muon run saved at step 1, trained on; a manager over it with ``extra``."""
    torch.manual_seed(0)
    model = TinyNet(vocab=11, dim=64)
    opt = make_muon(model)
    train(model, opt, 2)
    url = str(tmp_path / "run")
    pos = _Position()
    CheckpointManager(url, model=model, optimizer=opt, extra={"pos": pos}).save(1)
    saved = muon_state_sd(model, opt)
    train(model, opt, 1, seed=3)
    pos.at = 7
    opt.param_groups[0]["lr"] = 0.5
    mgr = CheckpointManager(url, model=model, optimizer=opt, extra={"pos": pos}, io_threads=4)
    return model, opt, pos, mgr, saved


class _Position:
    def __init__(self) -> None:
        self.at = 0

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, sd: dict) -> None:
        self.at = sd["at"]


class _Injected(Exception):
    pass


def _fail_at_write(monkeypatch, k: int | None) -> None:
    """The k-th target a reading thread has written (None: the last) raises, once written."""
    commit = SafeLoadPlanner.commit_tensor
    lock, seen = threading.Lock(), [0]

    def failing(self, read_item, tensor):
        commit(self, read_item, tensor)
        with lock:
            seen[0] += 1
            n = seen[0]
        last = sum(isinstance(v, torch.Tensor) for v in self.state_dict.values())
        if n == (k if k is not None else last):
            raise _Injected(f"write {n}")

    monkeypatch.setattr(SafeLoadPlanner, "commit_tensor", failing)


@pytest.mark.parametrize(
    "where",
    ["prepare", "backup", "first write", "a middle write", "the last write", "apply", "agreement"],
)
def test_an_exception_before_the_commit_point_changes_nothing(tmp_path, monkeypatch, where):
    """Whatever raises before every rank has agreed that it read and applied everything,
    wherever it raises (the reading threads included, after a target was written), the
    model, the optimizer (values, structure, hyperparameters) and extra are as they were;
    the same manager then loads the step cleanly."""
    model, opt, pos, mgr, saved = _run(tmp_path)
    before = muon_state_sd(model, opt)
    if where == "prepare":
        fit = attempt_mod.fit

        def failing_fit(*a, **kw):
            fit(*a, **kw)
            raise _Injected("fit")

        monkeypatch.setattr(attempt_mod, "fit", failing_fit)
    elif where == "backup":
        keep = Rollback.keep_values

        def failing_keep(self, *a, **kw):
            keep(self, *a, **kw)
            raise _Injected("backup")

        monkeypatch.setattr(Rollback, "keep_values", failing_keep)
    elif where == "apply":
        apply = attempt_mod.apply_loaded

        def failing_apply(*a, **kw):
            apply(*a, **kw)
            raise _Injected("apply")

        monkeypatch.setattr(attempt_mod, "apply_loaded", failing_apply)
    elif where == "agreement":
        agree, calls = attempt_mod._agree, []

        def failing_agree(error, group):
            calls.append(error)
            if len(calls) == 2:  # the one after the read: the commit point itself
                raise KeyboardInterrupt
            return agree(error, group)

        monkeypatch.setattr(attempt_mod, "_agree", failing_agree)
    else:
        _fail_at_write(monkeypatch, {"first write": 1, "a middle write": 5}.get(where))
    with pytest.raises((CheckpointError, _Injected, KeyboardInterrupt)):
        mgr.load(step=1)
    monkeypatch.undo()
    assert_same(muon_state_sd(model, opt), before)
    assert pos.at == 7 and opt.param_groups[0]["lr"] == 0.5
    assert mgr.load(step=1) == 1
    assert pos.at == 0
    assert_same(muon_state_sd(model, opt), saved)


def test_after_the_commit_point_nothing_is_left_that_can_fail(tmp_path, monkeypatch):
    """Once every rank has agreed that it read and applied everything, the load only lets its
    backup go: from there on, every call into storage, every collective, every copy between
    tensors and every call of ``extra`` raises, and the load still returns the step, with
    the state of the checkpoint."""
    model, opt, pos, mgr, saved = _run(tmp_path)
    agree, calls = attempt_mod._agree, []
    armed = threading.Event()

    def poisoned(name, real):
        def call(*a, **kw):
            if armed.is_set():
                raise AssertionError(f"{name} called after the commit point")
            return real(*a, **kw)

        return call

    for name in ("on_rank0", "all_gather", "gather_to_rank0", "handshake", "new_group"):
        monkeypatch.setattr(coll, name, poisoned(f"coll.{name}", getattr(coll, name)))
    for name, fn in vars(Storage).items():
        if callable(fn) and not name.startswith("__"):
            monkeypatch.setattr(Storage, name, poisoned(f"Storage.{name}", fn))
    monkeypatch.setattr(torch.Tensor, "copy_", poisoned("Tensor.copy_", torch.Tensor.copy_))
    monkeypatch.setattr(Rollback, "restore", poisoned("Rollback.restore", Rollback.restore))
    monkeypatch.setattr(_Position, "load_state_dict", poisoned("extra", _Position.load_state_dict))
    monkeypatch.setattr(_Position, "state_dict", poisoned("extra", _Position.state_dict))

    def arming_agree(error, group):
        got = agree(error, group)
        calls.append(got)
        if len(calls) == 2 and not got:  # every rank read and applied: the commit point
            armed.set()
        return got

    monkeypatch.setattr(attempt_mod, "_agree", arming_agree)
    assert mgr.load(step=1) == 1
    assert armed.is_set()
    armed.clear()
    assert_same(muon_state_sd(model, opt), saved)
    assert pos.at == 0
