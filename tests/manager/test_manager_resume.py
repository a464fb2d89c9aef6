"""Resume is exact: a run saved at step K on N ranks, loaded in fresh processes on M ranks and
continued to K+S, has bitwise the parameters and optimizer state of an uninterrupted run.

The uninterrupted reference is a single-process Muon on the full tensors (Muon's contract:
N ranks give bitwise the result of one process), run inside every resuming rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tests._dist import dist_device, eight_ranks_reason, run_on_ranks

K, S = 3, 2  # saved after K steps, continued for S more

# name -> (shape, placement, use_muon). Uneven shards: 10 rows on 3/4 ranks, 5 on 2/3/4.
SPECS = {
    "blocks.0.attn.w": ((12, 8), Shard(0), True),
    "blocks.0.mlp.w": ((10, 12), Shard(0), True),
    "blocks.1.attn.w": ((8, 6), Shard(1), True),
    "blocks.1.proj": ((4, 4), Replicate(), True),
    "blocks.0.norm.weight": ((12,), Shard(0), False),
    "blocks.1.bias": ((5,), Shard(0), False),
    "head.scale": ((3,), Replicate(), False),
}


def _module_with(params: dict[str, torch.Tensor]) -> nn.Module:
    """An nn.Module whose named_parameters() are exactly ``params`` (dotted FQNs)."""
    root = nn.Module()
    for fqn, t in params.items():
        mod = root
        *path, leaf = fqn.split(".")
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(t))
    return root


def full_values(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g) for n, (shape, _, _) in SPECS.items()}


def grads_at(step: int) -> dict[str, torch.Tensor]:
    return full_values(10_000 + step)


def build(mesh, seed: int):
    """(model, Muon with a Muon group and an AdamW group); DTensors when ``mesh`` is given."""
    from optim.muon import Muon

    dev = dist_device()
    vals = {n: t.to(dev) for n, t in full_values(seed).items()}
    if mesh is not None:
        vals = {n: distribute_tensor(t, mesh, [SPECS[n][1]]) for n, t in vals.items()}
    model = _module_with(vals)
    named = dict(model.named_parameters())
    muon = [n for n in SPECS if SPECS[n][2]]
    adamw = [n for n in SPECS if not SPECS[n][2]]
    opt = Muon(
        [
            {"params": [named[n] for n in muon], "lr": 0.02, "weight_decay": 0.01},
            {"params": [named[n] for n in adamw], "use_muon": False, "lr": 3e-3},
        ],
        chunk_size=2,
    )
    return model, opt


def train(model, opt, mesh, steps: range) -> None:
    dev = dist_device()
    named = dict(model.named_parameters())
    for s in steps:
        for n, g in grads_at(s).items():
            g = g.to(dev)
            named[n].grad = g if mesh is None else distribute_tensor(g, mesh, [SPECS[n][1]])
        opt.step()


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    """FQN-keyed full tensors of every parameter and optimizer state (on the CPU)."""
    named = dict(model.named_parameters())
    out = {f"param.{n}": _full(p.detach()).cpu().clone() for n, p in named.items()}
    for n, p in named.items():
        for k, v in opt.state.get(p, {}).items():
            out[f"state.{n}.{k}"] = _full(v).cpu().clone()
    return out


def assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ"
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (
            f"{what}: {k} differs (max abs diff "
            f"{(got[k].double() - want[k].double()).abs().max().item():.3e})"
        )


def _mesh(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        return None
    return init_device_mesh(dist_device().type, (world_size,))


def body_train_and_save(rank, world_size, url, storage_options, offload):
    from muon_ckpt import CheckpointManager
    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    mesh = _mesh(world_size)
    model, opt = build(mesh, seed=1)
    if offload:
        opt.turn_on_cpu_offload()
    train(model, opt, mesh, range(1, K + 1))
    mgr = CheckpointManager(url, model=model, optimizer=opt, storage_options=storage_options)
    assert mgr.save(K)
    assert opt.cpu_offload == offload, "save must restore the offload mode"
    steps = mgr.steps()
    mgr.close()
    return steps


def body_resume_and_compare(rank, world_size, jobs):
    """For each (url, storage_options, offload): fresh model, load step K, continue S steps;
    compare with the uninterrupted single-process reference at K and at K+S."""
    from muon_ckpt import CheckpointManager
    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    mesh = _mesh(world_size)
    ref_model, ref_opt = build(None, seed=1)
    train(ref_model, ref_opt, None, range(1, K + 1))
    at_k = snapshot(ref_model, ref_opt)
    train(ref_model, ref_opt, None, range(K + 1, K + S + 1))
    at_end = snapshot(ref_model, ref_opt)
    for url, storage_options, offload in jobs:
        model, opt = build(mesh, seed=2)  # different values: the load must overwrite them
        if offload:
            opt.turn_on_cpu_offload()
        with CheckpointManager(
            url, model=model, optimizer=opt, storage_options=storage_options
        ) as m:
            assert m.load() == K
        assert opt.cpu_offload == offload, "load must restore the offload mode"
        if offload:
            parked = [
                _local(st["momentum_buffer"]).untyped_storage().nbytes() == 0
                for st in opt.state.values()
                if "momentum_buffer" in st
            ]
            assert parked and all(parked), "states must be offloaded again after the load"
            opt.turn_off_cpu_offload()
        assert_bitwise(snapshot(model, opt), at_k, f"{url} right after load")
        if offload:
            opt.turn_on_cpu_offload()
        train(model, opt, mesh, range(K + 1, K + S + 1))
        if offload:
            opt.turn_off_cpu_offload()
        assert_bitwise(snapshot(model, opt), at_end, f"{url} after {S} more steps")
    return len(jobs)


def test_resume_is_exact_same_and_resharded_world_sizes(storage_url):
    """Local: 2->2, 2->3, 3->2, 2->1, 4->2, offload on and off on both sides. S3: 2->3.
    memory:// lives in one process only: save and resume in this process there."""
    url, opts = storage_url
    if url.startswith("memory://"):
        body_train_and_save(0, 1, url, opts, False)
        assert body_resume_and_compare(0, 1, [(url, opts, True)]) == 1
        return
    if url.startswith("s3://"):
        assert run_on_ranks(body_train_and_save, 2, url, opts, True)[0] == [K]
        assert run_on_ranks(body_resume_and_compare, 3, [(url, opts, False)]) == [1] * 3
        return
    urls = {n: f"{url}/saved_on_{n}" for n in (2, 3, 4)}
    assert run_on_ranks(body_train_and_save, 2, urls[2], None, True)[0] == [K]
    assert run_on_ranks(body_train_and_save, 3, urls[3], None, False)[0] == [K]
    assert run_on_ranks(body_train_and_save, 4, urls[4], None, True)[0] == [K]
    jobs_on_2 = [(urls[2], None, False), (urls[3], None, True), (urls[4], None, False)]
    assert run_on_ranks(body_resume_and_compare, 2, jobs_on_2) == [3, 3]
    assert run_on_ranks(body_resume_and_compare, 3, [(urls[2], None, True)]) == [1] * 3
    assert run_on_ranks(body_resume_and_compare, 1, [(urls[2], None, True)]) == [1]


