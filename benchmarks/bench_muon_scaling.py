"""Muon step time on N ranks for one fixed set of matrices (FSDP2-style Shard(0) DTensors).

    torchrun --nproc-per-node=N benchmarks/bench_muon_scaling.py [--matrices 64] [--side 4096]
    for n in 1 2 4 8; do
        torchrun --nproc-per-node=$n benchmarks/bench_muon_scaling.py --csv scaling.csv
    done

Every matrix has one owner rank that gathers it, runs Newton-Schulz once and scatters the
result, so the step time should follow the Newton-Schulz work of the busiest rank: ~1/N of the
total. Each run prints one row: world size, median step time, the busiest rank's share of the
Newton-Schulz cost (max·min² per matrix; ideal 1/N), and, when ``--csv`` already holds the
world-size-1 row of the same case, the speedup over it and the parallel efficiency.
``--offload`` adds the step time with CPU offload on vs off on these N ranks; ``--ckpt-dir DIR``
the manager's save/load throughput against raw ``dcp.save``/``dcp.load`` (1 and 4 writer
threads) of the same state, all ranks together, into a local directory every rank sees. NCCL on
``cuda:<local rank>`` when CUDA is present, else gloo on the CPU (use small ``--side`` there).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from optim import Muon, set_ns_compile
from optim._plan import _ns_cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--matrices", type=int, default=64, help="number of square matrices")
    ap.add_argument("--side", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=8)
    ap.add_argument("--csv", default=None, help="append the row here; speedup vs its 1-rank row")
    ap.add_argument("--offload", action="store_true", help="also: step time offload on vs off")
    ap.add_argument(
        "--ckpt-dir",
        default=None,
        help="also: manager save/load vs raw DCP of the same state, in this (shared) local dir",
    )
    ap.add_argument("--ckpt-repeat", type=int, default=2)
    args = ap.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(dev.type, (world,))
    set_ns_compile(False)

    g = torch.Generator(device=dev).manual_seed(0)  # the same full tensors on every rank
    params = []
    for _ in range(args.matrices):
        full = torch.randn(args.side, args.side, device=dev, generator=g)
        p = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
        p.grad = distribute_tensor(
            torch.randn(args.side, args.side, device=dev, generator=g), mesh, [Shard(0)]
        )
        params.append(p)
        del full
    names = [f"layers.{i}.weight" for i in range(len(params))]
    hp = {"lr": 0.02, "weight_decay": 0.01, "momentum": 0.95}
    opt = Muon([{"params": params, "names": names, **hp}], chunk_size=args.chunk_size)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    for _ in range(args.warmup):
        opt.step()
    times = []
    for _ in range(args.iters):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3

    plan = opt._get_plan()
    per_rank = [0.0] * world
    for it in plan.items:
        per_rank[it.owner] += _ns_cost(it.gshape)
    share = max(per_rank) / sum(per_rank)
    if rank == 0:
        dev_name = torch.cuda.get_device_name() if cuda else "cpu/gloo"
        case = f"{args.matrices}x{args.side}^2"
        row = {"case": case, "world": world, "step_ms": f"{ms:.2f}", "busiest_share": share}
        base = None
        if args.csv:
            path = Path(args.csv)
            rows = list(csv.DictReader(path.open())) if path.exists() else []
            base = next(
                (float(r["step_ms"]) for r in rows if r["case"] == case and r["world"] == "1"), None
            )
            with path.open("a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(row))
                if not rows:
                    w.writeheader()
                w.writerow(row)
        if world == 1:
            base = ms
        extra = ""
        if base is not None:
            extra = f"  speedup vs 1 rank {base / ms:5.2f}x  efficiency {base / ms / world:5.1%}"
        print(
            f"device: {dev_name}, torch {torch.__version__}; case {case}, chunk_size {args.chunk_size}"
        )
        print(
            f"world {world:2d}  step {ms:9.2f} ms  busiest rank's NS share {share:6.1%}"
            f" (ideal {1 / world:6.1%}){extra}"
        )
    if args.offload:
        offload_ratio(opt, sync, args.iters, rank)
    if args.ckpt_dir:
        checkpoint_vs_raw_dcp(opt, sync, args.ckpt_dir, args.ckpt_repeat, dev)
    dist.destroy_process_group()


def offload_ratio(opt: Muon, sync, iters: int, rank: int) -> None:
    """Median step time with CPU offload off and on, in alternating rounds (the toggle itself
    is not timed: each timed step with offload on includes its own state copies)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(iters + 1):
        for on in (False, True) if i % 2 == 0 else (True, False):
            if on:
                opt.turn_on_cpu_offload()
            else:
                opt.turn_off_cpu_offload()
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            if i:  # the first round warms up the pool's buffers
                times[on].append(time.perf_counter() - t0)
    opt.turn_off_cpu_offload()
    off, on = statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
    if rank == 0:
        print(f"offload: step off {off:9.2f} ms  on {on:9.2f} ms  on/off {on / off:6.3f}x")


