"""The storage contract, against a local directory, memory:// and a real S3 endpoint (moto):
commit marker, steps(), interval, overwrite, retention, leftovers, resume_from, extra."""

from __future__ import annotations

import json
import os

import crc32c
import pytest
import torch

from muon_ckpt import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointManager,
)
from muon_ckpt.store import DATA, INDEX, LEASE, MANIFEST, Storage
from tests._ckpt import data_files
from tests.conftest import assert_same, tiny_run, tiny_snapshot, tiny_train


def _mgr(url, opts, model=None, opt=None, **kw) -> CheckpointManager:
    return CheckpointManager(url, model=model, optimizer=opt, storage_options=opts, **kw)


def _save_states(url, opts, steps, **kw) -> dict[int, dict]:
    """Train one run (resuming the url's, if it has one), saving after each step in
    ``steps``; return the snapshot of each."""
    model, opt = tiny_run()
    mgr = _mgr(url, opts, model, opt, **kw)
    mgr.load()
    snaps, done = {}, 0
    for s in steps:
        tiny_train(model, opt, s - done, seed=s)
        done = s
        mgr.save(s, force=True)
        snaps[s] = tiny_snapshot(model, opt)
    return snaps


def _load(url, opts, step=None, **kw):
    model, opt = tiny_run(seed=99)
    got = _mgr(url, opts, model, opt, **kw).load(step)
    return got, tiny_snapshot(model, opt)


def test_fresh_run_loads_nothing_then_roundtrips_every_step(storage_url):
    url, opts = storage_url
    model, opt = tiny_run(seed=99)
    before = tiny_snapshot(model, opt)
    mgr = _mgr(url, opts, model, opt)
    assert mgr.steps() == [] and mgr.latest_step() is None
    assert mgr.load() is None
    assert_same(tiny_snapshot(model, opt), before)  # a fresh run changes nothing

    snaps = _save_states(url, opts, [1, 3])
    assert mgr.steps() == [1, 3] and mgr.latest_step() == 3
    got, snap = _load(url, opts)
    assert got == 3
    assert_same(snap, snaps[3])
    got, snap = _load(url, opts, step=1)
    assert got == 1
    assert_same(snap, snaps[1])


def test_manifest_lists_every_file_with_size_and_crc32c_per_chunk(storage_url):
    url, opts = storage_url
    _save_states(url, opts, [2])
    st = Storage(url, opts)
    manifest = json.loads(st.read_bytes("step-00000002", MANIFEST))
    assert manifest["step"] == 2 and manifest["world_size"] == 1
    assert manifest["torch_version"] == torch.__version__
    assert manifest["muon_ckpt_version"] and manifest["time"].endswith("+00:00")
    on_disk = {k: v for k, v in st.walk_files("step-00000002").items() if k != MANIFEST}
    assert set(on_disk) == {".metadata"} and manifest["format_version"] == 3
    data = manifest["data"]  # the save's data directory, under <url>/data/
    on_disk.update({f"../data/{data}/{k}": v for k, v in st.walk_files("data", data).items()})
    assert set(manifest["files"]) == set(on_disk)
    assert ".metadata" in on_disk and any(k.endswith(".distcp") for k in on_disk)
    for name, entry in manifest["files"].items():
        data = st.read_bytes("step-00000002", name)
        assert entry["size"] == len(data) == on_disk[name]
        # CRC32C of each 1 MiB chunk, by the crc32c package directly (format 2).
        chunk = entry["chunk_bytes"]
        assert chunk == 1 << 20 and "crc32" not in entry
        assert "cuts" not in entry  # no write of 64 KiB or more here: the regular 1 MiB grid
        want = "".join(
            f"{crc32c.crc32c(data[i : i + chunk]):08x}" for i in range(0, max(1, len(data)), chunk)
        )
        assert entry["crc32c"] == want, name
    assert manifest["format_version"] == 3


def test_interval_saves_only_due_steps_unless_forced(storage_url):
    url, opts = storage_url
    model, opt = tiny_run()
    mgr = _mgr(url, opts, model, opt, interval=2)
    assert mgr.save(1) is False
    assert mgr.steps() == [] and Storage(url, opts).listdir() == []
    assert mgr.save(2) is True
    assert mgr.save(3, force=True) is True
    assert mgr.save(5) is False
    assert mgr.steps() == [2, 3]


def test_saving_a_committed_step_needs_overwrite(storage_url):
    url, opts = storage_url
    snaps = _save_states(url, opts, [2])
    model, opt = tiny_run(seed=5)
    mgr = _mgr(url, opts, model, opt)
    assert mgr.load() == 2
    tiny_train(model, opt, 1, seed=5)
    with pytest.raises(CheckpointExistsError, match="overwrite=True") as ei:
        mgr.save(2)
    assert isinstance(ei.value, FileExistsError)
    assert_same(_load(url, opts)[1], snaps[2])  # untouched
    assert mgr.save(2, overwrite=True)
    assert mgr.steps() == [2]
    assert_same(_load(url, opts)[1], tiny_snapshot(model, opt))


