"""The memory tier answers damaged and hostile files as the url does: a part whose files have
the wrong size or are not regular files, whose manifest is unreadable, a linked part or step
directory, a tier another user owns, another run's parts in the run's directory, a tier that
is full, a SIGKILL at each point of a memory save, and a peer that sends the wrong bytes. Each
time the load takes the next good source (older step, replica, url) with the state bitwise
that source's, a WARNING names the file where one is damaged, nothing committed is lost, and
the next memory save works."""

from __future__ import annotations

import glob
import json
import logging
import os
import resource
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from muon_ckpt import CheckpointError, CheckpointManager, MemoryOptions
from muon_ckpt.memory import run_dirname
from muon_ckpt.store import MANIFEST, Storage
from tests._ckpt import train
from tests._dist import _context, run_on_ranks
from tests._memtier import _assert_same, _fresh, _load_fresh, _mgr, _run_dir, _saved, _state


def _part(tmp_path: Any, step: int = 7) -> Any:
    return _run_dir(tmp_path) / f"step-{step:08d}" / "rank-00000"


def _from_url(tmp_path: Any) -> dict[str, Any]:
    """The state a load of the url alone gives (step 5 of ``_saved(..., range(5, 8))``)."""
    model, opt = _fresh(seed=9)
    with CheckpointManager(str(tmp_path / "run"), model=model, optimizer=opt) as mgr:
        assert mgr.load() == 5
    return _state(model, opt)


def _falls_back_and_recovers(tmp_path: Any, caplog: Any, names: str | None) -> None:
    """A load goes past the damaged step 7 to the url's step 5 (bitwise), the WARNING names
    ``names``; the next memory save is kept and restored."""
    want = _from_url(tmp_path)
    with caplog.at_level(logging.WARNING, logger="muon_ckpt"):
        step, tier, got = _load_fresh(tmp_path)
    assert (step, tier) == (5, "storage")
    _assert_same(want, got)
    if names is not None:
        said = [r.getMessage() for r in caplog.records if names in r.getMessage()]
        assert said, [r.getMessage() for r in caplog.records]
    model, opt = _fresh(seed=3)
    mgr = _mgr(tmp_path, model, opt)
    assert mgr.load() == 5
    train(model, opt, 1, seed=60)
    assert mgr.save(6) and mgr.wait() == 6
    want = _state(model, opt)
    mgr._saves.memory.mark = None
    mgr.close()
    step, tier, got = _load_fresh(tmp_path)
    assert (step, tier) == (6, "memory")
    _assert_same(want, got)


# ---------------------------------------------------------------------- crafted or torn files
@pytest.mark.parametrize("how", ["truncated", "grown", "symlink", "fifo"])
def test_a_part_file_of_the_wrong_size_or_kind_is_not_read(how, tmp_path, caplog):
    _saved(tmp_path, range(5, 8))  # url: 5; memory: 7
    f = sorted(p for p in _part(tmp_path).iterdir() if p.name.endswith(".distcp"))[0]
    if how == "truncated":
        os.truncate(f, f.stat().st_size - 10)
    elif how == "grown":
        with open(f, "ab") as out:
            out.write(b"x" * 10)
    elif how == "symlink":  # to the same bytes elsewhere: still not read through the link
        shutil.copy(f, tmp_path / "elsewhere")
        f.unlink()
        f.symlink_to(tmp_path / "elsewhere")
    else:
        f.unlink()
        os.mkfifo(f)  # (an open that blocked would hang the load)
    _falls_back_and_recovers(tmp_path, caplog, names=str(f))


@pytest.mark.parametrize("how", ["junk", "outside", "misplaced"])
def test_an_unreadable_part_manifest_is_said_and_not_loaded(how, tmp_path, caplog):
    """Junk, a file outside the part (``..``), a manifest of another step: a WARNING names
    the manifest, as a damaged step of the url is named."""
    _saved(tmp_path, range(5, 8))
    path = _part(tmp_path) / MANIFEST
    m = json.loads(path.read_text())
    if how == "junk":
        path.write_text("{" * 10000)
    elif how == "outside":
        name = next(iter(m["files"]))
        m["files"]["../../x.distcp"] = m["files"].pop(name)
        path.write_text(json.dumps(m))
    else:
        m["step"] = 6
        path.write_text(json.dumps(m))
    _falls_back_and_recovers(tmp_path, caplog, names=f"{path}: ")


