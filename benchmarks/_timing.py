"""Small timing helpers shared by the benchmarks (not a test)."""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    fns: dict[str, Callable[[], object]], device: torch.device, iters: int, warmup: int = 2
) -> dict[str, float]:
    """Median wall time (s) of each of ``fns``, timed in rounds that run every function once,
    the order rotating from round to round: drift of the machine (GPU clocks falling as it
    heats, other jobs) hits every variant alike instead of whichever happens to run last."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(iters):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            sync(device)
            t0 = time.perf_counter()
            fns[k]()
            sync(device)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


GiB = 1 << 30


def free_bytes(path: str) -> int:
    """Free bytes (for an unprivileged writer) on the filesystem that holds ``path``, or would
    hold it: its nearest existing parent is asked."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return shutil.disk_usage(p).free


def headroom(need: int) -> int:
    """What a benchmark leaves free beside ``need`` bytes: a tenth of them and 1 GiB (DCP's
    metadata, the manifests, the page cache's write-back lag, other users of the disk)."""
    return need // 10 + GiB


def room_for(path: str, need: int, what: str) -> str | None:
    """None when ``need`` bytes plus :func:`headroom` fit the free space of ``path``'s
    filesystem, else why not (a line that names ``what``, the bytes needed and free)."""
    free = free_bytes(path)
    if need + headroom(need) <= free:
        return None
    return (
        f"{what}: needs {need / GiB:.1f} GiB (+{headroom(need) / GiB:.1f} GiB headroom) on "
        f"{path}, {free / GiB:.1f} GiB free"
    )


def fit_size_gib(size_gib: float, copies: float, paths: list[str], what: str) -> float:
    """The largest state size (GiB, at most ``size_gib``) of which ``copies`` copies plus
    headroom fit the free space of every one of ``paths``; prints why when it is smaller
    than asked. Raises SystemExit when not even 1/16 GiB fits."""
    fit = size_gib
    for path in paths:
        free = free_bytes(path) - GiB
        fit = min(fit, free / 1.1 / copies / GiB)
    if fit >= size_gib:
        return size_gib
    fit = int(fit * 16) / 16  # a round size
    if fit <= 0:
        raise SystemExit(
            f"{what}: {copies:g} copies of even 1/16 GiB of state do not fit the free space "
            f"of {', '.join(paths)} ({', '.join(f'{free_bytes(p) / GiB:.1f}' for p in paths)} "
            "GiB free): free some space or pass another directory"
        )
    print(
        f"{what}: --size-gib {size_gib:g} shrunk to {fit:g}: {copies:g} copies of the state "
        f"(+10% and 1 GiB headroom) must fit the free space of {', '.join(paths)} "
        f"({', '.join(f'{free_bytes(p) / GiB:.1f}' for p in paths)} GiB free)",
        flush=True,
    )
    return fit
