"""A run forked by linking another run's data: ``ln -s runA/data
runB/data``, or one link per data directory, with run A's newest step copied into run B.

Before the fix run B's collection listed and deleted through the links: its first save
deleted run A's data that B's manifests did not name (A's steps became corrupt), and B's
load read A's files. A run's data is its own (docs/format.md): nothing is collected, deleted,
read or written through a link; a step of B naming data behind one is corrupt there (load
falls back, verify fails it, naming the link); a save that would write through the linked
``data`` is refused before it writes. Run A's every step loads bitwise after run B's saves,
retention and prune, and so do B's own steps.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

from muon_ckpt import CheckpointCorruptError, CheckpointError, CheckpointManager
from muon_ckpt.cli import main
from muon_ckpt.store import DATA, step_dirname
from tests._ckpt import TinyNet, make_muon, muon_state_sd, train


def _model() -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = TinyNet()
    model.register_buffer("frozen", torch.randn(64, 64))  # 16 KiB: later steps refer to it
    return model, make_muon(model)


def _state(model: torch.nn.Module, opt: Any) -> dict[str, Any]:
    sd = muon_state_sd(model, opt)
    sd["frozen"] = model.frozen.clone()
    return sd


def _run_a(url: str) -> dict[int, dict[str, Any]]:
    """Steps 1-3 (dedup on): each step's data directory, step 1's holding the frozen
    tensor that steps 2 and 3 refer to. The state at each step."""
    model, opt = _model()
    want = {}
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        for step in (1, 2, 3):
            train(model, opt, 1, seed=step)
            mgr.save(step)
            want[step] = _state(model, opt)
    return want


def _loads(url: str, want: dict[int, dict[str, Any]]) -> None:
    """Exactly the steps of ``want``, each loading bitwise."""
    assert CheckpointManager(url).steps() == sorted(want)
    for step, sd in want.items():
        model, opt = _model()
        assert CheckpointManager(url, model=model, optimizer=opt).load(step=step) == step
        got = _state(model, opt)
        assert sorted(got) == sorted(sd)
        for k, v in sd.items():
            assert torch.equal(got[k], v) if torch.is_tensor(v) else got[k] == v, (step, k)


def _fork(tmp_path: Any, whole: bool) -> tuple[str, str, dict[int, dict[str, Any]]]:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    want = _run_a(a)
    os.makedirs(b)
    shutil.copytree(os.path.join(a, step_dirname(3)), os.path.join(b, step_dirname(3)))
    if whole:
        os.symlink(os.path.join(a, DATA), os.path.join(b, DATA))
    else:
        os.makedirs(os.path.join(b, DATA))
        for d in os.listdir(os.path.join(a, DATA)):
            os.symlink(os.path.join(a, DATA, d), os.path.join(b, DATA, d))
    return a, b, want


def _refused_for_the_link(b: str, capsys: pytest.CaptureFixture) -> None:
    """B's copied step 3 names data behind a link: load() passes over it, verify fails it."""
    model, opt = _model()
    with pytest.raises(CheckpointCorruptError, match="symbolic link"):
        CheckpointManager(b, model=model, optimizer=opt).load(step=3)
    with pytest.raises(CheckpointCorruptError, match=r"no committed step loads.*symbolic link"):
        CheckpointManager(b, model=model, optimizer=opt).load()
    assert main(["verify", b, "--step", "3"]) != 0
    assert "symbolic link" in capsys.readouterr().out


