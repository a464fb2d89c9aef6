"""Crafted checkpoints for the trust tests: items written by hand (zips with deflated
or overlapping records), DCP metadata whose chunks are edited, and the peak memory a command
takes. A crafted step is consistent: its manifest lists every file it changed with the size
and checksum of the new bytes, so only what the reader makes of the bytes can catch it.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from muon_ckpt.store import MANIFEST, METADATA, Storage, step_dirname
from muon_ckpt.store.dcp import parse_metadata

MiB = 1 << 20

# ------------------------------------------------------------------ zips written by hand
_LOCAL = struct.Struct("<4s5H3L2H")
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_EOCD = struct.Struct("<4s4H2LH")


def zip_bytes(
    records: Sequence[tuple[str, bytes, bool]], aliases: Iterable[tuple[str, int]] = ()
) -> bytes:
    """A zip of ``records`` (name, bytes, deflated?) in that order, plus ``aliases``: more
    central directory entries (name, index of a record) that point at an existing record's
    local header, so that several names share (overlap) the same bytes."""
    out = io.BytesIO()
    locals_: list[tuple[int, int, int, int, int]] = []
    for name, data, deflate in records:
        raw = name.encode()
        stored = zlib.compress(data, 9)[2:-4] if deflate else data
        method, crc = (8 if deflate else 0), zlib.crc32(data) & 0xFFFFFFFF
        at = out.tell()
        head = (b"PK\x03\x04", 20, 0, method, 0, 0, crc, len(stored), len(data), len(raw), 0)
        out.write(_LOCAL.pack(*head) + raw + stored)
        locals_.append((at, method, crc, len(stored), len(data)))
    entries = [(name, i) for i, (name, _, _) in enumerate(records)] + list(aliases)
    cd_at = out.tell()
    for name, i in entries:
        at, method, crc, csize, size = locals_[i]
        raw = name.encode()
        fields = (b"PK\x01\x02", 20, 20, 0, method, 0, 0, crc, csize, size, len(raw), 0, 0, 0, 0)
        out.write(_CENTRAL.pack(*fields, 0, at) + raw)
    cd_size = out.tell() - cd_at
    n = len(entries)
    out.write(_EOCD.pack(b"PK\x05\x06", 0, 0, n, n, cd_size, cd_at, 0))
    return out.getvalue()


def saved(obj: Any) -> bytes:
    """``torch.save(obj)``'s bytes: what DCP stores for one item."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def bomb_item(value: torch.Tensor, storage_bytes: int, *, deflate: bool, aliases: int = 0) -> bytes:
    """A torch.save-like item of ``value`` (float32) whose storage claims ``storage_bytes``
    bytes (``value`` views its first elements): its record deflated (``deflate``: hundreds of
    MiB of zeros in a few hundred KiB), and ``aliases`` more storages whose central directory
    entries point at that same record (each read again by torch.load), all in one tuple
    with ``value`` first. What torch.load gives: ``value`` (or that tuple)."""
    numel = storage_bytes // 4
    flat = torch.zeros(numel, dtype=torch.float32)
    flat[: value.numel()] = value.reshape(-1)
    keys = [str(i) for i in range(1 + aliases)]
    views = [_view_ops(keys[0], numel, tuple(value.shape))]
    views += [_view_ops(k, numel, (1,)) for k in keys[1:]]
    body = views[0] if not aliases else b"(" + b"".join(views) + b"t"
    pkl = b"\x80\x02" + body + b"."
    records = [("archive/data.pkl", pkl, False), ("archive/byteorder", b"little", False)]
    records += [("archive/version", b"3\n", False), ("archive/data/0", tensor_bytes(flat), deflate)]
    return zip_bytes(records, [(f"archive/data/{k}", 3) for k in keys[1:]])


def compressed(data: bytes, stride: int = 4) -> bytes:
    """``data`` encoded as a compressed item (``store._codec``), as a save writes it."""
    from muon_ckpt.store.codec import Encoder

    out = io.BytesIO()
    enc = Encoder(out, stride)
    enc.write(data)
    enc.finish()
    return out.getvalue()


