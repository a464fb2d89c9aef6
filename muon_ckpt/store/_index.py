"""A DCP metadata's stored items as columns (``StorageIndex``), and one rank's write results
as the same columns (``Written``).

DCP keeps them as a dict from ``MetadataIndex`` to ``_StorageInfo``: three objects an item,
1.3 million items at 2,048 ranks of an 8B model, which rank 0 builds, pickles and checks, and
every rank unpickles. Here they are seven lists, one row per item, in the order the ranks
wrote them (rank by rank, file by file, each file's items in the order of their bytes): the
checks run over them in C (maps, slices, sorts), and an item is built only when asked for.
``align`` finds every key's rows with one sort (a tensor's in the order of its chunks, where
its ranks wrote them so); then a chunk's row is found by DCP's index hint (its place among
the tensor's chunks), else by a dict of (name, offset), which DCP's own dict hashes and
compares by.
"""

from __future__ import annotations

import collections
import itertools
import operator
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from muon_ckpt.store._chunklist import ChunkList

__all__ = [
    "Call",
    "Gathered",
    "Listed",
    "StorageIndex",
    "Written",
    "pickled_items",
]

_NONES = itertools.repeat(None)
_drain = collections.deque(maxlen=0).extend  # (runs a map in C, keeps nothing)
_INDEX, _DATA = operator.attrgetter("index"), operator.attrgetter("storage_data")
_OFFSETS, _SIZES = operator.attrgetter("offsets"), operator.attrgetter("sizes")
_COLS = operator.attrgetter("cols")
_KEY_FIELDS = ("fqn", "offset", "index")  # MetadataIndex's
_INFO_FIELDS = ("relative_path", "offset", "length", "transform_descriptors")  # _StorageInfo's
_FIELDS = tuple(f"index.{f}" for f in _KEY_FIELDS) + tuple(
    f"storage_data.{f}" for f in _INFO_FIELDS
)  # a WriteResult's, in StorageIndex's order
_HINTS, _HOW = _FIELDS.index("index.index"), _FIELDS.index("storage_data.transform_descriptors")


def _columns(objs: list[Any], fields: tuple[str, ...]) -> list[list[Any]]:
    """The objects' fields, a list each (None for one an object lacks: a crafted file's)."""
    try:  # (one pass: each object's fields at one visit)
        return list(map(list, zip(*map(operator.attrgetter(*fields), objs)))) or [[]] * len(fields)
    except AttributeError:
        return [list(map(getattr, objs, itertools.repeat(f), _NONES)) for f in fields]


def _all_none(col: list[Any]) -> bool:
    return col.count(None) == len(col)