@pytest.mark.parametrize("whole", [True, False], ids=["data-linked", "dirs-linked"])
def test_a_run_with_linked_data_never_touches_the_other_runs_files(tmp_path, capsys, whole):
    a, b, want = _fork(tmp_path, whole)
    _refused_for_the_link(b, capsys)
    model, opt = _model()
    opts: dict[str, Any] = {"keep_last": 1, "new_run": True}  # (step 3 does not load here)
    mgr = CheckpointManager(b, model=model, optimizer=opt, **opts)
    own = {}
    if whole:  # a save would write its data into run A's directory: refused, nothing written
        with pytest.raises(CheckpointError, match="symbolic link") as e:
            mgr.save(4)
        assert "nothing was written" in str(e.value)
        _loads(a, want)
        mgr = CheckpointManager(b, model=model, optimizer=opt, dedup=False, **opts)
    for step in (4, 5, 6):  # (B's step 3 is replaced, then retention deletes 4 and 5)
        train(model, opt, 1, seed=step)
        mgr.save(step)
        own[step] = _state(model, opt)
    mgr.close()
    assert main(["prune", b, "--keep", "1"]) == 0
    _loads(a, want)
    _loads(b, {6: own[6]})
    # The links were never followed, and are never removed by collecting either.
    if whole:
        assert os.path.islink(os.path.join(b, DATA))
    else:
        assert all(os.path.islink(os.path.join(b, DATA, d)) for d in os.listdir(f"{a}/{DATA}"))
    # Run A saves on, and its retention and prune keep to its own files.
    model, opt = _model()
    with CheckpointManager(a, model=model, optimizer=opt, keep_last=2) as mgr_a:
        assert mgr_a.load() == 3
        mgr_a.save(4)
        want[4] = _state(model, opt)
    assert main(["prune", a, "--keep", "2"]) == 0
    _loads(a, {3: want[3], 4: want[4]})
    _loads(b, {6: own[6]})


def _tree(root: str) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(root)
        for f in files
    }


def test_a_link_inside_a_data_directory_is_never_followed(tmp_path):
    """Entries no save makes (a subdirectory that links to run A's data, a file that links
    to one of A's files): collecting unlinks them, never deletes through them."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    want = _run_a(a)
    before = _tree(a)
    model, opt = _model()
    with CheckpointManager(b, model=model, optimizer=opt, keep_last=1) as mgr:
        mgr.save(1)
        d = os.path.join(b, DATA, os.listdir(os.path.join(b, DATA))[0])
        os.symlink(os.path.join(a, DATA), os.path.join(d, "sub"))
        os.symlink(os.path.join(a, sorted(before)[0]), os.path.join(d, "linked.distcp"))
        train(model, opt, 1, seed=7)
        mgr.save(2)  # retention deletes step 1; collecting goes through step 1's directory
        own = {2: _state(model, opt)}
    assert main(["prune", b, "--keep", "1"]) == 0
    assert _tree(a) == before
    _loads(a, want)
    _loads(b, own)
    # (the links went, as any file no step names, never what they link to)
    assert not os.path.lexists(os.path.join(d, "sub"))
    assert not os.path.lexists(os.path.join(d, "linked.distcp"))


def test_a_data_directory_moved_behind_a_link_is_written_again_not_read(tmp_path, caplog):
    """A data directory later saves refer to, moved elsewhere and replaced by a link to the
    copy (``mv data/D /disk2/D; ln -s /disk2/D data/D``): the saves that follow write its
    tensors again from the saved state (a WARNING names the link) instead of failing, never
    read through the link, and the newest step loads bitwise; the moved copy is untouched.
    (keep_last=4: step 3 may still refer to step 1's data, ``dedup_bound``; steps 1 and 2
    age out.)"""
    url = str(tmp_path / "run")
    model, opt = _model()
    mgr = CheckpointManager(url, model=model, optimizer=opt, keep_last=4)
    for step in (1, 2):
        train(model, opt, 1, seed=step)
        mgr.save(step)
    (first,) = [d for d in os.listdir(os.path.join(url, DATA)) if d.startswith("00000001-")]
    moved = str(tmp_path / "disk2" / first)
    shutil.move(os.path.join(url, DATA, first), moved)
    os.symlink(moved, os.path.join(url, DATA, first))
    before = _tree(moved)
    own = {}
    with caplog.at_level("WARNING", logger="muon_ckpt"):
        for step in (3, 4, 5, 6):
            train(model, opt, 1, seed=step)
            assert mgr.save(step)
            own[step] = _state(model, opt)
    mgr.close()
    assert f"behind the symbolic link {os.path.join(url, DATA, first)}" in caplog.text
    _loads(url, own)
    assert _tree(moved) == before
