"""Who orthogonalises what: owner ranks, pieces and the chunk order of a Muon step.

Every matrix gets ONE owner among ALL ranks of the main mesh (``_mesh.py``), replicas
included, so R replicas share the Newton-Schulz work rather than each redoing it. Owners are
chosen greedily (longest-processing-time first) to balance the Newton-Schulz cost,
~max(A, B) * min(A, B)^2 for an A x B matrix. The owner gathers the pieces of its own replica
(``Exchange.same_replica``) and every rank that holds a piece gets its slice of the result. The
processing order interleaves owners so that each chunk of ``chunk_size`` matrices keeps as
many ranks busy as it can. The plan depends only on the global shapes, the placements, the
mesh and ``chunk_size``, so every rank builds the same one.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from optim._mesh import Exchange, embed, exchange_of, main_mesh, piece, sharding_dims
from optim._ns_dtype import NS_DTYPES, NS_METHODS
from optim.newton_schulz import uses_gram

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, length) per dim of a piece


@dataclass
class Item:
    """One Muon matrix as the step sees it."""

    param: Tensor
    group: dict
    gshape: torch.Size  # global (logical) shape
    exchanged: bool  # True: owner-based gather/scatter over the mesh; False: all local
    ns_dtype: torch.dtype  # what its update, Newton-Schulz and result are computed in
    ex: Exchange | None = None  # the main mesh's group (exchanged items)
    placements: tuple[Placement, ...] = ()  # on the main mesh's dims (exchanged items)
    owner: int = 0
    chunk: int = 0
    unit: int = 0  # items of one unit run through one batched Newton-Schulz
    _boxes: dict[int, Box] = field(default_factory=dict)
    _sends: dict[int, bool] = field(default_factory=dict)

    @property
    def method(self) -> str:
        """Its group's Newton-Schulz method (``ns_method``, resolved)."""
        return self.group["ns_method"]

    @property
    def gram(self) -> bool:
        """Whether Newton-Schulz takes the Gram iteration on it (``uses_gram``)."""
        return uses_gram(*self.matrix_dims(), self.method)

    def box(self, r: int) -> Box:
        """The piece rank ``r`` of the exchange holds: (start, length) per dim."""
        if r not in self._boxes:
            self._boxes[r] = piece(
                tuple(self.gshape), self.placements, tuple(self.ex.mesh.shape), self.ex.coords[r]
            )
        return self._boxes[r]

    def piece_numel(self, r: int) -> int:
        return math.prod(self.box(r)[1])

    def gathered(self) -> bool:
        """Whether its owner needs pieces of others (it does not hold the whole matrix)."""
        return self.piece_numel(self.owner) != self.gnumel()

    def sends(self, r: int) -> bool:
        """Whether rank ``r`` sends its piece to the owner: a non-empty piece of the owner's
        own replica (``Exchange.same_replica``), when the owner lacks the whole matrix. Call
        once the owner is set."""
        if r not in self._sends:
            self._sends[r] = (
                self.gathered()
                and self.piece_numel(r) > 0
                and self.ex.same_replica(r, self.owner, sharding_dims(self.placements))
            )
        return self._sends[r]

    def gnumel(self) -> int:
        return math.prod(self.gshape)

    def matrix_dims(self) -> tuple[int, int]:
        a = self.gshape[0]
        return a, math.prod(self.gshape) // max(a, 1)


