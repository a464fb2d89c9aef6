"""GPU: the local item reader into CUDA targets, bit for bit against DCP's own reader.

    python3 -m pytest tests/gpu/test_itemread_gpu.py     (needs a CUDA device)

Same state and checks as tests/test_itemread.py, with the targets on the GPU: contiguous
targets of the stored dtype are copied through the two page-locked chunk buffers (the 3-chunk
tensor reuses both), or straight out of the mapped file where that is on
(``MUON_CKPT_MAPPED_READS=1``: ``_mapped``), the others through the whole-record host buffer
and ``copy_``.
"""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

import muon_ckpt.io._mapped as mapped
from muon_ckpt import CheckpointCorruptError
from tests._ckpt import flip_byte
from tests.test_itemread import (
    _bits,
    _manifest,
    _ours,
    _save,
    _stored,
    _targets,
    check_same_bits_as_dcp_reader,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("kind", ["same", "strided"])
@pytest.mark.parametrize("verify", [True, False], ids=["crc32", "size"])
def test_cuda_targets_same_bits_as_dcp_reader(tmp_path, kind, verify):
    check_same_bits_as_dcp_reader(tmp_path, kind, verify, "cuda")


@pytest.mark.parametrize("kind", ["same", "strided"])
@pytest.mark.parametrize("verify", [True, False], ids=["crc32", "size"])
def test_cuda_targets_same_bits_with_mapped_reads_on(tmp_path, monkeypatch, kind, verify):
    monkeypatch.setenv("MUON_CKPT_MAPPED_READS", "1")
    check_same_bits_as_dcp_reader(tmp_path, kind, verify, "cuda")


def test_cuda_targets_go_through_the_page_locked_buffers(tmp_path, monkeypatch):
    """By default (mapped reads off), contiguous CUDA targets of the stored dtype take the
    pinned double-buffer path (and the 3-chunk tensor cycles through both buffers)."""
    import muon_ckpt.io._itemread as itemread

    monkeypatch.delenv("MUON_CKPT_MAPPED_READS", raising=False)
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
    """A file split into many parts (tests/test_read_parts.py) into CUDA targets: the same
    bits, and one pair of page-locked buffers per reading thread for all its parts."""
    import muon_ckpt.io._reader as reader_mod
    from tests.test_read_parts import check_parts_share_their_threads_buffers

    monkeypatch.setattr(reader_mod, "PART_BYTES", 1)
    check_parts_share_their_threads_buffers(tmp_path, monkeypatch, "cuda")


class _Pins:
    """Counts the registrations of mapped pieces: made, given back, alive."""

    def __init__(self, monkeypatch) -> None:
        self.made, self.freed, self.live = 0, 0, set()
        self._lock = threading.Lock()
        register, unregister = mapped._register, mapped._unregister

        def spy_register(device, addr, n):
            register(device, addr, n)
            with self._lock:
                self.made += 1
                self.live.add(addr)

        def spy_unregister(device, addr, events):
            unregister(device, addr, events)
            with self._lock:
                self.freed += 1
                self.live.discard(addr)

        monkeypatch.setattr(mapped, "_register", spy_register)
        monkeypatch.setattr(mapped, "_unregister", spy_unregister)


@pytest.fixture
def small_pieces(monkeypatch):
    """Mapped reads on, pieces of one, then two pages: the 3-chunk tensor spans hundreds of
    them; records of any length are copied out of the mapping."""
    import muon_ckpt.io._itemread as itemread

    monkeypatch.setenv("MUON_CKPT_MAPPED_READS", "1")
    monkeypatch.setattr(mapped, "FIRST", mapped._PAGE)
    monkeypatch.setattr(mapped, "PIECE", 2 * mapped._PAGE)
    monkeypatch.setattr(itemread, "MAPPED_MIN", 0)
    return mapped.PIECE


def _count_chunk_buffers(monkeypatch) -> list[int]:
    """Which page-locked chunk buffer each copy through them took, from here on."""
    import muon_ckpt.io._itemread as itemread

    chunked: list[int] = []
    pinned = itemread.ReadBuffers.pinned
    monkeypatch.setattr(
        itemread.ReadBuffers,
        "pinned",
        lambda self, i, dev: chunked.append(i) or pinned(self, i, dev),
    )
    return chunked


def test_short_records_go_through_the_chunks(tmp_path, monkeypatch):
    """Only records of at least MAPPED_MIN bytes are copied out of the mapping (the 3-chunk
    tensor); the short ones go through the page-locked chunk buffers. Same bits."""
    import muon_ckpt.io._itemread as itemread

    monkeypatch.setenv("MUON_CKPT_MAPPED_READS", "1")
    mapped_bytes: list[int] = []
    take = itemread.FileLoad._take_mapped

    def spy(self, fd, dst, offset, nbytes, stream):
        mapped_bytes.append(nbytes)
        return take(self, fd, dst, offset, nbytes, stream)

    monkeypatch.setattr(itemread.FileLoad, "_take_mapped", spy)
    chunked = _count_chunk_buffers(monkeypatch)
    check_same_bits_as_dcp_reader(tmp_path, "same", True, "cuda")
    big = _stored()["big"]
    assert mapped_bytes == [big.numel() * 4] and mapped_bytes[0] >= itemread.MAPPED_MIN
    assert chunked, "the short records did not go through the chunk buffers"


@pytest.mark.parametrize("verify", [True, False], ids=["crc32", "size"])
def test_cuda_targets_copy_from_the_mapped_file(tmp_path, monkeypatch, small_pieces, verify):
    """Contiguous CUDA targets are copied out of the mapped file, not through the page-locked
    chunk buffers: same bits as the saved tensors, every piece given back after the load."""

    pins = _Pins(monkeypatch)
    chunked = _count_chunk_buffers(monkeypatch)
    d, sd = _save(tmp_path)
    got = _targets(sd, "same", "cuda")
    _ours(d, got, verify=verify)  # 2 threads
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert _bits(got[k]) == _bits(v), k
    assert chunked == []
    big = sd["big"].numel() * 4
    assert pins.made >= big // small_pieces, (pins.made, big // small_pieces)
    assert pins.freed == pins.made and not pins.live, vars(pins)


@pytest.mark.usefixtures("small_pieces")
@pytest.mark.parametrize("where", ["head", "record", "tail"])
def test_damage_in_a_mapped_item_is_caught_and_nothing_stays_registered(
    tmp_path, monkeypatch, where
):
    pins = _Pins(monkeypatch)
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
    assert pins.freed == pins.made and not pins.live, vars(pins)


@pytest.mark.usefixtures("small_pieces")
def test_truncated_file_into_cuda_targets_is_corruption(tmp_path, monkeypatch):
    """The mapping never reaches past the end of a short file (reading there would be
    SIGBUS; registering it fails, which would count as a failure of the file system)."""
    pins = _Pins(monkeypatch)
    d, sd = _save(tmp_path)
    files = _manifest(d)
    name = max(files, key=lambda n: files[n].size)
    with open(os.path.join(d, name), "r+b") as f:
        f.truncate(files[name].size - 4 * mapped._PAGE - 100)  # pages wholly past the end
    monkeypatch.setattr(mapped, "_failures", {})
    for verify in (False, True):
        with pytest.raises(CheckpointCorruptError, match=name):
            _ours(d, _targets(sd, "same", "cuda"), files=files, verify=verify)
    assert pins.freed == pins.made and not pins.live, vars(pins)
    assert mapped._failures == {}  # nothing past the end was mapped or registered


def test_a_file_system_that_refuses_page_locking_falls_back_to_the_chunks(
    tmp_path, monkeypatch, caplog
):
    """A registration CUDA refuses (here: a flag it does not know) makes the load copy that
    file through the page-locked chunk buffers, after one warning per file system, and after
    a few such failures the file system's files are not mapped again: the same bits, and the
    refused calls' CUDA errors never reach the reading threads' later kernel launches (the
    strided targets' loads launch copy kernels on them)."""
    monkeypatch.setenv("MUON_CKPT_MAPPED_READS", "1")
    monkeypatch.setattr(mapped, "_REGISTER_FLAGS", 0x8000)
    monkeypatch.setattr(mapped, "_failures", {})
    with caplog.at_level(logging.WARNING, logger="muon_ckpt"):
        for name in "abc":  # two files each: tried until refused
            check_same_bits_as_dcp_reader(tmp_path / name, "same", True, "cuda")
        refused = mapped._failures[os.stat(tmp_path).st_dev]
        assert refused >= mapped._REFUSE_AFTER
        check_same_bits_as_dcp_reader(tmp_path / "d", "same", True, "cuda")
        check_same_bits_as_dcp_reader(tmp_path / "e", "strided", True, "cuda")
    assert mapped._failures[os.stat(tmp_path).st_dev] == refused  # not tried again
    warned = [r for r in caplog.records if "cannot page-lock" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    torch.cuda.synchronize()
    assert torch.ones(3, device="cuda").add(1).sum().item() == 6.0


@pytest.mark.usefixtures("small_pieces")
def test_pieces_are_unregistered_only_after_their_copies(tmp_path, monkeypatch):
    """A sleep kernel queued before the load holds the stream, so the copies wait behind it:
    no piece may be unregistered (nor unmapped) before it has ended."""
    pins = _Pins(monkeypatch)
    early: list[int] = []
    spy = mapped._unregister  # (the counting spy, which calls the real one)

    def check(device, addr, events):
        spy(device, addr, events)
        if not slept.query():
            early.append(addr)

    monkeypatch.setattr(mapped, "_unregister", check)
    d, sd = _save(tmp_path)
    got = _targets(sd, "same", "cuda")
    torch.cuda._sleep(1 << 30)  # about half a second
    slept = torch.cuda.Event()
    slept.record()
    _ours(d, got)
    assert slept.query(), "the load returned before its copies were done"
    assert pins.made > 0 and pins.freed == pins.made and early == [], (vars(pins), early)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert _bits(got[k]) == _bits(v), k
