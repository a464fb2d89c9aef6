"""The manager's options are checked at construction by one table of rules: every bad value
of every option is a ValueError that names the option, says what it must be and shows the
value found; ``MemoryOptions`` checks its own fields when it is made; ``async_save`` takes
``"deferred"``; a keyword neither spelling knows is a TypeError, as without ``**``."""

from __future__ import annotations

import os

import pytest

from muon_ckpt import CheckpointManager, MemoryOptions
from muon_ckpt._config import _MEMORY_RULES, _RULES, ManagerConfig

# One bad value per rule at least (the keys are the table's fields: a rule added without a
# case here fails the first test).
BAD = {
    "url": [""],
    "keep_last": [0, 1.5, True],
    "interval": [0, -5, "5"],
    "storage_options": [["anon"], "anon=1"],
    "resume_storage_options": [["anon"]],
    "resume_from": [("x", -1), ("x",), 7, ""],
    "io_threads": [0, 65, 2.5],
    "verify": ["md5", None],
    "async_save": [1, "yes", "blocking", None],
    "collective_timeout": [0, -1.0, float("inf"), True],
    "max_staging_bytes": [-1, 1.5],
    "storage_timeout": [0, "60"],
    "lease_seconds": [0, None],
    "confirm": ["never", False],
    "read_once": [1, "yes"],
    "new_run": [1, None],
    "certify_replicas": [1, None],
    "dedup": [1, None],
    "dedup_max_age": [0, -1, 2.5, True, None],
    "compression": ["lz4", "", 1, True],
    "memory": [{"interval": 1}, 10],
}
MEMORY_BAD = {
    "interval": [0, None, 1.0],
    "dir": ["", "s3://bucket/tier", 7],
    "replicas": [-1, 1.5],
    "node_size": [0, "8"],
    "keep": [0, None],
    "flush": [1, None],
}


def test_every_rule_has_a_bad_value_here():
    assert {r.field for r in _RULES} == set(BAD)
    assert {r.field for r in _MEMORY_RULES} == set(MEMORY_BAD)


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, vs in BAD.items() for v in vs])
def test_a_bad_option_names_itself_what_it_must_be_and_the_value(field, value):
    with pytest.raises(ValueError) as ei:
        ManagerConfig(**{"url": "x", field: value})
    msg = str(ei.value)
    assert msg.startswith(f"{field} must be "), msg
    assert f", got {value!r}" in msg, msg


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, vs in MEMORY_BAD.items() for v in vs])
def test_a_bad_memory_option_is_refused_when_made(field, value):
    with pytest.raises(ValueError) as ei:
        MemoryOptions(**{"interval": 1, field: value})
    msg = str(ei.value)
    assert msg.startswith(f"MemoryOptions.{field} must be "), msg
    assert f", got {value!r}" in msg, msg


def test_without_dev_shm_the_tier_needs_a_dir(monkeypatch):
    isdir = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda p: p != "/dev/shm" and isdir(p))
    with pytest.raises(ValueError) as ei:
        MemoryOptions(interval=1)
    msg = str(ei.value)
    assert msg.startswith(
        "MemoryOptions.dir must be a directory path: this machine has no /dev/shm"
    )
    assert ", got None; pass dir=, a directory in host memory (tmpfs)" in msg, msg
    assert MemoryOptions(interval=1, dir="/tmp/tier").dir == "/tmp/tier"


def test_good_options_pass_and_paths_are_normalised(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mem = MemoryOptions(interval=3, dir=tmp_path / "mem", keep=2, replicas=0, flush=False)
    assert mem.dir == str(tmp_path / "mem")
    assert MemoryOptions(interval=1, dir="rel").dir == os.path.join(str(tmp_path), "rel")
    c = ManagerConfig(
        url=tmp_path / "run",  # os.PathLike: kept as a str
        resume_from=[tmp_path / "old", 7],  # a list: kept as a (url, step) pair
        async_save="deferred",
        memory=mem,
        storage_timeout=None,
        read_once=None,
    )
    assert c.url == str(tmp_path / "run") and c.resume_from == (str(tmp_path / "old"), 7)
    assert c.deferred and c.memory is mem
    assert not ManagerConfig(url="x", async_save=True).deferred


def test_a_keyword_neither_spelling_knows_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'keep_lats'.*'keep_last'"):
        CheckpointManager(str(tmp_path / "run"), keep_lats=3)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'zzz'$"):
        CheckpointManager(str(tmp_path / "run"), zzz=3)
    assert not (tmp_path / "run").exists()


def test_the_memory_tier_is_configured_in_one_place(tmp_path):
    mem = MemoryOptions(interval=2, dir=str(tmp_path / "mem"), keep=3)
    mgr = CheckpointManager(str(tmp_path / "run"), memory=mem)
    assert mgr._saves.memory is not None and mgr._saves.memory.tier.opts is mem
    assert mgr._saves.memory.tier.run_dir.startswith(str(tmp_path / "mem") + os.sep)
    mgr.close()
    assert CheckpointManager(str(tmp_path / "run2"))._saves.memory is None
