"""Untrusted checkpoints stay inside their root: crafted ``.metadata`` paths, files
that are FIFOs, devices or symlinks, manifests nested without end, non-canonical step names,
and a step directory that is a symlink to another run's step. Every command finishes within a
bound, with a CheckpointCorruptError where it reads the bad step."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import threading
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from muon_ckpt import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointManager,
    export_safetensors,
    import_optimizer_state,
)
from muon_ckpt.cli import main
from muon_ckpt.store import MANIFEST, METADATA, Storage, step_dirname
from muon_ckpt.store._layout import MAX_MANIFEST_BYTES
from muon_ckpt.store.dcp import parse_metadata
from tests._ckpt import TinyNet, data_files, make_muon, muon_state_sd, three_step_run, train

BOUND_S = 20.0  # every command must finish within this (a FIFO used to block forever)


@pytest.fixture
def local_run(tmp_path: Any) -> dict[str, Any]:
    return three_step_run(str(tmp_path / "run"), {}, leftover=False)


def bounded(fn: Callable[[], Any]) -> Any:
    """``fn()``'s result or exception, failing the test if it runs past BOUND_S."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(BOUND_S)
    assert not t.is_alive(), f"still running after {BOUND_S} s (blocked on a FIFO?)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def cli(capsys: pytest.CaptureFixture, run: dict[str, Any], *argv: str) -> tuple[int, str, str]:
    rc = bounded(lambda: main([*argv[:1], run["url"], *argv[1:], *run["flags"]]))
    out, err = capsys.readouterr()
    return rc, out, err


def _rewrite_manifest(st: Storage, step: int, edit: Callable[[dict], None]) -> None:
    m = json.loads(st.read_bytes(step_dirname(step), MANIFEST))
    edit(m)
    st.write_bytes(json.dumps(m).encode(), step_dirname(step), MANIFEST)


