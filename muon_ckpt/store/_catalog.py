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

Only canonical names count (``step-`` and exactly 8 digits); ``ignored()`` lists the other
``step-*`` names for ``ls``. Nothing a step's files say can make a reader leave its directory:
the manifest names plain files in it, the DCP metadata only files the manifest lists, local
files are read only when regular (no FIFO, device or symlink), and no more than their size.

Commit protocol: every rank's files are closed (and fsynced, locally) and confirmed on the
storage (``_confirm``) before rank 0 checks the write lease (``_lease``) and writes the
manifest, LAST, with every file's size and checksums, and reads it back. Deleting a step removes
the manifest FIRST, so a crash while deleting leaves an uncommitted directory, never a
committed step with missing files; a step directory that is a symlink is unlinked, never
followed. An overwrite is written beside the committed step (``overwrite-step-XXXXXXXX``),
committed there, then swapped in (locally one atomic ``renameat2(RENAME_EXCHANGE)``), so a
crash never leaves fewer committed steps than before (object stores: see ``_swap_in``).
Writing operations run on rank 0 only; the manager broadcasts the outcome.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from muon_ckpt._errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointStorageError,
)
from muon_ckpt._version import __version__
from muon_ckpt.store._checksum import Checksum
from muon_ckpt.store._layout import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    METADATA,
    STEP_PREFIX,
    FileEntry,
    Manifest,
    parse_step_dirname,
    step_dirname,
)
from muon_ckpt.store._lease import DEFAULT_LEASE_SECONDS, Lease
from muon_ckpt.store._metadata import check_paths, check_ranges, parse_metadata
from muon_ckpt.store._storage import Storage

__all__ = [
    "COMMITTED",
    "CORRUPT",
    "UNCOMMITTED",
    "Catalog",
    "StepInfo",
    "check_files",
    "read_manifest",
    "write_dirname",
]

COMMITTED, CORRUPT, UNCOMMITTED = "committed", "corrupt", "uncommitted"
_OVERWRITE = "overwrite-"  # prefix of the directory an overwrite is written to

_log = logging.getLogger("muon_ckpt")


def write_dirname(step: int, overwrite: bool) -> str:
    """Where a save of ``step`` writes its files: the step's directory, or beside it for an
    overwrite (swapped in at the commit)."""
    return _OVERWRITE + step_dirname(step) if overwrite else step_dirname(step)


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


def read_manifest(storage: Storage, dirname: str, step: int | None) -> Manifest:
    """The valid manifest of ``dirname`` (``step``: the step it must name). Raises
    FileNotFoundError when absent, CheckpointCorruptError when invalid."""
    where = storage.url_of(dirname, MANIFEST)
    data = storage.read_bytes(dirname, MANIFEST, limit=MAX_MANIFEST_BYTES)
    m = Manifest.from_json(data, where)
    if step is not None and m.step != step:
        raise CheckpointCorruptError(
            f"{where}: the manifest says step {m.step} but lies in the directory of step "
            f"{step}; the step cannot be trusted. Load another step or delete this one"
        )
    return m