class StorageIndex(MutableMapping):
    """``Metadata.storage_data`` as columns, one row per stored item: its DCP index (``fqns``,
    ``offsets``, ``hints``: ``MetadataIndex``'s fields) and where it is stored (``paths``,
    ``starts``, ``lengths``, ``how``: ``_StorageInfo``'s). Looked up as DCP's dict is (by
    name and offset; the hint only finds the row faster); each item is built when asked."""

    __slots__ = (
        "_groups",
        "_rows",
        "fqns",
        "hints",
        "how",
        "lengths",
        "offsets",
        "paths",
        "starts",
    )

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
        self._groups: dict[Any, Any] | None = None  # key -> its rows (``align``)

    @classmethod
    def of_items(cls, keys: list[Any], infos: list[Any]) -> StorageIndex:
        """From unique DCP indexes and their ``_StorageInfo``s, in order (a dict's items)."""
        return cls.of_columns(_columns(keys, _KEY_FIELDS) + _columns(infos, _INFO_FIELDS))

    @classmethod
    def of_columns(cls, cols: list[list[Any]]) -> StorageIndex:
        """From the seven columns in ``_FIELDS``' order (hints and ``how`` of None dropped)."""
        fqns, offsets, hints, paths, starts, lengths, how = cols or [[]] * len(_FIELDS)
        hints = None if _all_none(hints) else hints
        return cls(fqns, offsets, paths, starts, lengths, hints, None if _all_none(how) else how)

    def columns(self) -> list[list[Any]]:
        """The seven columns in ``_FIELDS``' order."""
        n = len(self.fqns)
        hints, how = self.hints or [None] * n, self.how or [None] * n
        return [self.fqns, self.offsets, hints, self.paths, self.starts, self.lengths, how]

    # ------------------------------------------------------------------ finding rows
    def rows(self) -> dict[tuple[Any, Any], int]:
        """(name, offset) -> row: what DCP's dict hashes and compares an index by (a later
        row of the same index wins, as in a dict: ``unique`` drops the earlier)."""
        if self._rows is None:
            self._rows = dict(zip(zip(self.fqns, self.offsets), range(len(self.fqns))))
        return self._rows

    def align(self, state: dict[str, Any]) -> bool:
        """Whether every row is one of ``state``'s keys' (its state dict's) items: an object's
        one, of offset None; a tensor's one per chunk, at the chunk's offset (distinct), found
        in the order of its chunks when the rows are taken in turn (the ranks' order, which
        is the chunks', ``save._global``). Then every index is unique, ``group`` gives a
        key's rows, and each row's offset is its chunk's own object."""
        # Each row into its key's bucket in one pass in C (the rows' order kept): a sort of
        # a million rows by key took most of this
        buckets: dict[Any, list[int]] = {k: [] for k in state}
        n = len(self.fqns)
        try:
            _drain(map(list.append, map(buckets.__getitem__, self.fqns), range(n)))
        except (KeyError, TypeError):  # (a name of no state dict, or unhashable)
            return False
        offsets = self.offsets
        fresh: list[Any] = [None] * n
        try:
            for key, meta in state.items():
                rows = buckets[key]
                got = list(map(offsets.__getitem__, rows))
                if type(meta) is TensorStorageMetadata and isinstance(meta.chunks, list):
                    chunks = meta.chunks
                    cols = chunks.columns() if isinstance(chunks, ChunkList) else None
                    want = cols[0] if cols else list(map(_OFFSETS, chunks))
                    if got != want or (len(want) > 1 and len(set(want)) != len(want)):
                        return False
                    _drain(map(fresh.__setitem__, rows, want))
                elif type(meta) is not BytesStorageMetadata or got != [None]:
                    return False
        except (AttributeError, TypeError):  # (a crafted chunk: the checks name it)
            return False
        self.matched(fresh)
        self._groups = buckets
        return True

    def matched(self, offsets: list[Any]) -> None:
        """The rows' offsets replaced by equal objects (their chunks' own, ``_layouts``): a
        million tuples go now, not at the collector's next walk, and the decision's pickle
        stores each offset once. Every index is unique (no ``group`` is known)."""
        self.offsets, self._rows, self._groups = offsets, None, None

    def group(self, key: Any) -> Any:
        """The rows of ``key``'s items (a tensor's in the order of its chunks), where ``align``
        found them; else None."""
        return None if self._groups is None else self._groups.get(key)

    def row(self, fqn: Any, offset: Any, hint: Any = None) -> int | None:
        """The row of the item of index (``fqn``, ``offset``), None if there is none; ``hint``:
        DCP's, the place of the chunk among its tensor's. Where ``align`` found the rows,
        among the name's rows only (by the hint first), and no dict is built."""
        if self._groups is None:
            return self.rows().get((fqn, offset))
        rows = self._groups.get(fqn)
        if rows is None:
            return None
        if type(hint) is int and 0 <= hint < len(rows) and self.offsets[rows[hint]] == offset:
            return rows[hint]
        return next((r for r in rows if self.offsets[r] == offset), None)

    def unique(self) -> None:
        """Each index in one row, as DCP's dict holds them: at its first row, with the hint
        of its first and the item of its last (a crafted file's; a save writes each once)."""
        rows = self.rows()
        if len(rows) == len(self.fqns):
            return
        keys = list(zip(self.fqns, self.offsets))
        first = sorted(dict(zip(reversed(keys), range(len(keys) - 1, -1, -1))).values())
        last = [rows[keys[f]] for f in first]
        cols = self.columns()
        cols = [list(map(c.__getitem__, first)) for c in cols[:3]] + [
            list(map(c.__getitem__, last)) for c in cols[3:]
        ]
        fresh = StorageIndex.of_columns(cols)
        for name in self.__slots__:
            setattr(self, name, getattr(fresh, name))  # (its rows and groups: not known yet)

    # ------------------------------------------------------------------ a mapping
    def info(self, row: int) -> _StorageInfo:
        how = None if self.how is None else self.how[row]
        return _StorageInfo(self.paths[row], self.starts[row], self.lengths[row], how)

    def __getitem__(self, key: Any) -> _StorageInfo:
        if key.__class__ is not MetadataIndex:  # (a dataclass equals only its own class)
            raise KeyError(key)
        row = self.row(key.fqn, key.offset, key.index)
        if row is None:
            raise KeyError(key)
        return self.info(row)

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
        self._groups = None
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
        self._rows = self._groups = None

    def _all_columns(self) -> list[list[Any]]:
        cols = [self.fqns, self.offsets, self.paths, self.starts, self.lengths]
        return cols + [c for c in (self.hints, self.how) if c is not None]

    def __reduce__(self) -> tuple[Any, ...]:
        # As DCP's dict (plain pickle.load makes one of it; store's unpickler, this class)
        return pickled_items(self.columns())


