"""The memory tier: how fast a restart restores from it, and what it costs a training loop.

``restore`` (default): ``--world`` ranks as nodes of ``--node-size`` (gloo on the CPU; one
rank per GPU with ``--device cuda``), ``--size-gib`` of state sharded over them (FSDP-style
``Shard(0)`` DTensors, Muon momentum included). Step 2 is saved to both tiers; then, in the same
run, ``load()`` of it (slowest rank, median of ``--rounds``) from:

* ``memory``: every rank's own part, in this node's memory tier;
* ``peer``: the parts of the last node's ranks deleted, so those ranks fetch their replicas
  from the other node (the fetch restores them: each round deletes them again);
* ``storage hot``/``storage cold``: the url (memory tier off), its files in the page cache, or
  evicted (fsync + ``POSIX_FADV_DONTNEED``, checked with mincore); ``--url moto``: a local
  moto S3 server instead (no cache);
* ``plain /dev/shm``: the same part files read by plain ``pread`` into the targets' memory
  (the physical path of a memory-tier restore, nothing else).

``overhead``: one process, ``--case NxD`` fp32 matrices (fixed gradients) or ``--gpt
LAYERSxDIMxBATCH`` (a GPT-like stack whose forward and backward take most of a step), Muon
on ``--device``, offload on and off; the step time while saving to memory every ``k`` steps
over the step time with none, for k in ``--every`` and each ``--snapshot`` mode, in one run:
the smallest k within 1.05x is the interval to pick. Also what ``save()`` blocks and the host
bandwidth the tier takes.

Both must fit the machine: ``restore`` shrinks ``--size-gib`` until the url's copy fits the
free space of its directory and the tier's (own parts and replicas) that of the memory
directory, each plus a tenth and 1 GiB; ``overhead`` skips a case whose two memory steps (the
one kept and the one being written) do not fit the memory directory, and says so.

Usage::

    python -m benchmarks.bench_memory_tier restore --world 4 --node-size 2 --size-gib 0.5
    python -m benchmarks.bench_memory_tier restore --world 4 --node-size 2 --url moto
    python -m benchmarks.bench_memory_tier restore --world 1 --device cuda --size-gib 4
    python -m benchmarks.bench_memory_tier overhead --device cuda --case 16x4096 --gpt 12x2048x4096
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import tempfile
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._timing import fit_size_gib, room_for, sync
from tests._pagecache import evict, step_files

GiB = 1 << 30


def _sharded_state(size_gib: float, device: torch.device, world: int) -> tuple[Any, Any]:
    """Square fp32 matrices (half the bytes; Muon momentum the other half), as Shard(0)
    DTensors over every rank (plain tensors with one rank)."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    from optim.muon import Muon

    side = 2048 if size_gib >= 0.25 else 128  # (tiny sizes: a smoke run)
    n = max(1, round(size_gib * GiB / 2 / (side * side * 4)))
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
    model = nn.Module()
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        t = torch.randn(side, side, generator=g).to(device)
        if mesh is not None:
            t = distribute_tensor(t, mesh, [Shard(0)])
        model.register_parameter(f"w{i}", nn.Parameter(t))
    opt = Muon(list(model.parameters()), chunk_size=4)
    opt.init_state()
    return model, opt


def _slowest(seconds: float) -> float:
    if not dist.is_initialized():
        return seconds
    t = torch.tensor([seconds])
    w = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    w.wait()
    return float(t.item())


def _last_rank_tier(tier: str) -> str:
    """The last rank's ``last_load_tier`` (on the last node: the one that may fetch)."""
    if not dist.is_initialized():
        return tier
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, tier)
    return str(out[-1])


