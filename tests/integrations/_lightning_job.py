"""A Lightning ``Trainer.fit`` with Muon (CPU offload on) saved by ``MuonCheckpoint``, run in
a child process by tests/integrations/test_integration_lightning.py.

``python -m tests.integrations._lightning_job URL OUT [--kill-at STEP] [--lightning-ckpt DIR]``:
trains ``STEPS`` optimizer steps over 5 batches per epoch (so the run crosses epochs and saves mid-
epoch) from a resumable dataloader, saving every ``EVERY`` steps asynchronously (``--every``),
then writes what the comparison needs to ``OUT`` (torch.save). ``--shuffle``: the module has
dropout, the loader shuffles (a ``RandomSampler``, its order resumable), and the RNG
states go in ``rank_extra`` as the README says, beside a callback whose state holds NumPy
values. ``--augment``: the dataset adds noise drawn from the global RNG to each sample it
fetches. ``--lazy``: the loader makes its DataLoader iterator at its first batch (a
generator). With ``--kill-at``, once that step is trained and the pending save committed,
the process SIGKILLs itself. ``--lightning-ckpt`` saves with
Lightning's own ModelCheckpoint (offload off: its save calls ``optimizer.state_dict()``) into
that directory instead, resuming from its ``last.ckpt``. ``--devices 2``: DDP over two CPU
processes (Lightning launches the second; rank 0 writes OUT).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)

from muon_ckpt.integrations.lightning import MuonCheckpoint
from optim import Muon

STEPS, EVERY, BATCH, BATCHES = 12, 3, 4, 5


class _FromBatch(BatchSampler):
    """A batch sampler that starts at batch ``start`` of its epoch: the batches before it are
    drawn from the sampler but never fetched (a resumed loader loads no sample it skips)."""

    start = 0

    def __iter__(self) -> Any:
        for i, b in enumerate(super().__iter__()):
            if i >= self.start:
                yield b


class ResumableLoader(DataLoader):
    """Batches in order (``shuffle``: in an order drawn from the global RNG at each epoch's
    start, as ``RandomSampler`` draws it), resumable where the last one was drawn (Lightning
    restores a dataloader's position only through its ``state_dict``/``load_state_dict``)."""

    def __init__(self, ds: Dataset, shuffle: bool = False, lazy: bool = False) -> None:
        order = RandomSampler(ds) if shuffle else SequentialSampler(ds)
        super().__init__(ds, batch_sampler=_FromBatch(order, BATCH, drop_last=False))
        self.drawn = 0
        self.seed: int | None = None  # the order of the epoch in progress (shuffle)
        self.lazy = lazy

    def __iter__(self) -> Any:
        start = self.drawn if self.drawn < len(self) else 0  # a finished epoch starts over
        batches = self.batch_sampler
        if isinstance(batches.sampler, RandomSampler):
            if start == 0:
                self.seed = int(torch.empty((), dtype=torch.int64).random_().item())
            batches.sampler.generator = torch.Generator().manual_seed(self.seed)
        self.drawn = batches.start = start
        # DataLoader's iterator draws from the global RNG as it is made: here (as
        # DataLoader's own __iter__ makes it), or at the first batch (``lazy``: a generator).
        return self._batches(None if self.lazy else super().__iter__(), start)

    def _batches(self, it: Any, start: int) -> Any:
        for i, b in enumerate(super().__iter__() if it is None else it, start):
            self.drawn = i + 1
            yield b

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drawn, self.seed = state["drawn"], state.get("seed")


class GlobalRng:
    """The global RNG states, for ``rank_extra`` (the README's advice)."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])


class NumpyCounter(pl.Callback):
    """A callback whose state holds NumPy values (in ``MuonCheckpoint``'s per-rank blob)."""

    def __init__(self) -> None:
        self.batches = np.int64(0)
        self.rng = np.random.RandomState(7)
        self.last = np.float32(0)

    def on_train_batch_end(self, *_: Any) -> None:
        self.batches += 1
        self.last = np.float32(self.rng.random_sample())

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "rng": self.rng.get_state(), "last": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches, self.last = np.int64(state["batches"]), np.float32(state["last"])
        self.rng.set_state(state["rng"])


class Net(pl.LightningModule):
    def __init__(self, offload: bool, width: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        drop = [nn.Dropout(dropout)] if dropout else []
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), *drop, nn.Linear(width, 1))
        self.offload = offload
        self.seen: list[tuple[int, int, int]] = []  # (global step, epoch, first sample id)
        self.losses: list[tuple[int, torch.Tensor]] = []  # (global step, loss)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y, ids = batch
        self.seen.append((self.trainer.global_step, self.current_epoch, int(ids[0])))
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append((self.trainer.global_step, loss.detach().clone()))
        return loss

    def configure_optimizers(self) -> Any:
        ps = list(self.net.parameters())
        opt = Muon(
            [
                {"params": [p for p in ps if p.ndim == 2], "lr": 0.02},
                {"params": [p for p in ps if p.ndim < 2], "use_muon": False, "lr": 1e-2},
            ]
        )
        if self.offload:
            opt.turn_on_cpu_offload()
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class KillAt(pl.Callback):
    """SIGKILL this process at the end of step ``step``, once the pending save committed."""

    def __init__(self, step: int, ckpt: MuonCheckpoint | None) -> None:
        self.step, self.ckpt = step, ckpt

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step == self.step:
            if self.ckpt is not None and self.ckpt.manager is not None:
                self.ckpt.manager.wait()
            os.kill(os.getpid(), signal.SIGKILL)


class Began(pl.Callback):
    """What the fit starts from (after MuonCheckpoint's load): global step and weights."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        self.seen = {"global_step": trainer.global_step, "params": params}


class Augmented(Dataset):
    """Each sample with random noise added, drawn from the global RNG as it is fetched (a
    random augmentation, as a torchvision transform draws it with ``num_workers=0``)."""

    def __init__(self, base: TensorDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        x, y, idx = self.base[i]
        return x + 0.1 * torch.randn_like(x), y, idx


def data(n: int = BATCH * BATCHES, augment: bool = False) -> Dataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    ds = TensorDataset(x, x.sum(1, keepdim=True).sin(), torch.arange(n))
    return Augmented(ds) if augment else ds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--lightning-ckpt")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--devices", type=int, default=1, help="> 1: DDP over CPU processes")
    ap.add_argument("--every", type=int, default=EVERY)
    ap.add_argument("--shuffle", action="store_true")
    ap.add_argument("--augment", action="store_true")
    ap.add_argument("--lazy", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)  # bitwise across processes, as in tests/conftest.py
    torch.manual_seed(0)
    model = Net(offload=a.lightning_ckpt is None, width=a.width, dropout=0.2 * a.shuffle)
    counter, began = NumpyCounter(), Began()
    callbacks: list[pl.Callback] = [began, *([counter] if a.shuffle else [])]
    ckpt = None
    fit: dict[str, Any] = {}
    if a.lightning_ckpt is None:
        rank_extra = {"rng": GlobalRng()} if a.shuffle else None
        ckpt = MuonCheckpoint(
            a.url, every_n_train_steps=a.every, keep_last=2, async_save=True, rank_extra=rank_extra
        )
        callbacks.append(ckpt)
    else:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                a.lightning_ckpt, every_n_train_steps=a.every, save_last=True, save_top_k=0
            )
        )
        last = os.path.join(a.lightning_ckpt, "last.ckpt")
        fit["ckpt_path"] = last if os.path.exists(last) else None
    if a.kill_at is not None:
        callbacks.insert(0, KillAt(a.kill_at, ckpt))
    trainer = pl.Trainer(
        max_steps=a.steps,
        accelerator="cpu",
        devices=a.devices,
        strategy="ddp" if a.devices > 1 else "auto",
        use_distributed_sampler=False,  # every rank draws the same batches (the loader's own)
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    t0 = time.perf_counter()
    loader = ResumableLoader(data(augment=a.augment), shuffle=a.shuffle, lazy=a.lazy)
    trainer.fit(model, loader, **fit)
    if trainer.global_rank != 0:
        return  # (every rank of a DDP fit ends with the same state)
    opt = trainer.optimizers[0]
    named = dict(model.named_parameters())
    torch.save(
        {
            "fit_s": time.perf_counter() - t0,
            "params": {n: p.detach().clone() for n, p in named.items()},
            "states": {n: dict(opt.state[p]) for n, p in named.items()},
            "lr": [g["lr"] for g in opt.param_groups],
            "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "seen": model.seen,
            "losses": model.losses,
            "counter": (int(counter.batches), float(counter.last), counter.rng.random_sample()),
            "resumed": None if ckpt is None else ckpt.resumed_step,
            "began": began.seen,
            "steps": None if ckpt is None else ckpt_steps(a.url),
        },
        a.out,
    )


def ckpt_steps(url: str) -> list[int]:
    from muon_ckpt import CheckpointManager

    return CheckpointManager(url).steps()


if __name__ == "__main__":
    sys.exit(main())