@pytest.mark.parametrize("which", ["part", "step"])
def test_a_linked_part_or_step_directory_is_no_part(which, tmp_path, caplog):
    """A part or step directory that is a symlink (to a whole copy of itself) is not read
    through; the save that drops the step removes the link, never what it points to."""
    _saved(tmp_path, range(5, 8))
    d = _part(tmp_path) if which == "part" else _part(tmp_path).parent
    target = tmp_path / "elsewhere"
    shutil.copytree(d, target)
    shutil.rmtree(d)
    d.symlink_to(target)
    there = sorted(str(p.relative_to(target)) for p in target.rglob("*"))
    _falls_back_and_recovers(tmp_path, caplog, names=None)
    if which == "part":  # dropped with its step (a linked step directory is never a step)
        assert not os.path.lexists(d)
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == there


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_tier_another_user_owns_is_neither_written_nor_read(tmp_path, caplog):
    """The run's directory (or the tier's root) handed to another user: the load reads the
    url, each memory save is skipped with a WARNING naming the directory and the fix; a root
    of another user's is refused at construction."""
    _saved(tmp_path, range(5, 8))
    run = _run_dir(tmp_path)
    want = _from_url(tmp_path)
    os.chown(run, 12345, 12345)
    model, opt = _fresh(seed=3)
    with caplog.at_level(logging.WARNING, logger="muon_ckpt"):
        mgr = _mgr(tmp_path, model, opt)
        assert mgr.load() == 5 and mgr.last_load_tier == "storage"
        _assert_same(want, _state(model, opt))
        assert mgr.save(6) and mgr.wait() == 6
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert (
        f"{run} belongs to user id 12345" in said
        and "a directory of your own (MemoryOptions(dir=" in said
    ), said
    assert mgr._saves.memory.tier.skipped == 1 and not os.path.exists(run / "step-00000006")
    mgr._saves.memory.mark = None
    mgr.close()
    os.chown(run, 0, 0)
    os.chown(tmp_path / "mem", 12345, 12345)
    with pytest.raises(CheckpointError, match="belongs to user id 12345"):
        _mgr(tmp_path, *_fresh())


def test_two_runs_share_a_tier_directory(tmp_path):
    """Two urls, one tier directory: each run resumes its own memory step; the other run's
    parts, found in its directory (a copy, or names that collide), are never loaded."""
    mem = str(tmp_path / "mem")
    urls = [str(tmp_path / "a"), str(tmp_path / "b")]
    kw: dict[str, Any] = {"interval": 100, "memory": MemoryOptions(interval=1, dir=mem)}
    want = {}
    for i, url in enumerate(urls):
        model, opt = _fresh(seed=i)
        mgr = CheckpointManager(url, model=model, optimizer=opt, **kw)
        mgr.load()
        mgr.save(1, force=True)
        mgr.wait()
        train(model, opt, 1, seed=10 + i)
        mgr.save(2 + i)  # memory only: a at 2, b at 3
        mgr.wait()
        want[url] = _state(model, opt)
        mgr._saves.memory.mark = None
        mgr.close()

    def load(url: str) -> tuple[Any, Any, Any]:
        model, opt = _fresh(seed=7)
        mgr = CheckpointManager(url, model=model, optimizer=opt, **kw)
        got = mgr.load(), mgr.last_load_tier, _state(model, opt)
        mgr._saves.memory.mark = None
        mgr.close()
        return got

    for i, url in enumerate(urls):
        step, tier, got = load(url)
        assert (step, tier) == (2 + i, "memory")
        _assert_same(want[url], got)
    a, b = (os.path.join(mem, run_dirname(Storage(u).url_of())) for u in urls)
    shutil.rmtree(b)
    shutil.copytree(a, b)  # run a's step 2 where run b's tier is
    assert load(urls[1])[:2] == (1, "storage")


# ---------------------------------------------------------------------- in a process of its own
def _in_child(target: Any, *args: Any) -> int:
    """``target(*args)`` in a fresh process (forked from a server that imported torch); its
    exit code (-9: SIGKILLed)."""
    p = _context().Process(target=target, args=args, daemon=True)
    p.start()
    p.join(120)
    if p.is_alive():
        p.kill()
        p.join()
        raise AssertionError(f"{target.__name__} did not end within 120 s")
    assert p.exitcode is not None
    return p.exitcode


def _three_steps(tmp: str) -> tuple[Any, Any, CheckpointManager]:
    """A manager (one writing thread) that saved step 1 to the url and steps 1-3 to memory,
    each step's state in ``<tmp>/want-<step>.pt``."""
    model, opt = _fresh()
    mgr = _mgr(Path(tmp), model, opt, interval=100, io_threads=1)
    mgr.load()
    for s in (1, 2, 3):
        train(model, opt, 1, seed=s)
        mgr.save(s, force=s == 1)
        mgr.wait()
        torch.save(_state(model, opt), os.path.join(tmp, f"want-{s}.pt"))
    return model, opt, mgr


