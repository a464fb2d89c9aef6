"""Copies into CUDA tensors straight out of the page cache: off unless
``MUON_CKPT_MAPPED_READS=1``.

Off by default: measured on the 16-core H200 host with the reading threads a load now uses
there (8), 4 GiB loads into CUDA tensors ran 1.09-1.39x faster through the page-locked chunks
in five of six same-run comparisons (0.95x in the sixth); with 4 threads, mapped reads were
0.94-1.18x as fast as the chunks (docs/benchmarks.md, "Reading threads and mapped reads").
Page-locking holds a driver lock that the reading threads' copy launches wait for, and more
reading threads wait more.

The other way to a CUDA tensor (``pread`` into a page-locked chunk, then the copy) moves every
byte through host memory twice more than a plain read does; on a host whose memory bandwidth
is the limit (the H200 host: docs/benchmarks.md) that caps a load at about 0.75x of plain
reads before any checksum. Here the file is mapped read-only (``mmap``), the mapped pages are
page-locked with CUDA (``cudaHostRegister``, read-only: the page cache's own pages, no copy)
a piece at a time, and the copy to the device reads them where they are. The checksum reads
the same mapped pages.

Page-locking costs about as much host time per byte as the checksum, so pieces (growing
from ``FIRST`` to ``PIECE`` bytes) are registered on registrar threads (``_registrar``), the
next piece while the current one is copied and checked, and unregistered once the copies out
of them are done, on releaser threads (``_releaser``: they wait for copies, which may queue
behind other GPU work, and must not hold up a registration); a file load hands its mapping to
those threads when it ends (``close_later``), and the reader waits for all of them before
the load returns. The
registrar threads also keep a failed registration's CUDA error away from the reading threads
(the runtime reports it to the next kernel launch of the thread that made the call): when
registration fails (a file system whose pages cannot be locked, out of memory), the load
copies the rest of that file through the page-locked chunks, after one warning per file
system; after ``_REFUSE_AFTER`` failures in a row on a file system, its files are not mapped
again.

A file must not be truncated while it is mapped: reading a mapped page past the end of a
file kills the process (SIGBUS) where ``pread`` would return short. The files of a committed
step are never written again; the caller checks each file's size before it maps it.
``MUON_CKPT_MAPPED_READS=1`` turns this path on (else the chunk path is used everywhere).
"""

from __future__ import annotations

import bisect
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

PIECE = 128 << 20  # bytes page-locked per registration at most (a multiple of the page size)
FIRST = 8 << 20  # the first piece of a mapping: the size the reads wait for
_PAGE = mmap.PAGESIZE
_REGISTER_FLAGS = 0x01 | 0x08  # cudaHostRegisterPortable | cudaHostRegisterReadOnly
ENV = "MUON_CKPT_MAPPED_READS"

_REFUSE_AFTER = 3  # failed mappings on one file system before its files are read in chunks

_lock = threading.Lock()
_pools: dict[str, ThreadPoolExecutor] = {}
_failures: dict[int, int] = {}  # file system (st_dev) -> mappings that failed on it


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
    """Whether copies from the file ``fd`` to CUDA tensors go through a mapping: when
    ``MUON_CKPT_MAPPED_READS=1`` and its file system has not refused too often."""
    if _LIBC is None or os.environ.get(ENV, "0") != "1":
        return False
    return _failures.get(os.fstat(fd).st_dev, 0) < _REFUSE_AFTER


def _registrar() -> ThreadPoolExecutor:
    """The threads that page-lock pieces (they wait for nothing but the call)."""
    return _threads("pin", 8)


def _releaser() -> ThreadPoolExecutor:
    """The threads that unregister pieces and unmap files: each waits for copies first (which
    may queue behind other GPU work), so they never hold up a registration."""
    return _threads("unpin", 4)


def _threads(name: str, n: int) -> ThreadPoolExecutor:
    with _lock:
        if name not in _pools:
            _pools[name] = ThreadPoolExecutor(n, thread_name_prefix=f"muon_ckpt-{name}")
        return _pools[name]


def _register(device: torch.device, addr: int, n: int) -> None:
    cudart = torch.cuda.cudart()
    with torch.cuda.device(device):  # a thread's current device is 0 until set
        err = cudart.cudaHostRegister(addr, n, _REGISTER_FLAGS)
    if int(err) != 0:
        raise Unmappable(f"cudaHostRegister: {cudart.cudaGetErrorString(err)}")


def _unregister(device: torch.device, addr: int, events: list[torch.cuda.Event] | None) -> None:
    """Unregister the piece at ``addr`` once the copies out of it are done: after ``events``
    (None: after everything queued on ``device``)."""
    cudart = torch.cuda.cudart()
    with torch.cuda.device(device):  # (as _register: no context on device 0 from here)
        if events is None:
            torch.cuda.synchronize(device)
        for event in events or ():
            event.synchronize()
        err = cudart.cudaHostUnregister(addr)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostUnregister: {cudart.cudaGetErrorString(err)}")


def _finish(
    device: torch.device,
    addr: int,
    length: int,
    pieces: list[tuple[int, Future[None], list[torch.cuda.Event] | None]],
    released: list[Future[None]],
) -> None:
    """On a releaser thread: unregister each piece once its copies are done, then unmap.
    The registrations waited for here run on the registrar threads, which wait for nothing;
    the unregistrations were submitted to the releaser threads before this task, so they have
    started. A piece
    that could not be unregistered keeps the mapping (leaked rather than unmapped under a
    registration that a later mapping of the same addresses would run into)."""
    assert _LIBC is not None
    failed: list[BaseException] = []
    for at, fut, events in pieces:
        if fut.exception() is None:  # (waits for its registration to end)
            try:
                _unregister(device, addr + at, events)
            except Exception as e:
                failed.append(e)
    failed += [e for f in released if (e := f.exception()) is not None]
    if failed:
        raise failed[0]
    _LIBC.munmap(addr, length)