class Catalog:
    """The steps under ``storage``'s root. Writers (``begin``/``commit``) hold the run's
    write lease, expiring ``lease_seconds`` after their last save."""

    def __init__(self, storage: Storage, *, lease_seconds: float = DEFAULT_LEASE_SECONDS) -> None:
        self.storage = storage
        self.lease = Lease(storage, lease_seconds)

    # ------------------------------------------------------------------ reading
    def scan(self, *, detail: bool = False) -> list[StepInfo]:
        """Every step directory, oldest first, with its status (``detail``: also size, file
        count and time of the steps that are not committed, from a listing)."""
        st = self.storage
        out: dict[int, StepInfo] = {}
        names = st.listdir()
        # A committed overwrite whose move into place was cut short: the step is read from
        # there until a save finishes the move (``_swap_in``).
        moved = {
            step: name
            for name in names
            if name.startswith(_OVERWRITE)
            and (step := parse_step_dirname(name[len(_OVERWRITE) :])) is not None
        }
        for name in [n for n in names if parse_step_dirname(n) is not None] + list(moved.values()):
            step = parse_step_dirname(name.removeprefix(_OVERWRITE))
            if step is None:
                continue
            if name.startswith(_OVERWRITE) and step in out and out[step].status != UNCOMMITTED:
                continue  # the step's own manifest stands (an overwrite not swapped in yet)
            info = StepInfo(step, name, UNCOMMITTED, problem="no manifest.json: not committed")
            try:
                m = read_manifest(st, name, step)
            except FileNotFoundError:
                pass
            except CheckpointCorruptError as e:
                info.status, info.problem = CORRUPT, str(e)
            else:
                info.status, info.problem = COMMITTED, None
                info.size, info.files = m.total_bytes, len(m.files)
                info.time, info.world_size = m.time, m.world_size
            if name.startswith(_OVERWRITE) and not info.committed:
                continue  # an overwrite being written, or left by a crash: not a step
            if detail and not info.committed:
                found = st.walk_info(name)
                info.size = sum(int(i.get("size") or 0) for i in found.values())
                info.files = len(found)
                times = [t for t in (_mtime(i) for i in found.values()) if t is not None]
                if times:
                    info.time = datetime.datetime.fromtimestamp(
                        max(times), datetime.timezone.utc
                    ).isoformat(timespec="seconds")
            out[step] = info
        return sorted(out.values(), key=lambda s: s.step)

    def ignored(self) -> list[str]:
        """Names under the root that look like steps but are not canonical (``step-`` and
        exactly 8 digits): never listed, loaded or deleted."""
        return [
            n
            for n in self.storage.listdir()
            if n.startswith(STEP_PREFIX) and parse_step_dirname(n) is None
        ]

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

    def dirname(self, step: int) -> str:
        """The directory that holds committed ``step``: its own, or the overwrite directory
        of a move into place that a crash (or, on an object store, a failed copy) cut short
        (``_swap_in``), while the step's own directory has no manifest."""
        own = step_dirname(step)
        if self.storage.exists(own, MANIFEST):
            return own
        staged = _OVERWRITE + own
        return staged if self.storage.exists(staged, MANIFEST) else own

    def manifest(self, step: int, dirname: str | None = None) -> Manifest:
        """The valid manifest of ``step`` (in ``dirname``, default: ``dirname(step)``), or
        the not-found / corrupt error."""
        try:
            return read_manifest(self.storage, dirname or self.dirname(step), step)
        except FileNotFoundError as e:
            raise self.not_found(step) from e

    def checked(self, step: int) -> tuple[Manifest, Metadata]:
        """``step``'s manifest with every file present at its size, and its DCP metadata
        (checksum-verified, safely unpickled). Raises CheckpointCorruptError naming the first
        bad file."""
        _, m, md = self.checked_at(step)
        return m, md

    def checked_at(self, step: int) -> tuple[str, Manifest, Metadata]:
        """``checked``, with the directory the step was read from."""
        name = self.dirname(step)
        m = self.manifest(step, name)
        return name, m, check_files(self.storage, (name,), m)

    # ------------------------------------------------------------------ writing (rank 0)
    def begin(self, step: int, overwrite: bool) -> None:
        """Ready a save of ``step``: take the write lease; refuse a committed (or corrupt)
        step unless ``overwrite`` (it stays until the new version is committed:
        ``write_dirname``); remove the leftovers of crashed saves (an overwrite that was
        committed but not swapped in is finished first)."""
        self.lease.acquire()
        st = self.storage
        for name in st.listdir():
            if name.startswith(_OVERWRITE):
                self._finish_or_drop(name)
        infos = {s.step: s for s in self.scan()}
        have = infos.get(step)
        if have is not None and have.status != UNCOMMITTED and not overwrite:
            what = "committed" if have.committed else f"present but CORRUPT ({have.problem})"
            raise CheckpointExistsError(
                f"{st.url_of(have.dirname)}: step {step} is already {what}; pass "
                "overwrite=True to replace it, or save another step"
            )
        for s in infos.values():
            if s.status == UNCOMMITTED:
                st.rm(s.dirname)

    def _finish_or_drop(self, name: str) -> None:
        """An ``overwrite-`` directory left by a crash: finish the move when it is committed
        and its step is not (an object store's swap was cut short); else remove it (an
        overwrite that never committed, or the old version an exchange left behind)."""
        step = parse_step_dirname(name[len(_OVERWRITE) :])
        finish = False
        if step is not None:
            try:
                read_manifest(self.storage, name, step)
                read_manifest(self.storage, step_dirname(step), step)
            except FileNotFoundError:  # the staged one is committed, the step's is gone
                finish = self.storage.exists(name, MANIFEST)
            except CheckpointCorruptError:
                finish = False
        if finish and step is not None:
            _log.warning("finishing the interrupted overwrite of step %d", step)
            self._swap_in(name, step)
        else:
            self._remove(name)

    def commit(
        self,
        step: int,
        world_size: int,
        files: dict[str, FileEntry],
        extra: dict[str, Any],
        *,
        overwrite: bool = False,
    ) -> Manifest:
        """Check that every recorded file is there with its size and that this job still
        holds the lease, then write the manifest and read it back; an overwrite is then
        swapped in for the step it replaces."""
        st, name = self.storage, write_dirname(step, overwrite)
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
        data = manifest.to_json()
        self.lease.check()
        st.write_bytes(data, name, MANIFEST)
        if st.read_bytes(name, MANIFEST, limit=len(data)) != data:
            st.rm(name, MANIFEST)
            raise CheckpointCorruptError(
                f"{st.url_of(name, MANIFEST)}: read back other bytes than were written (the "
                f"upload was damaged); step {step} is NOT committed. Check the storage"
            )
        if overwrite:
            self._swap_in(name, step)
        return manifest

    def _swap_in(self, staged: str, step: int) -> None:
        """Put the committed ``staged`` directory in the place of ``step``'s. Locally one
        atomic exchange of the two directories; on object stores (no rename) the old step
        is uncommitted, the staged files copied (server-side) and the manifest written last:
        a crash in between leaves the staged copy committed, and the next save (``begin``)
        finishes the move."""
        st, final = self.storage, step_dirname(step)
        if st.is_local:
            if not st.exists(final):
                st.rename(staged, final)
                return
            st.exchange(staged, final)
            self._remove(staged)  # now the old version (or the symlink that was the step)
            return
        try:
            self._remove(final)
            files = st.walk_files(staged)
            for fname in sorted(files):
                if fname != MANIFEST:
                    st.copy((staged, fname), (final, fname))
            st.copy((staged, MANIFEST), (final, MANIFEST))
        except Exception as e:
            try:
                stands = st.exists(final, MANIFEST)  # the old version (its manifest goes first)
            except Exception:
                stands = False
            if stands:
                raise
            err = CheckpointStorageError(
                f"{st.url_of(final)}: the new version of step {step} is committed, but moving "
                f"it into place failed ({type(e).__name__}: {e}); until the next save moves "
                f"it, step {step} is read from {st.url_of(staged)}"
            )
            err.committed = True  # (not 'not committed': SaveJob passes it on as it is)
            raise err from e
        st.rm(staged)

    def delete(self, step: int) -> None:
        """Uncommit (manifest first), then remove the files; also a committed overwrite of the
        step not moved into place yet (not one being written). A step directory that is a
        symlink (to another run's step) is unlinked: its target is never touched."""
        self._remove(step_dirname(step))
        if self.storage.exists(_OVERWRITE + step_dirname(step), MANIFEST):
            self._remove(_OVERWRITE + step_dirname(step))

    def _remove(self, name: str) -> None:
        if self.storage.is_link(name):
            self.storage.rm(name)
            return
        self.storage.rm(name, MANIFEST)
        self.storage.rm(name)

    def retain(self, keep_last: int, just_saved: int | None = None) -> list[int]:
        """Delete the oldest committed steps beyond ``keep_last``; never the newest one nor
        ``just_saved`` (the step just committed, after its files were confirmed on the
        storage: the newest step that verified). Returns the deleted steps."""
        steps = self.committed_steps()
        keep = set(steps[-keep_last:]) | {just_saved}
        victims = [s for s in steps if s not in keep]
        for s in victims:
            self.delete(s)
        return victims


