"""A load's local plan in time of this rank's chunks, not of every rank's.

DCP's planner finds the saved chunks a rank reads by sweeping all of a tensor's chunks: every
rank's, 2,048 a tensor at 2,048 ranks, 1.3 million for a rank's load of an 8B model (2.5 s,
on every rank). Where a tensor's saved chunks are slabs in order (each spans the tensor but
along one dimension, their starts and ends along it never decreasing: ``Shard(d)``'s, as the
ranks save them), those a shard of this rank can overlap are a run of them, found by
bisection; DCP's own planner then sweeps that run alone. Its read items are the same, in the
same order: DCP takes a shard's chunks in the order of their ends along the dimension it
sweeps, then of their places; along the slabs' dimension that order is the run's, along any
other they all end at once. Each item's index hint is then put back to its chunk's place
among all of the tensor's.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
from typing import Any

from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
from torch.distributed.tensor import DTensor

from muon_ckpt.store.dcp import ChunkList

__all__ = ["narrowed", "restored"]


def _run(meta: Any, local: Any) -> range | None:
    """The saved chunks (positions in ``meta.chunks``) a local chunk can overlap, where they
    are slabs in order (each spans the tensor but along one dimension, their starts and ends
    along it never decreasing); else None."""
    chunks, size = meta.chunks, tuple(meta.size)
    cols = chunks.columns() if isinstance(chunks, ChunkList) else None
    if cols is None or len(chunks) < 2 or not size:
        return None
    offsets, sizes = cols
    try:
        d = next((i for i, (k, n) in enumerate(zip(sizes[0], size)) if k != n), 0)
        shapes = set(sizes)
        for j in range(len(size)):
            at = operator.itemgetter(j)
            if j != d and (set(map(at, offsets)) != {0} or set(map(at, shapes)) != {size[j]}):
                return None
        along = operator.itemgetter(d)
        starts = list(map(along, offsets))
        ends = list(map(operator.add, starts, map(along, sizes)))
        if not (
            all(map(operator.le, starts, starts[1:])) and all(map(operator.le, ends, ends[1:]))
        ):
            return None
        a, b = local.offsets[d], local.offsets[d] + local.sizes[d]
        # (DCP's overlap along d: a chunk's end past a, its start before b)
        return range(bisect.bisect_right(ends, a), bisect.bisect_left(starts, b))
    except (TypeError, IndexError):  # (chunks of another kind: DCP's planner alone)
        return None


def narrowed(state_dict: dict[str, Any], md: Metadata) -> tuple[Metadata, dict[str, range]]:
    """``md`` with each DTensor's chunks narrowed to the run its shard can overlap (for DCP's
    planner to sweep), and those runs by key (for ``restored``)."""
    runs: dict[str, range] = {}
    state = dict(md.state_dict_metadata)
    for key, value in state_dict.items():
        meta = state.get(key)
        if not isinstance(value, DTensor) or type(meta) is not TensorStorageMetadata:
            continue
        try:
            local = _create_chunk_list(value)  # (as DCP's planner makes it)
        except Exception:  # (DCP's planner says what is wrong)
            continue
        run = _run(meta, local[0]) if len(local) == 1 else None
        if run is not None and len(run) < len(meta.chunks):
            runs[key] = run
            state[key] = dataclasses.replace(meta, chunks=meta.chunks.part(run.start, run.stop))
    if not runs:
        return md, runs
    return dataclasses.replace(md, state_dict_metadata=state), runs


def restored(plan: LoadPlan, runs: dict[str, range]) -> LoadPlan:
    """``plan`` (of ``narrowed`` metadata) with each item's index hint its chunk's place among
    all of the tensor's chunks, as DCP's planner gives it."""
    if not runs:
        return plan
    items = [_restored(it, runs.get(it.storage_index.fqn)) for it in plan.items]
    return dataclasses.replace(plan, items=items)


def _restored(item: ReadItem, run: range | None) -> ReadItem:
    index = item.storage_index
    if run is None or type(index.index) is not int:
        return item
    at = MetadataIndex(index.fqn, index.offset, run.start + index.index)
    return dataclasses.replace(item, storage_index=at)