class MappedFile:
    """Bytes ``[lo, hi)`` of the open file ``fd`` mapped read-only for copies to ``device``.

    Use :meth:`reach` for the bytes available from an offset (their piece registered by then,
    the next one on its way), :meth:`host` / :meth:`view` for a tensor / buffer over them,
    :meth:`copied` after each copy out of them, and :meth:`close` or :meth:`close_later`
    (always: it waits for the copies, unregisters and unmaps).

    Pieces grow from ``FIRST`` bytes to ``PIECE``: the first registration, which the reads
    wait for, is short; the later ones are made while the reads run."""

    def __init__(self, fd: int, lo: int, hi: int, device: torch.device) -> None:
        assert _LIBC is not None
        self._device = device
        self._dev = os.fstat(fd).st_dev
        self._lo = lo - lo % _PAGE
        self._len = hi - self._lo
        self._starts = [0]  # piece k: [starts[k], starts[k + 1]) from lo (the last: to len)
        size = FIRST
        while self._starts[-1] + size < self._len:
            self._starts.append(self._starts[-1] + size)
            size = min(2 * size, PIECE)
        addr = _LIBC.mmap(None, self._len, mmap.PROT_READ, mmap.MAP_SHARED, fd, self._lo)
        if addr is None or addr == _MAP_FAILED:
            self._refuse(os.strerror(ctypes.get_errno()))
        self._addr: int = addr
        self._pieces: dict[int, Future[None]] = {}  # registered (or being registered)
        self._streams: dict[int, set[torch.cuda.Stream]] = {}  # copying out of each piece
        self._released: list[Future[None]] = []

    def _refuse(self, why: str) -> None:
        """Count a failure on this file system, warn the first time, raise Unmappable."""
        with _lock:
            n = _failures[self._dev] = _failures.get(self._dev, 0) + 1
        if n == 1:
            log.warning(
                "muon_ckpt: cannot page-lock a mapped checkpoint file on this file system "
                "(device %d: %s); the load copies it to the GPU through page-locked buffers "
                "instead (slower), as it will every file there after %d such failures",
                self._dev,
                why,
                _REFUSE_AFTER,
            )
        raise Unmappable(why)

    def _span(self, k: int) -> tuple[int, int]:
        """Piece ``k``'s bytes from ``lo``; its end rounded up to a page (the last page of
        the file is mapped whole)."""
        a = self._starts[k]
        b = self._starts[k + 1] if k + 1 < len(self._starts) else self._len
        return a, b + -b % _PAGE

    def _submit(self, k: int) -> None:
        if k < len(self._starts) and k not in self._pieces:
            a, b = self._span(k)
            self._pieces[k] = _registrar().submit(_register, self._device, self._addr + a, b - a)

    def reach(self, at: int, n: int) -> int:
        """How many of the ``n`` bytes from file offset ``at`` lie in one piece, that piece
        registered (raises Unmappable if it cannot be)."""
        rel = at - self._lo
        k = bisect.bisect_right(self._starts, rel) - 1
        self._submit(k)
        try:
            self._pieces[k].result()
        except Unmappable as e:
            self._refuse(str(e))
        if self._dev in _failures:  # refused after that many failures in a row
            with _lock:
                _failures.pop(self._dev, None)
        self._submit(k + 1)  # registered while this one is copied
        for j in [j for j in self._pieces if j < k - 1]:  # behind the reads: let go
            self._release(j)
        return min(n, self._span(k)[1] - rel)

    def _events(self, k: int) -> list[torch.cuda.Event] | None:
        """Events after the copies queued out of piece ``k`` (one per stream); None when
        they cannot be recorded (a CUDA error): then the whole device is waited for."""
        try:
            events = []
            for stream in self._streams.get(k, ()):
                events.append(torch.cuda.Event(blocking=True))  # waited for without spinning
                events[-1].record(stream)
            return events
        except Exception:
            return None

    def _release(self, k: int) -> None:
        events = self._events(k)
        fut = self._pieces.pop(k)
        self._streams.pop(k, None)
        if fut.exception() is None:
            addr = self._addr + self._starts[k]
            unregister = _releaser().submit(_unregister, self._device, addr, events)
            self._released.append(unregister)

    def host(self, at: int, n: int) -> torch.Tensor:
        """A uint8 CPU tensor over the ``n`` mapped bytes from file offset ``at``."""
        return torch.frombuffer(self.view(at, n), dtype=torch.uint8)

    def view(self, at: int, n: int) -> Any:
        """A buffer over the ``n`` mapped bytes from file offset ``at`` (read it only)."""
        return (ctypes.c_uint8 * n).from_address(self._addr + at - self._lo)

    def copied(self, at: int, stream: torch.cuda.Stream) -> None:
        """A copy out of the piece that holds file offset ``at`` was queued on ``stream`` (an
        event is recorded there when the piece is let go: one per piece, not per copy)."""
        k = bisect.bisect_right(self._starts, at - self._lo) - 1
        self._streams.setdefault(k, set()).add(stream)

    def close_later(self) -> Future[None]:
        """Let go of the mapping without waiting: a releaser thread waits for the copies,
        unregisters and unmaps; the future says when that is done (and raises its error).
        Use nothing of the mapping after this."""
        pieces = [(self._starts[k], fut, self._events(k)) for k, fut in self._pieces.items()]
        released, self._pieces, self._released = self._released, {}, []
        return _releaser().submit(_finish, self._device, self._addr, self._len, pieces, released)

    def close(self) -> None:
        """``close_later`` and wait for it."""
        self.close_later().result()
