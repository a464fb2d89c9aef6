"""CPU offload of optimizer states: step time on vs off, copy speed vs the pinned peak.

    python benchmarks/bench_offload.py [--device cuda] [--chunk-size 8] [--iters 10]

For 16 x 4096^2 matrices in fp32 and in bf16 (momentum has the param's dtype) it prints:
- Muon step time with offload off and on, and their ratio (target <= 1.10);
- the pool's achieved host-to-device and device-to-host GB/s moving all states, against the
  pinned-memory peak measured in the same run with one 2 GiB copy (target >= 80%);
- optimizer-state bytes held on the device between steps (target 0), and the drop in
  torch.cuda.memory_allocated() that offload gives.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._timing import pick_device, sync, time_it
from optim import Muon, set_ns_compile


def pinned_peak(device: torch.device, nbytes: int) -> tuple[float, float]:
    """GB/s of one large pinned H2D and D2H copy (the ceiling for the pool's copies)."""
    if device.type != "cuda":
        return float("nan"), float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = time_it(lambda: dev.copy_(host, non_blocking=True), device, 5)
    d2h = time_it(lambda: host.copy_(dev, non_blocking=True), device, 5)
    return nbytes / h2d / 1e9, nbytes / d2h / 1e9


def run(dtype: torch.dtype, device, n: int, dim: int, chunk_size: int, iters: int) -> dict:
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(dim, dim, generator=g).to(device, dtype) for _ in range(n)]
    grads = [torch.randn(dim, dim, generator=g).to(device, dtype) for _ in range(n)]
    out = {}
    for offload in (False, True):
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        for p, gr in zip(ps, grads):
            p.grad = gr
        opt = Muon([{"params": ps, "lr": 0.02, "weight_decay": 0.01}], chunk_size=chunk_size)
        opt.step()  # creates the states
        if offload:
            opt.turn_on_cpu_offload()
        sync(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        out[f"step_{offload}"] = time_it(opt.step, device, iters)
        sync(device)
        out[f"alloc_{offload}"] = (
            torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        ) - base
        if offload:
            pool = opt._cpu_offload_pool
            out["state_bytes_on_device"] = pool.device_nbytes()
            out["state_bytes"] = sum(pool._storage_nbytes.values())

            def reload_all(pool=pool):
                pool.reload()
                pool.wait_reload()

            # Reload and offload timed separately; each leaves the pool as it found it.
            sync(device)
            out["h2d_s"] = _time_half(reload_all, pool.offload, device, iters)
            out["d2h_s"] = _time_half(pool.offload, reload_all, device, iters, offloaded=False)
            out["allocated_with_offload"] = (
                torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            )
        else:
            out["allocated_without_offload"] = (
                torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            )
        del opt, ps
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _time_half(measured, restore, device, iters, offloaded=True):
    import statistics
    import time

    times = []
    for _ in range(iters):
        if not offloaded:
            restore()  # bring states home first so that `measured` (offload) has work
            sync(device)
        sync(device)
        t0 = time.perf_counter()
        measured()
        sync(device)
        times.append(time.perf_counter() - t0)
        if offloaded:
            restore()
            sync(device)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--chunk-size", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--dim", type=int, default=4096)
    args = ap.parse_args()
    device = pick_device(args.device)
    set_ns_compile(device.type == "cuda")
    h2d_peak, d2h_peak = pinned_peak(device, 2 * 2**30)
    print(
        f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}"
    )
    print(f"pinned peak (2 GiB copy): H2D {h2d_peak:.1f} GB/s, D2H {d2h_peak:.1f} GB/s")
    print(f"{args.n} x {args.dim}^2, chunk_size={args.chunk_size}")
    print(
        f"{'dtype':<9} {'off ms':>8} {'on ms':>8} {'on/off':>7} {'H2D GB/s':>9} {'%peak':>6} {'D2H GB/s':>9} {'%peak':>6} {'state MiB':>9} {'on GPU B':>9} {'alloc saved MiB':>15}"
    )
    for dtype in (torch.float32, torch.bfloat16):
        r = run(dtype, device, args.n, args.dim, args.chunk_size, args.iters)
        h2d = r["state_bytes"] / r["h2d_s"] / 1e9
        d2h = r["state_bytes"] / r["d2h_s"] / 1e9
        saved = (r["allocated_without_offload"] - r["allocated_with_offload"]) / 2**20
        print(
            f"{str(dtype).split('.')[-1]:<9} {r['step_False'] * 1e3:>8.2f} {r['step_True'] * 1e3:>8.2f} "
            f"{r['step_True'] / r['step_False']:>6.3f}x {h2d:>9.1f} {100 * h2d / h2d_peak:>5.0f}% "
            f"{d2h:>9.1f} {100 * d2h / d2h_peak:>5.0f}% {r['state_bytes'] / 2**20:>9.0f} "
            f"{r['state_bytes_on_device']:>9d} {saved:>15.0f}"
        )


if __name__ == "__main__":
    main()
