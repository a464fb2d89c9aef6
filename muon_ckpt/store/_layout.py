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
FORMAT_VERSION = 1
KEY_FORMAT_VERSION = 1

MAX_STEP = 10**8 - 1  # 8 digits
MAX_MANIFEST_BYTES = 64 << 20  # a manifest is read up to this size, no further

_STEP_RE = re.compile(r"^step-(\d{8})$")
# A file of a step: one plain name inside the step directory (DCP writes no subdirectories).
_FILE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,255}$")
_CRC_RE = re.compile(r"^[0-9a-f]{8}$")


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
    size: int
    crc32: str  # 8 hex digits of zlib.crc32


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
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

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
    size, crc = v["size"], v["crc32"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"file {name!r}: size {size!r} is not an int >= 0")
    if not isinstance(crc, str) or not _CRC_RE.match(crc):
        raise ValueError(f"file {name!r}: crc32 {crc!r} is not 8 hex digits")
    return FileEntry(size, crc)
