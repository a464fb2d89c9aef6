"""Say what happened: one test per message a user meets at the start or end of a run — a
load that finds nothing, storage options that do not fit the url, another optimizer's
checkpoint, ``steps()`` after ``close()``, the command line piped into ``head``, and a resume
at another world size in one ``load(elastic=True)``."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys

import pytest
import torch

from muon_ckpt import CheckpointManager, CheckpointMismatchError
from tests import REPO
from tests._dist import run_on_ranks
from tests.conftest import assert_same, tiny_run, tiny_snapshot, tiny_train


def test_a_load_that_finds_nothing_says_so(tmp_path, caplog):
    url = str(tmp_path / "tpyo")
    model, opt = tiny_run()
    mgr = CheckpointManager(url, model=model, optimizer=opt)
    with caplog.at_level(logging.INFO, logger="muon_ckpt"):
        assert mgr.load() is None
    assert [r.getMessage() for r in caplog.records] == [
        f"no committed step in {url}: starting fresh"
    ]


@pytest.mark.parametrize(
    ("url", "options", "field", "value"),
    [
        (
            "./ckpt",
            {"endpoint_url": "http://127.0.0.1:9000", "key": "k"},
            "storage_options",
            "endpoint_url",
        ),
        ("s3://bucket/run", {"endpoint_url": "127.0.0.1:9000"}, "endpoint_url", "127.0.0.1:9000"),
        ("s4://bucket/run", {}, "url", "s4"),
    ],
)
def test_storage_options_that_do_not_fit_the_url_are_refused(
    tmp_path, monkeypatch, url, options, field, value
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as ei:
        CheckpointManager(url, storage_options=options)
    msg = str(ei.value)
    assert field in msg and value in msg, msg


def test_another_optimizers_checkpoint_points_to_import(tmp_path):
    url = str(tmp_path / "run")
    model, opt = tiny_run()
    tiny_train(model, opt, 1)
    CheckpointManager(url, model=model, optimizer=opt).save(1)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = CheckpointManager(url, model=model, optimizer=adamw)
    with pytest.raises(CheckpointMismatchError) as ei:
        mgr.load()
    msg = str(ei.value)
    assert "saved by optim.muon.Muon, this optimizer is torch.optim.adamw.AdamW" in msg, msg
    assert "import_optimizer_state" in msg


def test_steps_work_after_close(tmp_path):
    url = str(tmp_path / "run")
    model, opt = tiny_run()
    mgr = CheckpointManager(url, model=model, optimizer=opt)
    mgr.save(1)
    mgr.close()
    assert mgr.steps() == [1] and mgr.latest_step() == 1


def test_the_command_line_piped_into_head_exits_quietly(tmp_path):
    url = str(tmp_path / "run")
    model, opt = tiny_run()
    mgr = CheckpointManager(url, model=model, optimizer=opt)
    for s in range(1, 4):
        mgr.save(s)
    cmd = f"{sys.executable} -m muon_ckpt.cli inspect {url} | head -n 1"
    r = subprocess.run(cmd, shell=True, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("step 3 of"), r.stdout
    assert r.stderr == "", r.stderr


class _Position:
    def __init__(self, rank: int) -> None:
        self.pos = rank

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


def _body_elastic(rank: int, world_size: int, url: str) -> tuple[int, int | None, dict, int]:
    torch.set_num_threads(1)
    model, opt = tiny_run(seed=0)
    data = _Position(100 + rank)
    mgr = CheckpointManager(url, model=model, optimizer=opt, rank_extra={"data": data})
    if world_size == 2:
        tiny_train(model, opt, 3)
        mgr.save(3)
        mgr.close()
        return 3, None, tiny_snapshot(model, opt), data.pos
    saved = mgr.step_info()
    assert saved is not None
    step = mgr.load(elastic=True)
    mgr.close()
    return step, saved.world_size, tiny_snapshot(model, opt), data.pos


def test_a_resume_at_another_world_size_is_one_load_call(tmp_path):
    url = str(tmp_path / "run")
    [(_, _, before, _), _] = run_on_ranks(_body_elastic, 2, url)
    after = run_on_ranks(_body_elastic, 3, url)
    for rank, (step, saved_world, snap, pos) in enumerate(after):
        assert (step, saved_world) == (3, 2)
        assert_same(snap, before)
        assert pos == 100 + rank  # rank_extra kept its own value


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_storage_error_names_the_endpoint_the_environment_set(s3_server, monkeypatch):
    """AWS_ENDPOINT_URL (no endpoint_url in storage_options) is the endpoint the error names:
    a missing bucket there, and an endpoint nothing listens on."""
    from muon_ckpt import CheckpointStorageError

    creds = {"key": "testing", "secret": "testing", "skip_instance_cache": True}
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    with pytest.raises(CheckpointStorageError) as ei:
        CheckpointManager("s3://no-such-bucket-here/run", storage_options=creds)
    msg = str(ei.value)
    assert f"the bucket 'no-such-bucket-here' does not exist at {s3_server};" in msg, msg
    closed = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    with pytest.raises(CheckpointStorageError) as ei:
        CheckpointManager("s3://bucket/run", storage_options=creds)
    msg = str(ei.value)
    assert f"cannot reach the storage at {closed} (" in msg, msg
    assert "default endpoint" not in msg
