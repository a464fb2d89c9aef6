"""The one catalog of what is stored under a run root: used by the manager and the CLI alike.

A step directory ``step-XXXXXXXX`` is

* COMMITTED when its ``manifest.json`` is present and valid: it parses, and its ``step`` is
  the directory's step. Only committed steps are listed by ``steps()``, loaded, counted and
  deleted by retention, and verified;
* CORRUPT when its manifest is present but invalid: never loaded (``load(step=)`` names the
  problem), never deleted by retention or leftover clean-up, shown as such by ``ls``, failed
  by ``verify``;
* UNCOMMITTED without a manifest (a save that crashed or is running): ignored, and removed
  by the next save.

Commit protocol: every rank's files are closed (and fsynced, locally) before rank 0 writes
the manifest, LAST, with every file's size and checksums. Deleting a step removes the manifest
FIRST, so a crash while deleting leaves an uncommitted directory, never a committed step with
missing files. Writing operations run on rank 0 only; the manager broadcasts the outcome.
"""

from __future__ import annotations

import datetime
import posixpath
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from muon_ckpt._errors import CheckpointCorruptError, CheckpointExistsError, CheckpointNotFoundError
from muon_ckpt._progress import progress_bar
from muon_ckpt._version import __version__
from muon_ckpt.store._checksum import Checksum, file_checksum
from muon_ckpt.store._layout import (
    MANIFEST,
    METADATA,
    FileEntry,
    Manifest,
    parse_step_dirname,
    step_dirname,
)
from muon_ckpt.store._metadata import parse_metadata
from muon_ckpt.store._storage import Storage

__all__ = ["COMMITTED", "CORRUPT", "UNCOMMITTED", "Catalog", "Resolved", "StepInfo", "resolve"]

COMMITTED, CORRUPT, UNCOMMITTED = "committed", "corrupt", "uncommitted"


@dataclass
class StepInfo:
    """One ``step-*`` directory and its status."""

    step: int
    dirname: str
    status: str
    size: int | None = None  # bytes: the manifest's total, else what the listing shows
    files: int | None = None
    time: str | None = None  # ISO 8601 UTC: the manifest's, else the newest file's
    world_size: int | None = None
    problem: str | None = None  # why the step is not loadable

    @property
    def committed(self) -> bool:
        return self.status == COMMITTED

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "committed": self.committed}


