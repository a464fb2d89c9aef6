"""GPU: the deferred snapshot (``async_save="deferred"``) on CUDA tensors.

    python3 -m pytest tests/gpu/test_deferred_gpu.py      (needs a CUDA device)

``save()`` queues the device-to-host copies of parameters and states on a side stream and
returns; the next step runs at once (its stream waits for the copies, not the host). A fresh
model loads the values of the save call, bit for bit, offload on and off; a parameter written
in place before the next step fails that save; the save adds no GPU memory.
"""

from __future__ import annotations

import pytest
import torch

from muon_ckpt import CheckpointError, CheckpointManager
from tests.gpu.test_async_gpu import MiB, _build, _host_state, _step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("offload", [False, True], ids=["offload-off", "offload-on"])
def test_deferred_save_on_cuda_holds_the_state_of_the_save_call(tmp_path, offload):
    url = str(tmp_path / "run")
    model, opt = _build(0)
    if offload:
        opt.turn_on_cpu_offload()
    _step(model, opt, 1)
    mgr = CheckpointManager(url, model=model, optimizer=opt, async_save="deferred")
    mgr.save(1)
    mgr.wait()  # the first save allocates (and page-locks) the host buffers

    def peak_of(run) -> float:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / MiB

    steps_alone = peak_of(lambda: [_step(model, opt, s) for s in (2, 3, 4)])
    want = _host_state(model, opt)

    def save_then_steps() -> None:
        assert mgr.save(4)
        for s in (5, 6, 7):  # at once: each step's stream waits for the copies
            _step(model, opt, s)
        assert mgr.wait() == 4

    with_save = peak_of(save_then_steps)
    # The copies go to pinned host buffers: the save adds no GPU memory to the steps'.
    assert with_save - steps_alone < 64, (with_save, steps_alone)
    mgr.close()
    model2, opt2 = _build(1)
    if offload:
        opt2.turn_on_cpu_offload()
    assert CheckpointManager(url, model=model2, optimizer=opt2).load() == 4
    got = _host_state(model2, opt2)
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_deferred_save_on_cuda_refuses_an_in_place_write_before_the_step(tmp_path):
    url = str(tmp_path / "run")
    model, opt = _build(0)
    _step(model, opt, 1)
    mgr = CheckpointManager(url, model=model, optimizer=opt, async_save="deferred")
    assert mgr.save(1) and mgr.wait() == 1
    _step(model, opt, 2)
    assert mgr.save(2)
    with torch.no_grad():
        next(model.parameters()).mul_(0.5)
    _step(model, opt, 3)
    with pytest.raises(CheckpointError, match="changed in place"):
        mgr.wait()
    assert mgr.steps() == [1]
