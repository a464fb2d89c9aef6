"""DCP's ``.metadata`` pickled in columns, and its stored items kept as columns in memory.

DCP pickles its ``Metadata`` with one object per chunk and per stored item, each with its state
as a dict of its own: at 2,048 ranks of an 8B model, 1.3 million of each, 22 s to write and
16 s to read and check. Here (``dump_metadata``) a tensor's chunks are pickled as
``list(map(ChunkStorageMetadata, offsets, sizes))`` and the stored items as
``dict(zip(map(MetadataIndex, fqns, offsets), map(_StorageInfo, paths, starts, lengths)))``:
columns, every equal size, offset and name stored once. Plain ``pickle.load`` (DCP's own
``FileSystemReader``, which unpickles with no restriction) builds the very objects DCP's pickle
holds from it; nothing else changes in the file.

Read here, the stored items stay columns: ``StorageIndex``, a mapping from DCP index to
``_StorageInfo`` that builds an item when asked, and whose columns the checks of ``_metadata``
and ``_chunks`` run over in C (maps, one sort). A rank's write results travel to rank 0 as
such columns too (``Written``).
"""

from __future__ import annotations

import copyreg
import io
import itertools
import operator
import pickle
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

__all__ = ["StorageIndex", "Written", "dump_metadata", "metadata_bytes", "packed_builtins"]

PROTOCOL = 4  # (DCP's own: pickle's default from Python 3.8 to 3.13)
_NONES = itertools.repeat(None)
_INDEX, _DATA = operator.attrgetter("index"), operator.attrgetter("storage_data")
_OFFSETS, _SIZES = operator.attrgetter("offsets"), operator.attrgetter("sizes")
_SIZE_TYPES = {torch.Size, type(None)}
_OFFSET_TYPES = {*_SIZE_TYPES, tuple}  # (a rank's results: Written)


def _columns(objs: list[Any], fields: tuple[str, ...]) -> list[list[Any]]:
    """The objects' fields, a list each (None for one an object lacks: a crafted file's)."""
    try:  # (one pass: each object's fields at one visit)
        return list(map(list, zip(*map(operator.attrgetter(*fields), objs)))) or [[]] * len(fields)
    except AttributeError:
        return [list(map(getattr, objs, itertools.repeat(f), _NONES)) for f in fields]


_KEY_FIELDS = ("fqn", "offset", "index")  # MetadataIndex's
_INFO_FIELDS = ("relative_path", "offset", "length", "transform_descriptors")  # _StorageInfo's
_FIELDS = tuple(f"index.{f}" for f in _KEY_FIELDS) + tuple(
    f"storage_data.{f}" for f in _INFO_FIELDS
)  # a WriteResult's, in StorageIndex's order


def _all_none(col: list[Any]) -> bool:
    return col.count(None) == len(col)


