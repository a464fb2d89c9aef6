"""CPU offload of optimizer states: what a step feels of it, and what it saves, in one run.

    python -m benchmarks.bench_offload --device cuda [--iters 20] [--profile]
    python -m benchmarks.bench_offload --device cpu --tiny

Two sets of fp32 matrices trained with Muon (``chunk_size`` 8, ``ns_dtype`` and ``ns_method``
"auto"): ``uniform``, 16 x 4096^2, and ``gpt``, bench_muon.py's GPT-like 104 matrices
(12 layers, d = 1024). Each set is built three times (the same values): offload off, offload
on (the step's pipeline window: chunk k+1 in and k-1 out while k computes) and offload on with
no chunk kept going out (``window (1, 0)``: chunk k+1 comes in only once k-1 is out), all
timed in the same interleaved rounds (medians). Per set it prints:

- step time with offload on / off (targets: gpt <= 1.05x, uniform <= 1.00x);
- peak GPU memory of a step (``max_memory_allocated``): the state held between steps plus
  what the step allocates, offload on against off, against the target
  on <= off - (state - 2 chunks), with the largest three-chunk window of the pipeline's order
  (what the pool may hold at once) and what the pool itself recorded (``max_device_nbytes``);
- for ``uniform``, the pool's own host-to-device and device-to-host GB/s moving all states,
  against one 2 GiB pinned copy each way measured in the same run.

``--profile``: for each set, which stream waited for what in the offload-on step and the
offload-off one (``benchmarks/_profile.py``): the table a missed target's note needs.

Each set is sized to the GPU's free memory (fewer matrices, saying so, when three copies of
the params, the grads and one state do not fit with a fifth to spare).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._profile import stream_table
from benchmarks._timing import pick_device, sync, time_interleaved
from benchmarks.bench_muon import fit_shapes, gpt_like_shapes
from optim import Muon, set_ns_compile

MiB = 1 << 20
WINDOWS = {"on": (1, 1), "on (1,0)": (1, 0)}
TARGET = {"uniform": 1.00, "gpt": 1.05}


def pinned_peak(device: torch.device, nbytes: int) -> tuple[float, float]:
    """GB/s of one large pinned H2D and D2H copy (the ceiling for the pool's copies)."""
    if device.type != "cuda":
        return float("nan"), float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for dst, src in ((dev, host), (host, dev)):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        sync(device)
        rates.append(3 * nbytes / (time.perf_counter() - t0) / 1e9)
    return rates[0], rates[1]


def _build(shapes, device, offload: bool, window=(1, 1)):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]
    grads = [torch.randn(s, generator=g).to(device) for s in shapes]
    opt = Muon([{"params": ps, "lr": 0.02, "weight_decay": 0.01}], chunk_size=8)
    opt._offload_window = window

    def step() -> None:
        for p, gr in zip(ps, grads, strict=True):
            p.grad = gr
        opt.step()

    step()  # states exist
    if offload:
        opt.turn_on_cpu_offload()
    return opt, step


def _chunk_bytes(opt: Muon) -> list[int]:
    return [
        sum(it.param.numel() * it.param.element_size() for it in c) for c in opt._get_plan().chunks
    ]


