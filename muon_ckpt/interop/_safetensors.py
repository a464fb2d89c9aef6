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
import reprlib
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import torch

from muon_ckpt._errors import CheckpointCorruptError
from muon_ckpt._tensors import tensor_bytes
from muon_ckpt.store import Storage

__all__ = ["DTYPES", "SafetensorsFile", "TensorInfo", "parse_header", "write_safetensors"]

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
_MAX_HEADER = 100 * 1024 * 1024  # as the safetensors package
MAX_DIMS = 64  # torch's own limit on a tensor's dimensions


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: dtype, shape and where its bytes lie."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


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
        self.tensors, self.metadata = parse_header(raw, 8 + n, size, where)

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


_SHORT = reprlib.Repr()  # (keyword arguments need Python 3.12)
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist = 2, 4, 8
_SHORT.maxstring, _SHORT.maxlong, _SHORT.maxother = 60, 40, 60


def _short(v: Any) -> str:
    """``v`` for an error message, cut short without rendering all of it (a crafted
    header's values can be megabytes)."""
    return _SHORT.repr(v)


def parse_header(
    raw: bytes, base: int, size: int, where: str
) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors and ``__metadata__`` of a header ``raw`` whose data starts at byte ``base``
    of a file of ``size`` bytes. Time and memory linear in the header's size: every shape is
    checked (at most MAX_DIMS plain integers below 2**63) before its product is taken, and
    messages show values cut short. Anything the format does not allow is a
    CheckpointCorruptError naming the file (``where``): the tensors' bytes, in offset order,
    must follow each other from the data's start to the file's end, as the safetensors
    package requires."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
        raise CheckpointCorruptError(
            f"{where}: header is not valid JSON ({type(e).__name__}: {str(e)[:200]})"
        ) from e
    if not isinstance(header, dict):
        raise CheckpointCorruptError(
            f"{where}: header is a JSON {type(header).__name__}, expected an object of "
            "name -> {dtype, shape, data_offsets}"
        )
    meta = header.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointCorruptError(
            f"{where}: __metadata__ is {_short(meta)}; expected an object of strings"
        )
    tensors = {name: _tensor_info(name, d, base, size, where) for name, d in header.items()}
    at = base
    for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin != at:
            what = "overlaps the tensor before it" if info.begin < at else "leaves a gap before it"
            raise CheckpointCorruptError(
                f"{where}: tensor {_short(name)} (data_offsets from {info.begin - base}) "
                f"{what}; a safetensors file stores its tensors one after another"
            )
        at = info.end
    if at != size:
        raise CheckpointCorruptError(
            f"{where}: its tensors end at byte {at}, the file at {size}; it is truncated or "
            "has bytes no tensor takes"
        )
    return tensors, meta


_EXPECTED = (
    f"expected dtype in {sorted(DTYPES)}, a shape of at most {MAX_DIMS} integers in "
    "[0, 2**63) and data_offsets [begin, end]"
)


def _tensor_info(name: str, d: Any, base: int, size: int, where: str) -> TensorInfo:
    d_type = d.get("dtype") if isinstance(d, dict) else None
    dtype = DTYPES.get(d_type) if isinstance(d_type, str) else None
    shape = d.get("shape") if isinstance(d, dict) else None
    offsets = d.get("data_offsets") if isinstance(d, dict) else None
    ok = (
        dtype is not None
        and isinstance(shape, list)
        and len(shape) <= MAX_DIMS
        and all(type(v) is int and 0 <= v < 1 << 63 for v in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(v) is int and v >= 0 for v in offsets)
    )
    if not ok:
        raise CheckpointCorruptError(f"{where}: entry {_short(name)} is {_short(d)}; {_EXPECTED}")
    b, e = offsets
    nbytes = _nbytes(dtype, tuple(shape))
    if e - b != nbytes or base + e > size:
        raise CheckpointCorruptError(
            f"{where}: entry {_short(name)} ({d['dtype']} {shape}) has data_offsets [{b}, {e}] "
            f"that do not match its size ({nbytes} bytes) or the file size {size}"
        )
    return TensorInfo(dtype, tuple(shape), base + b, base + e)


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
