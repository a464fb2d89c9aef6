"""DCP's ``.metadata`` pickled in columns.

DCP pickles its ``Metadata`` with one object per chunk and per stored item, each with its state
as a dict of its own: at 2,048 ranks of an 8B model, 1.3 million of each, 22 s to write and
16 s to read and check. Here (``dump_metadata``) a tensor's chunks are pickled as
``list(map(ChunkStorageMetadata, offsets, sizes))`` and the stored items as
``dict(zip(map(MetadataIndex, fqns, offsets), map(_StorageInfo, paths, starts, lengths)))``:
columns, in the metadata's own order (each key of its state dict in turn, a tensor's items in
the order of its chunks), every equal size, offset and name stored once. Plain
``pickle.load`` (DCP's own ``FileSystemReader``, which unpickles with no restriction) builds
the very objects DCP's pickle holds from it (the dict's order aside, which nothing reads);
nothing else changes in the file. Read here (``packed_builtins``: what ``_metadata``'s
unpickler resolves those four builtins to), the stored items stay columns: a ``StorageIndex``.
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import io
import itertools
import operator
import pickle
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from muon_ckpt.store._chunklist import ChunkList, chunk_list
from muon_ckpt.store._index import Call, Gathered, Listed, StorageIndex, pickled_items

__all__ = ["dump_metadata", "metadata_bytes", "packed_builtins"]

PROTOCOL = 4  # (DCP's own: pickle's default from Python 3.8 to 3.13)
_OFFSETS, _SIZES = operator.attrgetter("offsets"), operator.attrgetter("sizes")


class _Pickler(pickle.Pickler):
    """DCP's Metadata with its chunks and stored items as columns (the module docstring): equal
    chunk offsets, sizes and columns one object (``_Same``), the stored items' names the very
    objects of the state dict's keys, which the pickle stores once each."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream, protocol=PROTOCOL)
        same = _Same()
        # Functions of ``same``, not bound methods: a pickler in its own dispatch table is a
        # cycle, which kept its memo of millions of objects for the collector to walk and free.
        self.dispatch_table = copyreg.dispatch_table.copy()
        self.dispatch_table.update(
            {
                Metadata: functools.partial(_metadata, same),
                TensorStorageMetadata: functools.partial(_tensor, same),
            }
        )


class _Same:
    """What one pickle stores once: each equal chunk offset and size (``values``, by value),
    each equal column of them (``columns``, a column pickled again is a reference to the
    first: tensors of one shape and sharding, every layer's param and state, have equal
    ones), and each tensor's pickled columns (``chunks``)."""

    __slots__ = ("chunks", "columns", "values")

    def __init__(self) -> None:
        self.values: dict[Any, Any] = {}  # (a torch.Size equals a tuple of its values)
        self.columns: dict[tuple[Any, ...], list[list[Any]]] = {}  # by (length, first, last)
        self.chunks: dict[int, tuple[Any, Any] | None] = {}  # id(TensorStorageMetadata) ->

    def of(self, meta: TensorStorageMetadata) -> tuple[Any, Any] | None:
        """The chunks of ``meta`` as pickled: their offsets and sizes, two columns; None where
        they are not every one a ChunkStorageMetadata."""
        key = id(meta)  # (meta is in the pickled metadata: alive while the pickle is written)
        if key not in self.chunks:
            self.chunks[key] = self._of(getattr(meta, "chunks", None))
        return self.chunks[key]

    def _of(self, chunks: Any) -> tuple[Any, Any] | None:
        cols = chunks.columns() if isinstance(chunks, ChunkList) and chunks.exact else None
        listed = cols is None and isinstance(chunks, list)
        if listed and set(map(type, chunks)) == {ChunkStorageMetadata}:
            cols = list(map(_OFFSETS, chunks)), list(map(_SIZES, chunks))
        if cols is None or not chunks:
            return cols
        offsets, sizes = cols
        if set(map(type, offsets)) | set(map(type, sizes)) != {torch.Size}:
            return cols
        return self.column(offsets), self.column(sizes)

    def column(self, col: list[Any]) -> list[Any]:
        """``col`` (of torch.Size, not empty) as pickled: a column equal to one pickled before
        is that one, found by one comparison of the two lists, in C (no hash of each value);
        else its values, each the one equal value pickled (``each``)."""
        seen = self.columns.setdefault((len(col), col[0], col[-1]), [])
        same = next((c for c in seen if c == col), None)
        if same is None:
            same = self.each(col)
            seen.append(same)
        return same

    def each(self, col: list[Any]) -> list[Any]:
        """Each value of ``col`` as the one equal value pickled: a value equal to the one before
        it (most of a column's sizes) by a comparison, the others by their hash, in C."""
        n = len(col)
        new = [True, *map(operator.ne, col[1:], col)]
        firsts = list(itertools.compress(col, new))
        same = list(map(self.values.setdefault, firsts, firsts))
        if len(same) == n:
            return same
        at = list(itertools.compress(range(n), new))
        runs = map(operator.sub, [*at[1:], n], at)
        return list(itertools.chain.from_iterable(map(itertools.repeat, same, runs)))


