"""One run, one line (store/_lines.py): a url holds one line of steps. A manager that saves
without having loaded is refused where another run's steps are, unless ``new_run=True``; a
rewind or a new run retires the old steps in its first commit and deletes them only after
it, so a save that fails deletes nothing, and a process that dies between the commit and
the deletions restarts on the new line. Steps of a newer format are never loaded past,
deleted or written beside. Against a local directory, memory:// and S3 (moto); and which
memory-tier steps the url vouches for (``mark_tier``: a commit of their line, or its record)."""

from __future__ import annotations

import json

import pytest

from muon_ckpt import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from muon_ckpt.cli import main
from muon_ckpt.store import MANIFEST, Catalog, Status, StepInfo, Storage, mark_tier, step_dirname
from tests.conftest import assert_same, tiny_run, tiny_snapshot, tiny_train


def _mgr(url, opts, model=None, opt=None, **kw) -> CheckpointManager:
    return CheckpointManager(url, model=model, optimizer=opt, storage_options=opts, **kw)


def _run(url, opts, steps, *, seed=0, load=True, **kw) -> dict[int, dict]:
    """A run (seed ``seed``) that saves after each step in ``steps``; its snapshots."""
    model, opt = tiny_run(seed=seed)
    mgr = _mgr(url, opts, model, opt, **kw)
    if load:
        mgr.load()
    snaps = {}
    for s in steps:
        tiny_train(model, opt, 1, seed=seed * 1000 + s)
        mgr.save(s, force=True)
        snaps[s] = tiny_snapshot(model, opt)
    mgr.close()
    return snaps


def _resume(url, opts) -> tuple[int | None, dict]:
    model, opt = tiny_run(seed=99)
    got = _mgr(url, opts, model, opt).load()
    return got, tiny_snapshot(model, opt)


class _Dies(BaseException):
    """A process killed right after a commit: no deletion ran (a BaseException, as an exit
    is: nothing on the way catches it)."""


def _no_tidy(monkeypatch: pytest.MonkeyPatch) -> None:
    def dead(self, *a, **k):
        raise _Dies("killed after the commit")

    monkeypatch.setattr(Catalog, "tidy", dead)


def test_a_new_run_in_a_used_url_is_refused_without_load(storage_url):
    url, opts = storage_url
    old = _run(url, opts, [30])
    model, opt = tiny_run(seed=1)
    mgr = _mgr(url, opts, model, opt, keep_last=2)
    with pytest.raises(CheckpointExistsError) as ei:
        mgr.save(5)
    msg = str(ei.value)
    assert "holds committed steps 30 of another run" in msg
    assert "load()" in msg and "another url" in msg and "new_run=True" in msg
    assert "Nothing was written" in msg
    assert mgr.steps() == [30]
    got, snap = _resume(url, opts)
    assert got == 30
    assert_same(snap, old[30])


def test_new_run_replaces_the_old_line_and_a_restart_resumes_the_new_one(storage_url, caplog):
    url, opts = storage_url
    _run(url, opts, [30])
    with caplog.at_level("WARNING", logger="muon_ckpt"):
        new = _run(url, opts, [5, 10, 15], seed=1, load=False, new_run=True, keep_last=2)
    assert any("new_run=True: starting a new run" in r.getMessage() for r in caplog.records)
    assert _mgr(url, opts).steps() == [10, 15]  # retention kept this run's steps, not 30
    assert not Storage(url, opts).exists(step_dirname(30))
    got, snap = _resume(url, opts)
    assert got == 15
    assert_same(snap, new[15])


def test_a_new_run_that_dies_before_deleting_the_old_line_still_resumes_the_new_one(
    storage_url, monkeypatch
):
    url, opts = storage_url
    _run(url, opts, [30])
    with monkeypatch.context() as m:
        _no_tidy(m)
        model, opt = tiny_run(seed=1)
        mgr = _mgr(url, opts, model, opt, new_run=True)
        tiny_train(model, opt, 1, seed=5)
        with pytest.raises(_Dies):
            mgr.save(5)
        want = tiny_snapshot(model, opt)
    st = Storage(url, opts)
    assert st.exists(step_dirname(30), MANIFEST)  # still there: nothing was deleted
    statuses = {i.step: i.status for i in Catalog(st).scan()}
    assert statuses == {5: "committed", 30: "superseded"}
    assert _mgr(url, opts).steps() == [5]
    got, snap = _resume(url, opts)
    assert got == 5
    assert_same(snap, want)
    with pytest.raises(CheckpointNotFoundError, match="replaced by the line of step 5"):
        tiny = tiny_run(seed=3)
        _mgr(url, opts, *tiny).load(step=30)
    # The next save of the new line deletes the retired step.
    _run(url, opts, [6])
    assert _mgr(url, opts).steps() == [5, 6]
    assert not st.exists(step_dirname(30))