class StorageIndex(MutableMapping):
    """``Metadata.storage_data`` as columns, one row per stored item: its DCP index (``fqns``,
    ``offsets``, ``hints``: ``MetadataIndex``'s fields) and where it is stored (``paths``,
    ``starts``, ``lengths``, ``how``: ``_StorageInfo``'s). Looked up as DCP's dict is (by
    name and offset, never the hint); each item is built when asked. Rows are unique."""

    __slots__ = ("_rows", "fqns", "hints", "how", "lengths", "offsets", "paths", "starts")

    def __init__(
        self,
        fqns: list[Any],
        offsets: list[Any],
        paths: list[Any],
        starts: list[Any],
        lengths: list[Any],
        hints: list[Any] | None = None,
        how: list[Any] | None = None,
    ) -> None:
        self.fqns, self.offsets, self.hints = fqns, offsets, hints
        self.paths, self.starts, self.lengths, self.how = paths, starts, lengths, how
        self._rows: dict[tuple[Any, Any], int] | None = None

    @classmethod
    def of_items(cls, keys: list[Any], infos: list[Any]) -> StorageIndex:
        """From unique DCP indexes and their ``_StorageInfo``s, in order (a dict's items)."""
        return cls._of(_columns(keys, _KEY_FIELDS) + _columns(infos, _INFO_FIELDS))

    @classmethod
    def of_results(cls, results: Iterable[Any]) -> StorageIndex:
        """From every rank's write results (a ``Written``, or DCP's list of WriteResults), in
        order. (DCP's ``finish`` makes a dict of them, where a later result of an index
        replaces the earlier; none does after the global plan's checks. Pickled, these
        columns load as that dict all the same.)"""
        parts = [r.cols if isinstance(r, Written) else Written.of(r).cols for r in results]
        return cls._of([list(itertools.chain.from_iterable(c)) for c in zip(*parts)])

    @classmethod
    def _of(cls, cols: list[list[Any]]) -> StorageIndex:
        fqns, offsets, hints, paths, starts, lengths, how = cols or [[]] * len(_FIELDS)
        hints = None if _all_none(hints) else hints
        return cls(fqns, offsets, paths, starts, lengths, hints, None if _all_none(how) else how)

    def rows(self) -> dict[tuple[Any, Any], int]:
        """(name, offset) -> row: what DCP's dict hashes and compares an index by."""
        if self._rows is None:
            self._rows = dict(zip(zip(self.fqns, self.offsets), range(len(self.fqns))))
        return self._rows

    def info(self, row: int) -> _StorageInfo:
        how = None if self.how is None else self.how[row]
        return _StorageInfo(self.paths[row], self.starts[row], self.lengths[row], how)

    def __getitem__(self, key: Any) -> _StorageInfo:
        if key.__class__ is not MetadataIndex:  # (a dataclass equals only its own class)
            raise KeyError(key)
        return self.info(self.rows()[(key.fqn, key.offset)])

    def __iter__(self) -> Iterator[MetadataIndex]:
        return map(MetadataIndex, self.fqns, self.offsets, self.hints or _NONES)

    def __len__(self) -> int:
        return len(self.fqns)

    def values(self) -> list[_StorageInfo]:  # type: ignore[override]
        return list(map(_StorageInfo, self.paths, self.starts, self.lengths, self.how or _NONES))

    def items(self) -> list[tuple[MetadataIndex, _StorageInfo]]:  # type: ignore[override]
        return list(zip(self, self.values()))

    def __repr__(self) -> str:
        return f"StorageIndex({len(self)} stored items)"

    def __setitem__(self, key: MetadataIndex, info: Any) -> None:
        """(An edit, rare: a crafted step's, in tests.) The item of ``key`` replaced, or added."""
        if key.__class__ is not MetadataIndex:
            raise TypeError(
                f"a DCP metadata's stored items are keyed by MetadataIndex, not {key!r}"
            )
        row = self.rows().get((key.fqn, key.offset))
        if row is None:  # (a new key; a dict keeps an old key's object, and its hint)
            row = len(self.fqns)
            for col in self._all_columns():
                col.append(None)
            self.rows()[(key.fqn, key.offset)] = row
            self.hints = self.hints or [None] * len(self.fqns)
            self.fqns[row], self.offsets[row], self.hints[row] = key.fqn, key.offset, key.index
        self.how = self.how or [None] * len(self.fqns)
        self.paths[row], self.starts[row], self.lengths[row] = (
            info.relative_path,
            info.offset,
            info.length,
        )
        self.how[row] = getattr(info, "transform_descriptors", None)

    def __delitem__(self, key: MetadataIndex) -> None:
        if key.__class__ is not MetadataIndex:
            raise KeyError(key)
        row = self.rows()[(key.fqn, key.offset)]
        for col in self._all_columns():
            del col[row]
        self._rows = None

    def _all_columns(self) -> list[list[Any]]:
        cols = [self.fqns, self.offsets, self.paths, self.starts, self.lengths]
        return cols + [c for c in (self.hints, self.how) if c is not None]

    def __reduce__(self) -> tuple[Any, ...]:
        # As DCP's dict (plain pickle.load makes one of it; store's unpickler, this class)
        return self.pickled(self.fqns, self.offsets, self.paths)

    def pickled(self, fqns: list[Any], offsets: list[Any], paths: list[Any]) -> tuple[Any, ...]:
        """``__reduce__``, these columns (equal to the index's) in place of its own."""
        keys = [fqns, offsets] + ([] if self.hints is None else [self.hints])
        infos = [paths, self.starts, self.lengths] + ([] if self.how is None else [self.how])
        pairs = _Call(zip, _Call(map, MetadataIndex, *keys), _Call(map, _StorageInfo, *infos))
        return (dict, (pairs,))


# ---------------------------------------------------------------------- writing
class Written:
    """One rank's write results as ``StorageIndex``'s columns: what its writer hands DCP, which
    gathers every rank's to rank 0 (pickled: lists of names and numbers, where DCP's own
    WriteResults are three objects an item, a second of rank 0's time per 300,000 items)."""

    __slots__ = ("cols",)

    def __init__(self, cols: list[list[Any]]) -> None:
        self.cols = cols

    @classmethod
    def of(cls, results: list[Any]) -> Written:
        wrs = list(results)
        try:  # (one pass: each result's fields at one visit)
            cols = list(map(list, zip(*map(operator.attrgetter(*_FIELDS), wrs))))
        except AttributeError:  # (a result of its own kind: its fields one by one)
            cols = _columns(list(map(_INDEX, wrs)), _KEY_FIELDS)
            cols += _columns(list(map(_DATA, wrs)), _INFO_FIELDS)
        cols = cols or [[] for _ in _FIELDS]
        # Offsets as plain tuples (equal to their torch.Size): the collector stops tracking
        # those of ints, where a million torch.Size, received at once, make it walk every
        # object of rank 0's process again and again (0.4 s of 0.41 s, 256 ranks).
        cols[1] = [o if o is None else tuple(o) for o in cols[1]]
        return cls(cols)

    def __len__(self) -> int:
        return len(self.cols[0])

    def __reduce__(self) -> tuple[Any, ...]:
        return (Written, (self.cols,))


