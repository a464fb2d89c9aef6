"""Checkpoints cost only what changed (muon_ckpt/save/_dedup.py, store/_data.py): a save
refers to the tensors its base holds unchanged (same SHA-256 of dtype, shape and bytes) and
writes the rest; data files live in ``<url>/data/`` and go only when no manifest names them.

Real saves and loads (local directory, moto S3); exactness is bitwise.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
from torch import nn

from muon_ckpt import CheckpointManager
from muon_ckpt.cli import main
from muon_ckpt.store import (
    DATA,
    MANIFEST,
    Catalog,
    Storage,
    data_ref,
    parse_data_dirname,
    prune,
    step_dirname,
    verify,
)
from muon_ckpt.store._resolve import resolve
from tests._dist import _context, run_on_ranks


class _Frozen(nn.Module):
    """A frozen embedding (``rows`` x 128 fp32) and a small trained head."""

    def __init__(self, rows: int = 512) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(rows, 128)
        self.head = nn.Linear(128, 8)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(rows, 128, generator=g))
            self.head.weight.copy_(torch.randn(8, 128, generator=g))
            self.head.bias.copy_(torch.randn(8, generator=g))
        self.emb.weight.requires_grad_(False)


def _set_step(m: _Frozen, step: int) -> None:
    with torch.no_grad():
        m.head.weight.fill_(float(step))
        m.head.bias.fill_(-float(step))


def _same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def _loads(url: str, step: int | None, want: nn.Module, opts: dict | None = None) -> None:
    fresh = _Frozen(want.emb.weight.shape[0])
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    got = CheckpointManager(url, model=fresh, storage_options=opts).load(step=step)
    assert step is None or got == step
    _same(fresh, want)


def _stored_in(st: Storage, step: int, key: str) -> str:
    """The data directory that holds ``key``'s bytes for ``step``."""
    _, md = Catalog(st).checked(step)
    names = {i.relative_path for idx, i in md.storage_data.items() if idx.fqn == key}
    assert len(names) == 1, names
    ref = data_ref(names.pop())
    assert ref is not None
    return ref[0]


def _stored_bytes(st: Storage) -> int:
    """Every byte under the run's root but the lease and the index (the run's bookkeeping)."""
    return sum(n for p, n in st.walk_files().items() if p not in ("lease.json", "index.json"))


def _no_orphans(st: Storage) -> None:
    """Every data file is named by some manifest, and every name resolves to a file."""
    named = set()
    for step in Catalog(st).committed_steps():
        named |= {n for n in Catalog(st).manifest(step).files if data_ref(n)}
    have = {f"../{DATA}/{p}" for p in st.walk_files(DATA)}
    assert named == have, named ^ have


# ---------------------------------------------------------------------- what is written
def test_a_95_percent_frozen_model_saved_3_times_stores_about_one_full_step(tmp_path):
    """keep_last=4, three saves of a model whose embedding is frozen (97% of the state; the
    head and its AdamW moments change at every step): at most 1.1x one full step in all,
    where the same run with dedup=False stores 3x. (With keep_last=3 the third save writes
    the embedding again: no data file is in every kept step, ``dedup_bound``.)"""
    stored = {}
    for dedup in (True, False):
        url = str(tmp_path / f"run-{dedup}")
        m = _Frozen(rows=4096)  # 2 MiB frozen, 4 KiB trained (+ 8 KiB of moments)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.1)
        mgr = CheckpointManager(url, model=m, optimizer=opt, keep_last=4, dedup=dedup)
        sizes = []
        for step in (1, 2, 3):
            m.head(m.emb(torch.tensor([step]))).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step)
            sizes.append(_stored_bytes(Storage(url)))
        mgr.close()
        stored[dedup] = sizes[2] / sizes[0]
        _loads(url, 3, m)
        if dedup:
            st = Storage(url)
            assert _stored_in(st, 3, "model.emb.weight") == _stored_in(st, 1, "model.emb.weight")
            assert _stored_in(st, 3, "model.head.weight").startswith("00000003-")
    assert stored[True] <= 1.1, stored
    assert stored[False] >= 2.9, stored


