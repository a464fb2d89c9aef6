"""Muon step time against torch.optim.Muon on the same params, in the same run.

    python benchmarks/bench_muon.py [--device cuda] [--iters 20]

Cases: 16 x 4096^2 fp32 matrices, and a GPT-like mix (attention/MLP matrices of a 12-layer,
d=1024 model plus small matrices). Prints milliseconds per step and the ratio ours/torch
(lower is better; <= 1.0 is the target). Newton-Schulz alone is timed too, since it is the
floor for both optimizers. The variants are timed in interleaved rounds (order rotating), so
that the GPU's clocks dropping as it heats up does not favour whichever runs first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._timing import pick_device, time_interleaved
from optim import Muon, set_ns_compile
from optim.newton_schulz import zeropower_via_newtonschulz


def gpt_like_shapes(layers: int = 12, d: int = 1024) -> list[tuple[int, int]]:
    shapes = []
    for _ in range(layers):
        shapes += [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)]
    shapes += [(64, 64)] * 16 + [(128, 256)] * 8 + [(256, 32)] * 8  # small heads / adapters
    return shapes


def bench_case(name: str, shapes, device, iters: int) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    init = [torch.randn(s, generator=g).to(device) for s in shapes]
    grads = [torch.randn(s, generator=g).to(device) for s in shapes]
    hp = {"lr": 0.02, "weight_decay": 0.01, "momentum": 0.95, "nesterov": True}

    def make(kind):
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        for p, gr in zip(ps, grads):
            p.grad = gr
        if kind == "torch":
            return torch.optim.Muon(ps, adjust_lr_fn="match_rms_adamw", **hp)
        return Muon([{"params": ps, **hp}], chunk_size=8)

    mats = [gr.bfloat16() for gr in grads]
    ref, eager, compiled = make("torch"), make("ours"), make("ours")

    def step_with(opt, compile_ns: bool):
        def run():
            set_ns_compile(compile_ns)
            opt.step()

        return run

    ms = time_interleaved(
        {
            "torch": ref.step,
            "eager": step_with(eager, False),
            "compiled": step_with(compiled, True),
            "ns": lambda: [zeropower_via_newtonschulz(m, 5) for m in mats],
        },
        device,
        iters,
    )
    set_ns_compile(False)
    return {
        "case": name,
        "matrices": len(shapes),
        "torch_ms": ms["torch"] * 1e3,
        "ours_eager_ms": ms["eager"] * 1e3,
        "ours_compiled_ms": ms["compiled"] * 1e3,
        "ns_only_ms": ms["ns"] * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="tiny sizes, for a CPU smoke run")
    args = ap.parse_args()
    device = pick_device(args.device)
    if args.small:
        cases = [("16 x 256^2", [(256, 256)] * 16), ("gpt-like d=128", gpt_like_shapes(2, 128))]
    else:
        cases = [("16 x 4096^2 fp32", [(4096, 4096)] * 16), ("gpt-like d=1024", gpt_like_shapes())]
    print(
        f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}"
    )
    print(
        f"{'case':<20} {'n':>4} {'torch ms':>9} {'ours eager':>11} {'ours comp.':>11} {'NS only':>8} {'eager/torch':>12} {'comp./torch':>12}"
    )
    for name, shapes in cases:
        r = bench_case(name, shapes, device, args.iters)
        print(
            f"{r['case']:<20} {r['matrices']:>4} {r['torch_ms']:>9.2f} {r['ours_eager_ms']:>11.2f} "
            f"{r['ours_compiled_ms']:>11.2f} {r['ns_only_ms']:>8.2f} "
            f"{r['ours_eager_ms'] / r['torch_ms']:>11.3f}x {r['ours_compiled_ms'] / r['torch_ms']:>11.3f}x"
        )


if __name__ == "__main__":
    main()
