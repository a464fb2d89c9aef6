"""The table of bad inputs: each raises the documented class with a message a user can act on,
and the checkpoints committed before are still loadable afterwards."""

from __future__ import annotations

import re

import pytest
import torch

from muon_ckpt import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from muon_ckpt.store import MANIFEST, Storage, parse_step_dirname
from tests._ckpt import biggest_data_file
from tests.conftest import assert_same, tiny_run, tiny_snapshot, tiny_train


@pytest.fixture
def committed(storage_url):
    """A run with steps 1 and 2 committed: (url, options, {step: snapshot})."""
    url, opts = storage_url
    model, opt = tiny_run()
    mgr = CheckpointManager(url, model=model, optimizer=opt, storage_options=opts)
    snaps = {}
    for s in (1, 2):
        tiny_train(model, opt, 1, seed=s)
        mgr.save(s)
        snaps[s] = tiny_snapshot(model, opt)
    return url, opts, snaps


def _still_loads(url, opts, snaps, step=None) -> None:
    """The committed steps are intact: load ``step`` (default newest) into a fresh run."""
    want = max(snaps) if step is None else step
    model, opt = tiny_run(seed=42)
    got = CheckpointManager(url, model=model, optimizer=opt, storage_options=opts).load(step)
    assert got == want
    assert_same(tiny_snapshot(model, opt), snaps[want])
    assert CheckpointManager(url, storage_options=opts).steps() == sorted(snaps)


def test_unknown_url_scheme(committed):
    url, opts, snaps = committed
    with pytest.raises(ValueError, match=r"url: .*nosuchfs.*scheme 'nosuchfs'"):
        CheckpointManager("nosuchfs://bucket/run")
    _still_loads(url, opts, snaps)


def test_url_that_is_a_file(committed):
    url, opts, snaps = committed
    st = Storage(url, opts)
    st.write_bytes(b"not a directory", "a-file")
    file_url = f"{url}/a-file"
    with pytest.raises(ValueError, match=r"url must be a directory .*a-file.* is a file"):
        CheckpointManager(file_url, storage_options=opts)
    _still_loads(url, opts, snaps)


def test_missing_step_lists_the_existing_steps(committed):
    url, opts, snaps = committed
    model, opt = tiny_run(seed=3)
    before = tiny_snapshot(model, opt)
    mgr = CheckpointManager(url, model=model, optimizer=opt, storage_options=opts)
    with pytest.raises(CheckpointNotFoundError, match=r"step 7 .*committed steps: 1, 2") as ei:
        mgr.load(step=7)
    assert isinstance(ei.value, FileNotFoundError)
    assert_same(tiny_snapshot(model, opt), before)
    _still_loads(url, opts, snaps, step=1)


def test_empty_bucket_load_step_5(storage_url):
    url, opts = storage_url
    model, opt = tiny_run()
    mgr = CheckpointManager(url, model=model, optimizer=opt, storage_options=opts)
    with pytest.raises(CheckpointNotFoundError, match=r"step 5 .*committed steps: none"):
        mgr.load(step=5)
    assert mgr.load() is None  # and without a step: a fresh run
    tiny_train(model, opt, 1)
    assert mgr.save(1)
    _still_loads(url, opts, {1: tiny_snapshot(model, opt)})


def test_renamed_parameter_names_the_key(committed):
    url, opts, snaps = committed
    model, opt = tiny_run(rename="renamed")
    mgr = CheckpointManager(url, model=model, optimizer=opt, storage_options=opts)
    with pytest.raises(
        CheckpointMismatchError, match=r"'model\.renamed\.weight'.*model\.first\.weight"
    ):
        mgr.load()
    _still_loads(url, opts, snaps)


def test_shape_mismatch_names_key_and_both_shapes(committed):
    url, opts, snaps = committed
    model, opt = tiny_run(hidden=5)
    mgr = CheckpointManager(url, model=model, optimizer=opt, storage_options=opts)
    with pytest.raises(
        CheckpointMismatchError, match=r"'model\.first\.weight'.*\(6, 4\).*\(5, 4\)"
    ):
        mgr.load()
    _still_loads(url, opts, snaps)


def _a_shard(st: Storage, step_dir: str) -> tuple[str, bytes]:
    name = biggest_data_file(st, parse_step_dirname(step_dir) or 0)
    return name, st.read_bytes(step_dir, name)