def checkpoint_vs_raw_dcp(opt: Muon, sync, root: str, repeat: int, dev: torch.device) -> None:
    """Manager save/load of the optimizer (params + momentum of every rank) against raw
    dcp.save/dcp.load of the very same flattened state with DCP's FileSystemWriter (1 and
    io_threads threads), interleaved rounds, total bytes of all ranks / wall time."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from muon_ckpt import CheckpointManager
    from muon_ckpt.state import FlatState

    rank, world = dist.get_rank(), dist.get_world_size()
    threads = 4
    mgr = CheckpointManager(f"{root}/manager", optimizer=opt, io_threads=threads, keep_last=1)
    flat = FlatState.build(None, opt, {})
    local = sum(
        (t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
        for t in flat.sd.values()
        if isinstance(t, torch.Tensor)
    )
    total = torch.tensor([float(local)], device=dev)
    dist.all_reduce(total)
    nbytes = total.item()
    step = iter(range(1, 10**6))

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    def manager() -> tuple[float, float]:
        s = next(step)
        return timed(lambda: mgr.save(s, force=True)), timed(lambda: mgr.load(s))

    def raw(t: int) -> tuple[float, float]:
        path = f"{root}/raw{t}-{next(step)}"
        w = dcp.FileSystemWriter(path, thread_count=t)
        t_save = timed(lambda: dcp.save(flat.sd, storage_writer=w))
        t_load = timed(lambda: dcp.load(flat.sd, storage_reader=dcp.FileSystemReader(path)))
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        return t_save, t_load

    variants = {
        "manager": manager,
        "raw dcp": lambda: raw(1),
        f"raw dcp x{threads}": lambda: raw(threads),
    }
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for r in range(repeat + 1):  # round 0 warms up (staging buffers, files, page cache)
        order = list(variants)
        for k in order[r % len(order) :] + order[: r % len(order)]:
            got = variants[k]()
            if r:
                samples[k].append(got)
    mgr.close()
    if rank == 0:
        for what, t in (("save", mgr.last_save_timings), ("load", mgr.last_load_timings)):
            print(
                f"  manager's last {what} on rank 0: "
                + ", ".join(f"{k} {v:.3f}" for k, v in t.items())
            )
        med = {k: [statistics.median(x[i] for x in v) for i in (0, 1)] for k, v in samples.items()}
        print(f"checkpoint: {nbytes / 2**30:.2f} GiB over {world} ranks in {root}")
        for k, (ts, tl) in med.items():
            print(
                f"  {k:<12} save {nbytes / ts / 1e9:7.3f} GB/s  load {nbytes / tl / 1e9:7.3f} GB/s"
            )
        m = med["manager"]
        for k in variants:
            if k != "manager":
                print(
                    f"  manager / {k:<11} save {med[k][0] / m[0]:5.2f}x  load {med[k][1] / m[1]:5.2f}x"
                )


if __name__ == "__main__":
    main()
