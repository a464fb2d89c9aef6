"""A tensor's chunks as DCP's list of ``ChunkStorageMetadata`` with their offsets and sizes as
columns beside them (``ChunkList``), and one whose chunk objects are built at its first use as a
list (``chunk_list``): a save's global plan and a load's check of a step read the columns, and
a million chunk objects of a 2,048-rank step are made only for the tensors a reader takes whole.
"""

from __future__ import annotations

import operator
import threading
from typing import Any

from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

__all__ = ["ChunkList", "chunk_list"]

_OFFSETS, _SIZES = operator.attrgetter("offsets"), operator.attrgetter("sizes")


class ChunkList(list):
    """A tensor's chunks (DCP's list of ChunkStorageMetadata) with their offsets and sizes as
    columns beside them, as the global plan adds them (``_dcp``): its checks and the
    ``.metadata``'s pickle read these instead of a million chunks again (received rank by
    rank, they lie all over rank 0's memory: a cache miss each). ``add`` a plan's chunks of
    the tensor; pickled, a plain list."""

    __slots__ = ("exact", "offsets", "sizes")

    def __init__(self) -> None:
        super().__init__()
        self.offsets: list[Any] = []
        self.sizes: list[Any] = []
        self.exact = True  # every chunk a ChunkStorageMetadata, not of a class of its own

    def add(self, chunk: Any) -> None:
        self.append(chunk)
        self.offsets.append(chunk.offsets)
        self.sizes.append(chunk.sizes)
        self.exact = self.exact and type(chunk) is ChunkStorageMetadata

    def columns(self) -> tuple[list[Any], list[Any]] | None:
        """The chunks' offsets and sizes, while they are those of the chunks in the list."""
        if not len(self) == len(self.offsets) == len(self.sizes):
            return None
        if self and self[-1].offsets is not self.offsets[-1]:
            return None
        return self.offsets, self.sizes

    def part(self, start: int, stop: int) -> list[Any]:
        """``self[start:stop]``: what a rank's load plan reads (``load._overlap``)."""
        return self[start:stop]

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (list(self),))


_BUILDING_LOCK = threading.Lock()


class _Unbuilt(ChunkList):
    """A ``ChunkList`` as read from a ``.metadata`` (``store._packed``): its columns only, the
    chunk objects built at its first use as a list, when it becomes a ``ChunkList``. The
    checks and the decision's pickle read the columns: a million chunk objects (and the
    collector's walk over them) are made only for the tensors some reader takes chunks of."""

    __slots__ = ()

    def built(self) -> ChunkList:
        with _BUILDING_LOCK:  # (two threads' first uses build them once)
            if type(self) is _Unbuilt:
                list.extend(self, map(ChunkStorageMetadata, self.offsets, self.sizes))
                self.__class__ = ChunkList  # (from here on a list: its own methods, in C)
        return self

    def columns(self) -> tuple[list[Any], list[Any]]:
        return self.offsets, self.sizes

    def part(self, start: int, stop: int) -> list[Any]:
        return list(map(ChunkStorageMetadata, self.offsets[start:stop], self.sizes[start:stop]))

    def __len__(self) -> int:
        return len(self.offsets)

    def __radd__(self, other: Any) -> Any:
        return other + self.built()


def _building(name: str) -> Any:
    def method(self: _Unbuilt, *args: Any, **kwargs: Any) -> Any:
        # (_Unbuilt's: another use may have built it since this method was looked up)
        return getattr(_Unbuilt.built(self), name)(*args, **kwargs)

    method.__name__ = name
    return method


# Every other method of a list that reads or changes its items builds them first (C code
# that reads a list's items directly takes exact lists only: a subclass's go through these)
_BUILDING = (
    "__add__ __contains__ __delitem__ __eq__ __ge__ __getitem__ __gt__ __iadd__ __imul__ "
    "__iter__ __le__ __lt__ __mul__ __ne__ __repr__ __reversed__ __rmul__ __setitem__ "
    "__sizeof__ append clear copy count extend index insert pop remove reverse sort"
)
for _name in _BUILDING.split():
    setattr(_Unbuilt, _name, _building(_name))


def chunk_list(offsets: list[Any], sizes: list[Any]) -> ChunkList:
    """A tensor's chunks ``map(ChunkStorageMetadata, offsets, sizes)``, built when first used
    as a list (columns of one length; else at once, as ``map`` makes them)."""
    out = _Unbuilt()
    out.offsets, out.sizes = offsets, sizes
    return out if len(offsets) == len(sizes) else out.built()
