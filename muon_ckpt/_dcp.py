"""DCP, called one way: ``save``/``load`` of a flat state dict, and the one place that turns
DCP's failures back into muon-ckpt's errors (an interrupt leaves as itself).

In a single process DCP warns on every call ("torch.distributed is disabled, unavailable or
uninitialized, assuming the intent is to save in a single process"), which is the normal
case here. ``save``/``load`` filter that one message, the first time they run without a
process group: a filter of our own (catch_warnings() is not thread-safe, and background
saves run in a thread), added at the call, not at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from muon_ckpt._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStorageError,
    handled,
    interrupt_in,
)
from muon_ckpt._gcpause import paused_gc
from muon_ckpt.store import is_storage_failure
from muon_ckpt.store.dcp import tiling_problem

__all__ = ["SavePlanner", "UntrustedItem", "dcp_failure", "failures", "global_plan", "load", "save"]

# What a failed dcp.save/dcp.load raises: DCP's CheckpointException derives from BaseException.
DCP_ERRORS = (Exception, CheckpointException)
_quiet = threading.Lock()
_quieted = False


class UntrustedItem(Exception):
    """A stored item is not the tensor its chunk declares, or could expand beyond its bytes
    (``load._declared``). Raised while reading, where a damaged item fails the same way: the
    readers report the file's checksum mismatch where there is one
    (``load._corruption.prefer_corruption``), else this as a CheckpointCorruptError
    (``prefer_corruption``, ``dcp_failure``)."""


def _single_process(alone: bool | None = None) -> bool:
    """Whether this call runs without a process group (``alone``; None: when there is none);
    then DCP's warning about it is filtered (once, for good: see the module docstring)."""
    global _quieted
    if alone is None:
        alone = not (dist.is_available() and dist.is_initialized())
    if not alone:
        return False
    with _quiet:
        if not _quieted:
            warnings.filterwarnings(
                "ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized"
            )
            _quieted = True
    return True


def save(
    sd: dict[str, Any],
    writer: Any,
    planner: Any,
    group: Any,
    what: str,
    *,
    alone: bool | None = None,
) -> None:
    """``dcp.save`` of ``sd`` on ``group``'s ranks, or in this process alone (``alone``; None:
    when there is no process group); a failure is a CheckpointError naming ``what``
    (``failures``)."""
    alone = _single_process(alone)
    with failures(what):
        dcp.save(sd, storage_writer=writer, planner=planner, process_group=group, no_dist=alone)


def load(
    sd: dict[str, Any],
    reader: Any,
    planner: Any,
    group: Any,
    what: str,
    *,
    alone: bool | None = None,
) -> None:
    """``dcp.load`` into ``sd`` on ``group``'s ranks, or in this process alone (``alone``;
    None: when there is no process group); a failure is a CheckpointError naming ``what``
    (``failures``)."""
    alone = _single_process(alone)
    with failures(what):
        dcp.load(sd, storage_reader=reader, planner=planner, process_group=group, no_dist=alone)


@contextlib.contextmanager
def failures(what: str) -> Iterator[None]:
    """DCP's failures as muon-ckpt's errors (``dcp_failure``), an interrupt as itself (DCP
    turns everything raised inside it into a CheckpointException: ``interrupt_in``)."""
    since = handled()
    try:
        yield
    except DCP_ERRORS as e:
        stop = interrupt_in(e, since)
        if stop is not None:  # Ctrl-C (or an exit) in the middle: itself, not a failure
            raise stop from None
        raise dcp_failure(e, what) from e


def dcp_failure(e: BaseException, what: str) -> CheckpointError:
    """The CheckpointError to raise for a failed ``dcp.save``/``dcp.load``: DCP wraps the
    failures of every rank (``CheckpointException.failures``); a CheckpointError raised by one
    of ours inside DCP comes back as itself (same class and message), an untrusted stored item
    (``_declared``) as a CheckpointCorruptError, anything else as a
    CheckpointError (a CheckpointStorageError when the storage failed) naming ``what`` and
    the first cause."""
    if isinstance(e, CheckpointError):
        return e
    failures: dict[int, Any] = getattr(e, "failures", None) or {}
    causes = [v[0] if isinstance(v, tuple) else v for _, v in sorted(failures.items())]
    for c in causes:
        if isinstance(c, CheckpointError):
            return type(c)(str(c))
        if isinstance(c, UntrustedItem):  # (its file's checksum found nothing, or none ran)
            return CheckpointCorruptError(str(c))
    first = causes[0] if causes else e
    ranks = f" on rank(s) {sorted(failures)}" if failures else ""
    cls = CheckpointStorageError if is_storage_failure(first) else CheckpointError
    return cls(f"{what} failed{ranks}: {type(first).__name__}: {first}")


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, its global plan linear in ranks (``global_plan``)."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # (DCP's plan caching, off by default, is never turned on here: no cache to keep)
        plans, md = global_plan(all_plans, self.dedup_save_to_lowest_rank, self.flatten_state_dict)
        self.global_plan, self.metadata = plans, md
        return plans, md


