"""The url's records of memory-tier lines (store/_records.py): a line the url does not vouch
for gets one record at its first memory save, never rewritten at the next ones; a commit to
the url keeps its own line's record and removes those of the other lines, and ``prune`` all
but the newest step's line's; ``ls`` shows them, ``verify`` ignores them. Against a local directory,
memory:// and S3 (moto)."""

from __future__ import annotations

import json

import pytest

from muon_ckpt import CheckpointExistsError, CheckpointManager, MemoryOptions
from muon_ckpt.cli import main
from muon_ckpt.store import Storage
from tests.conftest import tiny_run, tiny_train


class _Run:
    """A manager that keeps every step in memory (flushing nothing) and the url every 100."""

    def __init__(self, url, opts, tmp_path, **kw) -> None:
        self.model, self.opt = tiny_run()
        memory = MemoryOptions(interval=1, dir=str(tmp_path / "mem"), flush=False)
        kw.setdefault("interval", 100)
        self.mgr = CheckpointManager(
            url, model=self.model, optimizer=self.opt, storage_options=opts, memory=memory, **kw
        )

    def save(self, steps, **kw) -> None:
        for s in steps:
            tiny_train(self.model, self.opt, 1, seed=s)
            assert self.mgr.save(s, **kw)
            self.mgr.wait()


def _records(url, opts) -> dict[str, dict]:
    """name -> the record's content."""
    st = Storage(url, opts)
    names = [n for n in st.list_dirs() if n.startswith("line-")]
    return {n: json.loads(st.read_bytes(n, limit=1 << 16)) for n in names}


def test_one_record_per_line_written_at_its_first_memory_save(storage_url, tmp_path):
    """Memory steps 1-3 of a fresh run: one record, of step 1, not rewritten at 2 and 3; its
    name holds the line and gen its content says. A memory save whose line the url holds a
    commit of writes none."""
    url, opts = storage_url
    r = _Run(url, opts, tmp_path)
    assert r.mgr.load() is None
    r.save([1])
    first = _records(url, opts)
    r.save([2, 3])
    assert _records(url, opts) == first
    ((name, doc),) = first.items()
    assert doc["step"] == 1 and name == f"line-{doc['line']}-{doc['gen']}.json"
    r.mgr.close()
    r = _Run(url, opts, tmp_path)
    assert r.mgr.load() == 3 and r.mgr.last_load_tier == "memory"
    r.save([4], force=True)  # (a commit of the line: no record needed beside it)
    r.save([5])
    assert _records(url, opts) == first  # (the line's own: kept while it is the current one)
    r.mgr.close()


def test_a_new_lines_commit_removes_the_other_lines_records(storage_url, tmp_path):
    """Run A keeps steps 1-2 in memory only (recorded); run B, new_run=True, commits step 1
    to the url (recorded too: the tier keeps it): A's record goes after the commit, B's
    stays; A's memory steps are never restored there."""
    url, opts = storage_url
    a = _Run(url, opts, tmp_path)
    assert a.mgr.load() is None
    a.save([1, 2])
    a.mgr.close()
    (rec_a,) = _records(url, opts)
    b = _Run(url, opts, tmp_path, new_run=True)
    b.save([1], force=True)
    b.mgr.close()
    left = _records(url, opts)
    assert rec_a not in left and len(left) == 1
    c = _Run(url, opts, tmp_path)
    assert c.mgr.load() == 1
    c.mgr.close()


def test_prune_removes_a_record_no_commit_needs_and_ls_shows_records(tmp_path, capsys):
    """A record left behind (a job killed between a commit and its clean-up) of a line with
    no step: ``prune`` deletes it (``--dry-run`` names it), ``ls`` lists the records and
    ``verify`` checks the steps only."""
    url, opts = str(tmp_path / "run"), {}
    r = _Run(url, opts, tmp_path)
    assert r.mgr.load() is None
    r.save([1], force=True)
    r.mgr.close()
    (own,) = _records(url, opts)
    Storage(url).write_bytes(b"{}", "line-0123456789abcdef-7.json")
    assert main(["ls", url]) == 0
    out = capsys.readouterr().out
    assert "line 0123456789abcdef (gen 7) is recorded" in out and own.split("-")[1] in out
    assert main(["verify", url]) == 0
    assert main(["prune", url, "--keep", "1", "--dry-run"]) == 0
    assert "would delete the records of older memory-tier lines" in capsys.readouterr().out
    assert len(_records(url, opts)) == 2
    assert main(["prune", url, "--keep", "1"]) == 0
    assert "0123456789abcdef" in capsys.readouterr().out
    assert list(_records(url, opts)) == [own]


def test_a_first_save_without_load_beside_a_recorded_line_is_refused(tmp_path):
    """Run A keeps steps 1-2 in memory only (recorded, no commit); a manager that loaded
    nothing (no new_run) saving step 1, to the memory tier or to the url, is refused as
    beside another run's commits, writing nothing: a restart still resumes A's step 2."""
    url, opts = str(tmp_path / "run"), {}
    a = _Run(url, opts, tmp_path)
    assert a.mgr.load() is None
    a.save([1, 2])
    a.mgr.close()
    before = sorted(Storage(url).list_dirs())
    for force in (False, True):
        b = _Run(url, opts, tmp_path)
        with pytest.raises(CheckpointExistsError, match=r"memory-tier line .* new_run=True"):
            b.save([1], force=force)
        b.mgr.close()
        assert sorted(Storage(url).list_dirs()) == before
    c = _Run(url, opts, tmp_path)
    assert c.mgr.load() == 2 and c.mgr.last_load_tier == "memory"
    c.mgr.close()


def test_a_record_of_any_gen_still_lets_a_new_line_be_recorded(tmp_path):
    """A record whose gen has 18 digits (hand-made, or foreign): the run's own line is
    recorded with a gen above it, and its memory steps saved before the url's first commit
    are restored."""
    url, opts = str(tmp_path / "run"), {}
    Storage(url).write_bytes(b"{}", "line-feedface-999999999999999999.json")
    r = _Run(url, opts, tmp_path)
    assert r.mgr.load() is None
    r.save([1, 2])
    r.mgr.close()
    gens = [doc.get("gen") for doc in _records(url, opts).values()]
    assert [g for g in gens if g is not None] == [10**18]
    c = _Run(url, opts, tmp_path)
    assert c.mgr.load() == 2 and c.mgr.last_load_tier == "memory"
    c.mgr.close()


def test_records_are_deleted_by_the_names_listed(tmp_path, capsys):
    """Two records of one line and a gen written with a leading zero: ``prune`` deletes each
    by its listed name and reports those lines; so does a commit's clean-up."""
    url, opts = str(tmp_path / "run"), {}
    r = _Run(url, opts, tmp_path)
    assert r.mgr.load() is None
    r.save([1], force=True)
    r.mgr.close()
    (own,) = _records(url, opts)
    odd = ["line-abc-07.json", "line-dup-3.json", "line-dup-5.json"]
    for name in odd:
        Storage(url).write_bytes(b"{}", name)
    assert main(["prune", url, "--keep", "1"]) == 0
    assert "deleted the records of older memory-tier lines: abc, dup" in capsys.readouterr().out
    assert list(_records(url, opts)) == [own]
    for name in odd:
        Storage(url).write_bytes(b"{}", name)
    r = _Run(url, opts, tmp_path)
    assert r.mgr.load() == 1
    r.save([2], force=True)
    r.mgr.close()
    assert list(_records(url, opts)) == [own]
