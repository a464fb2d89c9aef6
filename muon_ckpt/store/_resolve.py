"""Readers over the catalog for the CLI and interop: ``resolve`` a URL to one checkpoint
directory, ``verify`` every file of a step and its metadata, ``prune`` old steps (under the
run's write lease, so never beside a save)."""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.distributed.checkpoint.metadata import Metadata

from muon_ckpt._errors import CheckpointCorruptError, CheckpointNotFoundError
from muon_ckpt._progress import progress_bar
from muon_ckpt.store._catalog import Catalog
from muon_ckpt.store._checksum import file_checksum
from muon_ckpt.store._data import listing
from muon_ckpt.store._files import check_files
from muon_ckpt.store._layout import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    METADATA,
    FileEntry,
    Manifest,
    data_ref,
    parse_step_dirname,
)
from muon_ckpt.store._lease import PRUNE, PRUNE_LEASE_SECONDS, Lease
from muon_ckpt.store._lines import aged_out
from muon_ckpt.store._metadata import check_paths, check_ranges, parse_metadata
from muon_ckpt.store._steps import (
    CORRUPT,
    NEWER,
    SUPERSEDED,
    UNCOMMITTED,
    read_manifest,
)
from muon_ckpt.store._storage import Storage

__all__ = ["PruneResult", "Resolved", "VerifyResult", "prune", "resolve", "verify"]

MAX_PLAIN_METADATA = 1 << 30  # a plain DCP directory's .metadata (no manifest to bound it)


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

    def metadata(self, *, tiles: bool = True) -> Metadata:
        """The DCP metadata; for a muon-ckpt step after checking every file's size and the
        metadata's checksum against the manifest (``tiles``: chunks must tile each tensor;
        not in a memory-tier part, which holds one rank's shards)."""
        if self.manifest is not None:
            return check_files(self.storage, self.parts, self.manifest, tiles)
        where = self.storage.url_of(*self.parts, METADATA)
        try:
            data = self.storage.read_bytes(*self.parts, METADATA, limit=MAX_PLAIN_METADATA)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{where}: no DCP metadata; not a checkpoint") from e
        md = parse_metadata(data, where)
        check_paths(md, None, where)
        # No manifest to bound the items: the files' sizes as listed do (a reader sizes
        # buffers from the items' lengths, and a tensor's bytes from its items).
        sizes = {n: int(i.get("size") or 0) for n, i in self.storage.walk_info(*self.parts).items()}
        check_ranges(md, sizes, where)
        return md


def resolve(storage: Storage, step: int | None = None) -> Resolved:
    """The checkpoint at ``storage``'s root: a run root (newest committed step, or ``step``),
    one step directory, or a plain DCP directory (no manifest)."""
    storage.check_root()
    root_name = posixpath.basename(storage.root.rstrip("/"))
    own = parse_step_dirname(root_name)
    if storage.exists(MANIFEST):
        m = read_manifest(storage, "", own)
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
    return Resolved(storage, (cat.dirname(step),), step, cat.manifest(step))


@dataclass
class VerifyResult:
    checked: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    # The step was deleted (or replaced by an overwrite) while it was verified: what was
    # missing then says nothing about its files, so ``problems`` is empty.
    deleted: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(
    r: Resolved,
    *,
    progress: bool | None = None,
    tiles: bool = True,
    check_items: Callable[[Storage, Metadata], list[str]] | None = None,
) -> VerifyResult:
    """Check every file of the manifest for presence, size and checksums, then what a load
    checks before it reads (``check_files``, as the load's decision does: the metadata's
    checksum, every tensor's chunks tiling it (``tiles``), every item inside its file), then
    ``check_items(step, metadata)`` (the problems of the items, as the load path finds them
    when it reads: ``load.verify_step`` passes them). A step that retention, a prune or an
    overwrite deleted meanwhile is ``deleted``, not damaged."""
    if r.manifest is None:
        raise CheckpointNotFoundError(
            f"{r.url!r} has no {MANIFEST}: only muon-ckpt checkpoints can be verified"
        )
    res = _check_files(r, r.manifest, progress)
    if not res.problems:  # damaged files: their metadata and items say nothing more
        try:
            md = r.metadata(tiles=tiles)
            if check_items is not None:
                res.problems += check_items(r.storage.child(*r.parts), md)
        except CheckpointCorruptError as e:
            res.problems.append(str(e))
        except FileNotFoundError as e:  # listed a moment ago (see below)
            res.problems.append(f"missing: {e}")
    # Deleting a step removes its manifest first: a file found missing (or changed) after that
    # is the deletion's doing, and the manifest read again tells.
    if res.problems and _gone(r):
        res.problems, res.deleted = [], True
    return res


def _gone(r: Resolved) -> bool:
    """Whether the step verified is no longer there in the version its manifest describes."""
    where = r.storage.url_of(*r.parts, MANIFEST)
    try:
        data = r.storage.read_bytes(*r.parts, MANIFEST, limit=MAX_MANIFEST_BYTES)
        return Manifest.from_json(data, where) != r.manifest
    except FileNotFoundError:
        return True
    except CheckpointCorruptError:
        return False  # damaged, not deleted: the problems stand


