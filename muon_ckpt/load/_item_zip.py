"""Where a stored item's tensor bytes are: torch.save's zip, parsed from the item's two ends.

DCP stores one ``torch.save`` per item: a zip of a few small records (the pickle, the byte
order, versions) and one record that holds the tensor's bytes. A reader that puts those bytes
straight into the target needs only the record's offset and the pickle's dtype, size, stride
and storage offset. This module reads them with Python's ``struct`` from the item's first and
last ``EDGE`` bytes (the local headers and the pickle before the tensor's record, the central
directory after it), usually one or two reads per item; torch's own zip reader issues a dozen
small reads per item, each a round trip through the interpreter lock that the reading threads
share (on the H200 host that made a load of 4 MiB items run at a fifth of the storage's speed).

Only what ``torch.save`` writes is recognised: stored (uncompressed) records under one archive
name, one ``data/`` record, a pickle of one dense tensor (a restricted unpickler that builds
nothing: ``_LayoutUnpickler``), little-endian bytes, zip64 fields where sizes need them.
Anything else, damaged items included, gives None and the caller loads the item with
``torch.load``, which says what is wrong.
"""

from __future__ import annotations

import collections
import functools
import io
import itertools
import math
import pickle
import pickletools
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["EDGE", "Layout", "parse_layout", "unbounded_records"]

# Bytes read at each end of an item: its zip records before the tensor's bytes (local headers,
# the pickle) and after them (the central directory) are well under 1 KiB each in a
# torch.save file. Bytes outside the two ends are read only when a record needs them.
EDGE = 4096

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory
_LOCATOR = struct.Struct("<4sLQL")  # zip64 end of central directory locator
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory file header
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header
_MAX_RECORDS = 64  # torch.save of one tensor writes 7
_MAX_PICKLE = 64 << 10
_CACHED_PICKLE = 4 << 10
_MAX_DIRECTORY = 1 << 20  # bytes of central directory (torch.save's: well under 1 KiB)
_MAX_DIMS = 64  # torch's own limit on a tensor's dimensions


@dataclass(frozen=True)
class Layout:
    """Where an item's tensor bytes are, relative to the item's first byte, and their shape."""

    start: int
    nbytes: int
    dtype: torch.dtype
    offset: int  # storage offset, in elements
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def whole_and_contiguous(self) -> bool:
        """The record holds exactly this tensor, row-major, from its first byte."""
        numel = math.prod(self.size)
        if self.offset != 0 or numel * self.dtype.itemsize != self.nbytes:
            return False
        expect = 1
        for n, s in zip(reversed(self.size), reversed(self.stride)):
            if n != 1 and s != expect:
                return False
            expect *= n
        return True


@dataclass(frozen=True)
class _Record:
    local: int  # the record's local header, from the item's first byte
    size: int  # stored bytes (= its size: only stored records are kept)
    name_bytes: int  # its name's length (the local header must say the same)


class _StorageName:
    def __init__(self, name: str) -> None:
        self.name = name


class _TensorRecord:
    def __init__(self, storage: tuple, offset: Any, size: Any, stride: Any, dtype: Any) -> None:
        self.storage, self.offset, self.dtype = storage, offset, dtype
        self.size, self.stride = tuple(size), tuple(stride)


def _rebuild_tensor_v2(
    storage: Any, offset: Any, size: Any, stride: Any, grad: Any, hooks: Any, meta: Any = None
) -> Any:
    if meta:  # conj / neg bits (torch applies them on load): not a plain view of the bytes
        raise pickle.UnpicklingError(f"tensor metadata {meta!r}")
    return _TensorRecord(storage, offset, size, stride, None)


def _rebuild_tensor_v3(
    storage: Any,
    offset: Any,
    size: Any,
    stride: Any,
    grad: Any,
    hooks: Any,
    dtype: Any,
    meta: Any = None,
) -> Any:
    """torch.save's form for dtypes without a typed storage class (float8, uint16, ...):
    an untyped (byte) storage and the tensor's dtype."""
    if meta or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"tensor metadata {meta!r}, dtype {dtype!r}")
    return _TensorRecord(storage, offset, size, stride, dtype)