def _index(url: str) -> list[str]:
    """The run's index, where the store keeps one (not ``memory://``: no stamps)."""
    return [] if url.startswith("memory://") else [INDEX]


def test_keep_last_deletes_only_old_committed_steps_after_the_commit(storage_url):
    url, opts = storage_url
    st = Storage(url, opts)
    snaps = _save_states(url, opts, [1, 2, 3, 4], keep_last=2)
    assert _mgr(url, opts).steps() == [3, 4]
    assert st.listdir() == [
        DATA,
        *_index(url),
        LEASE,
        "step-00000003",
        "step-00000004",
    ]  # lease: one writer
    assert [n[:8] for n in st.listdir(DATA)] == ["00000003", "00000004"]  # theirs alone
    assert_same(_load(url, opts, step=3)[1], snaps[3])
    # keep_last=1 never deletes the newest (the one just committed).
    _save_states(url, opts, [5], keep_last=1)
    assert _mgr(url, opts).steps() == [5]


def test_uncommitted_step_is_invisible_and_removed_by_the_next_save(storage_url):
    url, opts = storage_url
    st = Storage(url, opts)
    snaps = _save_states(url, opts, [1, 2])
    st.rm("step-00000002", MANIFEST)  # what a save killed before its commit leaves behind
    assert st.listdir() == [DATA, *_index(url), LEASE, "step-00000001", "step-00000002"]
    assert [n[:8] for n in st.listdir(DATA)] == ["00000001", "00000002"]
    assert _mgr(url, opts).steps() == [1]
    got, snap = _load(url, opts)
    assert got == 1
    assert_same(snap, snaps[1])
    model, opt = tiny_run()
    mgr = _mgr(url, opts, model, opt, keep_last=5)
    assert mgr.load() == 1  # a restart after the crash
    mgr.save(3)
    assert st.listdir() == [DATA, *_index(url), LEASE, "step-00000001", "step-00000003"]
    assert [n[:8] for n in st.listdir(DATA)] == ["00000001", "00000003"]  # step 2's data went


def test_resume_from_another_run_until_this_run_has_a_step(storage_url):
    url, opts = storage_url
    other = url + "-other"
    snaps = _save_states(other, opts, [2, 4])
    got, snap = _load(url, opts, resume_from=other)
    assert got == 4
    assert_same(snap, snaps[4])
    got, snap = _load(url, opts, resume_from=(other, 2))
    assert got == 2
    assert_same(snap, snaps[2])
    got, snap = _load(url, opts, resume_from=f"{other}/step-00000002")
    assert got == 2
    assert_same(snap, snaps[2])
    mine = _save_states(url, opts, [7])
    got, snap = _load(url, opts, resume_from=other)
    assert got == 7  # once this run has a committed step, resume_from is not used
    assert_same(snap, mine[7])


class _Position:
    """A data-position object with nested state (a Stateful, not a torch class)."""

    def __init__(self) -> None:
        self.epoch, self.offsets = 0, {"train": 0, "val": 0}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offsets": dict(self.offsets)}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.offsets = sd["epoch"], dict(sd["offsets"])


def test_extra_state_and_offload_mode_survive_a_round_trip(storage_url):
    url, opts = storage_url
    model, opt = tiny_run()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    pos = _Position()
    opt.turn_on_cpu_offload()
    for _ in range(3):
        tiny_train(model, opt, 1)
        sched.step()
    pos.epoch, pos.offsets = 3, {"train": 1234, "val": 7}
    extra = {"sched": sched, "data": pos}
    assert _mgr(url, opts, model, opt, extra=extra).save(3)
    assert opt.cpu_offload
    opt.turn_off_cpu_offload()
    want = tiny_snapshot(model, opt)
    lrs = [g["lr"] for g in opt.param_groups]

    model2, opt2 = tiny_run(seed=7)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    pos2 = _Position()
    opt2.turn_on_cpu_offload()
    mgr = _mgr(url, opts, model2, opt2, extra={"sched": sched2, "data": pos2})
    assert mgr.load() == 3
    assert opt2.cpu_offload
    opt2.turn_off_cpu_offload()
    assert_same(tiny_snapshot(model2, opt2), want)
    assert [g["lr"] for g in opt2.param_groups] == lrs
    assert sched2.state_dict() == sched.state_dict()
    assert (pos2.epoch, pos2.offsets) == (3, {"train": 1234, "val": 7})


