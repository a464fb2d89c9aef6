"""torchtitan itself, for tests/integrations/test_integration_torchtitan.py (where torchtitan
is installed).

``python -m tests.integrations._titan_job interop DIR``: torchtitan's own ``CheckpointManager``
resumes a step of ours exported with ``export_torchtitan``, and a step it writes imports into
our Muon; prints ``interop: OK``.

``python -m tests.integrations._titan_job train URL OUT [--kill-at STEP]``: the checkpointer
calls of torchtitan's ``Trainer.train`` (``load``, then per step ``maybe_wait_for_staging``
before the optimizer step and ``save(step, last_step)``, then ``close``) with
``MuonCheckpointManager`` built by its ``Config.build``, around 10 steps of ``optim.Muon`` (CPU
offload on) in a ``MuonOptimizersContainer``, torchtitan's ``LRSchedulersContainer`` and a
shuffling ``ParallelAwareDataloader``; saves every 3 steps asynchronously, keeps 2. With
``--kill-at`` it SIGKILLs itself once that step is trained (the save before committed).
(torchtitan's Trainer itself needs a GPU.)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

import torch

from tests.integrations._titan import Tiny

STEPS, EVERY = 10, 3


class TrainState:
    """The Trainer's own ``state_dict()`` (torchtitan/trainer.py)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def _data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return list(torch.randint(0, 32, (4 * STEPS, 8), generator=g))


def _objects(seed: int, optimizer: str) -> tuple[Any, ...]:
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import ParamGroupConfig
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    from muon_ckpt.integrations.torchtitan import MuonOptimizersContainer

    model = Tiny(seed)
    if optimizer == "AdamW":
        groups = [
            ParamGroupConfig(
                pattern=".*",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.1},
            )
        ]
        cfg = MuonOptimizersContainer.Config(param_groups=groups)
    else:
        groups = [
            ParamGroupConfig(
                pattern=r"^layers\..*\.weight$",
                optimizer_name="Muon",
                optimizer_kwargs={"lr": 0.02},
            ),
            ParamGroupConfig(
                pattern=".*",
                optimizer_name="Muon",
                optimizer_kwargs={"use_muon": False, "lr": 3e-3},
            ),
        ]
        cfg = MuonOptimizersContainer.Config(param_groups=groups, cpu_offload=True)
    opts = cfg.build(model_parts=[model])
    sched = LRSchedulersContainer(opts, lambda s: 1.0 - 0.05 * s)
    torch.manual_seed(seed)
    loader = ParallelAwareDataloader(
        _data(), dp_rank=0, dp_world_size=1, batch_size=4, shuffle=True
    )
    return model, opts, sched, loader, TrainState()


def _train(model, opts, sched, loader, ts, steps, ckpt=None) -> list[float]:
    losses = []
    it = iter(loader)
    while ts.step < steps:
        ts.step += 1
        batch = next(it)
        loss = torch.nn.functional.cross_entropy(
            model(batch[:, :-1]).reshape(-1, 32), batch[:, 1:].reshape(-1)
        )
        loss.backward()
        if ckpt is not None:
            ckpt.maybe_wait_for_staging()
        opts.step()
        sched.step()
        opts.zero_grad()
        ts.ntokens_seen += batch.numel()
        losses.append(loss.item())
        if ckpt is not None:
            ckpt.save(ts.step, last_step=ts.step == STEPS)
            yield_kill(ckpt, ts.step)
    return losses


_KILL_AT: int | None = None


def yield_kill(ckpt: Any, step: int) -> None:
    if step == _KILL_AT:
        ckpt.manager.wait()
        os.kill(os.getpid(), signal.SIGKILL)


def _equal_states(a: torch.optim.Optimizer, pa, b: torch.optim.Optimizer, pb) -> None:
    for p, q in zip(pa, pb, strict=True):
        sa, sb = a.state[p], b.state[q]
        assert sa.keys() == sb.keys(), (sa.keys(), sb.keys())
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


