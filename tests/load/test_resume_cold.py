"""A resume reads files that are not in the page cache (a new node, a restarted container):
a verified load of a step whose pages were evicted gives the same bits as one of a step just
written, and ``last_load_timings`` splits the reading threads' time into its phases.

Eviction is ``fsync`` then ``posix_fadvise(POSIX_FADV_DONTNEED)``; ``mincore`` checks that no
page of the step stayed resident before the load (``tests/_pagecache.py``).
"""

from __future__ import annotations

import os

import pytest
import torch

from muon_ckpt import CheckpointManager
from tests._ckpt import TinyNet, make_muon, muon_state_sd, train
from tests._pagecache import evict, resident_bytes, step_files


def _run(tmp_path):
    torch.manual_seed(0)
    model = TinyNet(vocab=2048, dim=256)  # a 2 MiB embedding: several chunks per file
    opt = make_muon(model)
    train(model, opt, 3)
    url = str(tmp_path / "run")
    with CheckpointManager(url, model=model, optimizer=opt, io_threads=2) as mgr:
        assert mgr.save(3)
    return url, muon_state_sd(model, opt)


def _fresh_load(url, **kw):
    torch.manual_seed(1)
    model = TinyNet(vocab=2048, dim=256)
    opt = make_muon(model)
    train(model, opt, 1, seed=5)  # different values everywhere: all must come from the step
    with CheckpointManager(url, model=model, optimizer=opt, **kw) as mgr:
        assert mgr.load() == 3
        timings = dict(mgr.last_load_timings)
    return muon_state_sd(model, opt), timings


def _assert_bitwise(want, got):
    assert want.keys() == got.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == got[k].dtype and v.shape == got[k].shape, k
            assert torch.equal(v.view(-1).view(torch.uint8), got[k].view(-1).view(torch.uint8)), k
        else:
            assert v == got[k], k


@pytest.mark.parametrize("cache", ["hot", "cold"])
def test_verified_load_of_an_evicted_step_is_bitwise(tmp_path, cache):
    url, want = _run(tmp_path)
    files = step_files(url, 3)
    size = sum(os.path.getsize(p) for p in files)
    held = sum(v.numel() * v.element_size() for v in want.values() if isinstance(v, torch.Tensor))
    assert size >= held, f"the files evicted ({files}) do not hold the step's tensors"
    if cache == "cold":
        try:
            evict(files)
        except RuntimeError as e:  # tmpfs keeps its pages: they are its storage
            pytest.skip(f"this file system cannot drop the step's pages: {e}")
        assert resident_bytes(files) == 0
    else:
        assert resident_bytes(files) >= size // 2  # just written: (mostly) in the page cache
    got, _ = _fresh_load(url)
    _assert_bitwise(want, got)
    if cache == "cold":  # it read from the disk: the pages are back
        assert resident_bytes(files) > 0


def test_load_timings_split_the_reading_threads_time(tmp_path):
    url, _ = _run(tmp_path)
    _, verified = _fresh_load(url)
    _, sized = _fresh_load(url, verify="size")
    for t in (verified, sized):
        assert {"decide", "prepare", "backup", "dcp_load", "read", "share", "apply", "total"} <= (
            t.keys()
        )
        assert t["threads_io"] > 0
        assert t["threads_pin"] == 0 and t["threads_h2d_wait"] == 0  # CPU targets: no copies
    assert verified["threads_checksum"] > 0
    assert sized["threads_checksum"] == 0  # verify="size": no byte through the checksum
