"""GPU: a verified load into CUDA tensors of a step whose pages were evicted, and of one just
written, each bit for bit (one device).

    python3 -m pytest tests/gpu/test_resume_gpu.py      (needs a CUDA device)

16 x 4096^2 fp32 parameters with Muon momentum (1 GiB), saved with ``io_threads=1`` (one
file: every reading thread reads a part of it) and with 4 files; the cold case fsyncs and
evicts every file of the step (``posix_fadvise(DONTNEED)``, checked with ``mincore``) before
a fresh model and optimizer load it. A second load in the same process reuses the reading
threads' page-locked chunks: it pins nothing.
"""

from __future__ import annotations

import os

import pytest
import torch

from muon_ckpt import CheckpointManager
from tests._pagecache import evict, resident_bytes, step_files
from tests.gpu.test_async_gpu import _build, _host_state, _step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("files", [1, 4], ids=["one-file", "four-files"])
@pytest.mark.parametrize("cache", ["hot", "cold"])
def test_verified_load_into_cuda_tensors_is_bitwise_hot_and_cold(tmp_path, cache, files):
    url = str(tmp_path / "run")
    model, opt = _build(0)
    for s in (1, 2):
        _step(model, opt, s)
    with CheckpointManager(url, model=model, optimizer=opt, io_threads=files) as mgr:
        assert mgr.save(2)
    want = _host_state(model, opt)
    del model, opt
    paths = step_files(url, 2)  # (its data files too, which format 3 keeps in <url>/data/)
    held = sum(v.numel() * v.element_size() for v in want.values())
    assert sum(os.path.getsize(p) for p in paths) >= held, paths
    if cache == "cold":
        try:
            evict(paths)
        except RuntimeError as e:  # tmpfs keeps its pages: they are its storage
            pytest.skip(f"this file system cannot drop the step's pages: {e}")
        assert resident_bytes(paths) == 0
    model2, opt2 = _build(1)
    with CheckpointManager(url, model=model2, optimizer=opt2) as mgr2:
        assert mgr2.load() == 2
        first = dict(mgr2.last_load_timings)
        got = _host_state(model2, opt2)
        for k in want:
            assert torch.equal(want[k].view(torch.uint8), got[k].view(torch.uint8)), k
        assert first["threads_io"] > 0 and first["threads_checksum"] > 0
        assert mgr2.load() == 2
        # The same threads again: their chunks come from the first load's, none pinned anew
        # (pinning 8 MiB a thread takes milliseconds; taking a kept chunk, microseconds).
        assert mgr2.last_load_timings["threads_pin"] < 0.005, mgr2.last_load_timings
    got = _host_state(model2, opt2)
    for k in want:
        assert torch.equal(want[k].view(torch.uint8), got[k].view(torch.uint8)), k
