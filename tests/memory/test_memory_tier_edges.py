"""The memory tier's edges, in one process unless said: its bound (``MemoryOptions.keep``), a memory
save that finds the previous one still running (queued, the newest kept) or a write in flight
(not waited for), directories it must not read, steps of another line, the budget, ``close()``'s flush,
SIGKILLs while parts are written and replicated, and ``muon-ckpt ls/prune --memory``."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import threading

import pytest
import torch

from muon_ckpt import CheckpointError, CheckpointExistsError, CheckpointManager, MemoryOptions
from muon_ckpt.cli import main as cli
from tests._ckpt import train
from tests._dist import run_on_ranks, run_then_kill
from tests._memtier import (
    _assert_same,
    _fresh,
    _load_fresh,
    _memory,
    _mgr,
    _run_dir,
    _saved,
    _state,
)


def test_the_tier_keeps_its_newest_keep_steps(tmp_path, caplog):
    model, opt = _fresh()
    with caplog.at_level(logging.WARNING, logger="muon_ckpt"):
        mgr = _mgr(tmp_path, model, opt, memory=_memory(tmp_path, keep=2, replicas=1))
        assert mgr.load() is None
        for s in range(0, 9):
            train(model, opt, 1, seed=s)
            assert mgr.save(s)
            assert mgr.wait() == s
        mgr.close()
    # One process is one node: the replica has nowhere to go, said once.
    said = [r.getMessage() for r in caplog.records if "replica" in r.getMessage()]
    assert len(said) == 1 and "one node" in said[0], said
    run = _run_dir(tmp_path)
    steps = sorted(p.name for p in run.iterdir() if p.name.startswith("step-"))
    assert steps == ["step-00000007", "step-00000008"]
    sizes = []
    for s in steps:
        parts = list((run / s).iterdir())
        assert [p.name for p in parts] == ["rank-00000"]
        files = list(parts[0].iterdir())
        sizes.append(sum(f.stat().st_size for f in files))
        assert "manifest.json" in [f.name for f in files]
        for f in files:
            assert f.stat().st_mode & 0o777 == 0o600, f
        assert parts[0].stat().st_mode & 0o777 == 0o700
    one = sum(
        v.numel() * v.element_size() for v in _state(model, opt).values() if torch.is_tensor(v)
    )
    assert all(one <= n < 2 * one + (1 << 20) for n in sizes), (sizes, one)


def _not_kept(caplog):
    return [r.getMessage() for r in caplog.records if "not kept in host memory" in r.getMessage()]


@pytest.mark.parametrize("offload", [False, True], ids=["offload-off", "offload-on"])
def test_a_memory_save_while_one_runs_is_queued_and_the_newest_kept(tmp_path, caplog, offload):
    """The job of step 1 is held: step 2 is queued with its own bytes (nothing said), step 3
    replaces it (a WARNING names step 2); training on changes nothing queued; wait() keeps
    step 3, which a restart loads bitwise."""
    model, opt = _fresh(offload=offload)
    mgr = _mgr(tmp_path, model, opt, interval=100)
    mgr.load()
    assert mgr.save(0) and mgr.wait() == 0  # (the url holds the run's line)
    gate = mgr._saves.gate = threading.Event()
    try:
        train(model, opt, 1, seed=1)
        assert mgr.save(1)  # its job waits at the gate
        with caplog.at_level(logging.WARNING, logger="muon_ckpt"):
            train(model, opt, 1, seed=2)
            assert mgr.save(2)
            assert _not_kept(caplog) == []
            train(model, opt, 1, seed=3)
            assert mgr.save(3)
            want = _state(model, opt)
            train(model, opt, 1, seed=4)
        said = _not_kept(caplog)
        assert len(said) == 1 and "step 2 " in said[0] and "step 3 replaced" in said[0], said
        assert mgr._saves.memory.tier.skipped == 1
    finally:
        gate.set()  # (a failure here must not leave the job waiting at exit)
    assert mgr.wait() == 3
    mgr._saves.memory.mark = None
    mgr.close()
    step, tier, got = _load_fresh(tmp_path, offload=offload)
    assert (step, tier) == (3, "memory")
    _assert_same(want, got)


@pytest.mark.parametrize("offload", [False, True], ids=["offload-off", "offload-on"])
def test_a_queued_memory_save_beside_a_write_in_flight_is_the_newest_kept(tmp_path, offload):
    """Step 5's write to the url is held, step 6's memory job too (its buffers are its own):
    step 7 is queued into a third set of buffers, and kept."""
    model, opt = _fresh(offload=offload)
    mgr = _mgr(tmp_path, model, opt, async_save=True)
    mgr.load()
    train(model, opt, 1, seed=0)
    gate = mgr._saves.gate = threading.Event()
    try:
        assert mgr.save(5)  # due for both tiers; the url's write waits at the gate
        mgr._saves.memory_job.wait()  # (the memory part of step 5 is not gated)
        train(model, opt, 1, seed=1)
        assert mgr.save(6)  # memory only, beside the write: held at the gate
        train(model, opt, 1, seed=2)
        assert mgr.save(7)  # queued
        want = _state(model, opt)
        train(model, opt, 1, seed=3)
    finally:
        gate.set()
    assert mgr.wait() == 7
    assert mgr.steps() == [5]
    mgr._saves.memory.mark = None
    mgr.close()
    step, tier, got = _load_fresh(tmp_path, offload=offload)
    assert (step, tier) == (7, "memory")
    _assert_same(want, got)


@pytest.mark.parametrize("offload", [False, True], ids=["offload-off", "offload-on"])
def test_a_memory_save_does_not_wait_for_a_write_in_flight(tmp_path, offload):
    model, opt = _fresh(offload=offload)
    mgr = _mgr(tmp_path, model, opt, async_save=True)
    mgr.load()
    train(model, opt, 1, seed=0)
    gate = mgr._saves.gate = threading.Event()
    assert mgr.save(5)  # due for both tiers; the url's write waits at the gate
    mgr._saves.memory_job.wait()  # (the memory part of step 5 is not gated)
    mgr._saves.gate = None
    train(model, opt, 1, seed=1)
    want = _state(model, opt)
    assert mgr.save(6)  # memory only: its own buffers, offloaded states copied
    mgr._saves.memory_job.wait()
    assert mgr._saves.pending is not None and not mgr._saves.pending.done()  # step 5 still writing
    train(model, opt, 1, seed=2)  # step 6's snapshot is not changed by this
    gate.set()
    assert mgr.wait() == 6  # the newest step pending in any tier
    assert mgr.steps() == [5]
    mgr._saves.memory.mark = None
    mgr.close()
    step, tier, got = _load_fresh(tmp_path, offload=offload)
    assert (step, tier) == (6, "memory")
    _assert_same(want, got)


def test_a_tier_others_may_read_is_neither_written_nor_read(tmp_path, caplog):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    model, opt = _fresh()
    with pytest.raises(CheckpointError, match="mode 0755: others may read"):
        _mgr(tmp_path, model, opt, memory=_memory(tmp_path, dir=str(open_dir)))
    # A run directory opened up after the save is not read: the load goes to storage.
    _saved(tmp_path, range(5, 8))
    run = _run_dir(tmp_path)
    os.chmod(run, 0o755)
    with caplog.at_level(logging.WARNING, logger="muon_ckpt"):
        step, tier, _ = _load_fresh(tmp_path)
    assert (step, tier) == (5, "storage")
    assert any("is not read" in r.getMessage() for r in caplog.records)
    os.chmod(run, 0o700)
    assert _load_fresh(tmp_path)[:2] == (7, "memory")


def test_memory_steps_of_another_run_are_not_loaded(tmp_path):
    import shutil

    _saved(tmp_path, range(5, 8))  # url: 5; memory: 7
    # The url is emptied and a new run starts there: step 7 in memory is not its own.
    shutil.rmtree(tmp_path / "run")
    model2, opt2 = _fresh(seed=3)
    mgr2 = _mgr(tmp_path, model2, opt2)
    assert mgr2.load() is None
    assert mgr2.save(1) and mgr2.wait() == 1
    run = _run_dir(tmp_path)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == ["step-00000001"]
    mgr2._saves.memory.mark = None
    mgr2.close()


def test_after_a_rewind_the_first_memory_save_retires_the_newer_steps_of_both_tiers(tmp_path):
    def steps_held():
        return sorted(p.name for p in _run_dir(tmp_path).iterdir() if p.name.startswith("step-"))

    model, opt = _fresh()
    mgr = _mgr(tmp_path, model, opt)
    mgr.load()
    for s in range(1, 8):  # url: 5; memory: 7
        mgr.save(s)
        mgr.wait()
    mgr._saves.memory.mark = None
    mgr.close()
    model, opt = _fresh(seed=2)
    mgr = _mgr(tmp_path, model, opt)
    assert mgr.load(5) == 5 and mgr.last_load_tier == "storage"
    # Killed now, the run resumes its newest step, as the url keeps a rewind's newer steps.
    assert _load_fresh(tmp_path)[:2] == (7, "memory")
    assert mgr.save(6) and mgr.wait() == 6
    assert steps_held() == ["step-00000006"]
    assert _load_fresh(tmp_path)[:2] == (6, "memory")
    for s in range(7, 13):  # url: 5, 10; memory: 12
        mgr.save(s)
        mgr.wait()
    # A rewind below the url's newest step: its first memory step is a commit of the new
    # line, which retires the url's step 10 as a commit to the url would. A restart on this
    # node resumes it, with its own bytes; the url keeps 10 until the line commits there.
    assert mgr.load(5) == 5
    assert mgr.save(6) and mgr.wait() == 6
    want = _state(model, opt)
    assert steps_held() == ["step-00000006"]
    step, tier, got = _load_fresh(tmp_path)
    assert (step, tier) == (6, "memory")
    _assert_same(want, got)
    with pytest.raises(CheckpointError, match="not loadable"):  # retired by memory step 6
        model2, opt2 = _fresh(seed=4)
        _mgr(tmp_path, model2, opt2).load(10)
    mgr._saves.memory.mark = None
    mgr.close()
    assert mgr.steps() == [5, 10]


def test_a_first_memory_save_without_a_load_is_refused_beside_another_run(tmp_path):
    model, opt = _fresh()
    with CheckpointManager(str(tmp_path / "run"), model=model, optimizer=opt) as mgr:
        mgr.save(5)
    mgr2 = _mgr(tmp_path, model, opt, interval=100)
    with pytest.raises(CheckpointExistsError, match="Call load\\(\\) first"):
        mgr2.save(6)
    assert not (tmp_path / "mem" / "run").exists()
    mgr2.close()


def test_over_the_budget_a_memory_save_is_skipped(tmp_path, caplog):
    model, opt = _fresh()
    mgr = _mgr(tmp_path, model, opt, interval=100, max_staging_bytes=4096)
    mgr.load()
    with caplog.at_level(logging.WARNING, logger="muon_ckpt"):
        assert mgr.save(1)
        mgr.wait()
    assert mgr._saves.memory.tier.skipped == 1
    assert any("max_staging_bytes=4096" in r.getMessage() for r in caplog.records)
    mgr._saves.memory.mark = None
    mgr.close()


def test_the_budget_counts_this_ranks_parts_only(tmp_path):
    """Ranks of a node share a directory: another rank's part there is not this rank's."""
    import shutil

    model, opt = _fresh()
    mgr = _mgr(tmp_path, model, opt, interval=100)
    mgr.load()
    assert mgr.save(1) and mgr.wait() == 1
    tier = mgr._saves.memory.tier
    step = _run_dir(tmp_path) / "step-00000001"
    mine = tier.held_bytes({1}, 0, 2)
    assert mine > 0
    shutil.copytree(step / "rank-00000", step / "rank-00001")  # rank 1's, on this node
    manifest = step / "rank-00001" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["extra"]["memory"]["rank"] = 1
    manifest.write_text(json.dumps(m))
    assert tier.held_bytes({1}, 0, 2) == mine
    assert tier.held_bytes({1}, 1, 2) == mine
    mgr._saves.memory.mark = None
    mgr.close()


def test_close_saves_the_newest_memory_step_to_the_url(tmp_path):
    model, opt = _fresh()
    mgr = _mgr(tmp_path, model, opt)
    mgr.load()
    for s in range(1, 8):
        train(model, opt, 1, seed=s)
        mgr.save(s)
        mgr.wait()
    want = _state(model, opt)
    assert mgr.durable_step == 5
    mgr.close()  # step 7 is the state's: it goes to the url
    assert mgr.steps() == [5, 7]
    shutil.rmtree(tmp_path / "mem")
    step, tier, got = _load_fresh(tmp_path)
    assert (step, tier) == (7, "storage")
    _assert_same(want, got)
    # The optimizer stepped after the newest memory step: the flush is still step 8's own
    # bytes, never the state trained on after it.
    model, opt = _fresh()
    mgr = _mgr(tmp_path, model, opt)
    assert mgr.load() == 7
    train(model, opt, 1, seed=8)
    mgr.save(8)
    mgr.wait()
    want = _state(model, opt)
    train(model, opt, 1, seed=9)
    mgr.close()
    assert mgr.steps() == [5, 7, 8]
    shutil.rmtree(tmp_path / "mem")
    step, tier, got = _load_fresh(tmp_path)
    assert (step, tier) == (8, "storage")
    _assert_same(want, got)


def _memory_only(url, root, rank, model, opt, **kw):
    """A manager that saves to memory only (after step 0), one rank per node."""
    return CheckpointManager(
        url,
        model=model,
        optimizer=opt,
        interval=10**6,
        memory=MemoryOptions(interval=1, dir=os.path.join(root, f"node{rank}"), node_size=1),
        **kw,
    )


def body_save_forever(rank, world_size, url, root, progress, saves):
    model, opt = _fresh()
    opt.init_state()
    mgr = _memory_only(url, root, rank, model, opt, async_save=True)
    loaded = mgr.load()
    if loaded is not None:  # every value must be the loaded step's, on every rank
        bad = [
            k for k, v in _state(model, opt).items() if torch.is_tensor(v) and (v != loaded).any()
        ]
        with open(progress, "a") as f:
            f.write(f"rank {rank} loaded {loaded} from {mgr.last_load_tier} bad {bad}\n")
    step = loaded or 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
            for st in opt.state.values():
                for v in st.values():
                    if torch.is_tensor(v):
                        v.fill_(step)
        mgr.save(step)
        with open(saves, "a") as f:  # (the parent kills after a random number of these)
            f.write(f"{rank} {step}\n")


def body_load_once(rank, world_size, url, root):
    model, opt = _fresh()
    mgr = _memory_only(url, root, rank, model, opt)
    loaded = mgr.load()
    bad = [k for k, v in _state(model, opt).items() if torch.is_tensor(v) and (v != loaded).any()]
    return loaded, mgr.last_load_tier, bad


def test_sigkills_while_writing_and_replicating_never_load_a_torn_step(tmp_path):
    url, root = str(tmp_path / "run"), str(tmp_path / "mem")
    progress = str(tmp_path / "progress")
    # Step 0 in the url: the run's line is committed there before the memory steps.
    model, opt = _fresh()
    opt.init_state()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0)
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    v.fill_(0)
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        mgr.save(0)
    rng = random.Random(7)
    saves = tmp_path / "saves"
    saves.touch()

    def count() -> int:
        return len(saves.read_text().splitlines())

    for _ in range(10):
        target = count() + rng.randint(2, 12)  # save() calls of both ranks, then SIGKILL
        args = (url, root, progress, str(saves))
        run_then_kill(body_save_forever, 2, *args, kill_when=lambda t=target: count() >= t)
    got = run_on_ranks(body_load_once, 2, url, root)
    with open(progress) as f:
        lines = f.read().splitlines()
    assert len(lines) >= 2 * 9, lines  # each restart loaded something
    assert all(line.endswith("bad []") for line in lines), lines
    assert any("from memory" in line for line in lines), lines
    assert [g[2] for g in got] == [[], []]
    assert got[0][0] == got[1][0] and got[0][0] > 0


def test_cli_lists_and_prunes_the_tier(tmp_path, capsys):
    _saved(tmp_path, (5, 6))  # (each waited for: a memory save never waits for the last)
    mem = str(tmp_path / "mem")
    assert cli(["ls", "--memory", mem, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (run,) = doc["runs"]
    assert run["url"] == str(tmp_path / "run") and run["problem"] is None
    assert [s["step"] for s in run["steps"]] == [6]
    assert run["steps"][0]["own"] == [0]
    assert cli(["ls", "--memory", mem]) == 0
    out = capsys.readouterr().out
    assert "step        6  parts of ranks 0" in out
    assert cli(["prune", "--memory", mem, "--dry-run"]) == 0
    assert "would remove 1" in capsys.readouterr().out
    assert os.path.isdir(run["dir"])
    assert cli(["prune", "--memory", mem]) == 0
    assert not os.path.exists(run["dir"])
