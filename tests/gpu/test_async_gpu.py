"""GPU (one device, NCCL world size 1): saves and loads with CPU offload on never bring
optimizer state to the GPU, and asynchronous saves hold the state of the save() call.

    python3 -m pytest tests/gpu/test_async_gpu.py      (needs a CUDA device)

16 x 4096^2 fp32 parameters with Muon momentum (1 GiB of state, offloaded). Peak GPU memory
(``torch.cuda.max_memory_allocated``) over the between-steps baseline must stay within 64 MiB
during an asynchronous save, a synchronous save, a load into the same optimizer and a load into
a fresh one; offload stays on throughout. Then an asynchronous save with offload on and one
with it off, each held back while three steps run: a fresh model loads the values of the save
call, bit for bit.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from tests._dist import run_on_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

N, SIDE, MiB = 16, 4096, 1 << 20


def _build(seed: int):
    from optim.muon import Muon

    torch.manual_seed(seed)
    model = nn.Module()
    for i in range(N):
        model.register_parameter(f"w{i}", nn.Parameter(torch.randn(SIDE, SIDE, device="cuda")))
    opt = Muon(list(model.parameters()), chunk_size=8, lr=0.02)
    # names come from the model; no 'names' needed
    return model, opt


def _step(model, opt, step: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device="cuda", generator=g)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _host_state(model, opt) -> dict[str, torch.Tensor]:
    was = opt.cpu_offload
    if was:
        opt.turn_off_cpu_offload()
    out = {}
    for n, p in model.named_parameters():
        out[n] = p.detach().cpu().clone()
        out[n + ":m"] = opt.state[p]["momentum_buffer"].cpu().clone()
    if was:
        opt.turn_on_cpu_offload()
    return out


def _peak_over(base: int, fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def body_peaks(rank, world_size, root):
    from muon_ckpt import CheckpointManager

    model, opt = _build(0)
    opt.turn_on_cpu_offload()
    for s in (1, 2):
        _step(model, opt, s)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    peaks = {}
    amgr = CheckpointManager(f"{root}/async", model=model, optimizer=opt, async_save=True)
    smgr = CheckpointManager(f"{root}/sync", model=model, optimizer=opt)
    peaks["first async save"] = _peak_over(base, lambda: (amgr.save(2), amgr.wait()))
    _step(model, opt, 3)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    peaks["async save"] = _peak_over(base, lambda: (amgr.save(3), amgr.wait()))
    peaks["sync save"] = _peak_over(base, lambda: smgr.save(3))
    peaks["load"] = _peak_over(base, lambda: amgr.load(3))
    assert opt.cpu_offload
    want = _host_state(model, opt)

    model2, opt2 = _build(1)
    opt2.turn_on_cpu_offload()  # fresh: no state yet
    torch.cuda.synchronize()
    base2 = torch.cuda.memory_allocated()
    mgr2 = CheckpointManager(f"{root}/async", model=model2, optimizer=opt2)
    peaks["load, fresh optimizer"] = _peak_over(base2, lambda: mgr2.load(3))
    assert opt2.cpu_offload
    got = _host_state(model2, opt2)
    bad = [k for k in want if not torch.equal(want[k], got[k])]
    # Both optimizers step on: the same bits.
    _step(model, opt, 4)
    _step(model2, opt2, 4)
    bad += [
        n
        for (n, a), (_, b) in zip(model.named_parameters(), model2.named_parameters())
        if not torch.equal(a, b)
    ]
    for m in (amgr, smgr, mgr2):
        m.close()
    return peaks, bad


def test_offload_on_saves_and_loads_use_no_gpu_memory_for_optimizer_state(tmp_path):
    peaks, bad = run_on_ranks(body_peaks, 1, str(tmp_path), timeout=600)[0]
    print({k: f"{v / MiB:.1f} MiB" for k, v in peaks.items()})
    assert bad == []
    over = {k: v / MiB for k, v in peaks.items() if v > 64 * MiB}
    assert not over, f"peak GPU memory over the between-steps baseline above 64 MiB: {over}"


def body_async_exact(rank, world_size, root):
    from muon_ckpt import CheckpointManager

    bad = {}
    for mode in ("on", "off"):
        model, opt = _build(2)
        if mode == "on":
            opt.turn_on_cpu_offload()
        for s in (1, 2):
            _step(model, opt, s)
        mgr = CheckpointManager(f"{root}/{mode}", model=model, optimizer=opt, async_save=True)
        mgr._saves.gate = gate = threading.Event()
        want = _host_state(model, opt)
        mgr.save(2)
        for s in (3, 4, 5):
            _step(model, opt, s)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        gate.set()
        assert mgr.wait() == 2
        mgr.close()
        model2, opt2 = _build(3)
        if mode == "on":
            opt2.turn_on_cpu_offload()
        with CheckpointManager(f"{root}/{mode}", model=model2, optimizer=opt2) as m2:
            assert m2.load() == 2
        got = _host_state(model2, opt2)
        bad[mode] = [k for k in want if not torch.equal(want[k], got[k])]
    return bad


def test_async_save_on_gpu_holds_the_state_of_the_save_call(tmp_path):
    bad = run_on_ranks(body_async_exact, 1, str(tmp_path), timeout=600)[0]
    assert bad == {"on": [], "off": []}
