"""Checkpoint layout and key format: the names every other module and the README agree on.

Layout::

    <url>/lease.json                the write lease: one writer per run (``_lease``)
    <url>/step-00000500/            one directory per step: ``step-`` and exactly 8 digits;
                                    any other name is ignored (``ls`` reports it)
        .metadata                   DCP's metadata, written first (format 2: with the data
                                    files __0_0.distcp ... beside it)
        manifest.json               written LAST, by rank 0, after every rank finished:
                                    the commit marker. A step without it does not exist.
    <url>/data/00000500-<16 hex>/   format 3: the data files the save of step 500 wrote
        __0_0.distcp ...            (``.metadata`` names them ``../data/<dir>/<file>``);
                                    later steps refer to the tensors in them that did not
                                    change, and a file goes once no step refers to it
    <url>/line-<line>-<gen>.json    a memory-tier line's record: the url vouches for the
                                    memory steps of that line (``_records``)

Keys (DCP state-dict keys, by parameter FQN, never by position)::

    model.<fqn>                        parameter / buffer tensors
    optim.state.<fqn>.<state key>      e.g. optim.state.layers.0.w.momentum_buffer
    optim.param_groups.<fqn>.<hparam>  e.g. optim.param_groups.layers.0.w.lr
    extra.<name>.<key path>            state_dict() of each ``extra`` object, flattened
    rank_extra.<rank>.<name>.<key path>  state_dict() of each ``rank_extra`` object, per rank
"""

from __future__ import annotations

import datetime
import json
import operator
import re
from dataclasses import dataclass, field, fields
from typing import Any

from muon_ckpt._errors import CheckpointCorruptError, CheckpointError, CheckpointVersionError
from muon_ckpt._version import __version__
from muon_ckpt.store._entry import FileEntry, _bounded

STEP_PREFIX = "step-"
MANIFEST = "manifest.json"
METADATA = ".metadata"  # DCP's own metadata file, in every step directory
FORMAT = "muon-ckpt"
# 3: data files in <url>/data/, shared by the steps that refer to them; 2: CRC32C (or crc32)
# per 1 MiB chunk, every file in the step's directory; 1: one zlib crc32 per file
FORMAT_VERSION = 4
SHARED_FORMAT_VERSION = 3  # the first format whose steps refer to files in DATA
COMPRESSED_FORMAT_VERSION = 4  # the first whose items may be compressed (store._codec)
PLAIN_FORMAT_VERSION = 2  # what a step without such references is written as
DATA = "data"  # <url>/data/: the data files of format-3 steps
KEY_FORMAT_VERSION = 1

MAX_STEP = 10**8 - 1  # 8 digits


def check_step(step: Any) -> int:
    """``step`` as a step number (an integer in [0, MAX_STEP]); ValueError otherwise."""
    try:
        value = operator.index(step) if not isinstance(step, bool) else None
    except TypeError:
        value = None
    if value is None or value < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if value > MAX_STEP:  # step directories have exactly 8 digits
        raise ValueError(f"step must be <= {MAX_STEP} (8 digits), got {step!r}")
    return value


# A manifest is read up to this size, no further. It grows with ranks x tensors, about 90
# bytes a tensor shard (its SHA-256 above all): an 8B model on 2,048 ranks writes ~100 MiB
MAX_MANIFEST_BYTES = 1 << 30

_STEP_RE = re.compile(r"^step-(\d{8})$")
# A line record: any gen (its name is kept as listed, and deleted by that name).
_RECORD_RE = re.compile(r"^line-([A-Za-z0-9]{1,64})-(\d+)\.json$")
# A file of a step: one plain name inside the step directory (DCP writes no subdirectories).
_FILE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,255}$")
_HEX_RE = re.compile(r"(?:[0-9a-f]{8})+")
_DATA_DIR_RE = re.compile(r"^(\d{8})-[0-9a-f]{16}$")
# How a step's manifest and .metadata name a file of the run's data: from the step directory.
_DATA_REF_RE = re.compile(r"^\.\./data/(\d{8}-[0-9a-f]{16})/([^/]{1,255})$")