def test_a_failed_save_after_a_rewind_deletes_nothing(storage_url):
    """[1, 2, 3], load(step=1): a save that fails keeps 2 and 3 (and says so); the one that
    commits retires them, then deletes them."""
    url, opts = storage_url
    snaps = _run(url, opts, [1, 2, 3])

    class Flaky:
        fail = True

        def state_dict(self):
            if self.fail:
                raise RuntimeError("a broken extra")
            return {"v": 1}

        def load_state_dict(self, sd):
            pass

    model, opt = tiny_run(seed=7)
    flaky = Flaky()
    mgr = _mgr(url, opts, model, opt, extra={"b": flaky})
    assert mgr.load(step=1, parts=("model", "optim")) == 1
    with pytest.raises(CheckpointError, match="every committed step is intact"):
        mgr.save(2)  # fails after the save began: the rewind's deletions must not have run
    assert mgr.steps() == [1, 2, 3]
    got, snap = _resume(url, opts)
    assert got == 3
    assert_same(snap, snaps[3])
    flaky.fail = False
    tiny_train(model, opt, 1, seed=42)
    assert mgr.save(2)
    assert mgr.steps() == [1, 2]
    got, snap = _resume(url, opts)
    assert got == 2
    assert_same(snap, tiny_snapshot(model, opt))


def test_a_rewind_that_dies_before_deleting_resumes_the_new_line(storage_url, monkeypatch):
    url, opts = storage_url
    _run(url, opts, [1, 2, 3])
    model, opt = tiny_run(seed=7)
    mgr = _mgr(url, opts, model, opt)
    assert mgr.load(step=1) == 1
    tiny_train(model, opt, 1, seed=42)
    with monkeypatch.context() as m:
        _no_tidy(m)
        with pytest.raises(_Dies):
            mgr.save(2)
    want = tiny_snapshot(model, opt)
    statuses = {i.step: i.status for i in Catalog(Storage(url, opts)).scan()}
    assert statuses == {1: "committed", 2: "committed", 3: "superseded"}
    got, snap = _resume(url, opts)
    assert got == 2
    assert_same(snap, want)
    rc = main(["ls", url, *[f"--storage-option={k}={v}" for k, v in opts.items()]])
    assert rc == 0


def _newer_format(st: Storage, step: int) -> None:
    m = json.loads(st.read_bytes(step_dirname(step), MANIFEST))
    m["format_version"] = 99
    m["something_new"] = {"the": "future"}
    st.write_bytes(json.dumps(m).encode(), step_dirname(step), MANIFEST)


@pytest.mark.parametrize("with_resume_from", [False, True])
def test_a_newer_format_is_refused_never_loaded_past_nor_deleted(storage_url, with_resume_from):
    url, opts = storage_url
    _run(url + "-other", opts, [1])
    _run(url, opts, [2, 3])
    st = Storage(url, opts)
    _newer_format(st, 3)
    kw = {"resume_from": url + "-other"} if with_resume_from else {}
    model, opt = tiny_run(seed=9)
    before = tiny_snapshot(model, opt)
    mgr = _mgr(url, opts, model, opt, keep_last=1, **kw)
    with pytest.raises(CheckpointVersionError, match="upgrade muon-ckpt") as ei:
        mgr.load()
    assert "format_version 99" in str(ei.value)
    assert_same(tiny_snapshot(model, opt), before)  # nothing loaded
    with pytest.raises(CheckpointVersionError, match=r"[Uu]pgrade muon-ckpt"):
        mgr.save(4)
    with pytest.raises(CheckpointVersionError, match="upgrade muon-ckpt"):
        mgr.load(step=3)
    assert mgr.load(step=2) == 2  # asked for by name: ours, and older
    with pytest.raises(CheckpointVersionError):
        mgr.save(4)  # still refused: never written beside a newer step
    assert st.exists(step_dirname(3), MANIFEST) and st.exists(step_dirname(2), MANIFEST)
    assert mgr.steps() == [2]
    flags = [f"--storage-option={k}={v}" for k, v in opts.items()]
    # verify says what load says: the run is refused, step 2 asked for by name loads.
    assert main(["verify", url, *flags]) == 1
    assert main(["verify", url, "--step", "3", *flags]) == 1
    assert main(["verify", url, "--step", "2", *flags]) == 0
    assert main(["prune", url, "--keep", "1", *flags]) == 0
    assert st.exists(step_dirname(3), MANIFEST)


