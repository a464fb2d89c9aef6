"""The mapping under copies to CUDA tensors (muon_ckpt/io/_mapped.py), the parts that need no
GPU: which bytes a mapping shows, how it is cut into pieces, that closing it unmaps it, and
when mapped reads are used. The copies themselves: tests/gpu/test_itemread_gpu.py."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

import muon_ckpt.io._mapped as mapped

pytestmark = pytest.mark.skipif(os.name != "posix", reason="mapped reads are POSIX only")

PAGE = mapped._PAGE


def _file(tmp_path, n: int) -> tuple[str, bytes]:
    data = (
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        .numpy()
        .tobytes()
    )
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as f:
        f.write(data)
    return path, data


def _mapped_here(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(path) for line in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_a_mapping_shows_the_files_bytes_and_closing_unmaps_it(tmp_path):
    n = 5 * PAGE + 123  # the file ends inside a page
    path, data = _file(tmp_path, n)
    fd = os.open(path, os.O_RDONLY)
    try:
        lo = 2 * PAGE + 77  # not on a page: the mapping starts at the page before
        m = mapped.MappedFile(fd, lo, n, torch.device("cpu"))
        assert _mapped_here(path)
        for at, k in [(lo, 10), (3 * PAGE - 1, 2), (n - 50, 50), (lo, n - lo)]:
            assert bytes(m.view(at, k)) == data[at : at + k], (at, k)
            assert bytes(m.host(at, k).numpy()) == data[at : at + k]
        m.close()  # nothing registered: it only unmaps
        assert not _mapped_here(path)
    finally:
        os.close(fd)


def test_pieces_grow_from_first_to_piece_and_cover_the_mapping(tmp_path, monkeypatch):
    monkeypatch.setattr(mapped, "FIRST", PAGE)
    monkeypatch.setattr(mapped, "PIECE", 8 * PAGE)
    n = 40 * PAGE + 5
    path, _ = _file(tmp_path, n)
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mapped.MappedFile(fd, PAGE + 1, n, torch.device("cpu"))
        spans = [m._span(k) for k in range(len(m._starts))]
        sizes = [b - a for a, b in spans]
        assert sizes[:4] == [PAGE, 2 * PAGE, 4 * PAGE, 8 * PAGE], sizes
        assert all(s == 8 * PAGE for s in sizes[3:-1]) and 0 < sizes[-1] <= 8 * PAGE, sizes
        assert spans[0][0] == 0 and all(a == b for (_, a), (b, _) in itertools.pairwise(spans))
        # the last piece ends on the page after the file's last byte: never past it
        assert spans[-1][1] == -(-(n - PAGE) // PAGE) * PAGE, (spans[-1], n)
        m.close()
    finally:
        os.close(fd)


def test_mapped_reads_are_on_only_when_asked_and_not_refused(tmp_path, monkeypatch):
    path, _ = _file(tmp_path, 100)
    fd = os.open(path, os.O_RDONLY)
    try:
        monkeypatch.setattr(mapped, "_failures", {})
        monkeypatch.delenv(mapped.ENV, raising=False)
        assert not mapped.mapped_reads(fd)  # off unless asked for
        monkeypatch.setenv(mapped.ENV, "1")
        assert mapped.mapped_reads(fd)
        monkeypatch.setenv(mapped.ENV, "0")
        assert not mapped.mapped_reads(fd)
        monkeypatch.setenv(mapped.ENV, "1")
        mapped._failures[os.fstat(fd).st_dev] = mapped._REFUSE_AFTER - 1
        assert mapped.mapped_reads(fd)  # a failure or two may be passing (out of memory)
        mapped._failures[os.fstat(fd).st_dev] = mapped._REFUSE_AFTER
        assert not mapped.mapped_reads(fd)
    finally:
        os.close(fd)
