"""A small safetensors reader/writer over any Storage, streaming one tensor at a time.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N,
N bytes of JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}`` padded with spaces to a multiple of 8, then the raw little-endian
tensor bytes. ``safetensors.torch.save_file`` builds the whole file in memory; this writer
streams one tensor at a time to any open binary file (local or remote) instead, and the reader
reads one tensor's byte range at a time. Files written here are read by the ``safetensors``
package and vice versa (tests check both).
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import torch

from muon_ckpt._errors import CheckpointCorruptError
from muon_ckpt._tensors import tensor_bytes
from muon_ckpt.store import Storage

__all__ = ["DTYPES", "SafetensorsFile", "TensorInfo", "write_safetensors"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: dtype, shape and where its bytes lie."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _check_little_endian() -> None:
    if sys.byteorder != "little":
        raise RuntimeError("safetensors export/import needs a little-endian machine")


class SafetensorsFile:
    """The header of a safetensors file, and lazy reads of its tensors (any fsspec file)."""

    def __init__(self, file: Storage) -> None:
        self.file = file  # rooted at the file itself
        self.path = file.url
        where = f"{self.path!r} (safetensors)"
        size = file.size()
        with file.open() as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointCorruptError(f"{where}: file is {size} bytes, too short")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointCorruptError(
                    f"{where}: header length {n} does not fit the file size {size}; "
                    "the file is truncated or not a safetensors file"
                )
            raw = f.read(n)
        try:
            header = json.loads(raw)
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointCorruptError(f"{where}: header is not valid JSON ({e})") from e
        meta = header.pop("__metadata__", None) or {}
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in meta.items()}
        base = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        for name, d in header.items():
            try:
                dtype = DTYPES[d["dtype"]]
                shape = tuple(int(s) for s in d["shape"])
                b, e = (int(x) for x in d["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointCorruptError(
                    f"{where}: entry {name!r} is malformed ({err!r}); expected dtype in "
                    f"{sorted(DTYPES)}, a shape and data_offsets"
                ) from err
            if e - b != _nbytes(dtype, shape) or b < 0 or base + e > size:
                raise CheckpointCorruptError(
                    f"{where}: entry {name!r} ({d['dtype']} {list(shape)}) has data_offsets "
                    f"[{b}, {e}] that do not match its size or the file size {size}"
                )
            self.tensors[name] = TensorInfo(dtype, shape, base + b, base + e)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor ``name`` (a new CPU tensor); ``rows=(start, stop)``: only those rows of
        dimension 0, reading only their bytes (an FSDP shard of a large weight)."""
        _check_little_endian()
        info = self.tensors[name]
        shape, begin, end = info.shape, info.begin, info.end
        if rows is not None:
            row = (end - begin) // shape[0] if shape and shape[0] else 0
            begin, end = begin + rows[0] * row, begin + rows[1] * row
            shape = (rows[1] - rows[0], *shape[1:])
        if end == begin:
            return torch.empty(shape, dtype=info.dtype)
        data = self.file.read_range(begin, end)
        if len(data) != end - begin:
            raise CheckpointCorruptError(
                f"{self.path!r}: short read for {name!r} ({len(data)} of {end - begin} "
                "bytes); the file is truncated"
            )
        return torch.frombuffer(bytearray(data), dtype=info.dtype).reshape(shape)


def write_safetensors(
    f: IO[bytes],
    layout: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    tensors: Iterator[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write a safetensors file to the open binary file ``f``; return the bytes written.

    ``layout`` lists (name, dtype, shape) in file order, known before any data is read, so the
    header goes out first; ``tensors`` then yields the tensors in the same order, one at a time
    (only one needs to be in memory).
    """
    _check_little_endian()
    header: dict[str, Any] = {}
    order: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    offset = 0
    for name, dtype, shape in layout:
        if dtype not in _NAMES:
            raise ValueError(
                f"tensor {name!r} has dtype {dtype}, which safetensors cannot store; "
                f"supported: {sorted(str(d) for d in _NAMES)}"
            )
        n = _nbytes(dtype, tuple(shape))
        header[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        order.append((name, dtype, tuple(shape)))
        offset += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    written = 8 + len(raw)
    for name, dtype, shape in order:
        got_name, t = next(tensors)
        if got_name != name or t.dtype != dtype or tuple(t.shape) != shape:
            raise RuntimeError(
                f"write_safetensors: expected {name} {dtype} {list(shape)}, got "
                f"{got_name} {t.dtype} {list(t.shape)}"
            )
        t = t.detach().to("cpu").contiguous()
        f.write(tensor_bytes(t))
        written += t.numel() * t.element_size()
    return written