@dataclass
class Plan:
    items: list[Item]  # processing order
    chunks: list[list[Item]]
    ex: Exchange | None  # None: nothing is exchanged
    device: torch.device | None  # where small control tensors live for collectives

    @property
    def pg(self) -> dist.ProcessGroup | None:
        return self.ex.pg if self.ex else None

    @property
    def rank(self) -> int:
        return self.ex.rank if self.ex else 0

    @property
    def world(self) -> int:
        return self.ex.world if self.ex else 1


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
    ns_steps, ns_dtype and Newton-Schulz method, and on whether each is a DTensor split over
    ranks (never on the world size or the placements), so one process and N ranks run the
    very same batched Newton-Schulz calls: the N-ranks == 1-process invariant survives."""
    open_units: dict[tuple, list[Item]] = {}
    units: list[list[Item]] = []
    for it in items:
        # DTensor-ness, not only "exchanged": a DTensor on one rank must batch as it does on
        # N; "exchanged" too, as a unit has one owner (a DTensor on a 1-rank slice of the
        # mesh is local beside exchanged ones).
        key = (
            tuple(it.gshape),
            it.param.dtype,
            it.group["ns_steps"],
            it.ns_dtype,
            it.gram,
            isinstance(it.param, DTensor),
            it.exchanged,
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
    items, ex = _items(groups)
    device = _check_pieces([it for it in items if it.exchanged], ex)
    units = _form_units(items)
    world, rank = (ex.world, ex.rank) if ex else (1, 0)
    _assign_owners(units, world, rank)
    chunks = _chunk(_interleave_owners(units, world), chunk_size)
    return Plan([it for c in chunks for it in c], chunks, ex, device)


def _items(groups: list[dict]) -> tuple[list[Item], Exchange | None]:
    """Every Muon param as an Item, in group order, and the exchange over the main mesh (None
    when no param spans more than one rank)."""
    muon = [p for g in groups if g["use_muon"] for p in g["params"]]
    main = main_mesh([p.device_mesh for p in muon if isinstance(p, DTensor)])
    ex = exchange_of(main) if main is not None else None
    items: list[Item] = []
    for g in groups:
        if not g["use_muon"] or not g["params"]:  # (an empty group's "auto" means nothing yet)
            continue
        dtype = NS_DTYPES[g["ns_dtype"]]
        for p in g["params"]:
            if isinstance(p, DTensor) and p.device_mesh.size() > 1:
                items.append(Item(p, g, p.shape, True, dtype, ex, embed(p, ex.mesh)))
            else:
                items.append(Item(p, g, p.shape, False, dtype))
    return items, ex


def _check_pieces(exchanged: list[Item], ex: Exchange | None) -> torch.device | None:
    """Check, on every rank at once, that each rank's local shard of each exchanged item is
    the piece its placements say (``Item.box``) and that the ranks agree on its Newton-Schulz
    dtype and method; return the device of the collectives' control tensors (None when
    nothing is exchanged). Two small all-reduces when all is well (each rank checks its own
    piece); every rank raises the same error otherwise, so none is left waiting."""
    if not exchanged:
        return None
    device = exchanged[0].param.to_local().device
    fewest, most = _spread([[len(exchanged)]], ex, device)
    if fewest != most:
        counts = [c[0][0] for c in _gather([[len(exchanged)]], ex, device)]
        raise RuntimeError(
            f"the ranks of {ex.mesh} hold different numbers of split Muon matrices: "
            f"{counts} on ranks 0..{ex.world - 1}; every rank must build Muon with the same "
            "params, in the same order"
        )
    codes = list(NS_DTYPES.values())
    mine = [
        [
            codes.index(it.ns_dtype),
            NS_METHODS.index(it.method),
            int(not _fits(tuple(it.param.to_local().shape), it.box(ex.rank)[1])),
        ]
        for it in exchanged
    ]
    lo, hi = _spread(mine, ex, device)
    if lo == hi and not any(row[2] for row in hi):
        return device
    nd = max(len(it.gshape) for it in exchanged)
    rows = [
        [*row[:2], *it.param.to_local().shape, *[0] * (nd - it.param.ndim)]
        for row, it in zip(mine, exchanged, strict=True)
    ]
    got = _gather(rows, ex, device)
    for j, it in enumerate(exchanged):
        _check_same_ns_dtype(it, [list(NS_DTYPES)[got[r][j][0]] for r in range(ex.world)])
        _check_same_ns_method(it, [NS_METHODS[got[r][j][1]] for r in range(ex.world)])
        for r in range(ex.world):
            found = tuple(got[r][j][2 : 2 + len(it.gshape)])
            if not _fits(found, it.box(r)[1]):
                raise RuntimeError(
                    f"a Muon param of shape {tuple(it.gshape)} with placements "
                    f"{it.placements} on {ex.mesh}: rank {r} (mesh coordinate {ex.coords[r]}) "
                    f"holds a local shard of shape {found}, but its placements give "
                    f"{it.box(r)[1]}; Muon cannot tell which piece of the matrix it holds "
                    "(is the param a DTensor whose local tensor was replaced or resized?)"
                )
    return device


def _fits(local_shape: tuple[int, ...], box_shape: tuple[int, ...]) -> bool:
    """Whether a local shard of ``local_shape`` is the piece ``box_shape``: the same, or both
    empty (``fully_shard`` over a tensor-parallel shard with no columns keeps it (0, 0) where
    the placements give (rows, 0): no elements either way)."""
    return local_shape == box_shape or math.prod(local_shape) == math.prod(box_shape) == 0


def _spread(rows: list[list[int]], ex: Exchange, device: torch.device):
    """The element-wise minimum and maximum over the ranks of ``rows`` (one all-reduce)."""
    mine = torch.tensor(rows, dtype=torch.int64, device=device)
    both = torch.stack([-mine, mine])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ex.pg)
    both = both.cpu()
    return (-both[0]).tolist(), both[1].tolist()


def _gather(rows: list[list[int]], ex: Exchange, device: torch.device) -> list[list[list[int]]]:
    """Every rank's ``rows`` (the same number, of the same length, on each rank)."""
    mine = torch.tensor(rows, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(ex.world)]
    dist.all_gather(gathered, mine, group=ex.pg)
    return torch.stack(gathered).cpu().tolist()


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
