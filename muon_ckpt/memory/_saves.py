"""The memory tier as a manager's saves write to it (``MemoryWriter``): a snapshot kept as this
rank's part by a background job (``MemoryJob``: write, replicate, agree), which memory save
``close()`` flushes to the url, and the parts the flush copies (``_flush``).

The save coordinator (``muon_ckpt._saves``) decides which steps come here, admits them, takes
their snapshots, queues one while a job runs and holds the jobs; this writer owns the tier's
bytes and never sees the url's saves.

The parts record each tensor's SHA-256 as the url's saves do (with ``dedup`` and
``MemoryOptions.flush``): the flush refers to the tensors the url holds unchanged by them.
That costs the memory job one SHA-256 pass over the tensors' bytes (a helper thread per
writer thread, beside the write: about 1.8 GiB/s per thread with SHA extensions).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import muon_ckpt._collective as coll
from muon_ckpt._config import ManagerConfig
from muon_ckpt.memory._dirs import layout_digest, model_digest
from muon_ckpt.memory._flush import PartCopy, flush
from muon_ckpt.memory._tier import MemoryJob, MemoryTier, MemoryWrite
from muon_ckpt.save import Handoff

__all__ = ["MemoryWriter"]

_log = logging.getLogger("muon_ckpt")

# Memory saves whose ids are kept for the flush: one job runs at a time, so the newest
# complete step is one of the last few started.
_IDS_KEPT = 8


class MemoryWriter:
    """Writes a manager's steps to its memory tier."""

    @classmethod
    def of(cls, c: ManagerConfig, url: str) -> MemoryWriter | None:
        """The memory tier ``c`` asks for (its directories made), or None."""
        if c.memory is None:
            return None
        tier = MemoryTier(c.memory, url, c.max_staging_bytes)
        tier.check_root()
        return cls(tier, c.write_threads, digests=c.dedup and c.memory.flush)

    def __init__(self, tier: MemoryTier, io_threads: int, *, digests: bool = False) -> None:
        self.tier = tier
        self._io_threads = io_threads
        self._digests = digests
        # (step, save id) of the newest memory save since the last load (None: none, or
        # nothing to flush), and the ids of all of them: close() flushes the newest complete.
        self.mark: tuple[int, str] | None = None
        self._ids: dict[int, str] = {}

    def due(self, step: int) -> bool:
        return self.tier.due(step)

    def loaded(self) -> None:
        """A load: the state is the loaded step's; no memory save before it is flushed."""
        self.mark = None
        self._ids.clear()

    def start(
        self, h: Handoff, group: Any, *, owns: bool, gate: threading.Event | None = None
    ) -> MemoryJob:
        """The background job that keeps ``h``'s snapshot as this rank's part of its step,
        started, on ``group`` (``owns``: no other save reads the snapshot; ``gate``: tests).
        Every part of it records the save's id (rank 0's, the same on every rank)."""
        step, snap, admission = h.step, h.snap, h.admission
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
        plan = admission.plan
        w = MemoryWrite(
            step=step,
            sd=snap.sd,
            staging=snap.staging,
            line=admission.line,
            gen=plan.gen,
            retires=list(plan.retires),
            base=plan.base,
            save_id=admission.save_id,
            world_size=world,
            rank=rank,
            layout=(layout_digest(snap.sd), model_digest(snap.sd)),
            extra=dict(h.about),
            io_threads=self._io_threads,
            digests=self._digests,
            group=group,
            before_commit=snap.deferred.verify if snap.deferred is not None else None,
            owns_staging=owns,
            gate=gate,
            recheck=admission.recheck,
        )
        job = MemoryJob(self.tier, w, snap.reader_done)
        job.start()
        self.mark = (step, admission.save_id)
        self._ids.pop(step, None)
        self._ids[step] = admission.save_id
        while len(self._ids) > _IDS_KEPT:
            del self._ids[next(iter(self._ids))]
        return job

    def flush(
        self,
        calls: coll.Calls,
        url_steps: Callable[[], list[int]],
        copy_in: Callable[[int, PartCopy], None],
        url: str,
    ) -> None:
        """``MemoryOptions.flush`` at ``close()``: the newest memory step complete on every
        rank (saved since the last load) committed to ``url`` with its own bytes when the
        url's newest step (``url_steps``) is older, through ``copy_in`` (the url's save of
        the parts); a newer memory save that failed is passed over."""
        step = self.tier.last_complete
        if not self.tier.opts.flush or self.mark is None or step not in self._ids:
            return
        flush(self.tier, step, self._ids[step], calls, url_steps, copy_in, url)
