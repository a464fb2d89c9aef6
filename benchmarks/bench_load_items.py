"""Load speed by tensor size: ``CheckpointManager.load()`` against plain reads of its files.

A load pays per stored item (its zip records parsed, its target resolved, its copies
launched) on top of its bytes, so the same gigabytes load slower in many small tensors than
in a few large ones. For each ``--tensor-mib``, the same state size is saved once as square
fp32 matrices of that size (parameters and Muon momentum), then loaded with
``verify="checksum"`` and ``verify="size"``, interleaved with plain reads of the step's own
files (``--streams`` per file, each into a reused 16 MiB buffer: the reference), with each
``--io-threads`` given (reading threads; default: the manager's choice). Loads read what was just written, from the
page cache.

Usage::

    python -m benchmarks.bench_load_items --device cuda --size-gib 4 --tensor-mib 4 16 64
    python -m benchmarks.bench_load_items --device cuda --size-gib 4 --io-threads 4 8 12 16
    python -m benchmarks.bench_load_items --size-gib 0.5 --tensor-mib 1 16
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
from collections.abc import Callable

import torch

from benchmarks._timing import pick_device, time_interleaved
from benchmarks.bench_checkpoint import build_state
from benchmarks.bench_resume import data_files
from muon_ckpt import CheckpointManager
from muon_ckpt._config import read_threads
from muon_ckpt.store import Storage

MiB = 1 << 20


def plain_reads(paths: list[str], streams: int = 1) -> None:
    """Every file read by ``streams`` streams (consecutive parts), each into a reused 16 MiB
    buffer."""

    def one(path: str, lo: int, hi: int) -> None:
        buf = memoryview(bytearray(16 * MiB))
        fd = os.open(path, os.O_RDONLY)
        try:
            while lo < hi and (n := os.preadv(fd, [buf[: min(len(buf), hi - lo)]], lo)):
                lo += n
        finally:
            os.close(fd)

    threads = []
    for p in paths:
        size = os.path.getsize(p)
        for i in range(streams):
            part = (p, size * i // streams, size * (i + 1) // streams)
            threads.append(threading.Thread(target=one, args=part))
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto")
    ap.add_argument("--size-gib", type=float, default=1.0, help="state size per tensor size")
    ap.add_argument("--tensor-mib", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument(
        "--io-threads",
        type=int,
        nargs="+",
        default=[None],
        help="loads with each of these reading threads (default: the manager's)",
    )
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2], help="plain reads per file")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--url", default=None, help="a local directory (default: a temp dir)")
    args = ap.parse_args()
    dev = pick_device(args.device)
    root = args.url or tempfile.mkdtemp(prefix="muon_ckpt_items_")
    threads = [read_threads(n) for n in args.io_threads]
    print(f"{args.size_gib} GiB on {dev}, {threads} reading threads, torch {torch.__version__}")
    for mib in args.tensor_mib:
        model, opt = build_state(args.size_gib, dev.type, mib)
        url = os.path.join(root, f"t{mib}")
        shutil.rmtree(url, ignore_errors=True)
        mgrs = {
            (v, n): CheckpointManager(url, model=model, optimizer=opt, io_threads=n, verify=v)
            for n in args.io_threads
            for v in ("checksum", "size")
        }
        with CheckpointManager(url, model=model, optimizer=opt) as saver:
            saver.save(1, force=True)
        files = sorted(p for p, _ in data_files(Storage(url), "step-00000001"))
        nbytes = sum(os.path.getsize(f) for f in files)
        fns: dict[str, Callable[[], object]] = {
            f"plain reads, {k * len(files)} streams": lambda f=files, k=k: plain_reads(f, k)
            for k in args.streams
        }
        for (v, n), m in mgrs.items():
            name = f"load, verify={v}" + (f", {read_threads(n)} threads" if n is not None else "")
            fns[name] = lambda m=m: m.load(1)
        t = time_interleaved(fns, dev, iters=args.repeat, warmup=1)
        items = 2 * len(list(model.parameters()))
        print(
            f"{mib} MiB tensors: {items} items in {len(files)} files, {nbytes / (1 << 30):.2f} GiB"
        )
        best = min(s for k, s in t.items() if k.startswith("plain"))
        for k, s in t.items():
            ratio = best / s
            print(f"  {k:<50} {s:7.3f} s  {nbytes / s / 1e9:6.2f} GB/s  {ratio:5.2f}x best plain")
        for m in mgrs.values():
            m.close()
        del model, opt, mgrs
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        shutil.rmtree(url, ignore_errors=True)
    if args.url is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
