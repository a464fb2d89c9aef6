"""The one catalog of what is stored under a run root: used by the manager and the CLI alike.

Steps and their status are in ``_steps`` (COMMITTED, SUPERSEDED, NEWER, CORRUPT,
UNCOMMITTED); which committed steps are live, and what a save retires, in ``_lines``. Only
canonical names of directories count (``step-`` and exactly 8 digits); ``ignored()`` lists
the other ``step-*`` entries (a plain file named like a step among them) for ``ls``. Nothing
a step's files say can make a reader leave its directory: the manifest names plain files in
it, the DCP metadata only files the manifest lists, local files are read only when regular
(no FIFO, device or symlink), and no more than their size.

Commit protocol: every rank's files are closed (and fsynced, locally) and confirmed on the
storage (``_confirm``) before rank 0 checks the write lease (``_lease``) and writes the
manifest, LAST, with every file's size and checksums, and reads it back. Deleting a step removes
the manifest FIRST, so a crash while deleting leaves an uncommitted directory, never a
committed step with missing files; a step directory that is a symlink is unlinked, never
followed (an ``overwrite-`` entry that is one is no version of its step: ``_steps``). A step written where a step already is (an overwrite, a rewind's or a new run's
replacement) is written beside it (``overwrite-step-XXXXXXXX``), committed there, then
swapped in (locally one atomic ``renameat2(RENAME_EXCHANGE)``), so a crash never leaves fewer
committed steps than before (object stores: see ``_swap_in``). Deletions of retired steps and
retention come after the commit (``tidy``). Writing operations run on rank 0 only; the
manager broadcasts the outcome.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from muon_ckpt._errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    CheckpointVersionError,
)
from muon_ckpt.store._data import collect_data
from muon_ckpt.store._files import check_files, check_written
from muon_ckpt.store._layout import MANIFEST, FileEntry, Manifest, step_dirname
from muon_ckpt.store._lease import DEFAULT_LEASE_SECONDS, Lease
from muon_ckpt.store._lines import SavePlan, Steps, aged_out, mark_superseded, plan_save
from muon_ckpt.store._memo import ManifestMemo
from muon_ckpt.store._records import LineRecords
from muon_ckpt.store._steps import (
    CORRUPT,
    NEWER,
    OVERWRITE,
    SUPERSEDED,
    UNCOMMITTED,
    StepInfo,
    layout_of,
    pick,
    read_step,
    step_dirs,
    write_dirname,
)
from muon_ckpt.store._storage import Storage

__all__ = ["Catalog", "write_dirname"]

_log = logging.getLogger("muon_ckpt")


class Catalog:
    """The steps under ``storage``'s root. Writers (``begin``/``commit``) hold the run's
    write lease, expiring ``lease_seconds`` after their last save."""

    def __init__(self, storage: Storage, *, lease_seconds: float = DEFAULT_LEASE_SECONDS) -> None:
        self.storage = storage
        self.lease = Lease(storage, lease_seconds)
        self.memo = ManifestMemo(storage, lambda: self.lease.ours)  # read once, or never
        self.records = LineRecords(storage)  # the memory tier's line records, as last scanned
        self.lease.changed_hands = self._handover
        # The steps as of this catalog's last scan under the lease, kept up to date by its
        # commits and deletions: what an asynchronous save is admitted from (``plan_cached``)
        self.known = None
        # The step directories as of the last scan, kept up to date by this catalog's own
        # changes (None: not listed yet): what the index names, where a step is read from
        self._present: set[str] | None = None

    @property
    def known(self) -> list[StepInfo] | None:
        return self._known

    @known.setter
    def known(self, infos: list[StepInfo] | None) -> None:
        # What a save reads of them, made now (in the save's job, after a commit or a
        # deletion): a save admitted from the cache makes no pass over a long run's steps
        self._known = infos
        live = None if infos is None else [i for i in infos if i.status != UNCOMMITTED]
        self._steps = None if live is None else Steps.of(live)

    def _handover(self) -> None:
        self.memo.handover()
        self.known = None

    def scan(self, *, detail: bool = False) -> list[StepInfo]:
        """Every step, oldest first, with its status (``detail``: also size, file count and
        time of the steps that are not committed, from a listing)."""
        steps, _, _, records = step_dirs(self.storage)
        self._present = {n for names in steps.values() for n in names}
        self.memo.check(sorted(self._present))
        out = []
        for step, names in sorted(steps.items()):
            info = pick([self._read_step(n, step) for n in names])
            if info is not None and info.status == CORRUPT:  # (a read fault? once more)
                info = pick([self._read_step(n, step) for n in names])
            if info is not None:
                if detail and not info.committed:
                    info = read_step(self.storage, info.dirname, step, detail=True)
                out.append(info)
        mark_superseded(out)
        self.records.scanned(records, out)
        self.known = list(out) if self.lease.ours else None
        return out

    def _read_step(self, name: str, step: int) -> StepInfo:
        return self.memo.info(name, step)

    def ignored(self) -> list[str]:
        """Entries named like steps that are not (another name than ``step-`` and 8 digits,
        or not a directory): never listed, loaded or deleted."""
        return step_dirs(self.storage)[1]

    def step_info(self, step: int | None = None) -> StepInfo | None:
        """Committed ``step`` (default: the newest) as its manifest describes it; None when
        nothing is committed."""
        committed = [i for i in self.scan() if i.committed]
        if step is None and not committed:
            return None
        found = (
            committed[-1] if step is None else next((i for i in committed if i.step == step), None)
        )
        if found is None:
            raise self.not_found(step, [i.step for i in committed])
        found.layout = layout_of(self.manifest(found.step, found.dirname))  # (not indexed)
        return found

    def committed_steps(self) -> list[int]:
        return [s.step for s in self.scan() if s.committed]

    def not_found(self, step: int | None, steps: list[int] | None = None) -> Exception:
        """The error for a step (None: any step) that is not committed here."""
        infos = self.scan()
        steps = [s.step for s in infos if s.committed] if steps is None else steps
        bad = next((s for s in infos if s.step == step and s.status in (CORRUPT, NEWER)), None)
        if bad is not None:
            cls = CheckpointVersionError if bad.status == NEWER else CheckpointCorruptError
            return cls(str(bad.problem))
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
        """The directory that holds ``step``: its own, or the overwrite directory of a move
        into place that a crash (or, on an object store, a failed copy) cut short
        (``_swap_in``) when that one holds the later commit."""
        own = step_dirname(step)
        staged = OVERWRITE + own
        if self._present is not None and staged not in self._present:
            return own  # (none when last listed: no request)
        if self.storage.is_link(staged) or not self.storage.exists(staged, MANIFEST):
            return own
        info = pick([self._read_step(n, step) for n in (own, staged)])
        return own if info is None else info.dirname

    def manifest(self, step: int, dirname: str | None = None) -> Manifest:
        """The valid manifest of ``step`` (in ``dirname``, default: ``dirname(step)``), or
        the not-found / corrupt error."""
        try:
            return self.memo.read(self.storage, dirname or self.dirname(step), step)
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

    def begin(
        self,
        step: int,
        *,
        overwrite: bool = False,
        resumed: bool = True,
        new_run: bool = False,
        abandon: list[tuple[int, int | None]] | None = None,
        refer_to: tuple[int, int] | None = None,
        pass_over: list[tuple[int, int | None, str]] | None = None,
        line: str | None = None,
    ) -> SavePlan:
        """Ready a save of ``step``: take the write lease; finish or remove the leftovers of
        crashed saves (an overwrite that was committed but not swapped in is finished first);
        decide what the save retires and refuse what it must not do (``_lines.plan_save``:
        a committed or corrupt step without ``overwrite``, another run's steps, a newer
        format); remove uncommitted directories and the data no step refers to. ``refer_to``:
        the commit ``(step, gen)`` whose files the save may refer to, kept in the plan while
        it is committed and not retired; ``pass_over``: the retired steps a load passed over,
        kept."""
        self.lease.acquire()
        st = self.storage
        steps, _, links, _ = step_dirs(st)
        for name in links:  # (another run's step linked along: unlinked, never followed)
            self._gone(name)
            st.rm(name)
        for s, names in steps.items():
            for name in names[1:] if names[0] == step_dirname(s) else names:
                self._finish_or_drop(name, s)
        infos = self.scan()
        plan = plan_save(
            infos,
            st.url,
            step,
            overwrite=overwrite,
            resumed=resumed,
            new_run=new_run,
            abandon=list(abandon or ()),
            refer_to=refer_to,
            pass_over=pass_over,
            records=self.records.gens,
            line=line,
        )
        for s in infos:
            if s.status == UNCOMMITTED:
                self._gone(s.dirname)
                st.rm(s.dirname)
        self.collect()
        return plan

    def plan_cached(self, step: int, **kw: Any) -> SavePlan | None:
        """``begin``'s decision from the steps this catalog knows, with no request (an
        asynchronous save's: its job runs ``begin`` before writing); None: nothing known."""
        if self._steps is None or not self.lease.ours:
            return None
        return plan_save(self._steps, self.storage.url, step, records=self.records.gens, **kw)

    def admit(self, step: int, **kw: Any) -> SavePlan:
        """Ready a save of ``step`` that writes nothing here (a memory-tier step): the same
        lease and the same refusals as ``begin`` (another job holds the lease, another run's
        steps, a newer format), nothing removed (a save to this url may be in flight). ``kw``:
        ``plan_save``'s (resumed, new_run, abandon, line). The plan's generation and retired
        commits go into the memory step's parts."""
        self.lease.acquire()
        # (overwrite: a memory step replaces nothing here)
        infos, url = self.scan(), self.storage.url
        return plan_save(infos, url, step, overwrite=True, records=self.records.gens, **kw)

    def _finish_or_drop(self, name: str, step: int) -> None:
        """An ``overwrite-`` directory left by a crash: finish the move when it holds the
        step's later commit (an object store's swap was cut short); else remove it (an
        overwrite that never committed, or the old version an exchange left behind)."""
        own = step_dirname(step)
        infos = [self._read_step(n, step) for n in (own, name)]
        picked = pick(infos)
        if picked is not None and picked.dirname == name:
            _log.warning("finishing the interrupted replacement of step %d", step)
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
        plan: SavePlan,
        line: str | None = None,
        data: str | None = None,
        compressed: bool = False,
        data_gens: dict[str, int] | None = None,
    ) -> Manifest:
        """Check that every recorded file is there with its size (those of the run's data it
        refers to included) and that this job still holds the lease, then write the manifest
        (with ``plan``'s generation, retired and passed-over commits, ``line``, ``data``: the
        data directory the save wrote to, and ``data_gens``: the generation of each data
        directory it lists; ``compressed``: whether its metadata has compressed items, format
        4) and read it back; a step written beside the one it replaces is then swapped in."""
        st, name = self.storage, write_dirname(step, plan.beside)
        check_written(st, name, files, step, data)
        manifest = Manifest.new(
            step,
            world_size,
            files,
            extra,
            data=data,
            compressed=compressed,
            gen=plan.gen,
            line=line,
            retires=list(plan.retires),
            data_gens=dict(sorted((data_gens or {}).items())),
            passed_over=list(plan.passed),
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
        self.memo.wrote(name, manifest)
        if self._present is not None:
            self._present.add(name)
        if plan.beside:
            self._swap_in(name, step)
        info = self._read_step(step_dirname(step), step)  # (remembered: what the index says)
        if self.known is not None:  # (the commit as a scan would find it now)
            known = [i for i in self.known if i.step != step] + [info]
            known.sort(key=lambda i: i.step)
            mark_superseded(known)
            self.known = known
        return manifest

    def _swap_in(self, staged: str, step: int) -> None:
        """Put the committed ``staged`` directory in the place of ``step``'s. Locally one
        atomic exchange of the two directories; on object stores (no rename) the old step
        is uncommitted, the staged files copied (server-side) and the manifest written last:
        a crash in between leaves the staged copy committed, and the next save (``begin``)
        finishes the move."""
        st, final = self.storage, step_dirname(step)
        self.memo.drop(final)
        self.memo.drop(staged)
        if self._present is not None:
            self._present.add(final)
        if st.is_local:
            if not st.exists(final):
                st.rename(staged, final)
                self._gone(staged)
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
        self._gone(staged)
        st.rm(staged)

    def delete(self, step: int) -> None:
        """Uncommit (manifest first), then remove the files; also a committed overwrite of the
        step not moved into place yet (not one being written). A step directory that is a
        symlink (to another run's step) is unlinked: its target is never touched."""
        self._remove(step_dirname(step))
        if self.storage.exists(OVERWRITE + step_dirname(step), MANIFEST):  # (a link: unlinked)
            self._remove(OVERWRITE + step_dirname(step))

    def _gone(self, name: str) -> None:
        """Directory ``name`` is deleted (or moved) by this catalog."""
        self.memo.drop(name)
        if self._present is not None:
            self._present.discard(name)

    def _remove(self, name: str) -> None:
        self._gone(name)
        if self.known is not None:
            self.known = [i for i in self.known if i.dirname != name]
        if self.storage.is_link(name):
            self.storage.rm(name)
            return
        self.storage.rm(name, MANIFEST)
        self.storage.rm(name)

    def tidy(
        self,
        keep_last: int | None,
        just_saved: int,
        drop: list[int] = (),
        verified: tuple[int, int] | None = None,
    ) -> tuple[list[int], list[int]]:
        """After a commit: delete the superseded steps (not those a load passed over) and the
        CORRUPT steps in ``drop`` (a replaced line's), then the oldest committed steps beyond
        ``keep_last``, never the newest one, ``just_saved`` (the step just committed) nor
        ``verified`` (``(step, gen)``: the newest step known to verify, read back whole by
        this job: ``just_saved`` itself with ``confirm="checksum"``), and the passed-over
        steps older than every step kept (``_lines.aged_out``); last, the records of other
        lines than ``just_saved``'s (``_records``). Returns (replaced, retention's) deleted."""
        infos = self.scan()
        gone = [
            i.step
            for i in infos
            if (i.status == SUPERSEDED and i.passed_over is None)
            or (i.status == CORRUPT and i.step in drop)
        ]
        for s in gone:
            self.delete(s)
        if keep_last is None:
            self.collect()
            self.records.drop(self.records.stale(infos, gone, just_saved))
            return gone, []
        steps = [i.step for i in infos if i.committed]
        keep = set(steps[-keep_last:]) | {just_saved}
        keep |= {i.step for i in infos if i.committed and (i.step, i.gen or 0) == verified}
        victims = sorted([s for s in steps if s not in keep] + aged_out(infos, keep))
        for s in victims:
            self.delete(s)
        self.collect()
        self.records.drop(self.records.stale(infos, gone + victims, just_saved))
        return gone, victims

    def publish(self) -> None:
        """Rank 0, after a save's last change: the run's index written (``_index``)."""
        st = self.storage
        if self.lease.ours and self._present is not None and (st.is_local or st.object_store):
            self.memo.publish(sorted(self._present))

    def collect(self) -> list[str]:
        """Delete the run's data files that no manifest of a step directory names (``_data``;
        rank 0, under the write lease, when no save is writing). Returns what went."""
        st, memo = self.storage, self.memo
        gone = collect_data(st, step_dirs(st)[0], self._read_step, memo.read, memo.clean)
        if gone:
            _log.info("%s: deleted data no step refers to: %s", self.storage.url, gone[:20])
        return gone