def step_dirname(step: int) -> str:
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be in [0, {MAX_STEP}] (8 digits), got {step}")
    return f"{STEP_PREFIX}{step:08d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a canonical step directory name (``step-`` and exactly 8 digits), else
    None: ``step-000000009`` is not step 9."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def record_name(line: str, gen: int) -> str:
    """The name of ``line``'s record in the run's root (``_records``), ordered by ``gen``."""
    return f"line-{line}-{gen}.json"


def parse_record_name(name: str) -> tuple[str, int] | None:
    """(line, gen) of a line record's name, else None (not a record: ignored)."""
    m = _RECORD_RE.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def is_file_name(name: str) -> bool:
    """A name a checkpoint may refer to: one plain relative name inside its step directory
    (no ``/``, no ``..``, not absolute)."""
    return isinstance(name, str) and name not in (".", "..") and bool(_FILE_RE.match(name))


def data_dirname(step: int, save_id: str) -> str:
    """The directory under ``<url>/data/`` of the files the save of ``step`` with id
    ``save_id`` (16 hex digits) writes."""
    return f"{step:08d}-{save_id}"


def parse_data_dirname(name: str) -> int | None:
    """The step of a data directory's name (8 digits, ``-``, 16 hex digits), else None (a
    name this version did not make: never deleted)."""
    m = _DATA_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def data_ref(name: str) -> tuple[str, str] | None:
    """(data directory, file name) of ``../data/<dir>/<file>``, the name a step gives a file
    of the run's data; None for anything else."""
    m = _DATA_REF_RE.match(name) if isinstance(name, str) else None
    if m is None or not is_file_name(m.group(2)):
        return None
    return m.group(1), m.group(2)


def data_ref_name(dirname: str, fname: str) -> str:
    """The name a step gives file ``fname`` of data directory ``dirname``."""
    return f"../{DATA}/{dirname}/{fname}"


def is_stored_name(name: str) -> bool:
    """A name a manifest may list: a plain file of the step directory, or a data file of
    the run (``data_ref``). Nothing else: no other ``..``, no ``/``, no absolute path."""
    return is_file_name(name) or data_ref(name) is not None


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


_COMPACT: dict[str, Any] = {"sort_keys": True, "separators": (",", ":")}


