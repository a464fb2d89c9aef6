"""Muon step time against torch.optim.Muon on the same params, in the same run, and the levers.

    python3 benchmarks/bench_muon.py --device cuda [--iters 20] [--profile]
    python3 benchmarks/bench_muon.py --device cpu --small [--without-bf16-units]
    python3 benchmarks/bench_muon.py --device cpu --tiny --variants torch ours offload ns-batches

Cases: 16 uniform 4096^2 fp32 matrices, and a GPT-like set of 104 (the attention and MLP matrices
of a 12-layer d=1024 model plus 32 small ones); ``--small``: 16 x 256^2 and the GPT-like set at
d=128, for a CPU; ``--tiny``: 4 x 32^2 and 2 layers at d=16 (a smoke run). Every variant of a
case is timed in the same interleaved rounds (order rotating, medians), so that clocks falling
as the machine heats up favour none of them:

- torch.optim.Muon, and ours with ``ns_dtype`` and ``ns_method`` "auto" (what this device
  picks);
- ours with the other ``ns_dtype`` (fp32 against bf16), the other ``ns_method`` (the standard
  iteration against the Gram one, which runs on matrices whose aspect ratio exceeds 2), with
  CPU offload on, with compiled NS (how many graphs dynamo compiled is printed: one per batch
  shape, and none again);
- Newton-Schulz alone: one matrix at a time (torch's way), in the batches of same-shape matrices
  our step forms (with each method), and (CUDA) those batches replayed as CUDA graphs (the
  launch cost a graph would save).

Prints the milliseconds and the ratios (lower is better). ``--variants`` picks columns.
``--profile`` then profiles our step and torch's per case: which stream waited for what, and
the kernels by kind (``benchmarks/_profile.py``). ``--without-bf16-units`` (CPU) turns oneDNN
off for the run: bf16 matrix products then take torch's scalar fallback, as on a CPU without
AVX512-BF16 or AMX, and ``"auto"`` picks fp32. A case that does not fit the GPU's free memory
(params, grads and states of every variant, with a fifth to spare) keeps fewer matrices, and
says so.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._profile import stream_table
from benchmarks._timing import pick_device, time_interleaved
from optim import Muon, set_ns_compile
from optim._ns_dtype import NS_DTYPES, auto_ns_dtype, auto_ns_method, fast_bf16_reason
from optim._plan import build_plan
from optim.newton_schulz import newton_schulz, zeropower_via_newtonschulz

HP = {"lr": 0.02, "weight_decay": 0.01, "momentum": 0.95, "nesterov": True}


def gpt_like_shapes(layers: int = 12, d: int = 1024, heads: bool = True) -> list[tuple[int, int]]:
    shapes = []
    for _ in range(layers):
        shapes += [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)]
    if heads:  # small heads / adapters
        shapes += [(64, 64)] * 16 + [(128, 256)] * 8 + [(256, 32)] * 8
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


def fit_shapes(shapes: list[tuple[int, ...]], device: torch.device, copies: int, what: str):
    """The first of ``shapes`` of which ``copies`` fp32 copies fit the GPU's free memory with a
    fifth to spare (all of them on a CPU); says so when that is fewer."""
    if device.type != "cuda":
        return shapes
    free = torch.cuda.mem_get_info(device)[0] / 1.2
    total, keep = 0, []
    for sh in shapes:
        total += copies * math.prod(sh) * 4
        if total > free and keep:
            break
        keep.append(sh)
    if len(keep) < len(shapes):
        print(
            f"{what}: {len(keep)} of {len(shapes)} matrices kept: {copies} fp32 copies of them "
            f"must fit the GPU's {free * 1.2 / 2**30:.1f} GiB free with a fifth to spare",
            flush=True,
        )
    return keep


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def bench_case(
    shapes: list[tuple[int, int]], device: torch.device, iters: int, variants: list[str]
) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    init = [torch.randn(s, generator=g).to(device) for s in shapes]
    grads = [torch.randn(s, generator=g).to(device) for s in shapes]
    auto = auto_ns_dtype(device)
    other = "fp32" if auto == "bf16" else "bf16"
    method = auto_ns_method(device, auto)
    other_method = "standard" if method == "gram" else "gram"

    def params() -> list[torch.nn.Parameter]:
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        for p, gr in zip(ps, grads):
            p.grad = gr
        return ps

    def ours(ns_dtype: str = "auto", offload: bool = False, compiled: bool = False, **kw):
        opt = Muon([{"params": params(), "ns_dtype": ns_dtype, **kw, **HP}], chunk_size=8)
        if offload:
            opt.turn_on_cpu_offload()

        def step() -> None:
            set_ns_compile(compiled)
            opt.step()

        return step, opt

    def eager(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            set_ns_compile(False)
            return fn()

        return run

    dt = NS_DTYPES[auto]
    mats = [gr.to(dt) for gr in grads]
    make: dict[str, Callable[[], Callable[[], object]]] = {
        "torch": lambda: torch.optim.Muon(params(), adjust_lr_fn="match_rms_adamw", **HP).step,
        "ours": lambda: ours()[0],
        "other-dtype": lambda: ours(other)[0],
        "other-method": lambda: ours(ns_method=other_method)[0],
        "offload": lambda: ours(offload=True)[0],
        "compiled": lambda: ours(compiled=True)[0],
    }
    batches = [[mats[i] for i in u] for u in _units(ours()[1])]
    ns: dict[str, Callable[[], object]] = {
        "ns-one-by-one": lambda: [zeropower_via_newtonschulz(m, dtype=dt) for m in mats],
        "ns-batches": lambda: [newton_schulz(b, dtype=dt, method=method) for b in batches],
        "ns-batches-other": lambda: [
            newton_schulz(b, dtype=dt, method=other_method) for b in batches
        ],
    }
    fns = {k: f() for k, f in make.items() if k in variants}
    fns.update({k: eager(f) for k, f in ns.items() if k in variants})
    if device.type == "cuda" and "ns-graphs" in variants:
        fns["ns-graphs"] = _graphed(batches)
    before = _graphs()
    ms = {k: v * 1e3 for k, v in time_interleaved(fns, device, iters).items()}
    set_ns_compile(False)
    ms["graphs"] = _graphs() - before
    ms["auto"], ms["method"], ms["batches"] = auto, method, len(batches)
    ms["shapes"] = len({(len(b), *b[0].shape) for b in batches})
    return ms


def profile_case(name: str, shapes, device: torch.device) -> None:
    """Which stream waited for what in our step and torch's, offload off (``_profile``)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]
    grads = [torch.randn(s, generator=g).to(device) for s in shapes]
    for p, gr in zip(ps, grads):
        p.grad = gr
    set_ns_compile(False)
    ours = Muon([{"params": ps, **HP}], chunk_size=8)
    theirs = torch.optim.Muon(ps, adjust_lr_fn="match_rms_adamw", **HP)
    for label, opt in (("ours", ours), ("torch.optim.Muon", theirs)):
        print(f"\n{name}, {label}: which stream waited for what")
        print("\n".join(stream_table(opt.step, device)))


