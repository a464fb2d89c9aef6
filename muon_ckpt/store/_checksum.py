"""File checksums: the one place that knows how a manifest's checksums are computed and read.

A manifest entry (``FileEntry``) records a file's size and its checksums: in format 2, one
CRC32C (or, without a CRC32C package, zlib crc32) per chunk of ``chunk_bytes`` bytes from the
file's start, as 8 hex digits each, concatenated; in format 1, one zlib crc32 of the whole
file. Per-chunk checksums let a reader that needs only part of a file (a resharded rank, a
slice of an item) verify just the chunks it reads (``chunk_span``, ``check_chunks``).

Writers and readers chain a ``Checksum`` over the bytes they write or read, in order;
``file_checksum`` reads a stored file front to back through one reused buffer per thread.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

from muon_ckpt.store._crc import CRC32, crc_function, write_algorithm
from muon_ckpt.store._layout import FileEntry

__all__ = [
    "CHUNK_BYTES",
    "Checksum",
    "check_chunks",
    "chunk_span",
    "crc_hex",
    "file_checksum",
    "mismatched_chunks",
    "new_entry",
]

# Bytes per checksum in new manifests: a reader of part of a file reads at most one chunk more
# on each side of each range it needs (and the chunks of an item's zip header and directory),
# so chunks must be small next to a slice of an item; 8 hex digits per MiB make a manifest of
# 32 KB per 4 GiB (8 MB per TB), and one CRC call per MiB costs nothing next to the CRC.
CHUNK_BYTES = 1 << 20
_BUF = 16 << 20
_tls = threading.local()


def crc_hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


class Checksum:
    """The running checksum of bytes taken front to back, in the form of a manifest entry:
    ``algorithm`` (``crc32c``/``crc32``), one CRC per chunk of at most ``chunk_bytes`` (None:
    one for all). Chunks run on a grid of ``chunk_bytes`` that restarts at each cut: a writer
    cuts (``cut()``) around every large write, so that a stored tensor's bytes start a chunk
    and the small zip records between tensors form small chunks of their own; a reader
    replays the recorded ``cuts``. ``start``: the file offset of the first byte taken (a chunk
    start, for checking a span)."""

    def __init__(
        self,
        algorithm: str,
        chunk_bytes: int | None,
        where: str = "",
        cuts: list[int] | None = None,
        start: int = 0,
    ) -> None:
        self.algorithm, self.chunk_bytes = algorithm, chunk_bytes
        self._fn = crc_function(algorithm, where)
        self._crc, self.size = 0, 0
        self._pos = self._anchor = start  # file offsets: next byte, current chunk's start
        self._replay = sorted(cuts) if cuts is not None else None
        self._ci = 0  # first replayed cut not behind the anchor
        self.cuts: list[int] = []  # written: where chunks were cut short
        self._done: list[str] = []

    @classmethod
    def like(cls, entry: FileEntry, where: str = "", start: int = 0) -> Checksum:
        """A checksum computed the way ``entry``'s was (to compare with it)."""
        return cls(entry.algorithm, entry.chunk_bytes, where, entry.cuts or [], start)

    @classmethod
    def for_writing(cls) -> Checksum:
        return cls(write_algorithm(), CHUNK_BYTES)

    def _chunk_end(self) -> int:
        if self.chunk_bytes is None:
            raise AssertionError("no chunks")
        end = self._anchor + self.chunk_bytes
        cuts = self._replay
        if cuts is not None:
            while self._ci < len(cuts) and cuts[self._ci] <= self._anchor:
                self._ci += 1
            if self._ci < len(cuts) and cuts[self._ci] < end:
                end = cuts[self._ci]
        return end

    def _finish(self) -> None:
        self._done.append(crc_hex(self._crc))
        self._crc, self._anchor = 0, self._pos

    def cut(self) -> None:
        """End the current chunk here (writers; nothing when it is empty)."""
        if self.chunk_bytes is not None and self._pos > self._anchor:
            self.cuts.append(self._pos)
            self._finish()

    def update(self, data: Any) -> None:
        mv = memoryview(data)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        n = len(mv)
        if self.chunk_bytes is None:
            self._crc = self._fn(self._crc, mv)
            self.size += n
            return
        while len(mv):
            end = self._chunk_end()
            part = mv[: end - self._pos]
            self._crc = self._fn(self._crc, part)
            self._pos += len(part)
            if self._pos == end:
                self._finish()
            mv = mv[len(part) :]
        self.size += n  # last: a failed update leaves the size short (the writer checks it)

    def hexdigest(self) -> str:
        """8 hex digits per chunk begun (at least one: an empty file has the CRC of nothing)."""
        if self.chunk_bytes is None:
            return crc_hex(self._crc)
        tail = [crc_hex(self._crc)] if self._pos > self._anchor or not self._done else []
        return "".join(self._done + tail)

    def entry(self) -> FileEntry:
        # A cut where the file ends (its last write was large: a compressed frame) ends the
        # last chunk, as the end does: not recorded.
        cuts = [c for c in self.cuts if c < self.size]
        return new_entry(
            self.size, self.algorithm, self.hexdigest(), self.chunk_bytes, cuts or None
        )


