"""The save's plans at thousands of ranks: up to rank 0 as columns, back as what was dropped.

DCP gathers every rank's local save plan to rank 0 (pickled: one ``WriteItem`` of five
objects per chunk), where the global plan drops the items several ranks hold and makes the
metadata, and scatters each rank's plan back (pickled again). At 2,048 ranks of an 8B model
that is 1.33 million items and 256 MiB: 11 s to unpickle on rank 0 with the collector paused,
60 s with it running, before any planning. Here a rank's plan (``LocalPlan``) travels up as
columns of plain values (``Columns``: names, kinds, offsets and sizes as tuples, properties
once each), and comes back as the positions rank 0 dropped, which the rank that made it
applies to its own items (``_plans.recall``); a plan of items DCP's planner would not make
travels as it is, and gets its items back.

The global plan runs over the columns (``global_plan``), as DCP's ``DefaultSavePlanner``
makes it (the same dedup of replicated items, the same metadata, its checks), in time linear
in the items: DCP's ``_validate_global_plan`` compares each chunk of a tensor with every
other that overlaps it along its largest dimension (w2 of a transformer, 4096 x 14336, on
2,048 ranks: 0.6 s a tensor); here the same checks are ``store``'s tiling check, a sort per
tensor. The dedup first counts only the items that can be held twice where every tensor is
sharded (objects, whole tensors, empty and 0-d shards): a non-empty shard held twice
overlaps itself, which the tiling check then finds, and the plan is made again counting
every item (a ``Replicate`` mesh dimension, HSDP, says so up front: ``Columns.replicated``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem
from torch.distributed.checkpoint.planner import WriteItemType as Kind

from muon_ckpt._plans import recall, remember

__all__ = [
    "BYTES",
    "SHARD",
    "Columns",
    "LocalPlan",
    "Paths",
    "Received",
    "columns_of",
    "loose",
    "merge",
]

SHARD, BYTES = Kind.SHARD.value, Kind.BYTE_IO.value  # (as the columns hold them)
_KINDS = {k.value: k for k in Kind}


class Columns:
    """One plan's write items as columns, in its order: ``fqns``; ``kinds`` (bytes of
    ``WriteItemType`` values); ``offsets`` (the index's, or None); for tensor items ``sizes``
    (the chunk's), ``cuts`` (the chunk's offsets where they are not the index's; None when
    none is), ``shapes`` (the tensor's) and ``props`` (a position in ``table``: each
    TensorProperties once), None for an object; ``hints`` (the index's; None when all are);
    ``doubt``: the positions another plan may hold too where every tensor is sharded (all
    but the non-empty shards of tensors of one or more dimensions); ``replicated``: the rank
    holds a tensor replicated over a mesh dimension (HSDP), where any may be. Every offset,
    size and shape a torch.Size, equal ones one object: pickled once each."""

    __slots__ = _FIELDS = (
        "fqns",
        "kinds",
        "offsets",
        "sizes",
        "cuts",
        "shapes",
        "props",
        "table",
        "hints",
        "doubt",
        "replicated",
    )

    def __init__(
        self,
        fqns: list[str],
        kinds: bytes,
        offsets: list[Any],
        sizes: list[Any],
        cuts: list[Any] | None,
        shapes: list[Any],
        props: list[Any],
        table: list[Any],
        hints: list[Any] | None,
        doubt: list[int] | None = None,
        replicated: bool = False,
    ) -> None:
        self.fqns, self.kinds, self.offsets, self.sizes = fqns, kinds, offsets, sizes
        self.cuts, self.shapes, self.props, self.table = cuts, shapes, props, table
        self.hints, self.replicated = hints, replicated
        if doubt is None:
            full = [k == SHARD and bool(s) and all(s) for k, s in zip(kinds, sizes)]
            doubt = list(itertools.compress(itertools.count(), map(operator.not_, full)))
        self.doubt = doubt

    def __reduce__(self) -> tuple[Any, ...]:
        return (Columns, tuple(getattr(self, n) for n in self._FIELDS))

    def __len__(self) -> int:
        return len(self.fqns)

    def chunk_offsets(self) -> list[Any]:
        if self.cuts is None:
            return self.offsets
        return [o if c is None else c for o, c in zip(self.offsets, self.cuts)]

    def item(self, j: int) -> WriteItem:
        """Item ``j`` as DCP's planner made it (``columns_of`` checks they are equal)."""
        kind, off = _KINDS[self.kinds[j]], self.offsets[j]
        index = MetadataIndex(self.fqns[j], off, None if self.hints is None else self.hints[j])
        if self.sizes[j] is None:
            return WriteItem(index=index, type=kind)
        cut = off if self.cuts is None or self.cuts[j] is None else self.cuts[j]
        chunk = ChunkStorageMetadata(cut, self.sizes[j])
        props = self.table[self.props[j]]
        data = TensorWriteData(chunk=chunk, properties=props, size=self.shapes[j])
        return WriteItem(index=index, type=kind, tensor_data=data)

    def nbytes(self, j: int) -> int:
        """DCP's ``tensor_storage_size`` of item ``j`` (the whole tensor's bytes), or 1."""
        if self.shapes[j] is None:
            return 1
        return math.prod(self.shapes[j]) * self.table[self.props[j]].dtype.itemsize or 1


def columns_of(items: Sequence[Any], replicated: bool = False) -> Columns | None:
    """``items`` as columns, or None where an item is not of DCP's plain classes or does not
    come back equal from them (then the plan travels as its items)."""
    table: list[TensorProperties] = []
    seen: dict[tuple[Any, ...], int] = {}
    same: dict[Any, torch.Size] = {}  # (equal offsets, sizes and shapes: one object each)

    def one(v: Any) -> torch.Size:
        return same.setdefault(v, torch.Size(v))

    fqns, kinds, offsets, hints, sizes, cuts, shapes, props = ([] for _ in range(8))
    for it in items:
        index, td = it.index, it.tensor_data
        if type(it) is not WriteItem or type(index) is not MetadataIndex or it.bytes_io_data:
            return None
        fqns.append(index.fqn)
        kinds.append(it.type.value)
        offsets.append(None if index.offset is None else one(index.offset))
        hints.append(index.index)
        if td is None:
            sizes.append(None), cuts.append(None), shapes.append(None), props.append(None)
            continue
        chunk, p = td.chunk, td.properties
        if type(td) is not TensorWriteData or type(chunk) is not ChunkStorageMetadata:
            return None
        if type(p) is not TensorProperties:
            return None
        sizes.append(one(chunk.sizes))
        cuts.append(None if chunk.offsets == index.offset else one(chunk.offsets))
        shapes.append(one(td.size))
        key = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
        props.append(seen.setdefault(key, len(table)))
        if len(table) < len(seen):
            table.append(p)
    cols = Columns(
        fqns,
        bytes(kinds),
        offsets,
        sizes,
        cuts if any(c is not None for c in cuts) else None,
        shapes,
        props,
        table,
        None if all(h is None for h in hints) else hints,
        replicated=replicated,
    )
    if any(cols.item(j) != it for j, it in enumerate(items)):  # (a field these do not carry)
        return None
    return cols


@dataclasses.dataclass(frozen=True)
class LocalPlan(SavePlan):
    """A rank's local plan: pickled (DCP's gather), its columns and a key to it in this
    process (``_plans.remember``); the plan is kept while its planner is."""

    replicated: bool = False

    def __reduce__(self) -> tuple[Any, ...]:
        cols = columns_of(self.items, self.replicated)
        if cols is None:  # (as DCP sends it)
            return (SavePlan, (self.items, self.storage_data, self.planner_data, self.usable))
        paths = Paths.of(self.planner_data)
        return (Received, ([], self.storage_data, paths, self.usable, remember(self), cols))


class Paths:
    """DCP's mappings of a plan (each flattened key's path in the state dict) as two columns,
    the path of a key that is its own path (``(key,)``: most) as ``...``: on rank 0 half of
    a plan's objects, the rest the names the plan's columns hold too (``merge``)."""

    __slots__ = ("keys", "paths")

    def __init__(self, keys: list[Any], paths: list[Any]) -> None:
        self.keys, self.paths = keys, paths

    @classmethod
    def of(cls, mappings: Any) -> Any:
        if type(mappings) is not dict:
            return mappings
        keys = list(mappings)
        own = [type(v) is tuple and len(v) == 1 and v[0] == k for k, v in mappings.items()]
        return cls(keys, [... if o else v for o, v in zip(own, mappings.values())])

    def __reduce__(self) -> tuple[Any, ...]:
        return (Paths, (self.keys, self.paths))


def merge(mappings: Sequence[Any]) -> dict[str, Any]:
    """DCP's ChainMap of the ranks' mappings, flattened: the first rank's wins."""
    merged: dict[str, Any] = {}
    for m in reversed(mappings):
        merged.update(zip(m.keys, m.paths) if isinstance(m, Paths) else (m or {}))
    own = [k for k, v in merged.items() if v is ...]
    merged.update(zip(own, zip(own)))
    return merged


@dataclasses.dataclass(frozen=True)
class Received(SavePlan):
    """A local plan on rank 0, its items as columns; pickled back (DCP's scatter) as the
    positions the global plan dropped (``drop``), which the rank that made it applies to
    its own plan (``_back``)."""

    key: str = ""
    cols: Columns | None = None
    drop: tuple[int, ...] = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_back, (self.key, self.drop, self.storage_data, self.usable))


def _back(key: str, drop: Sequence[int], storage_data: Any, usable: bool) -> SavePlan:
    """The global plan's part for this rank: its own plan but the items rank 0 dropped."""
    own = recall(key)
    if not isinstance(own, LocalPlan):
        raise RuntimeError(
            "a save plan came back to a process that did not make it (DCP's scatter must "
            "return each rank its own plan); the step is not committed"
        )
    items = own.items
    if drop:
        gone = set(drop)
        items = [it for j, it in enumerate(items) if j not in gone]
    return SavePlan(items, storage_data=storage_data, planner_data=own.planner_data, usable=usable)


def loose(items: Sequence[Any]) -> Columns:
    """The columns of items of classes or fields DCP's plain ones do not carry as they are:
    what DCP's metadata records of them, item by item."""
    tds = [it.tensor_data for it in items]
    chunks = [None if td is None else td.chunk for td in tds]

    def size(v: Any) -> Any:
        return None if v is None else torch.Size(v)

    return Columns(
        [it.index.fqn for it in items],
        bytes(it.type.value for it in items),
        [size(it.index.offset) for it in items],
        [None if c is None else size(c.sizes) for c in chunks],
        [None if c is None else size(c.offsets) for c in chunks],
        [None if td is None else size(td.size) for td in tds],
        list(range(len(items))),
        [None if td is None else td.properties for td in tds],
        None,
    )
