"""``io_threads``: given, it is both the files a save writes in parallel per rank and the
threads a load reads with; left as None (the default), saves write 4 files, loads from remote
storage read with 4 threads, and loads from local storage with half the cores this rank may
run on (shared with the other ranks of its host), 4 to 8."""

from __future__ import annotations

import json

import pytest
import torch

import muon_ckpt._config as config
import muon_ckpt.load._attempt as attempt_mod
from muon_ckpt import CheckpointManager
from muon_ckpt.store import Storage
from tests._ckpt import TinyNet, make_muon, train


@pytest.mark.parametrize(
    ("host", "cores", "local", "want"),
    [
        (16, 16, None, 8),  # the GPU host of docs/benchmarks.md, one rank
        (2, 2, None, 4),  # at least 4
        (64, 64, None, 8),  # at most 8
        (128, 128, "8", 8),  # 8 ranks share 128 cores: 16 each
        (64, 64, "8", 4),  # 8 each
        (24, 24, "2", 6),
        (16, 16, "not a number", 8),  # as if one rank
        (128, 16, "8", 8),  # pinned to 16 cores: its own
        (32, 12, "2", 6),
        (128, 6, "8", 4),
    ],
)
def test_reading_threads_follow_the_cores_of_the_rank(monkeypatch, host, cores, local, want):
    monkeypatch.setattr(config.os, "cpu_count", lambda: host)
    monkeypatch.setattr(
        config.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False
    )
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert config.read_threads(None) == want
    c = config.ManagerConfig(url="x")
    assert (c.read_threads(True), c.read_threads(False), c.write_threads) == (want, 4, 4)
    given = config.ManagerConfig(url="x", io_threads=3)
    assert (given.read_threads(True), given.read_threads(False), given.write_threads) == (3, 3, 3)


@pytest.mark.parametrize("bad", [0, 65, 2.5, True, "4"])
def test_io_threads_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match=r"io_threads must be an int in \[1, 64\] or None, got"):
        CheckpointManager("/nonexistent/never-created", io_threads=bad)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_default_saves_write_4_files_and_loads_read_with_the_cores(tmp_path, monkeypatch, where):
    monkeypatch.setattr(config.os, "cpu_count", lambda: 12)
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    seen: list[int] = []
    reader = attempt_mod.VerifyingReader

    class Spy(reader):  # type: ignore[misc,valid-type]
        def __init__(self, *args, **kwargs):
            seen.append(kwargs["io_threads"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(attempt_mod, "VerifyingReader", Spy)
    torch.manual_seed(0)
    model = TinyNet()
    opt = make_muon(model)
    train(model, opt, 2)
    url = str(tmp_path / "run") if where == "local" else f"memory://{tmp_path.name}/run"
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        mgr.save(1)
        mgr.load(1)
    step = Storage(url).child("step-00000001")
    assert json.loads(step.read_bytes("manifest.json"))["extra"]["io_threads"] == 4
    assert sum(n.endswith(".distcp") for n in step.listdir()) <= 4
    assert seen == [6 if where == "local" else 4]  # remote: 4