def _peak(step, device) -> int:
    """What the step allocated beyond what was allocated before it (bytes)."""
    if device.type != "cuda":
        return 0
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def run_set(name: str, shapes, device, iters: int, profile: bool) -> dict:
    built = {"off": _build(shapes, device, False)}
    for label, window in WINDOWS.items():
        built[label] = _build(shapes, device, True, window)
    times = time_interleaved({k: s for k, (_, s) in built.items()}, device, iters)
    chunks = _chunk_bytes(built["off"][0])
    state = sum(chunks)
    out = {"name": name, "n": len(shapes), "ms": {k: v * 1e3 for k, v in times.items()}}
    out["state"], out["chunk"] = state, max(chunks)
    out["three"] = max(sum(chunks[j : j + 3]) for j in range(max(1, len(chunks) - 2)))
    # Peak of a step = the state held between steps (off: all of it; on: none) + what it adds.
    out["peak"] = {
        k: _peak(s, device) + (state if k == "off" else 0) for k, (_, s) in built.items()
    }
    for label in WINDOWS:
        pool = built[label][0]._cpu_offload_pool
        pool.reset_max_device_nbytes()
        built[label][1]()
        out.setdefault("pool_max", {})[label] = pool.max_device_nbytes()
        if device.type != "cuda":  # no allocator to ask: the pool's own count stands in
            out["peak"][label] = out["pool_max"][label]
    if name == "uniform":
        out["h2d"], out["d2h"] = _pool_rates(built["on"][0], device, max(3, iters // 4))
    if profile:
        for label in ("on", "off"):
            print(f"\n{name}, offload {label}: which stream waited for what")
            print("\n".join(stream_table(built[label][1], device)))
    return out


def _pool_rates(opt: Muon, device, iters: int) -> tuple[float, float]:
    """GB/s of the pool moving every state in and out (one bucket at a time, all queued)."""
    pool = opt._cpu_offload_pool
    nbytes = sum(pool._storage_nbytes.values())
    h2d = d2h = 0.0
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        pool.reload()
        pool.wait_reload()
        sync(device)
        t1 = time.perf_counter()
        pool.offload()
        sync(device)
        h2d, d2h = h2d + t1 - t0, d2h + time.perf_counter() - t1
    return nbytes * iters / h2d / 1e9, nbytes * iters / d2h / 1e9


def _mib(n: float) -> str:
    return f"{n / MiB:.0f}" if abs(n) >= 10 * MiB else f"{n / MiB:.3g}"


def report(rows: list[dict], peaks: tuple[float, float]) -> None:
    print(
        "\n| set | off ms | on ms | on / off (target) | on (1,0) ms | / off | peak MiB off | "
        "on | saved | target saved (state - 2 chunks) | 3-chunk window | pool held |"
    )
    print("| --- |" + " ---: |" * 11)
    for r in rows:
        ms, pk = r["ms"], r["peak"]
        ratio, tgt = ms["on"] / ms["off"], TARGET.get(r["name"], 1.0)
        saved, want = pk["off"] - pk["on"], r["state"] - 2 * r["chunk"]
        verdict = "met" if ratio <= tgt else f"missed by {ratio - tgt:.3f}"
        mem = "met" if saved >= want else f"missed by {_mib(want - saved)} MiB"
        print(
            f"| {r['name']}, {r['n']} matrices | {ms['off']:.2f} | {ms['on']:.2f} | "
            f"**{ratio:.3f}x** (<= {tgt:.2f}: {verdict}) | {ms['on (1,0)']:.2f} | "
            f"{ms['on (1,0)'] / ms['off']:.3f}x | {_mib(pk['off'])} | {_mib(pk['on'])} | "
            f"{_mib(saved)} | {_mib(want)} ({mem}) | {_mib(r['three'])} | "
            f"{_mib(r['pool_max']['on'])} / {_mib(r['pool_max']['on (1,0)'])} |"
        )
    for r in rows:
        if "h2d" in r:
            print(
                f"\npool copies ({r['name']}, {_mib(r['state'])} MiB): H2D {r['h2d']:.1f} GB/s "
                f"({100 * r['h2d'] / peaks[0]:.0f}% of one 2 GiB pinned copy, {peaks[0]:.1f}), "
                f"D2H {r['d2h']:.1f} GB/s ({100 * r['d2h'] / peaks[1]:.0f}% of {peaks[1]:.1f})"
            )
    print(
        "\npeak: state held between steps + what the step allocates (max_memory_allocated; on a "
        "CPU the pool's own count); saved: off - on; 3-chunk window: the most state three consecutive chunks hold; "
        "pool held: max_device_nbytes of the pool during a step, window (1,1) / (1,0)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sets", nargs="+", choices=["uniform", "gpt"], default=["uniform", "gpt"])
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU smoke run)")
    ap.add_argument("--profile", action="store_true", help="which stream waited for what")
    args = ap.parse_args()
    device = pick_device(args.device)
    set_ns_compile(False)
    sets = {
        "uniform": [(32, 32)] * 4 if args.tiny else [(4096, 4096)] * 16,
        "gpt": gpt_like_shapes(2, 16, False) if args.tiny else gpt_like_shapes(),
    }
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peaks = pinned_peak(device, (64 * MiB) if args.tiny else 2 << 30)
    print(
        f"device: {name}, torch {torch.__version__}, fp32 params, chunk_size 8, medians of {args.iters}"
    )
    rows = []
    for s in args.sets:
        shapes = fit_shapes(sets[s], device, copies=8, what=f"bench_offload {s}")
        rows.append(run_set(s, shapes, device, args.iters, args.profile))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report(rows, peaks)


if __name__ == "__main__":
    main()
