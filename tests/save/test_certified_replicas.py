"""Certified replicas: under HSDP every shard is held by two ranks and written once; before the
commit the holders compare its checksum, so one replica's silent corruption (a bit flipped in
one rank's copy) refuses the save on every rank, naming the rank and the key, nothing
committed, the previous step still the newest. 20 trials on 4 gloo ranks (HSDP 2x2), each
flipping one bit of one parameter's shard, or of its optimizer state (offloaded), on one
rank, synchronous and asynchronous saves."""

from __future__ import annotations

import os
import random

import torch

from tests._dist import run_on_ranks
from tests.optim._meshes import build, groups

TRIALS = 20


def _target(opt, params, name, trial):
    """What trial ``trial`` flips a bit of: the param (even trials) or its first state of
    more than one element (odd: Muon's momentum, AdamW's first moment), and its key."""
    p = params[name]
    if trial % 2 == 0:
        return p.detach(), f"model.{name}"
    st = opt.cpu_state(p)  # (offloaded: the pinned host copy the next step reads)
    key = sorted(k for k, v in st.items() if v.dim() > 0)[0]
    return st[key], f"optim.state.{name}.{key}"


def _flip(t, trial: int) -> None:
    """Flip one bit of this rank's shard of ``t`` (again: flips it back)."""
    local = t.to_local()
    pick = random.Random(trial)
    words = local.view(torch.int32).view(-1)
    i, bit = pick.randrange(words.numel()), pick.randrange(31)
    with torch.no_grad():
        words[i] ^= 1 << bit


def body_flipped_bits(rank, world_size, root):
    from muon_ckpt import CheckpointError, CheckpointManager
    from optim import Muon

    model = build("hsdp2x2")
    params = dict(model.named_parameters())
    opt = Muon(groups(model))
    opt.turn_on_cpu_offload()
    for p in params.values():
        p.grad = torch.ones_like(p)
    opt.step()  # (states to flip)
    out = []
    for background in (False, True):
        url = os.path.join(root, f"async-{background}")
        with CheckpointManager(
            url, model=model, optimizer=opt, async_save=background, certify_replicas=True
        ) as mgr:
            mgr.save(1)
            mgr.wait()
            for trial in range(TRIALS // 2):
                choose = random.Random(1000 * background + trial)  # (the same on every rank)
                victim, name = choose.randrange(world_size), choose.choice(sorted(params))
                t, key = _target(opt, params, name, trial)
                if rank == victim:
                    _flip(t, trial)
                error = None
                try:
                    mgr.save(2 + trial)
                    mgr.wait()
                except CheckpointError as e:
                    error = str(e)
                if rank == victim:
                    _flip(t, trial)
                out.append((victim, key, error, mgr.steps()))
            mgr.save(50)  # the replicas agree again: committed
            mgr.wait()
            out.append((None, None, None, mgr.steps()))
    return out


def test_one_flipped_bit_in_one_replica_refuses_the_save_on_every_rank(tmp_path):
    results = run_on_ranks(body_flipped_bits, 4, str(tmp_path), timeout=900)
    for got in results:
        assert len(got) == TRIALS + 2
        for victim, key, error, steps in got:
            if victim is None:
                assert steps == [1, 50]
                continue
            assert error is not None, (victim, key)
            assert f"'{key}'" in error and f"rank {victim}: " in error, error
            assert "replicas of 1 replicated shard(s) differ" in error, error
            assert "is not committed" in error, error
            assert steps == [1], (victim, key, steps)


def body_tp_slice(rank, world_size, root):
    """FSDP x TP 2x2 with real forwards and backwards: a healthy save commits; a bit flipped
    in one tp rank's copy of a param TP leaves alone (``proj``: sharded over the dp slice,
    each tp rank holding the same shards), or of its optimizer state, refuses the save."""
    from muon_ckpt import CheckpointError, CheckpointManager
    from optim import Muon
    from tests.optim._mesh_train_job import DIMS, forward_backward

    model = build("tp2xfsdp2", DIMS)
    params = dict(model.named_parameters())
    opt = Muon(groups(model))
    out = []
    with CheckpointManager(root, model=model, optimizer=opt, certify_replicas=True) as mgr:
        for step in (1, 2):
            forward_backward(model, step, step)
            opt.step()
            opt.zero_grad()
        mgr.save(1)
        for trial, victim in ((0, 1), (1, 2)):
            t, key = _target(opt, params, "proj.weight", trial)
            if rank == victim:
                _flip(t, trial)
            error = None
            try:
                mgr.save(2 + trial)
            except CheckpointError as e:
                error = str(e)
            if rank == victim:
                _flip(t, trial)
            out.append((victim, key, error))
        return out, mgr.steps()


def test_a_flipped_bit_in_one_tp_ranks_copy_of_a_dp_sliced_param_refuses_the_save(tmp_path):
    results = run_on_ranks(body_tp_slice, 4, str(tmp_path / "run"), timeout=600)
    for got, steps in results:
        assert steps == [1], steps  # (the healthy save committed, neither flipped one)
        for victim, key, error in got:
            assert error is not None, (victim, key)
            assert f"'{key}'" in error and f"rank {victim}: " in error, error
