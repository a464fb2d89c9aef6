"""The two exchanges of a Muon chunk over the main mesh's group: pieces to owners, results back.

Gather: each exchanged matrix's owner receives the pieces of its own replica
(``Item.sends``: the ranks at its coordinates on every mesh dim that does not split the
matrix), one ``all_to_all_single`` per chunk, and copies each into its box of the full matrix
(``assemble``): a copy, so the owner orthogonalises the very matrix one process would.
Scatter: the owner sends EVERY rank that holds a piece of the matrix, replicas included, its
box of the result (``start_scatter``), again one ``all_to_all_single``; each rank then applies
what it received (``received``). Both are asynchronous: the step waits for them only when it
needs their data, so they overlap the Newton-Schulz of other chunks.

Each rank's part of a collective is laid out in rank order, and within it in the chunk's
item order: every rank derives the same sizes from the plan alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from optim._mesh import mesh_group
from optim._plan import Box, Item, Plan

__all__ = ["Inflight", "agree_on_grads", "assemble", "received", "start_gather", "start_scatter"]


@dataclass
class Inflight:
    """A chunk's collective in flight: its items, their local updates (gather) and where the
    data lands (``buf``, sized per source rank), or nothing to wait for (``work`` None)."""

    items: list[Item]
    updates: list[Tensor] | None
    buf: Tensor | None = None
    work: Any = None

    def wait(self) -> Tensor:
        self.work.wait()  # Sync: the data of this collective must have landed before it is read.
        return self.buf


def region(t: Tensor, box: Box) -> Tensor:
    """The view of ``t`` at ``box`` (start, length per dim)."""
    return t[tuple(slice(a, a + n) for a, n in zip(*box, strict=True))]


def _by_owner(plan: Plan, items: list[Item]) -> list[list[int]]:
    """Indices into ``items`` of its exchanged items, per owner rank, in order."""
    out: list[list[int]] = [[] for _ in range(plan.world)]
    for i, it in enumerate(items):
        if it.exchanged:
            out[it.owner].append(i)
    return out


def wire_dtype(items: list[Item]) -> torch.dtype:
    """The dtype a chunk's exchanged updates and results travel in: the widest of their
    ns_dtypes (fp32 holds every bf16 value exactly). The same on every rank: every rank has
    the chunk's exchanged items."""
    out = items[0].ns_dtype
    for it in items[1:]:
        out = torch.promote_types(out, it.ns_dtype)
    return out


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _all_to_all(plan: Plan, parts: list[Tensor], send_sizes, recv_sizes, like: Tensor):
    send = torch.cat(parts) if parts else like.new_empty(0)
    recv = like.new_empty(sum(recv_sizes))
    work = dist.all_to_all_single(
        recv, send, list(recv_sizes), list(send_sizes), group=plan.pg, async_op=True
    )
    return recv, work


def start_gather(plan: Plan, items: list[Item], updates: list[Tensor]) -> Inflight:
    """Send this rank's piece of every exchanged matrix it is a sender of to the matrix's
    owner (async); ``updates`` are the items' local updates, in order."""
    ex = [i for i, it in enumerate(items) if it.exchanged]
    if not ex:
        return Inflight(items, updates)
    wire, me = wire_dtype([items[i] for i in ex]), plan.rank
    by_owner = _by_owner(plan, items)
    parts, send_sizes = [], []
    for d in range(plan.world):
        n = 0
        for i in by_owner[d]:
            if items[i].sends(me):
                parts.append(_as(updates[i].reshape(-1), wire))
                n += items[i].piece_numel(me)
        send_sizes.append(n)
    recv_sizes = [
        sum(items[i].piece_numel(s) for i in by_owner[me] if items[i].sends(s))
        for s in range(plan.world)
    ]
    like = updates[ex[0]].new_empty(0, dtype=wire)
    buf, work = _all_to_all(plan, parts, send_sizes, recv_sizes, like)
    return Inflight(items, updates, buf, work)


