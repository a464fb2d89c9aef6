"""What a training loop feels of a checkpoint: the time ``save()`` blocks, the step time while a
write is in flight, the end-to-end save speed and peak extra GPU memory, next to references
measured in the same run.

For each case (N square fp32 matrices trained with Muon; CPU offload of the momentum on / off):

* blocked: the time ``CheckpointManager(async_save=True).save()`` takes to return, per GiB of
  state (parameters + momentum), against ``dcp.async_save`` of the same state: with DCP's
  default stager, and with its pinned-memory stager (torchtitan's ``async_with_pinned_mem``;
  there the loop must wait for the staging before its next step, so that is counted). With
  offload on, a DCP user first has to call ``turn_off_cpu_offload()`` (and turn it on after):
  that is part of DCP's blocked time. DCP's copies are written to ``--dcp-dir`` (a tmpfs by
  default where there is one): only its blocked time is used;
* steps in flight: the median step time of the steps run while our write is in flight, over
  the median step time with no write;
* end to end: state bytes / (save() call -> manifest written; retention, which deletes the
  step before, comes after and is timed on its own), against plain parallel writes of the same
  bytes to the same storage (``io_threads`` streams, fsync, write-out queued as the manager
  does: ``bench_checkpoint.storage_write``);
* peak extra GPU memory (``max_memory_allocated`` over the between-steps baseline) of an
  asynchronous save (no steps in between), a synchronous save and a load.

The first save of a manager allocates (and page-locks) its host buffers: it is reported on its
own, and the figures are medians of the ``--rounds`` later ones.

The cases must fit the machine: before each one the free space of the checkpoint directory is
checked against what it writes at most at once (``STEPS_AT_ONCE`` copies of its state, all
ranks, plus a tenth and 1 GiB), and that of ``--dcp-dir`` against one copy (DCP's reference);
a case that does not fit is skipped (a DCP reference that does not fit is left out), and the
report says what was skipped and why. Each case's steps are deleted once it is measured.

Usage::

    python benchmarks/bench_async_save.py --device cuda --case 16x4096 --case 16x8192
    torchrun --nproc-per-node=2 benchmarks/bench_async_save.py --device cpu --case 8x1024
    torchrun --nproc-per-node=2 benchmarks/bench_async_save.py --device cpu --case 8x1024 --url moto
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import room_for
from bench_checkpoint import start_moto, storage_write

from muon_ckpt import CheckpointManager
from muon_ckpt._tensors import local_tensor, tensor_bytes
from muon_ckpt.state import FlatState
from muon_ckpt.store import Storage
from optim.muon import Muon

GiB, MiB = 1 << 30, 1 << 20
# Steps of one case on disk at most at once: the one kept (keep_last=1) and the one being
# written; then one more, the synchronous save (or the plain writes) beside the one kept.
STEPS_AT_ONCE = 3


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    if dist.is_initialized():
        dist.barrier()


def build(
    n: int, side: int, dev: torch.device, offload: bool, adamw: bool
) -> tuple[nn.Module, Muon, list]:
    """N side x side fp32 matrices (row-sharded DTensors over every rank when there are
    several, as FSDP2 makes them), their optimizer (Muon, or with ``adamw`` its AdamW groups:
    the CPU's bf16 matrix products make Muon steps seconds long there) and fixed gradients."""
    torch.manual_seed(0)
    mesh = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (dist.get_world_size(),))

    def make() -> torch.Tensor:
        t = torch.randn(side, side, device=dev)
        if mesh is None:
            return t
        from torch.distributed.tensor import Shard, distribute_tensor

        return distribute_tensor(t, mesh, [Shard(0)])

    model = nn.Module()
    for i in range(n):
        model.register_parameter(f"w{i}", nn.Parameter(make()))
    opt = Muon(list(model.parameters()), chunk_size=8, lr=0.02, use_muon=not adamw)
    grads = [make() for _ in range(n)]
    if offload:
        opt.turn_on_cpu_offload()
    return model, opt, grads


