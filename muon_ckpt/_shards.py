"""Where each rank's shard of a DTensor lies in the full tensor, and the layout a state's
DTensors are on (what a manifest records).

A DTensor's local shard is a box of the full tensor: an offset and a size per dim, DCP's
chunk. torch computes it with ``compute_local_shape_and_global_offset``, which reads a
``_StridedShard`` left to right; ``fully_shard`` over tensor parallelism puts the rows
elsewhere when shards are uneven (13 rows over tp 2 then dp 3: the data-parallel ranks of
each TP shard split its rows as ``torch.chunk`` does). DCP then plans overlapping chunks, and
the save fails, or a load reads rows into the wrong place. So here the mesh dims that shard a
tensor dim split it one after another as ``torch.chunk`` splits: ``Shard`` dims left to
right, then ``_StridedShard`` dims right to left (FSDP2's order). Without a strided shard
torch's own reading is used: the two agree there (``tests/manager/test_mesh_checkpoint.py`` checks
both against FSDP2's real shards). ``optim`` reads placements by the same rule for Muon
(``optim._mesh.piece``); the packages never import each other, so the rule is written in
each and tested to agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor import DTensor, Shard

__all__ = ["box", "chunk_of", "describe_layout", "has_strided", "shard_box"]


def _strided(pl: Any) -> bool:
    return type(pl).__name__ == "_StridedShard"


def has_strided(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor with a ``_StridedShard`` (where torch's reading may err)."""
    return isinstance(t, DTensor) and any(_strided(pl) for pl in t.placements)


def shard_box(t: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of this rank's shard of ``t`` in the full tensor. An empty shard's
    offset is the dim's size on the dims it is empty on, as torch puts it (no two chunks of
    a tensor then share an offset, which DCP takes for replicas of one chunk)."""
    if not has_strided(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple(offsets), tuple(sizes)
    coord = t.device_mesh.get_coordinate()
    if coord is None:  # (not in the mesh: what torch returns)
        return (), (0,)
    return box(tuple(t.shape), tuple(t.placements), tuple(t.device_mesh.shape), tuple(coord))


def box(
    gshape: tuple[int, ...],
    placements: tuple[Any, ...],
    mesh_shape: tuple[int, ...],
    coord: tuple[int, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of the shard at mesh coordinate ``coord`` (``shard_box``'s rule)."""
    start, size = [0] * len(gshape), list(gshape)
    for d in range(len(gshape)):
        plain = [m for m, pl in enumerate(placements) if _splits(pl, d) and not _strided(pl)]
        strided = [m for m, pl in enumerate(placements) if _splits(pl, d) and _strided(pl)]
        for m in plain + strided[::-1]:
            step = -(-size[d] // mesh_shape[m])
            lo = min(coord[m] * step, size[d])
            start[d] += lo
            size[d] = min(lo + step, size[d]) - lo
    offsets = tuple(gshape[d] if size[d] == 0 else start[d] for d in range(len(gshape)))
    return offsets, tuple(size)


def _splits(pl: Any, dim: int) -> bool:
    return (isinstance(pl, Shard) or _strided(pl)) and pl.dim == dim


def chunk_of(t: Tensor) -> ChunkStorageMetadata:
    """DCP's chunk of this rank's part of ``t``: its shard's box for a DTensor, else all of
    it."""
    if isinstance(t, DTensor):
        offsets, sizes = shard_box(t)
    else:
        offsets, sizes = (0,) * t.dim(), tuple(t.shape)
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def describe_layout(tensors: Iterable[tuple[str, Any]]) -> dict[str, Any] | None:
    """The layout of the DTensors among ``tensors`` (name, value), as a manifest records it:
    ``{"meshes": [{"shape": [...], "dims": [...]}], "params": {name: {"mesh": i,
    "placements": ["R", "S(0)", "_S(0, 2)"]}}}`` (torch's short names of the placements);
    None when none is a DTensor (plain tensors: each rank holds all of each)."""
    meshes: list[dict[str, Any]] = []
    params: dict[str, Any] = {}
    for name, v in tensors:
        if not isinstance(v, DTensor):
            continue
        mesh = v.device_mesh
        entry = {"shape": list(mesh.shape), "dims": list(mesh.mesh_dim_names or ())}
        if entry not in meshes:
            meshes.append(entry)
        params[name] = {
            "mesh": meshes.index(entry),
            "placements": [str(pl) for pl in v.placements],
        }
    return {"meshes": meshes, "params": params} if params else None