def interop(root: str) -> None:
    from torchtitan.components.checkpointer import CheckpointManager as TitanManager

    from muon_ckpt.integrations.torchtitan import MuonCheckpointManager
    from muon_ckpt.interop import export_torchtitan, import_torchtitan
    from optim import Muon

    def titan(folder: str, objs: tuple[Any, ...], **options: Any) -> Any:
        model, opts, sched, loader, ts = objs
        cfg = TitanManager.Config(
            enable=True, folder=folder, interval=2, keep_latest_k=0, **options
        )
        return cfg.build(
            dataloader=loader,
            model_parts=[model],
            optimizers=opts,
            lr_schedulers=sched,
            states={"train_state": ts},
            sd_adapter=None,
        )

    # 1. Ours (MuonCheckpointManager, torch AdamW in the container) -> export -> torchtitan.
    src = _objects(0, "AdamW")
    _train(*src, steps=4)
    cfg = MuonCheckpointManager.Config(enable=True, url=os.path.join(root, "ours"), interval=2)
    ours = cfg.build(
        dataloader=src[3],
        model_parts=[src[0]],
        optimizers=src[1],
        lr_schedulers=src[2],
        states={"train_state": src[4]},
        sd_adapter=None,
    )
    assert ours.save(4) and ours.manager.steps() == [4]
    ours.close()
    export_torchtitan(os.path.join(root, "ours"), os.path.join(root, "exported"))
    dst = _objects(1, "AdamW")
    assert titan(os.path.join(root, "exported"), dst).load()
    for (n, p), q in zip(src[0].named_parameters(), dst[0].parameters(), strict=True):
        assert torch.equal(p, q), n
    _equal_states(
        src[1].optimizers[0], src[0].parameters(), dst[1].optimizers[0], dst[0].parameters()
    )
    assert dst[2].schedulers[0].last_epoch == 4 and dst[4].state_dict() == src[4].state_dict()
    # The dataloader's position: the batches after it, as from the source's own state.
    same = _objects(3, "AdamW")[3]
    same.load_state_dict(src[3].state_dict())
    assert all(torch.equal(a, b) for a, b in zip(iter(dst[3]), iter(same), strict=True))

    # 2. A Muon step of ours -> export -> torchtitan's model-only initial load (its
    # container keys optimizer states by param_names, which optim.Muon does not keep).
    src = _objects(0, "Muon")
    _train(*src, steps=4)
    cfg = MuonCheckpointManager.Config(enable=True, url=os.path.join(root, "muon"), interval=2)
    ours = cfg.build(
        dataloader=src[3],
        model_parts=[src[0]],
        optimizers=src[1],
        lr_schedulers=src[2],
        states={"train_state": src[4]},
        sd_adapter=None,
    )
    assert ours.save(4)
    ours.close()
    s = export_torchtitan(os.path.join(root, "muon"), os.path.join(root, "muon-titan"))
    dst = _objects(1, "Muon")
    start = titan(
        os.path.join(root, "empty"), dst, initial_load_path=s.step_dir, initial_load_model_only=True
    )
    assert start.load()
    for (n, p), q in zip(src[0].named_parameters(), dst[0].parameters(), strict=True):
        assert torch.equal(p, q), n

    # 3. torchtitan's own step -> import_torchtitan into our Muon (AdamW groups).
    src = _objects(0, "AdamW")
    _train(*src, steps=4)
    t = titan(os.path.join(root, "titan"), src)
    t.save(4)
    t.close()
    model = Tiny(2)
    opt = Muon([{"params": list(model.parameters()), "use_muon": False}])
    rep = import_torchtitan(os.path.join(root, "titan"), model=model, optimizer=opt)
    assert rep.step == 4 and sorted(rep.unused) == ["dataloader", "lr_scheduler", "train_state"]
    adamw = src[1].optimizers[0]
    for p, q in zip(src[0].parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
        st = adamw.state[p]
        assert torch.equal(opt.state[q]["moment1"], st["exp_avg"])
        assert torch.equal(opt.state[q]["moment2"], st["exp_avg_sq"])
        assert torch.equal(opt.state[q]["step"], st["step"])
    print("interop: OK")


def train(url: str, out: str) -> None:
    from muon_ckpt.integrations.torchtitan import MuonCheckpointManager

    model, opts, sched, loader, ts = objs = _objects(0, "Muon")
    cfg = MuonCheckpointManager.Config(
        enable=True, url=url, interval=EVERY, keep_latest_k=2, async_save=True
    )
    ckpt = cfg.build(
        dataloader=loader,
        model_parts=[model],
        optimizers=opts,
        lr_schedulers=sched,
        states={"train_state": ts},
        sd_adapter=None,
    )
    ckpt.load(step=-1)
    losses = _train(*objs, steps=STEPS, ckpt=ckpt)
    ckpt.close()
    opt = opts.optimizers[0]
    assert opt.cpu_offload
    torch.save(
        {
            "loaded": ckpt.loaded_step,
            "losses": losses,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "states": {n: opt.cpu_state(p) for n, p in model.named_parameters()},
            "last_epoch": sched.schedulers[0].last_epoch,
            "train_state": ts.state_dict(),
            "steps": ckpt.manager.steps(),
        },
        out,
    )


def main() -> None:
    global _KILL_AT
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["interop", "train"])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--kill-at", type=int)
    a = ap.parse_args()
    _KILL_AT = a.kill_at
    if a.mode == "interop":
        interop(a.paths[0])
    else:
        train(*a.paths)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
