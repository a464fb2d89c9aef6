"""A training script on a 2-D mesh with torch's own APIs, run under torchrun
(tests/optim/test_optim_mesh.py):
``python -m tests.optim._mesh_train_job LAYOUT OUT_DIR STEPS``.

The model of ``tests/optim/_meshes.py`` laid out as LAYOUT (``fully_shard`` over a 2-D mesh, or
``parallelize_module`` then ``fully_shard``), Muon with CPU offload on, a forward and backward
per step on this rank's batch (one batch per data-parallel coordinate: tensor-parallel ranks
share theirs). Before each step every rank records the full gradients Muon is given; at the
end, the full params. Each rank writes ``OUT_DIR/rank<r>.pt``; the test replays the gradients
on one process and compares bitwise.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from optim import Muon
from tests.optim._meshes import _MESHES, build, groups

DIMS = (10, 14)  # (even under TP, which a forward needs; uneven under fully_shard)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def batch_index(layout: str) -> int:
    """This rank's batch: one per data-parallel coordinate (every mesh dim but the
    tensor-parallel one); tensor-parallel ranks share theirs."""
    mesh = _MESHES[layout]
    names, coord = mesh.mesh_dim_names, mesh.get_coordinate()
    batch = 0
    for j, n in enumerate(names):
        if n != "tp":
            batch = batch * mesh.shape[j] + coord[j]
    return batch


def forward_backward(model: torch.nn.Module, step: int, batch: int) -> None:
    """Step ``step``'s forward and backward on batch ``batch`` (the same input whenever it
    runs: a resumed run redoes it bitwise)."""
    g = torch.Generator().manual_seed(1000 * step + batch)
    x = torch.randn(3, 3, DIMS[0] + 2, generator=g)
    model(x).pow(2).mean().backward()


def main(layout: str, out_dir: str, steps: int) -> None:
    torch.set_num_threads(1)  # (the same bits in every process)
    dist.init_process_group("gloo")
    model = build(layout, DIMS)
    init = {n: _full(p.detach()) for n, p in model.named_parameters()}
    batch = batch_index(layout)
    opt = Muon(groups(model), chunk_size=2, warmup_step=1)
    opt.turn_on_cpu_offload()
    grads = []
    for step in range(steps):
        forward_backward(model, step, batch)
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    opt.turn_off_cpu_offload()
    params = {n: _full(p.detach()) for n, p in model.named_parameters()}
    rank = dist.get_rank()
    torch.save(
        {"init": init, "grads": grads, "params": params},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    # Torn down together: gloo aborts a process ending right after a blocking collective
    # while a mesh lives (pytorch#190489), so the last one is asynchronous and its Work
    # lives until the exit.
    work = dist.barrier(async_op=True)
    work.wait()
    _LAST_WORK.append(work)
    dist.destroy_process_group()


_LAST_WORK: list = []  # (see the end of main)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
