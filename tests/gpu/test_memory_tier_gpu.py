"""GPU: the memory tier on CUDA tensors (one device): a step kept in host memory loads back bit
for bit into a fresh model and optimizer, offload on and off, from the memory tier (no step
data from storage); a memory save adds no GPU memory.

    python3 -m pytest tests/gpu/test_memory_tier_gpu.py      (needs a CUDA device)
"""

from __future__ import annotations

import pytest
import torch

from muon_ckpt import CheckpointManager, MemoryOptions
from tests.gpu.test_async_gpu import MiB, _build, _host_state, _step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("offload", [False, True], ids=["offload-off", "offload-on"])
def test_a_memory_step_loads_back_bitwise_on_cuda(tmp_path, offload):
    url, mem = str(tmp_path / "run"), str(tmp_path / "mem")
    model, opt = _build(0)
    if offload:
        opt.turn_on_cpu_offload()
    kw = dict(interval=5, memory=MemoryOptions(interval=1, dir=mem), async_save=True)
    mgr = CheckpointManager(url, model=model, optimizer=opt, **kw)
    assert mgr.load() is None
    for s in range(1, 6):
        _step(model, opt, s)
        mgr.save(s)
        mgr.wait()
    _step(model, opt, 6)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert mgr.save(6)  # memory only
    mgr.wait()
    torch.cuda.synchronize()
    assert (torch.cuda.max_memory_allocated() - base) / MiB < 64
    want = _host_state(model, opt)
    mgr._saves.memory.mark = None  # (keep step 6 in memory only)
    mgr.close()
    model2, opt2 = _build(1)
    if offload:
        opt2.turn_on_cpu_offload()
    mgr2 = CheckpointManager(url, model=model2, optimizer=opt2, **kw)
    assert mgr2.load() == 6
    assert mgr2.last_load_tier == "memory" and mgr2.last_load_bytes_read == 0
    got = _host_state(model2, opt2)
    for k in want:
        assert torch.equal(want[k].view(torch.uint8), got[k].view(torch.uint8)), k
    mgr2._saves.memory.mark = None
    mgr2.close()