def _full_tier(tmp: str) -> None:
    """Step 4's part cannot be written: a file of its size cannot be created here
    (RLIMIT_FSIZE, as a full /dev/shm refuses it; EFBIG instead of ENOSPC)."""
    model, opt, mgr = _three_steps(tmp)
    part = _part(Path(tmp), 3)
    biggest = max(os.path.getsize(f) for f in glob.glob(str(part / "*")))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (write() fails with EFBIG instead)
    resource.setrlimit(resource.RLIMIT_FSIZE, (biggest // 2, hard))
    try:
        train(model, opt, 1, seed=4)
        assert mgr.save(4) and mgr.wait() == 4
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    with open(os.path.join(tmp, "failed"), "w") as f:
        f.write(str(mgr._saves.memory.tier.failed))
    mgr.close()  # the tier's flush: step 4 is not in memory, step 3 goes to the url


def test_a_full_tier_skips_the_step_and_loses_nothing(tmp_path):
    """A memory save whose part cannot be written (the tier is full) is a WARNING: the step
    is not kept, the older memory step stays whole and is what a restart loads, bitwise;
    ``close()`` writes nothing to the url under the lost step's number, and flushes step 3
    (the newest step the tier holds) with its own bytes; the next memory save is kept."""
    assert _in_child(_full_tier, str(tmp_path)) == 0
    assert (tmp_path / "failed").read_text() == "1"
    assert not glob.glob(str(_run_dir(tmp_path) / "step-00000004" / "*" / MANIFEST))
    model, opt = _fresh(seed=6)
    with CheckpointManager(str(tmp_path / "run"), model=model, optimizer=opt) as mgr:
        assert mgr.steps() == [1, 3]
        assert mgr.load() == 3
    _assert_same(torch.load(tmp_path / "want-3.pt"), _state(model, opt))
    model, opt = _fresh(seed=5)
    mgr = _mgr(tmp_path, model, opt, interval=100)
    assert mgr.load() == 3 and mgr.last_load_tier == "memory"
    _assert_same(torch.load(tmp_path / "want-3.pt"), _state(model, opt))
    train(model, opt, 1, seed=40)
    assert mgr.save(4) and mgr.wait() == 4
    want = _state(model, opt)
    mgr._saves.memory.mark = None
    mgr.close()
    step, tier, got = _load_fresh(tmp_path, interval=100)
    assert (step, tier) == (4, "memory")
    _assert_same(want, got)


_KILL_POINTS = {  # where a memory save of step 4 is SIGKILLed -> the step a restart loads
    "writing its data": 3,
    "before its manifest's rename": 3,
    "before retention": 4,
    "while retention drops step 3": 4,
}


def _killed_while_keeping_step_4(tmp: str, point: str) -> None:
    import threading

    import muon_ckpt.memory._tier as tier_mod
    from muon_ckpt.save import _streams

    model, opt, mgr = _three_steps(tmp)

    def kill() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def in_memory_job() -> bool:
        return threading.current_thread().name.startswith("muon_ckpt-memory")

    if point == "writing its data":
        write = _streams._CrcStream.write

        def writing(self: Any, b: Any) -> int:
            if in_memory_job():
                kill()
            return write(self, b)

        _streams._CrcStream.write = writing  # type: ignore[method-assign]
    elif point == "before its manifest's rename":
        replace = os.replace

        def renaming(src: Any, dst: Any) -> None:
            if in_memory_job() and str(dst).endswith(MANIFEST):
                kill()
            replace(src, dst)

        os.replace = renaming  # type: ignore[assignment]
    elif point == "before retention":
        tier_mod.MemoryTier.retain = lambda *a: kill()  # type: ignore[method-assign]
    else:
        drop = tier_mod.drop_part

        def dropping(path: str) -> None:
            drop(path)
            if "step-00000003" in path:
                kill()

        tier_mod.drop_part = dropping
    train(model, opt, 1, seed=4)
    torch.save(_state(model, opt), os.path.join(tmp, "want-4.pt"))
    mgr.save(4)
    mgr.wait()


@pytest.mark.parametrize("point", list(_KILL_POINTS))
def test_a_sigkill_at_each_point_of_a_memory_save_leaves_a_whole_step(point, tmp_path):
    """Killed while the part's data is written, before its manifest is renamed into place,
    after it but before retention, or while retention drops the older step: a restart
    loads the newest whole step, bitwise (never a torn one), and its next memory save is
    kept with nothing of the killed save left beside it."""
    assert _in_child(_killed_while_keeping_step_4, str(tmp_path), point) == -signal.SIGKILL
    want = _KILL_POINTS[point]
    model, opt = _fresh(seed=5)
    mgr = _mgr(tmp_path, model, opt, interval=100)
    assert mgr.load() == want and mgr.last_load_tier == "memory"
    _assert_same(torch.load(tmp_path / f"want-{want}.pt"), _state(model, opt))
    assert mgr.save(want + 1) and mgr.wait() == want + 1
    mgr._saves.memory.mark = None
    mgr.close()
    assert sorted(os.listdir(_run_dir(tmp_path))) == ["run.json", f"step-{want + 1:08d}"]
    assert os.listdir(_part(tmp_path, want + 1)) and not glob.glob(str(tmp_path / "**/*.tmp"))


# ---------------------------------------------------------------------- a peer's bytes
def _node_manager(url: str, root: str, rank: int, model: Any, opt: Any) -> CheckpointManager:
    """One rank per node, each node's tier its own directory; the url saves step 0 only."""
    return CheckpointManager(
        url,
        model=model,
        optimizer=opt,
        interval=10**6,
        memory=MemoryOptions(
            interval=1, dir=os.path.join(root, f"node{rank}"), node_size=1, flush=False
        ),
        collective_timeout=60,
    )


def body_train_two_nodes(rank: int, world_size: int, url: str, root: str) -> dict[int, Any]:
    """Steps 0 (url and memory) to 3 (memory); step 3's replica of rank 0's part is sent as
    rank 0's part of step 2, which rank 1 must refuse (not this save's)."""
    import muon_ckpt.memory._tier as tier_mod

    send = tier_mod.send_part

    def sends_step_2(path: str | None, dst: int, group: Any) -> None:
        send(path and path.replace("step-00000003", "step-00000002"), dst, group)

    model, opt = _fresh()
    mgr = _node_manager(url, root, rank, model, opt)
    mgr.load()
    states = {}
    for s in range(4):
        if s == 3 and rank == 0:
            tier_mod.send_part = sends_step_2
        train(model, opt, 1, seed=s)
        mgr.save(s, force=s == 0)
        mgr.wait()
        states[s] = _state(model, opt)
    mgr.close()
    return states


def body_restore_two_nodes(rank: int, world_size: int, url: str, root: str, lie: bool) -> Any:
    """A load; ``lie``: rank 1 sends its own part where rank 0's replica is asked for."""
    import muon_ckpt.memory._restore as restore_mod

    if lie and rank == 1:
        send = restore_mod.send_part
        restore_mod.send_part = lambda path, dst, group: send(  # type: ignore[assignment]
            path.replace("copy-00000", "rank-00001"), dst, group
        )
    model, opt = _fresh(seed=5)
    mgr = _node_manager(url, root, rank, model, opt)
    out = mgr.load(), mgr.last_load_tier, _state(model, opt)
    mgr.close()
    return out


def test_a_peer_that_sends_the_wrong_bytes_is_refused(tmp_path):
    """2 ranks, one per node. A replica offered for another step than the save's is not
    kept (the older step, whose replicas are whole, stays beside it). A restore that needs
    rank 0's part from rank 1 refuses another part sent in its place, and a replica whose
    file became a FIFO is sent as bytes that fail their check (never a hang); both times the
    load reads the url, bitwise."""
    url, root = str(tmp_path / "run"), str(tmp_path / "mem")
    states = run_on_ranks(body_train_two_nodes, 2, url, root)[0]
    node0, node1 = (glob.glob(os.path.join(root, f"node{n}", "run-*"))[0] for n in (0, 1))
    assert not os.path.exists(os.path.join(node1, "step-00000003", "copy-00000"))
    assert os.path.exists(os.path.join(node1, "step-00000002", "copy-00000", MANIFEST))
    for step in (2, 3):  # rank 0 has no part of its own: only rank 1's replica of step 2
        shutil.rmtree(os.path.join(node0, f"step-{step:08d}", "rank-00000"))
    for lie in (True, False):
        if not lie:
            f = sorted(glob.glob(os.path.join(node1, "step-00000002", "copy-00000", "*.distcp")))
            os.unlink(f[0])
            os.mkfifo(f[0])
        got = run_on_ranks(body_restore_two_nodes, 2, url, root, lie, timeout=120)
        assert [(g[0], g[1]) for g in got] == [(0, "storage"), (0, "storage")], lie
        for g in got:
            _assert_same(states[0], g[2])
