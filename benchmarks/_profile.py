"""Which stream waited for what during a step: a short table from torch.profiler (not a test).

``stream_table(step, device, steps)`` profiles ``steps`` calls of ``step`` (each followed by a
device synchronisation) and returns the lines of a table, per call averaged:

* per CUDA stream: what ran on it (kernels by kind: matmul, elementwise, reduction, copy/cast,
  other; host-to-device and device-to-host copies with their bytes and GB/s) and its busy time;
* the compute stream's idle time inside the step (its first kernel to its last), each gap put
  down to what it waited for: an H2D copy (a copy in ended where the gap ends: the next chunk's
  states were not in yet), a D2H copy, or the host (nothing on the GPU ended there: launch
  overhead, Python, a host synchronisation);
* the tail: device time after the compute stream's last kernel (copies still running).

The compute stream is the one with the most kernel time. On a CPU there are no streams: the
table lists the ops with the most self CPU time instead.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["stream_table"]

_KINDS = (
    ("matmul", ("gemm", "cutlass", "sm90", "sm100", "nvjet", "matmul", "xmma", "mm_")),
    ("reduction", ("reduce", "norm")),
    ("copy/cast", ("copy", "cast", "convert")),
    ("elementwise", ("elementwise", "lerp", "foreach", "mul", "add", "div", "triton")),
)
_MARK = "bench_profiled_step"
_NEAR_NS = 30_000  # a gap ends "at" a copy's end within 30 us (the event wait, the launch)


def _kind(name: str) -> str:
    low = name.lower()
    if "memcpy" in low and "htod" in low:
        return "H2D"
    if "memcpy" in low and "dtoh" in low:
        return "D2H"
    for kind, keys in _KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def _bytes(ev) -> int:
    try:
        meta = json.loads("{" + ev.metadata_json() + "}") if ev.metadata_json() else {}
    except (ValueError, AttributeError):
        return 0
    return int(meta.get("bytes", 0) or 0)


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def stream_table(step: Callable[[], object], device: torch.device, steps: int = 3) -> list[str]:
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()  # (warm: allocations, cuBLAS handles)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            with record_function(_MARK):
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
    events = list(prof.profiler.kineto_results.events())
    if device.type != "cuda":
        return _cpu_table(events, steps)
    return _cuda_table(events, steps)


def _cpu_table(events, steps: int) -> list[str]:
    self_ns: dict[str, int] = defaultdict(int)
    for ev in events:
        if ev.device_type() == torch.autograd.DeviceType.CPU and ev.name() != _MARK:
            self_ns[ev.name()] += ev.duration_ns()
    top = sorted(self_ns.items(), key=lambda kv: -kv[1])[:8]
    lines = ["CPU: no streams (copies are synchronous); ops by CPU time (incl. children), ms/step:"]
    lines += [f"  {name:40} {ns / steps / 1e6:8.3f}" for name, ns in top]
    return lines


def _cuda_table(events, steps: int) -> list[str]:
    dev = [e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA]
    marks = sorted((e.start_ns(), e.end_ns()) for e in events if e.name() == _MARK)
    by_stream: dict[int, list] = defaultdict(list)
    for e in dev:
        by_stream[e.device_resource_id()].append(e)
    kernel_ns = {
        s: sum(e.duration_ns() for e in evs if _kind(e.name()) not in ("H2D", "D2H"))
        for s, evs in by_stream.items()
    }
    if not kernel_ns:
        return ["no CUDA activity was recorded"]
    compute = max(kernel_ns, key=kernel_ns.__getitem__)
    lines = ["| stream | ran (ms per step) | busy ms | GB/s |", "| --- | --- | ---: | ---: |"]
    for s, evs in sorted(by_stream.items(), key=lambda kv: kv[0] != compute):
        kinds: dict[str, int] = defaultdict(int)
        nbytes = 0
        for e in evs:
            kinds[_kind(e.name())] += e.duration_ns()
            nbytes += _bytes(e) if _kind(e.name()) in ("H2D", "D2H") else 0
        busy = sum(b - a for a, b in _union([(e.start_ns(), e.end_ns()) for e in evs]))
        what = ", ".join(f"{k} {v / steps / 1e6:.2f}" for k, v in sorted(kinds.items()))
        label = "compute" if s == compute else "side"
        rate = f"{nbytes / busy:.1f}" if nbytes and busy else "-"
        lines.append(f"| {label} {s} | {what} | {busy / steps / 1e6:.2f} | {rate} |")
    lines += _waits(by_stream, compute, marks, steps)
    return lines


def _waits(by_stream, compute: int, marks, steps: int) -> list[str]:
    """The compute stream's gaps inside each step, by what ended where each gap ends."""
    copies = [
        (e.end_ns(), _kind(e.name()))
        for s, evs in by_stream.items()
        if s != compute
        for e in evs
        if _kind(e.name()) in ("H2D", "D2H")
    ]
    waited: dict[str, int] = defaultdict(int)
    tail = 0
    for m0, m1 in marks:
        spans = _union(
            [(e.start_ns(), e.end_ns()) for e in by_stream[compute] if m0 <= e.start_ns() <= m1]
        )
        if not spans:
            continue
        for (_, a), (b, _) in itertools.pairwise(spans):
            ended = [k for t, k in copies if b - _NEAR_NS <= t <= b + _NEAR_NS // 3]
            cause = "H2D" if "H2D" in ended else "D2H" if "D2H" in ended else "host"
            waited[cause] += b - a
        last = max((t for t, _ in copies if m0 <= t <= m1), default=spans[-1][1])
        tail += max(0, last - spans[-1][1])
    w = {k: v / steps / 1e6 for k, v in waited.items()}
    return [
        "",
        "compute stream idle inside the step, ms per step, by what it waited for: "
        f"H2D copy {w.get('H2D', 0):.2f}, D2H copy {w.get('D2H', 0):.2f}, host (launches, "
        f"Python, syncs) {w.get('host', 0):.2f}; copies after its last kernel "
        f"{tail / steps / 1e6:.2f}",
    ]
