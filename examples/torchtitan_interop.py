"""A run's step as a torchtitan step, and a torchtitan step back into Muon (no torchtitan
needed).

    python examples/torchtitan_interop.py [DIR]     # default ./torchtitan-interop

Trains a small model with Muon (CPU offload on) for 10 steps through CheckpointManager, writes
the newest step in torchtitan's layout (DIR/titan/step-10: torchtitan's checkpointer starts
from its weights with checkpoint.initial_load_path at it and initial_load_model_only), then
imports that step into a fresh model and Muon and checks that weights and optimizer states
came back bitwise.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from muon_ckpt import CheckpointManager
from muon_ckpt.interop import export_torchtitan, import_torchtitan
from optim import Muon


def build(seed: int) -> tuple[nn.Module, Muon]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 1))
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    opt = Muon([{"params": matrices}, {"params": others, "use_muon": False, "lr": 3e-3}])
    opt.turn_on_cpu_offload()
    return model, opt


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else "./torchtitan-interop"
    model, opt = build(0)
    with CheckpointManager(
        os.path.join(root, "run"), model=model, optimizer=opt, interval=5
    ) as mgr:
        start = mgr.load() or 0
        for step in range(start + 1, 11):
            x = torch.randn(64, 32)
            nn.functional.mse_loss(model(x), x.square().sum(1, keepdim=True)).backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step)
    titan = os.path.join(root, "titan")
    if not os.path.isdir(os.path.join(titan, "step-10")):
        s = export_torchtitan(os.path.join(root, "run"), titan)
        print(f"wrote {s.step_dir}: torchtitan sections {s.sections}")

    fresh, fresh_opt = build(1)
    report = import_torchtitan(titan, model=fresh, optimizer=fresh_opt)
    same = all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    states = all(
        torch.equal(v, fresh_opt.cpu_state(q)[k])
        for p, q in zip(model.parameters(), fresh.parameters())
        for k, v in opt.cpu_state(p).items()
    )
    print(f"imported {report.source} (step {report.step}): weights {same}, optimizer {states}")


if __name__ == "__main__":
    main()
