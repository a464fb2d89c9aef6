"""A manager's memory saves: the snapshot a memory step takes, the job that keeps it, and the
one save that waits while a job runs.

A step due for both tiers takes one snapshot, which the url's write and the memory job both
read (the write's release waits until this rank's part is written). A step due for memory
only never waits for a write in flight: its snapshot goes to host buffers of its own and
copies the offloaded states there (the write holds the pool's one freeze); without a write
in flight it uses the manager's buffers and freezes the pool like any asynchronous save.

While the previous memory save still runs on any rank, a memory step is queued: its
snapshot is taken at its ``save()`` call, into buffers no running job reads, and at most one
waits (latest wins: a newer step replaces it, a WARNING names the step dropped). It starts
where every rank is at the same point: at ``wait()`` (so ``close()`` and the exit keep it),
or it is replaced by the next memory step, which starts at once when no job runs anywhere.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import muon_ckpt._collective as coll
from muon_ckpt._config import ManagerConfig
from muon_ckpt.memory._dirs import layout_digest
from muon_ckpt.memory._flush import flush
from muon_ckpt.memory._tier import MemoryJob, MemoryTier, MemoryWrite
from muon_ckpt.save import SaveSources, Snapshot, UrlSaves, new_id, take
from muon_ckpt.state import HostStaging
from muon_ckpt.store import Catalog, SavePlan

__all__ = ["MemorySaves"]

_log = logging.getLogger("muon_ckpt")

# Memory saves whose ids are kept for the flush: one job runs at a time, so the newest
# complete step is one of the last few started.
_IDS_KEPT = 8


@dataclasses.dataclass
class _Queued:
    """A memory save taken while a job ran: started later, unless a newer one replaces it."""

    step: int
    snap: Snapshot
    src: SaveSources
    plan: SavePlan
    line: str | None
    save_id: str
    calls: coll.Calls
    optimizer: str | None
    gate: threading.Event | None


class MemorySaves:
    """The memory tier as the manager's saves use it."""

    @classmethod
    def of(cls, c: ManagerConfig, url: str, sources: SaveSources) -> MemorySaves | None:
        """The memory tier ``c`` asks for (its directories made), or None."""
        if c.memory is None:
            return None
        tier = MemoryTier(c.memory, url, c.max_staging_bytes)
        tier.check_root()
        return cls(tier, sources, c.write_threads)

    def __init__(self, tier: MemoryTier, sources: SaveSources, io_threads: int) -> None:
        self.tier = tier
        self._main = sources
        self._own = dataclasses.replace(sources, staging=HostStaging(), freeze=False)
        self._spare: SaveSources | None = None  # a queued snapshot's while the job reads _own
        self._io_threads = io_threads
        self.job: MemoryJob | None = None
        self._job_src: SaveSources | None = None  # the buffers the running job reads
        self.queued: _Queued | None = None
        # (step, save id) of the newest memory save since the last load (None: none, or
        # nothing to flush), and the ids of all of them: close() flushes the newest complete.
        self.mark: tuple[int, str] | None = None
        self._ids: dict[int, str] = {}

    def close(self) -> None:
        """Drop a queued save; the buffers of memory-only snapshots are freed."""
        self._drop_queued(None)
        self._own.staging.release()
        if self._spare is not None:
            self._spare.staging.release()

    def loaded(self) -> None:
        """A load: the state is the loaded step's; no memory save before it is flushed."""
        self.mark = None
        self._ids.clear()

    def flush(self, saves: UrlSaves, url: str) -> None:
        """``MemoryOptions.flush`` at ``close()``: the newest memory step complete on every rank
        (saved since the last load) committed to ``url`` with its own bytes when the url's
        newest step is older (a newer memory save that failed is passed over)."""
        step = self.tier.last_complete
        if not self.tier.opts.flush or self.mark is None or step not in self._ids:
            return
        flush(self.tier, step, self._ids[step], saves, url)

    def reap(self) -> int | None:
        """Finish the memory job if it has ended (its release runs in this thread); its step."""
        job = self.job
        if job is not None and job.done():
            self.job = self._job_src = None
            return job.wait()
        return None

    def wait(self) -> int | None:
        """Until the memory job and then the queued save are complete (replicas included);
        the step of the last. A wait that Ctrl-C interrupts leaves them to the next."""
        step = None
        while self.job is not None or self.queued is not None:
            if self.job is not None:
                step = self.job.wait()
                self.job = self._job_src = None
            q, self.queued = self.queued, None
            if q is not None:
                self._start_queued(q)
        return step

    def _start_queued(self, q: _Queued) -> None:
        self.start(
            q.step,
            q.snap,
            q.plan,
            q.line,
            q.save_id,
            q.calls,
            q.optimizer,
            owns=True,
            gate=q.gate,
            src=q.src,
        )

    def supersede(self, step: int) -> None:
        """A step due for both tiers replaces the queued save (it is newer)."""
        self._drop_queued(step)

    def save_only(
        self, step: int, saves: UrlSaves, catalog: Catalog, optimizer: str | None
    ) -> tuple[bool, Snapshot | None]:
        """A save of ``step`` to the memory tier only: it never waits for the url's write in
        flight. Returns whether it started or was queued, and its snapshot.

        First one all-gather: whether the previous memory save still runs on some rank (then
        every rank queues this one), and whether the url's write ended on every rank (only
        then is it waited for here, everywhere, so that its failure is raised on every
        rank)."""
        calls, line = saves.calls, saves.line
        group, job = calls.group, saves.pending
        self.reap()
        flags = coll.all_gather((self.job is not None, job is not None and job.done()), group)
        if job is not None and all(e for _, e in flags):
            saves.wait()  # (in this thread: its release; its failure is raised here)
        busy = any(b for b, _ in flags)
        self._drop_queued(step)
        plan, line_id, save_id = coll.on_rank0(
            lambda: (*line.admit(catalog, step), new_id()), group
        )
        line.line = line_id
        if busy:  # buffers no running job reads, offloaded states copied
            src = self._own if self._job_src is not self._own else self._spare_sources()
        else:
            src = self._own if saves.pending is not None else self._main
        src.group = group
        snap = take(src, step, background=True)
        saves.deferred = snap.deferred
        if busy and not snap.background:  # (max_staging_bytes: the live state cannot wait)
            snap.staging.finish()
            snap.reader_done()
            self.tier.skipped += 1
            if coll.rank() == 0:
                _log.warning(
                    "step %d is not kept in host memory: the previous memory save is still "
                    "running, and a snapshot to wait beside it would exceed "
                    "max_staging_bytes",
                    step,
                )
            return False, None
        if busy:
            self.queued = _Queued(
                step, snap, src, plan, line_id, save_id, calls, optimizer, saves.gate
            )
        else:
            self.start(
                step,
                snap,
                plan,
                line_id,
                save_id,
                calls,
                optimizer,
                owns=True,
                gate=saves.gate,
                src=src,
            )
        return True, snap

    def _spare_sources(self) -> SaveSources:
        if self._spare is None:
            self._spare = dataclasses.replace(self._own, staging=HostStaging())
        return self._spare

    def _drop_queued(self, by: int | None) -> None:
        """The queued save is not kept (``by``: the newer step that replaces it; WARNING)."""
        q, self.queued = self.queued, None
        if q is None:
            return
        try:
            q.snap.staging.finish()  # (its copies land before its buffers are used again)
        finally:
            q.snap.reader_done()
        if by is None:
            return
        self.tier.skipped += 1
        if coll.rank() == 0:
            _log.warning(
                "step %d is not kept in host memory: step %d replaced it while the memory save "
                "before it was still running (%d dropped so far); until a newer memory step is "
                "complete, a crash resumes an older one. A larger MemoryOptions.interval, or a "
                "faster tier, avoids this",
                q.step,
                by,
                self.tier.skipped,
            )

    def start(
        self,
        step: int,
        snap: Snapshot,
        plan: SavePlan,
        line: str | None,
        save_id: str,
        calls: coll.Calls,
        optimizer: str | None,
        *,
        owns: bool,
        gate: threading.Event | None = None,
        src: SaveSources | None = None,
    ) -> MemoryJob:
        """The background job that keeps ``snap`` (``save_id``: rank 0's ``new_id()``, the
        same on every rank; ``owns``: no other save reads it; ``gate``: tests; ``src``: the
        buffers it reads)."""
        world, rank = coll.world_size(), coll.rank()
        if self.tier.opts.replicas and not self.tier.holders(rank, world) and rank == 0:
            self.tier.warn_once(
                "replicas",
                "memory tier: replicas=%d, but all %d rank(s) are on one node (node_size=%d): "
                "each step is kept in this node's memory only",
                self.tier.opts.replicas,
                world,
                self.tier.node_size(world),
            )
        w = MemoryWrite(
            step=step,
            sd=snap.sd,
            staging=snap.staging,
            line=line,
            gen=plan.gen,
            retires=list(plan.retires),
            base=plan.base,
            save_id=save_id,
            world_size=world,
            rank=rank,
            layout=layout_digest(snap.sd),
            extra={"optimizer": optimizer} if optimizer is not None else {},
            io_threads=self._io_threads,
            group=calls.memory_group,
            before_commit=snap.deferred.verify if snap.deferred is not None else None,
            owns_staging=owns,
            gate=gate,
        )
        job = MemoryJob(self.tier, w, snap.reader_done)
        job.start()
        self.job, self._job_src = job, src
        self.mark = (step, save_id)
        self._ids.pop(step, None)
        self._ids[step] = save_id
        while len(self._ids) > _IDS_KEPT:
            del self._ids[next(iter(self._ids))]
        if not snap.background:  # it reads the live state: done before training goes on
            job.wait_written()
        return job
