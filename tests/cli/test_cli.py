"""The muon-ckpt CLI on local and S3 (moto) checkpoints: ls, inspect, verify (with corrupted
files), export, prune; one-line errors; fast --help."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from muon_ckpt import CheckpointManager, CheckpointNotFoundError, MemoryOptions
from muon_ckpt._progress import progress_bar
from muon_ckpt.cli import main
from muon_ckpt.store import Storage
from tests._ckpt import data_files, three_step_run


@pytest.fixture(params=["local", "s3"])
def run(request: pytest.FixtureRequest, tmp_path: Any) -> dict[str, Any]:
    """A run with committed steps 1, 2, 3 (CheckpointManager) and an uncommitted leftover 4."""
    if request.param == "local":
        return three_step_run(str(tmp_path / "run"), {}, leftover=True)
    bucket, opts = request.getfixturevalue("s3_bucket")
    return three_step_run(f"s3://{bucket}/run", opts, leftover=True)


def cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_ls_lists_committed_and_uncommitted_steps(run, capsys):
    rc, out, _ = cli(capsys, "ls", run["url"], *run["flags"])
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "STATUS", "SIZE", "FILES", "WORLD", "TIME"]
    assert [ln.split()[:2] for ln in lines[1:5]] == [
        ["1", "committed"],
        ["2", "committed"],
        ["3", "committed"],
        ["4", "UNCOMMITTED"],
    ]
    assert lines[-1] == "3 committed, 1 uncommitted; newest committed: 3"
    rc, out, _ = cli(capsys, "ls", run["url"], "--json", *run["flags"])
    steps = json.loads(out)["steps"]
    assert [(s["step"], s["committed"], s["world_size"]) for s in steps] == [
        (1, True, 1),
        (2, True, 1),
        (3, True, 1),
        (4, False, None),
    ]
    assert all(s["size"] > 0 and s["time"] for s in steps)


def test_inspect_shows_keys_shapes_dtypes_bytes(run, capsys):
    rc, out, _ = cli(capsys, "inspect", run["url"], "--keys", "optim.state.fc1.*", *run["flags"])
    assert rc == 0
    assert out.splitlines()[0].startswith("step 3 of ")
    rows = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines()[2:-1]}
    assert rows["optim.state.fc1.weight.momentum_buffer"] == ["(12,", "8)", "float32", "384", "B"]
    assert rows["optim.state.fc1.bias.step"] == ["()", "float32", "4", "B"]
    assert out.splitlines()[-1] == "4 keys, 484 B of tensors"  # 384 + 48 + 48 + 4
    rc, out, _ = cli(capsys, "inspect", run["url"], "--step", "1", "--json", *run["flags"])
    doc = json.loads(out)
    assert doc["step"] == 1 and doc["kind"] == "muon-ckpt" and doc["world_size"] == 1
    keys = {k["key"]: k for k in doc["keys"]}
    assert keys["model.emb.weight"] == {
        "key": "model.emb.weight",
        "shape": [11, 8],
        "dtype": "float32",
        "bytes": 352,
    }
    assert keys["optim.param_groups.fc1.weight.lr"]["dtype"] == "object"


def test_verify_passes_then_catches_corruption(run, capsys):
    rc, out, _ = cli(capsys, "verify", run["url"], *run["flags"])
    assert rc == 0, out
    assert "step 4: skipped (not committed)" in out
    assert out.count(": OK: ") == 3
    st = run["storage"]
    files = sorted(data_files(st, 2))
    flipped = bytearray(st.read_bytes("step-00000002", files[0]))
    flipped[len(flipped) // 2] ^= 0x01  # same size, one bit changed
    _put(st, ("step-00000002", files[0]), bytes(flipped))
    _put(st, ("step-00000002", files[1]), st.read_bytes("step-00000002", files[1])[:-7])
    rc, out, _ = cli(capsys, "verify", run["url"], *run["flags"])
    assert rc == 1
    assert f"step 2: {files[0]}: crc32c " in out and "(content changed)" in out
    assert f"step 2: {files[1]}: size " in out
    assert "step 2: FAILED (2 problem(s))" in out
    assert "step 1: OK" in out and "step 3: OK" in out
    rc, _, _ = cli(capsys, "verify", run["url"], "--step", "3", *run["flags"])
    assert rc == 0
    gone = sorted(data_files(st, 3))[0]
    st.rm("step-00000003", gone)
    rc, out, _ = cli(capsys, "verify", run["url"], "--step", "3", *run["flags"])
    assert rc == 1 and f"{gone}: missing" in out
    _put(st, ("step-00000001", "manifest.json"), b"{not json")
    rc, out, _ = cli(capsys, "verify", run["url"], "--step", "1", *run["flags"])
    assert rc == 1 and "step 1: FAILED" in out and "manifest is unreadable" in out
    rc, out, _ = cli(capsys, "verify", run["url"], *run["flags"])
    assert rc == 1 and "step 1: FAILED" in out and "step 3: FAILED" in out


def _put(st: Storage, parts: tuple[str, ...], data: bytes) -> None:
    with st.fs.open(st.path(*parts), "wb") as f:
        f.write(data)
    st.fs.invalidate_cache(st.path(*parts))


def test_export_command(run, capsys, tmp_path):
    out_file = str(tmp_path / "e.safetensors")
    rc, out, _ = cli(
        capsys,
        "export",
        run["url"],
        out_file,
        "--step",
        "2",
        "--dtype",
        "bf16",
        "--include",
        "optim",
        *run["flags"],
    )
    assert rc == 0
    assert out.startswith("exported step 2: 14 tensors")
    from safetensors import safe_open

    with safe_open(out_file, "pt") as f:
        assert f.metadata()["step"] == "2"
        assert f.get_tensor("optim.state.fc1.weight.momentum_buffer").dtype == torch.bfloat16


def test_prune_keeps_newest_and_never_touches_leftovers(run, capsys):
    st = run["storage"]
    rc, out, _ = cli(capsys, "prune", run["url"], "--keep", "1", "--dry-run", *run["flags"])
    assert rc == 0 and "would delete 2 step(s): 1, 2" in out
    assert st.exists("step-00000001", "manifest.json")
    rc, out, _ = cli(capsys, "prune", run["url"], "--keep", "1", *run["flags"])
    assert rc == 0 and "deleted 2 step(s): 1, 2" in out and "kept 1 committed step(s): 3" in out
    assert "uncommitted leftovers (not touched; a save may still be running): 4" in out
    assert sorted(st.listdir()) == ["data", "index.json", "step-00000003", "step-00000004"]
    assert [n[:8] for n in st.listdir("data")] == ["00000003"]  # the pruned steps' data went
    rc, _, err = cli(capsys, "prune", run["url"], "--keep", "0", *run["flags"])
    assert rc == 1
    assert err.strip() == (
        "muon-ckpt: error: ValueError: keep must be an int >= 1 (the newest step is never "
        "pruned), got 0 (--debug shows the traceback)"
    )
    assert CheckpointManager(run["url"], storage_options=run["opts"]).steps() == [3]


def test_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    missing = str(tmp_path / "missing")
    rc, out, err = cli(capsys, "inspect", missing)
    assert rc == 1 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("muon-ckpt: error: CheckpointNotFoundError: no checkpoint at ")
    with pytest.raises(CheckpointNotFoundError):
        main(["inspect", missing, "--debug"])
    with pytest.raises(CheckpointNotFoundError):  # before the command too
        main(["--debug", "inspect", missing])
    rc, _, err = cli(capsys, "ls", missing)
    assert rc == 1 and "does not exist" in err
    rc, _, err = cli(capsys, "ls", str(tmp_path), "--storage-option", "novalue")
    assert rc == 1 and "--storage-option must be KEY=VALUE" in err


def test_console_script_help_is_fast_and_imports_no_torch():
    code = (
        "import sys; from muon_ckpt.cli import build_parser; build_parser(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    r = subprocess.run(
        [sys.executable, "-m", "muon_ckpt.cli", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0
    for cmd in ("ls", "inspect", "verify", "export", "prune", "demo"):
        assert cmd in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "muon_ckpt.cli", "verify", "/nonexistent/run"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("muon-ckpt: ")]
    assert len(errs) == 1 and "Traceback" not in r.stderr


def test_version_prints_the_package_version(capsys):
    import muon_ckpt

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"muon-ckpt {muon_ckpt.__version__}\n"
    r = subprocess.run(
        [sys.executable, "-m", "muon_ckpt.cli", "--version"], capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.split() == ["muon-ckpt", muon_ckpt.__version__]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_is_drawn_only_on_a_tty():
    quiet = io.StringIO()
    with progress_bar(100, "verify", stream=quiet) as bar:
        bar.update(100)
    assert quiet.getvalue() == ""
    tty = _Tty()
    with progress_bar(100, "verify", stream=tty) as bar:
        bar.update(100)
    assert tty.getvalue().startswith("\rverify:") and "100%" in tty.getvalue()  # tqdm's bar
    forced = io.StringIO()
    with progress_bar(100, "export", stream=forced, enabled=True) as bar:
        bar.update(50)
    assert "export:  50%" in forced.getvalue()


def test_verify_json_reports_every_step_good_corrupt_and_missing_file(tmp_path, capsys):
    run = three_step_run(str(tmp_path / "run"), {}, leftover=True)
    rc, out, _ = cli(capsys, "verify", run["url"], "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] is True and doc["url"] == run["url"]
    assert [(s["step"], s["status"]) for s in doc["steps"]] == [
        (1, "ok"),
        (2, "ok"),
        (3, "ok"),
        (4, "skipped"),
    ]
    assert all(s["files"] > 1 and s["bytes"] > 0 for s in doc["steps"][:3])
    st = run["storage"]
    files = sorted(data_files(st, 2))
    flipped = bytearray(st.read_bytes("step-00000002", files[0]))
    flipped[len(flipped) // 2] ^= 0x01
    _put(st, ("step-00000002", files[0]), bytes(flipped))
    gone = sorted(data_files(st, 3))[0]
    st.rm("step-00000003", gone)
    _put(st, ("step-00000001", "manifest.json"), b"{not json")
    rc, out, _ = cli(capsys, "verify", run["url"], "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False
    steps = {s["step"]: s for s in doc["steps"]}
    assert [steps[n]["status"] for n in (1, 2, 3, 4)] == ["failed", "failed", "failed", "skipped"]
    assert "manifest is unreadable" in steps[1]["problems"][0]
    assert len(steps[2]["problems"]) == 1 and "(content changed)" in steps[2]["problems"][0]
    assert steps[2]["problems"][0].startswith(f"{files[0]}: crc32c ")
    assert steps[3]["problems"] == [f"{gone}: missing (manifest: {_size(run, gone)} bytes)"]
    rc, out, _ = cli(capsys, "verify", run["url"], "--step", "3", "--json")
    assert rc == 1 and [s["step"] for s in json.loads(out)["steps"]] == [3]


def _size(run: dict[str, Any], name: str) -> int:
    from muon_ckpt.store import Catalog

    return Catalog(run["storage"]).manifest(3).files[name].size


class _Loader:
    """Data-loader state: a position, a flag, a small and a large tensor."""

    def state_dict(self) -> dict[str, Any]:
        g = torch.Generator().manual_seed(0)
        return {
            "position": 12345,
            "shuffle": True,
            "seed": torch.tensor([7, 8]),
            "order": torch.randperm(1000, generator=g).float(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def test_inspect_shows_extra_values_small_in_full_large_summarised(tmp_path, capsys):
    url = str(tmp_path / "run")
    torch.manual_seed(0)
    with CheckpointManager(url, model=torch.nn.Linear(2, 2), extra={"data": _Loader()}) as mgr:
        mgr.save(5)
    rc, out, _ = cli(capsys, "inspect", url, "--keys", "extra.*")
    assert rc == 0
    rows = {ln.split()[0]: ln for ln in out.splitlines()[2:-1]}
    assert rows["extra.data.position"].endswith("  12345")
    assert rows["extra.data.shuffle"].endswith("  true")
    assert rows["extra.data.seed"].endswith("  [7, 8]")
    assert rows["extra.data.order"].endswith("  min 0, max 999, mean 499.5")
    rc, out, _ = cli(capsys, "inspect", url, "--json")
    keys = {k["key"]: k for k in json.loads(out)["keys"]}
    assert keys["extra.data.position"]["value"] == 12345
    assert keys["extra.data.seed"] == {
        "key": "extra.data.seed",
        "shape": [2],
        "dtype": "int64",
        "bytes": 16,
        "value": [7, 8],
    }
    assert keys["extra.data.order"]["summary"] == {"min": 0.0, "max": 999.0, "mean": 499.5}
    assert "value" not in keys["model.weight"]  # model tensors: shapes only


def test_export_refuses_nothing_to_export_and_ambiguous_outputs(tmp_path, capsys):
    run = three_step_run(str(tmp_path / "run"), {})
    out_file = str(tmp_path / "e.safetensors")
    rc, _, err = cli(capsys, "export", run["url"], out_file, "--include", "extra")
    assert rc == 1 and "--include extra selects no tensor" in err  # the flag, not include=
    assert "extra: 0 tensors" in err and not (tmp_path / "e.safetensors").exists()
    rc, _, err = cli(capsys, "export", run["url"])
    assert rc == 1 and "export needs one output" in err and "got neither" in err
    rc, _, err = cli(capsys, "export", run["url"], out_file, "--hf", str(tmp_path / "hf"))
    assert rc == 1 and "got both" in err
    rc, _, err = cli(capsys, "export", run["url"], out_file, "--max-shard-size", "1GB")
    assert rc == 1 and "--max-shard-size apply to --hf exports only" in err
    rc, out, _ = cli(capsys, "export", run["url"], out_file, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["step"] == 3 and doc["tensors"] == 6  # the model only, by default
    rc, out, _ = cli(capsys, "prune", run["url"], "--keep", "2", "--json")
    assert rc == 0 and json.loads(out) == {
        "url": run["url"],
        "dry_run": False,
        "deleted": [1],
        "kept": [2, 3],
        "leftovers": [],
        "corrupt": [],
        "newer": [],
        "lines": [],  # (the memory-tier line records it deleted)
    }


class _EarlyStop:
    """An ``extra`` holding non-finite values: a best loss that starts at inf, NaNs."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": float("inf"),
            "worst": float("-inf"),
            "hist": torch.full((40,), float("nan")),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def test_json_output_is_strict_json_with_non_finite_values(tmp_path, capsys):
    """``--json`` prints one RFC 8259 document: inf, -inf and NaN as strings (Python's own
    ``Infinity``/``NaN`` are rejected by strict parsers)."""
    url = str(tmp_path / "run")
    with CheckpointManager(url, model=torch.nn.Linear(2, 2), extra={"early": _EarlyStop()}) as m:
        m.save(1)
    rc, out, _ = cli(capsys, "inspect", url, "--json", "--keys", "extra.*")
    assert rc == 0

    def strict(c: str) -> Any:
        raise ValueError(f"not RFC 8259 JSON: {c}")

    keys = {k["key"]: k for k in json.loads(out, parse_constant=strict)["keys"]}
    assert keys["extra.early.best"]["value"] == "inf"
    assert keys["extra.early.worst"]["value"] == "-inf"
    assert keys["extra.early.hist"]["summary"] == {"min": "nan", "max": "nan", "mean": "nan"}


