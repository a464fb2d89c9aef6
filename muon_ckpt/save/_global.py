"""Rank 0's global save plan over the ranks' plans as columns (``_plan``), as DCP's
``DefaultSavePlanner`` makes it, in time linear in the items (the docstring of ``_plan``)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor

from muon_ckpt._gcpause import paused_gc
from muon_ckpt.save._plan import (
    BYTES,
    SHARD,
    Columns,
    LocalPlan,
    Received,
    columns_of,
    loose,
    merge,
)
from muon_ckpt.store.dcp import chunk_list, tiling_problem

__all__ = ["SavePlanner", "global_plan"]

_drain = collections.deque(maxlen=0).extend


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, its plans sent as columns (``LocalPlan``) and its global
    plan linear in ranks (``global_plan``)."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if not plan.usable:  # (DCP's plan caching, off by default: its own marker)
            return plan
        replicated = any(
            not all(p.is_shard() for p in v.placements)
            for v in self.state_dict.values()
            if isinstance(v, DTensor)
        )
        plan = self.plan = LocalPlan(
            plan.items, plan.storage_data, plan.planner_data, plan.usable, replicated
        )
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # (DCP's plan caching, off by default, is never turned on here: no cache to keep)
        plans, md = global_plan(all_plans, self.dedup_save_to_lowest_rank, self.flatten_state_dict)
        self.global_plan, self.metadata = plans, md
        return plans, md


def global_plan(
    all_plans: Sequence[SavePlan], lowest_rank: bool = False, mappings: bool = True
) -> tuple[list[SavePlan], Metadata]:
    """Rank 0's global save plan and metadata from every rank's local plan (the module
    docstring): ``Received`` plans come back as theirs with the positions dropped, any other
    with its items. DCP's index hints are left as the ranks made them (None): they only
    speed up finding a ShardedTensor's local shard, and a global position is not one."""
    with paused_gc():  # (millions of values at thousands of ranks, none of them garbage)
        cols = [p.cols if isinstance(p, Received) else columns_of(p.items) for p in all_plans]
        cols = [c if c is not None else loose(p.items) for c, p in zip(cols, all_plans)]
        whole = len(cols) > 1  # (one rank alone may save part of a tensor: DCP's rule too)
        md, drops = None, None
        if not any(c.replicated for c in cols):
            drops = _dedup(cols, lowest_rank, every=False)
            try:
                md = _metadata(cols, drops)
            except AssertionError:  # (an object or whole tensor held twice, not counted)
                md = None
            if md is not None and _problem(md, whole, sure=False) is not None:
                md = None  # (a shard held twice: counted again, every item)
        if md is None:
            drops = _dedup(cols, lowest_rank, every=True)
            md = _metadata(cols, drops)
            problem = _problem(md, whole, sure=True)
            if problem is not None:
                raise ValueError(problem)
        metadata = Metadata(md)
        if mappings:
            merged = merge([p.planner_data for p in all_plans])
            metadata = dataclasses.replace(metadata, planner_data=merged)
        plans = [_final(p, d) for p, d in zip(all_plans, drops)]
    return plans, metadata


def _final(plan: SavePlan, drop: list[int]) -> SavePlan:
    """``plan`` without the items at ``drop``: a ``Received`` one keeps them as positions."""
    if isinstance(plan, Received):
        return dataclasses.replace(plan, drop=tuple(drop))
    items = plan.items
    if drop:
        gone = set(drop)
        items = [it for j, it in enumerate(items) if j not in gone]
    return SavePlan(items, plan.storage_data, plan.planner_data, plan.usable)


def _dedup(cols: list[Columns], lowest_rank: bool, every: bool) -> list[list[int]]:
    """DCP's ``dedup_save_plans``, as the positions each plan drops: an item that several
    plans hold (a replicated tensor or object, the empty shards several ranks hold at a
    tensor's end) stays in one, the plan with the fewest bytes so far in the order the
    items first appear (the lowest rank with ``lowest_rank``), ties as DCP breaks them.
    Counted: every item (``every``) or those of ``Columns.doubt``, in C. Where DCP adds up every
    item's bytes, only those that decide are measured: a key's holders are its first holder
    and later plans, whose own items come after it, so at its turn their bytes are what they
    were given so far, and its first holder's its items before it."""
    at = [range(len(c)) if every else c.doubt for c in cols]
    keys = [
        list(zip(map(c.fqns.__getitem__, a), map(c.offsets.__getitem__, a)))
        for c, a in zip(cols, at)
    ]
    counts = collections.Counter(itertools.chain.from_iterable(keys))
    drops: list[list[int]] = [[] for _ in cols]
    if len(counts) == sum(map(len, keys)):
        return drops  # (each key once: nothing to drop)
    shared = set(itertools.compress(counts, map((1).__lt__, counts.values())))
    held: dict[Any, tuple[list[int], list[int]]] = {k: ([], []) for k in shared}
    mine = []  # each plan's positions of shared items
    for p, (ks, a) in enumerate(zip(keys, at)):
        idx = list(itertools.compress(itertools.count(), map(shared.__contains__, ks)))
        pos = list(map(a.__getitem__, idx))
        lists = list(map(held.__getitem__, map(ks.__getitem__, idx)))
        _drain(map(list.append, map(_FIRST, lists), itertools.repeat(p, len(idx))))
        _drain(map(list.append, map(_SECOND, lists), pos))
        mine.append(set(pos))
    given = [0] * len(cols)  # the bytes of the shared items each plan was given
    own, upto, before = -1, 0, 0  # a first holder, how far its items were added up, their bytes
    for p, i, key in sorted((qs[0], js[0], key) for key, (qs, js) in held.items()):
        if p != own:
            own, upto, before = p, 0, 0
        c, skip = cols[p], mine[p]  # (a shared one counts where it was given)
        before += sum(c.nbytes(j) for j in range(upto, i) if j not in skip)
        upto = i
        qs, js = held[key]
        holders = list(set(qs))  # (a set, as DCP's, so that ties fall as there: the first)
        if lowest_rank:
            pick = min(holders)
        else:
            bytes_ = list(map(given.__getitem__, holders))
            if own in holders:
                bytes_[holders.index(own)] += before
            pick = holders[bytes_.index(min(bytes_))]
        given[pick] += cols[qs[-1]].nbytes(js[-1])  # (DCP's: the last holder's item)
        _drain(map(list.append, map(drops.__getitem__, qs), js))
        for _ in range(qs.count(pick)):  # (the pick keeps its own)
            drops[pick].pop()
    return drops


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_OFFSETS, _SIZES, _CHUNKS = (operator.attrgetter(a) for a in ("offsets", "sizes", "chunks"))
_TSM, _NONES = itertools.repeat(TensorStorageMetadata), itertools.repeat(None)