def compressed_bomb(frames: int, raw: int = 4 * MiB) -> bytes:
    """A well-formed compressed item of ``frames`` frames of ``raw`` zero bytes each (each
    padded to the 1/64 the format asks): what it expands to is far beyond any small chunk."""
    import crc32c
    import zstandard

    from muon_ckpt.store._codec import _FRAME, _HEAD, MAGIC, MAX_RATIO

    packed = zstandard.ZstdCompressor(level=19).compress(bytes(raw))
    pad = max(0, -(-raw // MAX_RATIO) - len(packed))
    frame = _FRAME.pack(raw, len(packed), 1, crc32c.crc32c(bytes(raw))) + packed + bytes(pad)
    return _HEAD.pack(MAGIC, 1, 4) + frame * frames


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _int_op(v: int) -> bytes:
    """A pickle opcode pushing ``v``."""
    if 0 <= v < 256:
        return b"K" + bytes([v])
    raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1


def _str_op(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<L", len(raw)) + raw  # BINUNICODE


def _view_ops(key: str, numel: int, size: tuple[int, ...]) -> bytes:
    """Pickle opcodes that push what torch.save pickles for a contiguous float32 tensor of
    ``size`` at the start of storage ``key`` of ``numel`` elements."""
    stride, acc = [], 1
    for n in reversed(size):
        stride.insert(0, acc)
        acc *= n
    pid = b"(" + _str_op("storage") + b"ctorch\nFloatStorage\n" + _str_op(key) + _str_op("cpu")
    pid += _int_op(numel) + b"tQ"
    tup = lambda xs: b"(" + b"".join(_int_op(x) for x in xs) + b"t"  # noqa: E731
    args = pid + _int_op(0) + tup(size) + tup(stride) + b"\x89ccollections\nOrderedDict\n)R"
    return b"ctorch._utils\n_rebuild_tensor_v2\n(" + args + b"tR"


# ------------------------------------------------------------------ steps edited in place
class StepEditor:
    """A committed step (or ``dirname``: another checkpoint directory under ``st``, such as a
    memory-tier part) opened for crafting: ``md`` (its DCP metadata, to edit), ``add``
    (append an item to a new data file), ``replace_item`` (new bytes for one stored item,
    in a new file); ``save()`` writes the metadata and new files and updates the manifest so
    every size and checksum matches."""

    NEW_FILE = "__0_9.distcp"

    def __init__(self, st: Storage, step: int, dirname: str | None = None) -> None:
        self.st, self.name = st, dirname or step_dirname(step)
        self.md: Metadata = parse_metadata(st.read_bytes(self.name, METADATA), "test")
        self._new = bytearray()

    def add(self, data: bytes, how: Sequence[str] | None = None) -> _StorageInfo:
        """``data`` appended to the new file; ``how``: its DCP storage transforms."""
        info = _StorageInfo(self.NEW_FILE, len(self._new), len(data), how)
        self._new += data
        return info

    def index_of(self, key: str) -> MetadataIndex:
        return next(i for i in self.md.storage_data if i.fqn == key)

    def stored(self, key: str) -> bytes:
        """The stored bytes of ``key``'s first item."""
        info = self.md.storage_data[self.index_of(key)]
        with self.st.open(self.name, info.relative_path) as f:
            f.seek(info.offset)
            return f.read(info.length)

    def replace_item(self, key: str, data: bytes, how: Sequence[str] | None = None) -> None:
        self.md.storage_data[self.index_of(key)] = self.add(data, how)

    def set_chunks(
        self,
        key: str,
        pieces: Sequence[tuple[Any, ...]],
        *,
        size: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """``key`` declared as ``size`` (default: as it was) of ``dtype``, stored in
        ``pieces`` (chunk offsets, chunk sizes, the item's bytes[, its storage transforms])."""
        tm = self.md.state_dict_metadata[key]
        for idx in [i for i in self.md.storage_data if i.fqn == key]:
            del self.md.storage_data[idx]
        chunks = []
        for offsets, sizes, data, *how in pieces:
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            self.md.storage_data[MetadataIndex(key, offsets)] = self.add(data, *how)
        props = tm.properties if dtype is None else TensorProperties(dtype=dtype)
        shape = tm.size if size is None else torch.Size(size)
        self.md.state_dict_metadata[key] = TensorStorageMetadata(props, shape, chunks)

    def save(self) -> None:
        entries = {}
        if self._new:
            self.st.write_bytes(bytes(self._new), self.name, self.NEW_FILE)
            entries[self.NEW_FILE] = _entry(bytes(self._new))
        data = pickle.dumps(self.md)
        self.st.write_bytes(data, self.name, METADATA)
        entries[METADATA] = _entry(data)
        m = json.loads(self.st.read_bytes(self.name, MANIFEST))
        m["files"].update(entries)
        self.st.write_bytes(json.dumps(m).encode(), self.name, MANIFEST)


def _entry(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "crc32": f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"}


def craft_step(
    st: Storage, step: int, edit: Callable[[StepEditor], None], dirname: str | None = None
) -> None:
    ed = StepEditor(st, step, dirname)
    edit(ed)
    ed.save()


# ------------------------------------------------------------------ verdicts
def assert_verify_agrees(rc: int, out: str, loaded: Any) -> None:
    """``muon-ckpt verify``'s exit code ``rc`` (output ``out``) says what load() did
    (``loaded``: its result or exception): OK when it loaded, FAILED when it refused."""
    if isinstance(loaded, Exception):
        assert rc == 1 and "FAILED" in out, (out, loaded)
    else:
        assert rc == 0 and ": OK: " in out, (out, loaded)


# ------------------------------------------------------------------ memory
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    if m is None:
        raise RuntimeError(f"no {field} in /proc/self/status")
    return int(m.group(1)) << 10


def peak_growth(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(how far this process's resident memory peaked above where it was, ``fn()``'s result
    or the exception it raised). The kernel's peak (VmHWM) is reset first, so the figure
    is this call's (and any thread's meanwhile: run tests that measure alone)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = _status("VmRSS")
    try:
        out: Any = fn()
    except Exception as e:  # returned: the caller asserts on it
        out = e
    return _status("VmHWM") - before, out
