"""Start the disk write of freshly written file bytes without waiting for it (Linux).

A save writes into the page cache at memory speed and then ``fsync``s each file; unless the
dirty pages exceed the kernel's background threshold (10% of RAM by default, more than most
checkpoints of one rank), the disk only starts writing at that fsync. Calling
``sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)`` right after each large write queues
those pages for write-out at once, so the disk works while the writer threads still copy, and
the final fsync has little left to do. It does not wait for the disk, does not drop the pages
from the cache, and promises nothing about durability: the fsync still does that.

Elsewhere (no glibc ``sync_file_range``: macOS, Windows) it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["start_writeback"]

_SYNC_FILE_RANGE_WRITE = 2


def _load() -> object | None:
    if not hasattr(os, "fsync") or os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Queue bytes ``[offset, offset + nbytes)`` of ``fd`` for write-out; never raises (the
    ctypes call releases the GIL, so other threads keep running while the kernel queues)."""
    if _sync_file_range is not None and nbytes > 0:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