def test_a_file_named_like_a_step_is_ignored(storage_url, capsys):
    url, opts = storage_url
    snaps = _run(url, opts, [1])
    st = Storage(url, opts)
    st.write_bytes(b"not a step", "step-00000009")
    model, opt = tiny_run(seed=3)
    mgr = _mgr(url, opts, model, opt)
    assert mgr.steps() == [1]
    assert mgr.load() == 1
    assert_same(tiny_snapshot(model, opt), snaps[1])
    assert mgr.save(2)
    assert mgr.steps() == [1, 2]
    flags = [f"--storage-option={k}={v}" for k, v in opts.items()]
    capsys.readouterr()
    assert main(["ls", url, *flags]) == 0
    out = capsys.readouterr().out
    assert "ignored: step-00000009" in out
    assert main(["verify", url, *flags]) == 0
    assert main(["prune", url, "--keep", "1", *flags]) == 0
    assert st.read_bytes("step-00000009") == b"not a step"
    assert mgr.steps() == [2]


def test_a_manifest_with_out_of_bounds_numbers_is_corrupt_everywhere(tmp_path, capsys):
    url = str(tmp_path / "run")
    _run(url, {}, [1, 2])
    st = Storage(url)
    m = json.loads(st.read_bytes(step_dirname(2), MANIFEST))
    name = next(iter(m["files"]))
    m["files"][name]["size"] = int("9" * 4300)
    st.write_bytes(json.dumps(m).encode(), step_dirname(2), MANIFEST)
    assert _mgr(url, {}).steps() == [1]
    capsys.readouterr()
    assert main(["ls", url]) == 0
    out = capsys.readouterr().out
    assert "2  CORRUPT" in " ".join(out.split("  ")) or "CORRUPT" in out
    assert "size must be an integer in [0, 2**63), found an integer of" in out
    assert main(["ls", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["status"]) for s in doc["steps"]] == [(1, "committed"), (2, "corrupt")]
    assert main(["prune", url, "--keep", "1"]) == 0  # keeps 1, the only loadable step
    assert _mgr(url, {}).steps() == [1]
    got, _ = _resume(url, {})
    assert got == 1
    for bad in (-1, 2**63, 1.5, True, "7"):
        m["files"][name]["size"] = bad
        st.write_bytes(json.dumps(m).encode(), step_dirname(2), MANIFEST)
        assert _mgr(url, {}).steps() == [1], bad


def test_the_line_of_a_resumed_run_is_kept_and_a_rewind_starts_a_new_one(tmp_path):
    url = str(tmp_path / "run")
    _run(url, {}, [1, 2])
    _run(url, {}, [3])  # a restart: same line
    infos = {i.step: i for i in Catalog(Storage(url)).scan()}
    assert infos[1].line == infos[2].line == infos[3].line
    assert [infos[s].gen for s in (1, 2, 3)] == [1, 2, 3]
    model, opt = tiny_run()
    mgr = _mgr(url, {}, model, opt)
    assert mgr.load(step=2) == 2
    mgr.save(3)
    infos = {i.step: i for i in Catalog(Storage(url)).scan()}
    assert sorted(infos) == [1, 2, 3]
    assert infos[3].line != infos[2].line and infos[3].gen == 4


def _tier_step(step, line, gen):
    """A complete memory-tier step, as a load sees it (a commit of the run)."""
    return StepInfo(step, f"memory:{step}", Status.COMMITTED, gen=gen, line=line)


def test_a_memory_step_of_a_line_the_url_holds_nothing_of_is_vouched_for_by_its_record():
    """A memory step of a line with no commit in the url: another run's (or of a url emptied
    since), unless the url holds the line's record."""
    tier = [_tier_step(2, "a", 1)]
    mark_tier([], tier)
    assert tier[0].status == Status.SUPERSEDED
    tier = [_tier_step(2, "a", 1)]
    mark_tier([], tier, {"a": 1})
    assert tier[0].committed


def test_a_later_recorded_lines_memory_step_abandons_the_earlier_lines():
    """Two recorded lines in the memory tier only (a run killed, then a new one in its url):
    the later record's step is the run's, though older; a url commit of another line that is
    not older abandons both."""
    tier = [_tier_step(6, "a", 1), _tier_step(1, "b", 1)]
    mark_tier([], tier, {"a": 1, "b": 2})
    assert [t.status for t in tier] == [Status.SUPERSEDED, Status.COMMITTED]
    url = [StepInfo(1, step_dirname(1), Status.COMMITTED, gen=1, line="c")]
    tier = [_tier_step(6, "a", 1), _tier_step(1, "b", 1)]
    mark_tier(url, tier, {"a": 1, "b": 2})
    assert [t.status for t in tier] == [Status.SUPERSEDED, Status.SUPERSEDED]