def _check_files(r: Resolved, m: Manifest, progress: bool | None) -> VerifyResult:
    """Presence, size and checksums of every file manifest ``m`` of ``r`` lists."""
    st, res = r.storage, VerifyResult()
    try:
        infos = listing(st, r.parts, set(m.files))
    except CheckpointCorruptError as e:  # its data behind a symbolic link (another run's)
        res.problems.append(str(e))
        return res
    present = {n: int(i.get("size") or 0) for n, i in infos.items()}
    own = {n for n in present if data_ref(n) is None}  # (a data directory is shared)
    res.unexpected = sorted(own - set(m.files) - {MANIFEST})
    total = sum(e.size for e in m.files.values())
    with progress_bar(total, f"verify step {r.step}", enabled=progress) as bar:
        for name, entry in sorted(m.files.items()):
            res.checked += 1
            if name not in present:
                res.problems.append(f"{name}: missing (manifest: {entry.size} bytes)")
                continue
            if infos[name].get("type") != "file" or infos[name].get("islink"):
                res.problems.append(f"{name}: not a regular file (a link, FIFO or device)")
                continue
            if present[name] != entry.size:
                res.problems.append(
                    f"{name}: size {present[name]} bytes, manifest says {entry.size}"
                )
                bar.update(entry.size)
                continue
            try:
                with st.open(*r.parts, name, ahead=[(0, entry.size)]) as f:
                    got = file_checksum(f, entry, bar.update, st.url_of(*r.parts, name))
            except FileNotFoundError:  # listed a moment ago: deleted since (verify checks)
                res.problems.append(f"{name}: missing (manifest: {entry.size} bytes)")
                continue
            res.bytes += got.size
            if got.hexdigest() != entry.digest:
                res.problems.append(f"{name}: {_differs(got.hexdigest(), entry)} (content changed)")
    return res


def _differs(digest: str, entry: FileEntry) -> str:
    """How ``digest`` differs from ``entry``'s checksums, briefly: which byte ranges."""
    if entry.chunk_bytes is None:
        return f"{entry.algorithm} {digest}, manifest says {entry.digest}"
    starts = entry.chunk_starts()
    bad = [
        k
        for k in range(len(starts))
        if digest[8 * k : 8 * k + 8] != entry.digest[8 * k : 8 * k + 8]
    ]
    ends = [*starts[1:], entry.size]
    spans = ", ".join(f"{starts[k]}-{ends[k]}" for k in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return f"{entry.algorithm} of {len(bad)} chunk(s) differs from the manifest's (bytes {spans}{more})"


@dataclass
class PruneResult:
    deleted: list[int]
    kept: list[int]
    leftovers: list[int]  # step dirs without a manifest: reported, never deleted here
    corrupt: list[int]  # step dirs with an invalid manifest: reported, never deleted here
    newer: list[int] = field(default_factory=list)  # a newer format's: never touched here
    lines: list[str] = field(default_factory=list)  # memory-tier line records deleted


def prune(storage: Storage, keep: int, *, dry_run: bool = False) -> PruneResult:
    """Delete committed steps but the newest ``keep`` (never the newest one), holding the run's
    write lease: a CheckpointLeaseError naming the holder while a job holds it, so a prune
    never deletes beside a save. ``dry_run`` only reads (no lease)."""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ValueError(
            f"keep must be an int >= 1 (the newest step is never pruned), got {keep!r}"
        )
    cat = Catalog(storage)
    plan = _plan(cat, keep)
    if dry_run or not (plan.deleted or plan.lines):
        return plan  # nothing to delete: no lease taken, nothing written
    lease = Lease(storage, PRUNE_LEASE_SECONDS, purpose=PRUNE)
    lease.acquire("pruning (nothing was deleted)")
    try:
        plan = _plan(cat, keep)  # again, under the lease: a save may have run meanwhile
        for k, s in enumerate(plan.deleted):
            done = ", ".join(map(str, plan.deleted[:k])) or "none"
            lease.acquire(f"pruning (steps deleted so far: {done})")  # renewed, still ours
            cat.delete(s)
        lease.acquire(f"pruning (steps deleted: {', '.join(map(str, plan.deleted))})")
        cat.collect()  # the data only the deleted steps referred to
        plan.lines = cat.records.drop(plan.lines)  # (those whose records went)
    finally:
        lease.release()
    return plan


def _plan(cat: Catalog, keep: int) -> PruneResult:
    """Committed steps but the newest ``keep`` go, with the superseded ones (a replaced line's,
    which no load reads; one a load passed over once every step kept is newer, as retention
    does), and the records of lines with no commit left but the newest (``_records``); the
    others are reported."""
    infos = cat.scan()
    committed = [s.step for s in infos if s.committed]
    by = {
        status: [s.step for s in infos if s.status == status and s.passed_over is None]
        for status in (UNCOMMITTED, CORRUPT, SUPERSEDED, NEWER)
    }
    aged = aged_out(infos, set(committed[-keep:]))
    doomed = sorted(committed[:-keep] + by[SUPERSEDED] + aged)
    lines = cat.records.stale(infos, doomed, None)
    return PruneResult(doomed, committed[-keep:], by[UNCOMMITTED], by[CORRUPT], by[NEWER], lines)
