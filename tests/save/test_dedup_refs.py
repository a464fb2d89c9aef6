"""A save builds only on bytes that check out (muon_ckpt/save/_writer.py, store/_confirm.py):
the data files of earlier saves a save refers to for unchanged tensors are checked before it
writes, and a missing or damaged one is written again from the saved state; no step refers to
data written more than ``dedup_max_age`` saves before it.

Real saves and loads (local directory, moto S3); exactness is bitwise.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch
from torch import nn

from muon_ckpt import CheckpointManager
from muon_ckpt.store import DATA, Catalog, Storage, data_ref, resolve, verify
from tests._ckpt import flip_byte


class _Frozen(nn.Module):
    """A frozen embedding (256 KiB fp32) and a small trained head."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(512, 128)
        self.head = nn.Linear(128, 8)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(512, 128, generator=g))
            self.head.weight.copy_(torch.randn(8, 128, generator=g))
        self.emb.weight.requires_grad_(False)


def _at(m: _Frozen, step: int) -> _Frozen:
    with torch.no_grad():
        m.head.weight.fill_(float(step))
        m.head.bias.fill_(-float(step))
    return m


def _same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def _where(st: Storage, step: int, key: str) -> tuple[str, int, int]:
    """(name from the step directory, offset, length) of ``key``'s stored item in ``step``."""
    _, md = Catalog(st).checked(step)
    (info,) = [i for idx, i in md.storage_data.items() if idx.fqn == key]
    return info.relative_path, info.offset, info.length


def damage(st: Storage, name: str, how: str, at: int = 0) -> None:
    """Flip one byte at ``at`` of the data file ``name`` (``../data/<dir>/<file>``), in place
    (an object rewritten on an object store), or delete the file."""
    ref = data_ref(name)
    assert ref is not None, name
    if how == "delete":
        st.rm(DATA, *ref)
    elif st.is_local:
        flip_byte(st.path(DATA, *ref), at, 0x10)
    else:
        data = bytearray(st.read_bytes(DATA, *ref))
        data[at] ^= 0x10
        st.write_bytes(bytes(data), DATA, *ref)


def _url(kind: str, tmp_path: Any, request: pytest.FixtureRequest) -> tuple[str, dict]:
    if kind == "local":
        return str(tmp_path / "run"), {}
    bucket, opts = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/run", opts


