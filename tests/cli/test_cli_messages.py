"""What the muon-ckpt command says when it refuses: the flag to use (``--step``,
``--storage-option``, ``--include``, ``--tied``), never the Python call the library's message
names; a url that holds no run (``prune`` as ``ls``), and a step's url where a run's is needed,
named as such with the run's url to give instead."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest

from muon_ckpt.cli import main
from tests._ckpt import three_step_run

# Spellings of the Python API that a command-line error must not advise.
_PYTHON = re.compile(r"load\(|\bstep=|storage_options|include=|tied=|rename=")


def _err(capsys: pytest.CaptureFixture, *argv: str) -> str:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert rc == 1 and out == "", (rc, out, err)
    assert err.startswith("muon-ckpt: error: ") and len(err.strip().splitlines()) == 1, err
    assert not _PYTHON.search(err), err
    return err


@pytest.fixture
def run(tmp_path: Any) -> dict[str, Any]:
    return three_step_run(str(tmp_path / "run"), {})


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{url}", "--step", "99"],
        ["verify", "{url}", "--step", "99"],
        ["export", "{url}", "{tmp}/out.safetensors", "--step", "99"],
        ["export", "{url}", "--hf", "{tmp}/hf", "--step", "99"],
    ],
)
def test_a_step_the_run_lacks_is_answered_with_the_step_flag(run, tmp_path, capsys, argv):
    err = _err(capsys, *[a.format(url=run["url"], tmp=tmp_path) for a in argv])
    assert "step 99 is not a committed checkpoint; committed steps: 1, 2, 3" in err
    assert "Leave --step out for the newest, or give --step with one of these" in err


def test_a_step_flag_on_a_plain_dcp_directory_is_named_once(run, capsys):
    step_dir = run["storage"].path("step-00000001")
    os.remove(os.path.join(step_dir, "manifest.json"))
    os.rename(step_dir, step_dir + "-plain")  # a DCP directory, no longer named as a step
    err = _err(capsys, "inspect", step_dir + "-plain", "--step", "1")
    assert "is a plain DCP checkpoint with no steps; drop --step" in err
    assert "--step/" not in err


def test_options_that_do_not_fit_the_url_name_the_storage_option_flag(run, capsys):
    err = _err(capsys, "ls", run["url"], "--storage-option", "key=abc")
    assert "is a local path, but --storage-option has ['key']" in err
    err = _err(capsys, "ls", "s3://bucket/run", "--storage-option", "endpoint_url=127.0.0.1:9")
    assert "--storage-option endpoint_url '127.0.0.1:9' (for url 's3://bucket/run') has no" in err


def test_a_storage_option_the_filesystem_refuses_names_the_flag(s3_server, capsys):
    flags = ["--storage-option", f"endpoint_url={s3_server}", "--storage-option", "bogus=1"]
    err = _err(capsys, "ls", "s3://bucket/run", *flags)
    assert "--storage-option: the option 'bogus' is not accepted" in err


def test_missing_credentials_name_the_storage_option_flag(s3_server, capsys, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)  # no profile's either
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    err = _err(capsys, "ls", "s3://bucket/run", "--storage-option", f"endpoint_url={s3_server}")
    assert "no credentials for the storage" in err
    assert "pass them in --storage-option (key=, secret=), the environment" in err


def test_export_errors_name_the_include_tied_and_rename_map_flags(run, tmp_path, capsys):
    err = _err(capsys, "export", run["url"], str(tmp_path / "x.safetensors"), "--include", "extra")
    assert "--include extra selects no tensor of " in err
    hf = ["export", run["url"], "--hf", str(tmp_path / "hf")]
    err = _err(capsys, *hf, "--tied", "a=b")
    assert "--tied a=b: ['a', 'b'] is not an exported model name" in err
    err = _err(capsys, *hf, "--tied", "norm.bias=norm.weight")  # same shape, other values
    assert "so they are not tied weights; export both (drop this --tied entry)" in err
    rename = tmp_path / "rename.json"
    rename.write_text(json.dumps({r"fc\d\.weight": "fc.weight"}))
    err = _err(capsys, *hf, "--rename-map", str(rename))
    assert "both become 'fc.weight'" in err and "give them distinct names with --rename-map" in err


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_prune_of_a_url_without_a_run_is_an_error_as_ls_is(tmp_path, capsys, where):
    url = str(tmp_path / where)
    if where == "empty":
        os.mkdir(url)
    err = _err(capsys, "prune", url, "--keep", "1")
    assert f"no run at {url!r}: " in err
    assert ("nothing to prune" if where == "empty" else "it does not exist") in err
    assert os.listdir(tmp_path) == ([] if where == "missing" else ["empty"])  # nothing made
    if where == "empty":
        assert os.listdir(url) == []
    else:
        assert "does not exist" in _err(capsys, "ls", url)


def test_prune_of_an_s3_prefix_without_a_run_is_an_error(s3_bucket, capsys):
    bucket, opts = s3_bucket
    flags = [f"--storage-option={k}={json.dumps(v)}" for k, v in opts.items()]
    err = _err(capsys, "prune", f"s3://{bucket}/rnu7", "--keep", "1", *flags)
    assert f"no run at 's3://{bucket}/rnu7'" in err


@pytest.mark.parametrize("command", [["ls"], ["prune", "--keep", "1"]])
def test_a_step_url_where_a_run_is_needed_names_the_runs_url(run, capsys, command):
    step_url = run["url"] + "/step-00000002/"
    err = _err(capsys, command[0], step_url, *command[1:])
    assert f"{step_url!r} is the directory of step 2, not a run" in err
    assert f"muon-ckpt {command[0]} {run['url']}" in err
    # The step's own commands take it as it is.
    assert main(["verify", step_url]) == 0
    assert "step 2: OK" in capsys.readouterr().out


def test_a_run_whose_root_is_named_like_a_step_is_still_a_run(tmp_path, capsys):
    # (saved under another name: a manager refuses to start a run named like a step)
    os.rename(three_step_run(str(tmp_path / "run"), {})["url"], tmp_path / "step-00000007")
    url = str(tmp_path / "step-00000007")
    assert main(["ls", url]) == 0
    assert "3 committed, 0 uncommitted; newest committed: 3" in capsys.readouterr().out