def build_gpt(
    layers: int, dim: int, batch: int, dev: torch.device, offload: bool
) -> tuple[nn.Module, Muon, None]:
    """A GPT-like stack (``layers`` MLP blocks of dim x 4dim and back, FSDP2 over every rank
    when there are several) whose forward and backward on a ``batch`` x dim input take most
    of a step; Muon on every matrix."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[
            nn.Sequential(
                nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False)
            )
            for _ in range(layers)
        ]
    ).to(dev)
    if dist.is_initialized() and dist.get_world_size() > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.batch = torch.randn(batch, dim, device=dev)  # type: ignore[assignment]
    opt = Muon(list(model.parameters()), chunk_size=8, lr=0.02)
    if offload:
        opt.turn_on_cpu_offload()
    return model, opt, None


def planned_bytes(case: str, adamw: bool) -> int:
    """The state bytes (all ranks) a case will have, before it is built: fp32 parameters and
    Muon's momentum (AdamW: two moments)."""
    if case.startswith("gpt"):
        layers, dim, _ = (int(x) for x in case[3:].split("x"))
        params = layers * 8 * dim * dim * 4
    else:
        n, side = (int(x) for x in case.split("x"))
        params = n * side * side * 4
    return params * (3 if adamw else 2)


def step(model: nn.Module, opt: Muon, grads: list | None, dev: torch.device) -> float:
    """One training step: the fixed gradients set (matrices), or a forward and backward
    (``build_gpt``); then the optimizer step."""
    sync(dev)
    t0 = time.perf_counter()
    if grads is None:
        model(model.batch).float().pow(2).mean().backward()
    else:
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
    opt.step()
    opt.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def state_bytes(model: nn.Module, opt: Muon) -> int:
    """This rank's bytes of parameters and optimizer states (momentum, or AdamW's moments)."""
    n = sum(_nbytes(local_tensor(p)) for p in model.parameters())
    counts = {"momentum_buffer": 1, "moment1": 1, "moment2": 1}
    return n * (1 + sum(counts.get(k, 0) for k in next(iter(opt.state.values()))))


def _say(line: str) -> None:
    """Print on rank 0 only (every rank comes to the same verdict)."""
    if rank() == 0:
        print(line, flush=True)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _any_rank(flag: bool) -> bool:
    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cpu_group())
    return bool(t.item())


_GROUP: list[Any] = []


def _cpu_group() -> Any:
    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


def measure_ours(
    model, opt, grads, dev, url, opts, rounds: int, io_threads: int, plain, snapshot: str
) -> dict[str, Any]:
    """Our saves, each round after one run of ``plain()`` (plain writes of the same bytes to
    the same storage: interleaved, so that both meet the disk in the same state)."""
    mgr = CheckpointManager(
        url,
        model=model,
        optimizer=opt,
        storage_options=opts,
        async_save="deferred" if snapshot == "deferred" else True,
        keep_last=1,
        io_threads=io_threads,
    )
    base_steps = [step(model, opt, grads, dev) for _ in range(5)]
    out: dict[str, Any] = {
        "blocked": [],
        "e2e": [],
        "in_flight": [],
        "steps": base_steps,
        "plain": [],
        "next_step": [],  # the first step after save() returned
    }
    for r in range(rounds + 1):
        if r:
            out["plain"].append(plain(r))
        sync(dev)
        t0 = time.perf_counter()
        mgr.save(r + 1, force=True)
        blocked = time.perf_counter() - t0
        flight = []
        job = mgr._saves.pending
        while _any_rank(job is not None and not job.done()):  # every rank steps alike
            flight.append(step(model, opt, grads, dev))
        mgr.wait()
        e2e = (job.written.committed_at if job is not None else time.perf_counter()) - t0
        if r == 0:
            out["first_blocked"] = blocked
            continue
        out["blocked"].append(blocked)
        out["e2e"].append(e2e)
        if flight:
            out["next_step"].append(flight[0])
        out["in_flight"] += flight[1:] or flight  # the first step also waits for the GIL
        out["steps"] += [step(model, opt, grads, dev) for _ in range(3)]
    # The same save with no training in flight (what the write costs by itself), its phases.
    sync(dev)
    t0 = time.perf_counter()
    mgr.save(rounds + 2, force=True)
    job = mgr._saves.pending
    mgr.wait()
    out["idle_e2e"] = (job.written.committed_at if job is not None else time.perf_counter()) - t0
    out["phases"] = dict(mgr.last_save_timings)
    # Peak extra GPU memory: a save with no step in between, a synchronous save, a load.
    if dev.type == "cuda":
        smgr = CheckpointManager(url + "-sync", model=model, optimizer=opt, storage_options=opts)
        peaks = {}
        for name, fn in (
            ("save", lambda: (mgr.save(100, force=True), mgr.wait())),
            ("sync save", lambda: smgr.save(100, force=True)),
            ("load", lambda: mgr.load(100)),
        ):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out[f"{name} s"] = time.perf_counter() - t0
            peaks[name] = (torch.cuda.max_memory_allocated() - base) / MiB
        out["peaks"] = peaks
        smgr.close()
    mgr.close()
    return out


