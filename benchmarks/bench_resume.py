"""Resume at the speed of the machine: ``load()`` against the physical path, with the page
cache hot and cold, in a fresh process and in a warm one.

One step is saved per file layout (``--layouts``): ``one``, a single data file
(``io_threads=1``), and ``many``, the most files one rank writes (``io_threads=64``). Then each
of these reads it into targets on ``--device`` (allocated before the clock starts, as a
resumed model's are), each in a process of its own:

* ``physical``: the same data files, read by as many threads as ``load()`` reads with, cut
  into the same ≥ 32 MiB parts: on CUDA ``pread`` into two 4 MiB page-locked buffers per
  thread, each chunk copied to the GPU while the next one is read; on CPU ``pread`` straight
  into the target memory. Nothing else: no parsing, no checksum. From S3: plain ranged
  downloads of the same bytes by as many threads;
* ``load``: ``CheckpointManager.load()``, every byte checksummed (CRC32C);
* ``size``: ``load()`` with ``verify="size"``;
* ``dcp``: raw ``dcp.load`` of the same state dict from the same directory (DCP's
  ``FileSystemReader``; ``FsspecReader`` from S3).

``fresh``: the timed read is the process's first (page-locked buffers, the manager's staging
included, are allocated inside it); ``warm``: the same read once untimed first, then timed.
``hot``: the files were read just before (the untimed read of a warm process, or one plain
read); ``cold``: every file of the step is fsynced and evicted with
``posix_fadvise(POSIX_FADV_DONTNEED)`` right before the timed read, and ``mincore`` checks
that none of its pages is resident (the benchmark stops if the kernel ignored the advice).
``--caches`` and ``--processes`` pick among these (default all), ``--layouts`` and
``--methods`` among the others. Each case runs ``--rounds`` times (the order rotating);
medians are printed with their ratio
to ``physical`` of the same layout, cache and process state, and ``load`` against ``dcp``.
The per-phase split of one hot and one cold ``load`` follows (``last_load_timings``: the
``threads_*`` phases are seconds summed over the reading threads).

``--async-save``: the loading manager saves asynchronously, as a training job does that
overlaps its saves (its host buffers are then kept between calls, the load's backup in them).
After each timed read, one optimizer step's elementwise part is timed, then the next
(``step_seconds``): a load that left work undone would show up in the first.

The steps must fit the disk: one copy of the state per layout, plus a tenth and 1 GiB, must fit
the free space of ``--dir``; else ``--size-gib`` is shrunk to what fits, and the run says so.

Usage::

    python -m benchmarks.bench_resume --device cuda --size-gib 4 --dir /nvme/bench
    python -m benchmarks.bench_resume --device cpu --size-gib 1
    python -m benchmarks.bench_resume --device cpu --size-gib 0.5 --url moto
    python -m benchmarks.bench_resume --device cuda --size-gib 4 --layouts many \
        --methods physical load --processes fresh --rounds 3      # the GPU targets' figure
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from benchmarks._timing import fit_size_gib
from benchmarks.bench_checkpoint import build_state, start_moto
from muon_ckpt import CheckpointManager
from muon_ckpt._config import read_threads
from muon_ckpt.state import FlatState
from muon_ckpt.store import Storage
from muon_ckpt.store._layout import DATA, data_ref
from muon_ckpt.store._steps import read_manifest
from offload import pinned_empty
from tests._pagecache import evict

GiB, MiB = 1 << 30, 1 << 20
CHUNK = 4 * MiB
PART = 32 * MiB
METHODS = ("physical", "load", "size", "dcp")
LAYOUTS = {"one": 1, "many": 64}  # io_threads of the save: files of the step


# ---------------------------------------------------------------------- the physical path
def data_files(st: Storage, step_dir: str) -> list[tuple[str, int]]:
    """(path or URL, size) of the step's data files (DCP's ``.distcp``), largest first: the
    files its manifest names, in its own directory or (format 3) in the run's ``data/``."""
    out = []
    for name, entry in read_manifest(st, step_dir, None).files.items():
        if not name.endswith(".distcp"):
            continue
        ref = data_ref(name)
        parts = (DATA, *ref) if ref is not None else (step_dir, name)
        out.append((st.path(*parts) if st.is_local else st.url_of(*parts), entry.size))
    return sorted(out, key=lambda f: -f[1])


