"""``offload.OffloadingOptimizer``: the protocol a checkpoint manager names for an optimizer
whose states may be offloaded. Muon satisfies it, with offload on or off; a plain torch
optimizer, or one with only some of its members, does not."""

from __future__ import annotations

import pytest
import torch

from offload import FrozenViews, OffloadingOptimizer
from optim import Muon


def _muon() -> Muon:
    w = torch.nn.Parameter(torch.randn(4, 3))
    b = torch.nn.Parameter(torch.randn(3))
    return Muon([{"params": [w]}, {"params": [b], "use_muon": False}])


def test_muon_is_an_offloading_optimizer_with_offload_on_or_off():
    opt = _muon()
    assert isinstance(opt, OffloadingOptimizer)
    opt.turn_on_cpu_offload()
    assert isinstance(opt, OffloadingOptimizer)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD, torch.optim.Muon])
def test_plain_torch_optimizer_is_not_an_offloading_optimizer(cls):
    opt = cls([torch.nn.Parameter(torch.randn(4, 3))], lr=0.01)
    assert not isinstance(opt, OffloadingOptimizer)


def test_an_optimizer_with_only_the_offload_flag_is_not_an_offloading_optimizer():
    class FlagOnly(torch.optim.SGD):
        cpu_offload = True  # no cpu_state_views(), no freeze_cpu_state()

    opt = FlagOnly([torch.nn.Parameter(torch.randn(2))], lr=0.1)
    assert not isinstance(opt, OffloadingOptimizer)


def test_the_protocol_gives_muon_states_views_and_snapshots():
    opt = _muon()
    w = opt.param_groups[0]["params"][0]
    w.grad = torch.ones_like(w)
    opt.param_groups[1]["params"][0].grad = torch.ones(3)
    opt.step()
    expected = opt.state[w]["momentum_buffer"].clone()
    opt.turn_on_cpu_offload()
    o: OffloadingOptimizer = opt
    assert o.cpu_offload is True
    views = o.cpu_state_views()
    assert torch.equal(views[id(opt.state[w]["momentum_buffer"])], expected)
    frozen = o.freeze_cpu_state()
    assert isinstance(frozen, FrozenViews)
    assert torch.equal(frozen.views[id(opt.state[w]["momentum_buffer"])], expected)
    frozen.release()


def test_the_pool_is_rebuilt_only_when_states_change():
    """Steps, views and snapshots with offload on leave the pool as it is (it was cleared,
    every state reloaded and parked again, at every step and every snapshot while the key it
    is matched by was overwritten by a state's name)."""
    opt = _muon()
    params = [p for g in opt.param_groups for p in g["params"]]
    opt.turn_on_cpu_offload()
    pool = opt._cpu_offload_pool
    cleared = []
    clear = pool.clear
    pool.clear = lambda: (cleared.append(1), clear())[1]

    def step():
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()

    step()  # the states are created: the pool tracks them (one rebuild)
    assert len(cleared) == 1
    for _ in range(3):
        step()
        opt.cpu_state_views()
        opt.freeze_cpu_state().release()
    assert len(cleared) == 1