def _point_metadata_at(st: Storage, step: int | None, target: str) -> None:
    """Make step's ``.metadata`` (``step`` None: the root's) send every item to ``target``
    (a crafted checkpoint: the manifest's entry for ``.metadata`` is updated to match, so
    its checksum passes)."""
    name = "" if step is None else step_dirname(step)
    md = parse_metadata(st.read_bytes(name, METADATA), "test")
    md.storage_data = {
        k: dataclasses.replace(v, relative_path=target) for k, v in md.storage_data.items()
    }
    data = pickle.dumps(md)
    st.write_bytes(data, name, METADATA)
    if step is not None:
        entry = {"size": len(data), "crc32": f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"}
        _rewrite_manifest(st, step, lambda m: m["files"].__setitem__(METADATA, entry))


def _fresh() -> tuple[Any, Any]:
    torch.manual_seed(7)
    model = TinyNet()
    return model, make_muon(model)


# ------------------------------------------------------------------ crafted .metadata paths
def test_crafted_s3_metadata_cannot_read_another_bucket(s3_bucket, s3_server):
    """``.metadata`` naming ``/victim/secret/copy.distcp`` made load()
    read that object (unlisted, never checksummed) with verify="size"."""
    import s3fs

    from tests.conftest import s3_options

    bucket, opts = s3_bucket
    url = f"s3://{bucket}/run"
    model, opt = _fresh()
    with CheckpointManager(url, model=model, optimizer=opt, storage_options=opts) as mgr:
        mgr.save(2)
        mgr.save(3)
    st = Storage(url, opts)
    fs = s3fs.S3FileSystem(**s3_options(s3_server))
    victim = f"{bucket}-victim"
    fs.mkdir(victim)
    try:
        data_file = next(iter(data_files(st, 3)))
        fs.pipe(f"{victim}/secret/copy.distcp", st.read_bytes(step_dirname(3), data_file))
        _point_metadata_at(st, 3, f"/{victim}/secret/copy.distcp")
        for verify in ("crc32", "size"):
            model, opt = _fresh()
            mgr = CheckpointManager(
                url, model=model, optimizer=opt, storage_options=opts, verify=verify
            )
            with pytest.raises(CheckpointCorruptError, match="outside the checkpoint"):
                mgr.load(step=3)
            assert mgr.load(step=2) == 2  # the other steps are untouched
    finally:
        fs.rm(victim, recursive=True)


@pytest.mark.parametrize("target", ["../outside/__0_0.distcp", "/tmp/outside/__0_0.distcp"])
def test_metadata_paths_outside_the_step_are_refused_everywhere(
    local_run, capsys, tmp_path, target
):
    """load, export, import and inspect refuse a ``.metadata`` that points outside the step,
    without opening the outside file."""
    st = local_run["storage"]
    name = step_dirname(3)
    real = next(iter(data_files(st, 3)))
    outside = os.path.normpath(os.path.join(st.path(name), target))
    os.makedirs(os.path.dirname(outside), exist_ok=True)
    shutil.copy(st.path(name, real), outside)
    try:
        _point_metadata_at(st, 3, target)
        model, opt = _fresh()
        mgr = CheckpointManager(local_run["url"], model=model, optimizer=opt)
        with pytest.raises(CheckpointCorruptError, match="outside the checkpoint"):
            mgr.load(step=3)
        out = str(tmp_path / "o.safetensors")
        with pytest.raises(CheckpointCorruptError, match="outside the checkpoint"):
            export_safetensors(local_run["url"], out, step=3)
        assert not os.path.exists(out)
        with pytest.raises(CheckpointCorruptError, match="outside the checkpoint"):
            import_optimizer_state(opt, local_run["url"], model=model, step=3)
        rc, _, err = cli(capsys, local_run, "inspect", "--step", "3")
        assert rc == 1 and "CheckpointCorruptError" in err and "outside the checkpoint" in err
    finally:
        os.remove(outside)


@pytest.mark.parametrize("verify", ["checksum", "size"])
def test_metadata_ranges_past_a_file_are_refused_before_any_read(local_run, tmp_path, verify):
    """A ``.metadata`` that gives an item a length of a terabyte (its manifest entry updated
    so the checksum passes) is a corrupt step, not a terabyte allocation (ranged reads size
    their buffers from these lengths)."""
    st = local_run["storage"]
    name = step_dirname(3)
    md = parse_metadata(st.read_bytes(name, METADATA), "test")
    key = next(iter(md.storage_data))
    md.storage_data[key] = dataclasses.replace(md.storage_data[key], length=1 << 40)
    data = pickle.dumps(md)
    st.write_bytes(data, name, METADATA)
    entry = {"size": len(data), "crc32": f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"}
    _rewrite_manifest(st, 3, lambda m: m["files"].__setitem__(METADATA, entry))
    model, opt = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mgr = CheckpointManager(local_run["url"], model=model, optimizer=opt, verify=verify)
    with pytest.raises(CheckpointCorruptError, match="cannot be trusted"):
        bounded(lambda: mgr.load(step=3))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(CheckpointCorruptError, match="cannot be trusted"):
        bounded(lambda: export_safetensors(local_run["url"], str(tmp_path / "o.st"), step=3))
    assert bounded(mgr.load) == 2  # the fallback skips it


def test_plain_dcp_directory_pointing_outside_is_refused(tmp_path):
    """Without a manifest (a plain DCP directory) export and import refuse the same paths."""
    import torch.distributed.checkpoint as dcp

    model, opt = _fresh()
    train(model, opt, 1)
    step_url = str(tmp_path / "plain")
    dcp.save(muon_state_sd(model, opt), storage_writer=dcp.FileSystemWriter(step_url), no_dist=True)
    shutil.copytree(step_url, str(tmp_path / "outside"))
    _point_metadata_at(Storage(step_url), None, "../outside/__0_0.distcp")
    with pytest.raises(CheckpointCorruptError, match="outside the checkpoint"):
        export_safetensors(step_url, str(tmp_path / "o.safetensors"))
    with pytest.raises(CheckpointCorruptError, match="outside the checkpoint"):
        import_optimizer_state(opt, step_url, model=model)


def test_manifest_listing_a_path_outside_the_step_is_corrupt(local_run):
    st = local_run["storage"]
    good = st.read_bytes(step_dirname(3), MANIFEST)
    for name in ["../step-00000002/.metadata", "/etc/passwd", "a/b.distcp", ".."]:
        entry = {"size": 10, "crc32": "0" * 8}
        _rewrite_manifest(st, 3, lambda m, n=name, e=entry: m["files"].__setitem__(n, e))
        mgr = CheckpointManager(local_run["url"])
        assert mgr.steps() == [1, 2], name
        with pytest.raises(CheckpointCorruptError, match="plain file names inside its step"):
            mgr.load(step=3)
        st.write_bytes(good, step_dirname(3), MANIFEST)


# ------------------------------------------------------------------ FIFOs, devices, symlinks
def _fifo(path: str) -> None:
    if os.path.lexists(path):
        os.remove(path)
    os.mkfifo(path)


def _zero_link(path: str) -> None:
    if os.path.lexists(path):
        os.remove(path)
    os.symlink("/dev/zero", path)


def _every_command_fails_on_step_3(run: dict[str, Any], capsys: Any, tmp_path: Any) -> None:
    model, opt = _fresh()
    mgr = CheckpointManager(run["url"], model=model, optimizer=opt)
    assert bounded(mgr.steps) in ([1, 2], [1, 2, 3])
    with pytest.raises(CheckpointCorruptError):
        bounded(lambda: mgr.load(step=3))
    out = str(tmp_path / "o.safetensors")
    with pytest.raises(CheckpointCorruptError):
        bounded(lambda: export_safetensors(run["url"], out, step=3))
    with pytest.raises(CheckpointCorruptError):
        bounded(lambda: import_optimizer_state(opt, run["url"], model=model, step=3))
    rc, out_, err = cli(capsys, run, "inspect", "--step", "3")
    assert rc == 1 and "CheckpointCorruptError" in err, out_ + err
    rc, out_, _ = cli(capsys, run, "verify")
    assert rc == 1 and "step 3: FAILED" in out_ and "step 2: OK" in out_
    rc, out_, _ = cli(capsys, run, "ls")
    assert (rc == 0 and "newest committed: 2" in out_) or "newest committed: 3" in out_
    rc, out_, _ = cli(capsys, run, "prune", "--keep", "5")
    assert rc == 0
    assert bounded(lambda: mgr.load(step=2)) == 2


@pytest.mark.parametrize("how", ["fifo", "dev_zero"])
def test_manifest_that_is_a_fifo_or_dev_zero_fails_fast(local_run, capsys, tmp_path, how):
    path = local_run["storage"].path(step_dirname(3), MANIFEST)
    (_fifo if how == "fifo" else _zero_link)(path)
    _every_command_fails_on_step_3(local_run, capsys, tmp_path)
    mgr = CheckpointManager(local_run["url"])
    assert mgr.steps() == [1, 2]  # a junk newest step never blocks a resume


@pytest.mark.parametrize("how", ["metadata_dev_zero", "distcp_fifo", "distcp_dev_zero"])
def test_step_files_that_are_fifos_or_links_fail_fast(local_run, capsys, tmp_path, how):
    st = local_run["storage"]
    name = step_dirname(3)
    target = METADATA if how == "metadata_dev_zero" else next(iter(data_files(st, 3)))
    (_zero_link if how.endswith("dev_zero") else _fifo)(st.path(name, target))
    # A crafted manifest agrees with the junk: a 0-byte file.
    _rewrite_manifest(
        st, 3, lambda m: m["files"].__setitem__(target, {"size": 0, "crc32": "00000000"})
    )
    _every_command_fails_on_step_3(local_run, capsys, tmp_path)


def test_deeply_nested_manifest_is_corrupt_not_a_recursion_error(local_run, capsys):
    run = local_run
    run["storage"].write_bytes(b"[" * 200_000 + b"]" * 200_000, step_dirname(3), MANIFEST)
    mgr = CheckpointManager(run["url"], storage_options=run["opts"])
    assert mgr.steps() == [1, 2]
    with pytest.raises(CheckpointCorruptError, match="manifest is unreadable"):
        mgr.load(step=3)
    rc, out, _ = cli(capsys, run, "ls")
    assert rc == 0 and "3  CORRUPT" in out.replace("   ", "  ")
    rc, out, _ = cli(capsys, run, "verify")
    assert rc == 1 and "step 3: FAILED" in out


def test_oversized_manifest_is_refused_unread(local_run):
    st = local_run["storage"]
    with open(st.path(step_dirname(3), MANIFEST), "r+b") as f:
        f.truncate(MAX_MANIFEST_BYTES + (1 << 20))  # sparse: zeros past a valid start
    mgr = CheckpointManager(local_run["url"])
    assert bounded(mgr.steps) == [1, 2]
    with pytest.raises(CheckpointCorruptError, match="larger than"):
        mgr.load(step=3)


# ------------------------------------------------------------------ canonical step names
def test_non_canonical_step_names_are_ignored_and_reported(local_run, capsys):
    run = local_run
    st = run["storage"]
    for f, size in st.walk_files(step_dirname(3)).items():
        assert size >= 0
        st.write_bytes(st.read_bytes(step_dirname(3), f), "step-000000009", f)
    st.write_bytes(b"junk", "step-000000000", MANIFEST)  # would have hidden step 0
    mgr = CheckpointManager(run["url"], storage_options=run["opts"])
    assert mgr.steps() == [1, 2, 3]
    rc, out, _ = cli(capsys, run, "ls")
    assert rc == 0
    assert "ignored: step-000000000" in out and "ignored: step-000000009" in out
    with pytest.raises(ValueError, match=r"step must be <= 99999999 \(8 digits\)"):
        mgr.save(10**8)


def test_junk_nine_digit_step_zero_does_not_hide_step_zero(tmp_path, capsys):
    url = str(tmp_path / "run")
    model, opt = _fresh()
    mgr = CheckpointManager(url, model=model, optimizer=opt)
    mgr.save(0)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    Storage(url).write_bytes(b"junk", "step-000000000", "__0_0.distcp")  # no manifest
    assert mgr.steps() == [0]
    # Step 0 is still committed: saving it again needs overwrite, and nothing is touched.
    train(model, opt, 1)
    with pytest.raises(CheckpointExistsError):
        mgr.save(0)
    got, opt2 = _fresh()
    assert CheckpointManager(url, model=got, optimizer=opt2).load() == 0
    assert all(torch.equal(v, want[k]) for k, v in got.state_dict().items())
    assert main(["ls", url]) == 0
    out = capsys.readouterr().out
    assert "ignored: step-000000000" in out and "1 committed" in out


# ------------------------------------------------------------------ symlinked steps
def _symlinked_runs(tmp_path: Any) -> tuple[dict[str, Any], str]:
    """Run A with steps 1-3 (format 2: each step's files in its directory); run B whose step
    2 is a symlink to A's step 2. (A step of format 3 names its data from the run's root:
    linked into another run, its data is missing there.)"""
    a = three_step_run(str(tmp_path / "a"), {}, dedup=False)
    b = str(tmp_path / "b")
    os.makedirs(b)
    os.symlink(a["storage"].path(step_dirname(2)), os.path.join(b, step_dirname(2)))
    return a, b


def _run_a_intact(a: dict[str, Any], steps: tuple[int, ...] = (1, 2, 3)) -> None:
    mgr = CheckpointManager(a["url"])
    assert mgr.steps() == list(steps)
    for step in steps:
        model, opt = _fresh()
        assert CheckpointManager(a["url"], model=model, optimizer=opt).load(step=step) == step


def test_retention_unlinks_a_symlinked_step_never_its_target(tmp_path):
    a, b = _symlinked_runs(tmp_path)
    model, opt = _fresh()
    mgr = CheckpointManager(b, model=model, optimizer=opt, keep_last=1)
    assert mgr.load() == 2  # reading through the link is fine
    mgr.save(3)
    mgr.save(4)
    assert mgr.steps() == [4]
    assert not os.path.lexists(os.path.join(b, step_dirname(2)))
    _run_a_intact(a)
    # Run A's next save (a restart) does not treat its step 2 as a leftover.
    model, opt = _fresh()
    mgr_a = CheckpointManager(a["url"], model=model, optimizer=opt)
    assert mgr_a.load() == 3
    mgr_a.save(4)
    _run_a_intact(a, (1, 2, 3, 4))


def test_prune_and_overwrite_unlink_a_symlinked_step_never_its_target(tmp_path, capsys):
    a, b = _symlinked_runs(tmp_path)
    model, opt = _fresh()
    mgr = CheckpointManager(b, model=model, optimizer=opt)
    assert mgr.load() == 2
    mgr.save(5)
    assert main(["prune", b, "--keep", "1"]) == 0
    assert "deleted 1 step(s): 2" in capsys.readouterr().out
    _run_a_intact(a)
    a2, b2 = _symlinked_runs(tmp_path / "again")
    model, opt = _fresh()
    mgr = CheckpointManager(b2, model=model, optimizer=opt)
    assert mgr.load() == 2
    mgr.save(2, overwrite=True)
    assert not os.path.islink(os.path.join(b2, step_dirname(2)))
    _run_a_intact(a2)


def test_an_overwrite_entry_that_is_a_symlink_is_no_version_of_the_step(tmp_path):
    """Run B's root holds ``overwrite-step-00000003``, a link to run A's step 3, committed
    later than B's own (a root forked by linking every entry of another, or A's crashed
    swap linked along). It is no interrupted replacement of B's step: B's load resumes B's
    own step 3, and B's next save unlinks it (A's step untouched) instead of swapping A's
    step in and deleting B's."""
    a = three_step_run(str(tmp_path / "a"), {}, dedup=False)
    model, opt = _fresh()
    with CheckpointManager(a["url"], model=model, optimizer=opt, dedup=False) as mgr:  # gen 4
        assert mgr.load() == 3
        train(model, opt, 1, seed=9)
        mgr.save(3, overwrite=True)
    b = three_step_run(str(tmp_path / "b"), {})
    link = os.path.join(b["url"], "overwrite-" + step_dirname(3))
    os.symlink(a["storage"].path(step_dirname(3)), link)
    model, opt = _fresh()
    b_own = CheckpointManager(b["url"], model=model, optimizer=opt)
    assert b_own.load() == 3
    want = muon_state_sd(model, opt)
    fresh_model, fresh_opt = _fresh()
    CheckpointManager(a["url"], model=fresh_model, optimizer=fresh_opt).load(step=3)
    theirs = muon_state_sd(fresh_model, fresh_opt)
    assert any(not torch.equal(want[k], theirs[k]) for k in want if torch.is_tensor(want[k]))
    train(model, opt, 1, seed=4)
    b_own.save(4)
    b_own.close()
    assert not os.path.lexists(link)
    assert not os.path.islink(os.path.join(b["url"], step_dirname(3)))
    model, opt = _fresh()
    assert CheckpointManager(b["url"], model=model, optimizer=opt).load(step=3) == 3
    got = muon_state_sd(model, opt)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v) if torch.is_tensor(v) else got[k] == v, k
    _run_a_intact(a)
