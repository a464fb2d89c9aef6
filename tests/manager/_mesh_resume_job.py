"""The training script of ``tests/optim/_mesh_train_job.py`` with checkpoints, for the kill and
resume test (tests/manager/test_mesh_resume.py), run on 4 ranks by ``tests/_dist.py``.

``train(url, layout, steps, stop=None, progress=None)``: the model laid out as ``layout`` by
torch's own APIs (``fully_shard`` over a 2-D mesh, or ``parallelize_module`` then
``fully_shard``), Muon with CPU offload on, resumed from ``url``'s newest committed step (if
any), a forward and backward per step and an asynchronous save after each. A ``save(s)``
returns once step ``s - 1`` is committed (it waits for the pending save first), so then rank 0
appends ``committed s-1`` to ``progress``. With ``stop``, the job returns right after
``save(stop)`` returned, step ``stop`` still being written in the background: the test's
SIGKILL lands there, after the marker, wherever the background write is.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from tests.optim._mesh_train_job import DIMS, _full, batch_index, forward_backward
from tests.optim._meshes import build, groups


def _state(model, opt) -> dict:
    """Every param and optimizer state, full (each rank's gather: replicas are checked too)."""
    opt.turn_off_cpu_offload()
    out = {}
    for n, p in model.named_parameters():
        out[f"param {n}"] = _full(p.detach())
        for k, v in opt.state[p].items():
            out[f"state {n}.{k}"] = _full(v)
    return out


def train(url, layout, steps, stop=None, progress=None) -> dict:
    from muon_ckpt import CheckpointManager
    from optim import Muon
    from optim.newton_schulz import set_ns_compile

    set_ns_compile(False)
    model = build(layout, DIMS)
    opt = Muon(groups(model), chunk_size=2, warmup_step=1)
    opt.turn_on_cpu_offload()
    batch = batch_index(layout)
    mgr = CheckpointManager(url, model=model, optimizer=opt, async_save=True, keep_last=2)
    start = mgr.load() or 0
    resumed = start or None
    info = mgr.step_info() if start else None
    for step in range(start + 1, steps + 1):
        forward_backward(model, step, batch)
        opt.step()
        opt.zero_grad()
        mgr.save(step)
        if progress is not None and dist.get_rank() == 0 and step > 1:
            with open(progress, "a") as f:
                f.write(f"committed {step - 1}\n")
        if step == stop:
            return {}  # (killed here, step `stop` in flight)
    mgr.close()
    return {
        "resumed": resumed,
        "layout": None if info is None else info.layout,
        "state": _state(model, opt),
    }


def killed(rank, world_size, url, layout, steps, stop, progress):
    return train(url, layout, steps, stop=stop, progress=progress)


def uninterrupted_then_resumed(rank, world_size, ref_url, url, layout, steps):
    """The uninterrupted run (its own url), then the killed run resumed to the end."""
    ref = train(ref_url, layout, steps)
    got = train(url, layout, steps)
    return {"ref": ref, "got": got}


def committed(progress: str) -> int:
    """The newest step the progress file says is committed (0: none yet)."""
    if not os.path.exists(progress):
        return 0
    with open(progress) as f:
        marks = [int(line.split()[1]) for line in f if line.startswith("committed ")]
    return max(marks, default=0)