def test_closed_manager_refuses_work_and_context_manager_closes(storage_url):
    url, opts = storage_url
    model, opt = tiny_run()
    with _mgr(url, opts, model, opt) as mgr:
        assert mgr.save(1)
    with pytest.raises(CheckpointError, match="closed"):
        mgr.save(2)
    mgr.close()  # idempotent
    assert _mgr(url, opts).steps() == [1]


def test_save_and_load_report_their_phase_timings(storage_url, caplog):
    url, opts = storage_url
    model, opt = tiny_run()
    tiny_train(model, opt, 1)
    mgr = _mgr(url, opts, model, opt)
    with caplog.at_level("DEBUG", logger="muon_ckpt"):
        mgr.save(1)
        assert mgr.load(1) == 1
    save, load = mgr.last_save_timings, mgr.last_load_timings
    top = ("snapshot", "prepare", "dcp_save", "commit")
    assert set(top) | {"write_data", "stage_wait", "write", "writeback", "crc_wait", "sync"} <= set(
        save
    )
    assert {"decide", "prepare", "backup", "dcp_load", "apply"} <= set(load)
    assert all(v >= 0 for v in (*save.values(), *load.values()))
    # The top-level phases tile the call: they add up to its total.
    assert sum(save[k] for k in top) == pytest.approx(save["total"], rel=1e-6)
    load_top = ("decide", "prepare", "backup", "dcp_load", "apply")
    assert sum(load[k] for k in load_top) == pytest.approx(load["total"], rel=1e-6)
    assert save["write_data"] <= save["dcp_save"] and save["write"] > 0
    logged = [r.getMessage() for r in caplog.records if r.name == "muon_ckpt"]
    assert any(m.startswith("saved step 1: snapshot ") for m in logged), logged
    assert any(m.startswith("loaded step 1: decide ") for m in logged), logged


def test_start_writeback_keeps_the_bytes_and_never_raises(tmp_path):
    from muon_ckpt.save._writeback import start_writeback

    data = bytes(range(256)) * 40000
    path = tmp_path / "f"
    with open(path, "wb", buffering=0) as f:
        f.write(data)
        start_writeback(f.fileno(), 0, len(data))
        start_writeback(f.fileno(), len(data), 1 << 20)  # past the end: nothing to queue
        os.fsync(f.fileno())
    assert path.read_bytes() == data
    r, w = os.pipe()  # not a file: the kernel refuses (ESPIPE), the helper stays quiet
    try:
        start_writeback(w, 0, 10)
    finally:
        os.close(r)
        os.close(w)


def test_verify_size_loads_exactly_and_still_catches_a_truncated_file(storage_url):
    url, opts = storage_url
    snaps = _save_states(url, opts, [1, 2], io_threads=3)
    got, snap = _load(url, opts, verify="size", io_threads=3)
    assert got == 2
    assert_same(snap, snaps[2])
    st = Storage(url, opts)
    name = next(iter(data_files(st, 2)))
    data = st.read_bytes("step-00000002", name)
    st.write_bytes(data[:-1], "step-00000002", name)
    with pytest.raises(CheckpointCorruptError, match=rf"{name}.*manifest says"):
        _load(url, opts, step=2, verify="size")
    got, snap = _load(url, opts, verify="size")  # without a step: falls back past step 2
    assert got == 1
    assert_same(snap, snaps[1])


def test_torch_save_skips_its_zip_crc_in_every_writer_thread_and_restores_it(tmp_path):
    # The manifest's per-file crc32 covers the bytes; torch.save's per-record crc32 would be a
    # second pass. The switch is per thread in recent torch: it must be off in each of DCP's
    # writer threads (not only the caller's), and the caller's setting must be back after.
    import threading

    import torch.serialization as ser

    seen: list[tuple[str, bool]] = []
    real = ser.get_crc32_options

    def recording() -> bool:
        value = real()
        seen.append((threading.current_thread().name, value))
        return value

    model, opt = tiny_run()
    tiny_train(model, opt, 1)
    mgr = _mgr(str(tmp_path / "run"), {}, model, opt, io_threads=4)
    ser.get_crc32_options = recording
    try:
        mgr.save(1)
    finally:
        ser.get_crc32_options = real
    threads = {name for name, _ in seen}
    assert len(threads) >= 2, seen  # DCP spread the tensors over several writer threads
    assert [v for _, v in seen if v] == [], seen
    assert ser.get_crc32_options() is True
    flags: list[bool] = []
    t = threading.Thread(target=lambda: flags.append(ser.get_crc32_options()))
    t.start()
    t.join()
    assert flags == [True]
    _, snap = _load(str(tmp_path / "run"), {})
    assert_same(snap, tiny_snapshot(model, opt))
