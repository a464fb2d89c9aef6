"""Lossless compression of stored tensor items (``compression="zstd"``, format 4): byte
grouping and zstd, frame by frame.

A compressed item is what ``torch.save`` writes for the tensor (its zip, as every item),
encoded as ``MAGIC``, a version byte, the stride (the tensor's element size: 1, 2, 4 or 8),
then frames of at most ``MAX_FRAME_BYTES`` of those bytes each: ``<raw length: u32> <stored
length: u32> <mode: u8> <CRC32C of the raw bytes: u32>`` and the stored bytes. Mode 1: the frame's bytes grouped by their
position in the element (every element's byte 0, then every byte 1, ...; a tail shorter
than the stride as it is), as one zstd frame, then zero bytes up to ``1 / MAX_RATIO`` of the
frame's bytes where the zstd frame is shorter; mode 0: the bytes as they are (a frame zstd
did not shrink). So no item expands beyond ``MAX_RATIO`` times its stored bytes, which
bounds, before anything is read, what the metadata may declare for it (``store._chunks``).
Grouping puts the exponent bytes of floats together, where zstd finds them alike; mantissa
bytes stay nearly random. The CRC32C is of the frame's bytes as ``torch.save`` wrote them,
taken before encoding and checked after decoding: it proves the round trip (grouping, zstd
and back) lossless at every read, whatever ``verify`` says of the stored bytes. The tensor's record starts 64-byte aligned in
the zip and frames are whole multiples of 8 bytes, so element boundaries line up.

DCP's metadata names the encoding per item (``_StorageInfo.transform_descriptors ==
[DESCRIPTOR]``), as its own storage transforms do; a plain DCP reader refuses it ("Unknown
extension") unless given ``extension_registry()``. The checksums of the manifest cover the
stored (compressed) bytes. ``decode`` expands an item to at most the bound its caller
declares (the metadata's chunk bytes plus ``ZIP_SLACK``) and checks every frame before it
allocates anything, so a crafted item cannot expand beyond what its chunk says, and checks
every frame's CRC32C once it is expanded.

``zstandard`` is imported lazily (``pip install 'muon-ckpt[zstd]'``): only saves that
compress and reads of compressed items need it.
"""

from __future__ import annotations

import io
import struct
from typing import IO, Any

import numpy as np

from muon_ckpt._zstd import require_zstd
from muon_ckpt.store._crc import CRC32C, crc_function

__all__ = [
    "DESCRIPTOR",
    "MIN_COMPRESS_BYTES",
    "ZIP_SLACK",
    "BadEncoding",
    "Encoder",
    "decode",
    "extension_registry",
    "require_zstd",
    "stride_of",
]

DESCRIPTOR = "bytegroup-zstd@muon-ckpt/1"
MAGIC = b"MCKZ"
_VERSION = 1
_HEAD = struct.Struct("<4sBB")
_FRAME = struct.Struct("<IIBI")  # raw bytes, stored bytes, mode, CRC32C of the raw bytes
FRAME_BYTES = 1 << 20  # what a writer puts in a frame
MAX_FRAME_BYTES = 4 << 20  # what a reader accepts in one (memory per frame)
MIN_COMPRESS_BYTES = 64 << 10  # tensors smaller than this are stored as they are
ZIP_SLACK = 64 << 10  # a torch.save zip's bytes beyond its tensor's (records, pickle)
# At most this many bytes per stored byte: a frame of zeros, ~25000x in zstd alone, costs
# 1/64 of its bytes; real float state compresses 1.2-1.5x.
MAX_RATIO = 64
LEVEL = 1  # zstd's level: ratios within 2% of level 3 on optimizer state, 1.5-2x faster
_STRIDES = (1, 2, 4, 8)


class BadEncoding(ValueError):
    """An encoded item that is not one, or expands beyond its bound (the load path reports it
    as an untrusted item: ``load._declared``)."""


def stride_of(itemsize: int) -> int:
    return itemsize if itemsize in _STRIDES else 1