@pytest.mark.parametrize(
    "how,async_save",
    [("data", False), ("data", True), ("copy_no_grad", False), ("load_state_dict", False)],
)
def test_a_frozen_tensor_changed_without_autograd_is_written_and_loads_back_changed(
    tmp_path, how, async_save
):
    """One element of the frozen embedding changed through ``.data``, ``copy_`` under
    ``no_grad`` or ``load_state_dict`` (none of which autograd or ``requires_grad`` sees):
    the next save writes it. Having changed, it is written once more (the writer does not
    wait for its hash), then referred to."""
    url = str(tmp_path / "run")
    m = _Frozen()
    mgr = CheckpointManager(url, model=m, async_save=async_save)
    mgr.save(1)
    before = _Frozen()
    _same(before, m)
    changed = m.emb.weight.detach().clone()
    changed[3, 5] = torch.nextafter(
        changed[3, 5], torch.tensor(float("inf"), dtype=changed.dtype)
    )  # one ulp
    if how == "data":
        m.emb.weight.data[3, 5] = changed[3, 5]
    elif how == "copy_no_grad":
        with torch.no_grad():
            m.emb.weight.copy_(changed)
    else:
        m.load_state_dict({**m.state_dict(), "emb.weight": changed})
    for step in (2, 3, 4):
        mgr.save(step)
    mgr.close()
    st = Storage(url)
    emb = [_stored_in(st, s, "model.emb.weight") for s in (1, 2, 3, 4)]
    assert emb[0].startswith("00000001-") and emb[1].startswith("00000002-"), emb
    assert emb[3] == emb[2]  # unchanged since: referred to
    _loads(url, 2, m)
    _loads(url, 4, m)
    _loads(url, 1, before)


def test_a_tensor_resharded_between_saves_is_written_whole(tmp_path):
    """Saved on 2 ranks as two Shard(0) halves, loaded on 1 and saved again: the one chunk
    it is now (same values) is written, not taken for the stored half; then back on 2 ranks,
    where the halves are written again."""
    url = str(tmp_path / "run")
    run_on_ranks(_body_sharded, 2, url, None, 1)
    st = Storage(url)
    m = _Frozen()
    mgr = CheckpointManager(url, model=m)
    assert mgr.load() == 1
    _same(m, _Frozen())
    mgr.save(2)
    mgr.close()
    assert _stored_in(st, 2, "model.emb.weight").startswith("00000002-")
    _loads(url, 2, _Frozen())
    run_on_ranks(_body_sharded, 2, url, 2, 3)
    _, md = Catalog(st).checked(3)
    dirs = {i.relative_path.split("/")[2] for x, i in md.storage_data.items() if "emb" in x.fqn}
    assert len(dirs) == 1 and dirs.pop().startswith("00000003-")
    _loads(url, 3, _Frozen())