_STAGER_NOT_REUSABLE = torch.__version__.startswith("2.11.")


def measure_dcp(model, opt, dev, path: str, rounds: int, pinned: bool, group) -> list[float] | None:
    """Blocked time of dcp.async_save of the same state (offload turned off and on around it
    when it is on, as DCP needs ordinary device tensors)."""
    stager = None
    if pinned:
        if dev.type != "cuda":
            return None  # pinned memory and non-blocking copies need an accelerator
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:
            return None
        stager = DefaultStager(StagingOptions(True, False, True, True))
    times = []
    for r in range(rounds + 1):
        d = os.path.join(path, f"dcp-{r}")
        if stager is not None and r and _STAGER_NOT_REUSABLE:
            # torch 2.11's DefaultStager cannot stage a second time (pytorch#183413: its
            # _stage() closes itself): a new one per save, as a job on 2.11 must do.
            stager = DefaultStager(StagingOptions(True, False, True, True))
        sync(dev)
        t0 = time.perf_counter()
        was_on = opt.cpu_offload
        if was_on:
            opt.turn_off_cpu_offload()
        # The tensors (DCP's pinned stager cannot deep-copy some of the Python values).
        sd = {k: v for k, v in FlatState.build(model, opt, {}).sd.items() if torch.is_tensor(v)}
        kw: dict[str, Any] = {"process_group": group}
        if stager is not None:
            kw["async_stager"] = stager
        fut = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(d), **kw)
        staged = getattr(fut, "staging_completion", None)
        if staged is not None:
            staged.result()  # the loop may not step before the copies are done
        if was_on:
            opt.turn_on_cpu_offload()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        blocked = time.perf_counter() - t0
        (getattr(fut, "upload_completion", None) or fut).result()
        sync(dev)
        if rank() == 0:
            shutil.rmtree(d, ignore_errors=True)
        if r:
            times.append(blocked)
    if stager is not None:
        stager.close()
    return times


