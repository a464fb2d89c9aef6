"""The resume contract: all-or-nothing loads, rewinds, fallback to the newest loadable step,
per-rank state, wrapper-free keys, relaxed and partial loads, bounded collectives, logs.

Every failing call is followed by a check that the committed checkpoints still load bitwise.
"""

from __future__ import annotations

import logging
import time

import numpy as np
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
from tests._ckpt import (
    TinyNet,
    biggest_data_file,
    data_files,
    make_muon,
    muon_state_sd,
    train,
    write_step,
)
from tests._dist import run_on_ranks, run_script
from tests.conftest import assert_same, tiny_run, tiny_snapshot, tiny_train


class Counter:
    """A Stateful ``extra``: a data position (a plain value and a tensor)."""

    def __init__(self, pos: int = 0) -> None:
        self.pos = pos
        self.seen = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"pos": self.pos, "seen": self.seen}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]
        self.seen.copy_(sd["seen"])


class Records(logging.Handler):
    def __init__(self, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.messages: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelno, record.getMessage()))

    def __enter__(self) -> Records:
        lg = logging.getLogger("muon_ckpt")
        self._old = lg.level
        lg.setLevel(logging.INFO)
        lg.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        lg = logging.getLogger("muon_ckpt")
        lg.removeHandler(self)
        lg.setLevel(self._old)

    def at(self, level: int) -> list[str]:
        return [m for lv, m in self.messages if lv == level]