def _body_sharded(rank: int, world: int, url: str, load: int | None, save: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    m = _Frozen()
    mesh = init_device_mesh("cpu", (world,))
    for name in ("emb", "head"):
        mod = getattr(m, name)
        w = distribute_tensor(mod.weight.detach(), mesh, [Shard(0)])
        mod.weight = nn.Parameter(w, requires_grad=mod.weight.requires_grad)
    with CheckpointManager(url, model=m) as mgr:
        if load is not None:
            assert mgr.load() == load
            want = _Frozen().emb.weight.detach().chunk(world)[rank]
            assert torch.equal(m.emb.weight.to_local(), want)
        mgr.save(save)


# ---------------------------------------------------------------------- what is kept
def _three_saves(url: str, opts: dict | None = None, **kw: Any) -> _Frozen:
    m = _Frozen()
    with CheckpointManager(url, model=m, storage_options=opts, **kw) as mgr:
        for step in (1, 2, 3):
            _set_step(m, step)
            mgr.save(step)
    return m


@pytest.mark.parametrize("how", ["retention", "prune", "by_hand"])
def test_deleting_the_oldest_steps_leaves_the_newest_loading_bitwise(tmp_path, capsys, how):
    """Step 3 refers to step 1's data for the frozen embedding; deleting steps 1 and 2 by
    retention (keep_last=1), ``muon-ckpt prune`` or by hand (rm -r of their directories)
    leaves step 3 loading bitwise and verifying, and only what no step names is deleted."""
    url = str(tmp_path / "run")
    m = _three_saves(url, keep_last=1 if how == "retention" else None)
    st = Storage(url)
    if how == "prune":
        assert main(["prune", url, "--keep", "1"]) == 0
        assert "deleted 2 step(s): 1, 2" in capsys.readouterr().out
    elif how == "by_hand":
        for s in (1, 2):
            st.rm(step_dirname(s))
    assert Catalog(st).committed_steps() == [3]
    assert _stored_in(st, 3, "model.emb.weight").startswith("00000001-")
    _loads(url, None, m)
    assert verify(resolve(st, 3)).ok
    if how == "by_hand":  # the next save collects what only the deleted steps named
        with CheckpointManager(url, model=m) as mgr:
            assert mgr.load() == 3
            _set_step(m, 4)
            mgr.save(4)
        assert Catalog(st).committed_steps() == [3, 4]
    _no_orphans(st)
    steps = {parse_data_dirname(n) for n in st.listdir(DATA)}
    assert 2 not in steps and 1 in steps  # step 2 wrote only what changed again later


def test_a_prune_of_every_step_but_the_newest_keeps_what_it_refers_to_on_s3(s3_bucket):
    bucket, opts = s3_bucket
    url = f"s3://{bucket}/run"
    m = _three_saves(url, opts)
    st = Storage(url, opts)
    assert prune(st, 1).deleted == [1, 2]
    _no_orphans(st)
    _loads(url, 3, m, opts)


def test_two_runs_in_one_bucket_share_nothing(s3_bucket):
    """Two runs of the same model (the same bytes) in one bucket: each run's steps name only
    its own data; deleting one run entirely leaves the other loading bitwise."""
    bucket, opts = s3_bucket
    a, b = f"s3://{bucket}/a", f"s3://{bucket}/b"
    m = _three_saves(a, opts)
    _three_saves(b, opts)
    st_b = Storage(b, opts)
    _no_orphans(st_b)  # every name of b's manifests is a file under b
    Storage(a, opts).rm()
    _loads(b, 3, m, opts)
    _loads(b, 1, _three_saves_state(1), opts)
    assert all(verify(resolve(st_b, s)).ok for s in (1, 2, 3))


def _three_saves_state(step: int) -> _Frozen:
    m = _Frozen()
    _set_step(m, step)
    return m


def test_a_new_run_in_a_used_url_refers_to_none_of_the_old_runs_data(tmp_path):
    url = str(tmp_path / "run")
    _three_saves(url)
    m = _Frozen()
    _set_step(m, 7)
    with CheckpointManager(url, model=m, new_run=True) as mgr:
        mgr.save(1)
    st = Storage(url)
    assert Catalog(st).committed_steps() == [1]
    assert _stored_in(st, 1, "model.emb.weight").startswith("00000001-")
    _no_orphans(st)  # the old run's steps and data went after the commit
    assert len(st.listdir(DATA)) == 1
    _loads(url, 1, m)


def test_a_run_of_format_2_steps_continues_in_format_3(tmp_path):
    """Steps saved with dedup=False (format 2: every file in the step's directory) load,
    and a run resumed from one writes format 3 steps beside them (a full first step: format
    2 records no digests); retention deletes the old steps without touching the new data.
    (keep_last=3: step 5 refers to step 4's data, step 6 writes it again, ``dedup_bound``.)"""
    url = str(tmp_path / "run")
    _three_saves(url, dedup=False)
    st = Storage(url)
    assert not st.exists(DATA)
    assert Catalog(st).manifest(3).format_version == 2
    m = _Frozen()
    with CheckpointManager(url, model=m, keep_last=3) as mgr:
        assert mgr.load() == 3
        _same(m, _three_saves_state(3))
        for step in (4, 5, 6):
            _set_step(m, step)
            mgr.save(step)
    assert Catalog(st).committed_steps() == [4, 5, 6]
    assert Catalog(st).manifest(5).format_version == 3
    assert _stored_in(st, 4, "model.emb.weight") == _stored_in(st, 5, "model.emb.weight")
    assert _stored_in(st, 4, "model.emb.weight").startswith("00000004-")
    _no_orphans(st)
    _loads(url, 4, _three_saves_state(4))
    _loads(url, 5, _three_saves_state(5))
    _loads(url, 6, m)


def test_a_data_file_deleted_by_hand_makes_the_steps_that_name_it_corrupt(tmp_path):
    url = str(tmp_path / "run")
    _three_saves(url)
    st = Storage(url)
    name = next(n for n in Catalog(st).manifest(3).files if n.startswith("../data/00000001-"))
    st.rm(step_dirname(3), name)
    r = verify(resolve(st, 3))
    assert not r.ok and any("missing" in p for p in r.problems)
    m = _Frozen()
    mgr = CheckpointManager(url, model=m)
    with pytest.raises(Exception, match="missing"):
        mgr.load(step=3)


# ---------------------------------------------------------------------- crashes in retention
def _child_retain(url: str, opts: dict, kill_at: int, count_file: str) -> None:
    """Resume step 3, save step 4 with keep_last=1 (retention deletes steps 1-3 and the data
    only they name), and SIGKILL itself at the ``kill_at``-th deletion of that retention (0:
    never; the count goes to ``count_file``)."""
    from muon_ckpt.store import _storage

    torch.set_num_threads(1)
    m = _Frozen()
    mgr = CheckpointManager(url, model=m, storage_options=opts, keep_last=1)
    assert mgr.load() == 3
    _set_step(m, 4)
    real_rm, real_tidy = _storage.Storage.rm, Catalog.tidy
    calls = [0, False]

    def tidy(self: Catalog, *a: Any, **k: Any) -> Any:
        calls[1] = True
        return real_tidy(self, *a, **k)

    def rm(self: Storage, *parts: str) -> None:
        if calls[1]:
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        real_rm(self, *parts)

    Catalog.tidy = tidy  # type: ignore[method-assign]
    _storage.Storage.rm = rm  # type: ignore[method-assign]
    mgr.save(4)
    mgr.close()
    with open(count_file, "w") as f:
        f.write(str(calls[0]))


def _retain_in_child(url: str, opts: dict, kill_at: int, count_file: str) -> int:
    p = _context().Process(target=_child_retain, args=(url, opts, kill_at, count_file))
    p.start()
    p.join(120)
    return p.exitcode if p.exitcode is not None else -1


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_sigkill_during_retention_loses_nothing(tmp_path, request, backend):
    """A process killed at a deletion of retention (a step's manifest gone, its directory
    not; between the data files collected) leaves step 4 and every step not yet deleted
    loading bitwise; the next save finishes the clean-up."""
    if backend == "s3":
        bucket, opts = request.getfixturevalue("s3_bucket")
        base = f"s3://{bucket}"
    else:
        base, opts = str(tmp_path), {}
    count = str(tmp_path / "count")
    url = f"{base}/dry"
    _three_saves(url, opts)
    assert _retain_in_child(url, opts, 0, count) == 0
    with open(count) as f:
        n = int(f.read())
    assert n >= 6  # 3 steps (manifest, then directory) and the data
    points = [1, 2, n - 1, n] if backend == "local" else [2, n - 1]
    for k in points:
        url = f"{base}/kill{k}"
        _three_saves(url, opts)
        assert _retain_in_child(url, opts, k, count) == -signal.SIGKILL
        st = Storage(url, opts)
        steps = Catalog(st).committed_steps()
        assert steps[-1] == 4, (k, steps)
        for s in steps:
            _loads(url, s, _three_saves_state(s), opts)
            assert verify(resolve(st, s)).ok
        m = _three_saves_state(5)
        with CheckpointManager(url, model=m, storage_options=opts, keep_last=1) as mgr:
            assert mgr.load() == 4
            _set_step(m, 5)
            mgr.save(5)
        assert Catalog(st).committed_steps() == [5]
        assert [n for n in st.listdir() if n.startswith("step-")] == [step_dirname(5)]
        _no_orphans(st)
        _loads(url, 5, m, opts)
        assert not st.exists(step_dirname(4), MANIFEST)


# ---------------------------------------------------------------------- readers and trust
def test_plain_dcp_reads_a_step_that_refers_to_earlier_data(tmp_path):
    """Outside readers: ``dcp_to_torch_save`` of a local step directory follows its
    ``../data/`` names (step 3 holds the frozen embedding in step 1's data)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    url = str(tmp_path / "run")
    m = _three_saves(url)
    out = str(tmp_path / "step3.pt")
    dcp_to_torch_save(os.path.join(url, step_dirname(3)), out)
    sd = torch.load(out, weights_only=True)
    assert torch.equal(sd["model.emb.weight"], m.emb.weight)
    assert torch.equal(sd["model.head.weight"], m.head.weight)


@pytest.mark.parametrize(
    "name",
    [
        "../data/../../etc/passwd",
        "../data/00000001-0123456789abcdef/../x",
        "../../data/00000001-0123456789abcdef/__0_0.distcp",
        "../data/1-0123456789abcdef/__0_0.distcp",
        "../data/00000001-0123456789abcdef/a/b",
        "../step-00000001/__0_0.distcp",
    ],
)
def test_a_manifest_naming_anything_but_a_data_file_of_the_run_is_corrupt(tmp_path, name):
    from muon_ckpt import CheckpointCorruptError
    from muon_ckpt.store import Manifest

    url = str(tmp_path / "run")
    _three_saves(url)
    st = Storage(url)
    m = Catalog(st).manifest(3)
    good = next(n for n in m.files if data_ref(n))
    m.files[name] = m.files.pop(good)
    with pytest.raises(CheckpointCorruptError, match="no other"):
        Manifest.from_json(m.to_json(), "crafted")
    m.files[good] = m.files.pop(name)
    m.format_version = 2  # data of the run in a format that has none
    with pytest.raises(CheckpointCorruptError, match="lists files of the run's data"):
        Manifest.from_json(m.to_json(), "crafted")
