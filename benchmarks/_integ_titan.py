"""bench_integrations' torchtitan rows (not a test): torchtitan's own ``CheckpointManager``
(``dcp.save``; ``async_mode="async"``: ``dcp.async_save``) against ``MuonCheckpointManager``,
each driven as torchtitan's ``Trainer.train`` drives its checkpointer (``load``, then per step
``maybe_wait_for_staging`` before the optimizer step and ``save(step, last_step)``, then
``close``), around the same model, ``LRSchedulersContainer``, ``ParallelAwareDataloader`` and
train state. torchtitan's Trainer itself needs a GPU, so the loop is this module's.

The optimizers hold the same states: torchtitan's own checkpointer keys optimizer states by
torch's ``param_names``, which ``optim.Muon`` does not keep, so its rows train torch's Muon
(matrices) and AdamW (the rest) in its ``OptimizersContainer``; ours train ``optim.Muon``
(AdamW groups inside) in ``MuonOptimizersContainer``. Needs torchtitan 0.3."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._integ import Case, Clock, Net, Row, data, run_cases

CASES = [
    Case("`CheckpointManager` (`dcp.save`)", False, ["titan", False, {}]),
    Case("`CheckpointManager`, `async_mode=async`", False, ["titan", False, {"async": True}]),
    Case("`MuonCheckpointManager`", True, ["muon", True, {}]),
    Case("`MuonCheckpointManager`, `async_save`", True, ["muon", True, {"async": True}]),
    Case("`MuonCheckpointManager`, `async_save`", False, ["muon", False, {"async": True}]),
]
_MATRICES = r"^blocks\..*\.weight$"


class _TrainState:
    """torchtitan's Trainer's own ``state_dict()`` (trainer.py)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def _optimizers(path: str, offload: bool, model: Net) -> Any:
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    from muon_ckpt.integrations.torchtitan import MuonOptimizersContainer

    if path == "muon":
        groups = [
            ParamGroupConfig(pattern=_MATRICES, optimizer_name="Muon"),
            ParamGroupConfig(
                pattern=".*",
                optimizer_name="Muon",
                optimizer_kwargs={"use_muon": False, "lr": 1e-3},
            ),
        ]
        cfg = MuonOptimizersContainer.Config(param_groups=groups, cpu_offload=offload)
        return cfg.build(model_parts=[model])

    class TorchMuonContainer(OptimizersContainer):
        @staticmethod
        def _resolve_optimizer_factory(name: str) -> Any:
            if name == "TorchMuon":
                return torch.optim.Muon
            return OptimizersContainer._resolve_optimizer_factory(name)

    groups = [
        ParamGroupConfig(pattern=_MATRICES, optimizer_name="TorchMuon"),
        ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
    ]
    return TorchMuonContainer(OptimizersContainer.Config(param_groups=groups), model_parts=[model])


def child(a: argparse.Namespace) -> dict[str, Any]:
    """One run (``a.child``: path, offload, options) of ``a.steps + 1`` steps, or one more
    where ``a.dir`` holds a step to resume."""
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    from muon_ckpt.integrations.torchtitan import MuonCheckpointManager

    path, offload, options = json.loads(a.child)
    # torchtitan's async mode saves over a gloo group of its own: a group of this one process.
    store = os.path.join(tempfile.mkdtemp(), "pg")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    torch.set_num_threads(1)
    tokens, y = data(a)
    batches = list(zip(tokens, y, strict=True))

    def objects() -> tuple[Any, ...]:
        torch.manual_seed(0)
        model = Net(a.vocab, a.width)
        opts = _optimizers(path, offload, model)
        sched = LRSchedulersContainer(opts, lambda s: 1.0)
        loader = ParallelAwareDataloader(batches, dp_rank=0, dp_world_size=1, batch_size=8)
        return model, opts, sched, loader, _TrainState()

    def train(objs: tuple[Any, ...], steps: int, ckpt: Any, clock: Clock | None) -> None:
        model, opts, sched, loader, ts = objs
        it = iter(loader)
        while ts.step < steps:
            ts.step += 1
            t, v = next(it)
            if clock is not None:
                clock.start()
            model.loss(t, v).backward()
            if ckpt is not None:
                ckpt.maybe_wait_for_staging()
            opts.step()
            sched.step()
            opts.zero_grad()
            ts.ntokens_seen += t.numel()
            if clock is not None:
                clock.end(ts.step)
            if ckpt is not None:
                ckpt.save(ts.step, last_step=ts.step == steps)

    # A first one-step run warms this process up (lazy imports, first allocations), so the
    # timed run's time to its first batch differs between fresh and resumed by the restore.
    warm = objects()
    if path == "muon" and offload:
        warm[1].optimizers[0].turn_off_cpu_offload()
    train(warm, 1, None, None)

    resume = os.path.isdir(a.dir) and any(n.startswith("step-") for n in os.listdir(a.dir))
    steps = a.steps + 2 if resume else a.steps + 1
    objs = objects()
    model, opts, sched, loader, ts = objs
    clock = Clock()
    common = {"enable": True, "interval": a.every, "keep_latest_k": 2}
    if path == "titan":
        cfg: Any = CheckpointManager.Config(
            folder=a.dir,
            async_mode="async" if options.get("async") else "disabled",
            last_save_model_only=False,  # (else the last step holds the weights alone)
            **common,
        )
    else:
        cfg = MuonCheckpointManager.Config(
            url=a.dir, async_save=bool(options.get("async")), **common
        )
    ckpt = cfg.build(
        dataloader=loader,
        model_parts=[model],
        optimizers=opts,
        lr_schedulers=sched,
        states={"train_state": ts},
        sd_adapter=None,
    )
    loaded = ckpt.load(step=-1)
    if loaded != resume:
        raise RuntimeError(f"{a.dir}: load() said {loaded}, a step to resume: {resume}")
    train(objs, steps, ckpt, clock)
    ckpt.close()  # (background writes finish here)
    out = clock.result(a.every)
    dist.destroy_process_group()
    return out


def rows(a: argparse.Namespace) -> list[Row]:
    if importlib.util.find_spec("torchtitan") is None:
        print(
            "torchtitan: skipped (not installed; pip install 'muon-ckpt[torchtitan]', "
            "Python 3.11+)",
            file=sys.stderr,
        )
        return []
    return run_cases("torchtitan", "torchtitan", CASES, a)
