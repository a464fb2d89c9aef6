"""A small model laid out on the meshes FSDP2 and tensor parallelism make, with torch's own APIs.

``LAYOUTS`` names each layout by what a user writes: ``fully_shard`` over a 1-D mesh (FSDP),
over a 2-D mesh (HSDP: replicate x shard), ``parallelize_module`` (TP) on a "tp" dim alone,
TP then ``fully_shard`` over the "dp" dim (rows x columns: ``_StridedShard`` on the
column-parallel weights), and TP under HSDP on a 3-D mesh. The model's dims are odd, so
shards are uneven and some are empty (``head``: 2 rows over 4 ranks); a Muon matrix that TP
leaves alone (``proj``, a conv) lands on the data-parallel slice of the mesh.

``shard_like(layout, tensors)`` lays full tensors out as the layout lays the params out
(torch's own sharding, not Muon's reading of the placements): the oracle of every test here.
"""

from __future__ import annotations

import torch
from torch import nn

from tests._dist import dist_device

DIM, HID, OUT = 9, 13, 7


class Block(nn.Module):
    def __init__(self, dim: int, hid: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hid)  # column-parallel: (13, 9), rows 7/6 then 4/3 and 3/3
        self.down = nn.Linear(hid, dim)  # row-parallel: (9, 13), columns 7/6
        self.gate = nn.Linear(dim, dim, bias=False)  # column-parallel, 9 rows
        self.mix = nn.Linear(dim, dim, bias=False)  # row-parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(torch.relu(self.up(h))) + self.mix(torch.tanh(self.gate(h)))


class Net(nn.Module):
    """``dim`` and ``hid`` 9 and 13 by default: uneven under TP too. A forward through TP
    needs even TP shards (DTensor's ``from_local`` in RowwiseParallel assumes them): the
    training script takes 10 and 14, uneven under ``fully_shard`` only."""

    def __init__(self, dim: int = DIM, hid: int = HID) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 5, 3, bias=False)  # (5, 3, 3): a 3-D Muon param, no TP
        self.blocks = nn.ModuleList([Block(dim, hid), Block(dim, hid)])
        self.proj = nn.Linear(dim, OUT, bias=False)  # no TP: on the data-parallel slice
        self.head = nn.Linear(OUT, 2)  # 2 rows: empty shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)  # (batch, 3, dim + 2) -> (batch, 5, dim)
        for b in self.blocks:
            h = b(h)
        return self.head(self.proj(h))


def _tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(2):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
        plan[f"blocks.{i}.gate"] = ColwiseParallel()
        plan[f"blocks.{i}.mix"] = RowwiseParallel()
    return plan


# name -> (mesh shape, mesh dim names, what is applied)
LAYOUTS = {
    "fsdp4": ((4,), ("dp",), "fsdp"),
    "hsdp2x2": ((2, 2), ("rep", "shard"), "fsdp"),
    "tp2xfsdp2": ((2, 2), ("dp", "tp"), "tp+fsdp"),
    "tp2": ((2, 2), ("dp", "tp"), "tp"),
    "hsdp2x1xtp2": ((2, 1, 2), ("rep", "shard", "tp"), "tp+fsdp"),
    # 8 ranks (MUON_CKPT_TEST_8_RANKS): 9 rows over tp 2 then dp 4 is where torch's own
    # left-to-right reading of _StridedShard differs from where FSDP2 puts the rows.
    "tp2xfsdp4": ((4, 2), ("dp", "tp"), "tp+fsdp"),
    # 6 ranks (the same switch): 13 rows over tp 2 then dp 3, where DCP's chunks (torch's
    # reading) overlapped and the save failed (tests/manager/test_mesh_checkpoint.py)
    "tp2xfsdp3": ((3, 2), ("dp", "tp"), "tp+fsdp"),
    "hsdp2x4": ((2, 4), ("rep", "shard"), "fsdp"),
}


_MESHES: dict = {}


def build(layout: str | None, dims: tuple[int, int] = (DIM, HID)) -> Net:
    """The model of ``dims`` (dim, hid) with a fixed init, laid out as ``layout`` (None: one
    process)."""
    torch.manual_seed(0)
    model = Net(*dims).to(dist_device())
    return model if layout is None else build_from(model, layout)


def shard_like(layout: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (full, by param name) as ``layout`` holds them on this rank: the local
    tensors torch's own sharding gives a model whose params have these values."""
    dims = (tensors["blocks.0.gate.weight"].shape[0], tensors["blocks.0.up.weight"].shape[0])
    model = Net(*dims).to(dist_device())
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tensors[n])
    laid = build_from(model, layout)
    return {n: _local(p.detach()) for n, p in laid.named_parameters()}


def build_from(model: Net, layout: str) -> Net:
    """``build`` on an existing (full) model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    shape, names, how = LAYOUTS[layout]
    if layout not in _MESHES:  # (one set of process groups per layout and process)
        _MESHES[layout] = init_device_mesh(dist_device().type, shape, mesh_dim_names=names)
    mesh = _MESHES[layout]
    if "tp" in how:
        parallelize_module(model, mesh["tp"], _tp_plan())
    if "fsdp" in how:
        dp = mesh if how == "fsdp" else mesh[names[:-1]]
        for b in model.blocks:
            fully_shard(b, mesh=dp)
        fully_shard(model, mesh=dp)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def groups(model: nn.Module, **muon_kw) -> list[dict]:
    """Muon for the matrices (and the conv), AdamW for biases and norms, named by FQN."""
    named = list(model.named_parameters())
    mats = [(n, p) for n, p in named if p.ndim >= 2]
    rest = [(n, p) for n, p in named if p.ndim < 2]
    hp = {"lr": 0.02, "weight_decay": 0.01, "momentum": 0.95, **muon_kw}
    return [
        {"params": [p for _, p in mats], "names": [n for n, _ in mats], **hp},
        {
            "params": [p for _, p in rest],
            "names": [n for n, _ in rest],
            "use_muon": False,
            "lr": 1e-3,
            "weight_decay": 0.1,
        },
    ]
