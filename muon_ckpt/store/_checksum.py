"""File checksums: the one place that knows the algorithm (zlib crc32) and reads whole files.

A manifest records each file's size and crc32 as 8 hex digits; writers chain ``update`` over
the bytes they write, readers over the bytes they read, and ``file_checksum`` reads a stored
file front to back through one reused buffer per thread.
"""

from __future__ import annotations

import threading
import zlib
from typing import Any

__all__ = ["crc_hex", "file_checksum", "update"]

_CHUNK = 16 << 20
_tls = threading.local()


def update(crc: int, data: Any) -> int:
    """The running checksum after ``data`` (bytes-like, released GIL for large buffers)."""
    return zlib.crc32(data, crc)


def crc_hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


def _buffer() -> bytearray:
    # One reused buffer per thread: a fresh 16 MiB bytes object per read would be a fresh
    # mmap, page-faulted in on every read (slower than the read itself from the page cache).
    buf = getattr(_tls, "buf", None)
    if buf is None:
        buf = _tls.buf = bytearray(_CHUNK)
    return buf


def file_checksum(f: Any, progress: Any = None) -> tuple[int, str]:
    """``(size, crc32 hex)`` of everything readable from the open binary file ``f``;
    ``progress(n)`` is called after each chunk when given."""
    buf = _buffer()
    view = memoryview(buf)
    crc, size = 0, 0
    while n := f.readinto(buf):
        crc, size = zlib.crc32(view[:n], crc), size + n
        if progress is not None:
            progress(n)
    return size, crc_hex(crc)