def test_truncated_shard_is_corrupt_and_names_the_file(committed):
    url, opts, snaps = committed
    st = Storage(url, opts)
    name, data = _a_shard(st, "step-00000002")
    st.write_bytes(data[: len(data) // 2], "step-00000002", name)
    model, opt = tiny_run(seed=3)
    before = tiny_snapshot(model, opt)
    mgr = CheckpointManager(url, model=model, optimizer=opt, storage_options=opts)
    with pytest.raises(CheckpointCorruptError, match=rf"{name}.*truncated"):
        mgr.load(step=2)  # an explicit step never falls back
    assert_same(tiny_snapshot(model, opt), before)  # all or nothing
    assert mgr.steps() == [1, 2]  # a failing load deletes nothing
    _falls_back_to_step_1(mgr, model, opt, snaps, rf"step 2 .*{name}.*truncated")
    _still_loads(url, opts, {1: snaps[1], 2: snaps[2]}, step=1)


def _falls_back_to_step_1(mgr, model, opt, snaps, why: str) -> None:
    """load() without a step skips the damaged step 2 with a WARNING naming it and why."""
    import logging

    class Grab(logging.Handler):
        records: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record.getMessage())

    h = Grab(logging.WARNING)
    logging.getLogger("muon_ckpt").addHandler(h)
    try:
        assert mgr.load() == 1
    finally:
        logging.getLogger("muon_ckpt").removeHandler(h)
    assert any(re.search(f"skipping {why}", m, re.S) for m in h.records), h.records
    assert_same(tiny_snapshot(model, opt), snaps[1])


@pytest.mark.parametrize("where", ["head", "middle"])
def test_flipped_bytes_fail_the_crc32_and_name_the_file(committed, where):
    # "head": the bytes DCP unpickles first, so the read fails before the checksum is done;
    # the error must still be the corruption one, naming the file, not the unpickler's.
    url, opts, snaps = committed
    st = Storage(url, opts)
    name, data = _a_shard(st, "step-00000002")
    bad = bytearray(data)
    at = slice(0, 64) if where == "head" else slice(len(bad) // 2, len(bad) // 2 + 1)
    bad[at] = bytes(b ^ 0xFF for b in bad[at])
    st.write_bytes(bytes(bad), "step-00000002", name)
    model, opt = tiny_run(seed=3)
    before = tiny_snapshot(model, opt)
    mgr = CheckpointManager(url, model=model, optimizer=opt, storage_options=opts)
    with pytest.raises(CheckpointCorruptError, match=rf"{name}.*crc32"):
        mgr.load(step=2)
    assert_same(tiny_snapshot(model, opt), before)  # all or nothing
    _falls_back_to_step_1(mgr, model, opt, snaps, rf"step 2 .*{name}.*crc32")
    _still_loads(url, opts, snaps, step=1)


def test_corrupted_manifest_names_the_manifest(committed):
    url, opts, snaps = committed
    st = Storage(url, opts)
    st.write_bytes(b'{"format": "muon-ckpt", "step": 2, "fil', "step-00000002", MANIFEST)
    model, opt = tiny_run(seed=3)
    mgr = CheckpointManager(url, model=model, optimizer=opt, storage_options=opts)
    with pytest.raises(CheckpointCorruptError, match=r"step-00000002/manifest\.json.*unreadable"):
        mgr.load(step=2)
    # One definition of a committed step: an unreadable manifest makes step 2 CORRUPT, which
    # steps() does not list and load() without a step skips.
    _still_loads(url, opts, {1: snaps[1]}, step=1)


def test_keep_last_zero(committed):
    url, opts, snaps = committed
    with pytest.raises(ValueError, match=r"keep_last must be an int >= 1 .*got 0"):
        CheckpointManager(url, storage_options=opts, keep_last=0)
    _still_loads(url, opts, snaps)


def test_negative_interval(committed):
    url, opts, snaps = committed
    with pytest.raises(ValueError, match=r"interval must be an int >= 1 .*got -5"):
        CheckpointManager(url, storage_options=opts, interval=-5)
    _still_loads(url, opts, snaps)


def test_non_stateful_extra(committed):
    url, opts, snaps = committed
    with pytest.raises(ValueError, match=r"extra\['data'\] must have state_dict\(\) and "):
        CheckpointManager(url, storage_options=opts, extra={"data": [1, 2, 3]})
    _still_loads(url, opts, snaps)


def test_unnamed_parameter_is_a_configuration_error(committed):
    url, opts, snaps = committed
    p = torch.nn.Parameter(torch.zeros(3, 3))
    from optim.muon import Muon

    with pytest.raises(ValueError, match=r"param group 0, param 0 .*has no name.*'names'"):
        CheckpointManager(url, optimizer=Muon([p]), storage_options=opts)
    _still_loads(url, opts, snaps)


def test_every_error_is_a_checkpoint_error_or_value_error():
    for cls in (CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError):
        assert issubclass(cls, CheckpointError)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_load_never_unpickles_a_forged_metadata_file(tmp_path):
    """A .metadata whose checksum matches a forged manifest is refused, not executed."""
    import json
    import pickle
    import zlib

    from muon_ckpt import CheckpointCorruptError, CheckpointManager

    model = torch.nn.Linear(4, 4)
    url = str(tmp_path / "run")
    with CheckpointManager(url, model=model) as mgr:
        mgr.save(1, force=True)
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Evil(str(marker)))
    step_dir = tmp_path / "run" / "step-00000001"
    (step_dir / ".metadata").write_bytes(evil)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"size": len(evil), "crc32": f"{zlib.crc32(evil):08x}"}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    with (
        CheckpointManager(url, model=torch.nn.Linear(4, 4)) as mgr,
        pytest.raises(CheckpointCorruptError, match=r"\.metadata"),
    ):
        mgr.load()
    assert not marker.exists(), "the forged metadata was unpickled"


def test_write_failure_in_a_writer_thread_fails_the_save_and_keeps_the_last_step(
    tmp_path, monkeypatch
):
    """DCP's writer threads die silently; the save must still fail, commit nothing, and
    retention must not delete the last good step."""
    import threading

    from muon_ckpt import CheckpointError, CheckpointManager
    from muon_ckpt.save import _streams

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    url = str(tmp_path / "run")
    with CheckpointManager(url, model=model, keep_last=1, io_threads=4) as mgr:
        mgr.save(1, force=True)
        real_write = _streams._CrcStream.write

        def disk_full(self, b):
            if threading.current_thread() is not threading.main_thread():
                raise OSError(28, "No space left on device")
            return real_write(self, b)

        monkeypatch.setattr(_streams._CrcStream, "write", disk_full)
        with pytest.raises(CheckpointError, match=r"not written.*No space left on device"):
            mgr.save(2, force=True)
        monkeypatch.undo()
        assert mgr.steps() == [1]
        assert mgr.load() == 1
