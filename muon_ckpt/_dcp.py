"""DCP, called one way: ``save``/``load`` of a flat state dict, and the one place that turns
DCP's failures back into muon-ckpt's errors (an interrupt leaves as itself).

In a single process DCP warns on every call ("torch.distributed is disabled, unavailable or
uninitialized, assuming the intent is to save in a single process"), which is the normal
case here. ``save``/``load`` filter that one message, the first time they run without a
process group: a filter of our own (catch_warnings() is not thread-safe, and background
saves run in a thread), added at the call, not at import.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import operator
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

import muon_ckpt._collective as coll
from muon_ckpt._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStorageError,
    handled,
    interrupt_in,
)
from muon_ckpt._gcpause import paused_gc
from muon_ckpt.store import is_storage_failure
from muon_ckpt.store.dcp import ChunkList, add_chunks, tiling_problem

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
    with failures(what, group, collective=not alone), coll.lane(None if alone else group):
        coll.arrive("the start of DCP's save")
        try:
            dcp.save(sd, storage_writer=writer, planner=planner, process_group=group, no_dist=alone)
        finally:  # (a writer whose rank 0 marks DCP's finish: marked also where it never ran)
            if (ended := getattr(writer, "ended", None)) is not None:
                ended()


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
    with failures(what, group, collective=not alone), coll.lane(None if alone else group):
        coll.arrive("the start of DCP's load")
        dcp.load(sd, storage_reader=reader, planner=planner, process_group=group, no_dist=alone)


@contextlib.contextmanager
def failures(what: str, group: Any = None, *, collective: bool = False) -> Iterator[None]:
    """DCP's failures as muon-ckpt's errors (``dcp_failure``), an interrupt as itself (DCP
    turns everything raised inside it into a CheckpointException: ``interrupt_in``); one of
    its own collectives on ``group`` (``collective``: it makes some) that failed (raised as
    it is, not wrapped) as the error every rank raises for it (``coll.comm_failure``)."""
    since = handled()
    try:
        yield
    except DCP_ERRORS as e:
        stop = interrupt_in(e, since)
        if stop is not None:  # Ctrl-C (or an exit) in the middle: itself, not a failure
            raise stop from None
        if collective and isinstance(e, RuntimeError):
            raise coll.comm_failure(e, what, group) from e
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

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        return _dedup(all_plans, self.dedup_save_to_lowest_rank)  # (DCP's hook, the same)


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
    as the ranks made them (None): they only speed up finding a ShardedTensor's local shard,
    and a global position is not one."""
    with paused_gc():  # (millions of items at thousands of ranks, none of them garbage)
        plans = _dedup(all_plans, lowest_rank)
        md: dict[str, Any] = {}
        for plan in plans:
            _add_chunks(md, plan.items)
        whole = len(plans) > 1  # (one rank alone may save part of a tensor: DCP's rule too)
        for fqn, meta in md.items():
            if isinstance(meta, TensorStorageMetadata) and len(meta.size):
                problem = tiling_problem(tuple(meta.size), *meta.chunks.columns(), whole)
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


_OFFSETS, _SIZES = operator.attrgetter("offsets"), operator.attrgetter("sizes")
_FQN, _TYPE, _TD = (operator.attrgetter(a) for a in ("index.fqn", "type", "tensor_data"))
_KEY = operator.attrgetter("index.fqn", "index.offset")  # (MetadataIndex's hash and equality)


def _add_chunks(md: dict[str, Any], items: list[Any]) -> None:
    """One plan's items into the metadata ``md``, in order, as DCP's global plan adds them:
    one more shard of a tensor already there (most: every rank's own) appends its chunk, all
    at once in C; any other item, one by one (``_first``), which makes the metadata's keys in
    DCP's order. (A tensor's chunks keep their order: the others raise, or are its first.)
    Each chunk's offsets and sizes go beside it (``ChunkList``), read while it is at hand."""
    metas = list(map(md.get, map(_FQN, items)))
    chunks = list(map(getattr, map(_TD, items), itertools.repeat("chunk"), _NONES))
    more = map(operator.is_, map(_TYPE, items), itertools.repeat(WriteItemType.SHARD))
    more = map(operator.and_, more, map(operator.is_, map(type, metas), _TSM))
    more = list(map(operator.and_, more, map(operator.is_not, chunks, _NONES)))
    if not all(more):
        for item, added in zip(items, more):
            if not added:
                meta = _first(md, item)  # (DCP's checks: an object, a tensor once)
                if meta is not None:
                    meta.chunks.add(item.tensor_data.chunk)
    lists = list(map(_CHUNKS, itertools.compress(metas, more)))
    add_chunks(lists, list(itertools.compress(chunks, more)))


