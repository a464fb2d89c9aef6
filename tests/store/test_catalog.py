"""One catalog: the manager (steps(), load()), `muon-ckpt ls` and `muon-ckpt verify` agree on
which steps are committed when a manifest is damaged or names another step; and every reader
of stored bytes (export, import, inspect) fails on a damaged or truncated file, naming it."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest
import torch

from muon_ckpt import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointManager,
    export_hf,
    export_safetensors,
    import_optimizer_state,
)
from muon_ckpt.cli import main
from muon_ckpt.store import MANIFEST, METADATA, Storage, step_dirname
from tests._ckpt import TinyNet, biggest_data_file, make_muon, three_step_run


@pytest.fixture(params=["local", "s3"])
def run(request: pytest.FixtureRequest, tmp_path: Any) -> dict[str, Any]:
    """Committed steps 1, 2, 3 saved by the manager."""
    if request.param == "local":
        return three_step_run(str(tmp_path / "run"), {}, leftover=False)
    bucket, opts = request.getfixturevalue("s3_bucket")
    return three_step_run(f"s3://{bucket}/run", opts, leftover=False)


def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _damage_manifest(st: Storage, how: str) -> str:
    """Make step 3's manifest invalid; return what the error must say."""
    name = step_dirname(3)
    if how == "unreadable":
        st.write_bytes(b'{"format": "muon-ckpt", "step": 3, "fil', name, MANIFEST)
        return r"manifest\.json: manifest is unreadable"
    m = json.loads(st.read_bytes(name, MANIFEST))
    m["step"] = 5  # a manifest copied from another step's directory
    st.write_bytes(json.dumps(m).encode(), name, MANIFEST)
    return r"manifest\.json: the manifest says step 5 but lies in the directory of step 3"


@pytest.mark.parametrize("how", ["unreadable", "other_step"])
def test_manager_ls_and_verify_agree_on_a_damaged_manifest(run, capsys, how):
    expect = _damage_manifest(run["storage"], how)
    torch.manual_seed(1)
    model = TinyNet()
    mgr = CheckpointManager(
        run["url"], model=model, optimizer=make_muon(model), storage_options=run["opts"]
    )
    assert mgr.steps() == [1, 2]
    assert mgr.latest_step() == 2
    assert mgr.load() == 2  # the damaged step is skipped, like an uncommitted one
    with pytest.raises(CheckpointCorruptError, match=expect):
        mgr.load(step=3)

    rc, out, _ = _cli(capsys, "ls", run["url"], *run["flags"])
    assert rc == 0
    rows = {ln.split()[0]: ln.split()[1] for ln in out.splitlines()[1:4]}
    assert rows == {"1": "committed", "2": "committed", "3": "CORRUPT"}
    assert "2 committed, 1 CORRUPT, 0 uncommitted; newest committed: 2" in out
    rc, out, _ = _cli(capsys, "ls", run["url"], "--json", *run["flags"])
    statuses = [(s["step"], s["status"]) for s in json.loads(out)["steps"]]
    assert statuses == [(1, "committed"), (2, "committed"), (3, "corrupt")]

    rc, out, _ = _cli(capsys, "verify", run["url"], *run["flags"])
    assert rc == 1
    assert "step 1: OK" in out and "step 2: OK" in out
    assert any(ln.startswith("step 3: FAILED") for ln in out.splitlines()), out
    rc, out, _ = _cli(capsys, "verify", run["url"], "--step", "3", *run["flags"])
    assert rc == 1 and out.startswith("step 3: FAILED")

    # A save of a manager that loaded nothing is refused (the url holds a run): it never
    # overwrites the damaged step, nor removes it as a leftover.
    model2 = TinyNet()
    mgr2 = CheckpointManager(
        run["url"], model=model2, optimizer=make_muon(model2), storage_options=run["opts"]
    )
    with pytest.raises(CheckpointExistsError, match="without having loaded anything"):
        mgr2.save(4)
    assert mgr2.steps() == [1, 2]
    assert run["storage"].exists(step_dirname(3), MANIFEST)
    # Resumed at step 2 past the damaged step 3 (a manifest that read as damaged twice may
    # be a read fault: no proof of damage), the next commit retires it from the line but
    # keeps it (docs/semantics.md, "A fallback is no rewind") until retention or prune keeps
    # only newer steps.
    assert mgr2.load() == 2
    assert mgr2.save(4)
    assert mgr2.steps() == [1, 2, 4]
    assert run["storage"].exists(step_dirname(3), MANIFEST)
    rc, out, _ = _cli(capsys, "ls", run["url"], *run["flags"])
    assert re.search(r"^\s+3\s+PASSED-OVER\s", out, re.M), out
    assert "3 committed, 1 passed over, 0 uncommitted; newest committed: 4" in out, out
    rc, out, _ = _cli(capsys, "verify", run["url"], *run["flags"])
    assert rc == 1 and any(ln.startswith("step 3: FAILED") for ln in out.splitlines()), out
    rc, out, _ = _cli(capsys, "prune", run["url"], "--keep", "1", *run["flags"])
    assert rc == 0 and mgr2.steps() == [4]
    assert not run["storage"].exists(step_dirname(3))