def _metadata(cols: list[Columns], drops: list[list[int]]) -> dict[str, Any]:
    """The metadata's entries of the plans' kept items, in DCP's order. Any item but one more
    shard of a tensor already there, one by one (``_first``: the keys in DCP's order, DCP's
    checks). The others (most: every rank's own shards) go to their tensors' columns by
    runs of plans whose shards are of the same tensors in the same order, a run's rows
    turned into the tensors' columns in C (``zip``). (A tensor's chunks keep the plans'
    order: the tensors ``_first`` adds to are new in that plan, none of them in a run.)"""
    md: dict[str, Any] = {}
    run: list[Any] = []  # the tensors of the run
    offsets: list[list[Any]] = []  # the run's rows
    sizes: list[list[Any]] = []

    def flush() -> None:
        for meta, offs, lens in zip(run, zip(*offsets), zip(*sizes)):
            meta.chunks.offsets.extend(offs)
            meta.chunks.sizes.extend(lens)
        offsets.clear(), sizes.clear()

    for c, drop in zip(cols, drops):
        metas = list(map(md.get, c.fqns))
        more = map(
            operator.and_, map((SHARD).__eq__, c.kinds), map(operator.is_, map(type, metas), _TSM)
        )
        more = list(map(operator.and_, more, map(operator.is_not, c.sizes, _NONES)))
        cuts = c.chunk_offsets()
        gone = set(drop)
        for j in drop:
            more[j] = False
        if not all(more):
            for j in itertools.compress(range(len(more)), map(operator.not_, more)):
                if j not in gone and (meta := _first(md, c, j)) is not None:
                    meta.chunks.offsets.append(cuts[j])
                    meta.chunks.sizes.append(c.sizes[j])
        tensors = list(itertools.compress(metas, more))
        if len(tensors) != len(run) or not all(map(operator.is_, tensors, run)):
            flush()
            run = tensors
        offsets.append(list(itertools.compress(cuts, more)))
        sizes.append(list(itertools.compress(c.sizes, more)))
    flush()
    return md


def _first(md: dict[str, Any], c: Columns, j: int) -> TensorStorageMetadata | None:
    """The metadata entry of item ``j`` of ``c``, not one more shard of a tensor already there
    (None: an object's), with DCP's checks: an object or a whole tensor is saved once, a
    tensor with its chunk."""
    fqn, kind = c.fqns[j], c.kinds[j]
    if kind != SHARD and fqn in md:
        raise AssertionError(f"{fqn!r} is saved twice")
    if kind == BYTES:
        md[fqn] = BytesStorageMetadata()
        return None
    if c.sizes[j] is None:
        raise AssertionError(f"the tensor {fqn!r} is saved without its chunk")
    meta = md.get(fqn)
    if meta is None:
        props, shape = c.table[c.props[j]], torch.Size(c.shapes[j])
        meta = md[fqn] = TensorStorageMetadata(props, shape, chunk_list([], []))
    if not isinstance(meta, TensorStorageMetadata):
        raise AssertionError(f"{fqn!r} is saved as an object and as a tensor")
    return meta


def _problem(md: dict[str, Any], whole: bool, sure: bool) -> str | None:
    """What DCP's validation of the global plan would refuse (its chunks must tile each
    tensor: ``store``'s check), as its message; unless ``sure`` (not every item was counted
    by the dedup), also an empty shard held twice or at a non-empty one's offset, which only
    a count of every item tells apart."""
    for fqn, meta in md.items():
        if not isinstance(meta, TensorStorageMetadata) or not len(meta.size):
            continue
        offsets, sizes = meta.chunks.offsets, meta.chunks.sizes
        problem = tiling_problem(tuple(meta.size), offsets, sizes, whole)
        if problem is not None:
            return (
                f"Failed to validate global plan: the tensor {fqn!r} of size "
                f"{list(meta.size)} {problem} (the ranks' shards must tile it)"
            )
        if not sure and not all(map(all, sizes)):
            full = list(map(all, sizes))
            empty = list(itertools.compress(offsets, map(operator.not_, full)))
            at = set(empty)
            if len(at) < len(empty) or not at.isdisjoint(itertools.compress(offsets, full)):
                return f"the tensor {fqn!r} has an empty chunk held twice"
    return None