def parts_of(files: list[tuple[str, int]], threads: int) -> list[tuple[str, int, int, int]]:
    """(path, file offset, length, target offset): the files cut as the loader cuts them
    (≥ 32 MiB, about four parts per thread), largest first."""
    total = sum(n for _, n in files)
    each = max(PART, -(-total // (4 * threads)))
    parts, at = [], 0
    for path, size in files:
        for off in range(0, size, each):
            n = min(each, size - off)
            parts.append((path, off, n, at + off))
        at += size
    return sorted(parts, key=lambda p: -p[2])


def physical_local(
    parts: list[tuple[str, int, int, int]], target: torch.Tensor, threads: int
) -> None:
    """``pread`` each part into ``target`` (bytes): directly on CPU; on CUDA through two
    page-locked 4 MiB buffers per thread, each chunk's copy overlapping the next read."""
    todo: queue.SimpleQueue[tuple[str, int, int, int]] = queue.SimpleQueue()
    for p in parts:
        todo.put(p)
    cuda = target.device.type == "cuda"
    host = memoryview(target.numpy()) if not cuda else None
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            bufs: list[tuple[torch.Tensor, memoryview, Any]] = []
            if cuda:
                for _ in range(2):
                    b = pinned_empty(CHUNK, pin=True, device=target.device)
                    bufs.append((b, memoryview(b.numpy()), torch.cuda.Event()))
            stream = torch.cuda.current_stream(target.device) if cuda else None
            i = 0
            while True:
                try:
                    path, off, n, dst = todo.get_nowait()
                except queue.Empty:
                    break
                fd = os.open(path, os.O_RDONLY)
                try:
                    for p in range(0, n, CHUNK):
                        k = min(CHUNK, n - p)
                        if host is not None:
                            _pread_all(fd, host[dst + p : dst + p + k], off + p)
                            continue
                        buf, view, ev = bufs[i % 2]
                        ev.synchronize()
                        _pread_all(fd, view[:k], off + p)
                        target[dst + p : dst + p + k].copy_(buf[:k], non_blocking=True)
                        ev.record(stream)
                        i += 1
                finally:
                    os.close(fd)
            for _, _, ev in bufs:
                ev.synchronize()
        except BaseException as e:
            errors.append(e)

    _run_threads(worker, threads, errors)


def _run_threads(worker: Any, threads: int, errors: list[BaseException]) -> None:
    """``worker`` on ``threads`` threads, joined; the first error any of them kept, raised."""
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def _pread_all(fd: int, mv: memoryview, offset: int) -> None:
    done = 0
    while done < len(mv):
        got = os.preadv(fd, [mv[done:]], offset + done)
        if got == 0:
            raise EOFError(f"short read at {offset + done}")
        done += got


def physical_remote(
    st: Storage, parts: list[tuple[str, int, int, int]], target: torch.Tensor, threads: int
) -> None:
    """Plain ranged downloads of the same bytes by ``threads`` threads, into ``target``."""
    todo: queue.SimpleQueue[tuple[str, int, int, int]] = queue.SimpleQueue()
    for p in parts:
        todo.put(p)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            while True:
                try:
                    url, off, n, dst = todo.get_nowait()
                except queue.Empty:
                    return
                data = st.fs.cat_file(url, start=off, end=off + n)
                src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                target[dst : dst + n].copy_(src)
        except BaseException as e:
            errors.append(e)

    _run_threads(worker, threads, errors)


# ---------------------------------------------------------------------- one measurement
def step_seconds(opt: torch.optim.Optimizer) -> float:
    """One optimizer step's elementwise part over every parameter and its state (Muon's
    momentum and update, without Newton-Schulz: its compute is the same whatever the load
    did, and minutes on a small CPU), timed: what a load left undone would show up in."""
    dev = opt.param_groups[0]["params"][0].device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                buf = opt.state[p]["momentum_buffer"]
                buf.mul_(0.95).add_(p, alpha=1e-3)  # (the parameter stands in for its grad)
                p.add_(buf, alpha=-1e-3)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One timed read in this (fresh) process: ``spec`` says which; prints its result."""
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)  # the context exists before any resume reads
    st = Storage(spec["url"], spec["opts"])
    step_dir = spec["step_dir"]
    files = data_files(st, step_dir)
    threads = read_threads(None, st.is_local)
    method = spec["method"]
    run: Any
    mgr, opt = None, None
    if method == "physical":
        parts = parts_of(files, threads)
        target = torch.empty(sum(n for _, n in files), dtype=torch.uint8, device=device)
        target.fill_(1)  # touched, as live parameters are

        def run() -> None:
            if st.is_local:
                physical_local(parts, target, threads)
            else:
                physical_remote(st, parts, target, threads)

    else:
        model, opt = build_state(spec["size_gib"], spec["device"])
        if method == "dcp":
            flat = FlatState.build(model, opt, {})
            where = st.path(step_dir) if st.is_local else st.url_of(step_dir)

            def run() -> None:
                if st.is_local:
                    reader = dcp.FileSystemReader(where)
                else:
                    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

                    reader = FsspecReader(where, **spec["opts"])
                dcp.load(flat.sd, storage_reader=reader, no_dist=True)

        else:
            mgr = CheckpointManager(
                spec["url"],
                model=model,
                optimizer=opt,
                storage_options=spec["opts"],
                verify="size" if method == "size" else "checksum",
                async_save=spec.get("async_save", False),
            )

            def run() -> None:
                mgr.load(spec["step"])

    if spec["process"] == "warm":
        run()
    paths = [p for p, _ in files]
    if spec["cache"] == "cold":
        evict(paths)
    elif st.is_local and spec["process"] == "fresh":
        for p in paths:  # hot: the files read once before, by a plain read
            with open(p, "rb", buffering=0) as f:
                while f.read(16 * MiB):
                    pass
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    took = time.perf_counter() - t0
    out = {"seconds": took, "bytes": sum(n for _, n in files), "threads": threads}
    if opt is not None:  # the first step after the read, against the next one
        out["first_step"], out["next_step"] = step_seconds(opt), step_seconds(opt)
    if mgr is not None:
        out["phases"] = dict(mgr.last_load_timings)
        mgr.close()
    return out


# ---------------------------------------------------------------------- the run
def save_steps(url: str, opts: dict, size_gib: float, layouts: list[str]) -> dict[str, str]:
    """One step per layout, each in a run of its own under ``url``: layout -> run URL."""
    model, opt = build_state(size_gib, "cpu")
    runs = {}
    for name in layouts:
        run_url = f"{url.rstrip('/')}/{name}"
        with CheckpointManager(
            run_url, model=model, optimizer=opt, storage_options=opts, io_threads=LAYOUTS[name]
        ) as mgr:
            mgr.save(1, force=True)
        runs[name] = run_url
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--size-gib", type=float, default=1.0, help="state saved (half momentum)")
    ap.add_argument("--dir", default=None, help="local directory of the steps (default: temp)")
    ap.add_argument("--url", default=None, help="'moto': the steps on a local moto S3 server")
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--caches", nargs="+", choices=["hot", "cold"], default=["hot", "cold"])
    ap.add_argument("--processes", nargs="+", choices=["fresh", "warm"], default=["fresh", "warm"])
    ap.add_argument(
        "--async-save",
        action="store_true",
        help="the loading manager saves asynchronously (its host staging is kept between calls)",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return

    server, opts, tmp = None, {}, None
    if args.url == "moto":
        import s3fs

        server, opts = start_moto()
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(**opts).mkdir(bucket)
        url = f"s3://{bucket}"
        caches = ["-"]
    else:
        tmp = args.dir or tempfile.mkdtemp(prefix="muon_ckpt_resume_")
        url = os.path.join(tmp, f"resume-{uuid.uuid4().hex[:6]}")
        caches = list(args.caches)
        args.size_gib = fit_size_gib(
            args.size_gib, len(args.layouts), [tmp], "bench_resume (one step per layout)"
        )
    try:
        runs = save_steps(url, opts, args.size_gib, args.layouts)
        st = Storage(url, opts)
        info = st.child(args.layouts[0]).listdir()
        step_dir = next(n for n in info if n.startswith("step-"))
        print(
            f"{args.size_gib:g} GiB to {args.device}; {url}; torch {torch.__version__}; "
            f"{os.cpu_count()} cores; reading threads {read_threads(None, st.is_local)}"
        )
        cases = [
            (lay, cache, proc, m)
            for lay in args.layouts
            for cache in caches
            for proc in args.processes
            for m in args.methods
        ]
        got: dict[tuple[str, ...], list[dict[str, Any]]] = {c: [] for c in cases}
        for r in range(args.rounds):
            for c in cases[r % len(cases) :] + cases[: r % len(cases)]:
                lay, cache, proc, m = c
                spec = {
                    "device": args.device,
                    "url": runs[lay],
                    "opts": opts,
                    "step_dir": step_dir,
                    "step": 1,
                    "method": m,
                    "cache": cache,
                    "process": proc,
                    "size_gib": args.size_gib,
                    "async_save": args.async_save,
                }
                got[c].append(_spawn(spec))
        report(got, args.layouts, caches, args.methods, args.processes)
    finally:
        if server is not None:
            server.stop()
        if tmp is not None and args.dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp is not None:
            shutil.rmtree(url, ignore_errors=True)


def _spawn(spec: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_resume", "--child", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"{spec['method']} ({spec}) failed:\n{done.stdout}\n{done.stderr}")


def report(
    got: dict[tuple[str, ...], list[dict[str, Any]]],
    layouts: list[str],
    caches: list[str],
    methods: list[str],
    processes: list[str],
) -> None:
    def med(c: tuple[str, ...]) -> float:
        return statistics.median(r["seconds"] for r in got[c])

    print(f"\n{'layout':7} {'cache':5} {'process':7} " + " ".join(f"{m:>17}" for m in methods))
    for lay in layouts:
        nbytes = next(iter(got[(lay, caches[0], processes[0], methods[0])]))["bytes"]
        for cache in caches:
            for proc in processes:
                ref = med((lay, cache, proc, "physical")) if "physical" in methods else None
                cells = []
                for m in methods:
                    s = med((lay, cache, proc, m))
                    rate = nbytes / s / GiB
                    ratio = f" {ref / s:4.2f}x" if ref is not None else ""
                    cells.append(f"{rate:6.2f} GiB/s{ratio}")
                print(f"{lay:7} {cache:5} {proc:7} " + " ".join(f"{c:>17}" for c in cells))
    print(
        "(GiB/s of the step's data files; 'Nx': speed as a fraction of 'physical' in the same "
        "row, i.e. physical time / its time)"
    )
    if "load" in methods and "dcp" in methods:
        for lay in layouts:
            for cache in caches:
                for proc in processes:
                    k = (lay, cache, proc)
                    print(
                        f"raw dcp.load time / load() time, {lay} {cache} {proc}: "
                        f"{med((*k, 'dcp')) / med((*k, 'load')):.2f}x"
                    )
    stepped = [m for m in methods if m != "physical"]
    if stepped:
        print("\nthe first step after the read / the next one, ms (medians; step_seconds):")
        for lay in layouts:
            for cache in caches:
                for proc in processes:
                    cells = []
                    for m in stepped:
                        rs = got[(lay, cache, proc, m)]
                        first = statistics.median(r["first_step"] for r in rs) * 1000
                        nxt = statistics.median(r["next_step"] for r in rs) * 1000
                        cells.append(f"{m} {first:.0f} / {nxt:.0f}")
                    print(f"  {lay} {cache} {proc}: " + ", ".join(cells))
    if "load" in methods:
        print("\nper phase, seconds (one load each; threads_*: summed over the reading threads):")
        for cache in caches:
            for lay in layouts:
                for proc in processes:
                    one = got[(lay, cache, proc, "load")][0]
                    cells = ", ".join(f"{k} {v:.3f}" for k, v in one["phases"].items())
                    print(f"  {lay} {cache} {proc}: timed {one['seconds']:.3f}, {cells}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
