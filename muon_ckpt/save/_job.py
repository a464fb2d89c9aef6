"""One save after its snapshot: write every rank's files, commit, apply retention.

``SaveJob`` runs that work either here (a synchronous save) or in a background thread (an
asynchronous one), and is the single place its failure is re-raised: ``wait()`` returns the
step once it is committed, or raises a CheckpointError naming the step and the cause.

Ordering, on every rank: ``dcp.save`` (DCP's planning collectives, then this rank's writer
threads, each file checksummed as it is written; a failure on any rank fails it on all) ->
each rank confirms that the storage holds what it wrote (``store.confirm_files``: read-back
of sizes and crc32 by default) -> gather every rank's file records (or its failure) on rank 0
-> rank 0 checks the files and the write lease and writes the manifest (the commit), then
applies retention -> the outcome is broadcast. A failure anywhere before the manifest leaves
the step uncommitted and every committed step untouched; retention runs only after a commit
whose files were confirmed, and a retention delete that fails is a warning (the step is
committed). An overwrite is written beside the step it replaces and swapped in at the commit.

The background thread's collectives run on a gloo group of their own (``group``), never on
the default group the training loop uses, so the two cannot interleave or deadlock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import muon_ckpt._collective as coll
import muon_ckpt._dcp as _dcp
from muon_ckpt._config import ManagerConfig, reads_back
from muon_ckpt._errors import CheckpointError, handled, interrupt_in
from muon_ckpt.save._dedup import DedupBase
from muon_ckpt.save._line import Admission
from muon_ckpt.save._snapshot import Snapshot, StagedSavePlanner
from muon_ckpt.save._streams import FileRecords
from muon_ckpt.save._writer import StepWriter, WritePolicy
from muon_ckpt.store import (
    METADATA,
    Catalog,
    FileEntry,
    confirm_files,
    data_dirname,
    data_ref,
    step_dirname,
    write_dirname,
)

__all__ = [
    "Handoff",
    "Prebuilt",
    "SaveJob",
    "UrlWriter",
    "WriteSpec",
    "Written",
    "write_and_commit",
]


class Prebuilt(Protocol):
    """A step's files written and checksummed elsewhere (the memory tier's parts), which a
    save copies instead of writing a snapshot: each rank copies its own, rank 0 writes the
    step's ``.metadata`` from every rank's share of it."""

    keys: int  # this rank's keys (the manifest's "keys", as len(sd) of a snapshot)

    def copy(self, writer: StepWriter) -> Any:
        """This rank's files copied (``writer.prepare`` with all their items first, then
        ``writer.copy_file`` each); its share of the metadata."""
        ...

    def metadata(self, shares: list[Any]) -> tuple[Any, list[Any]]:
        """Rank 0: the step's DCP metadata and each rank's write results, from the shares."""
        ...


_log = logging.getLogger("muon_ckpt")


@dataclass(frozen=True)
class Handoff:
    """A step as the save coordinator hands it to a writer (the url's or the memory tier's):
    its snapshot, its admission, and the optimizer's type (the manifest's, for messages)."""

    step: int
    snap: Snapshot  # host tensors (or the live ones, for a synchronous save) and objects
    admission: Admission  # rank 0's plan, the line, the save's id, what it may refer to
    optimizer: str | None = None


@dataclass
class WriteSpec:
    """What the write of one step to the url takes: the manager's options, the step handed
    over (its snapshot is written, or ``parts`` copied as they are). Its results are a
    ``Written``."""

    catalog: Catalog
    config: ManagerConfig
    handoff: Handoff
    world_size: int  # ranks that took the snapshot (the process group it needs)
    group: Any = None  # process group of the collectives (None: the default group)
    verified: tuple[int, int] | None = None  # the newest step known to verify: retention keeps it
    gate: threading.Event | None = None  # tests: the write starts once this is set
    parts: Prebuilt | None = None  # files copied as they are instead of the snapshot written

    @property
    def step(self) -> int:
        return self.handoff.step

    @property
    def snap(self) -> Snapshot:
        return self.handoff.snap

    @property
    def admission(self) -> Admission:
        return self.handoff.admission

    @property
    def policy(self) -> WritePolicy:
        return WritePolicy.of(self.config)

    @property
    def data_dir(self) -> str | None:
        """With dedup, the directory under <url>/data/ the data files go to (format 3); else
        None: the step's own directory (format 2)."""
        if not self.config.dedup:
            return None
        return data_dirname(self.step, self.admission.save_id)

    @property
    def base(self) -> DedupBase | None:
        """What the run holds that the save refers to when unchanged (with dedup)."""
        return self.admission.base if self.config.dedup else None


@dataclass
class Written:
    """What the write of one step did on this rank (filled as it goes: a failed one keeps
    what it measured)."""

    committed_at: float | None = None  # time.perf_counter() once the step was committed
    written_bytes: int = 0  # bytes of the files this rank wrote
    referred_bytes: int = 0  # bytes of the unchanged tensors it referred to instead
    next_base: DedupBase | None = None  # once committed with dedup: the next save's base
    timings: dict[str, float] = field(default_factory=dict)