def check_files(storage: Storage, parts: tuple[str, ...], m: Manifest) -> Metadata:
    """Every file of manifest ``m`` present at its size; the DCP metadata checksummed and
    parsed. Raises CheckpointCorruptError naming the first bad file."""
    infos = storage.walk_info(*parts)
    for fname, entry in sorted(m.files.items()):
        info = infos.get(fname)
        got = None if info is None else int(info.get("size") or 0)
        if info is not None and (info.get("type") != "file" or info.get("islink")):
            kind = "a symbolic link" if info.get("islink") else f"of type {info.get('type')}"
            raise CheckpointCorruptError(
                f"{storage.url_of(*parts, fname)}: is {kind}, not a regular file; a "
                "checkpoint holds regular files only. Load another step or delete this one"
            )
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
    data = storage.read_bytes(*parts, METADATA, limit=md_entry.size)
    got = Checksum.like(md_entry, where)
    got.update(data)
    if len(data) != md_entry.size or got.hexdigest() != md_entry.digest:
        raise CheckpointCorruptError(
            f"{where}: {md_entry.algorithm} {got.hexdigest()} ({len(data)} bytes), the "
            f"manifest says {md_entry.digest} ({md_entry.size} bytes); load another step"
        )
    md = parse_metadata(data, where)
    check_paths(md, set(m.files), where)
    check_ranges(md, {n: e.size for n, e in m.files.items()}, where)
    return md
