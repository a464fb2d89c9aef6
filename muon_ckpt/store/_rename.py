"""Swap two local directories atomically: ``renameat2(RENAME_EXCHANGE)`` (Linux >= 3.15,
glibc >= 2.28). Where that is missing (or the filesystem refuses it) two renames are the
fallback, with a window of a few microseconds in which the target name does not exist."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import uuid

__all__ = ["exchange"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _load() -> object | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load()


def exchange(a: str, b: str) -> None:
    """Afterwards ``a`` holds what ``b`` held and the other way round (both must exist)."""
    if _renameat2 is not None:
        rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err not in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: fall back below
            raise OSError(err, os.strerror(err), a)
    tmp = f"{a}.{uuid.uuid4().hex[:8]}"
    os.rename(b, tmp)
    os.rename(a, b)
    os.rename(tmp, a)