class Call:
    """``fn(*args)``, pickled as that call (REDUCE)."""

    __slots__ = ("args", "fn")

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


class Listed:
    """A list of the values ``it`` yields, pickled as ``list()`` and its values appended (the
    pickle's APPENDS, as for a list), taken from ``it`` as they are written: no list made."""

    __slots__ = ("it",)

    def __init__(self, it: Iterable[Any]) -> None:
        self.it = it

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (), None, iter(self.it))


def pickled_items(cols: list[Any]) -> tuple[Any, ...]:
    """What pickles stored items (``StorageIndex.columns``, or ``Gathered.columns``: None for
    hints or storage transforms that no item has) as DCP's dict of them:
    ``dict(zip(map(MetadataIndex, ...), map(_StorageInfo, ...)))``, hints and storage
    transforms only where some item has them."""
    fqns, offsets, hints, paths, starts, lengths, how = cols
    keys = [fqns, offsets] + ([] if _none(hints) else [hints])
    infos = [paths, starts, lengths] + ([] if _none(how) else [how])
    return (dict, (Call(zip, Call(map, MetadataIndex, *keys), Call(map, _StorageInfo, *infos)),))


def _none(col: Any) -> bool:
    return col is None or (type(col) is list and _all_none(col))


class Gathered:
    """Every rank's write results (a ``Written`` each, or DCP's list of WriteResults), as DCP
    gathers them to rank 0 for its finish: the stored items of the step, in order, whose
    ``.metadata`` pickle (``store.dump_metadata``) reads each column as the ranks' one after
    the other, in C, and never makes it one list of a million rows (``StorageIndex`` would:
    seven of them, every row's objects touched to make them and again to free them). (DCP's
    finish makes a dict of them, where a later result of an index replaces the earlier; none
    does after the global plan's checks. Pickled, these columns load as that dict all the
    same.)"""

    __slots__ = ("parts",)

    def __init__(self, results: Iterable[Any]) -> None:
        results = list(results)
        if set(map(type, results)) - {Written}:  # (DCP's own list of WriteResults: as Written)
            results = [r if isinstance(r, Written) else Written.of(r) for r in results]
        self.parts: list[list[list[Any]]] = list(map(_COLS, results))

    def column(self, k: int) -> Iterator[Any]:
        """Column ``k`` (``_FIELDS``' order) of every rank's, one after the other."""
        return itertools.chain.from_iterable(map(operator.itemgetter(k), self.parts))

    def columns(self) -> list[Any]:
        """The seven columns, each an iterable run once; hints and storage transforms None
        where no item has one."""
        cols: list[Any] = list(map(self.column, range(len(_FIELDS))))
        for k in (_HINTS, _HOW):
            parts = list(map(operator.itemgetter(k), self.parts))
            if sum(map(list.count, parts, _NONES)) == sum(map(len, parts)):
                cols[k] = None
        return cols

    def compressed(self) -> bool:
        """Whether some item is stored with a storage transform (compressed)."""
        return any(self.column(_HOW))


class Written:
    """One rank's write results as ``StorageIndex``'s columns, in the order it wrote them: what
    its writer hands DCP, which gathers every rank's to rank 0 (pickled: lists of names and
    numbers, where DCP's own WriteResults are three objects an item, a second of rank 0's
    time per 300,000 items)."""

    __slots__ = ("cols",)

    def __init__(self, cols: list[list[Any]]) -> None:
        self.cols = cols

    @classmethod
    def of(cls, results: Iterable[Any]) -> Written:
        wrs = list(results)
        try:  # (one pass: each result's fields at one visit)
            cols = list(map(list, zip(*map(operator.attrgetter(*_FIELDS), wrs))))
        except AttributeError:  # (a result of its own kind: its fields one by one)
            cols = _columns(list(map(_INDEX, wrs)), _KEY_FIELDS)
            cols += _columns(list(map(_DATA, wrs)), _INFO_FIELDS)
        cols = cols or [[] for _ in _FIELDS]
        # Offsets as plain tuples (equal to their torch.Size; pickled, MetadataIndex makes them
        # one): the collector stops tracking those of ints, where a million torch.Size,
        # received at once, make it walk every object of rank 0's process again and again
        # (0.4 s of 0.41 s, 256 ranks).
        cols[1] = [o if o is None else tuple(o) for o in cols[1]]
        return cls(cols)

    def __len__(self) -> int:
        return len(self.cols[0])

    def __reduce__(self) -> tuple[Any, ...]:
        return (Written, (self.cols,))