@pytest.mark.parametrize("kind", ["local", "s3"])
@pytest.mark.parametrize("how", ["flip", "delete"])
def test_damaged_data_a_save_refers_to_is_written_again(tmp_path, request, caplog, kind, how):
    """Steps 1 and 2 store the frozen embedding once (step 2 refers to step 1's file). A
    byte flipped in that file after the commit (bit rot, a tool rewriting the object), or the
    file deleted (a lifecycle rule): the saves that follow write the embedding again from the
    saved state instead of referring to the damage (or failing for the missing file), and a
    restart loads the newest step bitwise; retention kept steps that load. (keep_last=4: a
    file is in at most 3 saves, so step 3 would still refer to step 1's, ``dedup_bound``.)"""
    url, opts = _url(kind, tmp_path, request)
    m = _Frozen()
    mgr = CheckpointManager(url, model=m, storage_options=opts, keep_last=4)
    for step in (1, 2):
        _at(m, step)
        mgr.save(step)
    st = Storage(url, opts)
    name, offset, length = _where(st, 2, "model.emb.weight")
    assert data_ref(name)[0].startswith("00000001-")  # step 2 refers to step 1's file
    damage(st, name, how, offset + length // 2)
    with caplog.at_level(logging.WARNING, logger="muon_ckpt"):
        for step in (3, 4, 5, 6):
            _at(m, step)
            assert mgr.save(step)
    mgr.close()
    fresh = _Frozen()
    with torch.no_grad():
        fresh.emb.weight.zero_()
    assert CheckpointManager(url, model=fresh, storage_options=opts).load() == 6
    _same(fresh, m)
    assert Catalog(st).committed_steps() == [3, 4, 5, 6]
    for step in (3, 4, 5, 6):
        assert verify(resolve(st, step)).ok
    assert _where(st, 3, "model.emb.weight")[0].startswith("../data/00000003-")
    assert _where(st, 4, "model.emb.weight")[0] == _where(st, 3, "model.emb.weight")[0]
    warned = [r.message for r in caplog.records if "written again" in r.message]
    assert len(warned) == 1 and data_ref(name)[0] in warned[0], warned


def test_damage_found_by_a_new_manager_after_a_load_is_written_again(tmp_path):
    """The same after a restart: a new manager that loaded step 2 (whose frozen embedding
    lies in step 1's file) checks that file before its first save refers to it."""
    url = str(tmp_path / "run")
    m = _Frozen()
    with CheckpointManager(url, model=m) as mgr:
        for step in (1, 2):
            _at(m, step)
            mgr.save(step)
    st = Storage(url)
    name, offset, length = _where(st, 2, "model.emb.weight")
    got = _Frozen()
    mgr = CheckpointManager(url, model=got)
    assert mgr.load() == 2
    damage(st, name, "flip", offset + length // 2)  # after the load, before the save
    _at(got, 3)
    mgr.save(3)
    mgr.close()
    assert _where(st, 3, "model.emb.weight")[0].startswith("../data/00000003-")
    fresh = _Frozen()
    with torch.no_grad():
        fresh.emb.weight.zero_()
    assert CheckpointManager(url, model=fresh).load() == 3
    _same(fresh, _at(_Frozen(), 3))


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_no_step_refers_to_data_older_than_dedup_max_age_saves(tmp_path, request, kind):
    """With ``dedup_max_age=3`` the frozen embedding is written again at every third save:
    each step's files were written by one of its last 3 saves (the manifest's ``data_gens``
    say which), and every step loads bitwise."""
    url, opts = _url(kind, tmp_path, request)
    m = _Frozen()
    with CheckpointManager(url, model=m, storage_options=opts, dedup_max_age=3) as mgr:
        for step in range(1, 8):
            _at(m, step)
            mgr.save(step)
    st = Storage(url, opts)
    cat = Catalog(st)
    homes = []
    for step in range(1, 8):
        man = cat.manifest(step)
        dirs = {data_ref(n)[0] for n in man.files if data_ref(n)}
        assert set(man.data_gens) == dirs, (step, man.data_gens)
        assert all(man.gen - g < 3 for g in man.data_gens.values()), (step, man.data_gens)
        homes.append(int(data_ref(_where(st, step, "model.emb.weight")[0])[0][:8]))
    assert homes == [1, 1, 1, 4, 4, 4, 7], homes
    for step in (1, 5, 7):
        fresh = _Frozen()
        got = CheckpointManager(url, model=fresh, storage_options=opts).load(step=step)
        assert got == step
        _same(fresh, _at(_Frozen(), step))


@pytest.mark.parametrize("keep_last", [2, 3])
def test_no_data_file_is_in_every_step_retention_keeps(tmp_path, keep_last):
    """keep_last=n below dedup_max_age: a data file is in at most n - 1 consecutive saves
    (keep_last=2: every save writes every tensor), so each is missing from a kept step, and a
    byte flipped in the newest step's copy of the frozen embedding (bit rot after the job
    ended) leaves an older step to load, bitwise. (Every kept step referred to one copy of it,
    and no step loaded.)"""
    url = str(tmp_path / "run")
    m = _Frozen()
    with CheckpointManager(url, model=m, keep_last=keep_last) as mgr:
        for step in range(1, 8):
            _at(m, step)
            mgr.save(step)
    st = Storage(url)
    cat = Catalog(st)
    kept = cat.committed_steps()
    assert kept == list(range(8 - keep_last, 8))
    named = {s: {n for n in cat.manifest(s).files if data_ref(n)} for s in kept}
    for name in set().union(*named.values()):
        assert any(name not in files for files in named.values()), (name, named)
    name, offset, length = _where(st, 7, "model.emb.weight")
    damage(st, name, "flip", offset + length // 2)
    fresh = _Frozen()
    with torch.no_grad():
        fresh.emb.weight.zero_()
    got = CheckpointManager(url, model=fresh).load()
    assert got == 6
    _same(fresh, _at(_Frozen(), 6))


def test_each_referred_file_is_read_back_once_while_it_is_unchanged(tmp_path, monkeypatch):
    """The cost: a file an unchanged tensor refers to is read back by the first save that
    refers to it in this process, and again only when the storage reports a change: saves 3
    and 4 read back only the files they wrote."""
    from muon_ckpt.store import _confirm

    # Files changed less than this long ago are read back at every save (see _confirm).
    monkeypatch.setattr(_confirm, "SETTLED_SECONDS", 0.0)
    reads: list[str] = []
    real = _confirm.file_checksum

    def spy(f: Any, entry: Any, *a: Any, **k: Any) -> Any:
        reads.append(os.path.basename(os.path.dirname(k["where"])))
        return real(f, entry, *a, **k)

    monkeypatch.setattr(_confirm, "file_checksum", spy)
    url = str(tmp_path / "run")
    m = _Frozen()
    with CheckpointManager(url, model=m) as mgr:
        for step in (1, 2, 3, 4):
            _at(m, step)
            reads.clear()
            mgr.save(step)
            dirs = {d[:8] for d in reads if d[:8].isdigit()}  # (not .metadata's step directory)
            others = sorted(dirs - {f"{step:08d}"})
            assert others == (["00000001"] if step == 2 else []), (step, reads)


def test_an_object_rewritten_in_place_on_memory_fs_is_read_back_again(monkeypatch, caplog):
    """``memory://`` reports only an object's creation time, which an in-place write (a tool
    rewriting one byte, ``open(..., "r+b")``) keeps: that is no change stamp, so every save
    reads back what it refers to. Step 3 then writes the damaged file's tensor again and
    loads bitwise (it committed on the damaged bytes, and no step after step 1 loaded)."""
    import fsspec

    from muon_ckpt.store import _confirm

    # (no file is taken for one changed within the clock's tick: the stamp alone decides)
    monkeypatch.setattr(_confirm, "SETTLED_SECONDS", 0.0)
    url = f"memory://inplace-{os.getpid()}-{id(caplog)}/run"
    m = _Frozen()
    mgr = CheckpointManager(url, model=m)
    for step in (1, 2):  # step 2 refers to step 1's file, read back by save 2
        _at(m, step)
        mgr.save(step)
    st = Storage(url)
    name, offset, length = _where(st, 2, "model.emb.weight")
    fs = fsspec.filesystem("memory")
    with fs.open(st.path(DATA, *data_ref(name)), "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    with caplog.at_level(logging.WARNING, logger="muon_ckpt"):
        _at(m, 3)
        assert mgr.save(3)
    mgr.close()
    assert "written again" in caplog.text and data_ref(name)[0] in caplog.text
    assert _where(st, 3, "model.emb.weight")[0].startswith("../data/00000003-")
    fresh = _Frozen()
    with torch.no_grad():
        fresh.emb.weight.zero_()
    assert CheckpointManager(url, model=fresh).load() == 3
    _same(fresh, _at(_Frozen(), 3))
    assert verify(resolve(st, 3)).ok
    fs.rm(st.root, recursive=True)


def _body_two_ranks(rank: int, world: int, url: str) -> None:
    """Two ranks, each writing part of a replicated model (DCP gives each tensor one writer):
    steps 1 and 2, both files of step 1 damaged after the commit, then step 3."""
    import torch.distributed as dist

    m = _Frozen()
    with CheckpointManager(url, model=m) as mgr:
        for step in (1, 2):
            _at(m, step)
            mgr.save(step)
        if rank == 0:
            st = Storage(url)
            for name in {n for n in Catalog(st).manifest(2).files if n.startswith("../data/")}:
                if data_ref(name)[0].startswith("00000001-"):
                    damage(st, name, "flip", st.size(DATA, *data_ref(name)) // 2)
        dist.barrier()
        _at(m, 3)
        mgr.save(3)


def test_each_rank_writes_again_what_it_would_refer_to_in_a_damaged_file(tmp_path):
    from tests._dist import run_on_ranks

    url = str(tmp_path / "run")
    run_on_ranks(_body_two_ranks, 2, url)
    st = Storage(url)
    assert verify(resolve(st, 3)).ok
    fresh = _Frozen()
    with torch.no_grad():
        fresh.emb.weight.zero_()
    assert CheckpointManager(url, model=fresh).load() == 3
    _same(fresh, _at(_Frozen(), 3))
