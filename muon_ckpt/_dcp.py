"""Reading DCP checkpoints without unpickling untrusted bytes, in one process, local or remote.

DCP's ``.metadata`` is a pickle and DCP loads non-tensor values with
``torch.load(weights_only=False)``. Here the metadata goes through an unpickler that only
resolves the classes a DCP metadata file is made of, and non-tensor values through
``torch.load(weights_only=True)``; tensors are read by DCP itself (already ``weights_only``).
Every load uses ``no_dist=True``: no process group is needed, and on N ranks each rank reads only
the slices its (DTensor) targets ask for, with no collective.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pathlib
import pickle
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from muon_ckpt._errors import CheckpointCorruptError, CheckpointNotFoundError
from muon_ckpt._storage import Storage

__all__ = ["METADATA", "load", "open_reader", "read_metadata", "tensor_entries"]

METADATA = ".metadata"
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only what a DCP ``.metadata`` file is made of; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
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
            import collections

            return collections.OrderedDict
        elif module == "builtins" and name in ("set", "frozenset", "slice"):
            return {"set": set, "frozenset": frozenset, "slice": slice}[name]
        raise pickle.UnpicklingError(
            f"{module}.{name} is not part of a DCP metadata file; refusing to unpickle it"
        )


def _reader_class() -> type:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    class _SafeReader(FsspecReader):
        """FsspecReader whose metadata is read with the restricted unpickler."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            path = self.fs.concat_path(self.path, METADATA)
            with self.fs.create_stream(path, "rb") as f:
                data = f.read()
            md = parse_metadata(data, str(path))
            if getattr(md, "storage_meta", None) is not None:
                md.storage_meta.load_id = self.load_id
            return md

    return _SafeReader


def parse_metadata(data: bytes, where: str) -> Metadata:
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise CheckpointCorruptError(
            f"{where}: DCP metadata is unreadable ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(md, Metadata):
        raise CheckpointCorruptError(f"{where}: not DCP metadata (found {type(md).__name__})")
    return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def open_reader(
    storage: Storage, *parts: str, storage_options: dict[str, Any] | None = None
) -> Any:
    """A DCP storage reader for the directory ``parts`` under ``storage`` (any fsspec URL);
    ``storage_options`` must be the ones ``storage`` was opened with."""
    if not storage.exists(*parts, METADATA):
        raise CheckpointNotFoundError(
            f"{storage.url_of(*parts)!r} has no DCP {METADATA} file: not a DCP checkpoint"
        )
    url = storage.url_of(*parts)
    return _reader_class()(url, **(storage_options or {}))


def read_metadata(storage: Storage, *parts: str) -> Metadata:
    """The DCP metadata of the directory ``parts`` (restricted unpickling)."""
    where = storage.url_of(*parts, METADATA)
    try:
        data = storage.read_bytes(*parts, METADATA)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"{where}: no DCP metadata; not a DCP checkpoint") from e
    return parse_metadata(data, where)


def tensor_entries(md: Metadata) -> dict[str, TensorStorageMetadata]:
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def bytes_keys(md: Metadata) -> list[str]:
    return [k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]


def load(state_dict: dict[str, Any], reader: Any) -> None:
    """Fill ``state_dict`` (tensors/DTensors; non-tensor keys receive values) in place.

    No process group is used, whether or not one exists: each caller reads what it asks for.
    Errors of the read are re-raised as CheckpointCorruptError naming the checkpoint.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except CheckpointException as e:
        raise CheckpointCorruptError(
            f"{reader.path}: reading the DCP checkpoint failed: {_first_failure(e)}"
        ) from e


def _first_failure(e: Exception) -> str:
    failures = getattr(e, "failures", None) or {}
    for exc in failures.values():
        inner = exc[0] if isinstance(exc, tuple) else exc
        return f"{type(inner).__name__}: {inner}"
    return str(e)
