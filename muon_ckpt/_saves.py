"""A manager's saves, to its url and its memory tier: which tiers a step is due for, its
admission, its one snapshot, and the jobs that write it -- the url's (``save.UrlWriter``) and
the memory tier's (``memory.MemoryWriter``), which never see each other; the pending save,
the queued memory save, ``wait()``, the flush at ``close()``, and this rank's timings.

A save is ``due -> admit -> snapshot -> write``: ``RunLine.admit`` (rank 0 readies the step:
the lease, the line, what it retires, its id) is the one admission of either tier; ``take``
copies the state once, with one reader per job that writes it, and releases it when the last
has ended (the url's write waits until this rank's part is written).

A step due for memory only never waits for a write to the url in flight: its snapshot goes to
host buffers of its own and copies the offloaded states there (the write holds the pool's one
freeze); without a write in flight it uses the manager's buffers and freezes the pool like any
asynchronous save. While the previous memory save still runs on any rank, a memory step is
queued: its snapshot is taken at its ``save()`` call, into buffers no running job reads, and
at most one waits (latest wins: a newer step replaces it, a WARNING names the step dropped).
It starts where every rank is at the same point: at ``wait()`` (so ``close()`` and the exit
keep it), or it is replaced by the next memory step, which starts at once when no job runs
anywhere.

Ctrl-C during ``close()`` (or the exit's) stops the saves (``stop``): the jobs start no new
file and the url's step is not committed unless it already was; a queued memory save and the
flush are dropped. ``close()`` returns once every job has ended, so no thread outlives it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import muon_ckpt._collective as coll
from muon_ckpt._config import ManagerConfig, reads_back
from muon_ckpt._exit import finish_at_exit, let_go
from muon_ckpt._interrupts import Stop, interrupts_deferred
from muon_ckpt.memory import MemoryJob, MemoryTier, MemoryWriter, PartCopy
from muon_ckpt.save import (
    Admission,
    Handoff,
    RunLine,
    SaveJob,
    SaveSources,
    Snapshot,
    UrlWriter,
    Written,
    take,
)
from muon_ckpt.state import HostStaging, describe
from muon_ckpt.store import Catalog

__all__ = ["Saves"]

_log = logging.getLogger("muon_ckpt")


@dataclasses.dataclass
class _Queued:
    """A memory save taken while a job ran: started later, unless a newer one replaces it."""

    handoff: Handoff
    src: SaveSources
    gate: threading.Event | None


class Saves:
    """The saves of one manager (``owner``: the manager, which the interpreter's exit closes
    while a save is pending)."""

    def __init__(
        self,
        catalog: Catalog,
        config: ManagerConfig,
        line: RunLine,
        sources: SaveSources,
        calls: coll.Calls,
        owner: Any,
    ) -> None:
        self.catalog, self.config, self.line = catalog, config, line
        self.sources, self.calls = sources, calls
        # (a group a running job holds is destroyed once it ended); weakly: a cycle here kept
        # the model and optimizer (their GPU memory) alive until a full garbage collection
        busy = weakref.WeakMethod(self.busy)
        calls.busy = lambda: (b := busy()) is not None and b()
        self.url = UrlWriter(catalog, config)
        self.memory = MemoryWriter.of(config, catalog.storage.url_of())
        self._owner = weakref.ref(owner)
        self.pending: SaveJob | None = None  # the url's job, in the background
        self.memory_job: MemoryJob | None = None
        self.queued: _Queued | None = None
        self.deferred: Any = None  # the newest snapshot's deferred copies
        self.timings: dict[str, float] = {}  # of the last finished save to the url
        self.gate: threading.Event | None = None  # tests: background writes wait for it
        self.stopped = Stop()  # Ctrl-C in close(): nothing new starts
        # A memory-only snapshot's buffers while the url's write reads the manager's, a
        # queued one's while a job reads those, and the buffers the running memory job reads
        self._own = dataclasses.replace(sources, staging=HostStaging(), freeze=False)
        self._spare: SaveSources | None = None
        self._memory_src: SaveSources | None = None
        self._flushing: SaveJob | None = None  # the flush's url job, while it runs

    @property
    def tier(self) -> MemoryTier | None:
        return None if self.memory is None else self.memory.tier

    def due(self, step: int, force: bool) -> tuple[bool, bool]:
        """Whether ``step`` is due for the url (``interval``, or ``force``) and for memory."""
        interval = self.config.interval
        url = force or interval is None or step % interval == 0
        return url, self.memory is not None and self.memory.due(step)

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        *,
        url: bool,
        memory: bool,
        overwrite: bool = False,
        background: bool | None = None,
    ) -> bool:
        """Save ``step`` to the tiers named (every rank is at this call): make way, admit,
        snapshot, hand over; whether it was saved or queued. ``background``: the url's write
        in a thread (default: ``async_save``)."""
        if background is None:
            background = bool(self.config.async_save)
        busy = self._make_way(step, url, memory)
        if background or memory:  # (after the wait, which lets go of what it finished)
            self._hold()  # the interpreter's exit waits for it (_exit)
        src = self._buffers(url, busy)
        t0 = time.perf_counter()
        # An asynchronous save to the url alone, or one to the memory tier alone, is admitted
        # from the steps the catalog knows: its listing and lease come in its job
        # (``Admission.recheck``), after the snapshot. One to both is admitted here.
        cached = (background and url and not memory) or (memory and not url)
        adm = self._admit(step, url=url, memory=memory, overwrite=overwrite, cached=cached)
        t1 = time.perf_counter()
        # A memory save writes in the background: it needs host copies, as an async save.
        snap = self._take(src, step, background or memory, readers=url + memory)
        t2 = time.perf_counter()
        h = self._handoff(step, snap, adm)
        if not url:
            return self._keep(h, src, busy)
        if memory:  # (not gated: tests hold the url's write and watch the memory part land)
            self._start_memory(h, owns=False, gate=None, src=None)
        before = {"snapshot": t2 - t1, "prepare": t1 - t0, "blocked": t2 - t0}
        job = self.url.job(
            h,
            self.calls.write_group,
            finish=lambda w: self._url_done(h, before, w, snap.reader_done),
            verified=self.line.verified,
            gate=self.gate,
        )
        if snap.background and background:
            with interrupts_deferred():  # (once started, it is pending: wait() joins it)
                job.start()
                self.pending = job
            return True
        job.run()
        return True

    def _make_way(self, step: int, url: bool, memory: bool) -> bool:
        """Before a save: one to the url waits for what is pending (a queued memory step is
        older: dropped when this one is due for memory too). One to the memory tier only
        never waits for the url's write in flight: one all-gather says whether the previous
        memory save still runs on some rank (then every rank queues this one: True), and
        whether the url's write ended on every rank (only then is it waited for here,
        everywhere, so that its failure is raised on every rank)."""
        if url:
            if memory:
                self._drop_queued(step)
            self.wait()
            return False
        self._reap()
        job = self.pending
        flags = coll.all_gather(
            (self.memory_job is not None, job is not None and job.done()), self.calls.group
        )
        if job is not None and all(e for _, e in flags):
            self._wait_url()  # (in this thread: its release; its failure is raised here)
        self._drop_queued(step)
        return any(b for b, _ in flags)

    def _buffers(self, url: bool, busy: bool) -> SaveSources:
        """Where the snapshot's copies go: the manager's buffers, but for a memory-only step
        while a job reads them (then ones no running job reads; offloaded states copied)."""
        if url:
            return self.sources
        if busy:
            return self._own if self._memory_src is not self._own else self._spare_sources()
        return self._own if self.pending is not None else self.sources

    def _keep(self, h: Handoff, src: SaveSources, busy: bool) -> bool:
        """A memory-only step: its job started, or queued while one runs; whether kept."""
        if busy and not h.snap.background:  # (max_staging_bytes: the live state cannot wait)
            h.snap.staging.finish()
            h.snap.reader_done()
            self._skipped()
            if coll.rank() == 0:
                _log.warning(
                    "step %d is not kept in host memory: the previous memory save is still "
                    "running, and a snapshot to wait beside it would exceed "
                    "max_staging_bytes",
                    h.step,
                )
            return False
        if busy:
            self.queued = _Queued(h, src, self.gate)
        else:
            self._start_memory(h, owns=True, gate=self.gate, src=src)
        return True

    def _admit(self, step: int, *, url: bool, memory: bool = False, **kw: Any) -> Admission:
        """The one admission of a save of either tier (``RunLine.admit``)."""
        return self.line.admit(self.catalog, step, self.calls.group, url=url, memory=memory, **kw)

    def _take(self, src: SaveSources, step: int, background: bool, readers: int) -> Snapshot:
        src.group = self.calls.group
        snap = take(src, step, background, readers)
        self.deferred = snap.deferred
        return snap

    def _handoff(self, step: int, snap: Snapshot, adm: Admission) -> Handoff:
        about = describe(self.sources.model, self.sources.optimizer, snap.sd)
        return Handoff(step, snap, adm, about)

    def _start_memory(
        self, h: Handoff, *, owns: bool, gate: threading.Event | None, src: SaveSources | None
    ) -> None:
        """The memory job that keeps ``h``'s snapshot (``owns``: no url job reads it;
        ``src``: the buffers it reads)."""
        assert self.memory is not None
        with interrupts_deferred():  # (once started, it is held; it reads no live state after)
            job = self.memory.start(h, self.calls.memory_group, owns=owns, gate=gate)
            self.memory_job, self._memory_src = job, src
            if not h.snap.background:  # it reads the live state: done before training goes on
                job.wait_written()

    def _url_done(
        self,
        h: Handoff,
        before: dict[str, float],
        w: Written,
        release: Callable[[], None] | None = None,
    ) -> None:
        """In the caller's thread, once a url job has ended (committed or not): the snapshot
        released (``release``), the line told, the timings kept."""
        if release is not None:
            release()
        step = h.step
        if w.committed_at is not None and w.gen is not None:  # (a read-back covers its refs)
            verified = (step, w.gen) if reads_back(self.config.confirm) else None
            self.line.committed(w.next_base, verified)
        t = {**before, **w.timings}
        t["total"] = sum(t.get(k, 0.0) for k in ("blocked", "dcp_save", "commit", "retention"))
        self.timings = t
        _log.debug("saved step %d: %s", step, ", ".join(f"{k} {v:.3f}s" for k, v in t.items()))

    # ------------------------------------------------------------------ queued memory save
    def _spare_sources(self) -> SaveSources:
        if self._spare is None:
            self._spare = dataclasses.replace(self._own, staging=HostStaging())
        return self._spare

    def _skipped(self) -> int:
        assert self.memory is not None
        self.memory.tier.skipped += 1
        return self.memory.tier.skipped

    def _drop_queued(self, by: int | None) -> None:
        """The queued save is not kept (``by``: the newer step that replaces it; WARNING)."""
        q, self.queued = self.queued, None
        if q is None:
            return
        try:
            q.handoff.snap.staging.finish()  # (its copies land before its buffers are used again)
        finally:
            q.handoff.snap.reader_done()
        if by is None:
            return
        skipped = self._skipped()
        if coll.rank() == 0:
            _log.warning(
                "step %d is not kept in host memory: step %d replaced it while the memory save "
                "before it was still running (%d dropped so far); until a newer memory step is "
                "complete, a crash resumes an older one. A larger MemoryOptions.interval, or a "
                "faster tier, avoids this",
                q.handoff.step,
                by,
                skipped,
            )

    def _reap(self) -> None:
        """Finish the memory job if it has ended (its release runs in this thread)."""
        job = self.memory_job
        if job is not None and job.done():
            self.memory_job = self._memory_src = None
            job.wait()

    # ------------------------------------------------------------------ wait, flush, close
    def wait(self) -> int | None:
        """Until the memory job, the queued memory save and the url's write are complete;
        the newest step among them (None: nothing was pending). The url's failure is raised
        here; a wait that Ctrl-C interrupts leaves the rest to the next."""
        try:
            kept = self._wait_memory()
            step = self._wait_url()
        finally:
            if self.pending is None:
                self._let_go()  # nothing pending: the exit closes it only if it is still alive
        return kept if step is None else step if kept is None else max(step, kept)

    def _wait_memory(self) -> int | None:
        step = None
        while self.memory_job is not None or self.queued is not None:
            if self.memory_job is not None:
                step = self.memory_job.wait()
                self.memory_job = self._memory_src = None
            if self.stopped.is_set:
                self._drop_queued(None)
            q, self.queued = self.queued, None
            if q is not None:
                self._start_memory(q.handoff, owns=True, gate=q.gate, src=q.src)
        return step

    def _wait_url(self) -> int | None:
        """Until the url's write is committed (its failure raised here); its step."""
        job = self.pending
        if job is None:
            return None
        try:
            return job.wait()
        finally:
            if job.joined:  # interrupted while joining (Ctrl-C): still pending
                self.pending = None

    def busy(self) -> bool:
        """Whether a background job (the url's write, a memory save, a flush) still runs."""
        jobs = (self.pending, self.memory_job, self._flushing)
        return any(j is not None and not j.done() for j in jobs)

    def writing(self) -> int | None:
        """The step the url's write in the background is writing, or None."""
        job = self.pending
        return job.step if job is not None and not job.done() else None

    def flush(self) -> None:
        """``MemoryOptions.flush``: the newest memory step, when newer than the url's, to the
        url (``MemoryWriter.flush``, through the url's writer)."""
        if self.memory is not None and not self.stopped.is_set:
            url = self.config.url
            self.memory.flush(self.calls, self.catalog.committed_steps, self._copy_in, url)

    def _copy_in(self, step: int, parts: PartCopy) -> None:
        """Commit ``step`` from the memory tier's ``parts``: admitted as any url save."""
        adm = self._admit(step, url=True)
        h = Handoff(step, Snapshot({}, HostStaging(), background=False), adm, parts.about)
        finish = functools.partial(self._url_done, h, {})
        job = self.url.job(h, self.calls.write_group, finish=finish, parts=parts)
        self._flushing = job
        try:
            job.run()
        finally:
            self._flushing = None

    def stop(self) -> None:
        """Ctrl-C in ``close()`` (called from its signal handler): every job of this manager
        starts no new file, and nothing new starts."""
        self.stopped.set()
        for job in (self.pending, self.memory_job, self._flushing):
            if job is not None:
                job.stop()

    def close(self) -> None:
        """Finish what is pending (its failure raised here) and flush; then drop a queued
        save, free the memory-only snapshots' buffers, and let the exit forget the manager.
        Whatever ended it, every job has ended when it returns (stopped, where it failed)."""
        try:
            self.wait()
            self.flush()
        finally:
            self._end_jobs()
            self._drop_queued(None)
            self._own.staging.release()
            if self._spare is not None:
                self._spare.staging.release()
            self._let_go()

    def _end_jobs(self) -> None:
        """Every job still running stopped and waited for, its failure logged (close() is
        leaving on another error)."""
        with interrupts_deferred():
            for job in (self.memory_job, self.pending):
                if job is None or (job is self.pending and job.joined):
                    continue
                job.stop()
                try:
                    job.wait()
                except Exception as e:
                    _log.warning("closing: the save of step %d failed: %s", job.step, e)
            self.memory_job = self.pending = self._memory_src = None

    def loaded(self, url: str, decision: Any) -> None:
        """A load of ``decision`` (None: nothing to load): the run's line continues from it,
        and no memory save before it is flushed."""
        if decision is None:
            self.line.fresh()
            return
        self.line.loaded(url, decision)
        if self.memory is not None:
            self.memory.loaded()

    def _hold(self) -> None:
        owner = self._owner()
        if owner is not None:
            finish_at_exit(owner, pending=True)

    def _let_go(self) -> None:
        owner = self._owner()
        if owner is not None:
            let_go(owner)
