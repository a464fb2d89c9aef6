"""One step directory: its manifest read, and its status.

A step directory ``step-XXXXXXXX`` is

* COMMITTED when its ``manifest.json`` is present and valid (it parses, within bounds, and
  its ``step`` is the directory's step) and no later commit retired it (``_lines``): listed
  by ``steps()``, loaded, counted and deleted by retention, verified;
* SUPERSEDED when it is committed but a later commit retired it (a rewind's abandoned line,
  another run's steps): never loaded or counted, deleted by the next save; or a step a load
  passed over (``passed_over``: it could not be read): never loaded, kept until retention or
  ``prune`` deletes it;
* NEWER when its manifest is of a newer format than this version reads: never loaded,
  deleted or written beside (``load()`` and ``save()`` say "upgrade muon-ckpt");
* CORRUPT when its manifest is present but invalid: never loaded, never deleted by
  retention or leftover clean-up;
* UNCOMMITTED without a manifest (a save that crashed or is running): ignored, and removed
  by the next save.

A step's directories (``step_dirs``) are its own and an overwrite's (``overwrite-step-...``,
written beside it and swapped in at the commit); ``pick`` says which stands for the step. An
``overwrite-`` entry that is a symbolic link is never a version of the step (this library
writes none: it is another run's step, linked along): never read, and unlinked as a leftover
by the next save (``Catalog.begin``).
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from muon_ckpt._errors import CheckpointCorruptError, CheckpointVersionError
from muon_ckpt.store._layout import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    STEP_PREFIX,
    Manifest,
    data_ref,
    parse_record_name,
    parse_step_dirname,
    step_dirname,
)
from muon_ckpt.store._storage import Storage

__all__ = [
    "COMMITTED",
    "CORRUPT",
    "NEWER",
    "OVERWRITE",
    "SUPERSEDED",
    "UNCOMMITTED",
    "Status",
    "StepInfo",
    "layout_of",
    "pick",
    "read_manifest",
    "read_step",
    "step_dirs",
    "write_dirname",
]

OVERWRITE = "overwrite-"  # prefix of the directory an overwrite is written to


def write_dirname(step: int, overwrite: bool) -> str:
    """Where a save of ``step`` writes its files: the step's directory, or beside it for an
    overwrite (swapped in at the commit)."""
    return OVERWRITE + step_dirname(step) if overwrite else step_dirname(step)


class Status(str, enum.Enum):
    """A step's status (the module says what each means); a ``str``, so that it compares,
    prints and serialises as its value."""

    COMMITTED = "committed"
    SUPERSEDED = "superseded"
    NEWER = "newer"
    CORRUPT = "corrupt"
    UNCOMMITTED = "uncommitted"

    def __str__(self) -> str:
        return self.value


COMMITTED, SUPERSEDED, NEWER = Status.COMMITTED, Status.SUPERSEDED, Status.NEWER
CORRUPT, UNCOMMITTED = Status.CORRUPT, Status.UNCOMMITTED


@dataclass
class StepInfo:
    """One ``step-*`` directory and its status."""

    step: int
    dirname: str
    status: Status
    size: int | None = None  # bytes: the manifest's total, else what the listing shows
    files: int | None = None
    time: str | None = None  # ISO 8601 UTC: the manifest's, else the newest file's
    world_size: int | None = None
    problem: str | None = None  # why the step is not loadable
    gen: int | None = None  # the commit's generation (_lines), from the manifest
    line: str | None = None  # the line of steps it belongs to, from the manifest
    retires: list[tuple[int, int]] = field(default_factory=list, repr=False)
    # Of those, the commits a load passed over, ``(step, gen, why)`` (from the manifest)
    passes: list[tuple[int, int, str]] = field(default_factory=list, repr=False)
    # A SUPERSEDED step a load passed over: why it could not read it (then kept until
    # retention or prune deletes it, ``_lines``)
    passed_over: str | None = None
    # A memory-tier step's: the url's newest commit when it was saved, (step, gen, line)
    base: tuple[int, int, str | None] | None = field(default=None, repr=False)
    # The model's parallel layout, from the manifest: {"meshes": [{"shape", "dims"}],
    # "params": {fqn: {"mesh", "placements"}}} (docs/format.md); None: plain tensors, or an
    # older manifest
    layout: dict[str, Any] | None = field(default=None, repr=False)
    # The objects in its directory: its manifest and the files it lists there (not the run's
    # data), which a listing of the step directories returns (``_memo``)
    stored: int | None = field(default=None, repr=False)
    # The data directories (``<url>/data/``) its manifest names files of (``_data.collect``)
    refers: list[str] = field(default_factory=list, repr=False)

    @property
    def committed(self) -> bool:
        return self.status == COMMITTED

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("retires", "base", "passes", "layout", "stored", "refers"):
            del d[k]
        return {**d, "committed": self.committed}


def read_manifest(storage: Storage, dirname: str, step: int | None) -> Manifest:
    """The valid manifest of ``dirname`` (``step``: the step it must name). Raises
    FileNotFoundError when absent, CheckpointVersionError for a newer format,
    CheckpointCorruptError when invalid."""
    where = storage.url_of(dirname, MANIFEST)
    data = storage.read_bytes(dirname, MANIFEST, limit=MAX_MANIFEST_BYTES)
    m = Manifest.from_json(data, where)
    if step is not None and m.step != step:
        raise CheckpointCorruptError(
            f"{where}: the manifest says step {m.step} but lies in the directory of step "
            f"{step}; the step cannot be trusted. Load another step or delete this one"
        )
    return m


def layout_of(m: Manifest) -> dict[str, Any] | None:
    """The manifest's record of the model's layout, or None (none, or not of its shape: the
    record only informs, nothing is loaded by it)."""
    got = m.extra.get("layout")
    ok = (
        isinstance(got, dict)
        and isinstance(got.get("meshes"), list)
        and isinstance(got.get("params"), dict)
        and all(isinstance(v, dict) for v in got["params"].values())
    )
    return got if ok else None


def read_step(
    storage: Storage,
    name: str,
    step: int,
    *,
    detail: bool = False,
    read: Callable[[Storage, str, int | None], Manifest] = read_manifest,
) -> StepInfo:
    """The status of directory ``name`` of ``step`` (SUPERSEDED is decided over all steps,
    by ``_lines.mark_superseded``); ``detail``: size, file count and time of a directory
    that is not committed, from a listing; ``read``: how its manifest is read (``_memo``)."""
    info = StepInfo(step, name, UNCOMMITTED, problem="no manifest.json: not committed")
    try:
        m = read(storage, name, step)
    except FileNotFoundError:
        pass
    except CheckpointVersionError as e:
        info.status, info.problem = NEWER, str(e)
    except CheckpointCorruptError as e:
        info.status, info.problem = CORRUPT, str(e)
    else:
        info.status, info.problem = COMMITTED, None
        info.size, info.files = m.total_bytes, len(m.files)
        info.time, info.world_size = m.time, m.world_size
        info.gen, info.line, info.retires = m.gen, m.line, list(m.retires)
        info.passes = list(m.passed_over)
        info.layout = layout_of(m)
        info.stored = 1 + sum(1 for n in m.files if data_ref(n) is None)
        info.refers = sorted({ref[0] for n in m.files if (ref := data_ref(n)) is not None})
    if detail and not info.committed:
        found = storage.walk_info(name)
        info.size = sum(int(i.get("size") or 0) for i in found.values())
        info.files = len(found)
        times = [t for t in (_mtime(i) for i in found.values()) if t is not None]
        if times:
            info.time = datetime.datetime.fromtimestamp(
                max(times), datetime.timezone.utc
            ).isoformat(timespec="seconds")
    return info


def _mtime(info: dict[str, Any]) -> float | None:
    for k in ("mtime", "LastModified", "last_modified", "created"):
        v = info.get(k)
        if isinstance(v, datetime.datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
    return None


def step_dirs(
    storage: Storage,
) -> tuple[dict[int, list[str]], list[str], list[str], list[str]]:
    """step -> its directories (its own first, then an overwrite's); the names that look like
    steps but are not directories with canonical names (``Catalog.ignored``); the
    ``overwrite-`` entries that are symbolic links (no version of a step: leftovers); and,
    from the same listing, the names of the memory tier's line records (``_records``)."""
    steps: dict[int, list[str]] = {}
    junk, links, records = [], [], []
    for name, is_dir in storage.list_dirs().items():
        if not is_dir and parse_record_name(name) is not None:
            records.append(name)
        base = name.removeprefix(OVERWRITE)
        if not base.startswith(STEP_PREFIX):
            continue
        step = parse_step_dirname(base)
        if step is None or not is_dir:
            junk.append(name)
        elif name.startswith(OVERWRITE) and storage.is_link(name):
            links.append(name)
        else:
            dirs = steps.setdefault(step, [])
            dirs.insert(len(dirs) if name.startswith(OVERWRITE) else 0, name)
    return steps, junk, links, records


def pick(infos: list[StepInfo]) -> StepInfo | None:
    """Which of a step's directories (its own first, then an overwrite's) stands for it: the
    committed one with the later commit (its own on a tie, or when none is committed, unless
    it has no manifest); an overwrite's directory only when committed (anything else there is
    a leftover, not a step). A directory of a newer format always stands."""
    own = infos[0] if infos and not infos[0].dirname.startswith(OVERWRITE) else None
    staged = [i for i in infos if i.dirname.startswith(OVERWRITE) and i.status == COMMITTED]
    if own is not None and own.status == NEWER:
        return own
    best = own
    for i in staged:
        if best is None or best.status != COMMITTED or (i.gen or 0) > (best.gen or 0):
            best = i
    return best