def _metadata(same: _Same, md: Metadata) -> tuple[Any, ...]:
    state = dict(md.__dict__)
    items = state.get("storage_data")
    if _dcp_items(items):  # (a dict of DCP's own: the same columns)
        items = StorageIndex.of_items(list(items), list(items.values()))
    if isinstance(items, (StorageIndex, Gathered)):
        state["storage_data"] = Call(*_call(pickled_items(_item_columns(same, md, items))))
    return (copyreg.__newobj__, (Metadata,), state)


def _item_columns(same: _Same, md: Metadata, items: StorageIndex | Gathered) -> list[Any]:
    """The stored items' columns as pickled: each name the state dict's key (stored once),
    each offset its chunk's torch.Size (the items' of a save are tuples of ints, ``Written``)."""
    tensors = md.state_dict_metadata if isinstance(md.state_dict_metadata, dict) else {}
    for meta in tensors.values():  # (the chunks' offsets first: the items' then refer to them)
        if type(meta) is TensorStorageMetadata:
            same.of(meta)
    names, values = {k: k for k in tensors}, same.values
    if isinstance(items, Gathered):  # (a save's: each column read once, as it is written)
        cols = items.columns()
        fqns, offsets = map(items.column, (0, 1))
        cols[0] = Listed(map(names.get, cols[0], fqns))
        cols[1] = Listed(map(values.get, cols[1], offsets))
        cols[2:] = [None if c is None else Listed(c) for c in cols[2:]]
        return cols
    cols = items.columns()
    with contextlib.suppress(TypeError):  # (a name of no state dict: as it is)
        cols[0] = list(map(names.get, cols[0], cols[0]))
    with contextlib.suppress(TypeError):  # (an offset of no chunk: as it is)
        cols[1] = list(map(values.get, cols[1], cols[1]))
    return cols


def _tensor(same: _Same, meta: TensorStorageMetadata) -> tuple[Any, ...]:
    state = dict(meta.__dict__)
    cols = same.of(meta)
    if cols is not None and state.get("chunks"):
        state["chunks"] = Call(list, Call(map, ChunkStorageMetadata, *cols))
    return (copyreg.__newobj__, (TensorStorageMetadata,), state)


def _call(reduced: tuple[Any, ...]) -> tuple[Any, ...]:
    """``Call``'s arguments for what a ``__reduce__`` returned: (fn, args) -> fn, *args."""
    fn, args = reduced
    return (fn, *args)


def _dcp_items(items: Any) -> bool:
    """Whether ``items`` is DCP's dict of stored items, every key and value of its classes."""
    if type(items) is not dict or not items or set(map(type, items)) != {MetadataIndex}:
        return False
    return set(map(type, items.values())) == {_StorageInfo}


def dump_metadata(md: Metadata, stream: Any) -> None:
    """Pickle ``md`` to the binary ``stream`` (the module docstring)."""
    _Pickler(stream).dump(md)


