"""GPU: a CheckpointManager save/load round trip with CPU offload on (NCCL, world size 1).

    python3 -m pytest tests/gpu/test_checkpoint_gpu.py     (needs a CUDA device)

Train 3 steps with offload on, save, go on 2 steps (reference). A fresh model + fresh Muon with
offload on loads the checkpoint and runs the same 2 steps: parameters and states must be
bitwise equal, the states must be offloaded again after the load, and the load must not leave
optimizer state on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tests._dist import run_on_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = {"attn.w": (256, 128), "mlp.w": (512, 256), "mlp.v": (256, 512), "norm.weight": (256,)}


def _build(mesh, seed):
    from optim.muon import Muon

    g = torch.Generator().manual_seed(seed)
    model = nn.Module()
    for name, shape in SHAPES.items():
        sub, leaf = name.split(".")
        if not hasattr(model, sub):
            model.add_module(sub, nn.Module())
        t = distribute_tensor(torch.randn(shape, generator=g).cuda(), mesh, [Shard(0)])
        getattr(model, sub).register_parameter(leaf, nn.Parameter(t))
    named = list(model.named_parameters())
    opt = Muon(
        [
            {"params": [p for n, p in named if p.ndim == 2], "lr": 0.02, "weight_decay": 0.01},
            {"params": [p for n, p in named if p.ndim < 2], "use_muon": False, "lr": 1e-3},
        ],
        chunk_size=2,
    )
    opt.turn_on_cpu_offload()
    return model, opt


def _grads(model, mesh, step):
    g = torch.Generator().manual_seed(1000 + step)
    for _, p in model.named_parameters():
        p.grad = distribute_tensor(torch.randn(p.shape, generator=g).cuda(), mesh, [Shard(0)])


def _state_bytes_on_gpu(opt):
    return sum(
        (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage().size()
        for st in opt.state.values()
        for k, t in st.items()
        if k != "step"
    )


def body_round_trip(rank, world_size, url):
    from torch.distributed.device_mesh import init_device_mesh

    from muon_ckpt import CheckpointManager

    mesh = init_device_mesh("cuda", (world_size,))
    model, opt = _build(mesh, 0)
    with CheckpointManager(url, model=model, optimizer=opt) as mgr:
        for step in range(1, 4):
            _grads(model, mesh, step)
            opt.step()
        assert mgr.save(3, force=True)
    assert opt.cpu_offload and _state_bytes_on_gpu(opt) == 0
    for step in range(4, 6):
        _grads(model, mesh, step)
        opt.step()

    model2, opt2 = _build(mesh, 1)  # different init: everything must come from the checkpoint
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with CheckpointManager(url, model=model2, optimizer=opt2) as mgr:
        assert mgr.load() == 3
    torch.cuda.synchronize()
    assert opt2.cpu_offload, "offload mode must be restored after the load"
    assert _state_bytes_on_gpu(opt2) == 0, "states must be offloaded again after the load"
    leftover = torch.cuda.memory_allocated() - before
    for step in range(4, 6):
        _grads(model2, mesh, step)
        opt2.step()
    opt.turn_off_cpu_offload()
    opt2.turn_off_cpu_offload()
    bad = []
    for (n, a), (_, b) in zip(model.named_parameters(), model2.named_parameters()):
        if not torch.equal(a.full_tensor(), b.full_tensor()):
            bad.append(f"param {n}")
        for k, v in opt.state[a].items():
            w = opt2.state[b][k]
            v = v.full_tensor() if isinstance(v, DTensor) else v
            w = w.full_tensor() if isinstance(w, DTensor) else w
            if not torch.equal(v.cpu(), w.cpu()):
                bad.append(f"state {n}.{k}")
    return bad, leftover


def test_save_load_round_trip_with_offload_on_gpu(tmp_path):
    bad, leftover = run_on_ranks(body_round_trip, 1, str(tmp_path / "run"))[0]
    assert bad == []
    assert leftover <= 4 * 2**20, f"load left {leftover} bytes allocated on the GPU"


def _values(model, opt):
    """Every parameter and optimizer state as full CPU tensors (offload stays on)."""
    out = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}
    views = opt.cpu_state_views()
    for n, p in model.named_parameters():
        for k, t in opt.state[p].items():
            v = views.get(id(t), t)
            out[f"{n}:{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).cpu().clone()
    return out


def body_failed_load(rank, world_size, url, late_backup=False, held_backup=False):
    from torch.distributed.device_mesh import init_device_mesh

    from muon_ckpt import CheckpointCorruptError, CheckpointManager
    from muon_ckpt.store import Storage
    from tests._ckpt import biggest_data_file

    mesh = init_device_mesh("cuda", (world_size,))
    model, opt = _build(mesh, 0)
    mgr = CheckpointManager(url, model=model, optimizer=opt)
    for step in range(1, 4):
        _grads(model, mesh, step)
        opt.step()
    mgr.save(3, force=True)
    st = Storage(url)
    name = biggest_data_file(st, 3)  # format 3: a file of <url>/data/, named from the step
    data = bytearray(st.read_bytes("step-00000003", name))
    data[len(data) // 2] ^= 0xFF
    st.write_bytes(bytes(data), "step-00000003", name)
    _grads(model, mesh, 4)
    opt.step()
    before = _values(model, opt)
    torch.cuda.synchronize()
    mem = torch.cuda.memory_allocated()
    if late_backup:
        # Half a second of GPU work before the load: the backup of the GPU tensors (a side
        # stream that waits for it) and the load's writes into them (queued behind it on the
        # default stream) are let go at the same time; only the load's ordering on the GPU
        # keeps the writes behind the backup.
        torch.cuda._sleep(1 << 30)
    if held_backup:
        # Only the backup held back: the staging side stream (made by the save above) waits
        # for half a second of work on a stream of its own; nothing else does. The load's
        # writes on the default stream would run first but for the load's ordering.
        (side,) = mgr._staging._streams.values()
        hold = torch.cuda.Stream()
        with torch.cuda.stream(hold):
            torch.cuda._sleep(1 << 30)
        side.wait_stream(hold)
    try:
        mgr.load(step=3)
        return ["the load did not fail"], 0
    except CheckpointCorruptError:
        pass
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - mem
    after = _values(model, opt)
    bad = [k for k in before if not torch.equal(before[k], after[k])]
    if _state_bytes_on_gpu(opt) != 0:
        bad.append("states not offloaded")
    return bad, grown


def body_failed_load_late_backup(rank, world_size, url):
    return body_failed_load(rank, world_size, url, late_backup=True)


def body_failed_load_held_backup(rank, world_size, url):
    return body_failed_load(rank, world_size, url, held_backup=True)


@pytest.mark.parametrize("backup", ["", "late", "held"])
def test_failed_load_with_offload_on_changes_nothing_on_gpu(tmp_path, backup):
    body = {
        "": body_failed_load,
        "late": body_failed_load_late_backup,
        "held": body_failed_load_held_backup,
    }[backup]
    bad, grown = run_on_ranks(body, 1, str(tmp_path / "run"))[0]
    assert bad == []
    assert grown <= 4 * 2**20, f"a failed load left {grown} bytes allocated on the GPU"
