"""PyTorch Lightning with Muon (CPU offload on), saved and resumed by muon-ckpt.

    python examples/lightning_muon.py [URL]     # default ./lightning-checkpoints

Trains 60 optimizer steps on CPU, saving every 20 in the background. Stop it at any point
(Ctrl-C, kill -9) and run it again: it resumes from the newest committed step. Run it once
more after it finished: it resumes at step 60 and has nothing left to do.
"""

from __future__ import annotations

import sys

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from muon_ckpt.integrations.lightning import MuonCheckpoint
from optim import Muon


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict:
        matrices = [p for p in self.parameters() if p.ndim == 2]
        others = [p for p in self.parameters() if p.ndim < 2]
        opt = Muon([{"params": matrices}, {"params": others, "use_muon": False, "lr": 3e-3}])
        opt.turn_on_cpu_offload()  # optimizer states in CPU memory between steps
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=60)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    url = sys.argv[1] if len(sys.argv) > 1 else "./lightning-checkpoints"
    torch.manual_seed(0)
    x = torch.randn(640, 32)
    data = DataLoader(TensorDataset(x, x.square().sum(1, keepdim=True)), batch_size=32)
    ckpt = MuonCheckpoint(url, every_n_train_steps=20, keep_last=2, async_save=True)
    trainer = pl.Trainer(max_steps=60, accelerator="cpu", callbacks=[ckpt], logger=False)
    trainer.fit(Regressor(), data)
    print(f"resumed from step {ckpt.resumed_step}; now at step {trainer.global_step}")


if __name__ == "__main__":
    main()
