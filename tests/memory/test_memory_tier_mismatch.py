"""A strict load of a memory-tier step that does not fit this job raises as a load from the url
does, on every rank, instead of loading an older step from storage (which the next save would
then retire): a step saved under other update rules, or by a model with a param renamed. The
step stays in the tier and loads once the job fits it again."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from muon_ckpt import CheckpointManager, CheckpointMismatchError, MemoryOptions
from optim import Muon


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 8))


def _muon(model, moved):
    """Muon on the matrices; ``moved``: the last matrix in the AdamW group instead."""
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    if moved:
        rest.append(mats.pop())
    return Muon([{"params": mats}, {"params": rest, "use_muon": False}])


def _step(model, opt):
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def _mgr(tmp_path, model, opt=None):
    """Every step to the tier only (the url gets what ``save(force=True)`` puts there)."""
    mem = MemoryOptions(interval=1, flush=False, dir=str(tmp_path / "mem"))
    return CheckpointManager(
        str(tmp_path / "run"), model=model, optimizer=opt, interval=1000, memory=mem
    )


def test_a_tier_step_under_other_update_rules_is_refused_not_rewound_past(tmp_path):
    """Step 1 (url and tier) under Muon for every matrix; a restart moves a matrix to AdamW
    (strict=False) and saves step 2 to the tier only; a restart with the old groups and a
    strict load() raises CheckpointMismatchError naming the param, and step 2 stays: the
    moved groups load it again."""
    m = _net()
    o = _muon(m, moved=False)
    with _mgr(tmp_path, m, o) as mgr:
        _step(m, o)
        mgr.save(1, force=True)
    m = _net()
    o = _muon(m, moved=True)
    with _mgr(tmp_path, m, o) as mgr:
        assert mgr.load(strict=False) == 1
        _step(m, o)
        mgr.save(2)
    m = _net()
    o = _muon(m, moved=False)
    with _mgr(tmp_path, m, o) as mgr, pytest.raises(CheckpointMismatchError, match=r"'1\.weight'"):
        mgr.load()
    m = _net()
    o = _muon(m, moved=True)
    with _mgr(tmp_path, m, o) as mgr:
        assert mgr.load() == 2
        assert mgr.last_load_tier == "memory"


class _Renamed(nn.Module):
    def __init__(self, second: str):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        setattr(self, second, nn.Linear(4, 4))


def test_a_tier_step_of_a_renamed_param_is_refused_not_rewound_past(tmp_path):
    """Step 1 (url and tier) with params a, b; a restart with b renamed (strict=False) saves
    step 2 to the tier only; a restart with a, b and a strict load() raises
    CheckpointMismatchError instead of loading step 1 from the url, and step 2 stays: the
    renamed model loads it."""
    with _mgr(tmp_path, _Renamed("b")) as mgr:
        mgr.save(1, force=True)
    with _mgr(tmp_path, _Renamed("renamed")) as mgr:
        assert mgr.load(strict=False) == 1
        mgr.save(2)
    with (
        _mgr(tmp_path, _Renamed("b")) as mgr,
        pytest.raises(CheckpointMismatchError, match="step 2"),
    ):
        mgr.load()
    with _mgr(tmp_path, _Renamed("renamed")) as mgr:
        assert mgr.load() == 2
        assert mgr.last_load_tier == "memory"
