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

from torch.distributed.checkpoint import DefaultSavePlanner

import muon_ckpt._collective as coll
import muon_ckpt._dcp as _dcp
from muon_ckpt._config import ManagerConfig
from muon_ckpt._errors import CheckpointError, handled, interrupt_in
from muon_ckpt.save._dedup import DedupBase
from muon_ckpt.save._deferred import DeferredCopies
from muon_ckpt.save._snapshot import Snapshot
from muon_ckpt.save._writer import ChecksumWriter, FileRecords
from muon_ckpt.state import HostStaging
from muon_ckpt.store import (
    METADATA,
    Catalog,
    FileEntry,
    SavePlan,
    confirm_files,
    data_ref,
    step_dirname,
    write_dirname,
)

__all__ = ["Prebuilt", "SaveJob", "WriteSpec", "spec_for", "write_and_commit"]


class Prebuilt(Protocol):
    """A step's files written and checksummed elsewhere (the memory tier's parts), which a
    save copies as they are instead of writing a snapshot: each rank copies its own, rank 0
    writes the step's ``.metadata`` from every rank's share of it."""

    keys: int  # this rank's keys (the manifest's "keys", as len(sd) of a snapshot)

    def copy(self, writer: ChecksumWriter) -> Any:
        """This rank's files copied through ``writer.copy_file``; its share of the metadata."""
        ...

    def metadata(self, shares: list[Any]) -> tuple[Any, list[Any]]:
        """Rank 0: the step's DCP metadata and each rank's write results, from the shares."""
        ...


class StagedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner; a writer thread resolving an item first waits for its copy."""

    def __init__(self, staging: HostStaging) -> None:
        super().__init__()
        self._staging = staging

    def resolve_data(self, write_item: Any) -> Any:
        self._staging.wait(write_item.index.fqn)
        return super().resolve_data(write_item)


_log = logging.getLogger("muon_ckpt")


@dataclass
class WriteSpec:
    """Everything the write of one snapshot needs."""

    catalog: Catalog
    step: int
    sd: dict[str, Any]  # host tensors (or the live ones, for a synchronous save) and objects
    staging: HostStaging
    world_size: int  # ranks that took the snapshot (the process group it needs)
    io_threads: int
    keep_last: int | None
    plan: SavePlan  # rank 0's decisions: generation, retired steps, written beside or not
    line: str | None = None  # the line of steps the commit continues (the manifest's)
    optimizer: str | None = None  # the optimizer's type (the manifest's extra, for messages)
    deferred: DeferredCopies | None = None  # async_save="deferred": checked before the commit
    group: Any = None  # process group of the collectives (None: the default group)
    confirm: str = "checksum"  # how the storage's copy is confirmed before the commit (_confirm)
    gate: threading.Event | None = None  # tests: the write starts once this is set
    # Format 3: the directory under <url>/data/ the data files go to (None: the step's own
    # directory, format 2), and what the run holds that the save refers to when unchanged
    data_dir: str | None = None
    base: DedupBase | None = None
    max_age: int = 1  # a save refers only to data written fewer saves before it (dedup_bound)
    verified: tuple[int, int] | None = None  # the newest step known to verify: retention keeps it
    compress: bool = False  # tensors stored compressed (store.codec; format 4)
    parts: Prebuilt | None = None  # files copied as they are instead of ``sd`` written
    timings: dict[str, float] = field(default_factory=dict)
    committed_at: float | None = None  # time.perf_counter() once the step was committed
    next_base: DedupBase | None = None  # once committed with data_dir: the next save's base
    written_bytes: int = 0  # bytes of the files this rank wrote
    referred_bytes: int = 0  # bytes of the unchanged tensors it referred to instead


def spec_for(
    catalog: Catalog,
    config: ManagerConfig,
    step: int,
    snap: Snapshot,
    plan: SavePlan,
    line: str,
    *,
    optimizer: str | None,
    group: Any,
    gate: threading.Event | None,
    data_dir: str | None = None,
    base: DedupBase | None = None,
    verified: tuple[int, int] | None = None,
) -> WriteSpec:
    """The write of ``snap`` as the manager's options say (``gate``: tests only; ``data_dir``,
    ``base`` and ``verified``: see WriteSpec)."""
    return WriteSpec(
        catalog=catalog,
        step=step,
        sd=snap.sd,
        staging=snap.staging,
        world_size=coll.world_size(),
        io_threads=config.write_threads,
        keep_last=config.keep_last,
        plan=plan,
        line=line,
        optimizer=optimizer,
        confirm=config.confirm,
        group=group,
        gate=gate if snap.background else None,
        deferred=snap.deferred,
        data_dir=data_dir,
        base=base,
        max_age=config.dedup_bound,
        verified=verified,
        compress=config.compression == "zstd",
    )


def write_and_commit(w: WriteSpec) -> None:
    storage, step = w.catalog.storage, w.step
    since = handled()  # (a synchronous save called while the caller handles an exception)
    if w.gate is not None:
        w.gate.wait()
    if coll.world_size() != w.world_size:  # each rank would commit its own part alone
        raise CheckpointError(
            f"saving step {step}: the snapshot was taken on {w.world_size} rank(s) but the "
            f"process group now has {coll.world_size()} (was it destroyed? call close() or "
            "wait() before torch.distributed.destroy_process_group()); step "
            f"{step} is not committed"
        )
    t0 = time.perf_counter()
    records = FileRecords()
    dirname = write_dirname(step, w.plan.beside)
    writer = ChecksumWriter(
        storage,
        dirname,
        records,
        w.io_threads,
        data_dir=w.data_dir,
        base=w.base,
        compress=w.compress,
        gen=w.plan.gen,
        max_age=w.max_age,
        confirm=w.confirm,
    )
    share, failed = None, None
    try:
        what = f"saving step {step} to {storage.url!r}"
        if w.parts is None:
            _dcp.save(w.sd, writer, StagedSavePlanner(w.staging), w.group, what)
        else:  # (no collective: a failure goes to the gather below, where every rank is)
            share, failed = _copied(w.parts, writer, since)
    finally:
        w.staging.finish()
    t1 = time.perf_counter()
    try:
        if failed is not None:
            raise failed
        if w.deferred is not None:  # every copy has landed (finish): was a source changed?
            w.deferred.verify()
        confirm_files(storage, dirname, records.files, w.confirm, w.io_threads)
    except Exception as e:  # every rank must reach the gather: rank 0 raises it for all
        if interrupt_in(e, since) is not None:
            raise  # (a Ctrl-C that broke the read-back, as if raised itself: the manager's
            # public call lets it out; the other ranks' collectives time out, as for one)
        failed = e if isinstance(e, CheckpointError) else CheckpointError(f"{e!r}")
    w.timings["confirm"] = time.perf_counter() - t1
    refs = writer.dedup.refs  # files of earlier saves the step refers to (checked before)
    gens = writer.dedup.gens(w.base, w.data_dir, w.plan.gen)
    gathered = coll.gather_to_rank0(({**refs, **records.files}, failed, gens, share), w.group)

    def commit() -> None:
        files: dict[str, FileEntry] = {}
        data_gens: dict[str, int] = {}
        for part, err, part_gens, _ in gathered or []:
            if err is not None:
                raise err
            files.update(part)
            data_gens.update(part_gens)
        if w.parts is not None:  # the step's .metadata, written as DCP's finish writes it
            writer.finish(*w.parts.metadata([s for *_, s in gathered or []]))
            md = {METADATA: records.files[METADATA]}
            confirm_files(storage, dirname, md, w.confirm, w.io_threads)
            files.update(md)
        listed = {ref[0] for n in files if (ref := data_ref(n)) is not None}
        keys = len(w.sd) if w.parts is None else w.parts.keys
        extra: dict[str, Any] = {"io_threads": w.io_threads, "keys": keys}
        if w.optimizer is not None:
            extra["optimizer"] = w.optimizer
        m = w.catalog.commit(
            step,
            w.world_size,
            files,
            extra,
            plan=w.plan,
            line=w.line,
            data=w.data_dir,
            compressed=writer.compressed,
            data_gens={d: g for d, g in data_gens.items() if d in listed},
        )
        _log.info(
            "committed step %d to %s: %d files, %d bytes, written in %.2f s (%d bytes new; "
            "the rest unchanged since earlier steps)",
            step,
            storage.url_of(step_dirname(step)),
            len(m.files),
            m.total_bytes,
            t1 - t0,
            m.written_bytes,
        )

    def tidy() -> None:
        try:
            # The step just committed was read back whole (its references included)
            checked = (step, w.plan.gen) if w.confirm in ("checksum", "crc32") else w.verified
            replaced, deleted = w.catalog.tidy(w.keep_last, step, w.plan.drop, checked)
        except Exception as e:  # the step is committed: a failed clean-up does not undo that
            _log.warning("retention after step %d failed (steps kept): %s", step, e)
            return
        if replaced:
            _log.warning(
                "%s: deleted steps %s, replaced by this run's line (a rewind or a new run)",
                storage.url,
                replaced,
            )
        if deleted:
            _log.info("retention (keep_last=%d) deleted steps %s", w.keep_last, deleted)

    coll.on_rank0(commit, w.group)
    t2 = w.committed_at = time.perf_counter()
    w.written_bytes = sum(e.size for e in records.files.values())
    w.referred_bytes = writer.dedup.referred_bytes
    if writer.packed[0]:
        _log.debug(
            "step %d: this rank compressed %d bytes of tensors into %d (%.3fx)",
            step,
            writer.packed[0],
            writer.packed[1],
            writer.packed[0] / max(1, writer.packed[1]),
        )
    if w.data_dir is not None:
        w.next_base = writer.dedup.base((step, w.plan.gen), records.files, gens)
    if w.keep_last is not None or w.plan.retires or w.plan.drop:
        coll.on_rank0(tidy, w.group)
        w.timings["retention"] = time.perf_counter() - t2
    w.timings.update(
        dcp_save=t1 - t0,
        commit=t2 - t1 - w.timings["confirm"],
        write_data=writer.write_seconds,
        stage_wait=w.staging.wait_seconds,
        **records.thread_seconds(),
    )


def _copied(
    parts: Prebuilt, writer: ChecksumWriter, since: BaseException | None
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
    """The write and commit of one snapshot: ``start()`` runs it in a background thread,
    ``run()`` in this one; ``wait()`` joins it, calls ``finish`` (in the caller's thread: it
    gives the snapshot's buffers back) and returns the step, or raises its failure."""

    def __init__(self, spec: WriteSpec, finish: Callable[[], None]) -> None:
        self.spec = spec
        self.step = spec.step
        self._finish: Callable[[], None] | None = finish
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._background = False
        self.joined = False  # the work has ended and was joined
        # Set when the work has ended. Waited on rather than Thread.join(): a join that Ctrl-C
        # interrupts can report a live thread as ended on the next call (CPython).
        self._ended = threading.Event()

    def _run(self) -> None:
        try:
            write_and_commit(self.spec)
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
                finish()
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
