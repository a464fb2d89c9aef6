"""Ctrl-C while ``close()`` or the interpreter's exit waits for a pending asynchronous save:
the save is stopped (no new file starts), its
thread has ended before the call leaves as KeyboardInterrupt, and only then is the write
lease given back; at exit, Ctrl-C pressed again and again never aborts the process.

Before the fix, close() raised KeyboardInterrupt with the save's thread still running and the
lease released: a new manager loaded step 1 while the old thread went on to commit step 2
above it. At exit, the hook returned with the thread running; a further Ctrl-C in
``threading._shutdown`` left it inside torch when the interpreter finished ("terminate called
without an active exception", SIGABRT), the pending step lost.

Every moment is a progress marker, never a time: the SIGINT goes out once the main thread is
inside ``close()`` (its stack) or the child said so; the pending write waits at the
manager's test gate until the stop was taken.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from muon_ckpt import CheckpointManager
from tests import REPO
from tests.conftest import assert_same, tiny_run, tiny_snapshot, tiny_train
from tests.manager.test_interrupt_storm import _python_sigint

BOUND_S = 120.0  # the longest any one wait for a marker may take (a loaded host)


def until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {BOUND_S} s")
        time.sleep(0.002)


def main_thread_in(function: str, module: str, blocked: bool = False) -> bool:
    """Whether the main thread is inside ``function`` of the muon_ckpt module ``module``
    (``blocked``: and waits there, in ``threading``: past that function's set-up)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if blocked and (frame is None or not frame.f_code.co_filename.endswith("threading.py")):
        return False
    while frame is not None:
        code = frame.f_code
        if code.co_name == function and code.co_filename.endswith(module):
            return True
        frame = frame.f_back
    return False


def alive() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("muon_ckpt"))


def is_set(flag: object) -> bool:
    """A stop flag's state (False where there is none)."""
    return bool(getattr(flag, "is_set", False))


class CtrlC:
    """A helper thread that sends this process SIGINT once the main thread waits inside
    ``function`` of ``module``, then, once ``stopped()`` says the interrupt was taken, opens
    ``gate`` (the storage answers again). ``errors``: what went wrong on its side."""

    def __init__(
        self, function: str, module: str, stopped: Callable[[], bool], gate: threading.Event
    ) -> None:
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(
            target=self._run, args=(function, module, stopped, gate), daemon=True
        )

    def _run(self, function: str, module: str, stopped: Callable[[], bool], gate: threading.Event):
        try:
            until(lambda: main_thread_in(function, module, True), f"main thread in {function}")
            os.kill(os.getpid(), signal.SIGINT)
            until(lambda: stopped() or not main_thread_in(function, module), "the stop")
        except BaseException as e:
            self.errors.append(e)
            gate.set()  # (the main thread may wait for it: the test fails, never hangs)
        finally:
            if stopped():
                gate.set()

    def __enter__(self) -> CtrlC:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(BOUND_S)
        assert not self.errors, self.errors


def test_ctrl_c_in_close_stops_the_pending_save_and_ends_its_thread_first(tmp_path):
    url = str(tmp_path / "run")
    model, opt = tiny_run(seed=0)
    mgr = CheckpointManager(url, model=model, optimizer=opt, async_save=True)
    tiny_train(model, opt, 1, seed=1)
    mgr.save(1)
    mgr.wait()
    step1 = tiny_snapshot(model, opt)
    saves = mgr._saves
    gate = saves.gate = threading.Event()  # storage that does not answer until told
    tiny_train(model, opt, 1, seed=2)
    mgr.save(2)  # pending: its write waits at the gate
    try:
        with (
            _python_sigint(),
            CtrlC("close", "_saves.py", lambda: is_set(getattr(saves, "stopped", None)), gate),
        ):
            with pytest.raises(KeyboardInterrupt):
                mgr.close()
            running = alive()
            lease = os.path.exists(os.path.join(url, "lease.json"))
            steps = mgr.steps()
    finally:
        gate.set()
        for t in threading.enumerate():  # (a thread left running: its step lands now)
            if t.name.startswith("muon_ckpt-save"):
                t.join(BOUND_S)
    assert running == [], f"close() raised KeyboardInterrupt with {running} still running"
    assert not lease  # given back, once the save had ended
    assert steps == [1] == CheckpointManager(url).steps()  # nothing committed after close()
    model, opt = tiny_run(seed=5)
    again = CheckpointManager(url, model=model, optimizer=opt)
    assert again.load() == 1
    assert_same(tiny_snapshot(model, opt), step1)
    assert again.save(2)  # the lease is free, the interrupted step's leftovers go
    assert again.steps() == [1, 2]
    again.close()


