"""Save/load throughput: CheckpointManager vs raw dcp.save/dcp.load vs the storage's own speed.

All three handle the same bytes in the same run:

* manager: ``CheckpointManager.save(step)`` / ``.load(step)`` (checksums, manifest, commit);
* raw DCP: ``dcp.save``/``dcp.load`` of the very state dict the manager builds, with DCP's
  default writer (``FileSystemWriter`` locally, ``FsspecWriter`` remotely, thread_count=1) and
  with ``thread_count`` = the manager's ``io_threads``;
* storage: the tensor bytes written (and fsynced, locally) as plain files, one stream, as many
  parallel streams as the manager writes files per rank, as many as it reads with where that
  differs (``io_threads`` left as None: 4 files, reading threads from the cores), and locally
  the write streams queueing each write for write-out at once as the manager does (``+wb``);
  the best of them is "storage write speed". Each is read back right away by as many streams
  into a reused buffer (no parsing, no copy into tensors): the best of those reads is
  "storage read speed".


Every variant runs once untimed first (``--warmup``): the manager's first save allocates its
host staging buffers (page-locked on CUDA, ~1 s/GiB there), which every later save reuses;
that first save is printed on its own line, not hidden.

Usage::

    python benchmarks/bench_checkpoint.py --size-gib 1 --device cpu --url /tmp/bench
    python benchmarks/bench_checkpoint.py --size-gib 0.25 --url moto       # local moto S3
    python benchmarks/bench_checkpoint.py --size-gib 8 --device cuda --url /nvme/bench
    python benchmarks/bench_checkpoint.py --size-gib 4 --save-io-threads 1   # one file per rank

Local loads are served by the page cache unless the machine drops it between runs; the figure
is then a memory-bandwidth figure, for manager and raw DCP alike.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from muon_ckpt import CheckpointManager
from muon_ckpt._config import WRITE_THREADS, read_threads
from muon_ckpt.save._writeback import start_writeback
from muon_ckpt.state import FlatState
from muon_ckpt.store import Storage
from muon_ckpt.store._crc import write_algorithm
from muon_ckpt.store.checksums import crc32c_implementation
from optim.muon import Muon

GiB = 1 << 30


def build_state(size_gib: float, device: str, tensor_mib: int = 16) -> tuple[nn.Module, Muon]:
    """Square fp32 matrices of about ``tensor_mib`` MiB each (2048 x 2048 by default): half
    the bytes in parameters, half in Muon momentum."""
    side = max(1, round((tensor_mib * (1 << 20) / 4) ** 0.5))
    per = side * side * 4
    n = max(1, round(size_gib * GiB / 2 / per))
    model = nn.Module()
    for i in range(n):
        model.register_parameter(f"w{i}", nn.Parameter(torch.randn(side, side, device=device)))
    opt = Muon(list(model.parameters()), chunk_size=4)
    opt.init_state()
    for st in opt.state.values():
        st["momentum_buffer"].normal_()
    return model, opt


class MotoProcess:
    """A moto S3 server in a process of its own on 127.0.0.1, as S3 is: its request handling
    does not take this process's interpreter lock from the readers and writers measured."""

    def __init__(self) -> None:
        import socket
        import subprocess
        import sys

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=30)


def start_moto() -> tuple[MotoProcess, dict]:
    server = MotoProcess()
    opts = {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": f"http://127.0.0.1:{server.port}",
    }
    return server, opts


