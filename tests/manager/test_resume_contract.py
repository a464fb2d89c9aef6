"""The resume contract, all or nothing: a load that fails on any rank, at any point before
its commit point, leaves the model, the optimizer and ``extra`` as they were on every rank
(values, step counters, hyperparameters, state created for the load removed); the backup that
makes it so keeps every host tensor once before its first write (tied and overlapping ones
included), on every read path, and a load cut short after its reads leaves nothing running.

Every failing call is followed by a check that the committed checkpoints still load bitwise.
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
from tests._ckpt import TinyNet, data_files, make_muon, muon_state_sd, train
from tests._dist import run_on_ranks
from tests.conftest import assert_same, tiny_run, tiny_snapshot, tiny_train
from tests.manager._resume import Counter, FailsToApply, Records, flip_byte_in, largest_file


# ---------------------------------------------------------------------- all or nothing
def test_failed_load_leaves_model_optimizer_and_extra_as_they_were(tmp_path):
    url = str(tmp_path / "run")
    model, opt = tiny_run()
    pos = Counter()
    mgr = CheckpointManager(url, model=model, optimizer=opt, extra={"data": pos})
    tiny_train(model, opt, 2)
    pos.pos, pos.seen[:] = 7, 1.0
    mgr.save(2)
    st = Storage(url)
    flip_byte_in(st, "step-00000002", largest_file(st, "step-00000002"))

    # Mid-run: state exists; a failed load restores values, step counters and extra.
    tiny_train(model, opt, 1, seed=5)
    pos.pos, pos.seen[:] = 9, 2.0
    opt.param_groups[0]["lr"] = 0.5
    before = tiny_snapshot(model, opt)
    with pytest.raises(CheckpointCorruptError, match="crc32"):
        mgr.load(step=2)
    assert_same(tiny_snapshot(model, opt), before)
    assert opt.param_groups[0]["lr"] == 0.5
    assert pos.pos == 9 and torch.equal(pos.seen, torch.full((3,), 2.0))

    # Fresh: the state created for the load is removed again.
    model2, opt2 = tiny_run(seed=1)
    pos2 = Counter()
    before2 = tiny_snapshot(model2, opt2)
    mgr2 = CheckpointManager(url, model=model2, optimizer=opt2, extra={"data": pos2})
    with pytest.raises(CheckpointCorruptError):
        mgr2.load(step=2)
    assert not opt2.state
    assert_same(tiny_snapshot(model2, opt2), before2)
    assert pos2.pos == 0 and not pos2.seen.any()


def test_failed_load_into_plain_adamw_leaves_no_state(tmp_path):
    url = str(tmp_path / "run")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    CheckpointManager(url, model=model, optimizer=opt).save(1)

    other = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))  # another shape
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-2)
    with pytest.raises(CheckpointMismatchError, match=r"shape"):
        CheckpointManager(url, model=other, optimizer=opt2).load()
    assert not opt2.state  # no state with step == 1 left behind


class Picky(Counter):
    """rank_extra whose load_state_dict() fails on one rank (after DCP read everything)."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail

    def load_state_dict(self, sd: dict) -> None:
        if self.fail:
            raise ValueError("this rank cannot take the state")
        super().load_state_dict(sd)


def _body_one_rank_fails(rank, world_size, url):
    model, opt = tiny_run()
    picky = Picky(fail=False)
    mgr = CheckpointManager(url, model=model, optimizer=opt, rank_extra={"p": picky})
    tiny_train(model, opt, 1)
    mgr.save(1)
    at1 = tiny_snapshot(model, opt)
    tiny_train(model, opt, 1, seed=2)
    mgr.save(2)
    if rank == 0:  # damage a file only rank 1 wrote; DCP fails the read on every rank
        st = Storage(url)
        rank1 = next(n for n in data_files(st, 2) if n.endswith("/__1_0.distcp"))
        flip_byte_in(st, "step-00000002", rank1)
    mgr.load(step=1)  # also a collective barrier: the damage is done before anyone reads
    out = {}
    for case in ("corrupt", "apply"):
        tiny_train(model, opt, 1, seed=9)
        before = tiny_snapshot(model, opt)
        picky.fail = case == "apply" and rank == 1
        try:
            mgr.load(step=2 if case == "corrupt" else 1)
            err = None
        except (CheckpointError, ValueError) as e:
            err = f"{type(e).__name__}: {e}"
        same = all(torch.equal(before[k], v) for k, v in tiny_snapshot(model, opt).items())
        out[case] = (err, same)
    picky.fail = False
    fell_back = mgr.load()
    back = all(torch.equal(at1[k], v) for k, v in tiny_snapshot(model, opt).items())
    return out, fell_back, back