def assemble(plan: Plan, fl: Inflight) -> dict[int, Tensor]:
    """Wait for the gather; return the full matrix of every item this rank owns (index into
    ``fl.items`` -> its full update, in the item's ns_dtype)."""
    items, updates, me = fl.items, fl.updates, plan.rank
    mine = _by_owner(plan, items)[me]
    fulls = {
        i: torch.empty(items[i].gshape, dtype=items[i].ns_dtype, device=updates[i].device)
        if items[i].gathered()
        else updates[i]  # (the owner holds the whole matrix)
        for i in mine
    }
    buf = fl.wait()
    off = 0
    for s in range(plan.world):
        for i in mine:
            it = items[i]
            if it.sends(s):
                box = it.box(s)
                n = it.piece_numel(s)
                region(fulls[i], box).copy_(buf[off : off + n].view(box[1]))  # (exact cast)
                off += n
    return fulls


def start_scatter(plan: Plan, items: list[Item], results: dict[int, Tensor]) -> Inflight:
    """Send every rank its box of each result this rank owns (async); ``results`` maps an
    index into ``items`` to its orthogonalised full matrix."""
    ex = [it for it in items if it.exchanged]
    wire, me = wire_dtype(ex), plan.rank
    by_owner = _by_owner(plan, items)
    parts, send_sizes = [], []
    for d in range(plan.world):
        n = 0
        for i in by_owner[me]:
            if items[i].piece_numel(d):
                parts.append(_as(region(results[i], items[i].box(d)).reshape(-1), wire))
                n += items[i].piece_numel(d)
        send_sizes.append(n)
    recv_sizes = [sum(items[i].piece_numel(me) for i in by_owner[s]) for s in range(plan.world)]
    like = torch.empty(0, dtype=wire, device=plan.device)
    buf, work = _all_to_all(plan, parts, send_sizes, recv_sizes, like)
    return Inflight(items, None, buf, work)


def received(plan: Plan, fl: Inflight) -> Iterator[tuple[Item, Tensor]]:
    """Wait for the scatter; yield each exchanged item with this rank's box of its result
    (empty where this rank holds no piece of it), in the item's ns_dtype."""
    buf = fl.wait()
    off = 0
    for owned in _by_owner(plan, fl.items):
        for i in owned:
            it = fl.items[i]
            n = it.piece_numel(plan.rank)
            yield it, _as(buf[off : off + n], it.ns_dtype)
            off += n


def agree_on_grads(plan: Plan, groups: list[dict]) -> set[int]:
    """ids of the params with a grad. The ranks that hold a param a step exchanges must
    agree on it (one all-reduce per group of ranks): Muon's split matrices over the main
    mesh, AdamW's DTensors over their own mesh (a Partial grad is reduced across it)."""
    active = {id(p) for g in groups for p in g["params"] if p.grad is not None}
    checks: dict[Any, tuple[Any, int, list[tuple[str, Tensor]]]] = {}
    if plan.ex is not None:
        muon = [("a Muon param", it.param) for it in plan.items if it.exchanged]
        checks["main"] = (plan.pg, plan.world, muon)
    for g in groups:
        for p in g["params"]:
            if g["use_muon"] or not isinstance(p, DTensor) or p.device_mesh.size() == 1:
                continue
            mesh = p.device_mesh  # (a DeviceMesh compares by its ranks and dims, not by id)
            if mesh not in checks:  # (in param order: the same order on every rank)
                checks[mesh] = (mesh_group(mesh), mesh.size(), [])
            checks[mesh][2].append(("an AdamW param", p))
    for pg, world, checked in checks.values():
        if pg is None or not checked:
            continue  # (a mesh without a group of its own ranks: nothing to reduce over)
        has = torch.tensor(
            [id(p) in active for _, p in checked],
            dtype=torch.int32,
            device=checked[0][1].to_local().device,
        )
        dist.all_reduce(has, group=pg)
        for (what, p), n in zip(checked, has.tolist(), strict=True):
            if n not in (0, world):
                raise RuntimeError(
                    f"{what} of shape {tuple(p.shape)} has a grad on {n} of {world} "
                    "ranks; every rank must have a grad for it, or none"
                )
    return active
