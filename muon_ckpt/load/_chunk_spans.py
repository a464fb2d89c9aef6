"""Ranged local reads: the byte ranges one rank needs from a file, verified by chunk.

A rank that does not check a file whole (another rank owns it) reads from it only the ranges
it needs: of a stored item, the bytes that hold the rows (or any sub-block) its targets take.
With a format-2 manifest entry (one checksum per ``chunk_bytes`` chunk) and checksums on,
every range is widened to whole chunks, overlapping spans are merged and read once, and each
chunk is checked before any byte of it is used; the item's zip header and directory (which
said where the tensor bytes are) are read and checked the same way. A format-1 entry (one
crc32 for the whole file) cannot check a part: the ranges are read as they are, and the
file's owner checks it whole, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from muon_ckpt._errors import CheckpointCorruptError
from muon_ckpt.store import FileEntry
from muon_ckpt.store.checksums import check_chunks, chunk_span

__all__ = ["SpanReader", "corrupt_chunk"]

# (file: an fd or an open file object, into, file offset): all of it, or raise
Pread = Callable[[Any, memoryview, int], None]


class SpanReader:
    """Reads byte ranges of one local file into one reused buffer. ``entry``: check every
    chunk read against it (None: read the ranges only)."""

    def __init__(self, where: str, entry: FileEntry | None, pread: Pread) -> None:
        self._where, self._pread = where, pread
        self._entry = entry if entry is not None and entry.chunk_bytes is not None else None
        self._buf = bytearray()
        self._spans: list[tuple[int, int, int]] = []  # (file lo, file hi, buffer offset)

    @property
    def verifies(self) -> bool:
        return self._entry is not None

    def read(self, fd: Any, ranges: list[tuple[int, int]]) -> None:
        """Read ``ranges`` (file offsets ``[lo, hi)``; empty ones are skipped), widened to
        whole chunks and checked when verifying; :meth:`view` then serves them."""
        spans = sorted(
            chunk_span(self._entry, lo, hi) if self._entry is not None else (lo, hi)
            for lo, hi in ranges
            if hi > lo
        )
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        total = sum(hi - lo for lo, hi in merged)
        if len(self._buf) < total:
            self._buf = bytearray(total)
        mv, at = memoryview(self._buf), 0
        self._spans = []
        for lo, hi in merged:
            part = mv[at : at + hi - lo]
            self._pread(fd, part, lo)
            if self._entry is not None:
                self._check(lo, part)
            self._spans.append((lo, hi, at))
            at += hi - lo

    def _check(self, lo: int, data: memoryview) -> None:
        entry = self._entry
        if entry is None or entry.chunk_bytes is None:
            raise AssertionError("checking chunks without a chunked manifest entry")
        bad = check_chunks(entry, lo, data, self._where)  # ``lo``: a chunk's start
        if bad:
            raise corrupt_chunk(entry, bad[0], self._where)

    def view(self, lo: int, hi: int) -> memoryview:
        """Bytes ``[lo, hi)`` of the file, from the last :meth:`read`."""
        for s_lo, s_hi, at in self._spans:
            if s_lo <= lo and hi <= s_hi:
                return memoryview(self._buf)[at + lo - s_lo : at + hi - s_lo]
        raise AssertionError(f"bytes {lo}-{hi} were not read")


def corrupt_chunk(entry: FileEntry, index: int, where: str) -> CheckpointCorruptError:
    """The error for chunk ``index`` of ``entry``'s file, whose checksum is not the manifest's."""
    starts = entry.chunk_starts()
    at = starts[index]
    end = starts[index + 1] if index + 1 < len(starts) else entry.size
    return CheckpointCorruptError(
        f"{where}: file is corrupt: the {entry.algorithm} of its bytes {at}-{end} differs "
        "from the manifest's. Load another step (muon-ckpt ls lists them) or restore this file"
    )