def _restore_rank(rank: int, world: int, args: argparse.Namespace, base: str, opts: dict) -> None:
    from muon_ckpt import CheckpointManager, MemoryOptions

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    model, opt = _sharded_state(args.size_gib, device, world)
    url = base if args.url == "moto" else os.path.join(base, "run")
    mem_root = os.path.join(args.memory_root, f"node{rank // args.node_size}")
    memory_options = MemoryOptions(interval=1, dir=mem_root, node_size=args.node_size, flush=False)
    kw = dict(storage_options=opts)
    with CheckpointManager(
        url, model=model, optimizer=opt, interval=2, memory=memory_options, **kw
    ) as mgr:
        mgr.load()
        assert mgr.save(2) and mgr.wait() == 2
    run_dir = glob.glob(os.path.join(mem_root, "run-*"))[0]
    own = os.path.join(run_dir, "step-00000002", f"rank-{rank:05d}")
    # (with its data files, which format 3 keeps in <url>/data/: a cold read of the step)
    url_files = step_files(url, 2) if args.url != "moto" else []
    last_node = rank // args.node_size == (world - 1) // args.node_size and world > args.node_size

    def load(memory: bool, cold: bool = False, drop_own: bool = False) -> tuple[float, str]:
        if drop_own and last_node:
            shutil.rmtree(own)
        if cold and url_files and rank == 0:
            evict(url_files)
        if dist.is_initialized():
            w = dist.barrier(async_op=True)
            w.wait()
        tier = memory_options if memory else None
        mgr = CheckpointManager(url, model=model, optimizer=opt, memory=tier, **kw)
        sync(device)
        t0 = time.perf_counter()
        assert mgr.load() == 2
        sync(device)
        took = time.perf_counter() - t0
        tier = _last_rank_tier(str(mgr.last_load_tier))
        mgr.close()
        return _slowest(took), tier

    def plain() -> tuple[float, str]:
        from benchmarks.bench_resume import parts_of, physical_local

        files = [(p, os.path.getsize(p)) for p in glob.glob(os.path.join(own, "*.distcp"))]
        target = torch.empty(sum(n for _, n in files), dtype=torch.uint8, device=device)
        target.fill_(1)
        parts = parts_of(sorted(files, key=lambda f: -f[1]), 4)
        sync(device)
        t0 = time.perf_counter()
        physical_local(parts, target, 4)
        sync(device)
        return _slowest(time.perf_counter() - t0), "-"

    cases: dict[str, Any] = {
        "memory": lambda: load(True),
        "peer": lambda: load(True, drop_own=True),
        "storage hot" if args.url != "moto" else "storage (moto)": lambda: load(False),
        "plain /dev/shm": plain,
    }
    if args.url != "moto":
        cases["storage cold"] = lambda: load(False, cold=True)
    if world <= args.node_size:
        del cases["peer"]
    times: dict[str, list[float]] = {k: [] for k in cases}
    tiers: dict[str, str] = {}
    for r in range(args.rounds + 1):  # round 0 warms up (and is not counted)
        names = list(cases)
        for k in names[r % len(names) :] + names[: r % len(names)]:
            took, tiers[k] = cases[k]()
            if r:
                times[k].append(took)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        state = sum(
            t.numel() * t.element_size()
            for t in [*model.parameters(), *(s["momentum_buffer"] for s in opt.state.values())]
        )
        print(
            f"restore of step 2: {state / GiB:.2f} GiB of state (global), {world} rank(s), "
            f"node_size {args.node_size}, device {device.type}; slowest rank, median of "
            f"{args.rounds}"
        )
        ref = med.get("storage cold", med.get("storage (moto)"))
        for k, v in med.items():
            print(
                f"  {k:16} {v * 1e3:8.1f} ms   tier of rank {world - 1}: {tiers[k]:8}  "
                f"storage {'cold' if 'storage cold' in med else '(moto)'} / this: "
                f"{ref / v:5.2f}x"
            )
        if "storage hot" in med:
            print(f"  memory vs storage hot: {med['storage hot'] / med['memory']:.2f}x faster")
        print(
            f"  memory vs plain reads of its files: {med['plain /dev/shm'] / med['memory']:.2f}x "
            "(1.0 = the speed of the memory)"
        )


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace, base: str, opts: dict):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        _restore_rank(rank, world, args, base, opts)
    finally:
        w = dist.barrier(async_op=True)
        w.wait()
        dist.destroy_process_group()