def _flip_or_truncate(st: Storage, name: str, how: str) -> None:
    data = bytearray(st.read_bytes(step_dirname(3), name))
    if how == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        data = data[: len(data) - 7]
    st.write_bytes(bytes(data), step_dirname(3), name)


def _biggest_data_file(st: Storage) -> str:
    return biggest_data_file(st, 3)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_export_import_and_inspect_name_the_damaged_file(run, capsys, tmp_path, how):
    st = run["storage"]
    name = _biggest_data_file(st)
    _flip_or_truncate(st, name, how)
    url, opts = run["url"], run["opts"]
    where = re.escape(st.url_of(step_dirname(3), name))  # (its data: ../data/<dir>/<file>)
    out = str(tmp_path / "out.safetensors")

    with pytest.raises(CheckpointCorruptError, match=where):
        export_safetensors(url, out, storage_options=opts)
    assert not os.path.exists(out)  # nothing half-written is left behind
    hf = str(tmp_path / "hf")
    with pytest.raises(CheckpointCorruptError, match=where):
        export_hf(url, hf, storage_options=opts)  # the Hugging Face layout: the same reader
    assert not os.path.exists(hf) or os.listdir(hf) == []  # no file left behind
    rc, stdout, err = _cli(capsys, "export", url, out, *run["flags"])
    assert rc == 1 and stdout == ""
    assert (
        err.startswith("muon-ckpt: error: CheckpointCorruptError: ")
        and st.url_of(step_dirname(3), name) in err
    )
    assert "Traceback" not in err

    model = TinyNet()
    opt = make_muon(model)
    with pytest.raises(CheckpointCorruptError, match=where):
        import_optimizer_state(opt, url, model=model, storage_options=opts)

    if how == "truncate":  # inspect reads the metadata; every file's size is checked first
        rc, _, err = _cli(capsys, "inspect", url, *run["flags"])
        assert (
            rc == 1 and "CheckpointCorruptError" in err and st.url_of(step_dirname(3), name) in err
        )
    # Steps 1 and 2 are untouched, and still export.
    export_safetensors(url, out, step=2, storage_options=opts)


def test_inspect_and_export_refuse_a_damaged_metadata_file(run, capsys, tmp_path):
    _flip_or_truncate(run["storage"], METADATA, "flip")
    rc, _, err = _cli(capsys, "inspect", run["url"], *run["flags"])
    assert rc == 1 and "CheckpointCorruptError" in err and METADATA in err
    with pytest.raises(CheckpointCorruptError, match=METADATA):
        export_safetensors(run["url"], str(tmp_path / "o.safetensors"), storage_options=run["opts"])


def test_verify_size_mode_reads_without_checksums(run, tmp_path):
    """``verify="size"`` (export and import) still refuses a truncated file."""
    _flip_or_truncate(run["storage"], _biggest_data_file(run["storage"]), "truncate")
    with pytest.raises(CheckpointCorruptError, match=r"truncated|bytes, the manifest says"):
        export_safetensors(
            run["url"],
            str(tmp_path / "o.safetensors"),
            storage_options=run["opts"],
            verify="size",
        )
