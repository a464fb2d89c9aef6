"""What is stored at a URL: steps (committed or not), one resolved checkpoint, verify, prune.

Used by the CLI, import and export. Reads only the layout of ``_layout`` through ``Storage``;
never loads the tensors.
"""

from __future__ import annotations

import posixpath
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from muon_ckpt._dcp import METADATA
from muon_ckpt._errors import CheckpointCorruptError, CheckpointNotFoundError
from muon_ckpt._layout import MANIFEST, Manifest, parse_step_dirname, step_dirname
from muon_ckpt._progress import Progress
from muon_ckpt._storage import Storage

__all__ = ["Resolved", "StepInfo", "list_steps", "prune", "resolve", "verify"]

_CHUNK = 8 * 1024 * 1024


@dataclass
class StepInfo:
    """One ``step-*`` directory: committed (has a readable manifest) or not."""

    step: int
    dirname: str
    committed: bool
    size: int
    time: str | None
    world_size: int | None
    files: int
    problem: str | None = None  # why the step is not usable
    corrupt: bool = False  # it has a manifest, but an unreadable one

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _mtime(info: dict[str, Any]) -> float | None:
    for k in ("mtime", "LastModified", "last_modified", "created"):
        v = info.get(k)
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
    return None


def _manifest(storage: Storage, *parts: str) -> Manifest:
    where = storage.url_of(*parts, MANIFEST)
    return Manifest.from_json(storage.read_bytes(*parts, MANIFEST), where)


def list_steps(storage: Storage) -> list[StepInfo]:
    """Every ``step-*`` directory under the root, oldest first."""
    out = []
    for name in storage.listdir():
        step = parse_step_dirname(name)
        if step is None:
            continue
        base = storage.path(name)
        try:
            found = storage.fs.find(base, detail=True)
        except FileNotFoundError:
            found = {}
        names = {posixpath.relpath(p, base) for p in found}
        size = sum(int(i.get("size") or 0) for i in found.values())
        info = StepInfo(step, name, False, size, None, None, len(found))
        if MANIFEST in names:
            try:
                m = _manifest(storage, name)
                info.committed = True
                info.time, info.world_size = m.time, m.world_size
                info.size, info.files = m.total_bytes, len(m.files)
            except CheckpointCorruptError as e:
                info.problem, info.corrupt = str(e), True
        if not info.committed:
            times = [t for t in (_mtime(i) for i in found.values()) if t is not None]
            if times:
                info.time = datetime.fromtimestamp(max(times), timezone.utc).isoformat(
                    timespec="seconds"
                )
            info.problem = info.problem or "no manifest.json: not committed"
        out.append(info)
    return sorted(out, key=lambda s: s.step)


@dataclass
class Resolved:
    """A checkpoint directory: ``storage`` + ``parts`` (the step dir), its manifest if ours."""

    storage: Storage
    parts: tuple[str, ...]
    step: int | None
    manifest: Manifest | None

    @property
    def url(self) -> str:
        return self.storage.url_of(*self.parts)

    @property
    def kind(self) -> str:
        return "muon-ckpt" if self.manifest is not None else "dcp"


def resolve(storage: Storage, step: int | None = None) -> Resolved:
    """The checkpoint at ``storage``'s root: a run root (newest committed step, or ``step``),
    one committed step directory, or a plain DCP directory (no manifest)."""
    storage.check_root()
    root_name = posixpath.basename(storage.root.rstrip("/"))
    if storage.exists(MANIFEST):
        m = _manifest(storage)
        if step is not None and step != m.step:
            raise CheckpointNotFoundError(
                f"{storage.url!r} is the directory of step {m.step}, not step {step}; give "
                "the run's root URL to choose a step"
            )
        return Resolved(storage, (), m.step, m)
    if storage.exists(METADATA):
        own = parse_step_dirname(root_name)
        if own is not None:
            raise CheckpointNotFoundError(
                f"{storage.url!r}: step {own} has no {MANIFEST}, so it was never committed "
                "(a save crashed or is still running); use a committed step"
            )
        if step is not None:
            raise CheckpointNotFoundError(
                f"{storage.url!r} is a plain DCP checkpoint with no steps; drop --step/step="
            )
        return Resolved(storage, (), None, None)
    steps = list_steps(storage)
    committed = [s.step for s in steps if s.committed]
    if not steps:
        raise CheckpointNotFoundError(
            f"no checkpoint at {storage.url!r}: no step-* directory, {MANIFEST} or DCP "
            f"{METADATA} there"
        )
    if step is None:
        if not committed:
            raise CheckpointNotFoundError(
                f"no committed step at {storage.url!r}: {len(steps)} step dir(s) without a "
                f"manifest (steps {[s.step for s in steps]}); nothing to read"
            )
        step = committed[-1]
    elif step not in committed:
        bad = next((s for s in steps if s.step == step and s.corrupt), None)
        if bad is not None:
            raise CheckpointCorruptError(str(bad.problem))
        raise CheckpointNotFoundError(
            f"step {step} is not a committed checkpoint at {storage.url!r}; committed steps: "
            f"{committed or 'none'}"
        )
    name = step_dirname(step)
    return Resolved(storage, (name,), step, _manifest(storage, name))


@dataclass
class VerifyResult:
    checked: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(r: Resolved, *, progress: bool | None = None) -> VerifyResult:
    """Check every file of the manifest for presence, size and crc32."""
    if r.manifest is None:
        raise CheckpointNotFoundError(
            f"{r.url!r} has no {MANIFEST}: only muon-ckpt checkpoints can be verified"
        )
    st, res = r.storage, VerifyResult()
    present = st.walk_files(*r.parts)
    res.unexpected = sorted(set(present) - set(r.manifest.files) - {MANIFEST})
    total = sum(e.size for e in r.manifest.files.values())
    with Progress(total, f"verify step {r.step}", enabled=progress) as bar:
        for name, entry in sorted(r.manifest.files.items()):
            res.checked += 1
            if name not in present:
                res.problems.append(f"{name}: missing (manifest: {entry.size} bytes)")
                continue
            if present[name] != entry.size:
                res.problems.append(
                    f"{name}: size {present[name]} bytes, manifest says {entry.size}"
                )
                bar.update(entry.size)
                continue
            crc = 0
            with st.fs.open(st.path(*r.parts, name), "rb") as f:
                while chunk := f.read(_CHUNK):
                    crc = zlib.crc32(chunk, crc)
                    res.bytes += len(chunk)
                    bar.update(len(chunk))
            if crc != int(entry.crc32, 16):
                res.problems.append(
                    f"{name}: crc32 {crc:08x}, manifest says {entry.crc32} (content changed)"
                )
    return res


@dataclass
class PruneResult:
    deleted: list[int]
    kept: list[int]
    leftovers: list[int]  # step dirs without a manifest: reported, never deleted here


def prune(storage: Storage, keep: int, *, dry_run: bool = False) -> PruneResult:
    """Delete committed steps but the newest ``keep`` (never the newest one)."""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(
            f"keep must be an int >= 1 (the newest step is never pruned), got {keep!r}"
        )
    steps = list_steps(storage)
    committed = [s.step for s in steps if s.committed]
    leftovers = [s.step for s in steps if not s.committed]
    doomed, kept = committed[:-keep], committed[-keep:]
    if not dry_run:
        for s in doomed:
            name = step_dirname(s)
            storage.rm(name, MANIFEST)  # un-commit first: a crash here leaves a leftover
            storage.rm(name)
    return PruneResult(doomed, kept, leftovers)