def test_a_failure_on_one_rank_rolls_back_every_rank(tmp_path):
    url = str(tmp_path / "run")
    (out0, fb0, back0), (out1, fb1, back1) = run_on_ranks(_body_one_rank_fails, 2, url)
    for err, same in (out0["corrupt"], out1["corrupt"]):
        assert err and "CheckpointCorruptError" in err and "__1_0.distcp" in err and same
    err0, same0 = out0["apply"]  # rank 0 read and applied cleanly, and still rolled back
    err1, same1 = out1["apply"]
    assert err0 and "failed on rank(s) [1]" in err0 and "cannot take the state" in err0
    assert err1 and err1.startswith("ValueError: this rank cannot take the state")
    assert same0 and same1
    assert fb0 == fb1 == 1 and back0 and back1


class _Tied(nn.Module):
    """An embedding and an output layer that share their weight (one tensor, two keys)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(8))
        self.register_buffer("scale_view", self.scale[2:6])  # a buffer inside another


def test_failed_load_restores_tied_and_overlapping_host_tensors(tmp_path):
    """Host tensors that share memory are kept before the load writes any of them: the
    second key of a tied weight must not back up what the first key's write left."""
    url = str(tmp_path / "run")
    torch.manual_seed(0)
    model = _Tied()
    CheckpointManager(url, model=model, extra={"d": Counter()}).save(1)
    with torch.no_grad():
        model.emb.weight.add_(1.0)
        model.scale.mul_(3.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mgr = CheckpointManager(url, model=model, extra={"d": FailsToApply()}, io_threads=4)
    with pytest.raises((CheckpointError, ValueError), match="cannot take the state"):
        mgr.load(step=1)
    assert model.head.weight is model.emb.weight
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
@pytest.mark.parametrize("verify", ["checksum", "size"])
def test_every_read_path_keeps_what_it_overwrites(storage_url, verify, offload, monkeypatch):
    """Host tensors are backed up by the load planner just before their first write
    (``Rollback.keep``) when the rollback's copier thread has not copied them yet; here the
    copier is off, so that every copy goes through the planner: a load that fails after it
    wrote everything (here: ``extra`` refuses its state) must still restore every value, on
    each read path (local parts, remote streamed or by ranges), with offloaded states too."""
    from muon_ckpt.state import Rollback

    monkeypatch.setattr(Rollback, "_keep_all", lambda self, keys: None)
    url, opts = storage_url
    torch.manual_seed(0)
    model = TinyNet(vocab=11, dim=64)
    opt = make_muon(model)
    train(model, opt, 2)
    if offload:
        opt.turn_on_cpu_offload()
    kw = {"storage_options": opts, "verify": verify}
    CheckpointManager(url, model=model, optimizer=opt, extra={"d": Counter()}, **kw).save(1)
    train(model, opt, 1, seed=3)
    before = muon_state_sd(model, opt) if not offload else None
    if offload:
        opt.turn_off_cpu_offload()
        before = muon_state_sd(model, opt)
        opt.turn_on_cpu_offload()
    mgr = CheckpointManager(url, model=model, optimizer=opt, extra={"d": FailsToApply()}, **kw)
    with pytest.raises((CheckpointError, ValueError), match="cannot take the state"):
        mgr.load(step=1)
    if offload:
        opt.turn_off_cpu_offload()
    assert_same(muon_state_sd(model, opt), before)


def test_a_host_tensor_is_kept_once_before_its_first_write():
    """``Rollback.keep`` from many threads at once (and the copier thread): one copy, taken
    before any of them writes; restore() puts it back."""
    import threading

    from muon_ckpt.state import HostStaging, Rollback

    a, b = torch.arange(1000.0), torch.arange(10.0)
    rb = Rollback(None, {}, HostStaging())
    assert rb.keep_values({"a": a, "b": b, "n": 3}, skip=set(), limit=None)
    go = threading.Barrier(8)

    def writer(i: int) -> None:
        go.wait()
        rb.keep("a")
        a[i::8] += 1  # a write after keep, as the reader's (each its own rows)

    ts = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    rb.keep("missing")  # not a kept tensor: nothing
    assert torch.equal(a, torch.arange(1000.0) + 1)
    rb.keep("b")
    b.fill_(-1)
    rb.restore()
    assert torch.equal(a, torch.arange(1000.0))
    assert torch.equal(b, torch.arange(10.0))


def test_host_tensors_are_copied_ahead_of_the_reads():
    """The rollback's copier thread copies every host tensor from the start, so that a load
    waiting on storage finds them copied when it writes (``keep`` is then free); a tensor
    it has copied is not copied again by ``keep``, and restore() puts all of them back."""
    from muon_ckpt.state import HostStaging, Rollback

    ts = {f"t{i}": torch.full((1000,), float(i)) for i in range(20)}
    rb = Rollback(None, {}, HostStaging())
    assert rb.keep_values(dict(ts), skip=set(), limit=None)
    rb._copier.join()  # (the load goes on meanwhile; here: wait for it)
    assert rb._pending == {}, "the copier left tensors uncopied"
    for i, t in enumerate(ts.values()):
        rb.keep(f"t{i}")  # copied already: nothing
        t.fill_(-1)
    assert len(rb._pairs) == len(ts)  # one copy each
    rb.restore()
    for i, t in enumerate(ts.values()):
        assert torch.equal(t, torch.full((1000,), float(i)))


def test_overlapping_host_tensors_are_found():
    from muon_ckpt._tensors import overlapping

    base = torch.zeros(100)
    w = torch.zeros(4, 4)
    found = overlapping(
        {
            "a": base[:50],
            "b": base[40:60],  # overlaps a
            "c": base[60:70],  # touches b, overlaps nothing
            "e": base[70:],
            "w": w,
            "wt": w.t(),  # the same memory, transposed
            "d": torch.zeros(3),
        }
    )
    assert found == {"a", "b", "w", "wt"}


def test_load_over_max_staging_bytes_warns_and_keeps_no_values(tmp_path):
    """A backup larger than max_staging_bytes is not taken (one WARNING): the load itself
    works; a failed one restores structure, hyperparameters and extra, not tensor values
    (README, Resume semantics)."""
    url = str(tmp_path / "run")
    model, opt = tiny_run()
    tiny_train(model, opt, 1)
    CheckpointManager(url, model=model, optimizer=opt, extra={"d": Counter(3)}).save(1)
    saved = tiny_snapshot(model, opt)
    tiny_train(model, opt, 1, seed=4)
    opt.param_groups[0]["lr"] = 0.5
    bad = FailsToApply()
    bad.pos = 5
    mgr = CheckpointManager(url, model=model, optimizer=opt, extra={"d": bad}, max_staging_bytes=1)
    with Records(logging.WARNING) as logs:
        with pytest.raises((CheckpointError, ValueError), match="cannot take the state"):
            mgr.load(step=1)
        # no values kept: the tensors hold what was read; the rest is as it was
        assert_same(tiny_snapshot(model, opt), saved)
        assert opt.param_groups[0]["lr"] == 0.5 and bad.pos == 5
        assert mgr.load(step=1) == 1  # extra takes it the second time
    warned = [m for m in logs.at(logging.WARNING) if "max_staging_bytes=1" in m]
    assert len(warned) == 1, logs.messages
    assert_same(tiny_snapshot(model, opt), saved)
    assert bad.pos == 3


@pytest.mark.parametrize("how", ["interrupt", "agreement"])
def test_a_load_cut_short_after_its_reads_undoes_them_and_leaves_nothing_running(
    tmp_path, monkeypatch, how
):
    """Ctrl-C after the reads (or the ranks' agreement failing: a rank gone) raises out of
    load(): this rank's values are put back, the rollback's copier thread has stopped and the
    host backup is freed (a copier left running would write into the staging buffer that the
    next asynchronous save reuses)."""
    import threading

    torch.manual_seed(0)
    model = TinyNet(vocab=11, dim=64)
    opt = make_muon(model)
    train(model, opt, 2)
    url = str(tmp_path / "run")
    CheckpointManager(url, model=model, optimizer=opt).save(1)
    train(model, opt, 1, seed=3)
    before = muon_state_sd(model, opt)
    mgr = CheckpointManager(url, model=model, optimizer=opt)
    import muon_ckpt.load._attempt as attempt_mod  # one attempt of a load: read, then agree

    read, agree = attempt_mod._read, attempt_mod._agree
    calls = []

    def read_then_interrupt(*args, **kwargs):
        read(*args, **kwargs)
        raise KeyboardInterrupt

    def agree_then_fail(error, group):
        calls.append(error)
        if len(calls) == 2:  # after the reads
            raise CheckpointError("rank 1 stopped answering")
        return agree(error, group)

    if how == "interrupt":
        monkeypatch.setattr(attempt_mod, "_read", read_then_interrupt)
        expected = KeyboardInterrupt
    else:
        monkeypatch.setattr(attempt_mod, "_agree", agree_then_fail)
        expected = CheckpointError
    with pytest.raises(expected):
        mgr.load(step=1)
    assert not [t for t in threading.enumerate() if t.name == "muon_ckpt_keep"]
    assert not [d for d in mgr._staging._buffers if d.type == "cpu"]
    assert_same(muon_state_sd(model, opt), before)