class _Rng:
    def state_dict(self) -> dict[str, Any]:
        return {"cpu": torch.arange(4, dtype=torch.uint8)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def test_inspect_shows_rank_extra_tensor_values(tmp_path, capsys):
    url = str(tmp_path / "run")
    with CheckpointManager(url, model=torch.nn.Linear(2, 2), rank_extra={"rng": _Rng()}) as m:
        m.save(1)
    rc, out, _ = cli(capsys, "inspect", url, "--json", "--keys", "rank_extra.*")
    assert rc == 0
    keys = {k["key"]: k for k in json.loads(out)["keys"]}
    assert keys["rank_extra.0.rng.cpu"]["value"] == [0, 1, 2, 3]


def test_verify_memory_checks_every_part_as_a_restore_would(tmp_path, capsys):
    """``verify --memory`` checks each part of this node's tier as a step (files, checksums,
    metadata, every item): a part whose item holds another dtype than its chunk declares
    (checksums consistent) is FAILED, and a load does not restore from it either."""
    import io

    from muon_ckpt.memory import run_dirname
    from tests._ckpt import TinyNet, make_muon, train
    from tests._crafted import craft_step, saved

    url, mem = str(tmp_path / "run"), str(tmp_path / "mem")

    def manager() -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        model = TinyNet()
        opt = make_muon(model)
        memory = MemoryOptions(interval=1, dir=mem, flush=False)
        return (
            model,
            opt,
            CheckpointManager(url, model=model, optimizer=opt, interval=5, memory=memory),
        )

    model, opt, mgr = manager()
    mgr.load()
    for step in (5, 6):  # 5: url and memory; 6: memory only
        train(model, opt, 1, seed=step)
        mgr.save(step)
        mgr.wait()
    mgr.close()
    rc, out, _ = cli(capsys, "verify", "--memory", mem, url)
    assert rc == 0, out
    assert "  step 6 rank 0: OK: " in out and "  step 5 rank 0: OK: " not in out  # keep=1
    run_dir = tmp_path / "mem" / run_dirname(Storage(url).url_of())
    key = "optim.state.fc1.weight.momentum_buffer"

    def edit(ed: Any) -> None:
        v = torch.load(io.BytesIO(ed.stored(key)), weights_only=True)
        ed.replace_item(key, saved(v.double()))

    craft_step(Storage(str(run_dir)), 6, edit, dirname="step-00000006/rank-00000")
    rc, out, _ = cli(capsys, "verify", "--memory", mem, url, "--json")
    (run,) = json.loads(out)["runs"]
    assert rc == 1 and [(p["step"], p["status"]) for p in run["parts"]] == [(6, "failed")]
    assert key in run["parts"][0]["problems"][0] and "float64" in run["parts"][0]["problems"][0]
    rc, out, _ = cli(capsys, "verify", url)  # the url's steps are not the tier's
    assert rc == 0 and "step 5: OK" in out
    _, _, mgr = manager()
    assert mgr.load() == 5 and mgr.last_load_tier == "storage"
    mgr.close()