def _grouped(mv: memoryview, stride: int) -> Any:
    """The bytes of ``mv`` grouped by position in the element (a tail as it is)."""
    a = np.frombuffer(mv, dtype=np.uint8)
    if stride == 1:
        return a
    n = len(a) - len(a) % stride
    planes = a[:n].reshape(-1, stride).T
    if n == len(a):
        return np.ascontiguousarray(planes)
    return np.concatenate([planes.reshape(-1), a[n:]])


class Encoder(io.RawIOBase):
    """A write-only stream that encodes what is written to it into ``out`` (call ``finish``
    once after the last write); ``raw`` and ``stored``: the bytes in and out."""

    def __init__(self, out: Any, stride: int) -> None:
        super().__init__()
        self._out, self._stride = out, stride
        self._cctx = require_zstd().ZstdCompressor(level=LEVEL)
        self._buf = bytearray()
        self._crc = crc_function(CRC32C)
        self.raw = 0
        self.stored = self._write(_HEAD.pack(MAGIC, _VERSION, stride))

    def writable(self) -> bool:
        return True

    def _write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        self._out.write(b)
        return n

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = len(mv)
        self.raw += n
        if self._buf:  # fill the pending frame first
            take = min(n, FRAME_BYTES - len(self._buf))
            self._buf += mv[:take]
            mv = mv[take:]
            if len(self._buf) == FRAME_BYTES:
                self._frame(memoryview(self._buf))
                self._buf = bytearray()
        while len(mv) >= FRAME_BYTES:  # whole frames straight from the caller's memory
            self._frame(mv[:FRAME_BYTES])
            mv = mv[FRAME_BYTES:]
        self._buf += mv
        return n

    def _frame(self, mv: memoryview) -> None:
        crc = self._crc(0, mv)
        packed = self._cctx.compress(_grouped(mv, self._stride))
        pad = _padded(len(mv), len(packed)) - len(packed)
        if len(packed) + pad < len(mv):
            self.stored += self._write(_FRAME.pack(len(mv), len(packed), 1, crc))
            self.stored += self._write(packed)
            if pad:
                self.stored += self._write(bytes(pad))
        else:
            self.stored += self._write(_FRAME.pack(len(mv), len(mv), 0, crc))
            self.stored += self._write(mv)

    def finish(self) -> None:
        if self._buf:
            self._frame(memoryview(self._buf))
            self._buf = bytearray()


