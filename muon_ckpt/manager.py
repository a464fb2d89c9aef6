"""CheckpointManager: save and resume model, optimizer and extra state on any number of ranks.

A save is ``due -> admit -> snapshot -> write -> commit -> tidy``, to the url, the memory tier
or both: ``_saves.Saves`` decides, admits once (``save.RunLine``), takes one snapshot
(``save.take``, the only part an asynchronous save blocks for) and hands it to the url's
writer (``save.UrlWriter``: write, confirm, commit, here or in a background thread) and the
memory tier's (``memory.MemoryWriter``). A load is ``decide -> attempt -> apply``, all or
nothing, falling back past damaged steps, from the memory tier first (``memory.load_tiers``,
``load.resume``). The options are described once, in ``_config.OPTIONS``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterable
from typing import Any, Literal

import torch

import muon_ckpt._collective as coll
from muon_ckpt._config import OPTIONS, ManagerConfig, MemoryOptions, checks_content
from muon_ckpt._deprecated import DeprecatedOptions, Unpack, upgrade
from muon_ckpt._errors import CheckpointError, passes_interrupts
from muon_ckpt._interrupts import interrupts_deferred
from muon_ckpt._preempt import PreemptionWatch
from muon_ckpt._saves import Saves
from muon_ckpt.load import LoadTargets
from muon_ckpt.memory import load_tiers
from muon_ckpt.save import RunLine, SaveSources, hook_step
from muon_ckpt.state import HostStaging, LoadReport, check_objects, check_parts
from muon_ckpt.store import StepInfo, check_step, open_run

__all__ = ["CheckpointManager"]

_log = logging.getLogger("muon_ckpt")


class CheckpointManager:
    """Save and load checkpoints of a training run under one URL. Save, load, wait and close
    are collectives: call them on every rank."""

    def __init__(
        self,
        url: str,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        extra: dict[str, Any] | None = None,
        rank_extra: dict[str, Any] | None = None,
        keep_last: int | None = None,
        interval: int | None = None,
        storage_options: dict[str, Any] | None = None,
        resume_from: str | tuple[str, int] | None = None,
        resume_storage_options: dict[str, Any] | None = None,
        io_threads: int | None = None,
        verify: str = "checksum",
        async_save: bool | Literal["deferred"] = False,
        max_staging_bytes: int | None = None,
        collective_timeout: float = 600.0,
        storage_timeout: float | None = 60.0,
        lease_seconds: float = 600.0,
        confirm: str = "checksum",
        dedup: bool = True,
        dedup_max_age: int = 10,
        compression: str | None = None,
        read_once: bool | None = None,
        new_run: bool = False,
        certify_replicas: bool = False,
        memory: MemoryOptions | None = None,
        **deprecated: Unpack[DeprecatedOptions],
    ) -> None:
        # ``deprecated``: the keywords of before 0.3, moved to their new spelling with a
        # DeprecationWarning; any other keyword is a TypeError, as without ``**``.
        given = {k: v for k, v in locals().items() if k in ManagerConfig.__dataclass_fields__}
        self.config = ManagerConfig(**upgrade(given, dict(deprecated)))
        self._extra, self._rank_extra = check_objects(model, optimizer, extra, rank_extra)
        self._model, self._optimizer = model, optimizer
        c = self.config
        self._catalog, self._resume = open_run(
            c.url,
            c.storage_kwargs,
            timeout=c.storage_timeout,
            lease_seconds=c.lease_seconds,
            resume_from=c.resume_from,
            resume_options=None if c.resume_storage_options is None else c.resume_kwargs,
        )
        self._calls = coll.Calls(
            c.url, c.collective_timeout, background_groups=c.memory is not None
        )
        line = RunLine(c.new_run, loads_check=checks_content(c.verify))
        self._preempt: PreemptionWatch | None = None
        self._staging = HostStaging()  # host buffers allocated by the first save, then reused
        warned: set[str] = set()  # warnings given once per manager
        limit = c.max_staging_bytes
        state = (model, optimizer, self._extra, self._rank_extra, self._staging)
        deferred = c.deferred
        self._sources = SaveSources(*state, None, limit, warned, deferred)
        self._saves = Saves(self._catalog, c, line, self._sources, self._calls, self)
        self._stop_saves = self._saves.stop  # (Ctrl-C at exit, from the signal handler: _exit)
        self._hook = hook_step(optimizer, self._saves) if deferred else None
        self._targets = LoadTargets(*state, config=c, group=None, hosts=1, warned=warned)
        self._closed = False
        # This rank's seconds per phase of the last load (docs/internals.md), what it left
        # out (strict=False), and the bytes it read from storage.
        self.last_load_timings: dict[str, float] = {}
        self.last_load_report = LoadReport()
        self.last_load_bytes_read = 0
        # Where the last load read this rank's state: "memory" (its own memory tier), "peer"
        # (a replica on another rank) or "storage" (url, or resume_from); None before one.
        self.last_load_tier: str | None = None

    # ------------------------------------------------------------------ queries
    @property
    def url(self) -> str:
        return self.config.url

    def steps(self) -> list[int]:
        """Committed steps at ``url``, ascending (this rank's listing, not a collective; also
        after ``close()``). A step saving in the background appears once committed."""
        return self._catalog.committed_steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    @property
    def durable_step(self) -> int | None:
        """The newest step committed to ``url`` (persistent storage; a listing): memory-tier
        steps never count."""
        return self.latest_step()

    def step_info(self, step: int | None = None) -> StepInfo | None:
        """What the manifest of committed ``step`` (default: the newest) says, before loading
        it: ``world_size`` (ranks that saved it), ``time``, ``size``, ``files``, ``line``;
        None when nothing is committed. Not a collective."""
        return self._catalog.step_info(step)

    # ------------------------------------------------------------------ save
    @passes_interrupts
    def save(self, step: int, *, force: bool = False, overwrite: bool = False) -> bool:
        """Save ``step`` if it is due (``interval``) or ``force``; return whether it saved.

        With ``async_save`` it returns after the snapshot; the commit follows in the
        background (``wait()``). A pending save is waited for first and its failure raised
        here, without saving ``step``. A committed ``step`` needs ``overwrite=True`` (the new
        version is written beside it and replaces it once committed). After a rewind the
        first save retires the abandoned steps and deletes them once it committed. With
        ``watch_preemption()``, a call after the signal saves ``step`` and exits (code 0).
        """
        self._check_open()
        step = check_step(step)
        if self._preempt is not None and self._preempt.agreed(self.config.collective_timeout, step):
            self._save_and_exit(step)
        url, memory = self._saves.due(step, force)
        if not url and not memory:
            return False
        self._calls.join(f"save(step={step})")
        return self._saves.save(step, url=url, memory=memory, overwrite=overwrite)

    @property
    def last_save_timings(self) -> dict[str, float]:
        """This rank's seconds per phase of the last finished save (docs/internals.md)."""
        return self._saves.timings

    @passes_interrupts
    def wait(self) -> int | None:
        """Block until the pending asynchronous save is complete in every tier it goes to
        (committed to ``url``; in the memory tier, replicas and a queued memory step included)
        and return its step (None when nothing was pending); a failure to commit is raised
        here (CheckpointError naming the step); the memory tier's are WARNINGs."""
        self._check_open()
        return self._saves.wait()

    # ------------------------------------------------------------------ preemption
    def watch_preemption(self, signals: Iterable[int] = (signal.SIGTERM,)) -> None:
        """Opt in: after one of ``signals`` (SIGTERM: what SLURM, Kubernetes and torchrun's
        agent send before they kill), the next ``save(step)`` on every rank finishes the
        pending save, saves ``step`` synchronously (due or not) and raises ``SystemExit(0)``.
        Installs signal handlers (main thread); ``close()`` puts the old ones back. Every
        ``save()`` call then makes one small collective: call it on every rank every step."""
        self._check_open()
        if self._preempt is None:
            self._preempt = PreemptionWatch(signals)

    def _save_and_exit(self, step: int) -> None:
        """Preempted: finish the pending save, save ``step`` (unless committed), exit 0."""
        self._calls.join(f"save(step={step}) on preemption")
        try:
            self.wait()
        except CheckpointError as e:  # that step is lost; the current one is what matters now
            _log.error("preempted: %s", e)
        group = self._calls.group
        if not coll.on_rank0(lambda: step in self._catalog.committed_steps(), group):
            self._saves.save(step, url=True, memory=False, background=False)
        if self._preempt is not None:
            self._preempt.exit(step)

    # ------------------------------------------------------------------ load
    @passes_interrupts
    def load(
        self,
        step: int | None = None,
        *,
        strict: bool = True,
        parts: tuple[str, ...] | list[str] | None = None,
        elastic: bool = False,
    ) -> int | None:
        """Load ``step`` in place (default: the newest that loads cleanly, skipping damaged
        steps with a WARNING, then ``resume_from``'s) and return it; None on a fresh run.

        All or nothing on every rank. ``strict=False`` loads what matches
        (``last_load_report``); ``parts``: a subset of ``("model", "optim", "extra",
        "rank_extra")``; ``elastic``: at another world size, everything but ``rank_extra``
        (WARNING). A pending save is committed first; a newer format raises
        CheckpointVersionError.
        """
        self._check_open()
        if step is not None:
            step = check_step(step)
        chosen = check_parts(parts)
        self._calls.join(f"load(step={step})")
        self.wait()
        t = self._targets
        t.group, t.hosts = self._calls.group, self._calls.hosts
        where = (t, self._catalog, self._resume, self._saves.tier, step)
        with t.tail():  # (Ctrl-C once the ranks agreed to keep it: raised after the records)
            got = load_tiers(*where, strict=strict, parts=chosen, elastic=elastic)
            self._saves.loaded(self.url, None if got is None else got.decision)
            if got is None:
                if coll.rank() == 0:
                    tried = "" if self._resume is None else " nor in resume_from"
                    _log.info("no committed step in %s%s: starting fresh", self.url, tried)
                return None
            self.last_load_report, self.last_load_timings = got.report, got.timings
            self.last_load_bytes_read = got.bytes_read if got.tier == "storage" else 0
            self.last_load_tier = got.tier
        return got.decision.step

    # ------------------------------------------------------------------ lifecycle
    @passes_interrupts
    def close(self) -> None:
        """Finish a pending save (its failure is raised here; Ctrl-C stops it, raised once it
        ended), give the write lease back, restore the signal handlers; ``steps()`` works after.
        Idempotent. Call it before ``destroy_process_group()``: a pending save needs the group."""
        if self._closed:
            return
        with interrupts_deferred(self._saves.stop):
            try:
                self._saves.close()  # (waits, flushes the memory tier's newest step)
            finally:
                self._staging.release()
                self._closed = True
                if self._preempt is not None:
                    self._preempt.restore()
                if self._hook is not None:
                    self._hook.remove()
                self._calls.close()
                if coll.rank() == 0:  # the next job may write at once
                    with contextlib.suppress(CheckpointError):
                        self._catalog.lease.release()

    def _close_at_exit(self) -> None:
        """The interpreter is exiting (``_exit``): commit the pending save, or say why not."""
        if self._closed:
            return
        step = self._saves.writing()
        if step is not None:
            _log.info("waiting for the asynchronous save of step %d before exiting", step)
        try:
            self.close()
        except Exception as e:  # the errors of a save name the step
            _log.error("at exit: %s", e)

    def __enter__(self) -> CheckpointManager:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager({self.url!r}) is closed; create a new one")

    def __repr__(self) -> str:
        c = self.config
        return (
            f"CheckpointManager({c.url!r}, keep_last={c.keep_last}, interval={c.interval}, "
            f"async_save={c.async_save!r}, resume_from={c.resume_from!r})"
        )


CheckpointManager.__doc__ = (
    (CheckpointManager.__doc__ or "")
    + "\n\n    Args:\n"
    + "".join(f"        {name}: {text.replace('`', '``')}\n" for name, text in OPTIONS.items())
)
