"""Where a local load's time goes: the steps of the reader's pipeline, one at a time.

Writes ``--threads`` plain files of ``--size-gib`` in all, reads them once (page cache), and
then times, with one thread per file, interleaved and median over ``--repeat`` rounds:

* ``plain 16 MiB``: ``readinto`` a reused 16 MiB buffer (``bench_checkpoint``'s reference);
* ``pread``: ``preadv`` in ``--chunk-mib`` chunks into a reused pageable buffer;
* ``pread into tensor``: ``preadv`` in chunks straight into a CPU tensor of the file's size
  (allocated and touched before: live parameters), as ``FileLoad`` does for CPU targets; the
  bytes land in memory, which a reused buffer (above) never has to do;
* ``pread into tensor +crc32c overlapped``: the checksum on a second thread per file, a chunk
  behind the reads (what a pipelined reader could reach where cores are free);
* ``pread pinned``: the same into two alternating page-locked buffers (CUDA only);
* ``+crc32c``: the chunk through the checksum right after it is read;
* ``+h2d``: each chunk copied to a device tensor on the current stream while the next one is
  read (an event per buffer), as ``FileLoad`` does for CUDA targets; ``stream`` variants use a
  stream per thread;
* ``+crc32c+h2d``: the pipeline of a verified load into CUDA tensors.

Each line prints its ratio to ``plain 16 MiB`` measured in the same run. Run:
``python -m benchmarks.bench_read_path --size-gib 4 --threads 4 [--chunk-mib 4]``.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from muon_ckpt.store._crc import crc_function, implementation
from offload import pinned_empty

MiB = 1 << 20


def _write(paths: list[str], each: int) -> None:
    block = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8).numpy().tobytes()
    for p in paths:
        with open(p, "wb") as f:
            left = each
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n


def _threads(fn: Callable[[int], None], n: int) -> float:
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    args = ap.parse_args()

    T, chunk = args.threads, args.chunk_mib * MiB
    each = int(args.size_gib * (1 << 30)) // T // chunk * chunk
    root = args.dir or tempfile.mkdtemp(prefix="muon_ckpt_readpath_")
    os.makedirs(root, exist_ok=True)
    paths = [os.path.join(root, f"part{i}") for i in range(T)]
    _write(paths, each)
    crc = crc_function("crc32c")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.init()
        targets = [torch.empty(each, dtype=torch.uint8, device="cuda") for _ in range(T)]
        pinned = [[pinned_empty(chunk, pin=True) for _ in range(2)] for _ in range(T)]
        streams = [torch.cuda.Stream() for _ in range(T)]

    def plain(i: int) -> None:
        buf = bytearray(16 * MiB)
        with open(paths[i], "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    host = [torch.ones(each, dtype=torch.uint8) for _ in range(T)]

    def into_tensor(check: bool) -> Callable:
        def run(i: int) -> None:
            dst = memoryview(host[i].numpy())
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                c = 0
                for p in range(0, each, chunk):
                    os.preadv(fd, [dst[p : p + chunk]], p)
                    if check:
                        c = crc(c, dst[p : p + chunk])
            finally:
                os.close(fd)

        return run

    def into_tensor_overlapped(i: int) -> None:
        dst = memoryview(host[i].numpy())
        done: queue.Queue[int | None] = queue.Queue()

        def check() -> None:
            c = 0
            while (p := done.get()) is not None:
                c = crc(c, dst[p : p + chunk])

        checker = threading.Thread(target=check)
        checker.start()
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            for p in range(0, each, chunk):
                os.preadv(fd, [dst[p : p + chunk]], p)
                done.put(p)
        finally:
            done.put(None)
            os.close(fd)
            checker.join()

    def chunked(pin: bool, check: bool, h2d: bool, own_stream: bool = False) -> Callable:
        def run(i: int) -> None:
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                if pin:
                    bufs = pinned[i]
                    views = [memoryview(b.numpy()) for b in bufs]
                else:
                    views = [memoryview(bytearray(chunk))] * 2
                events = [torch.cuda.Event(), torch.cuda.Event()] if h2d else []
                stream = (
                    streams[i] if own_stream else (torch.cuda.current_stream() if h2d else None)
                )
                c = 0
                for k, p in enumerate(range(0, each, chunk)):
                    j = k % 2
                    if h2d:
                        events[j].synchronize()
                    os.preadv(fd, [views[j]], p)
                    if check:
                        c = crc(c, views[j])
                    if h2d:
                        with torch.cuda.stream(stream):
                            targets[i][p : p + chunk].copy_(bufs[j], non_blocking=True)
                            events[j].record(stream)
                for e in events:
                    e.synchronize()
            finally:
                os.close(fd)

        return run

    variants: dict[str, Callable[[int], None]] = {
        "plain 16 MiB": plain,
        "pread": chunked(False, False, False),
        "pread +crc32c": chunked(False, True, False),
        "pread into tensor": into_tensor(False),
        "pread into tensor +crc32c": into_tensor(True),
        "pread into tensor +crc32c overlapped": into_tensor_overlapped,
    }
    if cuda:
        variants |= {
            "pread pinned": chunked(True, False, False),
            "pread pinned +crc32c": chunked(True, True, False),
            "pread pinned +h2d": chunked(True, False, True),
            "pread pinned +h2d stream": chunked(True, False, True, own_stream=True),
            "pread pinned +crc32c+h2d": chunked(True, True, True),
            "pread pinned +crc32c+h2d stream": chunked(True, True, True, own_stream=True),
        }
    for fn in variants.values():  # warm: page cache, buffers, CUDA context
        _threads(fn, T)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.repeat):
        order = list(variants)
        order = order[r % len(order) :] + order[: r % len(order)]
        for k in order:
            times[k].append(_threads(variants[k], T))
    total = each * T
    print(
        f"{total / (1 << 30):.2f} GiB in {T} files, {T} threads, {args.chunk_mib} MiB chunks; "
        f"CRC32C: {implementation()}; torch {torch.__version__}; cuda {cuda}"
    )
    ref = statistics.median(times["plain 16 MiB"])
    for k, xs in times.items():
        m = statistics.median(xs)
        print(f"  {k:<40} {total / m / 1e9:7.2f} GB/s  {ref / m:5.2f}x plain")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
