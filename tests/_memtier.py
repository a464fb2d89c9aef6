"""A memory-tier run in one process, for the tier's tests: a small Muon setup, a manager
whose every step goes to the tier (every 5th to the url), and bitwise comparisons."""

from __future__ import annotations

import torch

from muon_ckpt import CheckpointManager
from tests._ckpt import TinyNet, make_muon, muon_state_sd, offload_off

__all__ = ["_assert_same", "_fresh", "_load_fresh", "_mgr", "_run_dir", "_saved", "_state"]


def _fresh(seed=0, offload=False):
    torch.manual_seed(seed)
    model = TinyNet(vocab=64, dim=16)
    opt = make_muon(model)
    if offload:
        opt.turn_on_cpu_offload()
    return model, opt


def _mgr(tmp_path, model, opt, **kw):
    kw.setdefault("interval", 5)
    kw.setdefault("memory_interval", 1)
    kw.setdefault("memory_dir", str(tmp_path / "mem"))
    return CheckpointManager(str(tmp_path / "run"), model=model, optimizer=opt, **kw)


def _state(model, opt):
    return offload_off(opt, lambda: muon_state_sd(model, opt))


def _assert_same(want, got):
    assert want.keys() == got.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v.view(-1).view(torch.uint8), got[k].view(-1).view(torch.uint8)), k
        else:
            assert v == got[k], k


def _run_dir(tmp_path, node=None):
    base = tmp_path / "mem" if node is None else tmp_path / "mem" / f"node{node}"
    (run,) = [p for p in base.iterdir() if p.name.startswith("run-")]
    return run


def _saved(tmp_path, steps, **kw):
    """A run that saves ``steps`` (each waited for) and closes, flushing nothing."""
    model, opt = _fresh()
    mgr = _mgr(tmp_path, model, opt, **kw)
    mgr.load()
    for s in steps:
        mgr.save(s)
        mgr.wait()
    mgr._memory.mark = None
    mgr.close()


def _load_fresh(tmp_path, seed=1, offload=False, **kw):
    model, opt = _fresh(seed, offload)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    mgr = _mgr(tmp_path, model, opt, **kw)
    step = mgr.load()
    tier = mgr.last_load_tier
    mgr._memory.mark = None  # (nothing to flush: this manager saved nothing)
    mgr.close()
    return step, tier, _state(model, opt)
