"""GPU: the local item reader into CUDA targets, bit for bit against DCP's own reader.

    python3 -m pytest tests/gpu/test_itemread_gpu.py     (needs a CUDA device)

Same state and checks as tests/load/test_itemread.py, with the targets on the GPU: contiguous
targets of the stored dtype are copied through the two page-locked chunk buffers (the 3-chunk
tensor reuses both), the others through the whole-record host buffer and ``copy_``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from muon_ckpt import CheckpointCorruptError
from tests._ckpt import flip_byte
from tests.load.test_itemread import (
    _manifest,
    _ours,
    _save,
    _targets,
    check_same_bits_as_dcp_reader,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("kind", ["same", "strided"])
@pytest.mark.parametrize("verify", [True, False], ids=["crc32", "size"])
def test_cuda_targets_same_bits_as_dcp_reader(tmp_path, kind, verify):
    check_same_bits_as_dcp_reader(tmp_path, kind, verify, "cuda")


def test_cuda_targets_go_through_the_page_locked_buffers(tmp_path, monkeypatch):
    """Contiguous CUDA targets of the stored dtype take the pinned double-buffer path (and
    the 3-chunk tensor cycles through both buffers)."""
    import muon_ckpt.load._local_files as itemread

    used: list[int] = []
    pinned = itemread.ReadBuffers.pinned

    def spy(self, i, device):
        used.append(i)
        return pinned(self, i, device)

    monkeypatch.setattr(itemread.ReadBuffers, "pinned", spy)
    d, sd = _save(tmp_path)
    got = _targets(sd, "same", "cuda")
    _ours(d, got)
    assert used.count(0) >= 2 and used.count(1) >= 2, used
    big = sd["big"]
    assert torch.equal(got["big"].cpu(), big)


def test_cuda_targets_loaded_in_parts(tmp_path, monkeypatch):
    """A file split into many parts (tests/load/test_read_parts.py) into CUDA targets: the same
    bits, and one pair of page-locked buffers per reading thread for all its parts."""
    import muon_ckpt.load._reader as reader_mod
    from tests.load.test_read_parts import check_parts_share_their_threads_buffers

    monkeypatch.setattr(reader_mod, "PART_BYTES", 1)
    check_parts_share_their_threads_buffers(tmp_path, monkeypatch, "cuda")


@pytest.mark.parametrize("where", ["head", "record", "tail"])
def test_damage_in_an_item_read_into_cuda_targets_is_caught(tmp_path, where):
    d, sd = _save(tmp_path)
    files = _manifest(d)
    md = dcp.FileSystemReader(d).read_metadata()
    info = next(i for idx, i in md.storage_data.items() if idx.fqn == "big")
    at = {
        "head": info.offset + 40,
        "record": info.offset + info.length // 2,
        "tail": info.offset + info.length - 30,
    }[where]
    flip_byte(os.path.join(d, info.relative_path), at, 0x5A)
    with pytest.raises(CheckpointCorruptError, match=info.relative_path):
        _ours(d, _targets(sd, "same", "cuda"), files=files)


def test_truncated_file_into_cuda_targets_is_corruption(tmp_path):
    d, sd = _save(tmp_path)
    files = _manifest(d)
    name = max(files, key=lambda n: files[n].size)
    with open(os.path.join(d, name), "r+b") as f:
        f.truncate(files[name].size - 3 * 4096 - 100)
    for verify in (False, True):
        with pytest.raises(CheckpointCorruptError, match=name):
            _ours(d, _targets(sd, "same", "cuda"), files=files, verify=verify)
