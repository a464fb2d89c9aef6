"""A stored file's entry in a manifest (``FileEntry``): its size, its CRC32C per chunk, the
SHA-256 of each tensor it stores; read from JSON with every integer bounded."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_INT", "FileEntry"]

MAX_INT = (1 << 63) - 1  # every integer of a manifest is below 2**63 (a file size, a count)
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_DIGITS, _HEX = b"0123456789", b"0123456789abcdef"
_OFFSET_LENGTHS = set(range(1, 20))  # an offset is below 2**63: at most 19 digits


@dataclass
class FileEntry:
    """A stored file's size and checksums: 8 hex digits per chunk of ``chunk_bytes`` bytes
    (None: one checksum of the whole file, format 1), in ``crc32c`` (CRC32C, the default)
    or ``crc32`` (zlib's; format 1, or saves without a CRC32C package). One of them is set."""

    size: int
    crc32: str | None = None
    crc32c: str | None = None
    chunk_bytes: int | None = None
    cuts: list[int] | None = None  # offsets where a chunk ends early; the grid restarts there
    # offset of a stored tensor -> SHA-256 of its dtype, shape and bytes (``save._dedup``):
    # how a later save knows that a tensor is unchanged and refers to it instead of writing it
    sha256: dict[int, str] | None = None

    def chunk_starts(self) -> list[int]:
        """Where each checksummed chunk begins (``[0]`` without chunks). Computed once per
        entry (entries are not changed after they are made; the cache is no field)."""
        cached = self.__dict__.get("_starts")
        if cached is None:
            cached = self.__dict__["_starts"] = self._chunk_starts()
        return cached

    def _chunk_starts(self) -> list[int]:
        c, size = self.chunk_bytes, self.size
        if c is None:
            return [0]
        # The grid restarts at each cut: between two cuts (or 0, or the end) chunks begin
        # every ``c`` bytes (ranges, not a step per chunk: a 2,048-rank step has millions)
        bounds = [0, *sorted({x for x in self.cuts or () if 0 < x < size}), size]
        starts: list[int] = []
        for a, b in itertools.pairwise(bounds):
            starts.extend(range(a, b, c))
        return starts or [0]

    @property
    def algorithm(self) -> str:
        return "crc32c" if self.crc32c is not None else "crc32"

    @property
    def digest(self) -> str:
        return self.crc32c if self.crc32c is not None else (self.crc32 or "")

    def to_dict(self) -> dict[str, Any]:
        # (not asdict: its deep copy of the digests made a 2,048-rank commit's manifest slow)
        d = {k: v for k in _ENTRY_FIELDS if (v := getattr(self, k)) is not None}
        if self.sha256 is not None:  # JSON keys are strings, in order
            d["sha256"] = {str(k): v for k, v in sorted(self.sha256.items())}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FileEntry:
        size = _bounded("size", d["size"])
        chunk = None if d.get("chunk_bytes") is None else _bounded("chunk_bytes", d["chunk_bytes"])
        sums = [k for k in ("crc32c", "crc32") if d.get(k) is not None]
        if len(sums) != 1:
            raise ValueError(f"a file entry needs one of crc32c or crc32, found {sorted(d)}")
        digest = str(d[sums[0]])
        cuts = None if d.get("cuts") is None else [_bounded("cuts", c) for c in d["cuts"]]
        if size < 0 or (chunk is not None and chunk < 1):
            raise ValueError(f"size {size} and chunk_bytes {chunk} must be >= 0 and >= 1")
        if cuts is not None and (chunk is None or any(not 0 < c < size for c in cuts)):
            raise ValueError(f"cuts must lie inside the file's {size} bytes, found {cuts[:5]}")
        sha = None if d.get("sha256") is None else _digests(d["sha256"], size)
        e = cls(size, chunk_bytes=chunk, cuts=cuts, sha256=sha, **{sums[0]: digest})
        count = len(e.chunk_starts())
        if len(digest) != 8 * count:
            raise ValueError(
                f"a file of {size} bytes in chunks of {chunk} needs {count} checksum(s) of 8 "
                f"hex digits, found {len(digest)} digits"
            )
        int(digest or "0", 16)  # hex only
        return e


def _only(text: str, chars: bytes) -> bool:
    """Whether ``text`` is made of ``chars`` (ASCII) alone, and not empty."""
    return bool(text) and text.isascii() and not text.encode().translate(None, chars)


_ENTRY_FIELDS = ("size", "crc32", "crc32c", "chunk_bytes", "cuts")


def _digests(v: Any, size: int) -> dict[int, str]:
    """A file entry's ``sha256``: {offset inside the file: 64 hex digits}."""
    if not isinstance(v, dict):
        raise ValueError(f"sha256 must be a JSON object, found a {type(v).__name__}")
    # All of them at once (a 2,048-rank step has a million); one by one where that fails,
    # to accept or name each as before
    keys, hexes = list(v), list(v.values())
    if not keys:
        return {}
    if (
        set(map(type, keys)) | set(map(type, hexes)) <= {str}
        and set(map(len, hexes)) == {64}
        and _only(("".join(hexes)), _HEX)
        and set(map(len, keys)) <= _OFFSET_LENGTHS
        and _only("".join(keys), _DIGITS)
    ):
        offsets = list(map(int, keys))
        if max(offsets) < size:
            return dict(zip(offsets, hexes))
    out = {}
    for k, h in v.items():
        if not (isinstance(k, str) and k.isdigit() and len(k) <= 19 and int(k) < size):
            raise ValueError(f"sha256: {str(k)[:40]!r} is not an offset inside the file")
        if not (isinstance(h, str) and _SHA256_RE.match(h)):
            raise ValueError(f"sha256 at {k}: {str(h)[:80]!r} is not 64 hex digits")
        out[int(k)] = h
    return out


def _bounded(name: str, v: Any, *, low: int = 0) -> int:
    """``v`` if it is a JSON integer in ``[low, 2**63)``: anything else in a manifest is
    corrupt (a 4,300-digit size must not reach arithmetic or formatting)."""
    if type(v) is not int or not low <= v <= MAX_INT:
        shown = repr(v) if type(v) is not int else f"an integer of {v.bit_length()} bits"
        raise ValueError(f"{name} must be an integer in [{low}, 2**63), found {shown[:40]}")
    return v
