"""Resharded load against a same-topology load: saved on 2 ranks, loaded on 2 and on 3 (CPU,
gloo; real processes through ``tests/_dist.run_on_ranks``); and bytes read by a replicated
load on 4 ranks.

The state is ``--size-gib`` of 2048x2048 fp32 parameters sharded by rows (``Shard(0)``). On 3
ranks every rank takes rows from both saved shards; ranks 0 and 1 check their own files whole
and read only the rows they need from the other file, rank 2 reads only its rows. Each rank
times ``CheckpointManager.load`` and counts the bytes it read (``last_load_bytes_read``); a
load's speed is the state's bytes over its slowest rank's time. Interleaved rounds, medians.

Replicated (``--replicated-gib``): plain 2048x2048 fp32 tensors on every rank, saved and loaded
on 4 ranks; every rank loads all of it. With ``read_once`` on and off: the bytes all ranks read
from storage over the checkpoint's bytes (read once: 1.0; each rank reading what it loads:
4.0) and the load time, against a 1-rank load of the same checkpoint.

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/bench_reshard.py --size-gib 1 --url /tmp/bench_reshard
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch

from benchmarks.bench_resume import data_files
from muon_ckpt.store import Storage
from tests._dist import run_on_ranks

SIDE = 2048


def _model(world: int, n: int, fill: bool) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Module()
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        full = torch.randn(SIDE, SIDE, generator=g) if fill else torch.zeros(SIDE, SIDE)
        model.register_parameter(
            f"w{i}", torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
        )
    return model


def _save(rank: int, world: int, url: str, n: int) -> None:
    from muon_ckpt import CheckpointManager

    with CheckpointManager(url, model=_model(world, n, True)) as m:
        m.save(1)


def _load(rank: int, world: int, url: str, n: int, verify: str, threads: int) -> tuple:
    from muon_ckpt import CheckpointManager

    model = _model(world, n, False)
    with CheckpointManager(url, model=model, verify=verify, io_threads=threads) as m:
        t = time.perf_counter()
        m.load()
        took = time.perf_counter() - t
        return took, m.last_load_bytes_read, m.last_load_timings.get("read", 0.0)


def _plain(n: int, fill: bool) -> torch.nn.Module:
    model = torch.nn.Module()
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        full = torch.randn(SIDE, SIDE, generator=g) if fill else torch.zeros(SIDE, SIDE)
        model.register_parameter(f"w{i}", torch.nn.Parameter(full))
    return model


def _save_plain(rank: int, world: int, url: str, n: int) -> None:
    from muon_ckpt import CheckpointManager

    with CheckpointManager(url, model=_plain(n, True)) as m:
        m.save(1)


def _load_plain(
    rank: int, world: int, url: str, n: int, verify: str, threads: int, once: bool
) -> tuple:
    from muon_ckpt import CheckpointManager

    kw = {"verify": verify, "io_threads": threads, "read_once": once}
    with CheckpointManager(url, model=_plain(n, False), **kw) as m:
        t = time.perf_counter()
        m.load()
        return time.perf_counter() - t, m.last_load_bytes_read, m.last_load_timings


def _replicated(args: argparse.Namespace) -> None:
    n = max(1, round(args.replicated_gib * (1 << 30) / (SIDE * SIDE * 4)))
    nbytes = n * SIDE * SIDE * 4
    url = tempfile.mkdtemp(prefix="muon_ckpt_replicated_")
    try:
        run_on_ranks(_save_plain, 4, url, n, timeout=1800)
        stored = sum(n for _, n in data_files(Storage(url), "step-00000001"))
        cases = [(1, False), (4, True), (4, False)]
        rounds: dict[tuple[int, bool], list[list[tuple]]] = {c: [] for c in cases}
        for r in range(args.repeat):
            for world, once in cases if r % 2 == 0 else cases[::-1]:
                rounds[(world, once)].append(
                    run_on_ranks(_load_plain, world, url, n, args.verify, args.io_threads, once)
                )
        print(
            f"replicated: {n} x {SIDE}x{SIDE} fp32 = {nbytes / 2**30:.2f} GiB on every rank, "
            f"saved on 4 ranks ({stored / 2**20:.0f} MiB of data files)"
        )
        wall = {}
        for (world, once), rr in rounds.items():
            wall[(world, once)] = statistics.median(max(x[0] for x in rs) for rs in rr)
            read = statistics.median(sum(x[1] for x in rs) for rs in rr)
            share = statistics.median(max(x[2].get("share", 0.0) for x in rs) for rs in rr)
            print(
                f"  {world} rank(s), read_once={once}: load {wall[(world, once)]:.3f} s "
                f"(sending {share:.3f} s); bytes read by all ranks / stored bytes "
                f"{read / stored:.3f}"
            )
        print(
            f"  load time, 4 ranks read once / each rank reading: "
            f"{wall[(4, True)] / wall[(4, False)]:.2f}x; / 1 rank: "
            f"{wall[(4, True)] / wall[(1, False)]:.2f}x"
        )
    finally:
        shutil.rmtree(url, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--url", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--verify", choices=["checksum", "size"], default="checksum")
    ap.add_argument("--replicated-gib", type=float, default=0.25, help="0: skip")
    args = ap.parse_args()
    from muon_ckpt.store.checksums import crc32c_implementation

    n = max(1, round(args.size_gib * (1 << 30) / (SIDE * SIDE * 4)))
    nbytes = n * SIDE * SIDE * 4
    url = args.url or tempfile.mkdtemp(prefix="muon_ckpt_reshard_")
    shutil.rmtree(url, ignore_errors=True)
    print(
        f"state: {n} x {SIDE}x{SIDE} fp32 = {nbytes / 2**30:.2f} GiB, Shard(0), saved on 2 "
        f"ranks; verify={args.verify}; io_threads={args.io_threads}; CRC32C implementation: "
        f"{crc32c_implementation()}"
    )
    run_on_ranks(_save, 2, url, n, timeout=1800)
    runs: dict[int, list[list[tuple]]] = {2: [], 3: []}
    for r in range(args.repeat):
        for world in (2, 3) if r % 2 == 0 else (3, 2):
            runs[world].append(
                run_on_ranks(_load, world, url, n, args.verify, args.io_threads, timeout=1800)
            )
    speed = {}
    for world, rounds in runs.items():
        wall = statistics.median(max(x[0] for x in ranks) for ranks in rounds)
        read = statistics.median(max(x[2] for x in ranks) for ranks in rounds)
        per_rank = [statistics.median(ranks[i][1] for ranks in rounds) for i in range(world)]
        speed[world] = nbytes / wall / 1e9
        print(
            f"  2 -> {world} ranks: load {wall:.3f} s ({speed[world]:.2f} GB/s; reader "
            f"{read:.3f} s); bytes read per rank {[f'{b / 2**20:.0f} MiB' for b in per_rank]}; "
            f"total / checkpoint {sum(per_rank) / nbytes:.2f}"
        )
    print("ratios (throughput):")
    print(f"  resharded (2 -> 3) / same topology (2 -> 2) load  {speed[3] / speed[2]:.2f}x")
    if args.url is None:
        shutil.rmtree(url, ignore_errors=True)
    if args.replicated_gib > 0:
        _replicated(args)


if __name__ == "__main__":
    main()