@pytest.mark.skipif(eight_ranks_reason() is not None, reason=str(eight_ranks_reason()))
def test_resume_is_exact_saved_on_8_loaded_on_4_and_back(tmp_path):
    """8 -> 4 and 4 -> 8 (offload on one side each), and 8 -> 8."""
    on8, on4 = str(tmp_path / "on8"), str(tmp_path / "on4")
    assert run_on_ranks(body_train_and_save, 8, on8, None, True, timeout=600)[0] == [K]
    assert run_on_ranks(body_train_and_save, 4, on4, None, False, timeout=600)[0] == [K]
    assert run_on_ranks(body_resume_and_compare, 4, [(on8, None, False)], timeout=600) == [1] * 4
    jobs = [(on4, None, True), (on8, None, False)]
    assert run_on_ranks(body_resume_and_compare, 8, jobs, timeout=600) == [2] * 8


def test_torch_adamw_resumes_exactly_from_a_fresh_optimizer(storage_url):
    """Any torch optimizer: its state is created before the load (no reset, params unchanged)."""
    from muon_ckpt import CheckpointManager

    url, opts = storage_url

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def step(model, opt, s):
        g = torch.Generator().manual_seed(s)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()

    model, opt = make()
    for s in range(3):
        step(model, opt, s)
    CheckpointManager(url, model=model, optimizer=opt, storage_options=opts).save(3)
    for s in range(3, 5):
        step(model, opt, s)
    want = [p.detach().clone() for p in model.parameters()]

    model2, opt2 = make()
    with torch.no_grad():
        for p in model2.parameters():
            p.mul_(0.5)  # the load must overwrite parameters as well
    assert CheckpointManager(url, model=model2, optimizer=opt2, storage_options=opts).load() == 3
    assert all(float(st["step"]) == 3.0 for st in opt2.state.values())
    for s in range(3, 5):
        step(model2, opt2, s)
    for a, b in zip(want, model2.parameters(), strict=True):
        assert torch.equal(a, b)
    for p, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], opt2.state[p2][k]), k
