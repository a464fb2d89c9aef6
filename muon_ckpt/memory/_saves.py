"""A manager's memory saves: the snapshot a memory step takes and the job that keeps it.

A step due for both tiers takes one snapshot, which the url's write and the memory job both
read (the write's release waits until this rank's part is written). A step due for memory
only never waits for a write in flight: its snapshot goes to host buffers of its own and
copies the offloaded states there (the write holds the pool's one freeze); without a write
in flight it uses the manager's buffers and freezes the pool like any asynchronous save.
While the previous memory save is still running on any rank, a memory save is skipped (a
WARNING; ``MemoryTier.skipped`` counts it).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import muon_ckpt._collective as coll
from muon_ckpt._config import ManagerConfig
from muon_ckpt.memory._dirs import default_root, layout_digest
from muon_ckpt.memory._tier import MemoryJob, MemoryOptions, MemoryTier, MemoryWrite
from muon_ckpt.save import SaveSources, Snapshot, UrlSaves, new_id, take
from muon_ckpt.state import HostStaging
from muon_ckpt.store import Catalog, SavePlan

__all__ = ["MemorySaves"]

_log = logging.getLogger("muon_ckpt")


class MemorySaves:
    """The memory tier as the manager's saves use it."""

    @classmethod
    def of(cls, c: ManagerConfig, url: str, sources: SaveSources) -> MemorySaves | None:
        """The memory tier ``c`` asks for (its directories made), or None."""
        if c.memory_interval is None:
            return None
        opts = MemoryOptions(
            interval=c.memory_interval,
            root=c.memory_dir or default_root(),
            replicas=c.replicas,
            node_size=c.node_size,
            keep=c.memory_keep,
            flush=c.memory_flush,
        )
        tier = MemoryTier(opts, url, c.max_staging_bytes)
        tier.check_root()
        return cls(tier, sources, c.write_threads)

    def __init__(self, tier: MemoryTier, sources: SaveSources, io_threads: int) -> None:
        self.tier = tier
        self._main = sources
        self._own = dataclasses.replace(sources, staging=HostStaging(), freeze=False)
        self._io_threads = io_threads
        self.job: MemoryJob | None = None
        # Optimizer steps taken (a step post-hook), and (step, steps taken) at the newest
        # memory save: close() flushes that step only while the state is still its own.
        self.steps_taken = 0
        self.mark: tuple[int, int] | None = None
        opt = sources.optimizer
        self._hook = opt.register_step_post_hook(self._stepped) if opt is not None else None

    def _stepped(self, *args: Any) -> None:
        self.steps_taken += 1

    def close(self) -> None:
        """Stop counting steps; the buffers of memory-only snapshots are freed."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._own.staging.release()

    def to_flush(self, url: str) -> int | None:
        """The step ``close()`` saves to ``url`` (``memory_flush``): the newest memory save,
        complete on every rank, while no optimizer step came after it; else None (a WARNING
        when the state moved on)."""
        if not self.tier.opts.flush or self.mark is None:
            return None
        step, steps = self.mark
        if self.tier.last_complete != step:
            return None
        if steps != self.steps_taken:
            if coll.rank() == 0:
                _log.warning(
                    "close(): memory-tier step %d is not saved to %s: the optimizer stepped "
                    "since; save(step, force=True) before close() keeps the newest state",
                    step,
                    url,
                )
            return None
        return step

    def reap(self) -> int | None:
        """Finish the memory job if it has ended (its release runs in this thread); its step."""
        job = self.job
        if job is not None and job.done():
            self.job = None
            return job.wait()
        return None

    def wait(self) -> int | None:
        """Until the memory job is complete (replicas included); its step."""
        job, self.job = self.job, None
        return job.wait() if job is not None else None

    def save_only(
        self, step: int, saves: UrlSaves, catalog: Catalog, optimizer: str | None
    ) -> tuple[bool, Snapshot | None]:
        """A save of ``step`` to the memory tier only: it never waits for the url's write in
        flight. Returns whether it started, and its snapshot.

        First one all-gather: whether the previous memory save still runs on some rank (then
        every rank skips this one), and whether the url's write ended on every rank (only
        then is it waited for here, everywhere, so that its failure is raised on every
        rank)."""
        calls, line = saves.calls, saves.line
        group, job = calls.group, saves.pending
        self.reap()
        flags = coll.all_gather((self.job is not None, job is not None and job.done()), group)
        if job is not None and all(e for _, e in flags):
            saves.wait()  # (in this thread: its release; its failure is raised here)
        if any(b for b, _ in flags):
            self.tier.skipped += 1
            if coll.rank() == 0:
                _log.warning(
                    "step %d is not kept in host memory: the previous memory save is still "
                    "running (%d skipped so far); a larger memory_interval avoids this",
                    step,
                    self.tier.skipped,
                )
            return False, None
        plan, line_id, save_id = coll.on_rank0(
            lambda: (*line.admit(catalog, step), new_id()), group
        )
        line.line = line_id
        src = self._own if saves.pending is not None else self._main
        src.group = group
        snap = take(src, step, background=True)
        saves.deferred = snap.deferred
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
        )
        return True, snap

    def flush(self, saves: UrlSaves, url: str) -> None:
        """``memory_flush`` at ``close()``: the newest memory step saved to ``url`` when it is
        newer than its newest step and still the state's (``to_flush``)."""
        step = self.to_flush(url)
        if step is None:
            return
        saves.calls.join(f"close(flush step={step})")
        steps = coll.on_rank0(saves.catalog.committed_steps, saves.calls.group)
        if not steps or steps[-1] < step:
            saves.save(step, overwrite=False, background=False)
            if coll.rank() == 0:
                _log.info("close(): saved memory-tier step %d to %s (memory_flush)", step, url)

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
    ) -> MemoryJob:
        """The background job that keeps ``snap`` (``save_id``: rank 0's ``new_id()``, the
        same on every rank; ``owns``: no other save reads it; ``gate``: tests)."""
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
        self.job = job
        self.mark = (step, self.steps_taken)
        if not snap.background:  # it reads the live state: done before training goes on
            job.wait_written()
        return job
