"""``close()``'s flush (``MemoryOptions.flush``) commits the memory step's own bytes to the url,
never the live state: a job that moved on after its last memory save (data position and RNG
advanced by gradient accumulation, EMA weights swapped in) commits exactly what the tier
holds of that step -- model, optimizer, extra and rank_extra -- through ``close()``, the
interpreter's exit, on 1 process and on 2 ranks (FSDP2); a part missing or damaged on any
rank flushes nothing, with a WARNING."""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil

import pytest
import torch

from muon_ckpt import CheckpointManager, MemoryOptions
from muon_ckpt.store import Storage
from tests import REPO
from tests._ckpt import flip_byte
from tests._dist import run_on_ranks, run_script
from tests._memtier import (
    Position,
    _fresh,
    _memory,
    _mgr,
    _run_dir,
    assert_same_nested,
    everything,
    moved_on,
    train_and_save,
)


def _run(tmp_path, **kw):
    """A run of steps 1-7 (url: 5; memory: 7), moved on into step 8; its manager, not
    closed, and the state at step 7."""
    model, opt = _fresh()
    data, rng = Position(1), Position(2)
    mgr = _mgr(tmp_path, model, opt, extra={"data": data}, rank_extra={"rng": rng}, **kw)
    assert mgr.load() is None
    train_and_save(mgr, model, opt, data, rng, range(1, 8))
    want = everything(model, opt, data, rng)
    moved_on(model, data, rng)
    return mgr, want


def _from_url(url, step, options=None):
    """The url's ``step`` loaded without a tier: everything it holds."""
    model, opt = _fresh(seed=9)
    data, rng = Position(5), Position(6)
    with CheckpointManager(
        url,
        model=model,
        optimizer=opt,
        extra={"data": data},
        rank_extra={"rng": rng},
        storage_options=options,
    ) as mgr:
        assert mgr.load() == step
    return everything(model, opt, data, rng)


def _files(url):
    """The url's files and sizes, but the lease (close() gives it back)."""
    return {n: s for n, s in Storage(url).walk_files().items() if n != "lease.json"}


def _entries(manifest_path):
    """(size, checksum) of each data file a manifest lists (``.metadata`` aside)."""
    with open(manifest_path) as f:
        files = json.load(f)["files"]
    return sorted(
        (e["size"], e.get("crc32c") or e["crc32"])
        for n, e in files.items()
        if not n.endswith(".metadata")
    )


@pytest.mark.parametrize(
    "options",
    [{}, {"dedup": False}, {"compression": "zstd", "keep_last": 1}],
    ids=["default", "no-dedup", "zstd-keep-1"],
)
def test_close_commits_the_memory_steps_own_bytes_not_the_live_state(tmp_path, options):
    mgr, want = _run(tmp_path, **options)
    part = _run_dir(tmp_path) / "step-00000007" / "rank-00000"
    held = _entries(part / "manifest.json")
    mgr.close()
    assert mgr.steps() == ([7] if options.get("keep_last") else [5, 7])
    # The url's files of step 7 are the part's files, byte for byte.
    url = str(tmp_path / "run")
    assert _entries(os.path.join(url, "step-00000007", "manifest.json")) == held
    shutil.rmtree(tmp_path / "mem")
    assert_same_nested(want, _from_url(url, 7))


def test_the_flush_copies_the_parts_to_every_kind_of_storage(storage_url, tmp_path):
    """Local, ``memory://`` and S3 (moto): the url's step 7 is the tier's bytes."""
    url, opts = storage_url
    model, opt = _fresh()
    data, rng = Position(1), Position(2)
    mgr = CheckpointManager(
        url,
        model=model,
        optimizer=opt,
        extra={"data": data},
        rank_extra={"rng": rng},
        interval=5,
        storage_options=opts,
        memory=_memory(tmp_path),
    )
    assert mgr.load() is None
    train_and_save(mgr, model, opt, data, rng, range(1, 8))
    want = everything(model, opt, data, rng)
    moved_on(model, data, rng)
    mgr.close()
    assert mgr.steps() == [5, 7]
    shutil.rmtree(tmp_path / "mem")
    assert_same_nested(want, _from_url(url, 7, opts))


def test_a_run_resumes_from_a_flushed_step_and_saves_on(tmp_path):
    """After the flush, a restart on another node (no tier) loads step 7 from the url,
    trains and saves step 10 there (dedup on: the flushed files have nothing to refer to),
    which loads bitwise."""
    mgr, want = _run(tmp_path)
    mgr.close()
    shutil.rmtree(tmp_path / "mem")
    model, opt = _fresh(seed=3)
    data, rng = Position(7), Position(8)
    mgr = _mgr(tmp_path, model, opt, extra={"data": data}, rank_extra={"rng": rng})
    assert mgr.load() == 7 and mgr.last_load_tier == "storage"
    assert_same_nested(want, everything(model, opt, data, rng))
    train_and_save(mgr, model, opt, data, rng, [10])
    want = everything(model, opt, data, rng)
    mgr._saves.memory.mark = None
    mgr.close()
    assert mgr.steps() == [5, 7, 10]
    shutil.rmtree(tmp_path / "mem")
    assert_same_nested(want, _from_url(str(tmp_path / "run"), 10))