def plain_writer(model, copies: int, st: Storage, threads: int):
    """A function that writes this rank's state bytes as plain files (all ranks at once, to the
    same storage) and returns the bytes per second."""
    keep = []
    for p in model.parameters():
        t = local_tensor(p).detach().cpu().contiguous()
        keep += [t] + [t.clone() for _ in range(copies - 1)]  # params, and as many per state
    views = [tensor_bytes(t) for t in keep]

    def run(r: int) -> float:
        sync(torch.device("cpu"))
        t0 = time.perf_counter()
        storage_write(st, views, threads, f"plain{r}-{rank()}", writeback=True)
        sync(torch.device("cpu"))
        secs = time.perf_counter() - t0
        st.rm(f"raw-plain{r}-{rank()}")
        return sum(v.nbytes for v in views) / secs

    run.keep = keep  # the bytes stay alive with the function
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--case", action="append", help="NxSIDE matrices, e.g. 16x4096")
    ap.add_argument("--url", default=None, help="checkpoint root (default: a temp dir; 'moto')")
    ap.add_argument("--dcp-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--adamw", action="store_true", help="AdamW groups instead of Muon ones")
    ap.add_argument(
        "--gpt",
        action="append",
        default=[],
        help="LAYERSxDIMxBATCH: a GPT-like stack whose forward and backward take most of a step",
    )
    ap.add_argument(
        "--snapshot",
        nargs="+",
        default=["blocking", "deferred"],
        choices=["blocking", "deferred"],
        help="the snapshot modes to measure, in the same run",
    )
    args = ap.parse_args()
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        if args.device == "cuda":
            torch.cuda.set_device(rank())
    dev = torch.device(args.device, rank()) if args.device == "cuda" else torch.device("cpu")
    server, opts = None, {}
    tmp = tempfile.mkdtemp(prefix="bench-async-")
    run_id = [uuid.uuid4().hex[:8], args.url or tmp]  # rank 0's temp dir for every rank
    if dist.is_initialized():
        dist.broadcast_object_list(run_id)
    url = run_id[1]
    if url == "moto":
        if rank() == 0:
            server, opts = start_moto()
        box = [opts]
        if dist.is_initialized():
            dist.broadcast_object_list(box)
        opts = box[0]
        bucket = f"bench-{uuid.uuid4().hex[:8]}" if rank() == 0 else None
        bb = [bucket]
        if dist.is_initialized():
            dist.broadcast_object_list(bb)
        url = f"s3://{bb[0]}/run"
        if rank() == 0:
            Storage(url, opts).fs.mkdir(bb[0])
        sync(dev)
    else:
        url = f"{url.rstrip('/')}/run-{run_id[0]}"  # never an earlier run's steps
    dcp_dir = tempfile.mkdtemp(prefix="bench-dcp-", dir=args.dcp_dir)
    box = [dcp_dir]
    if dist.is_initialized():
        dist.broadcast_object_list(box)
    dcp_dir = box[0]
    group = _cpu_group() if dist.is_initialized() else None
    rows: list = []
    skipped: list[str] = []
    cases = (args.case or ([] if args.gpt else ["16x4096"])) + [f"gpt{g}" for g in args.gpt]
    local = "://" not in url
    for case in cases:
        planned = planned_bytes(case, args.adamw)
        why = room_for(url, STEPS_AT_ONCE * planned, f"{case} skipped") if local else None
        if _any_rank(why is not None):  # one host's disk (or ranks' disks): all skip alike
            skipped.append(why or f"{case} skipped: another rank lacks the space")
            _say(skipped[-1])
            continue
        no_dcp = room_for(dcp_dir, planned, f"{case}: dcp.async_save reference left out")
        if _any_rank(no_dcp is not None):
            skipped.append(no_dcp or f"{case}: dcp reference left out (another rank's space)")
            _say(skipped[-1])
        for offload in (True, False):
            if case.startswith("gpt"):
                layers, dim, batch = (int(x) for x in case[3:].split("x"))
                model, opt, grads = build_gpt(layers, dim, batch, dev, offload)
            else:
                n, side = (int(x) for x in case.split("x"))
                model, opt, grads = build(n, side, dev, offload, args.adamw)
            step(model, opt, grads, dev)  # states exist (and are parked, with offload on)
            nbytes = state_bytes(model, opt)
            gib = nbytes / GiB
            copies = nbytes // sum(_nbytes(local_tensor(p)) for p in model.parameters())
            plain = plain_writer(model, copies, Storage(url, opts), args.io_threads)
            run_url = f"{url}/{case}-{'on' if offload else 'off'}"
            modes = {}
            for mode in args.snapshot:
                mode_url = f"{run_url}-{mode}"
                modes[mode] = measure_ours(
                    model,
                    opt,
                    grads,
                    dev,
                    mode_url,
                    opts,
                    args.rounds,
                    args.io_threads,
                    plain,
                    mode,
                )
                sync(dev)
                if rank() == 0:  # the case's steps go: the next case needs the space
                    Storage(mode_url, opts).rm()
                    Storage(mode_url + "-sync", opts).rm()
                sync(dev)
            k = max(1, args.rounds - 1)
            ref = ref_pin = None
            if no_dcp is None:
                ref = measure_dcp(model, opt, dev, dcp_dir, k, pinned=False, group=group)
                try:
                    ref_pin = measure_dcp(model, opt, dev, dcp_dir, k, pinned=True, group=group)
                except Exception as e:  # report it and go on: it is a reference, not ours
                    print(f"dcp.async_save with the pinned stager failed: {type(e).__name__}: {e}")
            for mode, ours in modes.items():
                label = f"{case}:{mode[:5]}"
                rows.append(
                    (label, offload, gib, statistics.median(ours["plain"]), ours, ref, ref_pin)
                )
            del model, opt, grads
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if rank() == 0:
        report(rows, dev, dist.get_world_size() if dist.is_initialized() else 1, url)
        for line in skipped:
            print(line)
    sync(dev)
    if rank() == 0:
        Storage(url, opts).rm()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(dcp_dir, ignore_errors=True)
    if server is not None:
        server.stop()
    if dist.is_initialized():
        dist.destroy_process_group()


