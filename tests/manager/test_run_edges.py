"""The edges of a run, in real interpreters (tests/manager/_edge_script.py): a script that ends with
an asynchronous save pending (it returns, raises, or gets Ctrl-C in its loop) commits that
step before it exits; Ctrl-C inside a save leaves as KeyboardInterrupt; SIGTERM with
``watch_preemption()`` finishes the pending save, saves the current step and exits 0; a
destroyed process group leaves the pending step uncommitted, logged at ERROR. 1 and 2 ranks,
local storage and S3 (moto)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from muon_ckpt import CheckpointManager, MemoryOptions
from tests import REPO
from tests.conftest import assert_same, tiny_run, tiny_snapshot, tiny_train
from tests.manager._edge_script import _Signals


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(cfg: dict[str, Any], world_size: int) -> list[subprocess.Popen]:
    port = _port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.manager._edge_script", json.dumps(cfg)],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def _finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, err))
    return out


def _progress(out: str, rank: int = 0) -> list[str]:
    path = os.path.join(out, f"progress-{rank}")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [ln.strip() for ln in f]


def _wait_for(out: str, line: str, procs: list[subprocess.Popen], ranks: int) -> None:
    deadline = time.monotonic() + 120
    while not all(line in _progress(out, r) for r in range(ranks)):
        dead = [p.returncode for p in procs if p.poll() is not None]
        assert not dead, f"a rank exited ({dead}) before {line!r}: {_finish(procs)}"
        assert time.monotonic() < deadline, f"no {line!r} in {out}"
        time.sleep(0.02)


def _loader(url: str, opts: dict[str, Any]) -> tuple[CheckpointManager, Any, Any]:
    model, opt = tiny_run(seed=99)
    mgr = CheckpointManager(
        url, model=model, optimizer=opt, extra={"signals": _Signals(None)}, storage_options=opts
    )
    return mgr, model, opt


def _assert_loads_bitwise(url: str, opts: dict[str, Any], out: str, step: int) -> None:
    mgr, model, opt = _loader(url, opts)
    assert mgr.load(step=step) == step
    assert_same(tiny_snapshot(model, opt), torch.load(os.path.join(out, f"state-{step}.pt")))


def _where(kind: str, tmp_path: Any, request: pytest.FixtureRequest) -> tuple[str, dict]:
    if kind == "local":
        return str(tmp_path / "run"), {}
    bucket, opts = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/run", opts


# ---------------------------------------------------------------------- exit
@pytest.mark.parametrize(
    ("end", "ranks", "kind"),
    [  # each ending on 1 and 2 ranks, and on local storage and S3
        ("return", 1, "local"),
        ("raise", 1, "s3"),
        ("sigint", 1, "local"),
        ("return", 2, "s3"),
        ("raise", 2, "local"),
        ("sigint", 2, "s3"),
    ],
)
def test_a_pending_save_is_committed_when_the_script_ends(end, ranks, kind, tmp_path, request):
    url, opts = _where(kind, tmp_path, request)
    out = str(tmp_path / "out")
    os.makedirs(out)
    # Each background write waits at its gate, step 3's until the exit waits for it.
    cfg = {"url": url, "opts": opts, "out": out, "steps": 3, "gate": True, "end": end}
    procs = _launch(cfg, ranks)
    if end == "sigint":
        _wait_for(out, "done", procs, ranks)
        for p in procs:
            p.send_signal(signal.SIGINT)
    results = _finish(procs)
    for rc, err in results:
        want = {"return": (0,), "raise": (1,), "sigint": (-signal.SIGINT, 130, 1)}[end]
        assert rc in want, (rc, err)
        assert "waiting for the asynchronous save of step 3 before exiting" in err, err
        assert "cannot schedule new futures" not in err, err
    assert "pending 3" in _progress(out)
    if kind == "local":  # closed at exit: the write lease was given back
        assert not os.path.exists(os.path.join(url, "lease.json"))
    mgr, _, _ = _loader(url, opts)
    assert mgr.steps() == [1, 2, 3]
    _assert_loads_bitwise(url, opts, out, 3)


def test_a_save_that_cannot_finish_at_exit_is_logged_and_left_uncommitted(tmp_path):
    """The process group is destroyed before the pending save could run: the step stays
    uncommitted (never half-committed) and each rank logs the failure at ERROR, naming it."""
    url, out = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(out)
    cfg = {"url": url, "out": out, "steps": 2, "gate": True, "end": "destroy"}
    for rc, err in _finish(_launch(cfg, 2)):
        assert rc == 0, err
        line = next((ln for ln in err.splitlines() if "ERROR" in ln or "at exit" in ln), err)
        assert "step 2" in line and "destroy" in line, err
    mgr, _, _ = _loader(url, {})
    assert mgr.steps() == [1]
    _assert_loads_bitwise(url, {}, out, 1)


def test_a_background_failure_after_the_last_save_is_logged_at_exit(tmp_path):
    """The last save of a script fails in the background (here: another job took the lease
    before its commit) and the script never calls wait() or close(): the exit logs it at
    ERROR, naming the step."""
    url, out = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(out)
    cfg = {"url": url, "out": out, "steps": 2, "gate": True, "end": "steal"}
    [(rc, err)] = _finish(_launch(cfg, 1))
    assert rc == 0, err
    errors = [ln for ln in err.splitlines() if ln.startswith("ERROR")]
    assert len(errors) == 1 and "step 2" in errors[0] and "lease" in errors[0], err
    mgr, _, _ = _loader(url, {})
    assert mgr.steps() == [1]


# ---------------------------------------------------------------------- Ctrl-C in a save
@pytest.mark.parametrize(
    ("async_save", "signal_in"),
    [(False, "write"), (False, "zip"), (True, "snapshot"), (False, "snapshot")],
)
def test_ctrl_c_inside_a_save_leaves_as_keyboard_interrupt(async_save, signal_in, tmp_path):
    """A SIGINT while ``save()`` runs (while DCP writes, inside torch.save's zip writer, or
    while the snapshot is taken) comes out of the call as KeyboardInterrupt, not as a
    CheckpointError that the loop's ``except CheckpointError`` would swallow (``zip``: the
    zip writer raises a RuntimeError whose __context__ is the interrupt); committed steps are
    unchanged and load, and the interrupted step, saved again over what it left, commits."""
    url, out = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(out)
    cfg = {
        "url": url,
        "out": out,
        "steps": 3,
        "interrupt_at": 3,
        "signal_in": signal_in,
        "async_save": async_save,
        "io_threads": 1 if signal_in == "zip" else None,  # (the main thread writes every file)
    }
    [(rc, err)] = _finish(_launch(cfg, 1))
    assert rc == 0, err
    lines = _progress(out)
    assert "interrupted 3" in lines, (lines, err)
    assert not any(ln.startswith("caught CheckpointError") for ln in lines), lines
    assert "steps [1, 2]" in lines  # (what a load finds right after the interrupt)
    assert "saved again 3: steps [1, 2, 3]" in lines  # over what the interrupt left
    mgr, model, opt = _loader(url, {})
    assert mgr.load() == 3
    assert_same(tiny_snapshot(model, opt), torch.load(os.path.join(out, "state-3.pt")))
    _assert_loads_bitwise(url, {}, out, 2)


def _raised(fn: Any) -> BaseException:
    try:
        fn()
    except BaseException as e:
        return e
    raise AssertionError("nothing raised")


def test_an_interrupt_anywhere_in_the_chain_is_what_comes_out():
    """The rule behind every save, load and wait: an interrupt (a BaseException that is not
    an Exception) wrapped by DCP, or left as the __context__ or __cause__ of what broke on
    its way out, anywhere down the chain, is found; errors without one are not interrupts."""
    from torch.distributed.checkpoint.api import CheckpointException

    from muon_ckpt import CheckpointError
    from muon_ckpt._dcp import failures
    from muon_ckpt._errors import interrupt_in, passes_interrupts

    ki, bye = KeyboardInterrupt(), SystemExit(3)

    def zip_writer() -> None:  # what torch.save's context manager does on a Ctrl-C
        try:
            raise ki
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos")

    broke = _raised(zip_writer)
    assert broke.__context__ is ki and interrupt_in(broke) is ki
    wrapped = CheckpointError("writing failed")
    wrapped.__cause__ = broke
    assert interrupt_in(CheckpointException("save", {0: (wrapped, None)})) is ki
    assert interrupt_in(CheckpointException("save", {1: bye})) is bye
    assert interrupt_in(ki) is ki
    loop_a, loop_b = RuntimeError("a"), ValueError("b")
    loop_a.__context__, loop_b.__context__ = loop_b, loop_a
    assert interrupt_in(loop_a) is None  # a cycle ends
    assert interrupt_in(CheckpointException("save", {0: (RuntimeError("x"), None)})) is None

    def in_dcp() -> None:  # through the place DCP's failures are translated
        with failures("saving step 1"):
            raise CheckpointException("save", {0: (wrapped, None)})

    assert _raised(in_dcp) is ki

    # What was being handled when the call began is not the call's interrupt: a save made
    # in an ``except KeyboardInterrupt:`` block that fails on its own is that failure.
    door = passes_interrupts(zip_writer)
    assert _raised(door) is ki
    own = CheckpointError("its own failure")
    try:
        raise ki
    except KeyboardInterrupt:
        assert _raised(passes_interrupts(_raises(own))) is own and own.__context__ is ki
        assert interrupt_in(own, since=ki) is None


def _raises(e: BaseException) -> Any:
    def fn() -> None:
        raise e

    return fn


def _interrupted_once(where: str) -> Any:
    """A stand-in for ``where``'s callee that fails, the first time, as an interrupted
    library call does: a CheckpointCorruptError raised on the way out of a Ctrl-C (its
    __context__), the error a load falls back past; afterwards the real one."""
    from muon_ckpt import CheckpointCorruptError

    module, name = where.rsplit(".", 1)
    real = getattr(__import__(module, fromlist=[name]), name)
    calls = [0]

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > 1:
            return real(*args, **kwargs)
        try:
            raise KeyboardInterrupt
        finally:
            raise CheckpointCorruptError("a read cut short: unexpected pos")

    return broken


@pytest.mark.parametrize("memory", [False, True])
def test_ctrl_c_inside_a_load_leaves_as_itself_and_changes_nothing(memory, tmp_path, monkeypatch):
    """A load whose read breaks on an interrupt (a corrupt-looking error whose __context__ is
    the KeyboardInterrupt) raises that KeyboardInterrupt, the state as it was: it does not
    fall back to an older step, nor from the memory tier to the url, as it would for damage.
    The next load loads the newest step."""
    url = str(tmp_path / "run")
    kw: dict[str, Any] = (
        {"memory": MemoryOptions(interval=2, dir=str(tmp_path / "mem"))} if memory else {}
    )
    model, opt = tiny_run(seed=0)
    mgr = CheckpointManager(url, model=model, optimizer=opt, **kw)
    for step in (1, 2):
        tiny_train(model, opt, 1, seed=step)
        mgr.save(step, force=True)
    mgr.wait()
    saved = tiny_snapshot(model, opt)
    mgr.close()
    model, opt = tiny_run(seed=1)
    before = tiny_snapshot(model, opt)
    mgr = CheckpointManager(url, model=model, optimizer=opt, **kw)
    where = (
        "muon_ckpt.memory._restore.check_files"
        if memory
        else "muon_ckpt.load._attempt.apply_loaded"
    )
    monkeypatch.setattr(where, _interrupted_once(where))
    with pytest.raises(KeyboardInterrupt):
        mgr.load()
    assert_same(tiny_snapshot(model, opt), before)
    assert mgr.load() == 2
    assert mgr.last_load_tier == ("memory" if memory else "storage")
    assert_same(tiny_snapshot(model, opt), saved)
    mgr.close()


def test_a_save_made_while_handling_ctrl_c_fails_as_itself(tmp_path):
    """A save or load called in the script's ``except KeyboardInterrupt:`` block that fails
    for a reason of its own (a committed step without ``overwrite``, a step that is not there)
    raises that CheckpointError, not the interrupt it was called while handling."""
    from muon_ckpt import CheckpointExistsError, CheckpointNotFoundError

    model, opt = tiny_run(seed=0)
    mgr = CheckpointManager(str(tmp_path / "run"), model=model, optimizer=opt)
    mgr.save(1)
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:  # (caught as BaseException: a wrong answer fails this test only)
        saved, loaded = _raised(lambda: mgr.save(1)), _raised(lambda: mgr.load(step=7))
    assert isinstance(saved, CheckpointExistsError), repr(saved)
    assert isinstance(loaded, CheckpointNotFoundError), repr(loaded)
    mgr.close()


def test_an_exit_in_a_background_save_leaves_wait_as_itself(tmp_path, monkeypatch):
    """A SystemExit raised while a background save writes (in the save's own thread, which
    writes every file with ``io_threads=1``) comes out of ``wait()`` as itself, not as the
    CheckpointError a failed asynchronous save is; nothing is committed and the next save
    commits."""
    import threading

    from muon_ckpt.save import _streams

    real = _streams._CrcStream.write
    main = threading.main_thread()

    def exits(self: Any, b: Any) -> int:
        if threading.current_thread() is not main:
            raise SystemExit(3)
        return real(self, b)

    model, opt = tiny_run(seed=0)
    url = str(tmp_path / "run")
    mgr = CheckpointManager(url, model=model, optimizer=opt, async_save=True, io_threads=1)
    monkeypatch.setattr(_streams._CrcStream, "write", exits)
    mgr.save(1, force=True)
    with pytest.raises(SystemExit):
        mgr.wait()
    monkeypatch.undo()
    assert mgr.steps() == []
    assert mgr.save(2, force=True)
    mgr.wait()
    assert mgr.steps() == [2]
    mgr.close()


# ---------------------------------------------------------------------- preemption
@pytest.mark.parametrize(("kind", "mid_save"), [("local", False), ("local", True), ("s3", True)])
def test_sigterm_saves_the_current_step_on_every_rank_and_exits_0(
    kind, mid_save, tmp_path, request
):
    url, opts = _where(kind, tmp_path, request)
    out = str(tmp_path / "out")
    os.makedirs(out)
    cfg = {"url": url, "opts": opts, "out": out, "steps": 10_000, "interval": 4, "preempt": True}
    if mid_save:  # step 4's write waits until the signal came: it comes while step 4 is pending
        cfg.update(gate=True, slow=0.05)
    else:
        cfg.update(slow=0.02)
    procs = _launch(cfg, 2)
    _wait_for(out, "pending 4" if mid_save else "saved 8", procs, 2)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    open(os.path.join(out, "signalled"), "w").close()  # (sent: the scripts' gates may open)
    results = _finish(procs)
    for rc, err in results:
        assert rc == 0, err
    assert "preempted (SIGTERM): finishing the pending save" in results[0][1], results[0][1]
    mgr, _, _ = _loader(url, opts)
    steps = mgr.steps()
    last = steps[-1]
    assert f"preempted: step {last} is committed; exiting with code 0" in results[0][1]
    if mid_save:  # step 4 finished, then the step the loop was at, due or not
        assert steps == [4, last] and last > 4, steps
    else:
        assert steps[:2] == [4, 8] and last > 8, steps
    _assert_loads_bitwise(url, opts, out, last)