def write_and_commit(w: WriteSpec, out: Written) -> None:
    """Write every rank's files, confirm them, commit the step (rank 0) and apply retention;
    ``out``: what it did."""
    since = handled()  # (a synchronous save called while the caller handles an exception)
    if w.gate is not None:
        w.gate.wait()
    _check_world(w)
    t0 = time.perf_counter()
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
    )
    share, failed = _write(w, writer, since)
    t1 = time.perf_counter()
    failed = _confirmed(w, writer, dirname, failed, since)
    out.timings["confirm"] = time.perf_counter() - t1
    gens = writer.dedup.gens(w.data_dir, w.admission.plan.gen)
    # files of earlier saves the step refers to (checked before), and its own
    files = {**writer.dedup.refs, **records.files}
    gathered = coll.gather_to_rank0((files, failed, gens, share), w.group)
    coll.on_rank0(lambda: commit(w, writer, dirname, gathered or [], t1 - t0), w.group)
    t2 = out.committed_at = time.perf_counter()
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
    if w.config.keep_last is not None or plan.retires or plan.drop:
        coll.on_rank0(lambda: tidy(w), w.group)
        out.timings["retention"] = time.perf_counter() - t2
    out.timings.update(
        dcp_save=t1 - t0,
        commit=t2 - t1 - out.timings["confirm"],
        write_data=writer.write_seconds,
        stage_wait=w.snap.staging.wait_seconds,
        **records.thread_seconds(),
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
        if w.snap.deferred is not None:  # every copy has landed (finish): was a source changed?
            w.snap.deferred.verify()
        records = writer.fs.records.files
        confirm_files(writer.storage, dirname, records, w.config.confirm, writer.thread_count)
    except Exception as e:
        if interrupt_in(e, since) is not None:
            raise  # (a Ctrl-C that broke the read-back, as if raised itself: the manager's
            # public call lets it out; the other ranks' collectives time out, as for one)
        return e if isinstance(e, CheckpointError) else CheckpointError(f"{e!r}")
    return None


def commit(
    w: WriteSpec, writer: StepWriter, dirname: str, gathered: list[Any], seconds: float
) -> None:
    """Rank 0: every rank's files (or its failure) committed as the step's manifest; a
    copy's ``.metadata`` written first, as DCP's finish writes it."""
    files: dict[str, FileEntry] = {}
    data_gens: dict[str, int] = {}
    for part, err, part_gens, _ in gathered:
        if err is not None:
            raise err
        files.update(part)
        data_gens.update(part_gens)
    storage, config = w.catalog.storage, w.config
    if w.parts is not None:
        writer.finish(*w.parts.metadata([s for *_, s in gathered]))
        md = {METADATA: writer.fs.records.files[METADATA]}
        confirm_files(storage, dirname, md, config.confirm, writer.thread_count)
        files.update(md)
    listed = {ref[0] for n in files if (ref := data_ref(n)) is not None}
    keys = len(w.snap.sd) if w.parts is None else w.parts.keys
    extra: dict[str, Any] = {"io_threads": config.write_threads, "keys": keys}
    if w.handoff.optimizer is not None:
        extra["optimizer"] = w.handoff.optimizer
    m = w.catalog.commit(
        w.step,
        w.world_size,
        files,
        extra,
        plan=w.admission.plan,
        line=w.admission.line,
        data=w.data_dir,
        compressed=writer.compressed,
        data_gens={d: g for d, g in data_gens.items() if d in listed},
    )
    _log.info(
        "committed step %d to %s: %d files, %d bytes, written in %.2f s (%d bytes new; "
        "the rest unchanged since earlier steps)",
        w.step,
        storage.url_of(step_dirname(w.step)),
        len(m.files),
        m.total_bytes,
        seconds,
        m.written_bytes,
    )


def tidy(w: WriteSpec) -> None:
    """Rank 0, after the commit: retention and the retired steps deleted (a failure is a
    WARNING: the step is committed)."""
    step, plan, keep_last = w.step, w.admission.plan, w.config.keep_last
    try:
        # The step just committed was read back whole (its references included)
        checked = (step, plan.gen) if reads_back(w.config.confirm) else w.verified
        replaced, deleted = w.catalog.tidy(keep_last, step, plan.drop, checked)
    except Exception as e:  # the step is committed: a failed clean-up does not undo that
        _log.warning("retention after step %d failed (steps kept): %s", step, e)
        return
    if replaced:
        _log.warning(
            "%s: deleted steps %s, replaced by this run's line (a rewind or a new run)",
            w.catalog.storage.url,
            replaced,
        )
    if deleted:
        _log.info("retention (keep_last=%d) deleted steps %s", keep_last, deleted)


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
    thread: it gives the snapshot's buffers back) and returns the step, or raises its
    failure."""

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
        self._thread.start()

    def run(self) -> int:
        self._run()
        return self.wait()

    def done(self) -> bool:
        return self._thread is None or self._ended.is_set()

    def wait(self) -> int:
        """Join the work (again, if a first wait was interrupted); then, once, give the
        snapshot's buffers back and return the step or raise the failure."""
        if self._thread is not None:
            self._ended.wait()
            self._thread.join()
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
        if isinstance(err, CheckpointError):
            raise type(err)(
                f"the asynchronous save of step {self.step} failed, so it was not committed "
                f"(committed steps are unchanged): {err}"
            ) from err
        raise CheckpointError(
            f"the asynchronous save of step {self.step} failed, so it was not committed "
            f"(committed steps are unchanged): {type(err).__name__}: {err}"
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
