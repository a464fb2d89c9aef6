"""Reading a remote file ahead only where the reader will go (``Storage.open(ahead=)``).

fsspec's buffered files read ahead by one block after every read that misses (s3fs: 50 MiB),
wherever it is. For a checkpoint that is wrong both ways: a resharded rank that reads a few
rows of an item fetched a whole block after them (the rows of a 16 MiB item cost 50 MB), and
a file read front to back in 16 MiB items took a request of one block plus one item, then
another for the rest (two requests for a 64 MiB file; moto copies the object for each).
``ReadAhead`` opens the file without fsspec's cache (every read of it one request for
exactly its bytes) and reads ahead itself, only inside the spans the caller says it will read
front to back, never past their ends.
"""

from __future__ import annotations

import bisect
import io
from typing import Any

__all__ = ["STREAM_BLOCK", "ReadAhead"]

# Bytes fetched per request inside a span (a read that asks for more fetches what it asks):
# most checkpoint files in one request; a reader holds one such block.
STREAM_BLOCK = 128 << 20


class ReadAhead(io.RawIOBase):
    """``raw`` (a file that fetches exactly what each read asks) read ahead inside ``spans``
    (``(lo, hi)`` byte ranges): a read that starts in a span fetches from there up to
    ``STREAM_BLOCK`` bytes or its own length, whichever is more, never past the span's end;
    a read elsewhere fetches exactly its bytes. Holds the last block fetched; ``read`` gives
    views into it."""

    def __init__(self, raw: Any, spans: list[tuple[int, int]]) -> None:
        super().__init__()
        self._raw = raw
        self._spans = sorted(spans)
        self._starts = [lo for lo, _ in self._spans]
        self._pos = 0
        self._block: memoryview = memoryview(b"")
        self._at = 0  # file offset of the block's first byte

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def _size(self) -> int:
        size = getattr(self._raw, "size", None)  # (fsspec's files know it)
        return size if isinstance(size, int) else self._raw.seek(0, io.SEEK_END)

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos}.get(whence)
        self._pos = (self._size() if base is None else base) + pos
        return self._pos

    def _fetch_end(self, want_end: int) -> int:
        """Where a fetch from the current position ends, for a read up to ``want_end``."""
        i = bisect.bisect_right(self._starts, self._pos) - 1
        if i >= 0 and self._pos < self._spans[i][1]:
            return max(want_end, min(self._spans[i][1], self._pos + STREAM_BLOCK))
        return want_end

    def _held(self, want: int) -> int:
        """The offset in the block of the current position, fetching a block from there
        first (for a read of ``want`` bytes) if it is not in the one held; -1 at the end."""
        off = self._pos - self._at
        if not 0 <= off < len(self._block):
            self._raw.seek(self._pos)
            data = self._raw.read(self._fetch_end(self._pos + want) - self._pos)
            if not data:  # end of file
                return -1
            self._block, self._at, off = memoryview(data), self._pos, 0
        return off

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        done = 0
        while done < len(mv) and (off := self._held(len(mv) - done)) >= 0:
            n = min(len(mv) - done, len(self._block) - off)
            mv[done : done + n] = self._block[off : off + n]
            done += n
            self._pos += n
        return done

    def read(self, size: int | None = -1) -> bytes:
        """``size`` bytes (all to the end without it): a read-only view into the block when
        they lie in it (no copy: it keeps the block alive while it is held), else bytes."""
        if size is None or size < 0:
            size = max(0, self._size() - self._pos)
        off = self._held(size) if size else -1
        if off >= 0 and off + size <= len(self._block):
            self._pos += size
            return self._block[off : off + size]  # type: ignore[return-value]  # (bytes-like)
        buf = bytearray(size)
        del buf[self.readinto(buf) :]
        return bytes(buf)

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            self._block = memoryview(b"")
            super().close()
