"""Ctrl-C that lands once a call's outcome is settled:
right after a synchronous save's commit, after the ranks agreed on a load, and
while a memory save reads the live state. The call leaves as KeyboardInterrupt, with what
it settled recorded: the commit's bookkeeping done (the line told, so the next save refers
to the step just committed), the load kept and recorded (the line continues from it, the
report fields set), and no thread left reading the state the training goes on changing.

The SIGINT is sent at a progress marker, never a time: from a logging handler when the
commit's or the load's INFO line is emitted (both come after the point in question), or from
a helper thread once the main thread is inside the wait for the memory job.

Before the fix, the interrupted save left the line as it was (the next save did not refer to
the step committed), the interrupted load left the line and
``last_load_tier`` as before the load (the next save did not retire the rewound step), and
the memory save returned while its job still read the live state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

import pytest

from muon_ckpt import CheckpointManager, MemoryOptions
from muon_ckpt.store import data_ref
from tests.conftest import assert_same, tiny_run, tiny_snapshot, tiny_train
from tests.manager.test_interrupt_close import CtrlC, is_set
from tests.manager.test_interrupt_storm import _python_sigint


class _SigintOn(logging.Handler):
    """Sends this process SIGINT when a record of the muon_ckpt logger starts with
    ``prefix`` (once)."""

    def __init__(self, prefix: str) -> None:
        super().__init__(logging.INFO)
        self.prefix = prefix
        self.sent = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.sent and record.getMessage().startswith(self.prefix):
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)


@contextlib.contextmanager
def sigint_on(prefix: str) -> Iterator[_SigintOn]:
    log = logging.getLogger("muon_ckpt")
    handler, level = _SigintOn(prefix), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with _python_sigint():
            yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _refers_to(mgr: CheckpointManager, step: int) -> set[str]:
    """The data directories step ``step``'s files are in."""
    m = mgr._catalog.manifest(step)
    return {ref[0] for name in m.files if (ref := data_ref(name)) is not None}


def test_ctrl_c_right_after_a_synchronous_commit_keeps_the_commits_bookkeeping(tmp_path):
    model, opt = tiny_run(seed=0, hidden=4096)  # (tensors large enough to be referred to)
    mgr = CheckpointManager(str(tmp_path / "run"), model=model, optimizer=opt)
    tiny_train(model, opt, 1, seed=1)
    mgr.save(1)
    tiny_train(model, opt, 1, seed=2)
    mgr.save(2)
    with sigint_on("committed step 3") as h, pytest.raises(KeyboardInterrupt):
        mgr.save(3)  # (unchanged since step 2; each tensor written again, having changed then)
    assert h.sent and mgr.steps() == [1, 2, 3]
    mgr.save(4)  # unchanged since step 3: it refers to step 3's files
    step3 = mgr._catalog.manifest(3).data
    assert step3 in _refers_to(mgr, 4), "the line was not told of step 3's commit"
    mgr.close()


@pytest.mark.parametrize("memory", [False, True])
def test_ctrl_c_after_the_ranks_agreed_leaves_the_load_kept_and_recorded(memory, tmp_path):
    """A Ctrl-C once every rank agreed to keep the load: it leaves as KeyboardInterrupt with
    the step loaded (bitwise) and recorded (``last_load_tier``; the line: from the url, a
    rewind to step 2 whose next save retires step 3; from the memory tier, step 3's line,
    continued)."""
    url = str(tmp_path / "run")
    kw = {"memory": MemoryOptions(interval=1, dir=str(tmp_path / "mem"))} if memory else {}
    model, opt = tiny_run(seed=0)
    mgr = CheckpointManager(url, model=model, optimizer=opt, **kw)
    saved = {}
    for step in (1, 2, 3):
        tiny_train(model, opt, 1, seed=step)
        mgr.save(step)
        saved[step] = tiny_snapshot(model, opt)
    mgr.close()
    model, opt = tiny_run(seed=9)
    mgr = CheckpointManager(url, model=model, optimizer=opt, **kw)
    step = 3 if memory else 2
    with sigint_on(f"loaded step {step}") as h, pytest.raises(KeyboardInterrupt):
        mgr.load(step=None if memory else step)
    assert h.sent
    assert_same(tiny_snapshot(model, opt), saved[step])
    assert mgr.last_load_tier == ("memory" if memory else "storage")
    assert mgr.last_load_report.step == step
    mgr.save(4)
    mgr.wait()
    assert mgr.steps() == ([1, 2, 3, 4] if memory else [1, 2, 4])
    mgr.close()


def test_ctrl_c_while_a_memory_save_reads_the_live_state(tmp_path):
    """A memory save whose snapshot is the live state (over ``max_staging_bytes``) waits
    until its job has read it; a Ctrl-C meanwhile stops the part's writing and leaves once
    the job no longer reads the state (the training changes it next)."""
    model, opt = tiny_run(seed=0)
    mem = MemoryOptions(interval=1, dir=str(tmp_path / "mem"))
    mgr = CheckpointManager(
        str(tmp_path / "run"),
        model=model,
        optimizer=opt,
        interval=100,
        memory=mem,
        max_staging_bytes=1,
    )
    saves = mgr._saves
    gate = saves.gate = threading.Event()  # the memory job waits for it

    def stopped() -> bool:
        job = saves.memory_job
        return job is not None and is_set(getattr(job, "stopped", None))

    reading = None
    try:
        with CtrlC("wait_written", "_tier.py", stopped, gate):
            with _python_sigint(), pytest.raises(KeyboardInterrupt):
                mgr.save(1)
            job = saves.memory_job
            reading = job is not None and not job._written.is_set()
    finally:
        gate.set()
    assert reading is False, "save() left while its memory job still read the live state"
    tiny_train(model, opt, 1, seed=2)
    assert mgr.save(2)
    mgr.close()
