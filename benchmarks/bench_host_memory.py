"""What an all-or-nothing load's second copy of the state costs on this host: the copy itself
against the memory it goes to, and the read and checksum it runs beside.

A load that can be undone holds two versions of every tensor it overwrites until the ranks
agree (the old one, or the new one read aside). The copy between them runs at memory speed;
memory that is not faulted in yet costs a page fault per 4 KiB page, and freeing it another
pass over the pages. Each line: the first of ``--rounds`` and their median, one thread,
``--mib`` MiB (the first round of fresh memory is what a process's first load meets):

* ``copy into faulted memory``: ``copy_`` into a buffer written before (a buffer kept);
* ``copy into fresh memory``: ``torch.empty`` then ``copy_`` (a buffer allocated per load);
* ``copy into fresh memory, MADV_HUGEPAGE``: the same with transparent huge pages asked for;
* ``free``: freeing that fresh buffer (``munmap`` of its pages);
* ``pread (page cache) into faulted memory`` / ``into fresh memory``: a hot file read;
* ``pread + CRC32C, 4 MiB at a time``: a verified read, each chunk checksummed while in cache.

Usage::

    python -m benchmarks.bench_host_memory --mib 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from muon_ckpt.store.checksums import Checksum

MiB = 1 << 20
CHUNK = 4 * MiB
_HUGE = 2 * MiB


def _advise_huge(t: torch.Tensor) -> None:
    """``madvise(MADV_HUGEPAGE)`` over the 2 MiB-aligned inside of ``t``'s memory."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    p, n = t.data_ptr(), t.numel() * t.element_size()
    lo, hi = -(-p // _HUGE) * _HUGE, (p + n) // _HUGE * _HUGE
    if hi > lo:
        libc.madvise(lo, hi - lo, mmap.MADV_HUGEPAGE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the file read goes (default: temp)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.mib * MiB
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    kept = torch.empty(n, dtype=torch.uint8)
    kept.fill_(0)
    rows: list[tuple[str, float, float]] = []

    def best(name: str, fn: Callable[[], float | None]) -> None:
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            got = fn()
            times.append(got if got is not None else time.perf_counter() - t0)
        rows.append((name, times[0], statistics.median(times)))

    def fresh(huge: bool) -> None:
        buf = torch.empty(n, dtype=torch.uint8)
        if huge:
            _advise_huge(buf)
        buf.copy_(src)

    def free() -> float:
        buf = torch.empty(n, dtype=torch.uint8)
        buf.copy_(src)
        t0 = time.perf_counter()
        del buf
        return time.perf_counter() - t0

    best("copy into faulted memory", lambda: _discard(kept.copy_(src)))
    best("copy into fresh memory", lambda: fresh(False))
    best("copy into fresh memory, MADV_HUGEPAGE", lambda: fresh(True))
    best("free that fresh memory", free)

    fd_dir = tempfile.mkdtemp(dir=args.dir, prefix="muon_ckpt_hostmem_")
    path = os.path.join(fd_dir, "data")
    try:
        with open(path, "wb") as f:
            f.write(memoryview(src.numpy()))
        fd = os.open(path, os.O_RDONLY)
        try:

            def pread(dst: memoryview, crc: bool) -> None:
                chk = Checksum("crc32c", MiB) if crc else None  # per 1 MiB chunk, as saved
                for p in range(0, n, CHUNK):
                    view = dst[p : p + CHUNK]
                    os.preadv(fd, [view], p)
                    if chk is not None:
                        chk.update(view)

            pread(memoryview(kept.numpy()), False)  # in the page cache from here on
            best("pread (page cache) into faulted memory", lambda: pread(_bytes(kept), False))
            best(
                "pread (page cache) into fresh memory",
                lambda: pread(_bytes(torch.empty(n, dtype=torch.uint8)), False),
            )
            best("pread + CRC32C, 4 MiB at a time, faulted", lambda: pread(_bytes(kept), True))
        finally:
            os.close(fd)
    finally:
        os.unlink(path)
        os.rmdir(fd_dir)
    gib = n / (1 << 30)
    print(f"{args.mib} MiB, one thread, {args.rounds} rounds; torch {torch.__version__}")
    print(f"{'':42} {'first':>12} {'median':>12}")
    for name, first, med in rows:
        print(f"{name:42} {first / gib:8.3f} s/GiB {med / gib:6.3f} s/GiB")


def _discard(_: object) -> None:
    return None


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy())


if __name__ == "__main__":
    main()
