"""Dedup never builds on bad bytes, as a property (muon_ckpt/save/_dedup.py, store/_confirm.py,
store/_catalog.py): random runs of saves of frozen and changing tensors, with bytes flipped in
and deletions of the run's data files, restarts, retention and ``prune``. Whatever happens,
every save that reports success after a damage committed a step that loads bitwise, and at
the end every committed step either loads bitwise (the state trained to its number) or is
refused by ``load()`` and ``verify`` alike.

Plain ``random`` with a fixed list of seeds (each case a few dozen saves and loads of a small
model on a local directory: a few seconds).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from muon_ckpt import CheckpointError, CheckpointManager
from muon_ckpt.store import DATA, Catalog, Storage, prune, resolve, verify
from tests._ckpt import flip_byte

SEEDS = [0, 1, 2, 3, 4, 5]
STEPS = 20
NAMES = ("a", "b", "c", "d")


class _State(nn.Module):
    """Four 64 x 64 fp32 tensors (16 KiB each: large enough to be referred to)."""

    def __init__(self) -> None:
        super().__init__()
        for n in NAMES:
            self.register_buffer(n, torch.zeros(64, 64))


def _copy(m: _State) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def _same(got: dict[str, torch.Tensor] | None, want: dict[str, torch.Tensor]) -> bool:
    """Bitwise the same state (None: a load that was refused)."""
    return (
        got is not None
        and got.keys() == want.keys()
        and all(torch.equal(got[k], want[k]) for k in want)
    )


def _load(url: str, step: int) -> dict[str, torch.Tensor] | None:
    """Step ``step`` as ``load(step=)`` reads it, or None when it refuses it."""
    m = _State()
    try:
        assert CheckpointManager(url, model=m).load(step=step) == step
    except CheckpointError:
        return None
    return _copy(m)


def _damage(rng: random.Random, st: Storage) -> str | None:
    """Flip one byte of a random data file of the run, or delete one."""
    files = sorted(st.walk_files(DATA).items())
    if not files:
        return None
    name, size = rng.choice(files)
    if size and rng.random() < 0.7:
        flip_byte(st.path(DATA, name), rng.randrange(size), 1 << rng.randrange(8))
        return f"flipped {name}"
    st.rm(DATA, name)
    return f"deleted {name}"


@pytest.mark.parametrize("seed", SEEDS)
def test_saves_after_damage_commit_steps_that_load_and_every_step_loads_or_is_refused(
    tmp_path, seed
):
    rng = random.Random(seed)
    url = str(tmp_path / "run")
    st = Storage(url)
    kw = {"keep_last": rng.choice([None, 2, 3]), "dedup_max_age": rng.choice([2, 3, 10])}
    trained: dict[int, dict[str, torch.Tensor]] = {}  # step -> the state saved as it
    g = torch.Generator().manual_seed(seed)
    m = _State()
    mgr = CheckpointManager(url, model=m, **kw)
    step, damaged, log = 0, False, [f"{kw}"]
    for _ in range(STEPS):
        step += 1
        for n in NAMES:  # each tensor changes at some steps only (frozen for a while)
            if rng.random() < 0.3:
                getattr(m, n).copy_(torch.randn(64, 64, generator=g))
        try:
            saved = mgr.save(step)
        except CheckpointError as e:
            saved = False
            log.append(f"save {step} failed: {e}")
        if saved:
            trained[step] = _copy(m)
            log.append(f"saved {step}")
            if damaged:  # the promise: what a save after a damage commits loads bitwise
                assert _same(_load(url, step), trained[step]), log
        if rng.random() < 0.35:
            what = _damage(rng, st)
            damaged = damaged or what is not None
            log.append(f"damage: {what}")
        if rng.random() < 0.2:  # a restart, after a prune now and then
            mgr.close()
            if rng.random() < 0.5:
                keep = rng.choice([1, 2])
                log.append(f"prune --keep {keep}: {prune(st, keep).deleted}")
            m = _State()
            mgr = CheckpointManager(url, model=m, **kw)
            try:
                got = mgr.load()
            except CheckpointError as e:  # no step loads: the run starts over
                log.append(f"load failed: {e}")
                mgr.close()
                mgr = CheckpointManager(url, model=m, new_run=True, **kw)
                got = None
            log.append(f"restart: loaded {got}")
            if got is not None:
                assert _same(_copy(m), trained[got]), log
            step = got or 0
    mgr.close()
    committed = Catalog(st).committed_steps()
    assert committed, log
    for s in committed:
        loaded = _load(url, s)
        ok = verify(resolve(st, s)).ok
        assert (loaded is not None) == ok, (s, log)
        if loaded is not None:
            assert _same(loaded, trained[s]), (s, log)
