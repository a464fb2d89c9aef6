"""A memory-tier run in one process, for the tier's tests: a small Muon setup, a manager
whose every step goes to the tier (every 5th to the url), and bitwise comparisons; a data
position and RNG (``Position``, for ``extra`` and ``rank_extra``) and a job that moves on
after its last save without an optimizer step (``moved_on``)."""

from __future__ import annotations

import torch

from muon_ckpt import CheckpointManager, MemoryOptions
from tests._ckpt import TinyNet, make_muon, muon_state_sd, offload_off, train

__all__ = [
    "Position",
    "_assert_same",
    "_fresh",
    "_load_fresh",
    "_memory",
    "_memory_at",
    "_mgr",
    "_run_dir",
    "_saved",
    "_state",
    "assert_same_nested",
    "everything",
    "moved_on",
    "train_and_save",
]


def _fresh(seed=0, offload=False):
    torch.manual_seed(seed)
    model = TinyNet(vocab=64, dim=16)
    opt = make_muon(model)
    if offload:
        opt.turn_on_cpu_offload()
    return model, opt


def _memory(tmp_path, **fields):
    """The tier of these tests: every step, in ``tmp_path / "mem"``, unless ``fields`` say."""
    return _memory_at(str(tmp_path / "mem"), **fields)


def _memory_at(path, **fields):
    return MemoryOptions(**{"interval": 1, "dir": str(path), **fields})


def _mgr(tmp_path, model, opt, **kw):
    kw.setdefault("interval", 5)
    kw.setdefault("memory", _memory(tmp_path))
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
    mgr._saves.memory.mark = None
    mgr.close()


def _load_fresh(tmp_path, seed=1, offload=False, **kw):
    model, opt = _fresh(seed, offload)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    mgr = _mgr(tmp_path, model, opt, **kw)
    step = mgr.load()
    tier = mgr.last_load_tier
    mgr._saves.memory.mark = None  # (nothing to flush: this manager saved nothing)
    mgr.close()
    return step, tier, _state(model, opt)


class Position:
    """A data loader's position and its RNG: what gradient accumulation moves on between
    optimizer steps (an ``extra`` or ``rank_extra`` object)."""

    def __init__(self, seed):
        self.pos = 0
        self.gen = torch.Generator().manual_seed(seed)

    def advance(self, batches):
        self.pos += batches
        torch.randn(batches, generator=self.gen)

    def state_dict(self):
        return {"pos": self.pos, "rng": self.gen.get_state()}

    def load_state_dict(self, sd):
        self.pos = sd["pos"]
        self.gen.set_state(sd["rng"])


def train_and_save(mgr, model, opt, data, rng, steps, micro=4):
    """Each step: ``micro`` batches drawn, one optimizer step, ``save(step)`` waited for."""
    for s in steps:
        data.advance(micro)
        rng.advance(micro)
        train(model, opt, 1, seed=s)
        mgr.save(s)
        mgr.wait()


def everything(model, opt, data, rng):
    """What a step holds: model, optimizer, extra and rank_extra (copies)."""
    return {
        "state": _state(model, opt),
        "data": {k: v.clone() if torch.is_tensor(v) else v for k, v in data.state_dict().items()},
        "rng": {k: v.clone() if torch.is_tensor(v) else v for k, v in rng.state_dict().items()},
    }


def moved_on(model, data, rng):
    """A job in the middle of its next step: 3 micro-batches drawn (no optimizer step yet),
    and EMA weights swapped in for an evaluation."""
    data.advance(3)
    rng.advance(3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)


def assert_same_nested(want, got, where=""):
    """Bitwise equality of nested dicts of tensors and plain values."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and want.keys() == got.keys(), (where, want.keys(), got)
        for k in want:
            assert_same_nested(want[k], got[k], f"{where}.{k}")
    elif isinstance(want, torch.Tensor):
        a, b = want.reshape(-1).view(torch.uint8), got.reshape(-1).view(torch.uint8)
        assert want.dtype == got.dtype and torch.equal(a, b), where
    else:
        assert want == got, (where, want, got)
