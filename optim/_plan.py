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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from optim._ns_dtype import NS_DTYPES, NS_METHODS
from optim.newton_schulz import uses_gram


@dataclass
class Item:
    """One Muon matrix as the step sees it."""

    param: Tensor
    group: dict
    gshape: torch.Size  # global (logical) shape
    exchanged: bool  # True: owner-based gather/scatter over the mesh; False: all local
    ns_dtype: torch.dtype  # what its update, Newton-Schulz and result are computed in
    shard_dim: int | None = None  # None: every rank holds the full matrix (Replicate)
    pieces: list[torch.Size] = field(default_factory=list)  # local shape on each rank
    owner: int = 0
    chunk: int = 0
    unit: int = 0  # items of one unit run through one batched Newton-Schulz

    @property
    def method(self) -> str:
        """Its group's Newton-Schulz method (``ns_method``, resolved)."""
        return self.group["ns_method"]

    @property
    def gram(self) -> bool:
        """Whether Newton-Schulz takes the Gram iteration on it (``uses_gram``)."""
        return uses_gram(*self.matrix_dims(), self.method)

    def piece_numel(self, r: int) -> int:
        return math.prod(self.pieces[r])

    def gnumel(self) -> int:
        return math.prod(self.gshape)

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


def local(t: Tensor) -> Tensor:
    """A DTensor's local shard, else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def grad_like_param(p: Tensor) -> Tensor:
    """``p``'s grad with ``p``'s placements (a DTensor grad whose placements differ, e.g.
    ``Partial`` for a replicated param, is redistributed first)."""
    g = p.grad
    if hasattr(g, "placements") and g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)
    return g


def _ns_cost(shape: torch.Size) -> float:
    a = shape[0]
    b = math.prod(shape) // max(a, 1)
    return float(max(a, b)) * float(min(a, b)) ** 2


# Same-shape matrices are orthogonalised together (one batched Newton-Schulz) while their
# summed cost stays under this, i.e. small matrices batch and large ones stay alone.
BATCH_COST_LIMIT = float(2048**3)
MAX_BATCH = 32


def _unit_cost(unit: list[Item]) -> float:
    return sum(_ns_cost(it.gshape) for it in unit)


def _form_units(items: list[Item]) -> list[list[Item]]:
    """Batches of same-shape matrices. Depends only on the params' order, shapes, dtypes,
    ns_steps, ns_dtype and Newton-Schulz method (never on the world size or placements), so one process and N ranks run the
    very same batched Newton-Schulz calls: the N-ranks == 1-process invariant survives."""
    open_units: dict[tuple, list[Item]] = {}
    units: list[list[Item]] = []
    for it in items:
        # DTensor-ness, not "exchanged": a DTensor on one rank must batch as it does on N.
        key = (
            tuple(it.gshape),
            it.param.dtype,
            it.group["ns_steps"],
            it.ns_dtype,
            it.gram,
            isinstance(it.param, DTensor),
        )
        u = open_units.get(key)
        if (
            u is None
            or len(u) >= MAX_BATCH
            or _unit_cost(u) + _ns_cost(it.gshape) > BATCH_COST_LIMIT
        ):
            u = []
            units.append(u)
            open_units[key] = u
        u.append(it)
    return units


def build_plan(groups: list[dict], chunk_size: int) -> Plan:
    """The plan of a Muon step: its items with their geometry, their owners, their batches
    (units) and the order and chunks they are processed in."""
    items, mesh = _items(groups)
    pg = mesh.get_group() if mesh is not None else None
    world = mesh.size() if mesh is not None else 1
    rank = dist.get_rank(pg) if pg is not None else 0
    device = _measure_pieces([it for it in items if it.exchanged], pg, world)
    units = _form_units(items)
    _assign_owners(units, world, rank)
    chunks = _chunk(_interleave_owners(units, world), chunk_size)
    return Plan([it for c in chunks for it in c], chunks, pg, rank, world, device)


def _items(groups: list[dict]) -> tuple[list[Item], DeviceMesh | None]:
    """Every Muon param as an Item, in group order, and the mesh it is split over (None when
    no param spans more than one rank)."""
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
                items.append(Item(p, g, p.shape, True, NS_DTYPES[g["ns_dtype"]], sd))
            else:
                items.append(Item(p, g, p.shape, False, NS_DTYPES[g["ns_dtype"]]))
    return items, mesh


def _measure_pieces(
    exchanged: list[Item], pg: dist.ProcessGroup | None, world: int
) -> torch.device | None:
    """Set each exchanged item's ``pieces`` (its local shape on every rank); return the device
    of the collectives' control tensors (None when nothing is exchanged).

    Each rank's shard length along the shard dim is gathered once per plan: the geometry is
    read off the real shards rather than re-derived from a chunking rule. Each rank's
    Newton-Schulz dtype and method of the item come with it: the owner's would otherwise
    decide."""
    if not exchanged:
        return None
    device = exchanged[0].param.to_local().device
    codes = list(NS_DTYPES.values())
    mine = torch.tensor(
        [
            [
                it.param.to_local().shape[it.shard_dim] if it.shard_dim is not None else 0,
                codes.index(it.ns_dtype),
                NS_METHODS.index(it.method),
            ]
            for it in exchanged
        ],
        dtype=torch.int64,
        device=device,
    )
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=pg)
    got = torch.stack(gathered).cpu().tolist()
    lens = [[row[0] for row in rank_rows] for rank_rows in got]
    for j, it in enumerate(exchanged):
        _check_same_ns_dtype(it, [list(NS_DTYPES)[got[r][j][1]] for r in range(world)])
        _check_same_ns_method(it, [NS_METHODS[got[r][j][2]] for r in range(world)])
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
    return device


def _check_same_ns_dtype(it: Item, per_rank: list[str]) -> None:
    if len(set(per_rank)) > 1:
        raise RuntimeError(
            f"the ranks disagree on the Newton-Schulz dtype of a param of shape "
            f"{tuple(it.gshape)}: ns_dtype {per_rank} on ranks 0..{len(per_rank) - 1} "
            "('auto' picks per host: bf16 where it has fast bf16 matrix units); pass the same "
            "ns_dtype='bf16' or 'fp32' on every rank"
        )


def _check_same_ns_method(it: Item, per_rank: list[str]) -> None:
    if len(set(per_rank)) > 1:
        raise RuntimeError(
            f"the ranks disagree on the Newton-Schulz method of a param of shape "
            f"{tuple(it.gshape)}: ns_method {per_rank} on ranks 0..{len(per_rank) - 1} "
            "('auto' picks per device and ns_dtype); pass the same ns_method='gram' or "
            "'standard' on every rank"
        )


def _assign_owners(units: list[list[Item]], world: int, rank: int) -> None:
    """Longest-processing-time-first owner assignment over the exchanged units; ties broken
    by index, so every rank computes the same owners. Local items are owned by this rank."""
    ex_units = [u for u in units if u[0].exchanged]
    loads = [(0.0, r) for r in range(world)]
    heapq.heapify(loads)
    for ui in sorted(range(len(ex_units)), key=lambda i: (-_unit_cost(ex_units[i]), i)):
        load, r = heapq.heappop(loads)
        for it in ex_units[ui]:
            it.owner = r
        heapq.heappush(loads, (load + _unit_cost(ex_units[ui]), r))
    for u in units:
        for it in u:
            if not it.exchanged:
                it.owner = rank


def _interleave_owners(units: list[list[Item]], world: int) -> list[list[Item]]:
    """The processing order of the units: round-robin over each owner's queue (largest
    first), so consecutive units, and hence each chunk, have different owners. Local units
    go last."""
    queues: list[list[list[Item]]] = [[] for _ in range(world)]
    for u in sorted((u for u in units if u[0].exchanged), key=lambda u: -_unit_cost(u)):
        queues[u[0].owner].append(u)
    ordered: list[list[Item]] = []
    depth = max((len(q) for q in queues), default=0)
    for k in range(depth):
        for q in queues:
            if k < len(q):
                ordered.append(q[k])
    return ordered + [u for u in units if not u[0].exchanged]


def _chunk(ordered_units: list[list[Item]], chunk_size: int) -> list[list[Item]]:
    """Cut the ordered units into chunks and number each item's unit and chunk.

    Chunks never split a unit. Their sizes ramp up 1, 2, 4, ... to chunk_size params: the
    first chunk's inputs (its gather, or its states' reload under CPU offload) cannot overlap
    anything, so it is kept small; later chunks hide behind the Newton-Schulz of earlier ones."""
    chunks: list[list[Item]] = []
    for ui, u in enumerate(ordered_units):
        for it in u:
            it.unit = ui
        target = min(chunk_size, 2 ** (len(chunks) - 1)) if chunks else 1
        if not chunks or (chunks[-1] and len(chunks[-1]) + len(u) > target):
            chunks.append([])
        chunks[-1].extend(u)
    for ci, chunk in enumerate(chunks):
        for it in chunk:
            it.chunk = ci
    return chunks