def new_entry(
    size: int,
    algorithm: str,
    digest: str,
    chunk_bytes: int | None,
    cuts: list[int] | None = None,
) -> FileEntry:
    if algorithm == CRC32:
        return FileEntry(size, crc32=digest, chunk_bytes=chunk_bytes, cuts=cuts)
    return FileEntry(size, crc32c=digest, chunk_bytes=chunk_bytes, cuts=cuts)


def _buffer() -> bytearray:
    # One reused buffer per thread: a fresh 16 MiB bytes object per read would be a fresh
    # mmap, page-faulted in on every read (slower than the read itself from the page cache).
    buf = getattr(_tls, "buf", None)
    if buf is None:
        buf = _tls.buf = bytearray(_BUF)
    return buf


def file_checksum(
    f: Any,
    like: FileEntry,
    progress: Any = None,
    where: str = "",
    span: tuple[int, int] | None = None,
) -> Checksum:
    """The checksum of everything readable from the open binary file ``f``, computed the way
    ``like``'s was; ``progress(n)`` is called after each block when given. ``span``: only
    bytes ``[lo, hi)`` (``lo`` a chunk start; fewer where the file ends first)."""
    buf = _buffer()
    view = memoryview(buf)
    lo, hi = span if span is not None else (0, None)
    c = Checksum.like(like, where, lo)
    if span is not None:
        f.seek(lo)
    while (left := len(buf) if hi is None else min(len(buf), hi - lo - c.size)) and (
        n := f.readinto(view[:left])
    ):
        c.update(view[:n])
        if progress is not None:
            progress(n)
    return c


def chunk_span(entry: FileEntry, start: int, end: int) -> tuple[int, int]:
    """The bytes to read so that ``[start, end)`` can be verified: whole chunks (the whole
    file for an entry without chunks)."""
    if entry.chunk_bytes is None:
        return 0, entry.size
    starts = entry.chunk_starts()
    i = bisect.bisect_left(starts, end)
    return starts[bisect.bisect_right(starts, start) - 1], starts[i] if i < len(
        starts
    ) else entry.size


def check_chunks(entry: FileEntry, start: int, data: Any, where: str = "") -> list[int]:
    """Indices of the chunks of ``entry`` in ``data`` (read from ``start``, a span from
    ``chunk_span``) whose checksums differ from the manifest's."""
    got = Checksum.like(entry, where, start)
    got.update(data)
    return mismatched_chunks(entry, start, got)


def mismatched_chunks(entry: FileEntry, start: int, got: Checksum) -> list[int]:
    """Indices of the chunks of ``entry`` that ``got`` (a ``Checksum.like(entry, start=start)``
    over whole chunks from ``start``, a chunk's start) disagrees with."""
    first = bisect.bisect_right(entry.chunk_starts(), start) - 1 if entry.chunk_bytes else 0
    mine, want = got.hexdigest(), entry.digest[8 * first :]
    return [first + i // 8 for i in range(0, len(mine), 8) if mine[i : i + 8] != want[i : i + 8]]
