"""DCP's ``.metadata`` file, read without unpickling untrusted bytes.

The file is a pickle. A matching checksum proves integrity, not trust, so it goes through an
unpickler that resolves only the classes a DCP metadata file is made of; anything else is a
``CheckpointCorruptError``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import io
import itertools
import operator
import pathlib
import pickle
import types
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from muon_ckpt._errors import CheckpointCorruptError
from muon_ckpt._gcpause import paused_gc
from muon_ckpt.store._chunks import check_tensors
from muon_ckpt.store._index import StorageIndex
from muon_ckpt.store._layout import MANIFEST, METADATA, data_ref, is_file_name
from muon_ckpt.store._packed import packed_builtins

__all__ = [
    "bytes_keys",
    "check_paths",
    "check_ranges",
    "parse_metadata",
    "tensor_entries",
    "unpack_metadata",
]

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}
# (map, zip, list and dict: the columns of store._packed, calls of the classes above)
_BUILTINS = {"set": set, "frozenset": frozenset, "slice": slice, **packed_builtins()}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only what a DCP ``.metadata`` file is made of; anything else is refused.
    Pickle's BUILD sets attributes on whatever it is given, a class included: the classes
    and functions handed out are kept as they were (``undo``), and a function is handed out
    as a wrapper of its own, so a crafted file cannot change them for the process."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.handed: dict[type, dict[str, Any]] = {}

    def find_class(self, module: str, name: str) -> Any:
        obj = self._resolve(module, name)
        if isinstance(obj, type):
            self.handed.setdefault(obj, dict(vars(obj)))
        elif isinstance(obj, types.FunctionType):
            return lambda *a, **k: obj(*a, **k)
        return obj

    def undo(self) -> list[str]:
        """Put back what BUILD changed on a class handed out; their names."""
        changed = []
        for cls, was in self.handed.items():
            now = dict(vars(cls))
            if now.keys() == was.keys() and all(now[k] is v for k, v in was.items()):
                continue
            changed.append(cls.__name__)
            for k in now.keys() - was.keys():
                delattr(cls, k)
            for k, v in was.items():
                if now.get(k) is not v:
                    setattr(cls, k, v)
        return changed

    def _resolve(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES:
            obj = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(obj, type) and (
                dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
            ):
                return obj
        elif module == "torch" and name == "Size":
            return torch.Size
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        elif module == "pathlib" and name in _PATHS:
            return getattr(pathlib, name)
        elif module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        elif module == "builtins" and name in _BUILTINS:
            return _BUILTINS[name]
        raise pickle.UnpicklingError(
            f"{module}.{name} is not part of a DCP metadata file; refusing to unpickle it"
        )


def parse_metadata(data: bytes, where: str, tiles: bool = True) -> Metadata:
    """DCP metadata from its bytes, its tensors checked (``check_tensors``: chunks that tile
    each tensor, items that store what the chunks declare): every reader gets it from here."""
    # Millions of objects at thousands of ranks, none of them garbage: each collection of
    # the collector would walk them all, while they are built and while they are checked
    with paused_gc():
        md = unpack_metadata(data, where)
        if not isinstance(md.state_dict_metadata, dict):
            raise CheckpointCorruptError(f"{where}: DCP metadata without a state dict index")
        items = md.storage_data
        if isinstance(items, dict):  # (DCP's own pickle: its stored items as columns too)
            if not all(isinstance(i, MetadataIndex) for i in items):
                raise CheckpointCorruptError(
                    f"{where}: DCP metadata with a storage index of other keys"
                )
            md.storage_data = StorageIndex.of_items(list(items), list(items.values()))
        elif not isinstance(items, StorageIndex):
            raise CheckpointCorruptError(f"{where}: DCP metadata without a storage index")
        check_tensors(md, where, tiles)
    return md


def unpack_metadata(data: bytes, where: str) -> Metadata:
    """DCP metadata from its bytes, unchecked (``parse_metadata`` checks it): for a copy of
    what was checked (a load's decision, sent by rank 0)."""
    with paused_gc():
        unpickler = _MetadataUnpickler(io.BytesIO(data))
        try:
            md = unpickler.load()
        except Exception as e:
            raise CheckpointCorruptError(
                f"{where}: DCP metadata is unreadable ({type(e).__name__}: {e})"
            ) from e
        finally:
            changed = unpickler.undo()
    if changed:
        raise CheckpointCorruptError(
            f"{where}: DCP metadata that sets attributes of {', '.join(changed)} (a crafted "
            "file; they were put back): load another step or restore this file"
        )
    if not isinstance(md, Metadata):
        raise CheckpointCorruptError(f"{where}: not DCP metadata (found {type(md).__name__})")
    return md


def check_paths(md: Metadata, allowed: set[str] | None, where: str) -> None:
    """Every file the metadata points DCP at must be a plain name inside the checkpoint's
    directory or, in a step of format 3, a file of the run's data (``../data/<dir>/<file>``),
    and, with a manifest, one it lists (``allowed``): a crafted ``.metadata`` must not send a
    load, export or import to ``../x``, ``/other/bucket/x`` or an unlisted, unchecksummed
    file."""
    paths = md.storage_data.paths
    names = dict.fromkeys(paths) if set(map(type, paths)) <= {str} else paths  # (each once)
    for name in names:
        plain = is_file_name(name) and name not in (MANIFEST, METADATA)
        ok = plain or (allowed is not None and data_ref(name) is not None)
        if ok and allowed is not None and name not in allowed:
            raise CheckpointCorruptError(
                f"{where}: refers to the file {name!r}, which the manifest does not list; the "
                "step was not written by one save and cannot be trusted. Load another step"
            )
        if not ok:
            raise CheckpointCorruptError(
                f"{where}: refers to the file {str(name)[:200]!r}, outside the checkpoint's "
                "directory (a checkpoint refers to plain file names beside its .metadata "
                "only); it cannot be trusted and is not read. Load another step"
            )


def check_ranges(md: Metadata, sizes: dict[str, int], where: str) -> None:
    """Every stored item the metadata points at lies inside its file's ``sizes`` (the
    manifest's), and no two items share a byte: a crafted ``.metadata`` must not make a reader
    allocate or seek past a file (a length of a terabyte is a MemoryError, not a corrupt step,
    otherwise), nor read (and expand) the same bytes as many items."""
    index: StorageIndex = md.storage_data
    if _ranges_fine(index, sizes):
        return
    by_file: dict[str, list[tuple[int, int]]] = {}  # (one by one, to name the first bad one)
    for name, off, n in zip(index.paths, index.starts, index.lengths):
        size = sizes.get(name, 0)
        if not (type(off) is int and type(n) is int and off >= 0 and n >= 0 and off + n <= size):
            raise CheckpointCorruptError(
                f"{where}: points at bytes {off}+{n} of {name!r}, which has {size} bytes (the "
                "manifest's size); it cannot be trusted and is not read. Load another step"
            )
        by_file.setdefault(name, []).append((off, off + n))
    for name, spans in by_file.items():
        spans.sort()
        for (a, b), (c, d) in itertools.pairwise(spans):
            if c < b:
                raise CheckpointCorruptError(
                    f"{where}: its items at bytes {a}-{b} and {c}-{d} of {name!r} overlap (a "
                    "save stores each item once); it cannot be trusted and is not read. Load "
                    "another step"
                )


def _ranges_fine(index: StorageIndex, sizes: dict[str, int]) -> bool:
    """``check_ranges`` for all items at once, in C (maps over the columns): the million
    items of a 2,048-rank step. False for anything wrong or odd, which the loop then names."""
    names, offsets, lengths = index.paths, index.starts, index.lengths
    if not names:
        return True
    if set(map(type, offsets)) | set(map(type, lengths)) != {int}:
        return False
    if set(map(type, names)) != {str} or min(lengths) < 0:
        return False
    ends = list(map(operator.add, offsets, lengths))
    # As a save lists them (file by file, each file's items in the order of their bytes),
    # each file's items are one run of rows in which each item ends where or before the
    # next begins: then they lie apart, and inside the file from the run's first start to
    # its last end. One pass compares each item with the next, with no sort nor a line of
    # big integers; any other order goes through the sort.
    n = len(names)
    cuts = list(itertools.compress(range(1, n), map(operator.ne, names, names[1:])))
    heads, tails = [0, *cuts], [*cuts, n]
    if len(set(map(names.__getitem__, heads))) != len(heads):  # (a file in two runs)
        return _ranges_sorted(names, offsets, ends, sizes)
    apart = list(map(operator.le, ends[:-1], offsets[1:]))
    for c in cuts:  # (the last item of a file and the first of the next: no pair)
        apart[c - 1] = True
    if False in apart:
        return _ranges_sorted(names, offsets, ends, sizes)
    if min(map(offsets.__getitem__, heads)) < 0:
        return False
    files = map(sizes.get, map(names.__getitem__, heads), itertools.repeat(0))
    return all(map(operator.le, map(ends.__getitem__, [t - 1 for t in tails]), files))


def _ranges_sorted(
    names: list[str], offsets: list[int], ends: list[int], sizes: dict[str, int]
) -> bool:
    """``_ranges_fine`` for items in any order (plain ints, lengths not negative): each
    file's items in one line of integers, file k's offsets plus k * 2**64 (an item's end is
    below 2**64: inside a file of at most 2**63 bytes), sorted by where they start."""
    if min(offsets) < 0:
        return False
    if not all(map(operator.le, ends, map(sizes.get, names, itertools.repeat(0)))):
        return False
    base = {name: k << 64 for k, name in enumerate(dict.fromkeys(names))}
    at = list(map(base.__getitem__, names))
    starts = list(map(operator.add, at, offsets))
    ends = list(map(operator.add, at, ends))
    order = sorted(range(len(starts)), key=starts.__getitem__)
    starts, ends = list(map(starts.__getitem__, order)), list(map(ends.__getitem__, order))
    return all(map(operator.le, ends[:-1], starts[1:]))


def tensor_entries(md: Metadata) -> dict[str, TensorStorageMetadata]:
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def bytes_keys(md: Metadata) -> list[str]:
    return [k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