def _flip_byte(st: Storage, step_dir: str, name: str) -> None:
    data = bytearray(st.read_bytes(step_dir, name))
    data[len(data) // 2] ^= 0xFF
    st.write_bytes(bytes(data), step_dir, name)


def _largest_shard(st: Storage, step_dir: str) -> str:
    return biggest_data_file(st, int(step_dir[-8:]))


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
    _flip_byte(st, "step-00000002", _largest_shard(st, "step-00000002"))

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
        _flip_byte(st, "step-00000002", rank1)
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


# ---------------------------------------------------------------------- fallback
def test_load_without_step_falls_back_past_every_damaged_step(tmp_path):
    url = str(tmp_path / "run")
    model, opt = tiny_run()
    mgr = CheckpointManager(url, model=model, optimizer=opt)
    snaps = {}
    for s in (1, 2, 3):
        tiny_train(model, opt, 1, seed=s)
        mgr.save(s)
        snaps[s] = tiny_snapshot(model, opt)
    st = Storage(url)
    st.rm("step-00000003", ".metadata")  # found by the manifest check, before any read
    _flip_byte(st, "step-00000002", _largest_shard(st, "step-00000002"))  # found by the read
    model2, opt2 = tiny_run(seed=4)
    with Records() as rec:
        got = CheckpointManager(url, model=model2, optimizer=opt2).load()
    assert got == 1
    assert_same(tiny_snapshot(model2, opt2), snaps[1])
    warned = "\n".join(rec.at(logging.WARNING))
    assert "skipping step 3" in warned and ".metadata" in warned
    assert "skipping step 2" in warned and "crc32" in warned
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata"):
        CheckpointManager(url, model=model2, optimizer=opt2).load(step=3)  # never falls back
    st.rm("step-00000001", ".metadata")
    with pytest.raises(CheckpointCorruptError, match=r"no committed step loads cleanly.*step 3"):
        CheckpointManager(url, model=model2, optimizer=opt2).load()
    assert_same(tiny_snapshot(model2, opt2), snaps[1])


# ---------------------------------------------------------------------- rewind
def _run_to(url: str, mgr_kw: dict, start: int, stop: int, *, resume_step=None, crash_at=None):
    """A training process: build, load (``resume_step`` or auto), train start..stop with a save
    per step (the manager's interval decides); returns (model, opt, loaded step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    named = list(model.named_parameters())
    opt = make_muon(model)
    mgr = CheckpointManager(url, model=model, optimizer=opt, **mgr_kw)
    loaded = mgr.load(resume_step)
    first = (loaded or start - 1) + 1
    for step in range(first, stop + 1):
        g = torch.Generator().manual_seed(step)
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        if crash_at == step:
            return model, opt, loaded  # killed before saving this step
        mgr.save(step)
    return model, opt, loaded


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_rewind_abandons_the_newer_line(tmp_path):
    url, ref_url = str(tmp_path / "run"), str(tmp_path / "ref")
    kw = {"interval": 5, "keep_last": 2}
    _run_to(url, kw, 1, 20)
    assert CheckpointManager(url).steps() == [15, 20]
    # Rewind to 15 and train on; killed at 22 (after the new line saved 20).
    with Records() as rec:
        _, _, loaded = _run_to(url, kw, 1, 25, resume_step=15, crash_at=22)
    assert loaded == 15
    assert any("abandoned line" in m and "[20]" in m for m in rec.at(logging.WARNING))
    assert CheckpointManager(url).steps() == [15, 20]  # 15 kept: retention counts this line
    # Auto-resume: the new line's 20, and at 25 the same as an uninterrupted rewound run.
    model, _, loaded = _run_to(url, kw, 1, 25)
    assert loaded == 20
    _run_to(ref_url, {"interval": 5}, 1, 15)
    ref, _, _ = _run_to(ref_url, {"interval": 5}, 1, 25, resume_step=15)
    assert_same(_params(model), _params(ref))
    assert CheckpointManager(url).steps() == [20, 25]


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


# ---------------------------------------------------------------------- bounded collectives
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
    # Different calls: every rank finds out at once.
    mgr = CheckpointManager(url, model=model, optimizer=opt, collective_timeout=3)
    t0 = time.monotonic()
    try:
        mgr.save(1 if rank == 0 else 2)
        out.append((None, 0.0))
    except CheckpointError as e:
        out.append((str(e), time.monotonic() - t0))
    # A rank that never calls: the others give up after collective_timeout, naming it.
    mgr = CheckpointManager(url, model=model, optimizer=opt, collective_timeout=3)
    t0 = time.monotonic()
    if rank == 1:
        time.sleep(5)
        return out
    try:
        mgr.save(1)
        out.append((None, 0.0))
    except CheckpointError as e:
        out.append((str(e), time.monotonic() - t0))
    return out


def test_collectives_give_up_in_bounded_time_naming_the_ranks(tmp_path):
    url = str(tmp_path / "run")
    out0, out1 = run_on_ranks(_body_bounded, 2, url, timeout=60)
    assert out0[0] and "taking the snapshot failed on rank(s) [1]" in out0[0]
    assert out1[0].startswith("CheckpointError: saving step 1: taking the snapshot failed: ")
    assert out1[0].endswith("(cause: RuntimeError('this extra cannot be saved'))")
    out0, out1 = out0[1:], out1[1:]
    for err, took in (out0[0], out1[0]):
        assert err and "rank 0: save(step=1), rank 1: save(step=2)" in err and took < 3
    err, took = out0[1]
    assert err and "save(step=1) on rank 0: rank(s) [1] of 2 did not call it within 3 s" in err
    assert 3 <= took < 5
    assert CheckpointManager(url).steps() == []  # nothing half-written was committed


# ---------------------------------------------------------------------- small contracts
def test_steps_accept_any_integral(tmp_path):
    model, opt = tiny_run()
    mgr = CheckpointManager(str(tmp_path / "run"), model=model, optimizer=opt)
    assert mgr.save(np.int64(3)) and mgr.save(torch.tensor(4))
    assert mgr.load(np.int32(3)) == 3 and mgr.load(torch.tensor(4)) == 4
    with pytest.raises(ValueError, match=r"step must be an integer >= 0, got 2\.5"):
        mgr.save(2.5)


def test_resume_from_has_its_own_storage_options(tmp_path, s3_bucket):
    bucket, opts = s3_bucket
    model, opt = tiny_run()
    tiny_train(model, opt, 1)
    CheckpointManager(f"s3://{bucket}/base", model=model, optimizer=opt, storage_options=opts).save(
        1
    )
    model2, opt2 = tiny_run(seed=1)
    mgr = CheckpointManager(
        str(tmp_path / "finetune"),
        model=model2,
        optimizer=opt2,
        resume_from=f"s3://{bucket}/base",
        resume_storage_options=opts,
    )
    assert mgr.load() == 1
    assert_same(tiny_snapshot(model2, opt2), tiny_snapshot(model, opt))


def test_info_logs_and_no_torch_warning_in_one_process(tmp_path):
    url = str(tmp_path / "run")
    script = f"""
import logging, torch
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
from muon_ckpt import CheckpointManager
from tests.conftest import tiny_run, tiny_train
model, opt = tiny_run()
mgr = CheckpointManager({url!r}, model=model, optimizer=opt, keep_last=1)
for s in (1, 2):
    tiny_train(model, opt, 1)
    mgr.save(s)
mgr.load()
"""
    r = run_script(["-c", script])
    assert r.returncode == 0, r.stderr
    err = r.stderr
    assert "torch.distributed is disabled" not in err and "Warning" not in err, err
    assert "INFO muon_ckpt committed step 2" in err and "bytes, written in" in err
    assert "INFO muon_ckpt retention (keep_last=1) deleted steps [1]" in err
    assert "INFO muon_ckpt loaded step 2" in err


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
    _flip_byte(st, "step-00000001", _largest_shard(st, "step-00000001"))
    held.fill_(0.25)
    with pytest.raises(CheckpointCorruptError):
        mgr.load(step=1)
    assert opt.param_groups[0]["lr"] is held and held.item() == 0.25


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


class _FailsToApply(Counter):
    """``extra`` whose first load_state_dict() fails: after DCP has written every tensor
    (the second, restore()'s, succeeds)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def load_state_dict(self, sd: dict) -> None:
        self.calls += 1
        if self.calls == 1:
            raise ValueError("cannot take the state")
        super().load_state_dict(sd)


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
    mgr = CheckpointManager(url, model=model, extra={"d": _FailsToApply()}, io_threads=4)
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
    mgr = CheckpointManager(url, model=model, optimizer=opt, extra={"d": _FailsToApply()}, **kw)
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
    bad = _FailsToApply()
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
        CheckpointManager(url, model=fresh, extra={"d": _FailsToApply()}).load(step=1)
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
    mgr = CheckpointManager(url, model=model, optimizer=opt, extra={"d": _FailsToApply()})
    with pytest.raises((CheckpointError, ValueError), match="cannot take the state"):
        mgr.load(step=1, parts=("optim", "extra"))
    assert calls == []
