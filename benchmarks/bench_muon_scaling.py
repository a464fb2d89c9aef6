"""Muon step time on N ranks for one fixed set of matrices (FSDP2-style Shard(0) DTensors).

    torchrun --nproc-per-node=N benchmarks/bench_muon_scaling.py [--matrices 64] [--side 4096]
    for n in 1 2 4 8; do
        torchrun --nproc-per-node=$n benchmarks/bench_muon_scaling.py --csv scaling.csv
    done

Every matrix has one owner rank that gathers it, runs Newton-Schulz once and scatters the
result, so the step time should follow the Newton-Schulz work of the busiest rank: ~1/N of the
total. Each run prints one row: world size, median step time, the busiest rank's share of the
Newton-Schulz cost (max·min² per matrix; ideal 1/N), and, when ``--csv`` already holds the
world-size-1 row of the same case, the speedup over it and the parallel efficiency. NCCL on
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
    opt = Muon(
        [{"params": params, "lr": 0.02, "weight_decay": 0.01, "momentum": 0.95}],
        chunk_size=args.chunk_size,
    )

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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