@dataclass
class Manifest:
    step: int
    world_size: int
    files: dict[str, FileEntry]
    time: str  # ISO 8601, UTC
    torch_version: str
    muon_ckpt_version: str
    format: str = FORMAT
    # PLAIN_FORMAT_VERSION unless a file is in the run's data (``Catalog.commit`` says which):
    # older readers still read the steps that do not need this version
    format_version: int = PLAIN_FORMAT_VERSION
    key_format_version: int = KEY_FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    # The run's history (``Catalog``): ``gen`` orders commits (one more than any commit in the
    # root when it was made; 0 in manifests written before it existed), ``line`` names the
    # line of steps it continues, ``retires`` lists the commits ``[step, gen]`` it replaced
    # (a rewind's newer steps, another run's steps): no load resumes those.
    gen: int = 0
    line: str | None = None
    retires: list[tuple[int, int]] = field(default_factory=list)
    # Format 3: the directory under <url>/data/ this save wrote its data files to (None: the
    # step's data files are in its own directory, or it wrote none)
    data: str | None = None
    # Format 3: the generation of the save that wrote each data directory the step lists (a
    # save refers only to data written fewer than ``dedup_max_age`` saves before it)
    data_gens: dict[str, int] = field(default_factory=dict)
    # Of ``retires``, the commits a load passed over (``[step, gen, why]``: it could not read
    # them when it fell back to an older step): retired, but kept until retention or prune
    passed_over: list[tuple[int, int, str]] = field(default_factory=list)

    @classmethod
    def new(
        cls,
        step: int,
        world_size: int,
        files: dict[str, FileEntry],
        extra: dict[str, Any],
        *,
        compressed: bool,
        **history: Any,
    ) -> Manifest:
        """A commit's manifest, made now by this version: the oldest format that reads it
        (compressed items: 4; files in the run's data: 3; else 2); ``history``: ``gen``,
        ``line``, ``retires``, ``data``, ``data_gens``, ``passed_over``."""
        import torch  # (here: the layout's names load without torch)

        shared = any(data_ref(n) is not None for n in files)
        version = SHARED_FORMAT_VERSION if shared else PLAIN_FORMAT_VERSION
        return cls(
            step=step,
            world_size=world_size,
            files=dict(sorted(files.items())),
            format_version=COMPRESSED_FORMAT_VERSION if compressed else version,
            time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            torch_version=torch.__version__,
            muon_ckpt_version=__version__,
            extra=extra,
            **history,
        )

    def to_json(self, limit: int = MAX_MANIFEST_BYTES) -> bytes:
        """Indented JSON, one file to a line: a file's entry as compact JSON (json's C
        encoder; its indenting encoder, pure Python, took seconds for the thousands of
        files and million digests of a 2,048-rank step). A CheckpointError when it is
        longer than ``limit``, which every reader refuses (``MAX_MANIFEST_BYTES``): a save
        must not commit a step no load can read."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "files"}
        for k in ("data", "data_gens", "passed_over"):  # (absent where not used)
            if not d[k]:
                del d[k]
        d["files"] = None  # (placed in sorted order below)
        out = []
        for k, v in sorted(d.items()):
            if k == "files":
                entries = [
                    f"{json.dumps(n)}: {json.dumps(e.to_dict(), **_COMPACT)}"
                    for n, e in sorted(self.files.items())
                ]
                text = "{\n  " + ",\n  ".join(entries) + "\n }" if entries else "{}"
            else:  # (a JSON string holds no newline: indenting after each one is safe)
                text = json.dumps(v, indent=1, sort_keys=True).replace("\n", "\n ")
            out.append(f" {json.dumps(k)}: {text}")
        data = ("{\n" + ",\n".join(out) + "\n}").encode()
        if len(data) > limit:
            raise CheckpointError(
                f"step {self.step}: its manifest would have {len(data)} bytes, more than the "
                f"{limit} a reader accepts ({len(self.files)} files; each tensor a rank writes "
                "adds about 90 bytes); it is not committed. Save fewer, larger tensors, or "
                "with dedup=False (no SHA-256 per tensor)"
            )
        return data

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def written_bytes(self) -> int:
        """The bytes this step's save wrote: its files, less those it refers to in the data
        of earlier saves."""
        return sum(
            f.size
            for n, f in self.files.items()
            if (ref := data_ref(n)) is None or ref[0] == self.data
        )

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """The manifest in ``data``: CheckpointVersionError for a newer format (checked
        first: a newer manifest may look invalid to this version), CheckpointCorruptError for
        anything invalid, integers out of bounds included."""
        try:
            d = json.loads(data)  # nesting is bounded: too deep raises RecursionError
            if not isinstance(d, dict):
                raise ValueError(f"it holds a JSON {type(d).__name__}, not an object")
            if d.get("format") != FORMAT:
                raise ValueError(f"format is {str(d.get('format'))[:40]!r}, expected {FORMAT!r}")
            version = _bounded("format_version", d["format_version"])
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise _unreadable(where, e) from e
        if version > FORMAT_VERSION:
            raise CheckpointVersionError(
                f"{where}: written by a newer muon-ckpt (format_version {version}; this "
                f"muon-ckpt {__version__} reads up to {FORMAT_VERSION}): upgrade muon-ckpt. "
                "This version never loads, deletes or writes beside such a step"
            )
        try:
            files = {k: _file_entry(k, v) for k, v in _mapping("files", d["files"]).items()}
            step = _bounded("step", d["step"])
            if step > MAX_STEP:
                raise ValueError(f"step {step} has more than 8 digits")
            retires = [_retired(r) for r in d.get("retires") or []]
            line = d.get("line")
            if line is not None and not (isinstance(line, str) and _LINE_RE.fullmatch(line)):
                raise ValueError(f"line {str(line)[:40]!r} is not an id of 1-64 letters/digits")
            data = d.get("data")
            if data is not None and not (isinstance(data, str) and _DATA_DIR_RE.match(data)):
                raise ValueError(f"data {str(data)[:40]!r} is not a data directory's name")
            gens = {k: _bounded("a data gen", g) for k, g in _data_gens(d.get("data_gens"))}
            passed = [_passed(r) for r in d.get("passed_over") or []]
            if not {(s, g) for s, g, _ in passed} <= set(retires):
                raise ValueError("passed_over lists a commit that retires does not")
            shared = [n for n in files if data_ref(n) is not None]
            if shared and version < SHARED_FORMAT_VERSION:
                raise ValueError(
                    f"format_version {version} lists files of the run's data ({shared[0]!r})"
                )
            return cls(
                step=step,
                world_size=_bounded("world_size", d["world_size"], low=1),
                files=files,
                time=str(d["time"]),
                torch_version=str(d["torch_version"]),
                muon_ckpt_version=str(d["muon_ckpt_version"]),
                format=d["format"],
                format_version=version,
                key_format_version=_bounded("key_format_version", d.get("key_format_version", 1)),
                extra=dict(_mapping("extra", d.get("extra", {}))),
                gen=_bounded("gen", d.get("gen", 0)),
                line=line,
                retires=retires,
                data=data,
                data_gens=gens,
                passed_over=passed,
            )
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise _unreadable(where, e) from e


_LINE_RE = re.compile(r"[A-Za-z0-9]{1,64}")


def _unreadable(where: str, e: BaseException) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{where}: manifest is unreadable ({str(e)[:300]}); the step cannot be trusted. "
        "Load another step (muon-ckpt ls lists them) or delete this one"
    )


def _mapping(name: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError(f"{name} must be a JSON object, found a {type(v).__name__}")
    return v


def _retired(r: Any) -> tuple[int, int]:
    if not isinstance(r, list) or len(r) != 2:
        raise ValueError(f"retires must hold [step, gen] pairs, found {str(r)[:40]!r}")
    return _bounded("a retired step", r[0]), _bounded("a retired gen", r[1])


def _data_gens(v: Any) -> list[tuple[str, Any]]:
    """A manifest's ``data_gens``: {data directory name: generation}."""
    pairs = list(_mapping("data_gens", v if v is not None else {}).items())
    bad = [k for k, _ in pairs if not (isinstance(k, str) and _DATA_DIR_RE.match(k))]
    if bad:
        raise ValueError(f"data_gens: {str(bad[0])[:40]!r} is not a data directory's name")
    return pairs


def _passed(r: Any) -> tuple[int, int, str]:
    if not (isinstance(r, list) and len(r) == 3 and isinstance(r[2], str)):
        raise ValueError(f"passed_over must hold [step, gen, why] triples, found {str(r)[:40]!r}")
    return _bounded("a passed-over step", r[0]), _bounded("a passed-over gen", r[1]), r[2]


def _file_entry(name: str, v: Any) -> FileEntry:
    if not is_stored_name(name) or name == MANIFEST:
        raise ValueError(
            f"it lists the file {name[:80]!r}: a checkpoint holds plain file names inside "
            "its step directory, and ../data/<8 digits>-<16 hex>/<file> for the run's data, "
            "only (no other '/', '..' or absolute paths)"
        )
    _mapping(f"file {name!r}", v)
    for k in ("size", "chunk_bytes"):
        x = v.get(k)
        if x is not None or k == "size":
            _bounded(f"file {name!r}: {k}", x)
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