COLUMNS = [
    ("torch.optim.Muon", "torch"),
    ("ours ({auto}, {method}: auto)", "ours"),
    ("ours, {other} NS", "other-dtype"),
    ("ours, {other_method} NS", "other-method"),
    ("ours, offload on", "offload"),
    ("ours, compiled NS", "compiled"),
    ("NS only, one by one", "ns-one-by-one"),
    ("NS only, our batches", "ns-batches"),
    ("NS only, our batches, {other_method}", "ns-batches-other"),
    ("NS only, batches as CUDA graphs", "ns-graphs"),
]
RATIOS = [
    ("ours / torch", ("ours", "torch")),
    ("offload on / off", ("offload", "ours")),
    ("{other} / {auto} NS", ("other-dtype", "ours")),
    ("{other_method} / {method} NS (step)", ("other-method", "ours")),
    ("{other_method} / {method} NS (NS only)", ("ns-batches-other", "ns-batches")),
    ("compiled / eager", ("compiled", "ours")),
    ("NS: batches / one by one", ("ns-batches", "ns-one-by-one")),
    ("NS: graphs / eager batches", ("ns-graphs", "ns-batches")),
]


def _table(rows: list[tuple[str, int, dict]]) -> None:
    first = rows[0][2]
    names = {
        "auto": first["auto"],
        "other": "fp32" if first["auto"] == "bf16" else "bf16",
        "method": first["method"],
        "other_method": "standard" if first["method"] == "gram" else "gram",
    }
    cols = [(c.format(**names), k) for c, k in COLUMNS if k in first]
    print("| case | " + " | ".join(c for c, _ in cols) + " |")
    print("| --- |" + " ---: |" * len(cols))
    for name, n, ms in rows:
        cells = " | ".join(f"{ms[k]:.2f} ms" for _, k in cols)
        print(f"| {name}, {n} matrices ({ms['batches']} batches) | {cells} |")
    ratios = [(r.format(**names), ab) for r, ab in RATIOS if all(k in first for k in ab)]
    print()
    print("| case | " + " | ".join(r for r, _ in ratios) + " |")
    print("| --- |" + " ---: |" * len(ratios))
    for name, _, ms in rows:
        print(f"| {name} | " + " | ".join(f"{ms[a] / ms[b]:.3f}x" for _, (a, b) in ratios) + " |")
    for name, _, ms in rows:
        if "compiled" in ms:
            print(
                f"{name}: compiled NS made {ms['graphs']} graphs for {ms['shapes']} batch shapes "
                "(one per shape: nothing recompiled, nothing fell back to eager)"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="small sizes, for a CPU")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes, a smoke run")
    ap.add_argument("--variants", nargs="+", choices=[k for _, k in COLUMNS], default=None)
    ap.add_argument("--profile", action="store_true", help="which stream waited for what")
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
    if args.tiny:
        cases = [("4 x 32^2", [(32, 32)] * 4), ("GPT-like d=16", gpt_like_shapes(2, 16, False))]
    elif args.small:
        cases = [("16 x 256^2", [(256, 256)] * 16), ("GPT-like d=128", gpt_like_shapes(12, 128))]
    else:
        cases = [("16 x 4096^2", [(4096, 4096)] * 16), ("GPT-like d=1024", gpt_like_shapes())]
    variants = args.variants or [k for _, k in COLUMNS]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    why = fast_bf16_reason(device) or "no fast bf16 matrix unit"
    auto = auto_ns_dtype(device)
    print(
        f"device: {name} ({why}: ns_dtype='auto' is {auto}, ns_method='auto' is "
        f"{auto_ns_method(device, auto)}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, fp32 params, medians of {args.iters} interleaved "
        "rounds\n"
    )
    # Each variant holds params and a state; the torch and NS ones share the grads.
    cases = [(n, fit_shapes(s, device, 2 * len(variants) + 2, n)) for n, s in cases]
    rows = [(n, len(s), bench_case(s, device, args.iters, variants)) for n, s in cases]
    _table(rows)
    if args.profile:
        for n, s in cases:
            profile_case(n, s, device)


if __name__ == "__main__":
    main()
