"""Muon step time against torch.optim.Muon on the same params, in the same run, and the levers.

    python3 benchmarks/bench_muon.py --device cuda [--iters 20]
    python3 benchmarks/bench_muon.py --device cpu --small [--without-bf16-units]

Cases: 16 uniform 4096^2 fp32 matrices, and a GPT-like set of 104 (the attention and MLP matrices
of a 12-layer d=1024 model plus 32 small ones); ``--small``: 16 x 256^2 and the GPT-like set at
d=128, for a CPU. Every variant of a case is timed in the same interleaved rounds (order
rotating, medians), so that clocks falling as the machine heats up favour none of them:

- torch.optim.Muon, and ours with ``ns_dtype="auto"`` (what this device picks);
- ours with the other ``ns_dtype`` (fp32 against bf16), with CPU offload on, with compiled NS;
- Newton-Schulz alone: one matrix at a time (torch's way), in the batches of same-shape matrices
  our step forms, and (CUDA) those batches replayed as CUDA graphs (the launch cost a graph
  would save).

Prints the milliseconds and the ratios (lower is better). ``--without-bf16-units`` (CPU) turns
oneDNN off for the run: bf16 matrix products then take torch's scalar fallback, as on a CPU
without AVX512-BF16 or AMX, and ``"auto"`` picks fp32.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._timing import pick_device, time_interleaved
from optim import Muon, set_ns_compile
from optim._ns_dtype import NS_DTYPES, auto_ns_dtype, fast_bf16_reason
from optim._plan import build_plan
from optim.newton_schulz import newton_schulz, zeropower_via_newtonschulz

HP = {"lr": 0.02, "weight_decay": 0.01, "momentum": 0.95, "nesterov": True}


def gpt_like_shapes(layers: int = 12, d: int = 1024) -> list[tuple[int, int]]:
    shapes = []
    for _ in range(layers):
        shapes += [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)]
    shapes += [(64, 64)] * 16 + [(128, 256)] * 8 + [(256, 32)] * 8  # small heads / adapters
    return shapes


def _units(opt: Muon) -> list[list[int]]:
    """The batches of same-shape matrices (indices into the group's params) ours runs."""
    plan = build_plan(opt.param_groups, opt.chunk_size)
    index = {id(p): i for i, p in enumerate(opt.param_groups[0]["params"])}
    units: dict[int, list[int]] = {}
    for it in plan.items:
        units.setdefault(it.unit, []).append(index[id(it.param)])
    return list(units.values())


def _graphed(batches: list[list[torch.Tensor]]) -> Callable[[], None]:
    """Newton-Schulz of each batch captured once as a CUDA graph; the returned function copies
    the inputs into the graphs' static buffers and replays them (sharing one memory pool)."""
    runs = []
    pool = None
    for mats in batches:
        static = torch.stack(mats) if len(mats) > 1 else mats[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (cuBLAS workspaces, plans)
            zeropower_via_newtonschulz(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            zeropower_via_newtonschulz(static)
        pool = graph.pool()
        runs.append((graph, static, mats))

    def run() -> None:
        for graph, static, mats in runs:
            if len(mats) > 1:
                torch.stack(mats, out=static)
            else:
                static.copy_(mats[0])
            graph.replay()

    return run


def bench_case(shapes: list[tuple[int, int]], device: torch.device, iters: int) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    init = [torch.randn(s, generator=g).to(device) for s in shapes]
    grads = [torch.randn(s, generator=g).to(device) for s in shapes]
    auto = auto_ns_dtype(device)
    other = "fp32" if auto == "bf16" else "bf16"

    def params() -> list[torch.nn.Parameter]:
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        for p, gr in zip(ps, grads):
            p.grad = gr
        return ps

    def ours(ns_dtype: str = "auto", offload: bool = False, compiled: bool = False):
        opt = Muon([{"params": params(), "ns_dtype": ns_dtype, **HP}], chunk_size=8)
        if offload:
            opt.turn_on_cpu_offload()

        def step() -> None:
            set_ns_compile(compiled)
            opt.step()

        return step, opt

    torch_opt = torch.optim.Muon(params(), adjust_lr_fn="match_rms_adamw", **HP)
    eager, opt = ours()
    mats = [gr.to(NS_DTYPES[auto]) for gr in grads]
    batches = [[mats[i] for i in u] for u in _units(opt)]
    dt = NS_DTYPES[auto]
    fns: dict[str, Callable[[], object]] = {
        "torch": torch_opt.step,
        "ours": eager,
        "other dtype": ours(other)[0],
        "offload": ours(offload=True)[0],
        "compiled": ours(compiled=True)[0],
        "ns one by one": lambda: [zeropower_via_newtonschulz(m, dtype=dt) for m in mats],
        "ns batches": lambda: [newton_schulz(b, dtype=dt) for b in batches],
    }
    if device.type == "cuda":
        fns["ns graphs"] = _graphed(batches)
    ms = {k: v * 1e3 for k, v in time_interleaved(fns, device, iters).items()}
    set_ns_compile(False)
    ms["auto"], ms["batches"] = auto, len(batches)
    return ms


def _table(rows: list[tuple[str, int, dict]], device: torch.device) -> None:
    auto = rows[0][2]["auto"]
    other = "fp32" if auto == "bf16" else "bf16"
    graphs = device.type == "cuda"
    cols = [
        ("torch.optim.Muon", "torch"),
        (f"ours ({auto}, auto)", "ours"),
        (f"ours, {other} NS", "other dtype"),
        ("ours, offload on", "offload"),
        ("ours, compiled NS", "compiled"),
        ("NS only, one by one", "ns one by one"),
        ("NS only, our batches", "ns batches"),
    ] + ([("NS only, batches as CUDA graphs", "ns graphs")] if graphs else [])
    print("| case | " + " | ".join(c for c, _ in cols) + " |")
    print("| --- |" + " ---: |" * len(cols))
    for name, n, ms in rows:
        cells = " | ".join(f"{ms[k]:.2f} ms" for _, k in cols)
        print(f"| {name}, {n} matrices ({ms['batches']} batches) | {cells} |")
    fp = ("other dtype", "ours") if auto == "bf16" else ("ours", "other dtype")
    ratios = [
        ("ours / torch", ("ours", "torch")),
        ("offload on / off", ("offload", "ours")),
        ("fp32 / bf16 NS", fp),
        ("compiled / eager", ("compiled", "ours")),
        ("NS: batches / one by one", ("ns batches", "ns one by one")),
    ] + ([("NS: graphs / eager batches", ("ns graphs", "ns batches"))] if graphs else [])
    print()
    print("| case | " + " | ".join(r for r, _ in ratios) + " |")
    print("| --- |" + " ---: |" * len(ratios))
    for name, _, ms in rows:
        print(f"| {name} | " + " | ".join(f"{ms[a] / ms[b]:.3f}x" for _, (a, b) in ratios) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="small sizes, for a CPU")
    ap.add_argument(
        "--without-bf16-units",
        action="store_true",
        help="CPU: oneDNN off, i.e. bf16 matmul as on a CPU without AVX512-BF16/AMX",
    )
    args = ap.parse_args()
    device = pick_device(args.device)
    if args.without_bf16_units:
        if device.type != "cpu":
            sys.exit("--without-bf16-units is for --device cpu")
        torch.backends.mkldnn.enabled = False
    if args.small:
        cases = [("16 x 256^2", [(256, 256)] * 16), ("GPT-like d=128", gpt_like_shapes(12, 128))]
    else:
        cases = [("16 x 4096^2", [(4096, 4096)] * 16), ("GPT-like d=1024", gpt_like_shapes())]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    why = fast_bf16_reason(device) or "no fast bf16 matrix unit"
    print(
        f"device: {name} ({why}: ns_dtype='auto' is {auto_ns_dtype(device)}), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 params, "
        f"medians of {args.iters} interleaved rounds\n"
    )
    rows = [(n, len(s), bench_case(s, device, args.iters)) for n, s in cases]
    _table(rows, device)


if __name__ == "__main__":
    main()
