"""One save after its snapshot: write every rank's files, commit, apply retention.

``SaveJob`` runs that work either here (a synchronous save) or in a background thread (an
asynchronous one), and is the single place its failure is re-raised: ``wait()`` returns the
step once it is committed, or raises a CheckpointError naming the step and the cause.

Ordering, on every rank: ``dcp.save`` (DCP's planning collectives, then this rank's writer
threads, each file checksummed as it is written; a failure on any rank fails it on all) ->
each rank confirms that the storage holds what it wrote (``store.confirm_files``: read-back
of sizes and crc32 by default) and checksums its replicated shards (``_replicas``) -> gather
every rank's file records and checksums (or its failure) on rank 0 -> rank 0 checks the
replicas, the files and the write lease and writes the manifest (the commit) -> the outcome is
broadcast (where that fails, the manifest on the storage decides it: ``settle``) -> rank 0
applies retention, alone (it logs the outcome). A failure anywhere before the manifest leaves
the step uncommitted and every committed step untouched; retention runs only after a commit
whose files were confirmed, and a retention delete that fails is a warning (the step is
committed). An overwrite is written beside the step it replaces and swapped in at the commit.

The background thread's collectives run on a gloo group of their own (``group``), never on
the default group the training loop uses, so the two cannot interleave or deadlock. Ctrl-C
(``SaveJob.stop``) starts no new file: the step fails on every rank, unless it was committed.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import muon_ckpt._collective as coll
import muon_ckpt._dcp as _dcp
from muon_ckpt._config import ManagerConfig
from muon_ckpt._errors import CheckpointCollectiveError, CheckpointError, handled, interrupt_in
from muon_ckpt._interrupts import interrupts_deferred
from muon_ckpt._threads import join, start
from muon_ckpt.save._commit import commit_posted, settle, tidy
from muon_ckpt.save._replicas import replica_checksums
from muon_ckpt.save._snapshot import StagedSavePlanner
from muon_ckpt.save._spec import Handoff, Prebuilt, WriteSpec, Written
from muon_ckpt.save._streams import FileRecords
from muon_ckpt.save._writer import StepWriter
from muon_ckpt.store import (
    Catalog,
    SavePlan,
    confirm_files,
    write_dirname,
)

__all__ = ["SaveJob", "UrlWriter", "write_and_commit"]


_log = logging.getLogger("muon_ckpt")


def write_and_commit(w: WriteSpec, out: Written) -> None:
    """Write every rank's files, confirm them, commit the step (rank 0) and apply retention;
    ``out``: what it did."""
    since = handled()  # (a synchronous save called while the caller handles an exception)
    if w.gate is not None:
        w.gate.wait()
    _check_world(w)
    t0 = time.perf_counter()
    if w.admission.recheck is not None:  # (a collective: every rank's job is here)
        try:
            _rechecked(w)
        except BaseException:
            w.snap.staging.finish()  # (nothing written: the copies are let go)
            raise
        out.timings["recheck"], t0 = time.perf_counter() - t0, time.perf_counter()
    records = FileRecords()
    dirname = write_dirname(w.step, w.admission.plan.beside)
    writer = StepWriter(
        w.catalog.storage,
        dirname,
        records,
        w.config.write_threads,
        policy=w.policy,
        data_dir=w.data_dir,
        base=w.base,
        gen=w.admission.plan.gen,
        confirm=w.config.confirm,
        stop=w.stop,
    )
    share, failed = _write(w, writer, since)
    t1 = time.perf_counter()
    failed = _confirmed(w, writer, dirname, failed, since)
    out.timings["confirm"] = time.perf_counter() - t1
    sums: Any = {}
    if w.config.certify_replicas and failed is None and w.parts is None:  # (not a copy's)
        sums, failed = replica_checksums(w.step, w.snap.sd, w.world_size)
    out.timings["replicas"] = time.perf_counter() - t1 - out.timings["confirm"]
    gens = writer.dedup.gens(w.data_dir, w.admission.plan.gen)
    # files of earlier saves the step refers to (checked before), and its own
    files = {**writer.dedup.refs, **records.files}
    gathered = coll.gather_to_rank0((files, failed, gens, sums, share), w.group)
    try:
        coll.on_rank0(lambda: commit_posted(w, writer, dirname, gathered or [], t1 - t0), w.group)
    except CheckpointCollectiveError as e:  # (rank 0 may have committed: the storage says)
        settle(w, e)
    t2 = out.committed_at = time.perf_counter()
    out.gen = w.admission.plan.gen
    out.written_bytes = sum(e.size for e in records.files.values())
    out.referred_bytes = writer.dedup.referred_bytes
    if writer.packed[0]:
        _log.debug(
            "step %d: this rank compressed %d bytes of tensors into %d (%.3fx)",
            w.step,
            writer.packed[0],
            writer.packed[1],
            writer.packed[0] / max(1, writer.packed[1]),
        )
    if w.data_dir is not None:
        out.next_base = writer.dedup.next_base((w.step, w.admission.plan.gen), records.files, gens)
    plan = w.admission.plan
    tidies = plan.retires or plan.drop or w.catalog.records.others(w.admission.line)
    if coll.rank() == 0 and (w.config.keep_last is not None or tidies):
        tidy(w)  # (no agreement after it: a slow or failed retention cannot fail the save)
        out.timings["retention"] = time.perf_counter() - t2
    out.timings.update(
        dcp_save=t1 - t0,
        commit=t2 - t1 - out.timings["confirm"] - out.timings["replicas"],
        write_data=writer.write_seconds,
        stage_wait=w.snap.staging.wait_seconds,
        **records.thread_seconds(),
    )


def _rechecked(w: WriteSpec) -> None:
    """A save admitted from the steps the catalog knew: rank 0 runs the url's listing and
    lease (``Catalog.begin``, ``Admission.recheck``) before anything is written, and the plan
    they give is the save's (as a synchronous save's would be), unless it refers to other
    data than the snapshot was deduplicated against: then the save fails."""
    adm, recheck = w.admission, w.admission.recheck
    assert recheck is not None

    def begin() -> SavePlan:
        fresh = recheck()
        if fresh.refer_to != adm.plan.refer_to:
            raise CheckpointError(
                f"saving step {w.step} to {w.catalog.storage.url!r}: the url changed since "
                f"this save was admitted (step {adm.plan.refer_to} it refers to is no longer "
                f"its base); step {w.step} is NOT committed and nothing was written. Save "
                "again"
            )
        return fresh

    plan = coll.on_rank0(begin, w.group)
    w.handoff = dataclasses.replace(
        w.handoff, admission=dataclasses.replace(adm, plan=plan, recheck=None)
    )


def _check_world(w: WriteSpec) -> None:
    if coll.world_size() != w.world_size:  # each rank would commit its own part alone
        raise CheckpointError(
            f"saving step {w.step}: the snapshot was taken on {w.world_size} rank(s) but the "
            f"process group now has {coll.world_size()} (was it destroyed? call close() or "
            "wait() before torch.distributed.destroy_process_group()); step "
            f"{w.step} is not committed"
        )


def _write(
    w: WriteSpec, writer: StepWriter, since: BaseException | None
) -> tuple[Any, CheckpointError | None]:
    """This rank's files: the snapshot through DCP, or the prebuilt files copied (no
    collective: a failure goes to the gather, where every rank is). Returns (this rank's
    share of the metadata, for a copy; its failure, for a copy)."""
    try:
        what = f"saving step {w.step} to {w.catalog.storage.url!r}"
        if w.parts is None:
            planner = StagedSavePlanner(w.snap.staging)
            _dcp.save(w.snap.sd, writer, planner, w.group, what)
            return None, None
        return _copied(w.parts, writer, since)
    finally:
        w.snap.staging.finish()


def _confirmed(
    w: WriteSpec,
    writer: StepWriter,
    dirname: str,
    failed: CheckpointError | None,
    since: BaseException | None,
) -> CheckpointError | None:
    """This rank's failure so far, else whether its files are on the storage as written (a
    deferred snapshot's sources unchanged first): every rank must reach the gather after it,
    where rank 0 raises it for all."""
    try:
        if failed is not None:
            raise failed
        w.check_stop()
        if w.snap.deferred is not None:  # every copy has landed (finish): was a source changed?
            w.snap.deferred.verify()
        records = writer.fs.records.files
        confirm_files(writer.storage, dirname, records, w.config.confirm, writer.thread_count)
    except Exception as e:
        if interrupt_in(e, since) is not None:
            raise  # (a Ctrl-C that broke the read-back, as if raised itself: the manager's
            # public call lets it out; the other ranks' collectives time out, as for one)
        step = f"confirming step {w.step}"
        return e if isinstance(e, CheckpointError) else _dcp.dcp_failure(e, step)
    return None


def _copied(
    parts: Prebuilt, writer: StepWriter, since: BaseException | None
) -> tuple[Any, CheckpointError | None]:
    """This rank's prebuilt files copied: (its share of the metadata, None), or (None, why)."""
    try:
        writer.fs.mkdir(writer.path)  # (as DCP's prepare_local_plan makes the step directory)
        return parts.copy(writer), None
    except Exception as e:
        if interrupt_in(e, since) is not None:
            raise
        return None, e if isinstance(e, CheckpointError) else CheckpointError(f"{e!r}")