@pytest.mark.parametrize("mode,step", [("moved-on", 7), ("queued", 8)])
def test_the_exit_hook_commits_the_memory_steps_own_bytes(tmp_path, mode, step):
    """A script that returns without close(): the exit writes a queued memory step and
    flushes the newest one's own bytes."""
    url, mem, state = str(tmp_path / "run"), str(tmp_path / "mem"), str(tmp_path / "want.pt")
    args = ["-m", "tests.memory._flush_job", mode, url, mem, state]
    out = run_script(args, env={"PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    assert Storage(url).listdir().count(f"step-{step:08d}") == 1, out.stderr
    shutil.rmtree(mem)
    assert_same_nested(torch.load(state), _from_url(url, step))


def test_a_failed_newer_memory_save_flushes_the_complete_one_before_it(tmp_path, caplog):
    """Step 7's part cannot be written (a file where its directory goes): close() commits
    step 6, the newest memory step complete on every rank, with its own bytes."""
    model, opt = _fresh()
    data, rng = Position(1), Position(2)
    mgr = _mgr(tmp_path, model, opt, extra={"data": data}, rank_extra={"rng": rng})
    assert mgr.load() is None
    train_and_save(mgr, model, opt, data, rng, range(1, 7))
    want = everything(model, opt, data, rng)
    (_run_dir(tmp_path) / "step-00000007").write_bytes(b"in the way")
    with caplog.at_level(logging.WARNING, logger="muon_ckpt"):
        train_and_save(mgr, model, opt, data, rng, [7])
    assert any("step 7 is not kept" in r.getMessage() for r in caplog.records)
    moved_on(model, data, rng)
    mgr.close()
    assert mgr.steps() == [5, 6]
    shutil.rmtree(tmp_path / "mem")
    assert_same_nested(want, _from_url(str(tmp_path / "run"), 6))


@pytest.mark.parametrize("how", ["flipped", "missing", "file-gone"])
def test_a_damaged_or_missing_part_flushes_nothing(how, tmp_path, caplog):
    mgr, _ = _run(tmp_path)
    part = _run_dir(tmp_path) / "step-00000007" / "rank-00000"
    files = sorted(part.glob("*.distcp"), key=lambda p: p.stat().st_size)
    if how == "flipped":
        flip_byte(str(files[-1]), files[-1].stat().st_size // 2)
    elif how == "missing":
        shutil.rmtree(part)
    else:
        files[0].unlink()
    url = str(tmp_path / "run")
    before = _files(url)
    with caplog.at_level(logging.WARNING, logger="muon_ckpt"):
        mgr.close()
    assert mgr.steps() == [5]
    assert _files(url) == before  # not a byte written
    said = [r.getMessage() for r in caplog.records if "not saved to" in r.getMessage()]
    assert said and "step 7" in said[0] and "rank 0" in said[0], said


# ---------------------------------------------------------------------- 2 ranks (FSDP2)
def _two_rank_manager(url, root, rank, model, opt, data, rng):
    return CheckpointManager(
        url,
        model=model,
        optimizer=opt,
        extra={"data": data},
        rank_extra={"rng": rng},
        interval=5,
        memory=MemoryOptions(interval=1, dir=os.path.join(root, f"node{rank}"), node_size=1),
    )


def _fsdp_everything(model, opt, data, rng):
    from tests.manager.test_manager_fsdp import snapshot

    return {"state": snapshot(model, opt), "data": data.state_dict(), "rng": rng.state_dict()}


def body_flush(rank, world_size, url, root, damage):
    from optim.newton_schulz import set_ns_compile
    from tests.manager.test_manager_fsdp import build, train

    set_ns_compile(False)
    model, opt = build(world_size)
    data, rng = Position(1), Position(10 + rank)  # one position for all, an RNG per rank
    mgr = _two_rank_manager(url, root, rank, model, opt, data, rng)
    assert mgr.load() is None
    for s in range(1, 8):
        data.advance(4)
        rng.advance(4)
        train(model, range(s, s + 1), opt)
        assert mgr.save(s) and mgr.wait() == s
    want = _fsdp_everything(model, opt, data, rng)
    moved_on(model, data, rng)
    if damage and rank == 1:
        (f,) = glob.glob(os.path.join(root, "node1", "run-*", "step-00000007", "rank-00001"))
        big = max(glob.glob(os.path.join(f, "*.distcp")), key=os.path.getsize)
        flip_byte(big, os.path.getsize(big) // 2)
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: said.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("muon_ckpt").addHandler(handler)
    mgr.close()
    return want, mgr.steps(), said


def body_load(rank, world_size, url):
    from optim.newton_schulz import set_ns_compile
    from tests.manager.test_manager_fsdp import build

    set_ns_compile(False)
    model, opt = build(world_size)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    data, rng = Position(5), Position(6)
    with CheckpointManager(
        url, model=model, optimizer=opt, extra={"data": data}, rank_extra={"rng": rng}
    ) as mgr:
        step = mgr.load()
    return step, _fsdp_everything(model, opt, data, rng)


def test_two_ranks_flush_their_own_parts(tmp_path):
    url, root = str(tmp_path / "run"), str(tmp_path / "mem")
    out = run_on_ranks(body_flush, 2, url, root, False)
    assert [o[1] for o in out] == [[5, 7]] * 2
    shutil.rmtree(root)
    got = run_on_ranks(body_load, 2, url)
    for r in range(2):
        assert got[r][0] == 7
        assert_same_nested(out[r][0], got[r][1], f"rank {r}")


def test_a_damaged_part_on_one_rank_flushes_nothing_on_any(tmp_path):
    url, root = str(tmp_path / "run"), str(tmp_path / "mem")
    out = run_on_ranks(body_flush, 2, url, root, True)
    assert [o[1] for o in out] == [[5]] * 2
    said = [m for m in out[0][2] if "not saved to" in m]
    assert said and "rank 1" in said[0], out[0][2]