_NONES, _TSM = itertools.repeat(None), itertools.repeat(TensorStorageMetadata)
_CHUNKS = operator.attrgetter("chunks")


def _first(md: dict[str, Any], item: Any) -> TensorStorageMetadata | None:
    """The metadata entry of a write item that is not one more shard of a tensor already
    there (None: an object's), with DCP's checks: an object or a whole tensor is saved once,
    a tensor with its chunk."""
    fqn, kind, td = item.index.fqn, item.type, item.tensor_data
    if kind is not WriteItemType.SHARD and fqn in md:
        raise AssertionError(f"{fqn!r} is saved twice")
    if kind is WriteItemType.BYTE_IO:
        md[fqn] = BytesStorageMetadata()
        return None
    if td is None or td.chunk is None:
        raise AssertionError(f"the tensor {fqn!r} is saved without its chunk")
    meta = md.setdefault(fqn, TensorStorageMetadata(td.properties, td.size, ChunkList()))
    if not isinstance(meta, TensorStorageMetadata):
        raise AssertionError(f"{fqn!r} is saved as an object and as a tensor")
    return meta


def _dedup(all_plans: Sequence[SavePlan], lowest_rank: bool) -> list[SavePlan]:
    """DCP's ``dedup_save_plans``: an item that several plans hold (a replicated tensor or
    object, the empty shards several ranks hold at a tensor's end) stays in one, the plan
    with the fewest bytes so far in the order the items first appear (the lowest rank with
    ``lowest_rank``), ties as DCP breaks them. The keys are counted in C. Where DCP adds up
    every item's bytes, only those that decide are measured: a key's holders are its first
    holder and later plans, whose own items come after it, so at its turn their bytes are
    what they were given so far, and its first holder's its items before it."""
    keys = [list(map(_KEY, plan.items)) for plan in all_plans]
    counts = collections.Counter(itertools.chain.from_iterable(keys))
    plans = list(all_plans)
    if len(counts) == sum(map(len, keys)):
        return plans  # (each key once: nothing to drop)
    shared = set(itertools.compress(counts, map((1).__lt__, counts.values())))
    drain = collections.deque(maxlen=0).extend
    held = {k: ([], []) for k in shared}  # shared key -> its plans and positions, in order
    for p, ks in enumerate(keys):
        at = list(itertools.compress(itertools.count(), map(shared.__contains__, ks)))
        lists = list(map(held.__getitem__, map(ks.__getitem__, at)))
        drain(map(list.append, map(_FIRST, lists), itertools.repeat(p, len(at))))
        drain(map(list.append, map(_SECOND, lists), at))
    given = [0] * len(plans)  # the bytes of the shared items each plan was given
    dropped: list[list[int]] = [[] for _ in plans]
    own, at, before = -1, 0, 0  # a first holder, how far its items were added up, their bytes
    for p, i, key in sorted((qs[0], js[0], key) for key, (qs, js) in held.items()):
        if p != own:
            own, at, before = p, 0, 0
        for k, item in zip(keys[p][at:i], plans[p].items[at:i]):
            if k not in shared:  # (a shared one counts where it was given)
                before += item.tensor_storage_size() or 1
        at = i
        qs, js = held[key]
        holders = list(set(qs))  # (a set, as DCP's, so that ties fall as there: the first)
        if lowest_rank:
            pick = min(holders)
        else:
            bytes_ = list(map(given.__getitem__, holders))
            if own in holders:
                bytes_[holders.index(own)] += before
            pick = holders[bytes_.index(min(bytes_))]
        given[pick] += plans[qs[-1]].items[js[-1]].tensor_storage_size() or 1  # (DCP's: the last)
        drain(map(list.append, map(dropped.__getitem__, qs), js))
        for _ in range(qs.count(pick)):  # (the pick keeps its own)
            dropped[pick].pop()
    for q, drop in enumerate(dropped):
        if drop:
            items = plans[q].items
            keep = sorted(set(range(len(items))) - set(drop))
            plans[q] = dataclasses.replace(plans[q], items=list(map(items.__getitem__, keep)))
    return plans


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