class SaveJob:
    """The write and commit of one step: ``start()`` runs it in a background thread, ``run()``
    in this one; ``wait()`` joins it, calls ``finish`` with its results (in the caller's
    thread: it gives the snapshot's buffers back) and returns the step, or raises."""

    def __init__(self, spec: WriteSpec, finish: Callable[[Written], None]) -> None:
        self.spec = spec
        self.step = spec.step
        self.written = Written()
        self._finish: Callable[[Written], None] | None = finish
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._background = False
        self.joined = False  # the work has ended and was joined
        # Set when the work has ended. Waited on rather than Thread.join(): a join that Ctrl-C
        # interrupts can report a live thread as ended on the next call (CPython).
        self._ended = threading.Event()

    def _run(self) -> None:
        try:
            write_and_commit(self.spec, self.written)
        except BaseException as e:
            self._error = e
        finally:
            self._ended.set()

    def start(self) -> None:
        # Not a daemon: like DCP's async_save executor, an interpreter that exits with a save
        # pending lets it finish (or fail) before it goes; it never leaves half a commit.
        self._background = True
        self._thread = threading.Thread(
            target=self._run, name=f"muon_ckpt-save-{self.step}", daemon=False
        )
        start(self._thread)

    def stop(self) -> None:
        """Ctrl-C (from its signal handler): no new file starts; uncommitted, it fails."""
        self.spec.stop.set()

    def run(self) -> int:
        """The job in this thread; Ctrl-C stops it (``stop``) and is raised once ``finish``
        ran: files end whole, ranks fail together, a step committed is recorded so."""
        with interrupts_deferred(self.stop):
            self._run()
            return self.wait()

    def done(self) -> bool:
        return self._thread is None or self._ended.is_set()

    def wait(self) -> int:
        """Join the work (Ctrl-C while it runs keeps it pending); then, once, Ctrl-C deferred,
        give the snapshot's buffers back and return the step or raise the failure."""
        if self._thread is not None:
            self._ended.wait()
        with interrupts_deferred():
            if self._thread is not None:
                join(self._thread)
            self.joined = True
            finish, self._finish = self._finish, None
            err, self._error = self._error, None
            try:
                if finish is not None:
                    finish(self.written)
            finally:
                if err is not None:
                    self._raise(err)
        return self.step

    def _raise(self, err: BaseException) -> None:
        if not self._background or getattr(err, "committed", False):
            raise err  # (committed: the error says where the step is)
        ours = isinstance(err, CheckpointError)
        raise (type(err) if ours else CheckpointError)(  # (the cause says whether it committed)
            f"the asynchronous save of step {self.step} failed: "
            f"{'' if ours else type(err).__name__ + ': '}{err}"
        ) from err


class UrlWriter:
    """The url's writer: a step written to the url as a ``SaveJob``, from its snapshot or
    from ``parts`` written elsewhere (the memory tier's, at the flush). It keeps no job and
    knows nothing of the memory tier: the save coordinator (``muon_ckpt._saves``) admits the
    step, takes the snapshot and holds the job."""

    def __init__(self, catalog: Catalog, config: ManagerConfig) -> None:
        self.catalog, self.config = catalog, config

    def job(
        self,
        h: Handoff,
        group: Any,
        *,
        finish: Callable[[Written], None],
        verified: tuple[int, int] | None = None,
        gate: threading.Event | None = None,
        parts: Prebuilt | None = None,
    ) -> SaveJob:
        """The write of ``h`` on ``group`` (``verified``: the newest step known to verify,
        which retention keeps; ``gate``: tests, for a snapshot written in the background)."""
        gate = gate if h.snap.background else None
        spec = WriteSpec(self.catalog, self.config, h, coll.world_size(), group, verified, gate)
        spec.parts = parts
        return SaveJob(spec, finish)
