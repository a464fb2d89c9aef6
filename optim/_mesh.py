"""Where each rank's piece of a DTensor lies in the full tensor, on a mesh of any number of dims.

A Muon step exchanges matrices over ONE process group: that of the *main mesh*, the mesh of
the most dims among the Muon params' meshes. A param on a slice of it (FSDP2 over tensor
parallelism puts a layer that TP left alone on the data-parallel slice) is taken as replicated
over the main mesh's other dims, as FSDP2 x TP makes it: its placements there are
``Replicate()`` (``embed``).

Each rank's piece is a box of the full tensor: a start and a length per tensor dim
(``piece``). The mesh dims that shard a tensor dim split it one after another as
``torch.chunk`` splits (ceil-sized chunks, the last ones shorter or empty), ``Shard`` dims
left to right, then ``_StridedShard`` dims right to left: a strided shard is the one
``fully_shard`` applied AFTER the tensor-parallel ``Shard`` to its right (its ``split_factor``
is their count). torch's own left-to-right reading of ``_StridedShard``
(``compute_local_shape_and_global_offset``) differs from where FSDP2 put the rows when shards
are uneven (7 rows, dp 3 x tp 2); FSDP2's order is the one that holds the data. The plan checks
every rank's derived shape against its real local shard, so a layout read wrongly is refused,
never orthogonalised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "Exchange",
    "check_placements",
    "embed",
    "exchange_of",
    "main_mesh",
    "mesh_group",
    "piece",
    "sharding_dims",
]


def _strided(pl: Placement) -> bool:
    return type(pl).__name__ == "_StridedShard"


def _shards(pl: Placement) -> bool:
    """A ``Shard`` or a ``_StridedShard`` (a subclass of ``Shard`` in some torch versions, not in others)."""
    return isinstance(pl, Shard) or _strided(pl)


def _split_order(placements: tuple[Placement, ...], dim: int) -> list[int]:
    """The mesh dims that shard tensor dim ``dim``, in the order they split it."""
    plain = [m for m, pl in enumerate(placements) if _shards(pl) and not _strided(pl)]
    strided = [m for m, pl in enumerate(placements) if _strided(pl)]
    return [m for m in plain if placements[m].dim == dim] + [
        m for m in reversed(strided) if placements[m].dim == dim
    ]


def piece(
    gshape: tuple[int, ...],
    placements: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    coord: tuple[int, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(start, length) per tensor dim of the piece held at mesh coordinate ``coord``."""
    start, size = [0] * len(gshape), list(gshape)
    for d in range(len(gshape)):
        for m in _split_order(placements, d):
            step = -(-size[d] // mesh_shape[m])
            lo = min(coord[m] * step, size[d])
            start[d] += lo
            size[d] = min(lo + step, size[d]) - lo
    return tuple(start), tuple(size)


def sharding_dims(placements: tuple[Placement, ...]) -> frozenset[int]:
    """The mesh dims that split the tensor; along the others, ranks hold the same piece."""
    return frozenset(m for m, pl in enumerate(placements) if _shards(pl))


def check_placements(p: DTensor, label: str) -> None:
    """Raise ValueError for a placement Muon cannot read: anything but ``Shard``,
    ``_StridedShard`` and ``Replicate``, or a strided shard whose split factor is not the
    count of the shards applied before it."""
    mesh = p.device_mesh
    for m, pl in enumerate(p.placements):
        if not (_shards(pl) or isinstance(pl, Replicate)):
            raise ValueError(
                f"param {label} has placement {pl!r} on mesh dim {m}; Muon takes Shard(dim), "
                "_StridedShard (fully_shard over tensor parallelism) and Replicate()"
            )
        if _strided(pl):
            order = _split_order(tuple(p.placements), pl.dim)
            before = math.prod(mesh.shape[k] for k in order[: order.index(m)])
            if pl.split_factor != before:
                raise ValueError(
                    f"param {label} has placements {tuple(p.placements)}: {pl!r} on mesh dim {m} "
                    f"has split_factor {pl.split_factor}, but the shards of dim {pl.dim} applied "
                    f"before it (Shard dims, then strided ones right to left) number {before}; "
                    "Muon reads the layout fully_shard makes over tensor parallelism only"
                )


def _names(mesh: DeviceMesh) -> tuple[str, ...] | None:
    return tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None


def _same(a: DeviceMesh, b: DeviceMesh) -> bool:
    return a is b or (_names(a) == _names(b) and a.mesh.tolist() == b.mesh.tolist())


def _is_slice(sub: DeviceMesh, main: DeviceMesh) -> bool:
    """Whether ``sub`` is ``main`` cut at this rank's coordinates on the dims ``sub`` lacks."""
    sn, mn = _names(sub), _names(main)
    if sn is None or mn is None or not set(sn) <= set(mn):
        return False
    coord = main.get_coordinate()
    if coord is None:
        return False
    index = tuple(slice(None) if n in sn else coord[j] for j, n in enumerate(mn))
    kept = [n for n in mn if n in sn]
    expected = main.mesh[index].permute(*(kept.index(n) for n in sn))
    return expected.tolist() == sub.mesh.tolist()


def main_mesh(meshes: list[DeviceMesh]) -> DeviceMesh | None:
    """The mesh a Muon step exchanges over: of the meshes of more than one rank, the one of
    most dims (then most ranks, then first); every other must be a slice of it. None when
    no mesh spans more than one rank. Raises ValueError otherwise."""
    big = [m for m in meshes if m.size() > 1]
    if not big:
        return None
    main = max(big, key=lambda m: (m.ndim, m.size()))
    for m in big:
        if not _same(m, main) and not _is_slice(m, main):
            raise ValueError(
                f"Muon params live on {m} and on {main}, and the first is not a slice of the "
                "second: Muon exchanges matrices over one mesh and takes a param on a slice of "
                "it (named by mesh_dim_names, as fully_shard over tensor parallelism makes) as "
                "replicated over the other dims; put the params on one mesh, or give the meshes "
                "dim names (init_device_mesh(..., mesh_dim_names=...)) and slice them"
            )
    if main.ndim > 1 and main.size() != dist.get_world_size() and _names(main) is None:
        raise ValueError(
            f"Muon params live on {main}, a {main.ndim}-D mesh over {main.size()} of the "
            f"{dist.get_world_size()} ranks without mesh_dim_names; Muon needs one process "
            "group over all its ranks (DeviceMesh._flatten, which needs dim names): create it "
            "with init_device_mesh(..., mesh_dim_names=...)"
        )
    return main


def embed(p: Tensor, main: DeviceMesh) -> tuple[Placement, ...]:
    """``p``'s placements on the main mesh's dims (``Replicate()`` where its mesh, a slice of
    the main mesh, lacks the dim)."""
    mesh = p.device_mesh
    if _same(mesh, main):
        return tuple(p.placements)
    own = dict(zip(_names(mesh), p.placements, strict=True))
    return tuple(own.get(n, Replicate()) for n in _names(main))


@dataclass
class Exchange:
    """The process group of the main mesh: this process's rank in it, its size, and the mesh
    coordinate of each of its ranks."""

    mesh: DeviceMesh
    pg: dist.ProcessGroup
    rank: int
    world: int
    coords: list[tuple[int, ...]]

    def same_replica(self, r: int, owner: int, dims: frozenset[int]) -> bool:
        """Whether rank ``r`` is of ``owner``'s replica of a matrix split along mesh ``dims``:
        at the owner's coordinates on every other dim. The pieces of one replica tile the
        matrix once."""
        rc, oc = self.coords[r], self.coords[owner]
        return all(rc[m] == oc[m] for m in range(len(oc)) if m not in dims)


def mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """A process group over all ranks of ``mesh``: its own on one dim; on several, the
    default group when it spans every rank, else the group of ``mesh._flatten()`` (torch's
    one way to a group over a mesh's ranks, which needs dim names: None without them)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return mesh._flatten().get_group() if _names(mesh) else None


def exchange_of(main: DeviceMesh) -> Exchange:
    """The ``Exchange`` over the ranks of ``main`` (``main_mesh`` made sure it has a group)."""
    pg = mesh_group(main)
    world = main.size()
    at_of = {g: i for i, g in enumerate(main.mesh.flatten().tolist())}
    coords = []
    for r in range(world):
        at = at_of[dist.get_global_rank(pg, r)]
        coord = []
        for n in reversed(main.shape):
            at, c = divmod(at, n)
            coord.append(c)
        coords.append(tuple(reversed(coord)))
    return Exchange(main, pg, dist.get_rank(pg), world, coords)