def _padded(raw: int, packed: int) -> int:
    """What a mode-1 frame of ``raw`` bytes in a zstd frame of ``packed`` bytes stores."""
    return max(packed, -(-raw // MAX_RATIO))


def decode(data: Any, bound: int, where: str, key: str) -> bytearray:
    """The bytes an encoded item holds (``data``: all of its stored bytes), at most ``bound``
    of them; BadEncoding naming the file and the key when it is not such an item, or would
    expand beyond ``bound``."""
    view = memoryview(data).cast("B")

    def bad(why: str) -> BadEncoding:
        return BadEncoding(
            f"{where}: cannot load it: the compressed item of {key[:200]!r} ({len(view)} "
            f"bytes) {why}; the step cannot be trusted. Load another step (muon-ckpt ls "
            "lists them)"
        )

    if len(view) < _HEAD.size:
        raise bad("is shorter than its header")
    magic, version, stride = _HEAD.unpack_from(view, 0)
    if magic != MAGIC or version != _VERSION or stride not in _STRIDES:
        raise bad(f"has the header {bytes(view[: _HEAD.size])!r}, not {MAGIC!r} version 1")
    frames, pos, total = [], _HEAD.size, 0
    while pos < len(view):  # every frame checked before anything is allocated
        if pos + _FRAME.size > len(view):
            raise bad(f"ends inside the header of a frame at byte {pos}")
        raw, packed, mode, crc = _FRAME.unpack_from(view, pos)
        at, pos = pos, pos + _FRAME.size
        stored = packed if mode == 0 else _padded(raw, packed)
        if not 0 < raw <= MAX_FRAME_BYTES or mode not in (0, 1) or pos + stored > len(view):
            raise bad(f"has a frame at byte {at} of {raw} bytes (mode {mode}) past its end")
        if (mode == 0 and packed != raw) or (mode == 1 and stored >= raw):
            raise bad(f"has a frame at byte {at} storing {raw} bytes in {stored}")
        if mode == 1 and np.count_nonzero(
            np.frombuffer(view[pos + packed : pos + stored], np.uint8)
        ):
            raise bad(f"has a frame at byte {at} whose padding is not zeros")
        total += raw
        if total > bound:
            raise bad(f"expands beyond the {bound} bytes its chunk declares")
        frames.append((at, pos, packed, raw, mode, crc))
        pos += stored
    out = bytearray(total)
    dst = np.frombuffer(out, dtype=np.uint8) if total else np.empty(0, np.uint8)
    dctx = require_zstd().ZstdDecompressor(max_window_size=MAX_FRAME_BYTES) if frames else None
    check, at = crc_function(CRC32C, where), 0
    for head, start, stored, raw, mode, crc in frames:
        src, part = view[start : start + stored], dst[at : at + raw]
        if mode == 0:
            part[:] = np.frombuffer(src, dtype=np.uint8)
        else:
            _ungroup(_inflate(dctx, src, raw, bad), stride, part)
        got = check(0, part.data)
        if got != crc:
            raise bad(
                f"has a frame at byte {head} that expands to bytes of CRC32C {got:08x}, not "
                f"the {crc:08x} recorded when it was written"
            )
        at += raw
    return out


def _inflate(dctx: Any, src: memoryview, raw: int, bad: Any) -> Any:
    """One zstd frame of exactly ``raw`` bytes, declared so in its header."""
    import zstandard

    try:
        if zstandard.frame_content_size(src) != raw:
            raise bad(f"has a zstd frame that does not declare its {raw} bytes")
        got = dctx.decompress(src, max_output_size=raw, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise bad(f"has a zstd frame that does not decompress ({e})") from e
    if len(got) != raw:
        raise bad(f"has a zstd frame of {len(got)} bytes, not {raw}")
    return np.frombuffer(got, dtype=np.uint8)


def _ungroup(a: Any, stride: int, dst: Any) -> None:
    """``a`` (bytes grouped by ``_grouped``) back in element order, into ``dst``: one strided
    copy per byte position (5-9x faster than numpy's copy of the transposed planes for
    strides 2 and 4)."""
    n = len(a) - len(a) % stride
    if stride == 1:
        dst[:] = a
        return
    elems, planes = dst[:n].reshape(-1, stride), a[:n].reshape(stride, -1)
    for i in range(stride):
        elems[:, i] = planes[i]
    dst[n:] = a[n:]


def extension_registry() -> Any:
    """DCP's extension registry with this encoding added: plain DCP reads a compressed step
    with ``FileSystemReader(path, _extension_registry=extension_registry())`` (DCP's
    experimental API; muon-ckpt's own readers need none of it)."""
    from torch.distributed.checkpoint._extension import (
        ExtensionRegistry,
        StreamTransformExtension,
    )

    class ByteGroupZstd(StreamTransformExtension):
        @staticmethod
        def registry_name() -> str:
            return DESCRIPTOR.partition("/")[0]

        @staticmethod
        def from_descriptor(version: str) -> ByteGroupZstd:
            if version != DESCRIPTOR.partition("/")[2]:
                raise ValueError(f"{DESCRIPTOR}: unknown version {version!r}: upgrade muon-ckpt")
            return ByteGroupZstd()

        def get_descriptor(self) -> str:
            return DESCRIPTOR

        def transform_to(self, output: IO[bytes]) -> IO[bytes]:
            del output
            raise NotImplementedError("muon-ckpt's saves write this encoding, not DCP's")

        def transform_from(self, input: IO[bytes]) -> IO[bytes]:
            data = input.read()  # (DCP reads an item whole too)
            most = len(data) * MAX_RATIO  # (no chunk to bound it here: the format's most)
            return io.BytesIO(decode(data, most, "dcp", "item"))

    reg = ExtensionRegistry()
    reg.register(ByteGroupZstd)
    return reg
