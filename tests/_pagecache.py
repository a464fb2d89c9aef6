"""The page cache of a step's files: how much of them is resident, and evicting them, for the
cold-load tests and ``benchmarks/bench_resume`` (Linux)."""

from __future__ import annotations

import ctypes
import os

MiB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
_libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def resident_bytes(paths: list[str]) -> int:
    """Bytes of ``paths`` in the page cache (``mincore`` over a shared read-only mapping)."""
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {p}")
            try:
                vec = (ctypes.c_ubyte * (-(-size // page)))()
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {p}")
                total += sum(b & 1 for b in vec) * page
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


def evict(paths: list[str]) -> None:
    """Write back and drop every page of ``paths``; raise if any page stays resident."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    left = resident_bytes(paths)
    if left:
        raise RuntimeError(
            f"posix_fadvise(DONTNEED) left {left / MiB:.1f} MiB of {len(paths)} files in the "
            "page cache: this machine ignores the advice, so nothing can be read cold here"
        )


def step_files(url: str, step: int) -> list[str]:
    """Every file a local step reads: its directory's, and the data files its manifest names
    (format 3 keeps them in the run's ``data/``, outside the step directory)."""
    from muon_ckpt.store import Storage, step_dirname
    from tests._ckpt import data_files

    st, name = Storage(url), step_dirname(step)
    own = [st.path(name, n) for n in sorted(os.listdir(st.path(name)))]
    return own + sorted({st.path(name, n) for n in data_files(st, step)} - set(own))
