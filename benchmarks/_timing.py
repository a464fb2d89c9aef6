"""Small timing helpers shared by the benchmarks (not a test)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in seconds, synchronising the device around each call."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
