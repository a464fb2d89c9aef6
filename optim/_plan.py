"""Who orthogonalises what: owner ranks, shard geometry and the chunk order of a Muon step.

Every matrix gets ONE owner rank. Owners are chosen greedily (longest-processing-time first)
to balance the Newton-Schulz cost, ~max(A, B) * min(A, B)^2 for an A x B matrix, across the
ranks of the mesh. The processing order interleaves owners so that each chunk of
``chunk_size`` matrices keeps as many ranks busy as it can. The plan depends only on the global
shapes, the mesh and ``chunk_size``, so every rank builds the same one.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard


@dataclass
class Item:
    """One Muon matrix as the step sees it."""

    param: Tensor
    group: dict
    gshape: torch.Size  # global (logical) shape
    exchanged: bool  # True: owner-based gather/scatter over the mesh; False: all local
    shard_dim: int | None = None  # None: every rank holds the full matrix (Replicate)
    pieces: list[torch.Size] = field(default_factory=list)  # local shape on each rank
    owner: int = 0
    chunk: int = 0

    def piece_numel(self, r: int) -> int:
        return math.prod(self.pieces[r])

    def matrix_dims(self) -> tuple[int, int]:
        a = self.gshape[0]
        return a, math.prod(self.gshape) // max(a, 1)


@dataclass
class Plan:
    items: list[Item]  # processing order
    chunks: list[list[Item]]
    pg: dist.ProcessGroup | None
    rank: int
    world: int
    device: torch.device | None  # where small control tensors live for collectives


def _ns_cost(shape: torch.Size) -> float:
    a = shape[0]
    b = math.prod(shape) // max(a, 1)
    return float(max(a, b)) * float(min(a, b)) ** 2


def build_plan(groups: list[dict], chunk_size: int) -> Plan:
    items: list[Item] = []
    mesh = None
    for g in groups:
        if not g["use_muon"]:
            continue
        for p in g["params"]:
            if isinstance(p, DTensor) and p.device_mesh.size() > 1:
                mesh = p.device_mesh
                pl = p.placements[0]
                sd = pl.dim if isinstance(pl, Shard) else None
                items.append(Item(p, g, p.shape, True, sd))
            else:
                items.append(Item(p, g, p.shape, False))

    pg = mesh.get_group() if mesh is not None else None
    world = mesh.size() if mesh is not None else 1
    rank = dist.get_rank(pg) if pg is not None else 0
    device = None
    exchanged = [it for it in items if it.exchanged]
    if exchanged:
        device = exchanged[0].param.to_local().device
        # Each rank's shard length along the shard dim, gathered once per plan: the geometry is
        # read off the real shards rather than re-derived from a chunking rule.
        mine = torch.tensor(
            [
                it.param.to_local().shape[it.shard_dim] if it.shard_dim is not None else 0
                for it in exchanged
            ],
            dtype=torch.int64,
            device=device,
        )
        gathered = torch.empty(world * len(exchanged), dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(gathered, mine, group=pg)
        lens = gathered.view(world, len(exchanged)).cpu().tolist()
        for j, it in enumerate(exchanged):
            if it.shard_dim is None:
                it.pieces = [it.gshape] * world
                continue
            pieces = []
            for r in range(world):
                s = list(it.gshape)
                s[it.shard_dim] = lens[r][j]
                pieces.append(torch.Size(s))
            if sum(lens[r][j] for r in range(world)) != it.gshape[it.shard_dim]:
                raise RuntimeError(
                    f"DTensor shards of a param with shape {tuple(it.gshape)} do not tile "
                    f"dim {it.shard_dim}: shard lengths {[lens[r][j] for r in range(world)]}"
                )
            it.pieces = pieces

        # Longest-processing-time-first owner assignment; ties broken by index for determinism.
        loads = [(0.0, r) for r in range(world)]
        heapq.heapify(loads)
        order = sorted(range(len(exchanged)), key=lambda j: (-_ns_cost(exchanged[j].gshape), j))
        for j in order:
            load, r = heapq.heappop(loads)
            exchanged[j].owner = r
            heapq.heappush(loads, (load + _ns_cost(exchanged[j].gshape), r))

    for it in items:
        if not it.exchanged:
            it.owner = rank

    # Interleave owners: round-robin over each owner's queue (largest first), so consecutive
    # items, and hence each chunk, have different owners. Local items go last.
    queues: list[list[Item]] = [[] for _ in range(world)]
    for it in sorted(exchanged, key=lambda it: -_ns_cost(it.gshape)):
        queues[it.owner].append(it)
    ordered: list[Item] = []
    depth = max((len(q) for q in queues), default=0)
    for k in range(depth):
        for q in queues:
            if k < len(q):
                ordered.append(q[k])
    ordered += [it for it in items if not it.exchanged]

    chunks = [ordered[i : i + chunk_size] for i in range(0, len(ordered), chunk_size)]
    for ci, chunk in enumerate(chunks):
        for it in chunk:
            it.chunk = ci
    return Plan(ordered, chunks, pg, rank, world, device)