def global_plan(
    all_plans: Sequence[SavePlan], lowest_rank: bool = False, mappings: bool = True
) -> tuple[list[SavePlan], Metadata]:
    """Rank 0's global save plan and metadata from every rank's local plan: what DCP's
    ``DefaultSavePlanner`` makes (the same dedup of replicated items, the same metadata) in
    time linear in the items. Its ``_validate_global_plan`` compares each chunk of a tensor
    with every other chunk that overlaps it along the tensor's largest dimension: all of them
    where the shards cut another one (w2 of a transformer, 4096 x 14336, on 2,048 ranks: 0.6 s
    a tensor, minutes a save); here the same checks (inside, no overlap, no gap when several
    ranks save) are ``store``'s tiling check, a sort per tensor. DCP's index hints are left
    as the ranks made them (None): they only speed up finding a ShardedTensor's local shard
    and a global position is not one."""
    with paused_gc():  # (millions of items at thousands of ranks, none of them garbage)
        plans = _dedup(all_plans, lowest_rank)
        md: dict[str, Any] = {}
        for plan in plans:
            for item in plan.items:
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    if fqn in md:
                        raise AssertionError(f"the object {fqn!r} is saved twice")
                    md[fqn] = BytesStorageMetadata()
                    continue
                td = item.tensor_data
                if td is None or td.chunk is None:
                    raise AssertionError(f"the tensor {fqn!r} is saved without its chunk")
                meta = md.get(fqn)
                if meta is None:
                    meta = md[fqn] = TensorStorageMetadata(td.properties, td.size, [])
                elif item.type != WriteItemType.SHARD or not isinstance(
                    meta, TensorStorageMetadata
                ):
                    raise AssertionError(f"the tensor {fqn!r} is saved twice")
                meta.chunks.append(td.chunk)
        whole = len(plans) > 1  # (one rank alone may save part of a tensor: DCP's rule too)
        for fqn, meta in md.items():
            if isinstance(meta, TensorStorageMetadata) and len(meta.size):
                chunks = [(c.offsets, c.sizes) for c in meta.chunks]  # (torch.Size: tuples)
                problem = tiling_problem(tuple(meta.size), chunks, whole)
                if problem is not None:
                    raise ValueError(
                        f"Failed to validate global plan: the tensor {fqn!r} of size "
                        f"{list(meta.size)} {problem} (the ranks' shards must tile it)"
                    )
        metadata = Metadata(md)
        if mappings:  # DCP's ChainMap of the ranks' mappings, flattened: the first rank's wins
            merged: dict[str, Any] = {}
            for plan in reversed(plans):
                merged.update(plan.planner_data or {})
            metadata = dataclasses.replace(metadata, planner_data=merged)
    return plans, metadata


def _dedup(all_plans: Sequence[SavePlan], lowest_rank: bool) -> list[SavePlan]:
    """DCP's ``dedup_save_plans``: an item that several plans hold (a replicated tensor or
    object) stays in one, the plan with the fewest bytes so far in the order the items first
    appear (the lowest rank with ``lowest_rank``), ties as DCP breaks them; in one pass over
    the items, measuring only those that come before the last such item."""
    first: dict[tuple[str, Any], Any] = {}  # key -> (plan, position, item) where first seen
    shared: dict[tuple[str, Any], list[tuple[int, int]]] = {}  # held by several: (plan, pos)
    last: dict[tuple[str, Any], Any] = {}  # the item of a shared key its last holder has
    for p, plan in enumerate(all_plans):
        for i, item in enumerate(plan.items):
            key = (item.index.fqn, item.index.offset)
            seen = first.get(key)
            if seen is None:
                first[key] = (p, i, item)
                continue
            held = shared.get(key)
            if held is None:
                held = shared[key] = [seen[:2]]
            held.append((p, i))
            last[key] = item
    plans = list(all_plans)
    if not shared:
        return plans
    sizes = [0] * len(plans)
    dropped: list[list[int]] = [[] for _ in plans]
    todo = len(shared)
    for key, (p, _, item) in first.items():  # (DCP's order: where each key first appears)
        held = shared.get(key)
        if held is None:
            sizes[p] += item.tensor_storage_size() or 1
            continue
        holders = {q for q, _ in held}  # (a set, as DCP's, so that ties fall as there)
        pick = min(holders) if lowest_rank else min(holders, key=lambda q: sizes[q])
        sizes[pick] += last[key].tensor_storage_size() or 1
        for q, i in held:
            if q != pick:
                dropped[q].append(i)
        todo -= 1
        if not todo:  # (sizes after the last shared key decide nothing)
            break
    for q, drop in enumerate(dropped):
        if drop:
            keep, at = [], 0
            for i in sorted(drop):
                keep += plans[q].items[at:i]
                at = i + 1
            keep += plans[q].items[at:]
            plans[q] = dataclasses.replace(plans[q], items=keep)
    return plans
