"""Load speed by tensor size: ``CheckpointManager.load()`` against plain reads of its files.

A load pays per stored item (its zip records parsed, its target resolved, its copies
launched) on top of its bytes, so the same gigabytes load slower in many small tensors than
in a few large ones. For each ``--tensor-mib``, the same state size is saved once as square
fp32 matrices of that size (parameters and Muon momentum), then loaded with
``verify="checksum"`` and ``verify="size"``, interleaved with plain reads of the step's own
files (one stream per file into a reused 16 MiB buffer: the reference). On CUDA the loads also
run with mapped reads off (``MUON_CKPT_MAPPED_READS=0``: every copy to the GPU through the
page-locked chunks). Loads read what was just written, from the page cache.

Usage::

    python -m benchmarks.bench_load_items --device cuda --size-gib 4 --tensor-mib 4 16 64
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
from muon_ckpt import CheckpointManager
from muon_ckpt.io._mapped import ENV as MAPPED_ENV

MiB = 1 << 20


def plain_reads(paths: list[str]) -> None:
    """Every file read by a stream of its own into a reused 16 MiB buffer."""

    def one(path: str) -> None:
        buf = bytearray(16 * MiB)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    threads = [threading.Thread(target=one, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _mapped_off(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        os.environ[MAPPED_ENV] = "0"
        try:
            fn()
        finally:
            os.environ.pop(MAPPED_ENV)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto")
    ap.add_argument("--size-gib", type=float, default=1.0, help="state size per tensor size")
    ap.add_argument("--tensor-mib", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--url", default=None, help="a local directory (default: a temp dir)")
    args = ap.parse_args()
    dev = pick_device(args.device)
    root = args.url or tempfile.mkdtemp(prefix="muon_ckpt_items_")
    print(f"{args.size_gib} GiB on {dev}, io_threads={args.io_threads}, torch {torch.__version__}")
    for mib in args.tensor_mib:
        model, opt = build_state(args.size_gib, dev.type, mib)
        url = os.path.join(root, f"t{mib}")
        shutil.rmtree(url, ignore_errors=True)
        mgrs = {
            v: CheckpointManager(
                url, model=model, optimizer=opt, io_threads=args.io_threads, verify=v
            )
            for v in ("checksum", "size")
        }
        mgrs["checksum"].save(1, force=True)
        step = os.path.join(url, "step-00000001")
        files = [os.path.join(step, f) for f in sorted(os.listdir(step)) if f.endswith(".distcp")]
        nbytes = sum(os.path.getsize(f) for f in files)
        fns: dict[str, Callable[[], object]] = {"plain reads": lambda f=files: plain_reads(f)}
        for v, m in mgrs.items():
            fns[f"load, verify={v}"] = lambda m=m: m.load(1)
            if dev.type == "cuda":
                fns[f"load, verify={v}, mapped reads off"] = _mapped_off(lambda m=m: m.load(1))
        t = time_interleaved(fns, dev, iters=args.repeat, warmup=1)
        items = 2 * len(list(model.parameters()))
        print(
            f"{mib} MiB tensors: {items} items in {len(files)} files, {nbytes / (1 << 30):.2f} GiB"
        )
        for k, s in t.items():
            ratio = t["plain reads"] / s
            print(f"  {k:<38} {s:7.3f} s  {nbytes / s / 1e9:6.2f} GB/s  {ratio:5.2f}x plain reads")
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
