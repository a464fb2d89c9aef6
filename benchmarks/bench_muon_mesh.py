"""The Muon step on the meshes FSDP2 and tensor parallelism make: Newton-Schulz work per rank
(matrices and FLOPs) and step time, for one process, FSDP, HSDP and TP x FSDP.

    python -m benchmarks.bench_muon_mesh --device cpu [--tiny]     # 4 gloo ranks, started here
    torchrun --nproc-per-node=N -m benchmarks.bench_muon_mesh --device cuda \\
        --layouts one fsdp hsdp:2 tp:2 [--matrices 32] [--side 4096]

The model is ``--matrices`` square ``--side`` Linear layers (bias-free), alternately column-
and row-parallel under TP, laid out with torch's own APIs: ``one`` (rank 0 alone, plain
tensors), ``fsdp`` (``fully_shard`` over all N ranks), ``hsdp:R`` (``fully_shard`` over an
R x N/R mesh: R replicas), ``tp:T`` (``parallelize_module`` over T ranks, then
``fully_shard`` over the N/T data-parallel ranks). Every layout is built up front and timed
in the same interleaved rounds (order rotating; medians of rank 0's step, between barriers).

Each matrix is orthogonalised on exactly one rank of the whole mesh, so the Newton-Schulz work
per rank is ~1/N of one process's on every layout: the table prints each rank's matrices and
GFLOP (``Muon.ns_work()``) beside what each rank would do were replicas to redo the work
(1/(N/R) of it under HSDP). On the CPU, small matrices would share one batched Newton-Schulz
(and so one owner); there each runs alone, as at GPU sizes, unless ``--batch-small``. ``--device cpu`` without torchrun starts itself under torchrun on
``--ranks`` (4) gloo ranks, one thread each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from optim import Muon, set_ns_compile

HP = {"lr": 0.02, "weight_decay": 0.01, "momentum": 0.95}


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--layouts", nargs="+", default=["one", "fsdp", "hsdp:2", "tp:2"])
    ap.add_argument("--matrices", type=int, default=32)
    ap.add_argument("--side", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chunk-size", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=4, help="gloo ranks of --device cpu")
    ap.add_argument("--tiny", action="store_true", help="8 x 64^2, 1 round: a smoke run")
    ap.add_argument(
        "--batch-small",
        action="store_true",
        help="let small same-shape matrices share a batched Newton-Schulz (and an owner), as "
        "the library does; by default on the CPU each runs alone, as at GPU sizes",
    )
    a = ap.parse_args()
    if a.device == "cpu" and "--matrices" not in sys.argv and "--side" not in sys.argv:
        a.matrices, a.side = 16, 256
    if a.tiny:
        a.matrices, a.side, a.iters, a.warmup = 8, 64, 1, 1
    return a


class Stack(nn.Module):
    def __init__(self, n: int, side: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(side, side, bias=False) for _ in range(n))


def build(layout: str, args: argparse.Namespace, dev: torch.device) -> Muon:
    """The model laid out as ``layout``, random grads set, and its Muon."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = Stack(args.matrices, args.side).to(dev)
    world = dist.get_world_size()
    kind, _, arg = layout.partition(":")
    if kind == "fsdp":
        fully_shard(model, mesh=init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",)))
    elif kind == "hsdp":
        r = int(arg)
        mesh = init_device_mesh(dev.type, (r, world // r), mesh_dim_names=("rep", "shard"))
        fully_shard(model, mesh=mesh)
    elif kind == "tp":
        t = int(arg)
        mesh = init_device_mesh(dev.type, (world // t, t), mesh_dim_names=("dp", "tp"))
        plan = {
            f"layers.{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
            for i in range(args.matrices)
        }
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
    elif kind != "one":
        raise SystemExit(f"unknown layout {layout!r}: one, fsdp, hsdp:R or tp:T")
    g = torch.Generator(device=dev).manual_seed(1 + dist.get_rank())
    for p in model.parameters():
        if isinstance(p, DTensor):  # (a random local grad: no scatter, any placement)
            local = torch.randn(p.to_local().shape, device=dev, generator=g)
            p.grad = DTensor.from_local(
                local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        else:
            p.grad = torch.randn(p.shape, device=dev, generator=g)
    names = [n for n, _ in model.named_parameters()]
    return Muon(
        [{"params": list(model.parameters()), "names": names, **HP}], chunk_size=args.chunk_size
    )


def _fits(layout: str, world: int) -> bool:
    """Whether ``world`` ranks make ``layout`` (hsdp:R and tp:T need R or T to divide it)."""
    kind, _, arg = layout.partition(":")
    return kind in ("one", "fsdp") or (
        arg.isdigit() and 0 < int(arg) <= world and world % int(arg) == 0
    )


def _mesh_label(layout: str, world: int) -> str:
    kind, _, arg = layout.partition(":")
    if kind == "one":
        return "1"
    if kind == "fsdp":
        return f"{world}"
    n = int(arg)
    return f"{n}x{world // n}" if kind == "hsdp" else f"{world // n}x{n} (dp x tp)"


def run(args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch.set_num_threads(1)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    set_ns_compile(False)
    if args.device == "cpu" and not args.batch_small:
        import optim._plan

        optim._plan.BATCH_COST_LIMIT = 0.0  # (each matrix its own batch, as at GPU sizes)
    fits = [k for k in args.layouts if _fits(k, world)]
    if rank == 0 and fits != args.layouts:
        print(
            f"skipped (the {world} ranks do not split so): {sorted(set(args.layouts) - set(fits))}"
        )
    args.layouts = fits
    opts = {}
    for layout in args.layouts:
        if layout == "one":
            opts[layout] = build(layout, args, dev) if rank == 0 else None
        else:
            opts[layout] = build(layout, args, dev)

    def step(layout: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        if opts[layout] is not None:
            opts[layout].step()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        for layout in args.layouts:
            step(layout)
    times: dict[str, list[float]] = {k: [] for k in args.layouts}
    for r in range(args.iters):
        order = args.layouts[r % len(args.layouts) :] + args.layouts[: r % len(args.layouts)]
        for layout in order:
            times[layout].append(step(layout))
    work = {k: (o.ns_work() if o is not None else None) for k, o in opts.items()}
    every = [None] * world
    dist.all_gather_object(every, work)
    if rank == 0:
        report(args, world, dev, times, every)
    # Torn down together once rank 0 has printed: gloo aborts a process ending right after a
    # blocking collective while a mesh lives (pytorch#190489), so the last one is
    # asynchronous and its Work lives until the exit.
    work = dist.barrier(async_op=True)
    work.wait()
    _LAST_WORK.append(work)
    dist.destroy_process_group()


def report(args, world, dev, times, every) -> None:
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu/gloo, 1 thread/rank"
    print(f"device: {name}, {world} ranks, torch {torch.__version__}")
    print(
        f"case: {args.matrices} x {args.side}^2 fp32 Linear weights, chunk_size {args.chunk_size}"
    )
    print()
    print(
        "| layout | mesh | NS matrices per rank | NS GFLOP per rank (max) | total GFLOP "
        "| replicas redoing it (GFLOP/rank) | step ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for layout in args.layouts:
        ws = [w[layout] for w in every if w[layout] is not None]
        mats = ",".join(str(w.matrices) for w in ws)
        gflop = [w.flops / 1e9 for w in ws]
        total = sum(gflop)
        kind, _, arg = layout.partition(":")
        group = world // int(arg) if kind == "hsdp" else len(ws)  # ranks that split a matrix
        print(
            f"| {layout} | {_mesh_label(layout, world)} | {mats} | {max(gflop):.2f} "
            f"| {total:.2f} | {total / group:.2f} | {statistics.median(times[layout]) * 1e3:.1f} |"
        )


_LAST_WORK: list = []  # (see the end of run)


def main() -> None:
    args = _args()
    if args.device == "cpu" and "RANK" not in os.environ:
        # Not under torchrun: start the gloo ranks (the same script, under torchrun).
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(args.ranks), "-m", "benchmarks.bench_muon_mesh"]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        raise SystemExit(subprocess.call(cmd + sys.argv[1:], env=env))
    run(args)


if __name__ == "__main__":
    main()
