"""Where a Muon step spends its GPU time: ours vs torch.optim.Muon, kernel by kernel.

    python benchmarks/profile_muon.py [--n 16] [--side 4096] [--steps 3] [--gpt-like]
      [--ns-dtype auto|bf16|fp32]

For each optimizer, profiles ``--steps`` steps (after two warm-up steps) with torch.profiler and
prints, per step: wall time, total kernel time, kernel time by kind (matmul, elementwise,
reduction, copy/cast, other) and the five heaviest kernels. Wall minus kernel time is time the
GPU sat idle (launch overhead or host syncs). ``--gpt-like`` profiles bench_muon.py's GPT-like set of
104 matrices instead of ``--n`` squares. A diagnostic companion to bench_muon.py, not a
benchmark of record: the profiler itself adds some overhead to both sides alike.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_muon import gpt_like_shapes
from optim import Muon

_KINDS = (
    ("matmul", ("gemm", "cutlass", "sm90", "sm100", "nvjet", "matmul", "xmma")),
    ("reduction", ("reduce", "norm")),
    ("copy/cast", ("copy", "cast", "convert")),
    ("elementwise", ("elementwise", "lerp", "foreach", "mul", "add", "div")),
)


def _kind(name: str) -> str:
    low = name.lower()
    for kind, keys in _KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def _kernel_times(prof) -> dict[str, float]:
    """Self device time (us) per kernel name."""
    out: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        out[ev.name] += ev.self_device_time_total if hasattr(ev, "self_device_time_total") else 0
    return out


def profile_one(label: str, make, steps: int) -> None:
    opt = make()
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e3
    kt = _kernel_times(prof)
    total = sum(kt.values()) / steps / 1e3
    by_kind: dict[str, float] = defaultdict(float)
    for name, us in kt.items():
        by_kind[_kind(name)] += us / steps / 1e3
    print(
        f"\n{label}: wall {wall:.2f} ms/step, kernels {total:.2f} ms/step, idle {wall - total:.2f}"
    )
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<12} {ms:8.3f} ms")
    for name, us in sorted(kt.items(), key=lambda kv: -kv[1])[:5]:
        print(f"    {us / steps / 1e3:8.3f} ms  {name[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--side", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gpt-like", action="store_true", help="the GPT-like set of bench_muon.py")
    ap.add_argument("--ns-dtype", default="auto", choices=("auto", "bf16", "fp32"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_muon.py needs a CUDA device")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    shapes = gpt_like_shapes() if args.gpt_like else [(args.side, args.side)] * args.n
    init = [torch.randn(s, generator=g).to(dev) for s in shapes]
    grads = [torch.randn(s, generator=g).to(dev) for s in shapes]
    hp = {"lr": 0.02, "weight_decay": 0.01, "momentum": 0.95, "nesterov": True}

    def params():
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        for p, gr in zip(ps, grads):
            p.grad = gr
        return ps

    what = "GPT-like" if args.gpt_like else f"{args.n} x {args.side}^2"
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {what} fp32")
    profile_one(
        "torch.optim.Muon",
        lambda: torch.optim.Muon(params(), adjust_lr_fn="match_rms_adamw", **hp),
        args.steps,
    )
    profile_one(
        f"optim.Muon (eager, ns_dtype={args.ns_dtype})",
        lambda: Muon([{"params": params(), "ns_dtype": args.ns_dtype, **hp}], chunk_size=8),
        args.steps,
    )


if __name__ == "__main__":
    main()
