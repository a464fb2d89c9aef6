"""The offload pool's snapshots and tensors made offloaded (CPU, same bookkeeping as on CUDA):
``freeze()`` keeps its views unchanged until ``release()`` whatever the pool does meanwhile,
every tracked tensor keeps its value through any sequence of moves, and a fresh Muon with
offload on gets its states without device memory."""

from __future__ import annotations

import random

import pytest
import torch

from offload import CPUOffloadPool


class _Model:
    """Tracked tensors and what each must hold (the reference), driven by random operations."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.pool = CPUOffloadPool(pin_memory=False)
        self.tensors: list[tuple[torch.Tensor, int]] = []
        self.truth: dict[int, torch.Tensor] = {}
        self.frozen = None
        self.frozen_values: dict[int, torch.Tensor] = {}
        self.buckets = self.rng.randint(1, 4)
        cold = self.rng.random() < 0.5
        for b in range(self.buckets):
            for _ in range(self.rng.randint(1, 3)):
                self.add(b, cold)
        self.pool.offload()

    def add(self, bucket: int, cold: bool) -> None:
        dtype = self.rng.choice([torch.float32, torch.bfloat16])
        shape = (self.rng.randint(1, 5), self.rng.randint(1, 4))
        if cold:
            t = self.pool.new_offloaded(torch.empty(shape, dtype=dtype), bucket)
            self.truth[id(t)] = torch.zeros(shape, dtype=dtype)
        else:
            t = torch.randn(shape, generator=torch.Generator().manual_seed(len(self.truth)))
            t = t.to(dtype)
            self.truth[id(t)] = t.clone()
            self.pool.track(t, bucket)
        self.tensors.append((t, bucket))

    def op(self, name: str) -> None:
        pool, b = self.pool, self.rng.randrange(self.buckets)
        if name == "step":  # what an optimizer step does to one bucket
            pool.reload(b)
            pool.wait_reload(b)
            for t, bb in self.tensors:
                if bb == b:
                    t.add_(1)
                    self.truth[id(t)] += 1
            pool.offload(b)
        elif name == "reload":
            pool.reload(b)
        elif name == "offload":
            pool.offload(b)
        elif name == "all_home":  # turn_off_cpu_offload
            pool.reload()
            pool.synchronize()
        elif name == "all_away":  # turn_on_cpu_offload
            pool.offload()
        elif name == "freeze" and self.frozen is None:
            pool.offload()  # as between steps with offload on
            self.frozen = pool.freeze()
            self.frozen_values = {k: v.clone() for k, v in self.frozen.views.items()}
            for t, _ in self.tensors:
                assert torch.equal(self.frozen.views[id(t)], self.truth[id(t)])
        elif name == "release" and self.frozen is not None:
            self.frozen.release()
            self.frozen = None
        elif name == "write_host":  # a load into the host views
            views = pool.host_views()
            for t, _ in self.tensors:
                if id(t) in views:
                    views[id(t)].fill_(7)
                    self.truth[id(t)].fill_(7)
        elif name == "grow":  # a tensor added to a laid-out pool: re-layout
            self.add(b, cold=False)
        elif name == "cpu_views":
            views = pool.cpu_views()
            for t, _ in self.tensors:
                assert torch.equal(views[id(t)], self.truth[id(t)])

    def check(self) -> None:
        if self.frozen is not None:
            for k, v in self.frozen.views.items():
                assert torch.equal(v, self.frozen_values[k]), "a frozen view changed"
        views = self.pool.cpu_views()  # brings nothing home; reads where the bytes are
        for t, _ in self.tensors:
            assert torch.equal(views[id(t)], self.truth[id(t)])


OPS = ["step"] * 4 + ["reload", "offload", "all_home", "all_away", "freeze", "release"]
OPS += ["write_host", "grow", "cpu_views"]


@pytest.mark.parametrize("seed", range(40))
def test_random_moves_keep_values_and_frozen_snapshots(seed):
    m = _Model(seed)
    for _ in range(120):
        m.op(m.rng.choice(OPS))
        m.check()
    if m.frozen is not None:
        m.frozen.release()
    m.check()


def test_one_freeze_at_a_time_and_release_only_what_it_froze():
    pool = CPUOffloadPool(pin_memory=False)
    t = torch.ones(4)
    pool.track(t, 0)
    pool.offload()
    first = pool.freeze()
    with pytest.raises(RuntimeError, match=r"still held.*one at a time"):
        pool.freeze()
    first.release()
    first.release()  # idempotent
    second = pool.freeze()
    assert torch.equal(second.views[id(t)], torch.ones(4))
    second.release()


def test_host_views_while_frozen_never_change_the_snapshot():
    pool = CPUOffloadPool(pin_memory=False)
    t = torch.arange(6.0)
    pool.track(t, 0)
    pool.offload()
    frozen = pool.freeze()
    pool.host_views()[id(t)].fill_(-1)  # e.g. a load while a save is being written
    assert torch.equal(frozen.views[id(t)], torch.arange(6.0))
    frozen.release()
    pool.reload()
    assert torch.equal(t, torch.full((6,), -1.0))


def test_a_fresh_muon_with_offload_on_creates_its_states_offloaded():
    from optim import Muon

    ps = [torch.nn.Parameter(torch.randn(8, 4)) for _ in range(3)] + [
        torch.nn.Parameter(torch.randn(4))
    ]
    opt = Muon([{"params": ps[:3]}, {"params": ps[3:], "use_muon": False}], chunk_size=2)
    opt.turn_on_cpu_offload()
    opt.init_state()
    states = [t for st in opt.state.values() for k, t in st.items() if k != "step"]
    assert len(states) == 5 and all(t.untyped_storage().nbytes() == 0 for t in states)
    assert opt._cpu_offload_pool.device_nbytes() == 0
    views = opt.cpu_state_views()
    assert set(views) == {id(t) for t in states}
    assert all(torch.count_nonzero(v) == 0 for v in views.values())
    with pytest.raises(RuntimeError, match="needs CPU offload on"):
        Muon(ps[:1]).cpu_state_views()
