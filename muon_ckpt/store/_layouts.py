"""The DCP metadata's check at thousands of ranks: each chunk layout checked once, and every
stored item matched with its chunk in one pass over the rows, in the order they are stored.

A 2,048-rank step of an 8B model has 1.3 million chunks and as many stored items, but its
hundreds of tensors come in a few shapes, all sharded alike: the ``.metadata``'s pickle
stores each equal offset and size once, so tensors of one layout have chunk columns of the
very same objects, and a layout checked for one (chunks inside the tensor, tiling it) is
checked for all (``Layouts``). The items then need each to be its chunk's (its key's next
chunk, at that chunk's offset) and to hold that chunk's bytes: ``rows_hold`` walks the
rows once, in the order the ranks stored them, each key's chunks advancing as its rows come
(a sort of the rows by key, or a pass per key over rows that lie all over the columns, was
most of the check's time: a cache miss per row).
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any

from muon_ckpt.store._chunklist import ChunkList
from muon_ckpt.store._index import StorageIndex

__all__ = ["Layout", "Layouts", "rows_hold"]

# A checked layout: its chunks' offsets, the bytes each needs (0: an empty chunk, which
# stores nothing), and whether its offsets are distinct (each chunk one stored item)
Layout = tuple[list[Any], list[int], bool]


def _raw(chunks: list[Any]) -> tuple[list[Any], list[Any]] | None:
    return chunks.columns() if isinstance(chunks, ChunkList) and chunks.exact else None


def needed(sizes: list[Any], itemsize: int) -> list[int]:
    """Each chunk's bytes (0: an empty chunk)."""
    need = {s: math.prod(s) * itemsize for s in set(sizes)}  # (a few sizes: each once)
    return list(map(need.__getitem__, sizes))


class Layouts:
    """The chunk layouts checked so far, one a tensor size (a crafted file's many layouts of
    one size cost one comparison each, not one per layout seen)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, ...], tuple[list[Any], list[Any], Layout, int]] = {}

    def get(self, size: tuple[int, ...], chunks: list[Any], itemsize: int) -> Layout | None:
        """The layout of a tensor of ``size`` whose chunk columns are the very objects of
        one checked already (identity: equal values of other types are not the same
        chunks); else None."""
        raw, seen = _raw(chunks), self._seen.get(size)
        if raw is None or seen is None or len(raw[0]) != len(seen[0]):
            return None
        if not all(map(operator.is_, raw[0], seen[0])):
            return None
        if not all(map(operator.is_, raw[1], seen[1])):
            return None
        layout, bytes_of = seen[2], seen[3]
        if itemsize != bytes_of:
            layout = (layout[0], needed(seen[1], itemsize), layout[2])
            self._seen[size] = (seen[0], seen[1], layout, itemsize)
        return layout

    def add(
        self, size: tuple[int, ...], chunks: list[Any], cols: tuple[list, list], itemsize: int
    ) -> Layout:
        """The layout of checked chunks (``cols``: their offsets and sizes, checked)."""
        offsets = cols[0]
        distinct = len(offsets) < 2 or len(set(offsets)) == len(offsets)
        layout = (offsets, needed(cols[1], itemsize), distinct)
        raw = _raw(chunks)
        if raw is not None:
            self._seen[size] = (raw[0], raw[1], layout, itemsize)
        return layout


def rows_hold(index: StorageIndex, want: dict[Any, Layout], int_lengths: bool) -> bool:
    """Whether the rows are exactly the items ``want`` describes, in one pass in the rows'
    order: each row the next chunk of its key (a key's rows in the order of its chunks,
    as ``StorageIndex.align`` finds them), at its offset, of a length of at least the
    chunk's bytes; every chunk one row. Then each row's offset is replaced by its chunk's
    equal object (``StorageIndex.matched``). False for anything else (a storage transform
    included), which the checks one by one then name."""
    if index.how is not None or not int_lengths:
        return False
    if not all(w[2] for w in want.values()):
        return False
    offsets = {k: w[0] for k, w in want.items()}
    need = {k: w[1] for k, w in want.items()}
    pos = {k: itertools.count() for k in want}
    fqns = index.fqns
    try:
        at = list(map(next, map(pos.__getitem__, fqns)))  # each row's place in its key's
        fresh = list(map(operator.getitem, map(offsets.__getitem__, fqns), at))
    except (KeyError, TypeError, IndexError):  # (a name of no key, or a chunk too many)
        return False
    if any(next(pos[k]) != len(offsets[k]) for k in want):  # (a chunk with no row)
        return False
    if fresh != index.offsets:
        return False
    needs = map(operator.getitem, map(need.__getitem__, fqns), at)
    if not all(map(operator.ge, index.lengths, needs)):
        return False
    index.matched(fresh)
    return True