# The opcodes torch.save's pickle of one dense tensor uses. Anything else (large byte strings
# above all: the C unpickler would allocate what their length field claims) is torch.load's.
# fmt: off
_OPCODES = frozenset({
    "PROTO", "FRAME", "GLOBAL", "STACK_GLOBAL", "BINPUT", "LONG_BINPUT", "MEMOIZE", "BINGET",
    "LONG_BINGET", "MARK", "BINUNICODE", "SHORT_BINUNICODE", "TUPLE", "TUPLE1", "TUPLE2",
    "TUPLE3", "EMPTY_TUPLE", "BINPERSID", "BININT", "BININT1", "BININT2", "LONG1", "NEWFALSE",
    "NEWTRUE", "NONE", "REDUCE", "EMPTY_DICT", "SETITEM", "SETITEMS", "STOP",
})
# fmt: on


class _LayoutUnpickler(pickle.Unpickler):
    """Reads what ``torch.save(dense_tensor)`` pickles without building anything: the
    storage's dtype and record key, storage offset, size and stride. Any other global
    makes it give up (the caller then uses torch.load)."""

    _ALLOWED = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
        ("collections", "OrderedDict"): collections.OrderedDict,
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return self._ALLOWED[(module, name)]
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return _StorageName(name)
        if module == "torch" and name.endswith("Storage") and name != "UntypedStorage":
            return _StorageName(name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        kind, storage_type, key, _location, numel = pid
        if kind != "storage" or not isinstance(storage_type, _StorageName):
            raise pickle.UnpicklingError(f"storage {pid!r}")
        if storage_type.name == "UntypedStorage":
            return (torch.uint8, str(key), int(numel))  # numel counts bytes
        dtype = torch.storage._get_dtype_from_pickle_storage_type(storage_type.name)
        return (dtype, str(key), int(numel))


def parse_tensor_pickle(data: Any) -> _TensorRecord | None:
    """What ``torch.save`` pickled for one dense tensor, or None for any other pickle (the
    result is shared: read it only)."""
    if len(data) > _MAX_PICKLE:
        return None
    data = bytes(data)
    if len(data) > _CACHED_PICKLE:
        return _parse_pickle.__wrapped__(data)
    return _parse_pickle(data)


@functools.lru_cache(maxsize=256)
def _parse_pickle(data: bytes) -> _TensorRecord | None:
    # Cached (short pickles only: torch.save's are a few hundred bytes): the items of tensors
    # of one dtype and shape have the same pickle, and scanning its opcodes is most of the
    # cost of parsing an item.
    try:
        if any(op.name not in _OPCODES for op, _, _ in pickletools.genops(data)):
            return None
        rec = _LayoutUnpickler(io.BytesIO(data)).load()
    except Exception:  # truncated or malformed opcode stream, anything the unpickler refuses
        return None
    return rec if isinstance(rec, _TensorRecord) else None


Read = Callable[[int, int], Any]  # (lo, hi) -> bytes [lo, hi) of the item


def _directory(
    read: Read, length: int, max_records: int = _MAX_RECORDS
) -> tuple[int, int, int] | None:
    """(records, offset, size) of the central directory, from the end records."""
    tail_at = max(0, length - EDGE)
    tail = bytes(read(tail_at, length))
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < _EOCD.size:
        return None
    _, disk, cd_disk, _, count, cd_size, cd_off, comment = _EOCD.unpack_from(tail, at)
    if at + _EOCD.size + comment != len(tail) or disk or cd_disk:
        return None
    end = tail_at + at  # the directory ends where the end records start
    if at >= _LOCATOR.size and tail[at - _LOCATOR.size : at - _LOCATOR.size + 4] == b"PK\x06\x07":
        _, _, eocd64, _ = _LOCATOR.unpack_from(tail, at - _LOCATOR.size)
        if eocd64 + _EOCD64.size > end:
            return None
        rec = bytes(read(eocd64, eocd64 + _EOCD64.size))
        sig, _, _, _, disk, cd_disk, _, count, cd_size, cd_off = _EOCD64.unpack(rec)
        if sig != b"PK\x06\x06" or disk or cd_disk:
            return None
        end = eocd64
    if count > max_records or cd_size > _MAX_DIRECTORY or cd_off + cd_size > end:
        return None
    return count, cd_off, cd_size


def _zip64(extra: bytes, fields: list[int]) -> list[int] | None:
    """``fields`` (size, compressed size, local header offset) with those at 0xFFFFFFFF taken
    from the zip64 extra field, in that order."""
    p = 0
    while p + 4 <= len(extra):
        tag, n = struct.unpack_from("<2H", extra, p)
        if tag == 1:
            out, q = list(fields), p + 4
            for i, v in enumerate(fields):
                if v == 0xFFFFFFFF:
                    if q + 8 > p + 4 + n:
                        return None
                    out[i] = struct.unpack_from("<Q", extra, q)[0]
                    q += 8
            return out
        p += 4 + n
    return None if 0xFFFFFFFF in fields else fields


def _records(read: Read, length: int) -> dict[str, _Record] | None:
    """The item's records by name, without the archive name, all stored; None otherwise."""
    found = _directory(read, length)
    if found is None:
        return None
    count, cd_off, cd_size = found
    cd = bytes(read(cd_off, cd_off + cd_size))
    records: dict[str, _Record] = {}
    prefix, p = None, 0
    for _ in range(count):
        if p + _CENTRAL.size > len(cd):
            return None
        head = _CENTRAL.unpack_from(cd, p)
        sig, flags, method, csize, size = head[0], head[3], head[4], head[8], head[9]
        nlen, elen, clen, local = head[10], head[11], head[12], head[16]
        name = cd[p + _CENTRAL.size : p + _CENTRAL.size + nlen].decode("utf-8", "replace")
        extra = cd[p + _CENTRAL.size + nlen : p + _CENTRAL.size + nlen + elen]
        p += _CENTRAL.size + nlen + elen + clen
        fields = _zip64(extra, [size, csize, local])
        if sig != b"PK\x01\x02" or fields is None or method != 0 or flags & 1:
            return None  # compressed or encrypted: not what torch.save writes
        size, csize, local = fields
        archive, sep, rest = name.partition("/")
        prefix = archive if prefix is None else prefix
        if not sep or archive != prefix or csize != size or rest in records:
            return None
        records[rest] = _Record(local, size, nlen)
    return records


def _data_at(read: Read, rec: _Record, length: int) -> int | None:
    """The first byte of a record's data, after its local header."""
    head = bytes(read(rec.local, rec.local + _LOCAL.size))
    sig, _, _, method, _, _, _, _, _, nlen, elen = _LOCAL.unpack(head)
    start = rec.local + _LOCAL.size + nlen + elen
    if sig != b"PK\x03\x04" or method != 0 or nlen != rec.name_bytes:
        return None
    return start if start + rec.size <= length else None


def parse_layout(read: Read, length: int) -> Layout | None:
    """The layout of the dense tensor that ``torch.save`` stored in an item of ``length``
    bytes, whose bytes ``[lo, hi)`` ``read(lo, hi)`` gives; None when the item is anything
    else or damaged (torch.load then says what is wrong), or ``read`` raises (bytes that were
    not read)."""
    if sys.byteorder != "little":
        return None
    try:
        records = _records(read, length)
        if records is None or "data.pkl" not in records:
            return None
        data = [k for k in records if k.startswith("data/")]
        if len(data) != 1:
            return None
        if "byteorder" in records:
            rec = records["byteorder"]
            at = _data_at(read, rec, length)
            if at is None or rec.size != len(b"little") or bytes(read(at, at + 6)) != b"little":
                return None
        pkl = records["data.pkl"]
        at = _data_at(read, pkl, length)
        if at is None or pkl.size > _MAX_PICKLE:
            return None
        trec = parse_tensor_pickle(read(at, at + pkl.size))
        if trec is None:
            return None
        storage_dtype, key, storage_numel = trec.storage
        name = f"data/{key}"
        if name != data[0]:
            return None
        dtype = trec.dtype or storage_dtype
        rec, nbytes = records[name], storage_numel * storage_dtype.itemsize
        start = _data_at(read, rec, length)
        if start is None or rec.size != nbytes or nbytes % dtype.itemsize:
            return None
        numel = nbytes // dtype.itemsize  # storage size in elements of the tensor's dtype
        size, stride, soff = trec.size, trec.stride, trec.offset
        # Plain non-negative integers below 2**63 before any arithmetic (a crafted pickle's
        # sizes could be huge integers whose product takes minutes), and no negative stride
        # (elements before the storage's first one).
        if len(size) != len(stride) or len(size) > _MAX_DIMS:
            return None
        if not all(type(v) is int and 0 <= v < 1 << 63 for v in (*size, *stride, soff)):
            return None
        if math.prod(size) and soff + sum((n - 1) * s for n, s in zip(size, stride)) >= numel:
            return None
        return Layout(start, nbytes, dtype, soff, size, stride)
    except Exception:
        return None


# Records an item handed to torch.load may have: a torch.save of an object writes one per
# storage (tensor) plus six; a directory entry takes at least 46 bytes, so this many fit in
# _MAX_DIRECTORY anyway.
_MAX_LOADED_RECORDS = _MAX_DIRECTORY // _CENTRAL.size


def unbounded_records(read: Read, length: int) -> str | None:
    """None when ``torch.load`` of this item (a zip of ``length`` bytes) allocates no more
    than the item's own bytes for its records, else why not (``the item ...``, for an error
    message). So: a
    central directory found from the end records, every record stored (a deflated one
    expands up to a thousandfold) and not encrypted, its local header and bytes inside the
    item before the directory, and no two records sharing a byte (entries that overlap make
    torch.load read the same bytes as many times as there are entries). torch.load itself
    refuses a storage whose declared size differs from its record's."""
    found = _directory(read, length, _MAX_LOADED_RECORDS)
    if found is None:
        return "is not a zip as torch.save writes it (no end of central directory)"
    count, cd_off, cd_size = found
    cd = bytes(read(cd_off, cd_off + cd_size))
    spans: list[tuple[int, int, str]] = []
    p = 0
    for _ in range(count):
        if p + _CENTRAL.size > len(cd):
            return "has a truncated central directory"
        head = _CENTRAL.unpack_from(cd, p)
        sig, flags, method, csize, size = head[0], head[3], head[4], head[8], head[9]
        nlen, elen, clen, local = head[10], head[11], head[12], head[16]
        name = cd[p + _CENTRAL.size : p + _CENTRAL.size + nlen].decode("utf-8", "replace")
        extra = cd[p + _CENTRAL.size + nlen : p + _CENTRAL.size + nlen + elen]
        p += _CENTRAL.size + nlen + elen + clen
        fields = _zip64(extra, [size, csize, local])
        if sig != b"PK\x01\x02" or fields is None:
            return "has a malformed central directory"
        size, csize, local = fields
        if method != 0 or flags & 1 or csize != size:
            return f"has a compressed or encrypted record {name[:100]!r} (torch.save stores them)"
        if local + _LOCAL.size > cd_off:
            return f"has a record {name[:100]!r} outside the item"
        sig, _, _, method, _, _, _, _, _, lnlen, lelen = _LOCAL.unpack(
            bytes(read(local, local + _LOCAL.size))
        )
        end = local + _LOCAL.size + lnlen + lelen + size
        if sig != b"PK\x03\x04" or method != 0 or end > cd_off:
            return f"has a record {name[:100]!r} outside the item, or malformed"
        spans.append((local, end, name))
    spans.sort()
    for (_, b, x), (c, _, y) in itertools.pairwise(spans):
        if c < b:
            return f"has records {x[:100]!r} and {y[:100]!r} that overlap"
    return None
