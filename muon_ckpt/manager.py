"""CheckpointManager: save and resume model, optimizer and extra state on any number of ranks.

One save = snapshot -> write -> commit -> retention:

1. snapshot (the caller's thread; the only part an asynchronous save blocks for): the flat
   FQN-keyed state dict (``_flatten``); with CPU offload on, the optimizer's offloaded states
   as views of its pinned CPU buffers (frozen for an asynchronous save, so steps taken
   meanwhile do not change them; no copy); every other tensor copied into reused host
   buffers (``io.HostStaging``: device tensors on a side stream; for an asynchronous save
   also CPU tensors and, deep-copied, Python values);
2. write, commit and retention (``io.SaveJob``): in this thread, or with ``async_save`` in a
   background thread whose collectives run on a gloo group of their own.

One load = decide (rank 0 picks the step from the catalog and checks it; all ranks get the
decision) -> read + verify (``io.VerifyingReader``) -> apply. With CPU offload on, optimizer
states are read straight into the pool's pinned buffers; offload stays on throughout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import operator
import posixpath
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import muon_ckpt._collective as coll
from muon_ckpt._config import ManagerConfig, checks_content
from muon_ckpt._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from muon_ckpt._exit import finish_at_exit
from muon_ckpt._flatten import (
    PARTS,
    FlatState,
    LoadReport,
    check_stateful,
    extra_digests,
    module_extra_states,
    prepare_optimizer_state,
)
from muon_ckpt._fqn import param_fqns
from muon_ckpt._preempt import PreemptionWatch
from muon_ckpt._rollback import Rollback
from muon_ckpt._tensors import local_tensor
from muon_ckpt.io import (
    DCP_ERRORS,
    HostStaging,
    SafeLoadPlanner,
    SaveJob,
    VerifyingReader,
    WriteSpec,
    dcp_failure,
    interrupt_in,
)
from muon_ckpt.store import (
    COMMITTED,
    CORRUPT,
    MAX_STEP,
    NEWER,
    SUPERSEDED,
    Catalog,
    FileEntry,
    SavePlan,
    StepInfo,
    Storage,
    open_storage,
    parse_step_dirname,
)

__all__ = ["CheckpointManager"]

_log = logging.getLogger("muon_ckpt")


def _open_storage(field: str, url: str, options: dict[str, Any], timeout: float | None) -> Storage:
    return open_storage(url, options, field=field, timeout=timeout)  # probes it (issue 14)


def _nbytes(t: torch.Tensor) -> int:
    t = local_tensor(t)
    return t.numel() * t.element_size()


class CheckpointManager:
    """Save and load checkpoints of a training run under one URL.

    Args:
        url: checkpoint root: a local path or any fsspec URL (``file://``, ``memory://``,
            ``s3://``, ``gs://``, ...). Each step is a directory ``step-<8 digits>``.
        model: its ``state_dict()`` is saved as ``model.<fqn>`` and loaded in place (FQNs
            without ``_orig_mod.``/``module.``: compiled, DDP and plain models interchange).
        optimizer: any ``torch.optim.Optimizer``; its state is keyed by parameter FQN.
        extra: ``{name: obj}`` with ``state_dict()``/``load_state_dict()`` (LR scheduler, data
            position...): the same on every rank (checked at each save), saved once.
        rank_extra: ``{name: obj}`` like ``extra``, but each rank's own (a per-rank data
            position, RNG state): saved per rank, loaded back by the same rank at the same
            world size (``load(parts=...)`` without ``"rank_extra"`` skips it).
        keep_last: keep this many newest committed steps; older ones are deleted after a commit.
        interval: ``save(step)`` saves only when ``step % interval == 0`` (``force=True`` always).
        storage_options: fsspec options (credentials, ``endpoint_url``...).
        resume_from: a URL (run root or ``.../step-XXXXXXXX``) or ``(url, step)`` to load from
            while ``url`` has no committed step yet.
        resume_storage_options: fsspec options for ``resume_from`` (default: ``storage_options``).
        io_threads: files written in parallel per rank, and threads reading in parallel (a
            large local file is read in parts by all of them). None: 4 files, and 4 reading
            threads from remote storage, from local storage half the cores this rank may run
            on (shared with the other ranks of its host), 4 to 8.
        verify: ``"checksum"`` checks size and checksums (CRC32C) of every file a load reads
            (``"crc32"``, its former name, means the same); ``"size"`` only sizes.
        async_save: ``save()`` returns once the state is snapshotted; the write and the commit
            run in the background (``wait()`` for them).
        max_staging_bytes: host memory a snapshot may hold; a save that needs more runs
            synchronously without staging copies (None: no bound).
        collective_timeout: seconds a rank waits for the others in ``save()``/``load()`` before
            it raises a CheckpointError naming the ranks that did not join.
        storage_timeout: seconds one storage request may take (S3: connect and read
            timeouts; None: the client's defaults). Default 60.
        lease_seconds: the run's write lease (one writer per run) expires this long after
            this job's last save. Default 600.
        confirm: before a commit, how each rank confirms the storage holds the files it
            wrote: ``"checksum"`` reads them back (default; ``"crc32"`` means the same),
            ``"size"`` compares sizes, ``"off"``.
        read_once: a stored item that several ranks load whole (replicated tensors, plain
            tensors on every rank, ``extra``) is read from storage by one rank and sent to the
            others over the process group. None (default): when the storage is remote or the
            ranks run on more than one host (on one host, the page cache already serves the
            other ranks' reads of a local file, faster than the process group).
        new_run: a first ``save()`` without a ``load()`` starts a new run in ``url`` even
            when it holds another run's committed steps: they are deleted (WARNING) once this
            run's first step is committed. Without it, that save is refused.

    Save, load, wait and close are collectives: call them on every rank.
    """

    _instances: dict[str, int] = {}  # managers of each url made in this process

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
        async_save: bool = False,
        max_staging_bytes: int | None = None,
        collective_timeout: float = 600.0,
        storage_timeout: float | None = 60.0,
        lease_seconds: float = 600.0,
        confirm: str = "checksum",
        read_once: bool | None = None,
        new_run: bool = False,
    ) -> None:
        self.config = ManagerConfig(
            url=url,
            keep_last=keep_last,
            interval=interval,
            storage_options=storage_options,
            resume_from=resume_from,
            resume_storage_options=resume_storage_options,
            io_threads=io_threads,
            verify=verify,
            async_save=async_save,
            max_staging_bytes=max_staging_bytes,
            collective_timeout=collective_timeout,
            storage_timeout=storage_timeout,
            lease_seconds=lease_seconds,
            confirm=confirm,
            read_once=read_once,
            new_run=new_run,
        )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
            )
        self._model = model
        self._optimizer = optimizer
        self._extra = check_stateful("extra", extra)
        self._rank_extra = check_stateful("rank_extra", rank_extra)
        both = sorted(set(self._extra) & set(self._rank_extra))
        if both:
            raise ValueError(f"{both} are names in both extra and rank_extra; use each name once")
        if optimizer is not None:
            param_fqns(model, optimizer)  # a param without a name is a configuration error
        opts = self.config.storage_kwargs
        timeout = self.config.storage_timeout
        self._catalog = Catalog(
            _open_storage("url", self.config.url, opts, timeout),
            lease_seconds=self.config.lease_seconds,
        )
        self._resume: tuple[Catalog, int | None] | None = None
        rf = self.config.resume_from
        if rf is not None:
            rf_url, rf_step = (rf, None) if isinstance(rf, str) else rf
            base = posixpath.basename(rf_url.rstrip("/"))
            if rf_step is None and parse_step_dirname(base) is not None:
                rf_step = parse_step_dirname(base)
                rf_url = rf_url.rstrip("/")[: -len(base)].rstrip("/") or "/"
            rf_opts = self.config.resume_kwargs
            rf_storage = _open_storage("resume_from", rf_url, rf_opts, timeout)
            self._resume = (Catalog(rf_storage), rf_step)
        self._pending: SaveJob | None = None
        self._hosts = 1  # hosts the ranks run on (counted with the group)
        self._group: Any = None  # gloo group of every save/load collective, made by the first
        # Handshake keys: per url and per manager of that url in this process (the same on
        # every rank when every rank makes the same managers, whatever else a rank makes).
        url_id = hashlib.blake2b(self.config.url.encode(), digest_size=8).hexdigest()
        n = CheckpointManager._instances[url_id] = CheckpointManager._instances.get(url_id, 0) + 1
        self._tag = f"muon_ckpt/{url_id}/{n}"
        self._calls = 0  # save/load calls so far: the handshake's sequence number
        # The run's line (store._lines): whether this manager loaded (or found nothing to
        # load) or saved, the line id its commits carry, and the steps its next commit
        # retires ((step, gen); gen None for a CORRUPT step): a rewind's newer steps.
        self._resumed = False
        self._line: str | None = None
        self._abandoned: list[tuple[int, int | None]] = []
        self._preempt: PreemptionWatch | None = None
        self._staging = HostStaging()  # host buffers allocated by the first save, then reused
        self._warned_budget = False
        self._warned_load = False
        self._closed = False
        # Tests only: a background write starts once this event is set, so a test can change
        # the state while a save is certainly still pending.
        self._write_gate: threading.Event | None = None
        # Seconds per phase of the last finished save on this rank (also logged at DEBUG):
        # prepare (rank 0 readies the step directory), snapshot, blocked (all save() took),
        # dcp_save, commit (the manifest), retention, total; within dcp_save: write_data (the
        # writer threads' wall time) and, summed over those threads, stage_wait (waiting for
        # host copies), write (in the storage's write calls), writeback (queueing local pages
        # for write-out), crc_wait (checksum still running after its write returned), sync
        # (fsync and close).
        self.last_save_timings: dict[str, float] = {}
        # The same for the last load: decide, prepare, backup (the copy that lets a failed
        # load be undone), dcp_load, apply (also the ranks' agreement on the outcome), total;
        # and read (the reader's wall time: reads, checksums, copies into place).
        self.last_load_timings: dict[str, float] = {}
        # What the last load left out (load(strict=False)); empty after a strict load.
        self.last_load_report = LoadReport()
        # Bytes the last load read from storage on this rank (data, checks and the parsing
        # of items; local files and remote objects alike).
        self.last_load_bytes_read = 0

    # ------------------------------------------------------------------ queries
    @property
    def url(self) -> str:
        return self.config.url

    def steps(self) -> list[int]:
        """Committed steps at ``url``, ascending (this rank's own listing; not a collective;
        also after ``close()``). A step being saved in the background is listed once it is
        committed."""
        return self._catalog.committed_steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def step_info(self, step: int | None = None) -> StepInfo | None:
        """What the manifest of committed ``step`` (default: the newest) says, read before
        loading it: ``world_size`` (ranks that saved it), ``time``, ``size``, ``files``,
        ``line``; None when nothing is committed. Not a collective."""
        committed = [i for i in self._catalog.scan() if i.committed]
        if step is None:
            return committed[-1] if committed else None
        found = next((i for i in committed if i.step == step), None)
        if found is None:
            raise self._catalog.not_found(step, [i.step for i in committed])
        return found

    # ------------------------------------------------------------------ collectives
    def _join(self, call: str) -> None:
        """Every rank is in the same ``call``, or every rank that is raises (bounded by
        ``collective_timeout``); the first call also makes the manager's process group."""
        if not coll.is_dist():
            return
        self._calls += 1
        if self._calls > 2:
            coll.forget(f"{self._tag}/{self._calls - 2}")  # every rank is past that one
        timeout = self.config.collective_timeout
        coll.handshake(f"{self._tag}/{self._calls}", call, timeout)
        self._ensure_group()

    def _ensure_group(self) -> None:
        """Make the manager's gloo group (a collective: every rank reaches it in the same
        call)."""
        if coll.is_dist() and self._group is None:
            self._group = coll.new_group(self.config.collective_timeout)
            self._hosts = len(set(coll.all_gather(socket.gethostname(), self._group)))

    # ------------------------------------------------------------------ save
    def save(self, step: int, *, force: bool = False, overwrite: bool = False) -> bool:
        """Save ``step`` if it is due (``interval``) or ``force``; return whether it saved.

        With ``async_save`` it returns once the state is snapshotted; the step is committed
        in the background (``wait()``). A pending save is waited for first, and its failure
        raised here, without saving ``step`` (a call ``interval`` skips returns False without
        waiting). Raises CheckpointExistsError if ``step`` is committed already, unless
        ``overwrite``: the new version is written beside the committed step and replaces it
        once committed (if this save fails, the old version stays). The first save after
        ``load(step=k)`` rewound the run retires the committed steps after ``k``, and deletes
        them once it committed. After ``watch_preemption()``, every call (due or not) asks the
        ranks whether one was signalled; if so it finishes the pending save, saves ``step``
        and raises ``SystemExit(0)``.
        """
        self._check_open()
        step = self._check_step(step)
        if self._preempt is not None and self._preempted():
            self._save_and_exit(step)
        if not force and self.config.interval is not None and step % self.config.interval:
            return False
        self._join(f"save(step={step})")
        self.wait()
        return self._save(step, overwrite, self.config.async_save)

    def _save(self, step: int, overwrite: bool, background: bool) -> bool:
        """One save (the handshake done, nothing pending): snapshot -> write -> commit."""
        t0 = time.perf_counter()
        group = self._group
        plan, self._line = coll.on_rank0(lambda: self._begin(step, overwrite), group)
        # Retired by this save once it commits; until then, by the next save (_finished).
        self._abandoned = [*((s, g) for s, g in plan.retires), *((s, None) for s in plan.drop)]
        self._resumed = True
        t1 = time.perf_counter()
        # No collective between here and the outcome's all-gather but the budget's, which
        # every rank reaches (the configuration is the same everywhere): a rank that fails
        # goes straight to the next gather that all reach.
        error: Exception | None = None
        digests: dict[str, str] = {}
        need = 0
        try:
            digests = extra_digests(self._extra)
            flat, views, keep = self._build()
            need = self._async_need(flat, keep)
        except Exception as e:
            error = e
        limit = self.config.max_staging_bytes
        if background and limit is not None:
            gathered = coll.all_gather((error is None, need), group)
            self._raise_failed(step, error, [r for r, (ok, _) in enumerate(gathered) if not ok])
            background = self._within_budget(max(n for _, n in gathered), limit)
        release = None
        if error is None:
            try:
                spec, release = self._snapshot(step, flat, views, keep, background, plan)
            except Exception as e:  # every rank must learn of it before any starts to write
                error = e
        outcome = coll.all_gather((error is None, digests), group)
        failed = [r for r, (ok, _) in enumerate(outcome) if not ok]
        differs = None if failed else _differing_extra(step, [d for _, d in outcome])
        if failed or differs:
            if error is None:
                self._staging.finish()
                if release is not None:
                    release()
            if differs is not None:
                raise differs
            self._raise_failed(step, error, failed)
        t2 = time.perf_counter()
        spec.timings.update(snapshot=t2 - t1, prepare=t1 - t0, blocked=t2 - t0)
        job = SaveJob(spec, finish=lambda: self._finished(spec, release))
        if background:
            finish_at_exit(self)  # the interpreter's exit waits for it (_exit)
            job.start()
            self._pending = job
        else:
            job.run()
        return True

    # ------------------------------------------------------------------ preemption
    def watch_preemption(self, signals: Iterable[int] = (signal.SIGTERM,)) -> None:
        """Opt in: after one of ``signals`` (default SIGTERM, what SLURM, Kubernetes and
        torchrun's agent send before they kill), the next ``save(step)`` on every rank
        finishes the pending save, saves ``step`` (synchronously, due or not) and raises
        ``SystemExit(0)``. Installs signal handlers (main thread only); ``close()`` puts the
        previous ones back. Each ``save()`` call then makes one small collective (the ranks
        agree on whether one was signalled), so every rank must call ``save()`` every step."""
        self._check_open()
        if self._preempt is None:
            self._preempt = PreemptionWatch(signals)

    def _preempted(self) -> bool:
        """Whether any rank received a watched signal (every rank asks at every save())."""
        if self._preempt is None:
            return False
        try:
            return self._preempt.agreed(self.config.collective_timeout)
        except RuntimeError as e:
            raise coll.comm_failure(e, "agreeing on preemption") from e

    def _save_and_exit(self, step: int) -> None:
        """Preempted: finish the pending save, save ``step`` unless it is committed, exit 0."""
        if coll.rank() == 0 and self._preempt is not None and self._preempt.received:
            _log.warning(
                "preempted (%s): finishing the pending save, then saving step %d",
                signal.Signals(self._preempt.received).name,
                step,
            )
        self._join(f"save(step={step}) on preemption")
        try:
            self.wait()
        except CheckpointError as e:  # that step is lost; the current one is what matters now
            _log.error("preempted: %s", e)
        done = coll.on_rank0(lambda: step in self._catalog.committed_steps(), self._group)
        if not done:
            self._save(step, overwrite=False, background=False)
        if coll.rank() == 0:
            _log.warning("preempted: step %d is committed; exiting with code 0", step)
        raise SystemExit(0)

    @staticmethod
    def _raise_failed(step: int, error: Exception | None, failed: list[int]) -> None:
        if isinstance(error, CheckpointError):
            raise error
        if error is not None:  # (an extra's state_dict(), the optimizer's offload snapshot)
            raise CheckpointError(
                f"saving step {step}: taking the snapshot failed: {type(error).__name__}: "
                f"{error}; nothing was written and every committed step is intact"
            ) from error
        if failed:
            raise CheckpointError(
                f"saving step {step}: taking the snapshot failed on rank(s) {failed} (their "
                "own error says why); nothing was written and every committed step is intact"
            )

    def _begin(self, step: int, overwrite: bool) -> tuple[SavePlan, str]:
        """Rank 0, before a save: ready ``step`` and decide what it retires (``Catalog.begin``);
        the line id its commit carries (this run's, or a new one)."""
        plan = self._catalog.begin(
            step,
            overwrite=overwrite,
            resumed=self._resumed,
            new_run=self.config.new_run,
            abandon=self._abandoned,
        )
        replaced = plan.replacing
        if replaced and not self._resumed:
            _log.warning(
                "%s: new_run=True: starting a new run here; the steps of the previous one %s "
                "are deleted once step %d is committed",
                self.url,
                replaced,
                step,
            )
        elif replaced:
            _log.warning(
                "%s: this run was rewound to an earlier step; step %d retires the steps of "
                "the abandoned line %s, which are deleted once it is committed",
                self.url,
                step,
                replaced,
            )
        return plan, self._line or uuid.uuid4().hex[:16]

    def _build(self) -> tuple[FlatState, dict[int, torch.Tensor], set[str]]:
        """The flat state to save, the offloaded states' host views, and their keys."""
        flat = FlatState.build(
            self._model,
            self._optimizer,
            self._extra,
            rank_extra=self._rank_extra,
            rank=coll.rank(),
        )
        views = self._offloaded_views()
        return flat, views, flat.host_state_keys(views)

    def _async_need(self, flat: FlatState, keep: set[str]) -> int:
        """Host bytes an asynchronous save of ``flat`` holds (0 when there is no bound)."""
        if not self.config.async_save or self.config.max_staging_bytes is None:
            return 0
        need = self._staging.bytes_needed(flat.sd, copy_cpu=True, keep=keep)
        return need + sum(_nbytes(flat.sd[k]) for k in keep)  # the pool's second buffer

    def _within_budget(self, need: int, limit: int) -> bool:
        if need <= limit:
            return True
        if not self._warned_budget:
            _log.warning(
                "an asynchronous save of this state needs %d bytes of host memory, more than "
                "max_staging_bytes=%d: saves run synchronously, without staging copies",
                need,
                limit,
            )
            self._warned_budget = True
        return False

    def _snapshot(
        self,
        step: int,
        flat: FlatState,
        views: dict[int, torch.Tensor],
        keep: set[str],
        background: bool,
        plan: SavePlan,
    ) -> tuple[WriteSpec, Any]:
        """The state of this moment, as DCP will write it: (spec, release)."""
        opt, limit = self._optimizer, self.config.max_staging_bytes
        release = None
        try:
            if background and keep:
                frozen = opt.freeze_cpu_state()  # keeps these values while training goes on
                views, release = frozen.views, frozen.release
            flat.use_host_states(views)
            if background:
                flat.detach_objects()
            staged = flat.sd
            if background or limit is None or self._within(flat.sd, keep, limit):
                staged = self._staging.stage(flat.sd, copy_cpu=background, keep=keep)
            if background:
                self._staging.finish()  # every copy has landed: training may change anything
        except BaseException:
            try:
                self._staging.finish()
            finally:
                if release is not None:
                    release()
            raise
        spec = WriteSpec(
            catalog=self._catalog,
            step=step,
            sd=staged,
            staging=self._staging,
            world_size=coll.world_size(),
            io_threads=self.config.write_threads,
            keep_last=self.config.keep_last,
            plan=plan,
            line=self._line,
            optimizer=_type_name(self._optimizer),
            confirm=self.config.confirm,
            group=self._group,
            gate=self._write_gate if background else None,
        )
        return spec, release

    def _within(self, sd: dict[str, Any], keep: set[str], limit: int) -> bool:
        return self._staging.bytes_needed(sd, copy_cpu=False, keep=keep) <= limit

    def _offloaded_views(self) -> dict[int, torch.Tensor]:
        """With CPU offload on: host views of the optimizer's offloaded states (the offload
        protocol: ``cpu_state_views()``); {} otherwise."""
        opt = self._optimizer
        if opt is None or getattr(opt, "cpu_offload", False) is not True:
            return {}
        for m in ("cpu_state_views", "freeze_cpu_state"):
            if not callable(getattr(opt, m, None)):
                raise TypeError(
                    f"{type(opt).__name__} has CPU offload on but no {m}(); the checkpoint "
                    "manager reads and writes offloaded states through cpu_state_views() and "
                    "freeze_cpu_state() (see optim.Muon)"
                )
        return opt.cpu_state_views()

    def _finished(self, spec: WriteSpec, release: Any) -> None:
        """In the caller's thread, once a save's job has ended (committed or not)."""
        if release is not None:
            release()
        if spec.committed_at is not None:
            self._abandoned = []  # retired by that commit
        t = spec.timings
        t["total"] = sum(t.get(k, 0.0) for k in ("blocked", "dcp_save", "commit", "retention"))
        self.last_save_timings = dict(spec.timings)
        _log.debug("saved step %d: %s", spec.step, _fmt(spec.timings))

    def wait(self) -> int | None:
        """Block until the pending asynchronous save is committed; return its step (None when
        nothing was pending). Its failure is raised here (CheckpointError naming the step)."""
        self._check_open()
        job = self._pending
        if job is None:
            return None
        try:
            return job.wait()
        finally:
            if job.joined:  # interrupted while joining (Ctrl-C): still pending
                self._pending = None

    # ------------------------------------------------------------------ load
    def load(
        self,
        step: int | None = None,
        *,
        strict: bool = True,
        parts: tuple[str, ...] | list[str] | None = None,
        elastic: bool = False,
    ) -> int | None:
        """Load ``step`` in place; return the step loaded.

        Without ``step``: the newest committed step that loads cleanly (a step that fails its
        checks is skipped with a WARNING naming it and why; then ``resume_from``'s steps). With
        ``step``: exactly that step, never another. All or nothing: a load that raises leaves
        the model, the optimizer and ``extra`` as they were, on every rank. ``strict=False``
        loads what matches and leaves the rest as it is (``last_load_report`` says what, also
        logged). ``parts``: a subset of ``("model", "optim", "extra", "rank_extra")`` to load
        (default: all). ``elastic``: at another world size than the save's, load everything
        but ``rank_extra`` (each rank's own state, left as it is, with a WARNING) instead of
        refusing; ``step_info()`` tells the saved world size before loading. On a fresh run
        (nothing committed, no ``resume_from``) returns None, logs it (INFO) and changes
        nothing. A pending asynchronous save is committed first. A step written by a newer
        muon-ckpt is never skipped: CheckpointVersionError says to upgrade.
        """
        self._check_open()
        if step is not None:
            step = self._check_step(step)
        chosen_parts = self._check_parts(parts)
        self._join(f"load(step={step})")
        self.wait()
        skipped: list[_Skip] = []
        while True:
            t0 = time.perf_counter()
            d = coll.on_rank0(functools.partial(self._decide, step, skipped), self._group)
            if d is None:
                self._resumed, self._line, self._abandoned = True, None, []
                if coll.rank() == 0:
                    tried = "" if self._resume is None else " nor in resume_from"
                    _log.info("no committed step in %s%s: starting fresh", self.url, tried)
                return None
            if elastic and "rank_extra" in chosen_parts and d.world_size != coll.world_size():
                chosen_parts = tuple(p for p in chosen_parts if p != "rank_extra")
                if self._rank_extra and coll.rank() == 0:
                    _log.warning(
                        "step %d was saved on %d rank(s), this run has %d: loading everything "
                        "but rank_extra %s, which keeps its current values (elastic=True)",
                        d.step,
                        d.world_size,
                        coll.world_size(),
                        sorted(self._rank_extra),
                    )
            decided = time.perf_counter() - t0
            chosen, skipped = d.step, d.skipped
            catalog = self._resume[0] if d.from_resume and self._resume else self._catalog
            where = catalog.storage.url_of(d.dirname)
            bad, error, report, rollback = self._attempt(catalog, d, where, strict, chosen_parts)
            if not bad:
                break
            self._undo(rollback)
            corrupt = all(kind == "corrupt" for kind, _ in bad.values())
            if step is not None or not corrupt:
                if error is not None:
                    raise self._explained(error, d, chosen_parts)
                raise CheckpointError(
                    f"loading {where} failed on rank(s) {sorted(bad)} ({bad[min(bad)][1]}); "
                    "this rank's model, optimizer and extra state are as they were"
                )
            why = bad[min(bad)][1]
            if coll.rank() == 0:
                _log.warning(
                    "skipping step %d (%s): %s; trying the next older step", chosen, where, why
                )
            skipped = [*skipped, _Skip(d.from_resume, chosen, why)]
        try:
            if rollback is not None:
                rollback.done()
        finally:
            # The backup of host tensors is not kept (saves copy fewer of them, or none); the
            # buffers of device tensors (page-locked) are what every later save stages into.
            # Also on an interrupt: release waits for the backup's copies into them.
            self._staging.release("cpu")
        self._abandoned = d.newer
        self._resumed = True
        # A plain resume continues the line; a rewind (or a start from resume_from) begins one.
        self._line = d.line if not d.newer and not d.from_resume else None
        if d.newer and coll.rank() == 0:
            _log.warning(
                "%s: loaded step %d while newer steps %s exist; the first save of this run "
                "retires them and deletes them once it is committed (to keep them, resume "
                "into another url with resume_from)",
                self.url,
                chosen,
                [s for s, _ in d.newer],
            )
        if report is None:  # (set whenever no rank failed)
            raise AssertionError("a load that succeeded without a report")
        self.last_load_report = report
        if report:
            _log.warning("loaded step %d from %s partially: %s", chosen, where, report.summary())
        t = self.last_load_timings = {"decide": decided, **self.last_load_timings}
        t["total"] = time.perf_counter() - t0
        # apply: also the ranks' agreements and the bookkeeping, so the phases add up to total
        t["apply"] = t["total"] - sum(t[k] for k in ("decide", "prepare", "backup", "dcp_load"))
        _log.info("loaded step %d from %s in %.3f s", chosen, where, t["total"])
        _log.debug("loaded step %d: %s", chosen, _fmt(t))
        return chosen

    def _attempt(
        self,
        catalog: Catalog,
        d: _Decision,
        where: str,
        strict: bool,
        parts: tuple[str, ...],
    ) -> tuple[dict[int, tuple[str, str]], Exception | None, LoadReport | None, Rollback | None]:
        """One try at loading ``d.step``: (every rank's failure, this rank's error, the
        report, the rollback). Two agreement points: every rank is ready before any starts
        DCP's collectives, and every rank has read and applied before any keeps what it
        read. An agreement that fails (a rank gone) or an interrupt undoes this rank's part
        before it propagates (and stops the rollback's copier)."""
        error: Exception | None = None
        report: LoadReport | None = None
        rollback: Rollback | None = None
        try:
            try:
                model = self._model if "model" in parts else None
                kept = module_extra_states(model)  # what the load may change, to restore
                kept |= self._extra if "extra" in parts else {}
                kept |= self._rank_extra if "rank_extra" in parts else {}
                rollback = Rollback(self._optimizer, kept, self._staging)
                flat, report = self._prepare(d, where, strict, parts, rollback)
            except Exception as e:
                error = e
            bad = self._agree(error)
            if not bad:
                if rollback is None or report is None:  # (set whenever no rank failed)
                    raise AssertionError("an agreed load without its rollback or report")
                try:
                    self._read(catalog, d, where, flat, report, strict, parts, rollback.keep)
                except Exception as e:
                    error = e
                bad = self._agree(error)
        except BaseException:
            self._undo(rollback)
            raise
        return bad, error, report, rollback

    def _explained(self, error: Exception, d: _Decision, parts: tuple[str, ...]) -> Exception:
        """``error``, with what explains a mismatch that another optimizer type would."""
        ours = _type_name(self._optimizer)
        saved = d.optimizer
        if not isinstance(error, CheckpointMismatchError) or "optim" not in parts:
            return error
        if ours is None or saved is None or saved == ours:
            return error
        return CheckpointMismatchError(
            f"{error}. The checkpoint's optimizer state was saved by {saved}, this optimizer "
            f"is {ours}: optimizer types differ, and so do their states and param groups. To "
            "carry the state over, load(parts=('model', 'extra', 'rank_extra')) and convert "
            "it with import_optimizer_state(optimizer, url) (AdamW moments, Muon momentum)"
        )

    def _undo(self, rollback: Rollback | None) -> None:
        """Put back what a failed load changed on this rank; free the host backup."""
        try:
            if rollback is not None:
                rollback.restore()
        finally:
            self._staging.release("cpu")

    def _check_parts(self, parts: Any) -> tuple[str, ...]:
        if parts is None:
            return PARTS
        if isinstance(parts, str) or not all(p in PARTS for p in parts) or not parts:
            raise ValueError(f"parts must be a non-empty subset of {PARTS}, got {parts!r}")
        return tuple(parts)

    def _agree(self, error: Exception | None) -> dict[int, tuple[str, str]]:
        """Every rank's failure so far (rank -> (kind, message)), on every rank."""
        outcome = coll.all_gather(_outcome(error), self._group)
        return {r: o for r, o in enumerate(outcome) if o is not None}

    def _prepare(
        self, d: _Decision, where: str, strict: bool, parts: tuple[str, ...], rollback: Rollback
    ) -> tuple[FlatState, LoadReport]:
        """The flat state to read ``d.step`` into, fitted to its metadata, and its backup."""
        t0 = time.perf_counter()
        if "rank_extra" in parts and self._rank_extra and d.world_size != coll.world_size():
            raise CheckpointMismatchError(
                f"{where} was saved on {d.world_size} rank(s), this run has "
                f"{coll.world_size()}: rank_extra holds each rank's own state and loads back "
                "only at the same world size; load(elastic=True) loads the rest and leaves "
                "rank_extra as it is"
            )
        opt = self._optimizer if "optim" in parts else None
        fresh = prepare_optimizer_state(opt) if opt is not None else set()
        flat = FlatState.build(
            self._model,
            opt,
            self._extra,
            rank_extra=self._rank_extra,
            rank=coll.rank(),
            parts=parts,
        )
        flat.use_host_states(self._offloaded_views() if opt is not None else {})
        report = flat.check_against(d.metadata, fresh, where, strict=strict)
        report.step = d.step
        t1 = time.perf_counter()
        created = {k for k, (p, _) in flat.state_slots.items() if id(p) in fresh}
        limit = self.config.max_staging_bytes
        if not rollback.keep_values(flat.sd, skip=created, limit=limit) and not self._warned_load:
            _log.warning(
                "the backup that makes a load all-or-nothing needs more host memory than "
                "max_staging_bytes=%s: loads run without it (a failed load may leave the "
                "model and optimizer partly loaded)",
                limit,
            )
            self._warned_load = True
        self.last_load_timings = {"prepare": t1 - t0, "backup": time.perf_counter() - t1}
        return flat, report

    def _read(
        self,
        catalog: Catalog,
        d: _Decision,
        where: str,
        flat: FlatState,
        report: LoadReport,
        strict: bool,
        parts: tuple[str, ...],
        keep: Callable[[str], None] | None,
    ) -> None:
        """Read ``d.step`` into the live state and apply what DCP does not write in place;
        ``keep(key)`` before the first write into each tensor (``Rollback.keep``)."""
        t0 = time.perf_counter()
        reader = VerifyingReader(
            catalog.storage.child(d.dirname),
            d.files,
            metadata=d.metadata,
            rank=coll.rank(),
            world_size=coll.world_size(),
            io_threads=self.config.read_threads(catalog.storage.is_local),
            verify_crc=checks_content(self.config.verify),
            group=self._group if self._reads_once(catalog) else None,
        )
        try:
            dcp.load(
                flat.sd,
                storage_reader=reader,
                planner=SafeLoadPlanner(before_write=keep),
                process_group=self._group,
                no_dist=not coll.is_dist(),
            )
        except DCP_ERRORS as e:
            stop = interrupt_in(e)
            if stop is not None:  # Ctrl-C in the middle: itself, not a failure (undone above)
                raise stop from None
            raise dcp_failure(e, f"loading {where}") from e
        except RuntimeError as e:  # DCP's own collectives: a rank died or stopped answering
            raise coll.comm_failure(e, f"loading {where}") from e
        self.last_load_timings.update(dcp_load=time.perf_counter() - t0, **reader.timings)
        self.last_load_bytes_read = reader.bytes_read
        opt = self._optimizer if "optim" in parts else None
        flat.apply_loaded(opt, where, report, strict=strict)

    def _reads_once(self, catalog: Catalog) -> bool:
        """Whether a load from ``catalog`` reads shared items once (``read_once``)."""
        if self.config.read_once is not None:
            return self.config.read_once
        return not catalog.storage.is_local or self._hosts > 1

    def _decide(self, step: int | None, skipped: list[_Skip]) -> _Decision | None:
        """Rank 0: what to load, or None on a fresh run. Without ``step``, a step whose files
        fail the checks is skipped (WARNING) for the next older one, then ``resume_from``; a
        step of a newer format is never skipped (CheckpointVersionError)."""
        skipped = list(skipped)
        tried = {(s.from_resume, s.step) for s in skipped}
        scan = self._catalog.scan()
        newer_format = [s for s in scan if s.status == NEWER]
        if newer_format and (step is None or step in [s.step for s in newer_format]):
            raise CheckpointVersionError(
                f"{self.url}: step(s) {[s.step for s in newer_format]} were written by a newer "
                "muon-ckpt; this version neither reads them nor resumes an older step past "
                f"them. Upgrade muon-ckpt. ({newer_format[-1].problem})"
            )
        # What a save after this load abandons: newer committed (with their commit's gen)
        # or CORRUPT steps; superseded ones are already retired, newer-format ones never are.
        present = [
            (s.step, (s.gen or 0) if s.committed else None)
            for s in scan
            if s.status in (COMMITTED, CORRUPT)
        ]
        steps = [s.step for s in scan if s.committed]
        if step is not None:
            if step not in steps:
                gone = next((s for s in scan if s.step == step and s.status == SUPERSEDED), None)
                if gone is not None:
                    raise CheckpointNotFoundError(
                        f"{self.url!r}: step {step} is not loadable: it was {gone.problem}. "
                        f"Committed steps: {', '.join(map(str, steps)) or 'none'}"
                    )
                raise self._catalog.not_found(step, steps)
            candidates = [(self._catalog, step, False)]
        else:
            candidates = [(self._catalog, s, False) for s in reversed(steps)]
            if self._resume is not None:
                rcat, rstep = self._resume
                rsteps = rcat.committed_steps()
                if rstep is not None and rstep not in rsteps:
                    if not steps:
                        raise rcat.not_found(rstep, rsteps)
                elif rstep is not None:
                    candidates.append((rcat, rstep, True))
                elif rsteps:
                    candidates += [(rcat, s, True) for s in reversed(rsteps)]
                elif not steps:
                    raise rcat.not_found(None, rsteps)
            elif not steps:
                return None
        for catalog, s, from_resume in candidates:
            if (from_resume, s) in tried:
                continue
            try:
                where, m, md = catalog.checked_at(s)
            except CheckpointCorruptError as e:
                if step is not None:
                    raise
                _log.warning("skipping step %d of %s: %s", s, catalog.storage.url, e)
                skipped.append(_Skip(from_resume, s, str(e)))
                continue
            newer = present if from_resume else [(n, g) for n, g in present if n > s]
            if step is None:
                for info in scan:
                    if info.status == CORRUPT and info.step in {n for n, _ in newer}:
                        _log.warning("skipping step %d: %s", info.step, info.problem)
            return _Decision(
                from_resume,
                s,
                m.world_size,
                m.files,
                md,
                newer,
                skipped,
                where,
                line=None if from_resume else m.line,
                optimizer=m.extra.get("optimizer"),
            )
        raise CheckpointCorruptError(
            f"{self.url}: no committed step loads cleanly; "
            + "; ".join(
                f"step {k.step}{' of resume_from' * k.from_resume}: {k.why}" for k in skipped
            )
        )

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Finish a pending save (its failure is raised here), give the write lease back and
        put back the signal handlers ``watch_preemption`` replaced; the manager cannot save or
        load afterwards (``steps()`` still works). Idempotent. Call it before
        ``torch.distributed.destroy_process_group()``: a pending save needs the process group.
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._staging.release()
            self._closed = True
            if self._preempt is not None:
                self._preempt.restore()
            if self._calls > 1:  # every rank is past that handshake (not surely past the last)
                # Housekeeping only: the store's host (rank 0's process) may be gone already.
                with contextlib.suppress(RuntimeError):
                    coll.forget(f"{self._tag}/{self._calls - 1}")
            if coll.rank() == 0:  # the next job may write at once
                with contextlib.suppress(CheckpointError):
                    self._catalog.lease.release()

    def _close_at_exit(self) -> None:
        """The interpreter is exiting (``_exit``): commit the pending save, or log at ERROR
        why it was not."""
        if self._closed:
            return
        job = self._pending
        if job is not None and not job.done():
            _log.info("waiting for the asynchronous save of step %d before exiting", job.step)
        try:
            self.close()
        except Exception as e:  # the errors of a save name the step
            _log.error("at exit: %s", e)

    def __enter__(self) -> CheckpointManager:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager({self.url!r}) is closed; create a new one")

    @staticmethod
    def _check_step(step: Any) -> int:
        try:
            value = operator.index(step) if not isinstance(step, bool) else None
        except TypeError:
            value = None
        if value is None or value < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if value > MAX_STEP:  # step directories have exactly 8 digits
            raise ValueError(f"step must be <= {MAX_STEP} (8 digits), got {step!r}")
        return value

    def __repr__(self) -> str:
        c = self.config
        return (
            f"CheckpointManager({c.url!r}, keep_last={c.keep_last}, interval={c.interval}, "
            f"async_save={c.async_save}, resume_from={c.resume_from!r})"
        )


@dataclasses.dataclass(frozen=True)
class _Skip:
    """A step that failed its checks (``why``) and was skipped by a load without a step."""

    from_resume: bool
    step: int
    why: str


@dataclasses.dataclass(frozen=True)
class _Decision:
    """Rank 0's choice for a load, sent to every rank."""

    from_resume: bool  # a step of resume_from, not of url
    step: int
    world_size: int  # ranks that saved it
    files: dict[str, FileEntry]
    metadata: Any
    newer: list[tuple[int, int | None]]  # steps of url a save after this load retires: (step, gen)
    skipped: list[_Skip]
    dirname: str  # the step's directory (Catalog.dirname)
    line: str | None = None  # the line the step belongs to (its manifest's)
    optimizer: str | None = None  # the type of the optimizer that saved it (its manifest's)


def _outcome(error: Exception | None) -> tuple[str, str] | None:
    """A rank's load outcome as all ranks see it: None, or (kind, message)."""
    if error is None:
        return None
    kind = "corrupt" if isinstance(error, CheckpointCorruptError) else "error"
    return kind, f"{type(error).__name__}: {error}"


def _differing_extra(step: int, digests: list[dict[str, str]]) -> CheckpointError | None:
    """The error for ``extra`` state that is not the same on every rank, or None."""
    names = sorted({n for d in digests for n in d})
    for name in names:
        groups: dict[str | None, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d.get(name), []).append(r)
        if len(groups) > 1:
            ranks = " vs ".join(str(g) for g in groups.values())
            return CheckpointError(
                f"saving step {step}: extra[{name!r}] differs between ranks {ranks}; extra is "
                "saved once for all ranks, so it must be the same everywhere: put per-rank "
                "state (a data position per rank, RNG state) in rank_extra. Nothing was written."
            )
    return None


def _type_name(obj: object | None) -> str | None:
    """``module.Class`` of ``obj``'s type (None for None): how manifests name the optimizer."""
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def _fmt(t: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}s" for k, v in t.items())
