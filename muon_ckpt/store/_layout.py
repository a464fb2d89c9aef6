"""Checkpoint layout and key format: the names every other module and the README agree on.

Layout::

    <url>/lease.json                the write lease: one writer per run (``_lease``)
    <url>/step-00000500/            one directory per step: ``step-`` and exactly 8 digits;
                                    any other name is ignored (``ls`` reports it)
        .metadata, __0_0.distcp ... DCP files, written first
        manifest.json               written LAST, by rank 0, after every rank finished:
                                    the commit marker. A step without it does not exist.

Keys (DCP state-dict keys, by parameter FQN, never by position)::

    model.<fqn>                        parameter / buffer tensors
    optim.state.<fqn>.<state key>      e.g. optim.state.layers.0.w.momentum_buffer
    optim.param_groups.<fqn>.<hparam>  e.g. optim.param_groups.layers.0.w.lr
    extra.<name>.<key path>            state_dict() of each ``extra`` object, flattened
    rank_extra.<rank>.<name>.<key path>  state_dict() of each ``rank_extra`` object, per rank
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from muon_ckpt._errors import CheckpointCorruptError

STEP_PREFIX = "step-"
MANIFEST = "manifest.json"
METADATA = ".metadata"  # DCP's own metadata file, in every step directory
FORMAT = "muon-ckpt"
FORMAT_VERSION = 2  # 2: CRC32C (or crc32) per 1 MiB chunk; 1: one zlib crc32 per file
KEY_FORMAT_VERSION = 1

MAX_STEP = 10**8 - 1  # 8 digits
MAX_MANIFEST_BYTES = 64 << 20  # a manifest is read up to this size, no further

_STEP_RE = re.compile(r"^step-(\d{8})$")
# A file of a step: one plain name inside the step directory (DCP writes no subdirectories).
_FILE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,255}$")
_HEX_RE = re.compile(r"(?:[0-9a-f]{8})+")


def step_dirname(step: int) -> str:
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be in [0, {MAX_STEP}] (8 digits), got {step}")
    return f"{STEP_PREFIX}{step:08d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a canonical step directory name (``step-`` and exactly 8 digits), else
    None: ``step-000000009`` is not step 9."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def is_file_name(name: str) -> bool:
    """A name a checkpoint may refer to: one plain relative name inside its step directory
    (no ``/``, no ``..``, not absolute)."""
    return isinstance(name, str) and name not in (".", "..") and bool(_FILE_RE.match(name))


def model_key(fqn: str) -> str:
    return f"model.{fqn}"


def optim_state_key(fqn: str, key: str) -> str:
    return f"optim.state.{fqn}.{key}"


def optim_group_key(fqn: str, hparam: str) -> str:
    return f"optim.param_groups.{fqn}.{hparam}"


def extra_key(name: str) -> str:
    return f"extra.{name}"


def rank_extra_key(rank: int, name: str) -> str:
    return f"rank_extra.{rank}.{name}"


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
        cuts = sorted(self.cuts or [])
        starts, at, ci = [0], 0, 0
        while True:
            end = at + c
            while ci < len(cuts) and cuts[ci] <= at:
                ci += 1
            if ci < len(cuts) and cuts[ci] < end:
                end = cuts[ci]
            if end >= size:
                return starts
            starts.append(end)
            at = end

    @property
    def algorithm(self) -> str:
        return "crc32c" if self.crc32c is not None else "crc32"

    @property
    def digest(self) -> str:
        return self.crc32c if self.crc32c is not None else (self.crc32 or "")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FileEntry:
        size = int(d["size"])
        chunk = None if d.get("chunk_bytes") is None else int(d["chunk_bytes"])
        sums = [k for k in ("crc32c", "crc32") if d.get(k) is not None]
        if len(sums) != 1:
            raise ValueError(f"a file entry needs one of crc32c or crc32, found {sorted(d)}")
        digest = str(d[sums[0]])
        cuts = None if d.get("cuts") is None else [int(c) for c in d["cuts"]]
        if size < 0 or (chunk is not None and chunk < 1):
            raise ValueError(f"size {size} and chunk_bytes {chunk} must be >= 0 and >= 1")
        if cuts is not None and (chunk is None or any(not 0 < c < size for c in cuts)):
            raise ValueError(f"cuts must lie inside the file's {size} bytes, found {cuts[:5]}")
        e = cls(size, chunk_bytes=chunk, cuts=cuts, **{sums[0]: digest})
        count = len(e.chunk_starts())
        if len(digest) != 8 * count:
            raise ValueError(
                f"a file of {size} bytes in chunks of {chunk} needs {count} checksum(s) of 8 "
                f"hex digits, found {len(digest)} digits"
            )
        int(digest or "0", 16)  # hex only
        return e


@dataclass
class Manifest:
    step: int
    world_size: int
    files: dict[str, FileEntry]
    time: str  # ISO 8601, UTC
    torch_version: str
    muon_ckpt_version: str
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    key_format_version: int = KEY_FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        d = asdict(self)
        d["files"] = {k: v.to_dict() for k, v in self.files.items()}
        return json.dumps(d, indent=1, sort_keys=True).encode()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        try:
            d = json.loads(data)  # nesting is bounded: too deep raises RecursionError
            if d.get("format") != FORMAT:
                raise ValueError(f"format is {d.get('format')!r}, expected {FORMAT!r}")
            if int(d["format_version"]) > FORMAT_VERSION:
                raise ValueError(
                    f"format_version {d['format_version']} is newer than this muon-ckpt "
                    f"understands ({FORMAT_VERSION}); upgrade muon-ckpt"
                )
            files = {k: _file_entry(k, v) for k, v in d["files"].items()}
            return cls(
                step=int(d["step"]),
                world_size=int(d["world_size"]),
                files=files,
                time=str(d["time"]),
                torch_version=str(d["torch_version"]),
                muon_ckpt_version=str(d["muon_ckpt_version"]),
                format=d["format"],
                format_version=int(d["format_version"]),
                key_format_version=int(d.get("key_format_version", 1)),
                extra=dict(d.get("extra", {})),
            )
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CheckpointCorruptError(
                f"{where}: manifest is unreadable ({e}); the step cannot be trusted. "
                "Load another step (muon-ckpt ls lists them) or delete this one"
            ) from e


def _file_entry(name: str, v: Any) -> FileEntry:
    if not is_file_name(name) or name == MANIFEST:
        raise ValueError(
            f"it lists the file {name[:80]!r}: a checkpoint holds plain file names inside "
            "its step directory only (no '/', '..' or absolute paths)"
        )
    for k in ("size", "chunk_bytes"):
        x = v.get(k)
        if (x is not None or k == "size") and (not isinstance(x, int) or isinstance(x, bool)):
            raise ValueError(f"file {name!r}: {k} {x!r} is not an int")
    cuts = v.get("cuts")
    if cuts is not None and (not isinstance(cuts, list) or not all(type(c) is int for c in cuts)):
        raise ValueError(f"file {name!r}: cuts must be a list of ints")
    for k in ("crc32c", "crc32"):
        digest = v.get(k)
        if digest is None:
            continue
        if not isinstance(digest, str) or not _HEX_RE.fullmatch(digest):
            raise ValueError(
                f"file {name!r}: {k} {str(digest)[:40]!r} is not 8 hex digits per chunk"
            )
        chunk = v.get("chunk_bytes")
        # Bound the work before the chunk grid is built: a crafted entry (1-byte chunks of a
        # huge file) must not spin; at least size / chunk_bytes checksums are needed.
        if chunk is not None and chunk >= 1 and -(-v["size"] // chunk) > len(digest) // 8:
            raise ValueError(
                f"file {name!r}: {v['size']} bytes in chunks of {chunk} need more checksums "
                f"than the {len(digest) // 8} listed"
            )
    try:
        return FileEntry.from_dict(v)
    except ValueError as e:
        raise ValueError(f"file {name!r}: {e}") from e