class _Call:
    """``fn(*args)``, pickled as that call (REDUCE)."""

    __slots__ = ("args", "fn")

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


class _Pickler(pickle.Pickler):
    """DCP's Metadata with its chunks and stored items as columns (the module docstring). A
    stored item's offset becomes the object of its chunk's equal offset, and its name the
    state dict's key, so that the pickle stores each once. (Equal chunk sizes and offsets are
    one object already where the global plan made them: ``_dcp.global_plan``.)"""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream, protocol=PROTOCOL)
        self._offsets: dict[Any, Any] = {}  # the chunks' offsets, by value
        self.dispatch_table = copyreg.dispatch_table.copy()
        self.dispatch_table.update({Metadata: self._metadata, TensorStorageMetadata: self._tensor})

    def _metadata(self, md: Metadata) -> tuple[Any, ...]:
        state = dict(md.__dict__)
        items = state.get("storage_data")
        if _dcp_items(items):  # (a dict of DCP's own: the same columns)
            items = StorageIndex.of_items(list(items), list(items.values()))
        if isinstance(items, StorageIndex):  # (pickled after the chunks: state's order)
            state["storage_data"] = _Items(self, items, md.state_dict_metadata or {})
        return (copyreg.__newobj__, (Metadata,), state)

    def _tensor(self, meta: TensorStorageMetadata) -> tuple[Any, ...]:
        state = dict(meta.__dict__)
        chunks = state.get("chunks")
        if type(chunks) is list and chunks and set(map(type, chunks)) == {ChunkStorageMetadata}:
            offsets = list(map(_OFFSETS, chunks))
            if set(map(type, offsets)) == {torch.Size}:
                offsets = list(map(self._offsets.setdefault, offsets, offsets))
            sizes = list(map(_SIZES, chunks))
            state["chunks"] = _Call(list, _Call(map, ChunkStorageMetadata, offsets, sizes))
        return (copyreg.__newobj__, (TensorStorageMetadata,), state)


def _dcp_items(items: Any) -> bool:
    """Whether ``items`` is DCP's dict of stored items, every key and value of its classes."""
    if type(items) is not dict or not items or set(map(type, items)) != {MetadataIndex}:
        return False
    return set(map(type, items.values())) == {_StorageInfo}


class _Items:
    """A ``StorageIndex`` to pickle, its names and offsets those of the state dict's keys and
    chunks (``_Pickler``), once the chunks are pickled."""

    def __init__(self, pickler: _Pickler, items: StorageIndex, keys: Any) -> None:
        self.pickler, self.items, self.keys = pickler, items, keys

    def __reduce__(self) -> tuple[Any, ...]:
        items, names = self.items, {k: k for k in self.keys}
        fqns = list(map(names.get, items.fqns, items.fqns))
        offsets = items.offsets
        if set(map(type, offsets)) <= _OFFSET_TYPES:  # (a tuple equals the torch.Size of it)
            offsets = list(map(self.pickler._offsets.get, offsets, offsets))
        paths = list(map(names.setdefault, items.paths, items.paths))
        return items.pickled(fqns, offsets, paths)


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
        return map(self.fn, *self.cols)

    def of(self, fn: Any, *arity: int) -> bool:
        return self.fn is fn and len(self.cols) in arity and all(type(c) is list for c in self.cols)


class _Zip:
    __slots__ = ("args",)

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __iter__(self) -> Iterator[Any]:
        return zip(*self.args)


def _dict(it: Any = ()) -> Any:
    """``dict(zip(map(MetadataIndex, ...), map(_StorageInfo, ...)))`` as a ``StorageIndex``
    (where its columns are of one length and its indexes unique: else as DCP would read it),
    any other as ``dict`` makes it."""
    if isinstance(it, _Zip) and len(it.args) == 2 and all(isinstance(a, _Map) for a in it.args):
        keys, infos = it.args
        columns = keys.of(MetadataIndex, 2, 3) and infos.of(_StorageInfo, 3, 4)
        if columns and len({len(c) for c in keys.cols + infos.cols}) == 1:
            index = _index(keys.cols, infos.cols)
            if index is not None:
                return index
    return dict(it)


def _index(keys: tuple[list[Any], ...], infos: tuple[list[Any], ...]) -> StorageIndex | None:
    fqns, offsets, *hints = keys
    if not set(map(type, offsets)) <= _SIZE_TYPES:  # (as MetadataIndex makes them)
        offsets = [None if o is None else torch.Size(o) for o in offsets]
    paths, starts, lengths, *how = infos
    index = StorageIndex(fqns, offsets, paths, starts, lengths, *(hints or [None]), *how)
    if len(index.rows()) != len(fqns):
        return None  # (an index twice: DCP's dict keeps the last)
    return index


def packed_builtins() -> dict[str, Any]:
    """What the metadata's unpickler resolves ``builtins.<name>`` to, for the columns."""
    return {"map": _Map, "zip": _Zip, "list": list, "dict": _dict}
