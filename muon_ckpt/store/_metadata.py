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
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from muon_ckpt._errors import CheckpointCorruptError

__all__ = ["bytes_keys", "parse_metadata", "tensor_entries"]

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}
_BUILTINS = {"set": set, "frozenset": frozenset, "slice": slice}


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
            return collections.OrderedDict
        elif module == "builtins" and name in _BUILTINS:
            return _BUILTINS[name]
        raise pickle.UnpicklingError(
            f"{module}.{name} is not part of a DCP metadata file; refusing to unpickle it"
        )


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


def tensor_entries(md: Metadata) -> dict[str, TensorStorageMetadata]:
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def bytes_keys(md: Metadata) -> list[str]:
    return [k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
