"""The eight behaviours of the seed offload test (tests/gpu/test_cpu_offload.py), on N ranks.

Runs on CPU/gloo in CI (world sizes 2 and 3, uneven shards on 3; and 2-D meshes of 4 ranks:
HSDP's replicate x shard, and rows x columns) and unchanged on CUDA/NCCL.
All eight behaviours run in one set of processes per world size (process start-up dominates on
2 cores); each behaviour reports its own result and has its own test below.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tests._dist import dist_device, run_on_ranks

BEHAVIOURS = [
    "correctness",
    "storage_freed",
    "adamw_offload",
    "memory_savings",
    "toggle",
    "leak",
    "state_dict_save_load",
    "checkpoint_guards",
]


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def _muon_group(params, **kw):
    g = {
        "params": params,
        "names": [f"layer.{i}.weight" for i in range(len(params))],
        "use_muon": True,
        "lr": 0.02,
        "weight_decay": 0.01,
        "momentum": 0.95,
        "nesterov": True,
        "ns_steps": 5,
        "none_grad": False,
    }
    g.update(kw)
    return g


class _Ctx:
    def __init__(self, mesh, dev, placements):
        self.mesh, self.dev, self.placements = mesh, dev, placements

    def shard(self, t):
        # (a vector is replicated where a matrix is split along its columns)
        pls = [
            Replicate() if isinstance(p, Shard) and p.dim >= t.ndim else p for p in self.placements
        ]
        return distribute_tensor(t.clone(), self.mesh, pls)

    def params(self, fulls):
        return [torch.nn.Parameter(self.shard(t)) for t in fulls]

    def randn(self, *shape, g):
        return torch.randn(*shape, generator=g).to(self.dev)


def _make(ctx, muon_init, adamw_init=(), offload=False):
    from optim.muon import Muon

    mp = ctx.params(muon_init)
    ap = ctx.params(adamw_init)
    groups = [_muon_group(mp, adamw_betas=(0.9, 0.95), adamw_eps=1e-8)]
    if ap:
        groups.append(
            {
                "params": ap,
                "use_muon": False,
                "lr": 1e-3,
                "weight_decay": 0.01,
                "adamw_betas": (0.9, 0.95),
                "adamw_eps": 1e-8,
            }
        )
    opt = Muon(params=groups, chunk_size=2, warmup_step=1)
    if offload:
        opt.turn_on_cpu_offload()
    return opt, mp, ap


def _set_grads(ctx, params, grads):
    for p, g in zip(params, grads):
        p.grad = ctx.shard(g)


def _assert_params_equal(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.data.full_tensor(), y.data.full_tensor(), atol=0, rtol=0)


def _state_storage_bytes(opt, keys=("momentum_buffer", "moment1", "moment2")):
    return sum(
        _local(st[k]).untyped_storage().size() for st in opt.state.values() for k in keys if k in st
    )


# Rows: 10 on 3 ranks gives uneven shards (4/4/2); 64 on 2 or 3 ranks also splits unevenly on 3.
def b_correctness(ctx, g):
    init = [ctx.randn(10, 24, g=g) for _ in range(4)]
    grads = [[ctx.randn(10, 24, g=g) for _ in range(4)] for _ in range(3)]
    ref, pr, _ = _make(ctx, init)
    off, po, _ = _make(ctx, init, offload=True)
    for step in grads:
        _set_grads(ctx, pr, step)
        _set_grads(ctx, po, step)
        ref.step()
        off.step()
        _assert_params_equal(pr, po)


def b_storage_freed(ctx, g):
    init = [ctx.randn(64, 32, g=g) for _ in range(8)]
    opt, ps, _ = _make(ctx, init, offload=True)
    for _ in range(2):
        _set_grads(ctx, ps, [ctx.randn(64, 32, g=g) for _ in range(8)])
        opt.step()
        for p in ps:
            assert _local(opt.state[p]["momentum_buffer"]).untyped_storage().size() == 0
    pool = opt._cpu_offload_pool
    assert len(pool._managed) == 8
    for grp in pool._groups.values():
        assert grp["cpu_flat"].is_pinned() == (ctx.dev.type == "cuda")
        assert grp["cpu_flat"].numel() >= sum(_local(p).numel() for p in ps)


def b_adamw_offload(ctx, g):
    minit = [ctx.randn(10, 24, g=g) for _ in range(4)]
    ainit = [ctx.randn(24, g=g) for _ in range(3)]
    ref, mr, ar = _make(ctx, minit, ainit)
    off, mo, ao = _make(ctx, minit, ainit, offload=True)
    for _ in range(3):
        gm = [ctx.randn(10, 24, g=g) for _ in range(4)]
        ga = [ctx.randn(24, g=g) for _ in range(3)]
        for ps_m, ps_a in ((mr, ar), (mo, ao)):
            _set_grads(ctx, ps_m, gm)
            _set_grads(ctx, ps_a, ga)
        ref.step()
        off.step()
        _assert_params_equal(mr + ar, mo + ao)
    for p in ao:
        for key in ("moment1", "moment2"):
            assert _local(off.state[p][key]).untyped_storage().size() == 0, key


def b_memory_savings(ctx, g):
    init = [ctx.randn(64, 32, g=g) for _ in range(8)]
    grads = [ctx.randn(64, 32, g=g) for _ in range(8)]
    held = {}
    for offload in (False, True):
        opt, ps, _ = _make(ctx, init, offload=offload)
        _set_grads(ctx, ps, grads)
        opt.step()
        held[offload] = (_state_storage_bytes(opt), opt._cpu_offload_pool.device_nbytes())
    expected = sum(t.numel() for t in init) * 4 // dist.get_world_size()
    assert held[False][0] >= expected * 0.9, held
    assert held[True] == (0, 0), held


def b_toggle(ctx, g):
    init = [ctx.randn(10, 24, g=g) for _ in range(4)]
    ref, pr, _ = _make(ctx, init)
    tog, pt, _ = _make(ctx, init)
    for step in range(6):
        want_on = (step // 2) % 2 == 0
        if want_on and not tog.cpu_offload:
            tog.turn_on_cpu_offload()
        elif not want_on and tog.cpu_offload:
            tog.turn_off_cpu_offload()
        grads = [ctx.randn(10, 24, g=g) for _ in range(4)]
        _set_grads(ctx, pr, grads)
        _set_grads(ctx, pt, grads)
        ref.step()
        tog.step()
        _assert_params_equal(pr, pt)
    # Twice in a row is a no-op either way.
    tog.turn_on_cpu_offload()
    tog.turn_on_cpu_offload()
    tog.turn_off_cpu_offload()
    tog.turn_off_cpu_offload()
    assert _state_storage_bytes(tog) > 0


def _rss_mb():
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def b_leak(ctx, g):
    init = [ctx.randn(64, 64, g=g) for _ in range(8)]
    ainit = [ctx.randn(64, g=g) for _ in range(2)]
    opt, ps, aps = _make(ctx, init, ainit, offload=True)
    pool = opt._cpu_offload_pool
    grads = [ctx.randn(64, 64, g=g) for _ in range(8)]
    agrads = [ctx.randn(64, g=g) for _ in range(2)]
    base = None
    for step in range(50):
        _set_grads(ctx, ps, grads)
        _set_grads(ctx, aps, agrads)
        opt.step()
        if step == 2:
            base = (_rss_mb(), pool.cpu_nbytes(), len(pool._managed), len(pool._groups))
    final = (_rss_mb(), pool.cpu_nbytes(), len(pool._managed), len(pool._groups))
    assert final[0] - base[0] < 50, f"RSS grew {final[0] - base[0]:.1f} MB over 47 steps"
    assert final[1:] == base[1:], f"tracked buffers grew: {base[1:]} -> {final[1:]}"
    assert pool.device_nbytes() == 0


def b_state_dict_save_load(ctx, g):
    import torch.distributed.checkpoint as dcp

    minit = [ctx.randn(10, 24, g=g) for _ in range(4)]
    ainit = [ctx.randn(24, g=g) for _ in range(3)]
    gm = [[ctx.randn(10, 24, g=g) for _ in range(4)] for _ in range(6)]
    ga = [[ctx.randn(24, g=g) for _ in range(3)] for _ in range(6)]
    opt, mo, ao = _make(ctx, minit, ainit, offload=True)
    for s in range(3):
        _set_grads(ctx, mo, gm[s])
        _set_grads(ctx, ao, ga[s])
        opt.step()
    with pytest.raises(RuntimeError, match=r"turn_off_cpu_offload\(\) before checkpoint save"):
        opt.state_dict()
    opt.turn_off_cpu_offload()
    sd = opt.state_dict()
    for st in sd["state"].values():
        for key, val in st.items():
            if val.is_floating_point():
                assert _local(val).untyped_storage().size() > 0, key
    flat = {f"state.{i}.{k}": v for i, st in sd["state"].items() for k, v in st.items()}
    ckpt = [tempfile.mkdtemp(prefix="offload_dcp_") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(ckpt, src=0)
    try:
        dcp.save(flat, checkpoint_id=ckpt[0])
        ref, mr, ar = _make(ctx, minit, ainit, offload=True)
        res, ms, as_ = _make(ctx, minit, ainit, offload=True)
        for dst_m, dst_a in ((mr, ar), (ms, as_)):
            for d, s in zip(dst_m + dst_a, mo + ao):
                d.data = s.data.clone()
        with pytest.raises(RuntimeError, match=r"turn_off_cpu_offload\(\) before checkpoint load"):
            ref.load_state_dict(copy.deepcopy(sd))
        ref.turn_off_cpu_offload()
        ref.load_state_dict(copy.deepcopy(sd))
        ref.turn_on_cpu_offload()
        target = {k: torch.zeros_like(v) for k, v in flat.items()}
        dcp.load(target, checkpoint_id=ckpt[0])
        loaded = copy.deepcopy(sd)
        for i, st in loaded["state"].items():
            for k in st:
                st[k] = target[f"state.{i}.{k}"]
        res.turn_off_cpu_offload()
        res.load_state_dict(loaded)
        res.turn_on_cpu_offload()
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(ckpt[0], ignore_errors=True)
    for s in range(3, 6):
        for ps_m, ps_a in ((mr, ar), (ms, as_)):
            _set_grads(ctx, ps_m, gm[s])
            _set_grads(ctx, ps_a, ga[s])
        ref.step()
        res.step()
    _assert_params_equal(mr + ar, ms + as_)
    for p in ms:
        assert _local(res.state[p]["momentum_buffer"]).untyped_storage().size() == 0


def b_checkpoint_guards(ctx, g):
    init = [ctx.randn(64, 32, g=g) for _ in range(8)]
    opt, ps, _ = _make(ctx, init, offload=True)
    _set_grads(ctx, ps, [ctx.randn(64, 32, g=g) for _ in range(8)])
    opt.step()
    pool = opt._cpu_offload_pool
    state_bytes = sum(pool._storage_nbytes[id(opt.state[p]["momentum_buffer"])] for p in ps)
    assert state_bytes == sum(_local(p).numel() * 4 for p in ps)
    with pytest.raises(RuntimeError, match=r"turn_off_cpu_offload\(\) before checkpoint save"):
        opt.state_dict()
    opt.turn_off_cpu_offload()
    assert _state_storage_bytes(opt) > 0 and pool.device_nbytes() == state_bytes
    sd = copy.deepcopy(opt.state_dict())
    opt.turn_on_cpu_offload()
    assert _state_storage_bytes(opt) == 0
    _set_grads(ctx, ps, [ctx.randn(64, 32, g=g) for _ in range(8)])
    opt.step()
    assert _state_storage_bytes(opt) == 0
    with pytest.raises(RuntimeError, match=r"turn_off_cpu_offload\(\) before checkpoint load"):
        opt.load_state_dict(copy.deepcopy(sd))
    opt.turn_off_cpu_offload()
    opt.load_state_dict(sd)
    assert _state_storage_bytes(opt) > 0, "loaded state must stay on the device while off"
    opt.turn_on_cpu_offload()
    assert pool._initialized
    assert len(pool._managed) == len(ps)
    assert all(pool.is_tracked(opt.state[p]["momentum_buffer"]) for p in ps)
    _set_grads(ctx, ps, [ctx.randn(64, 32, g=g) for _ in range(8)])
    opt.step()
    assert _state_storage_bytes(opt) == 0


# name -> (mesh shape, the placements of a matrix on it)
MESHES = {
    "ws1": ((1,), [Shard(0)]),
    "ws2": ((2,), [Shard(0)]),
    "ws3": ((3,), [Shard(0)]),
    "hsdp2x2": ((2, 2), [Replicate(), Shard(0)]),
    "rows-x-cols2x2": ((2, 2), [Shard(0), Shard(1)]),
}


def body_all_behaviours(rank, world_size, layout):
    from torch.distributed.device_mesh import init_device_mesh

    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    dev = dist_device()
    shape, placements = MESHES[layout]
    ctx = _Ctx(init_device_mesh(dev.type, shape), dev, placements)
    results = {}
    for name in BEHAVIOURS:
        g = torch.Generator().manual_seed(42)
        try:
            globals()[f"b_{name}"](ctx, g)
        except Exception as e:
            # Peers may now wait in a collective: fail this rank at once (the harness stops
            # the others and shows this traceback) rather than hang until the timeout.
            raise RuntimeError(f"behaviour {name!r} failed on rank {rank}") from e
        results[name] = "passed"
        dist.barrier()
    return results


@pytest.fixture(scope="module", params=list(MESHES))
def outcomes(request):
    world = torch.Size(MESHES[request.param][0]).numel()
    return run_on_ranks(body_all_behaviours, world, request.param, timeout=150)


@pytest.mark.parametrize("behaviour", BEHAVIOURS)
def test_offload_behaviour(outcomes, behaviour):
    # A behaviour that raised failed the whole run (the fixture raises with its traceback);
    # here every rank must have run this one to the end.
    got = [res.get(behaviour) for res in outcomes]
    assert got == ["passed"] * len(outcomes), f"{behaviour}: per rank {got}"