def _mtime(info: dict[str, Any]) -> float | None:
    for k in ("mtime", "LastModified", "last_modified", "created"):
        v = info.get(k)
        if isinstance(v, datetime.datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
    return None


def _read_manifest(storage: Storage, dirname: str, step: int | None) -> Manifest:
    """The valid manifest of ``dirname`` (``step``: the step it must name). Raises
    FileNotFoundError when absent, CheckpointCorruptError when invalid."""
    where = storage.url_of(dirname, MANIFEST)
    m = Manifest.from_json(storage.read_bytes(dirname, MANIFEST), where)
    if step is not None and m.step != step:
        raise CheckpointCorruptError(
            f"{where}: the manifest says step {m.step} but lies in the directory of step "
            f"{step}; the step cannot be trusted. Load another step or delete this one"
        )
    return m


class Catalog:
    """The steps under ``storage``'s root."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    # ------------------------------------------------------------------ reading
    def scan(self, *, detail: bool = False) -> list[StepInfo]:
        """Every step directory, oldest first, with its status (``detail``: also size, file
        count and time of the steps that are not committed, from a listing)."""
        st = self.storage
        out = []
        for name in st.listdir():
            step = parse_step_dirname(name)
            if step is None:
                continue
            info = StepInfo(step, name, UNCOMMITTED, problem="no manifest.json: not committed")
            try:
                m = _read_manifest(st, name, step)
            except FileNotFoundError:
                pass
            except CheckpointCorruptError as e:
                info.status, info.problem = CORRUPT, str(e)
            else:
                info.status, info.problem = COMMITTED, None
                info.size, info.files = m.total_bytes, len(m.files)
                info.time, info.world_size = m.time, m.world_size
            if detail and not info.committed:
                found = st.walk_info(name)
                info.size = sum(int(i.get("size") or 0) for i in found.values())
                info.files = len(found)
                times = [t for t in (_mtime(i) for i in found.values()) if t is not None]
                if times:
                    info.time = datetime.datetime.fromtimestamp(
                        max(times), datetime.timezone.utc
                    ).isoformat(timespec="seconds")
            out.append(info)
        return sorted(out, key=lambda s: s.step)

    def committed_steps(self) -> list[int]:
        return [s.step for s in self.scan() if s.committed]

    def not_found(self, step: int | None, steps: list[int] | None = None) -> Exception:
        """The error for a step (None: any step) that is not committed here."""
        infos = self.scan()
        steps = [s.step for s in infos if s.committed] if steps is None else steps
        bad = next((s for s in infos if s.step == step and s.status == CORRUPT), None)
        if bad is not None:
            return CheckpointCorruptError(str(bad.problem))
        have = ", ".join(map(str, steps)) if steps else "none"
        url = self.storage.url
        if step is None:
            return CheckpointNotFoundError(
                f"{url!r}: no committed checkpoint (committed steps: {have}). Check the URL "
                "and storage_options, or start without resume_from"
            )
        return CheckpointNotFoundError(
            f"{url!r}: step {step} is not a committed checkpoint; committed steps: {have}. "
            "Call load() for the newest, or load(step=...) with one of these"
        )

    def manifest(self, step: int) -> Manifest:
        """The valid manifest of ``step``, or the not-found / corrupt error."""
        try:
            return _read_manifest(self.storage, step_dirname(step), step)
        except FileNotFoundError as e:
            raise self.not_found(step) from e

    def checked(self, step: int) -> tuple[Manifest, Metadata]:
        """``step``'s manifest with every file present at its size, and its DCP metadata
        (checksum-verified, safely unpickled). Raises CheckpointCorruptError naming the first
        bad file."""
        m = self.manifest(step)
        return m, check_files(self.storage, (step_dirname(step),), m)

    # ------------------------------------------------------------------ writing (rank 0)
    def begin(self, step: int, overwrite: bool) -> None:
        """Ready ``step``'s directory for a save: refuse a committed (or corrupt) step unless
        ``overwrite`` (then it is deleted), and remove the leftovers of crashed saves."""
        infos = {s.step: s for s in self.scan()}
        have = infos.get(step)
        if have is not None and have.status != UNCOMMITTED:
            if not overwrite:
                what = "committed" if have.committed else f"present but CORRUPT ({have.problem})"
                raise CheckpointExistsError(
                    f"{self.storage.url_of(have.dirname)}: step {step} is already {what}; pass "
                    "overwrite=True to replace it, or save another step"
                )
            self.delete(step)
        for s in infos.values():
            if s.status == UNCOMMITTED:
                self.storage.rm(s.dirname)

    def commit(
        self, step: int, world_size: int, files: dict[str, FileEntry], extra: dict[str, Any]
    ) -> Manifest:
        """Check that every recorded file is there with its size, then write the manifest."""
        st, name = self.storage, step_dirname(step)
        listed = st.walk_files(name)
        for fname, entry in sorted(files.items()):
            if listed.get(fname) != entry.size:
                raise CheckpointCorruptError(
                    f"{st.url_of(name, fname)}: written with {entry.size} bytes but the "
                    f"storage reports {listed.get(fname)}; step {step} is NOT committed"
                )
        if METADATA not in files:
            raise CheckpointCorruptError(
                f"{st.url_of(name)}: DCP wrote no {METADATA}; step {step} is NOT committed"
            )
        manifest = Manifest(
            step=step,
            world_size=world_size,
            files=dict(sorted(files.items())),
            time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            torch_version=torch.__version__,
            muon_ckpt_version=__version__,
            extra=extra,
        )
        st.write_bytes(manifest.to_json(), name, MANIFEST)
        return manifest

    def delete(self, step: int) -> None:
        """Uncommit (manifest first), then remove the files."""
        name = step_dirname(step)
        self.storage.rm(name, MANIFEST)
        self.storage.rm(name)

    def retain(self, keep_last: int, just_saved: int | None = None) -> list[int]:
        """Delete the oldest committed steps beyond ``keep_last``; never the newest one nor
        ``just_saved``. Returns the deleted steps."""
        steps = self.committed_steps()
        keep = set(steps[-keep_last:]) | {just_saved}
        victims = [s for s in steps if s not in keep]
        for s in victims:
            self.delete(s)
        return victims


def check_files(storage: Storage, parts: tuple[str, ...], m: Manifest) -> Metadata:
    """Every file of manifest ``m`` present at its size; the DCP metadata checksummed and
    parsed. Raises CheckpointCorruptError naming the first bad file."""
    listed = storage.walk_files(*parts)
    for fname, entry in sorted(m.files.items()):
        got = listed.get(fname)
        if got is None:
            raise CheckpointCorruptError(
                f"{storage.url_of(*parts, fname)}: listed in the manifest ({entry.size} bytes) "
                "but missing; load another step or restore the file"
            )
        if got != entry.size:
            raise CheckpointCorruptError(
                f"{storage.url_of(*parts, fname)}: {got} bytes, the manifest says "
                f"{entry.size} (truncated or overwritten); load another step or restore the file"
            )
    where = storage.url_of(*parts, METADATA)
    md_entry = m.files.get(METADATA)
    if md_entry is None:
        raise CheckpointCorruptError(f"{storage.url_of(*parts, MANIFEST)}: lists no {METADATA}")
    data = storage.read_bytes(*parts, METADATA)
    got = Checksum.like(md_entry, where)
    got.update(data)
    if len(data) != md_entry.size or got.hexdigest() != md_entry.digest:
        raise CheckpointCorruptError(
            f"{where}: {md_entry.algorithm} {got.hexdigest()} ({len(data)} bytes), the "
            f"manifest says {md_entry.digest} ({md_entry.size} bytes); load another step"
        )
    return parse_metadata(data, where)


@dataclass
class Resolved:
    """A checkpoint directory: ``storage`` + ``parts`` (the step dir), its manifest when it is
    a muon-ckpt step (None for a plain DCP directory)."""

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

    def metadata(self) -> Metadata:
        """The DCP metadata; for a muon-ckpt step after checking every file's size and the
        metadata's checksum against the manifest."""
        if self.manifest is not None:
            return check_files(self.storage, self.parts, self.manifest)
        where = self.storage.url_of(*self.parts, METADATA)
        try:
            data = self.storage.read_bytes(*self.parts, METADATA)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{where}: no DCP metadata; not a checkpoint") from e
        return parse_metadata(data, where)


def resolve(storage: Storage, step: int | None = None) -> Resolved:
    """The checkpoint at ``storage``'s root: a run root (newest committed step, or ``step``),
    one step directory, or a plain DCP directory (no manifest)."""
    storage.check_root()
    root_name = posixpath.basename(storage.root.rstrip("/"))
    own = parse_step_dirname(root_name)
    if storage.exists(MANIFEST):
        m = _read_manifest(storage, "", own)
        if step is not None and step != m.step:
            raise CheckpointNotFoundError(
                f"{storage.url!r} is the directory of step {m.step}, not step {step}; give "
                "the run's root URL to choose a step"
            )
        return Resolved(storage, (), m.step, m)
    if storage.exists(METADATA):
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
    cat = Catalog(storage)
    infos = cat.scan()
    if not infos:
        raise CheckpointNotFoundError(
            f"no checkpoint at {storage.url!r}: no step-* directory, {MANIFEST} or DCP "
            f"{METADATA} there"
        )
    committed = [s.step for s in infos if s.committed]
    if step is None and not committed:
        raise CheckpointNotFoundError(
            f"no committed step at {storage.url!r}: {len(infos)} step dir(s), none "
            f"committed ({', '.join(f'{s.step}: {s.status}' for s in infos)}); nothing to read"
        )
    step = committed[-1] if step is None else step
    return Resolved(storage, (step_dirname(step),), step, cat.manifest(step))


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
    """Check every file of the manifest for presence, size and checksums."""
    if r.manifest is None:
        raise CheckpointNotFoundError(
            f"{r.url!r} has no {MANIFEST}: only muon-ckpt checkpoints can be verified"
        )
    st, res = r.storage, VerifyResult()
    present = st.walk_files(*r.parts)
    res.unexpected = sorted(set(present) - set(r.manifest.files) - {MANIFEST})
    total = sum(e.size for e in r.manifest.files.values())
    with progress_bar(total, f"verify step {r.step}", enabled=progress) as bar:
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
            with st.open(*r.parts, name) as f:
                got = file_checksum(f, entry, bar.update, st.url_of(*r.parts, name))
            res.bytes += got.size
            if got.hexdigest() != entry.digest:
                res.problems.append(f"{name}: {_differs(got.hexdigest(), entry)} (content changed)")
    return res


def _differs(digest: str, entry: FileEntry) -> str:
    """How ``digest`` differs from ``entry``'s checksums, briefly."""
    if entry.chunk_bytes is None:
        return f"{entry.algorithm} {digest}, manifest says {entry.digest}"
    bad = [i for i in range(0, len(digest), 8) if digest[i : i + 8] != entry.digest[i : i + 8]]
    c = entry.chunk_bytes
    spans = ", ".join(f"{i // 8 * c}-{min(entry.size, (i // 8 + 1) * c)}" for i in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return f"{entry.algorithm} of {len(bad)} chunk(s) differs from the manifest's (bytes {spans}{more})"


@dataclass
class PruneResult:
    deleted: list[int]
    kept: list[int]
    leftovers: list[int]  # step dirs without a manifest: reported, never deleted here
    corrupt: list[int]  # step dirs with an invalid manifest: reported, never deleted here


def prune(storage: Storage, keep: int, *, dry_run: bool = False) -> PruneResult:
    """Delete committed steps but the newest ``keep`` (never the newest one)."""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(
            f"keep must be an int >= 1 (the newest step is never pruned), got {keep!r}"
        )
    cat = Catalog(storage)
    infos = cat.scan()
    committed = [s.step for s in infos if s.committed]
    doomed, kept = committed[:-keep], committed[-keep:]
    if not dry_run:
        for s in doomed:
            cat.delete(s)
    by = {
        status: [s.step for s in infos if s.status == status] for status in (UNCOMMITTED, CORRUPT)
    }
    return PruneResult(doomed, kept, by[UNCOMMITTED], by[CORRUPT])
