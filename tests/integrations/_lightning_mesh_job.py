"""A Lightning fit under ``ModelParallelStrategy`` (a 2-D device mesh, "data_parallel" x
"tensor_parallel") with Muon (CPU offload on) saved by ``MuonCheckpoint``, run under torchrun by
tests/integrations/test_integration_meshes.py.

``python -m torch.distributed.run --nproc-per-node 4 -m tests.integrations._lightning_mesh_job
URL OUT DP TP HOW STEPS``: the model of ``tests/optim/_meshes.py`` laid out in
``configure_model`` on Lightning's mesh, ``HOW`` being ``tp+fsdp`` as Lightning's docs do
(``parallelize_module`` over "tensor_parallel", then ``fully_shard`` over "data_parallel") or
``hsdp`` (``fully_shard`` over the whole 2-D mesh: replicated over "data_parallel", sharded
over "tensor_parallel"), ``STEPS`` optimizer steps, a save
after each (asynchronous), resuming the url's newest committed step. Rank 0 writes the full
params and optimizer states after the fit, and the layout of the newest step, to ``OUT``.
"""

from __future__ import annotations

import sys
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from muon_ckpt.integrations.lightning import MuonCheckpoint
from optim import Muon
from tests.optim._mesh_train_job import DIMS, _full
from tests.optim._meshes import Net, _tp_plan, groups


class MeshModule(pl.LightningModule):
    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.how = Net(*DIMS), how

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = self.device_mesh
        if self.how == "hsdp":
            dp = mesh
        else:
            dp = mesh["data_parallel"]
            if mesh["tensor_parallel"].size() > 1:
                parallelize_module(self.net, mesh["tensor_parallel"], _tp_plan())
        for b in self.net.blocks:
            fully_shard(b, mesh=dp)
        fully_shard(self.net, mesh=dp)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        # (the sample is drawn from its index: the same input on any layout)
        g = torch.Generator().manual_seed(int(batch[0][0]))
        return self.net(torch.randn(3, 3, DIMS[0] + 2, generator=g)).pow(2).mean()

    def configure_optimizers(self) -> Any:
        opt = Muon(groups(self.net), chunk_size=2, warmup_step=1)
        opt.turn_on_cpu_offload()
        return opt


def main(url: str, out: str, dp: int, tp: int, how: str, steps: int) -> None:
    torch.set_num_threads(1)
    module = MeshModule(how)
    ckpt = MuonCheckpoint(url, every_n_train_steps=1, async_save=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=dp * tp,
        strategy=pl.strategies.ModelParallelStrategy(
            data_parallel_size=dp, tensor_parallel_size=tp
        ),
        max_steps=steps,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.arange(100)), batch_size=1)
    trainer.fit(module, data)
    opt = trainer.optimizers[0]
    full = {}
    for n, p in module.net.named_parameters():
        full[f"param {n}"] = _full(p.detach())
        for k, v in opt.state[p].items():
            full[f"state {n}.{k}"] = _full(v)
    from muon_ckpt import CheckpointManager

    info = CheckpointManager(url).step_info()
    if trainer.global_rank == 0:
        torch.save(
            {"state": full, "resumed": ckpt.resumed_step, "layout": info.layout, "step": info.step},
            out,
        )


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), a[4], int(a[5]))