class _Child:
    """tests/_exit_interrupt_child.py: its stdout lines in a queue, its stderr kept."""

    def __init__(self, url: str, out: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.manager._exit_interrupt_child", url, out],
            cwd=REPO,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        self.pumps = [
            threading.Thread(target=self._pump_out, daemon=True),
            threading.Thread(target=self._pump_err, daemon=True),
        ]
        for t in self.pumps:
            t.start()

    def _pump_out(self) -> None:
        for line in self.proc.stdout:
            self.out.append(line.rstrip("\n"))
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _pump_err(self) -> None:
        for line in self.proc.stderr:
            self.err.append(line)

    def expect(self, want: str) -> None:
        """Until the child printed ``want`` (other lines pass)."""
        deadline = time.monotonic() + BOUND_S
        while True:
            try:
                got = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {want!r}; stderr: {''.join(self.err)[-3000:]}") from None
            assert got is not None, f"ended before {want!r}: {''.join(self.err)[-3000:]}"
            if got == want:
                return

    def stderr_has(self, text: str) -> bool:
        return any(text in line for line in self.err)


def test_ctrl_c_again_and_again_at_exit_never_aborts(tmp_path):
    """The loop ends on Ctrl-C with step 2 pending; the exit hook waits for it and three more
    Ctrl-C arrive, each once the one before it reached the process. The save is stopped and
    its thread has ended before the hook returns; the process exits on the interrupt, never
    aborted; the lease is given back and step 1 loads bitwise."""
    url, out = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(out)
    child = _Child(url, out)
    try:
        child.expect("pending 2")
        child.proc.send_signal(signal.SIGINT)  # ends the training loop
        child.expect("sigint 1")
        waiting = "waiting for the asynchronous save of step 2 before exiting"
        until(lambda: child.stderr_has(waiting) or child.proc.poll() is not None, "exit hook")
        for n in (2, 3, 4):  # impatient: again and again while the hook waits
            child.proc.send_signal(signal.SIGINT)
            child.expect(f"sigint {n}")
        child.proc.stdin.write("open\n")  # the gate may open once the stop was taken
        child.proc.stdin.flush()
        rc = child.proc.wait(timeout=BOUND_S)
    finally:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()
    for t in child.pumps:  # (everything it printed)
        t.join(BOUND_S)
    err = "".join(child.err)
    assert "terminate called" not in err and rc != -signal.SIGABRT, (rc, err[-3000:])
    assert rc in (-signal.SIGINT, 130, 1), (rc, err[-3000:])
    assert "after exit hook: alive []" in child.out, (child.out, err[-3000:])
    assert not os.path.exists(os.path.join(url, "lease.json"))
    assert CheckpointManager(url).steps() == [1]  # stopped before its first file
    assert any("step 2" in ln for ln in err.splitlines() if ln.startswith("ERROR")), err
    model, opt = tiny_run(seed=7)
    mgr = CheckpointManager(url, model=model, optimizer=opt)
    assert mgr.load() == 1
    assert_same(tiny_snapshot(model, opt), torch.load(os.path.join(out, "state-1.pt")))
