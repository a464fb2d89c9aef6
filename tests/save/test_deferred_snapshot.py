"""The deferred snapshot (``async_save="deferred"``): ``save()`` only queues the copies of
parameters and optimizer states and returns; the next ``optimizer.step()`` waits for them. The
checkpoint still holds the state of the ``save()`` call: saved at step k, then the next
forward, backward and step run at once, step k loads bitwise in fresh processes (1 and 2
ranks, plain and FSDP2, offload on and off, offload toggled before the next step); a parameter
written in place before the next step fails that save (never a silently wrong checkpoint) and
the previous step stays."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from muon_ckpt import CheckpointError, CheckpointManager
from tests._dist import dist_device, run_on_ranks
from tests.manager.test_manager_fsdp import VOCAB, build
from tests.save.test_async_save import DataPosition, assert_bitwise, state_of


def forward_backward_step(model, opt, s: int) -> None:
    g = torch.Generator().manual_seed(900 + s)
    tokens = torch.randint(0, VOCAB, (4, 6), generator=g).to(dist_device())
    model(tokens).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def save_then_train_at_once(url, opts, world, offload, step=2):
    model, opt = build(world)
    if offload:
        opt.turn_on_cpu_offload()
    for s in range(1, step + 1):
        forward_backward_step(model, opt, s)
    data = DataPosition(step)
    mgr = CheckpointManager(
        url,
        model=model,
        optimizer=opt,
        extra={"data": data},
        storage_options=opts,
        async_save="deferred",
    )
    want = state_of(model, opt, data)
    assert mgr.save(step)
    assert mgr._saves.pending is not None and mgr._saves.pending.spec.snap.deferred is not None
    for s in range(step + 1, step + 3):  # at once: the step waits for the copies
        forward_backward_step(model, opt, s)
    data.pos = 99
    assert mgr.wait() == step
    mgr.close()
    return want


def load_fresh(url, opts, world, offload, step=2):
    model, opt = build(world)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    if offload:
        opt.turn_on_cpu_offload()
    data = DataPosition(0)
    mgr = CheckpointManager(
        url, model=model, optimizer=opt, extra={"data": data}, storage_options=opts
    )
    assert mgr.load() == step
    got = state_of(model, opt, data)
    mgr.close()
    return got


def body_save(rank, world_size, base, fsdp):
    world = world_size if fsdp else None
    return {off: save_then_train_at_once(f"{base}/{off}", {}, world, off) for off in (False, True)}


def body_load(rank, world_size, base, fsdp):
    world = world_size if fsdp else None
    return {off: load_fresh(f"{base}/{off}", {}, world, off) for off in (False, True)}


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "plain"])
def test_deferred_save_holds_the_state_of_the_save_call_on_2_ranks(tmp_path, fsdp):
    base = str(tmp_path / "run")
    saved = run_on_ranks(body_save, 2, base, fsdp)
    loaded = run_on_ranks(body_load, 2, base, fsdp)
    for rank, (want, got) in enumerate(zip(saved, loaded, strict=True)):
        for off in (False, True):
            assert_bitwise(want[off], got[off], f"rank {rank}, offload {off}")


@pytest.mark.parametrize("offload", [False, True], ids=["offload-off", "offload-on"])
def test_deferred_save_holds_the_state_of_the_save_call_in_one_process(tmp_path, offload):
    url = str(tmp_path / "run")
    want = save_then_train_at_once(url, {}, None, offload)
    assert_bitwise(want, load_fresh(url, {}, None, offload), f"offload {offload}")


@pytest.mark.parametrize("offload", [False, True], ids=["turned-on", "turned-off"])
def test_toggling_offload_between_the_save_and_the_next_step_keeps_the_save(tmp_path, offload):
    # The toggle moves the states the copies read: it waits for them, as a step does, and a
    # move is no change of value. Turning offload on used to fail every later step (a parked
    # state's version read) and the save.
    url = str(tmp_path / "run")
    model, opt = build(None)
    if offload:
        opt.turn_on_cpu_offload()
    for s in (1, 2):
        forward_backward_step(model, opt, s)
    data = DataPosition(2)
    mgr = CheckpointManager(
        url, model=model, optimizer=opt, extra={"data": data}, async_save="deferred"
    )
    want = state_of(model, opt, data)
    assert mgr.save(2)
    (opt.turn_off_cpu_offload if offload else opt.turn_on_cpu_offload)()
    for s in (3, 4):
        forward_backward_step(model, opt, s)
    data.pos = 99
    assert mgr.wait() == 2
    mgr.close()
    assert_bitwise(want, load_fresh(url, {}, None, not offload), f"offload {offload} toggled")


def test_an_in_place_write_before_the_next_step_fails_that_save(tmp_path):
    url = str(tmp_path / "run")
    model, opt = build(None)
    forward_backward_step(model, opt, 1)
    mgr = CheckpointManager(url, model=model, optimizer=opt, async_save="deferred")
    assert mgr.save(1) and mgr.wait() == 1
    want = state_of(model, opt, DataPosition(0))
    forward_backward_step(model, opt, 2)
    assert mgr.save(2)
    with torch.no_grad():  # an EMA of the weights, written before the next step
        next(model.parameters()).mul_(0.999)
    forward_backward_step(model, opt, 3)
    with pytest.raises(CheckpointError, match=r"changed in place between save\(\) and the next"):
        mgr.wait()
    assert mgr.steps() == [1]
    model2, opt2 = build(None)
    mgr2 = CheckpointManager(url, model=model2, optimizer=opt2)
    assert mgr2.load() == 1
    assert_bitwise(want, state_of(model2, opt2, DataPosition(0)), "the previous step")


def test_buffers_that_the_next_forward_writes_are_copied_at_the_call(tmp_path):
    """BatchNorm's running statistics change in the next forward (not in a step): they are
    copied at the call, so the checkpoint holds their values then."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # another optimizer: its step hook
    model(torch.randn(16, 4)).sum().backward()
    opt.step()
    mgr = CheckpointManager(
        str(tmp_path / "run"), model=model, optimizer=opt, async_save="deferred"
    )
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert mgr.save(1)
    model(torch.randn(16, 4) * 3).sum().backward()  # running_mean/var change here
    opt.step()
    mgr.close()
    fresh = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert CheckpointManager(str(tmp_path / "run"), model=fresh, optimizer=opt2).load() == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_the_deferred_mode_is_refused_where_it_cannot_hold(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="needs the optimizer"):
        CheckpointManager(str(tmp_path / "b"), model=model, async_save="deferred")
    with pytest.raises(ValueError, match='async_save must be False, True or "deferred"'):
        CheckpointManager(str(tmp_path / "c"), model=model, async_save="lazy")