def metadata_bytes(md: Metadata) -> bytes:
    buf = io.BytesIO()
    dump_metadata(md, buf)
    return buf.getvalue()


# ---------------------------------------------------------------------- reading
class _Map:
    """``map(fn, *cols)`` of a pickle, not run yet (iterating runs it): ``list`` and ``dict``
    below take the columns of the ones they know."""

    __slots__ = ("cols", "fn")

    def __init__(self, fn: Any, *cols: Any) -> None:
        self.fn, self.cols = fn, cols

    def __iter__(self) -> Iterator[Any]:
        # Used up by one pass, as the builtin is: a file that refers to one map many times
        # must not make it again each time (a few KB would allocate gigabytes)
        cols, self.cols = self.cols, ()
        return map(self.fn, *cols) if cols else iter(())

    def of(self, fn: Any, *arity: int) -> bool:
        return self.fn is fn and len(self.cols) in arity and all(type(c) is list for c in self.cols)


class _Zip:
    __slots__ = ("args",)

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __iter__(self) -> Iterator[Any]:
        args, self.args = self.args, ()  # (one pass, as _Map)
        return zip(*args) if args else iter(())


def _list(it: Any = ()) -> list[Any]:
    """``list(map(ChunkStorageMetadata, offsets, sizes))`` as a ``ChunkList`` of its columns,
    whose chunk objects are built when it is first used as a list (``chunk_list``), any
    other as ``list`` makes it."""
    if not (isinstance(it, _Map) and it.of(ChunkStorageMetadata, 2)):
        return list(it)
    offsets, sizes = it.cols
    it.cols = ()  # (used up, as by a pass over it)
    # Copies: the pickle refers to one column from every tensor of equal ones (_Same),
    # and a ChunkList's columns are its own to append to (the values stay the very
    # objects: store._layouts knows a layout by them).
    return chunk_list(list(offsets), list(sizes))


def _dict(it: Any = ()) -> Any:
    """``dict(zip(map(MetadataIndex, ...), map(_StorageInfo, ...)))`` as a ``StorageIndex``
    (where its columns are of one length: else as DCP would read it), any other as ``dict``
    makes it."""
    if isinstance(it, _Zip) and len(it.args) == 2 and all(isinstance(a, _Map) for a in it.args):
        keys, infos = it.args
        columns = keys.of(MetadataIndex, 2, 3) and infos.of(_StorageInfo, 3, 4)
        if columns and len({len(c) for c in keys.cols + infos.cols}) == 1:
            return _index(keys.cols, infos.cols)
    return dict(it)


def _index(keys: tuple[list[Any], ...], infos: tuple[list[Any], ...]) -> StorageIndex:
    """(An index twice, which a save never writes, is found by ``StorageIndex.align`` or
    ``unique``, which the checks call: then it is kept once, as DCP's dict keeps it.)"""
    fqns, offsets, *hints = keys
    if not _offsets_fine(offsets):  # (as MetadataIndex makes them)
        offsets = [None if o is None else torch.Size(o) for o in offsets]
    paths, starts, lengths, *how = infos
    return StorageIndex(fqns, offsets, paths, starts, lengths, *(hints or [None]), *how)


def _offsets_fine(offsets: list[Any]) -> bool:
    """Whether every offset is None, a torch.Size, or a tuple of ints (which equals the
    torch.Size MetadataIndex would make of it: a save's, ``Written``)."""
    types = set(map(type, offsets))
    if not types <= {torch.Size, tuple, type(None)}:
        return False
    if tuple not in types:
        return True
    # (the values of all at once: None and the empty ones, which hold none, left out)
    return set(map(type, itertools.chain.from_iterable(filter(None, offsets)))) <= {int}


def packed_builtins() -> dict[str, Any]:
    """What the metadata's unpickler resolves ``builtins.<name>`` to, for the columns."""
    return {"map": _Map, "zip": _Zip, "list": _list, "dict": _dict}
