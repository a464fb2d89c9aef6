"""The ranks of a node share the tier's directory, and one rank's retention drops a step while
another lists the parts: a step or part gone between the listing and the reading is no part
(nothing raised, no problem reported), so a healthy save never warns that keeping a step
failed. The vanishing is made real and exact: an audit hook removes the directory the moment
the reader is about to read it."""

from __future__ import annotations

import os
import shutil
import sys

from muon_ckpt.memory import list_parts
from muon_ckpt.store import MANIFEST
from tests._ckpt import train
from tests._memtier import _fresh, _memory, _mgr, _run_dir

_armed: dict[str, str] = {}  # audit event -> the path whose reading removes its directory


def _remove_when_read(event: str, args: tuple) -> None:
    target = _armed.get(event)
    if target is not None and args and os.fspath(args[0]) == target:
        del _armed[event]
        shutil.rmtree(target if event == "os.listdir" else os.path.dirname(target))


sys.addaudithook(_remove_when_read)  # (inert while nothing is armed; hooks cannot be removed)


def _two_steps(tmp_path):
    model, opt = _fresh()
    with _mgr(tmp_path, model, opt, interval=1000, memory=_memory(tmp_path, keep=2)) as mgr:
        for step in (1, 2):
            train(model, opt, 1)
            mgr.save(step)
        mgr.wait()
    return str(_run_dir(tmp_path))


def test_a_step_dropped_while_parts_are_listed_is_skipped(tmp_path):
    """Step 1's directory is removed just as list_parts lists it: step 2's part is listed,
    nothing is raised."""
    run = _two_steps(tmp_path)
    _armed["os.listdir"] = os.path.join(run, "step-00000001")
    try:
        parts = list_parts(run)
        removed = not _armed
    finally:
        _armed.clear()
    assert removed
    assert [(p.step, p.rank, p.problem) for p in parts] == [(2, 0, None)]


def test_a_part_dropped_before_its_manifest_is_read_is_skipped(tmp_path):
    """Step 1's part is removed just as its manifest is opened: it is no part (as one whose
    manifest was never written), not a part with a problem that a restore would warn of."""
    run = _two_steps(tmp_path)
    _armed["open"] = os.path.join(run, "step-00000001", "rank-00000", MANIFEST)
    try:
        parts = list_parts(run)
        removed = not _armed
    finally:
        _armed.clear()
    assert removed
    assert [(p.step, p.rank, p.problem) for p in parts] == [(2, 0, None)]
