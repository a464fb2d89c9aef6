"""Copies into CUDA tensors straight out of the page cache.

The other way to a CUDA tensor (``pread`` into a page-locked chunk, then the copy) moves every
byte through host memory twice more than a plain read does; on a host whose memory bandwidth
is the limit (the H200 host: docs/benchmarks.md) that caps a load at about 0.75x of plain
reads before any checksum. Here the file is mapped read-only (``mmap``), the mapped pages are
page-locked with CUDA (``cudaHostRegister``, read-only: the page cache's own pages, no copy)
a piece at a time, and the copy to the device reads them where they are. The checksum reads
the same mapped pages.

Page-locking costs about as much host time per byte as the checksum, so pieces of ``PIECE``
bytes are registered on registrar threads (``_registrar``), the next piece while the current
one is copied and checked, and unregistered once the copies out of them are done. The
registrar threads also keep a failed registration's CUDA error away from the reading threads
(the runtime reports it to the next kernel launch of the thread that made the call): when
registration fails (a file system whose pages cannot be locked, out of memory), loads of
files on that file system use the page-locked chunks instead, after one log line.

A file must not be truncated while it is mapped: reading a mapped page past the end of a
file kills the process (SIGBUS) where ``pread`` would return short. The files of a committed
step are never written again; the caller checks each file's size before it maps it.
``MUON_CKPT_MAPPED_READS=0`` turns this path off (the chunk path is then used everywhere).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["ENV", "MappedFile", "Unmappable", "mapped_reads"]

log = logging.getLogger("muon_ckpt")

PIECE = 128 << 20  # bytes page-locked per registration (a multiple of the page size)
_PAGE = mmap.PAGESIZE
_REGISTER_FLAGS = 0x01 | 0x08  # cudaHostRegisterPortable | cudaHostRegisterReadOnly
ENV = "MUON_CKPT_MAPPED_READS"

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_refused: set[int] = set()  # file systems (st_dev) whose pages could not be page-locked


class Unmappable(Exception):
    """The file's pages could not be mapped or page-locked: use the chunk path."""


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


_LIBC = _libc() if os.name == "posix" else None
_MAP_FAILED = ctypes.c_void_p(-1).value


def mapped_reads(fd: int) -> bool:
    """Whether copies from the file ``fd`` to CUDA tensors go through a mapping."""
    if _LIBC is None or os.environ.get(ENV, "1") == "0":
        return False
    return os.fstat(fd).st_dev not in _refused


def _registrar() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(8, thread_name_prefix="muon_ckpt-pin")
        return _pool


def _register(device: torch.device, addr: int, n: int) -> None:
    cudart = torch.cuda.cudart()
    with torch.cuda.device(device):  # a thread's current device is 0 until set
        err = cudart.cudaHostRegister(addr, n, _REGISTER_FLAGS)
    if int(err) != 0:
        raise Unmappable(f"cudaHostRegister: {cudart.cudaGetErrorString(err)}")


def _unregister(addr: int, events: list[torch.cuda.Event]) -> None:
    for event in events:
        event.synchronize()  # the copies out of the piece are done
    torch.cuda.cudart().cudaHostUnregister(addr)


class MappedFile:
    """Bytes ``[lo, hi)`` of the open file ``fd`` mapped read-only for copies to ``device``.

    Use :meth:`reach` for the bytes available from an offset (their piece registered by then,
    the next one on its way), :meth:`host` / :meth:`view` for a tensor / buffer over them,
    :meth:`copied` after each copy out of them, and :meth:`close` (always: it waits for the
    copies, unregisters and unmaps)."""

    def __init__(self, fd: int, lo: int, hi: int, device: torch.device) -> None:
        assert _LIBC is not None
        self._device = device
        self._dev = os.fstat(fd).st_dev
        self._lo = lo - lo % _PAGE
        self._len = hi - self._lo
        addr = _LIBC.mmap(None, self._len, mmap.PROT_READ, mmap.MAP_SHARED, fd, self._lo)
        if addr is None or addr == _MAP_FAILED:
            self._refuse(os.strerror(ctypes.get_errno()))
        self._addr: int = addr
        self._pieces: dict[int, Future[None]] = {}  # registered (or being registered)
        self._streams: dict[int, set[torch.cuda.Stream]] = {}  # copying out of each piece
        self._released: list[Future[None]] = []

    def _refuse(self, why: str) -> None:
        with _lock:
            first = self._dev not in _refused
            _refused.add(self._dev)
        if first:
            log.warning(
                "muon_ckpt: cannot page-lock mapped checkpoint files on this file system "
                "(device %d: %s); loads into CUDA tensors copy through page-locked buffers "
                "instead (slower)",
                self._dev,
                why,
            )
        raise Unmappable(why)

    def _submit(self, k: int) -> None:
        start = k * PIECE
        if start < self._len and k not in self._pieces:
            n = min(PIECE, self._len - start)
            n += -n % _PAGE  # the last page of the file is mapped whole
            addr = self._addr + start
            self._pieces[k] = _registrar().submit(_register, self._device, addr, n)

    def reach(self, at: int, n: int) -> int:
        """How many of the ``n`` bytes from file offset ``at`` lie in one piece, that piece
        registered (raises Unmappable if it cannot be)."""
        rel = at - self._lo
        k = rel // PIECE
        self._submit(k)
        try:
            self._pieces[k].result()
        except Unmappable as e:
            self._refuse(str(e))
        self._submit(k + 1)  # registered while this one is copied
        for j in [j for j in self._pieces if j < k - 1]:  # behind the reads: let go
            self._release(j)
        return min(n, (k + 1) * PIECE - rel)

    def _release(self, k: int) -> None:
        fut = self._pieces.pop(k)
        events = []
        for stream in self._streams.pop(k, ()):  # after the copies queued out of the piece
            events.append(torch.cuda.Event())
            events[-1].record(stream)
        if fut.exception() is None:
            self._released.append(_registrar().submit(_unregister, self._addr + k * PIECE, events))

    def host(self, at: int, n: int) -> torch.Tensor:
        """A uint8 CPU tensor over the ``n`` mapped bytes from file offset ``at``."""
        return torch.frombuffer(self.view(at, n), dtype=torch.uint8)

    def view(self, at: int, n: int) -> Any:
        """A buffer over the ``n`` mapped bytes from file offset ``at`` (read it only)."""
        return (ctypes.c_uint8 * n).from_address(self._addr + at - self._lo)

    def copied(self, at: int, stream: torch.cuda.Stream) -> None:
        """A copy out of the piece that holds file offset ``at`` was queued on ``stream`` (an
        event is recorded there when the piece is let go: one per piece, not per copy)."""
        self._streams.setdefault((at - self._lo) // PIECE, set()).add(stream)

    def close(self) -> None:
        """Wait for the copies, unregister every piece and unmap (also after a failure)."""
        assert _LIBC is not None
        try:
            for k in list(self._pieces):  # each waits for its registration first
                self._release(k)
        finally:
            failed = [e for f in self._released if (e := f.exception()) is not None]
            self._released.clear()
            _LIBC.munmap(self._addr, self._len)
        if failed:
            raise failed[0]