def storage_write(
    st: Storage, blobs: list[memoryview], threads: int, tag: str, writeback: bool = False
) -> None:
    """Write the bytes as plain files: ``threads`` streams, fsync once per file (locally);
    with ``writeback``, each write's pages are queued for write-out at once, as the manager's
    writer does (locally)."""
    parts: list[list[memoryview]] = [blobs[i::threads] for i in range(threads)]

    def one(i: int) -> None:
        path = st.path(f"raw-{tag}", f"part{i}")
        if st.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb", buffering=0) as f:
                off = 0
                for b in parts[i]:
                    f.write(b)
                    if writeback:
                        start_writeback(f.fileno(), off, b.nbytes)
                    off += b.nbytes
                os.fsync(f.fileno())
        else:
            with st.fs.open(path, "wb") as f:
                for b in parts[i]:
                    f.write(b)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def storage_read(st: Storage, threads: int, tag: str) -> None:
    """Read back what ``storage_write`` wrote with ``threads`` streams: plain reads into one
    reused buffer per stream, no parsing, no copy into tensors."""

    def one(i: int) -> None:
        buf = bytearray(16 << 20)
        with st.fs.open(st.path(f"raw-{tag}", f"part{i}"), "rb") as f:
            while f.readinto(buf):
                pass

    ts = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0, help="total state size (GiB)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--url", default=None, help="local dir, fsspec URL, or 'moto' (default: tmp)")
    ap.add_argument("--io-threads", type=int, default=None, help="(default: the manager's)")
    ap.add_argument(
        "--save-io-threads",
        type=int,
        default=None,
        help="the manager saves with this io_threads (files per rank) and loads with "
        "--io-threads: e.g. 1 for a checkpoint of one file read by several threads",
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds of every variant")
    ap.add_argument("--verify", choices=["checksum", "crc32", "size"], default="checksum")
    args = ap.parse_args()

    server, opts = None, {}
    url = args.url or tempfile.mkdtemp(prefix="muon_ckpt_bench_")
    if url == "moto":
        server, opts = start_moto()
        import s3fs

        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(**opts).mkdir(bucket)
        url = f"s3://{bucket}/run"
    st = Storage(url, opts)
    model, opt = build_state(args.size_gib, args.device)
    flat = FlatState.build(model, opt, {})
    tensors = [v for v in flat.sd.values() if torch.is_tensor(v)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    host = [t.detach().cpu().contiguous() for t in tensors]
    blobs = [_bytes_view(t) for t in host]
    T = args.io_threads or WRITE_THREADS
    R = read_threads(args.io_threads, st.is_local)
    print(
        f"state: {len(tensors)} tensors, {nbytes / GiB:.2f} GiB on {args.device}; url {url}; "
        f"io_threads={args.io_threads} (saves: {args.save_io_threads or T} files, loads: {R} "
        f"threads); verify={args.verify}; torch {torch.__version__}; checksums: "
        f"{write_algorithm()} (CRC32C implementation: {crc32c_implementation()})"
    )

    def clean() -> None:
        for name in st.listdir():
            st.rm(name)

    mgr = CheckpointManager(
        url,
        model=model,
        optimizer=opt,
        storage_options=opts,
        io_threads=args.io_threads,
        verify=args.verify,
    )
    saver = mgr
    if args.save_io_threads is not None:
        saver = CheckpointManager(
            url, model=model, optimizer=opt, storage_options=opts, io_threads=args.save_io_threads
        )
    counter = iter(range(1, 10**6))
    phases: list[dict[str, float]] = []
    load_phases: list[dict[str, float]] = []

    def raw_writer(threads: int):
        name = f"dcp-{uuid.uuid4().hex[:6]}"
        if st.is_local:
            return dcp.FileSystemWriter(st.path(name), thread_count=threads), name
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(st.url_of(name), thread_count=threads, **opts), name

    def raw_reader(name: str):
        if st.is_local:
            return dcp.FileSystemReader(st.path(name))
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(st.url_of(name), **opts)

    def mgr_pair() -> tuple[float, float]:
        step = next(counter)
        t = time.perf_counter()
        saver.save(step, force=True)
        t_save = time.perf_counter() - t
        phases.append(dict(saver.last_save_timings))
        t = time.perf_counter()
        mgr.load(step)
        t_load = time.perf_counter() - t
        load_phases.append(dict(mgr.last_load_timings))
        return t_save, t_load

    def raw_pair(threads: int) -> tuple[float, float]:
        w, name = raw_writer(threads)
        t = time.perf_counter()
        dcp.save(flat.sd, storage_writer=w, no_dist=True)
        t_save = time.perf_counter() - t
        t = time.perf_counter()
        dcp.load(flat.sd, storage_reader=raw_reader(name), no_dist=True)
        return t_save, time.perf_counter() - t

    def storage_once(threads: int, writeback: bool = False) -> tuple[float, float]:
        tag = f"s{threads}{'wb' if writeback else ''}"
        t = time.perf_counter()
        storage_write(st, blobs, threads, tag, writeback)
        t_write = time.perf_counter() - t
        t = time.perf_counter()
        storage_read(st, threads, tag)
        return t_write, time.perf_counter() - t

    # Interleaved: every repeat runs each variant once, on a clean root, so that drift in the
    # machine's load (page cache, other jobs) hits all of them alike. Median per variant.
    variants = {
        "manager": mgr_pair,
        "raw dcp": lambda: raw_pair(1),
        f"raw dcp x{T}": lambda: raw_pair(T),
        "storage 1 stream": lambda: storage_once(1),
        f"storage {T} streams": lambda: storage_once(T),
    }
    if R != T:
        variants[f"storage {R} streams"] = lambda: storage_once(R)
    if st.is_local:
        variants[f"storage {T} streams+wb"] = lambda: storage_once(T, writeback=True)
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    first_save = None
    for _ in range(args.warmup):
        for k, fn in variants.items():
            clean()
            t_first = fn()[0]
            if k == "manager" and first_save is None:
                first_save = t_first
    phases.clear()  # the timed repeats only
    load_phases.clear()
    for r in range(args.repeat):
        order = list(variants)
        order = order[r % len(order) :] + order[: r % len(order)]
        for k in order:
            clean()
            samples[k].append(variants[k]())
    clean()
    res: dict[str, float] = {}
    for k, xs in samples.items():
        plain = k.startswith("storage")
        res[f"{k} {'write' if plain else 'save'}"] = statistics.median(x[0] for x in xs)
        res[f"{k} {'read' if plain else 'load'}"] = statistics.median(x[1] for x in xs)

    gbs = {k: nbytes / v / 1e9 for k, v in res.items()}
    if first_save is not None:
        print(f"  first manager save (allocates staging buffers, untimed): {first_save:.3f} s")
    for k, v in res.items():
        print(f"  {k:<26} {v:8.3f} s  {gbs[k]:7.3f} GB/s")
    for what, ph in (("save", phases), ("load", load_phases)):
        if ph:
            print(f"manager {what} phases (median s; thread sums are over all writer threads):")
            print("  " + ", ".join(f"{k} {statistics.median(p[k] for p in ph):.3f}" for k in ph[0]))
    disk = max(v for k, v in gbs.items() if k.startswith("storage") and k.endswith("write"))
    disk_read = max(v for k, v in gbs.items() if k.startswith("storage") and k.endswith("read"))
    print("ratios (throughput):")
    print(f"  manager save / raw dcp save        {gbs['manager save'] / gbs['raw dcp save']:.2f}x")
    print(
        f"  manager save / raw dcp x{T} save    "
        f"{gbs['manager save'] / gbs[f'raw dcp x{T} save']:.2f}x"
    )
    print(f"  manager save / storage write speed {gbs['manager save'] / disk:.2f}x")
    print(f"  raw dcp save / storage write speed {gbs['raw dcp save'] / disk:.2f}x")
    print(f"  manager load / raw dcp load        {gbs['manager load'] / gbs['raw dcp load']:.2f}x")
    print(
        f"  manager load / raw dcp x{T} load    "
        f"{gbs['manager load'] / gbs[f'raw dcp x{T} load']:.2f}x"
    )
    print(f"  manager load / storage read speed  {gbs['manager load'] / disk_read:.2f}x")
    if load_phases:
        # The reader alone (reads, checksums, copies into place): the load without the
        # decision, the all-or-nothing backup copy and the apply step.
        reader = nbytes / statistics.median(p["read"] for p in load_phases) / 1e9
        print(
            f"  manager reader / storage read speed {reader / disk_read:.2f}x ({reader:.2f} GB/s)"
        )
    print(f"  raw dcp load / storage read speed  {gbs['raw dcp load'] / disk_read:.2f}x")
    mgr.close()
    if saver is not mgr:
        saver.close()
    if server is not None:
        server.stop()
    elif args.url is None:
        shutil.rmtree(url, ignore_errors=True)


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (``t`` must stay alive)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


if __name__ == "__main__":
    main()