def restore(args: argparse.Namespace) -> None:
    import socket

    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="muon_ckpt_memtier_")
    args.memory_root = args.memory_dir or os.path.join("/dev/shm", f"bench-{uuid.uuid4().hex[:8]}")
    server, opts, base = None, {}, tmp
    if args.url == "moto":
        import s3fs

        from benchmarks.bench_checkpoint import start_moto

        server, opts = start_moto()
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(**opts).mkdir(bucket)
        base = f"s3://{bucket}/run"
    copies = 1 + (args.world > args.node_size)  # own parts, and replicas from another node
    try:
        for size in args.size_gib:  # each size in a run of its own
            one = argparse.Namespace(**vars(args))
            one.size_gib = fit_size_gib(size, copies, [args.memory_root], "memory tier")
            if args.url != "moto":
                one.size_gib = fit_size_gib(one.size_gib, 1, [tmp], "storage (the url's step)")
            where = f"{base}-{size:g}" if args.url == "moto" else os.path.join(tmp, f"{size:g}")
            if args.world == 1:
                _restore_rank(0, 1, one, where, opts)
            else:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                mp.spawn(_spawned, args=(args.world, port, one, where, opts), nprocs=args.world)
            shutil.rmtree(where, ignore_errors=True)  # the next size needs the space
            shutil.rmtree(args.memory_root, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(args.memory_root, ignore_errors=True)
        if server is not None:
            server.stop()


def overhead(args: argparse.Namespace) -> None:
    from benchmarks.bench_async_save import build, build_gpt, planned_bytes, state_bytes, step

    device = torch.device(args.device)
    tmp = tempfile.mkdtemp(prefix="muon_ckpt_memtier_")
    mem = args.memory_dir or os.path.join("/dev/shm", f"bench-{uuid.uuid4().hex[:8]}")
    cases = (args.case or ([] if args.gpt else ["16x1024"])) + [f"gpt{g}" for g in args.gpt]
    skipped = []
    try:
        for case in cases:
            why = room_for(mem, 2 * planned_bytes(case, False), f"{case} skipped (memory tier)")
            if why is not None:
                skipped.append(why)
                print(why, flush=True)
                continue
            for offload in args.offload:
                if case.startswith("gpt"):
                    layers, dim, batch = (int(x) for x in case[3:].split("x"))
                    model, opt, grads = build_gpt(layers, dim, batch, device, offload == "on")
                else:
                    n, side = (int(x) for x in case.split("x"))
                    model, opt, grads = build(n, side, device, offload == "on", adamw=False)
                for _ in range(3):
                    step(model, opt, grads, device)
                state = state_bytes(model, opt) / GiB
                print(
                    f"{case} fp32 on {device.type}, offload {offload}: {state:.2f} GiB of state; "
                    f"each line: {args.steps} steps saving to memory every k steps, over "
                    f"{args.steps} steps without, run just before (drift hits both)"
                )
                for mode in args.snapshot:
                    for k in args.every:
                        _overhead_line(args, model, opt, grads, step, state, mode, k, tmp, mem)
                del model, opt, grads
        for line in skipped:
            print(line)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(mem, ignore_errors=True)


def _p99(xs: list[float]) -> float:
    """The 99th percentile (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, -(-99 * len(xs) // 100) - 1))]


def _overhead_line(args, model, opt, grads, step, state, mode, k, tmp, mem) -> None:
    """One line of ``overhead``: steps without memory saves, then with one every ``k``; each
    step timed as the loop feels it (the step, then ``save()``)."""
    from muon_ckpt import CheckpointManager, MemoryOptions

    device = torch.device(args.device)
    sync(device)
    base = [step(model, opt, grads, device) for _ in range(args.steps)]
    url = os.path.join(tmp, f"run-{uuid.uuid4().hex[:8]}")
    with CheckpointManager(
        url,
        model=model,
        optimizer=opt,
        interval=10**7,
        memory=MemoryOptions(interval=k, dir=mem, flush=False, replicas=0),  # (one node)
        async_save="deferred" if mode == "deferred" else True,
    ) as mgr:
        mgr.load()
        mgr.save(0)
        mgr.wait()
        tier = mgr._saves.tier
        skipped = tier.skipped if tier is not None else 0
        times, blocked = [], 0.0
        sync(device)
        for s in range(1, args.steps + 1):
            took = step(model, opt, grads, device)
            t1 = time.perf_counter()
            mgr.save(s)
            blocked += time.perf_counter() - t1
            times.append(took + time.perf_counter() - t1)
        sync(device)
        mgr.wait()
        skipped = (tier.skipped if tier is not None else 0) - skipped
    med, bmed = statistics.median(times), statistics.median(base)
    took = sum(times) / len(times)
    print(
        f"  {mode:8} memory every {k:3} steps: median {med * 1e3:7.1f} ms a step "
        f"({bmed * 1e3:.1f} without) = {med / bmed:5.3f}x, p99 {_p99(times) * 1e3:.1f} ms "
        f"({_p99(base) * 1e3:.1f}) = {_p99(times) / _p99(base):5.3f}x; mean {took / (sum(base) / len(base)):5.3f}x; "
        f"save() blocks {blocked / args.steps * 1e3:5.1f} ms a step; dropped {skipped} of "
        f"{args.steps // k} saves (the previous still running); ~{state / (k * took):.2f} GiB/s "
        "of host bandwidth"
    )
    shutil.rmtree(url, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", nargs="?", choices=["restore", "overhead"], default="restore")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--size-gib", type=float, nargs="+", default=[0.5], help="restore: sizes")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--node-size", type=int, default=2)
    ap.add_argument("--url", default=None, help="'moto': the url on a local moto S3 server")
    ap.add_argument("--memory-dir", default=None, help="tier root (default: a new /dev/shm dir)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--case", action="append", help="overhead: N matrices of D x D (16x1024)")
    ap.add_argument("--gpt", action="append", default=[], help="overhead: LAYERSxDIMxBATCH")
    ap.add_argument("--snapshot", nargs="+", default=["blocking", "deferred"])
    ap.add_argument("--offload", nargs="+", choices=["on", "off"], default=["on", "off"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    if args.what == "restore":
        restore(args)
    else:
        overhead(args)


if __name__ == "__main__":
    main()
