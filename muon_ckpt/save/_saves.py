"""A manager's saves to its url, one after another: rank 0 readies the step and decides what
it retires (``RunLine``), every rank takes the snapshot, and the job writes, confirms and
commits it, here or in a background thread (then one save is pending at a time, until
``wait()``). A step also due for the memory tier shares the snapshot with the memory save
(``memory``: a callable the manager passes; this package does not know the tier).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import muon_ckpt._collective as coll
from muon_ckpt._config import ManagerConfig
from muon_ckpt._interrupts import interrupts_deferred
from muon_ckpt.save._job import Prebuilt, SaveJob, WriteSpec, spec_for
from muon_ckpt.save._line import RunLine
from muon_ckpt.save._snapshot import SaveSources, Snapshot, take
from muon_ckpt.state import HostStaging, optimizer_name
from muon_ckpt.store import Catalog, SavePlan, data_dirname

__all__ = ["UrlSaves", "new_id"]

_log = logging.getLogger("muon_ckpt")


# Another job that writes a step's snapshot too (the memory tier's, for a step due for both;
# this package does not know the tier): (step, snapshot, plan, line, save id) -> None. It
# calls ``snap.add_reader()`` and, once it has ended, ``snap.reader_done()``.
AlsoWrite = Callable[[int, Snapshot, SavePlan, "str | None", str], None]


def new_id() -> str:
    """A save's id (rank 0 draws it): the memory tier's parts record it, so that parts of
    one step written by different saves (a step saved again) are never loaded together."""
    return uuid.uuid4().hex[:16]


class UrlSaves:
    """The saves of one manager to its url."""

    def __init__(
        self,
        catalog: Catalog,
        config: ManagerConfig,
        line: RunLine,
        sources: SaveSources,
        calls: coll.Calls,
    ) -> None:
        self.catalog, self.config, self.line = catalog, config, line
        self.sources, self.calls = sources, calls
        self.pending: SaveJob | None = None
        self.deferred: Any = None  # the newest snapshot's deferred copies
        self.timings: dict[str, float] = {}  # of the last finished save
        self.gate: threading.Event | None = None  # tests: background writes wait for it

    def save(
        self, step: int, overwrite: bool, background: bool, also: AlsoWrite | None = None
    ) -> bool:
        """Save ``step`` (``background``: its job in a thread, pending); whether it is
        pending. ``also``: another job writes the same snapshot (the memory tier's)."""
        t0 = time.perf_counter()
        # An asynchronous save is admitted from what the catalog knows; the url's listing and
        # lease come in its job, after the snapshot (``recheck``), before it writes.
        cached = background and also is None
        plan, line, save_id, base, recheck = self._begin(step, overwrite, cached)
        t1 = time.perf_counter()
        self.sources.group = self.calls.group
        # A memory save writes in the background: it needs host copies, as an async save.
        snap = take(self.sources, step, background or also is not None)
        self.deferred = snap.deferred
        t2 = time.perf_counter()
        spec = spec_for(
            self.catalog,
            self.config,
            step,
            snap,
            plan,
            line,
            optimizer=optimizer_name(self.sources.optimizer),
            group=self.calls.write_group,
            gate=self.gate,
            data_dir=data_dirname(step, save_id) if self.config.dedup else None,
            base=base if self.config.dedup else None,
            verified=self.line.verified,
        )
        spec.timings.update(snapshot=t2 - t1, prepare=t1 - t0, blocked=t2 - t0)
        spec.recheck = recheck
        if also is not None:  # (not gated: tests hold the url's write, watch the other land)
            also(step, snap, plan, line, save_id)
        job = SaveJob(spec, finish=lambda: self._finished(spec, snap.reader_done))
        if snap.background and background:
            with interrupts_deferred():  # (once started, it is pending: wait() joins it)
                job.start()
                self.pending = job
            return True
        job.run()
        return False

    def copy_in(self, step: int, parts: Prebuilt) -> None:
        """Commit ``step`` from files written elsewhere (``parts``: the memory tier's), copied
        as they are, through the same begin, commit and retention as a snapshot's save."""
        plan, line, save_id, _, _ = self._begin(step, overwrite=False)
        snap = Snapshot({}, HostStaging(), background=False)
        spec = spec_for(
            self.catalog,
            self.config,
            step,
            snap,
            plan,
            line,
            optimizer=optimizer_name(self.sources.optimizer),
            group=self.calls.write_group,
            gate=None,
            data_dir=data_dirname(step, save_id) if self.config.dedup else None,
        )
        spec.parts = parts
        SaveJob(spec, finish=lambda: self._finished(spec, snap.reader_done)).run()

    def _begin(
        self, step: int, overwrite: bool, cached: bool = False
    ) -> tuple[SavePlan, str, str, Any, Callable[[], SavePlan] | None]:
        """Rank 0 readies ``step`` (``RunLine.begin``; ``cached``: decides from what the
        catalog knows, and the returned ``begin`` runs on rank 0 in the save's job) and draws
        the save's id; every rank learns them, and what the save may refer to
        (``RunLine.saving``)."""
        later: list[Any] = [None]  # (rank 0's: a closure is not broadcast)

        def begin() -> tuple[SavePlan, str, str, bool]:
            plan, line, later[0] = self.line.begin(self.catalog, step, overwrite, cached=cached)
            return plan, line, new_id(), later[0] is not None

        plan, line, save_id, deferred = coll.on_rank0(begin, self.calls.group)
        recheck = (lambda: later[0]()) if deferred else None
        return plan, line, save_id, self.line.saving(plan, line), recheck

    def _finished(self, spec: WriteSpec, release: Callable[[], None]) -> None:
        """In the caller's thread, once a save's job has ended (committed or not)."""
        release()
        if spec.committed_at is not None:
            read_back = spec.confirm in ("checksum", "crc32")  # (its references included)
            self.line.committed(spec.next_base, (spec.step, spec.plan.gen) if read_back else None)
        t = spec.timings
        t["total"] = sum(t.get(k, 0.0) for k in ("blocked", "dcp_save", "commit", "retention"))
        self.timings = dict(t)
        _log.debug("saved step %d: %s", spec.step, ", ".join(f"{k} {v:.3f}s" for k, v in t.items()))

    def wait(self) -> int | None:
        """Until the pending save is committed (its failure raised here); its step."""
        job = self.pending
        if job is None:
            return None
        try:
            return job.wait()
        finally:
            if job.joined:  # interrupted while joining (Ctrl-C): still pending
                self.pending = None