def report(rows, dev, world: int, url: str) -> None:
    med = statistics.median
    print(f"\ndevice {dev}, {world} rank(s), storage {url}; medians; state = params + momentum")
    print(
        f"{'case':>16} {'offload':>7} {'state':>8} | {'blocked':>9} {'ms/GiB':>7} "
        f"{'first':>8} | {'dcp.async':>9} {'ratio':>6} {'dcp pin':>9} {'ratio':>6} | "
        f"{'step':>8} {'next':>8} {'ratio':>6} {'in flight':>9} {'ratio':>6} | "
        f"{'e2e GB/s':>8} {'plain':>6} {'ratio':>6} | peak MiB save/sync/load"
    )
    for case, offload, gib, plain, o, ref, ref_pin in rows:
        b = med(o["blocked"])
        r = med(ref) if ref else float("nan")
        rp = med(ref_pin) if ref_pin else float("nan")
        st, fl = med(o["steps"]), med(o["in_flight"]) if o["in_flight"] else float("nan")
        nx = med(o["next_step"]) if o["next_step"] else float("nan")
        e2e = gib * GiB * world / med(o["e2e"]) / 1e9
        peaks = o.get("peaks")
        pk = "/".join(f"{peaks[k]:.0f}" for k in ("save", "sync save", "load")) if peaks else "-"
        print(
            f"{case:>16} {'on' if offload else 'off':>7} {gib * world:>6.2f}Gi | "
            f"{b * 1e3:>7.1f}ms {b * 1e3 / gib:>7.1f} {o['first_blocked'] * 1e3:>6.0f}ms | "
            f"{r * 1e3:>7.0f}ms {b / r:>6.3f} {rp * 1e3:>7.0f}ms {b / rp:>6.3f} | "
            f"{st * 1e3:>6.1f}ms {nx * 1e3:>6.1f}ms {nx / st:>6.3f} "
            f"{fl * 1e3:>7.1f}ms {fl / st:>6.3f} | {e2e:>8.2f} "
            f"{plain * world / 1e9:>6.2f} {e2e / (plain * world / 1e9):>6.3f} | {pk}"
        )
    for case, offload, gib, _, o, _, _ in rows:
        ph = " ".join(f"{k} {v:.3f}" for k, v in o["phases"].items())
        print(
            f"{case} offload {'on' if offload else 'off'}: e2e with no training in flight "
            f"{gib * GiB * world / o['idle_e2e'] / 1e9:.2f} GB/s; its phases (s): {ph}"
        )
        if "sync save s" in o:
            print(f"  a synchronous save: {gib * GiB / o['sync save s'] / 1e9:.2f} GB/s")
    print(
        "blocked: save() until it returns (rank 0; ms/GiB of that rank's state); ratio: ours / "
        "the reference; step: "
        "median step without a write; next: the first step after save() returned (it waits for "
        "a deferred snapshot's copies); in flight: median step while our write runs; e2e: state "
        "bytes over save() -> commit, all ranks; plain: plain parallel writes of the same bytes"
    )


if __name__ == "__main__":
    main()
