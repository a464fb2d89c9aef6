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
import logging
import operator
import posixpath
import threading
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import muon_ckpt._collective as coll
from muon_ckpt._config import ManagerConfig
from muon_ckpt._errors import CheckpointError
from muon_ckpt._flatten import FlatState, check_extra, param_fqns, prepare_optimizer_state
from muon_ckpt._tensors import local_tensor
from muon_ckpt.io import (
    DCP_ERRORS,
    HostStaging,
    SafeLoadPlanner,
    SaveJob,
    VerifyingReader,
    WriteSpec,
    dcp_failure,
)
from muon_ckpt.store import (
    MAX_STEP,
    Catalog,
    FileEntry,
    Storage,
    open_storage,
    parse_step_dirname,
    step_dirname,
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
        model: its ``state_dict()`` is saved as ``model.<fqn>`` and loaded in place.
        optimizer: any ``torch.optim.Optimizer``; its state is keyed by parameter FQN.
        extra: ``{name: obj}`` with ``state_dict()``/``load_state_dict()`` (LR scheduler, data
            position...); treated as the same on every rank.
        keep_last: keep this many newest committed steps; older ones are deleted after a commit.
        interval: ``save(step)`` saves only when ``step % interval == 0`` (``force=True`` always).
        storage_options: fsspec options (credentials, ``endpoint_url``...).
        resume_from: a URL (run root or ``.../step-XXXXXXXX``) or ``(url, step)`` to load from
            while ``url`` has no committed step yet.
        io_threads: files written and read in parallel per rank.
        verify: ``"crc32"`` checks size and checksum of every file a load reads; ``"size"`` only
            sizes.
        async_save: ``save()`` returns once the state is snapshotted; the write and the commit
            run in the background (``wait()`` for them).
        max_staging_bytes: host memory a snapshot may hold; a save that needs more runs
            synchronously without staging copies (None: no bound).
        storage_timeout: seconds one storage request may take (S3: connect and read
            timeouts; None: the client's defaults). Default 60.
        lease_seconds: the run's write lease (one writer per run) expires this long after
            this job's last save. Default 600.
        confirm: before a commit, how each rank confirms the storage holds the files it
            wrote: ``"crc32"`` reads them back (default), ``"size"`` compares sizes, ``"off"``.

    Save, load, wait and close are collectives: call them on every rank.
    """

    def __init__(
        self,
        url: str,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        extra: dict[str, Any] | None = None,
        keep_last: int | None = None,
        interval: int | None = None,
        storage_options: dict[str, Any] | None = None,
        resume_from: str | tuple[str, int] | None = None,
        io_threads: int = 4,
        verify: str = "crc32",
        async_save: bool = False,
        max_staging_bytes: int | None = None,
        storage_timeout: float | None = 60.0,
        lease_seconds: float = 600.0,
        confirm: str = "crc32",
    ) -> None:
        self.config = ManagerConfig(
            url=url,
            keep_last=keep_last,
            interval=interval,
            storage_options=storage_options,
            resume_from=resume_from,
            io_threads=io_threads,
            verify=verify,
            async_save=async_save,
            max_staging_bytes=max_staging_bytes,
            storage_timeout=storage_timeout,
            lease_seconds=lease_seconds,
            confirm=confirm,
        )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
            )
        self._model = model
        self._optimizer = optimizer
        self._extra = check_extra(extra)
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
            self._resume = (Catalog(_open_storage("resume_from", rf_url, opts, timeout)), rf_step)
        self._pending: SaveJob | None = None
        self._group: Any = None  # gloo group of the background saves, made by the first one
        self._staging = HostStaging()  # host buffers allocated by the first save, then reused
        self._warned_budget = False
        self._closed = False
        # Tests only: a background write starts once this event is set, so a test can change
        # the state while a save is certainly still pending.
        self._write_gate: threading.Event | None = None
        # Seconds per phase of the last finished save on this rank (also logged at DEBUG):
        # prepare (rank 0 readies the step directory), snapshot, blocked (all save() took),
        # dcp_save, commit (the manifest), retention, total; within dcp_save: write_data (the writer threads' wall
        # time) and, summed over those threads, stage_wait (waiting for host copies), write
        # (in the storage's write calls), writeback (queueing local pages for write-out),
        # crc_wait (checksum still running after its write returned), sync (fsync and close).
        self.last_save_timings: dict[str, float] = {}
        # The same for the last load: decide, prepare, dcp_load, apply, total; and read (the
        # reader's wall time: reads, checksums, copies into place).
        self.last_load_timings: dict[str, float] = {}

    # ------------------------------------------------------------------ queries
    @property
    def url(self) -> str:
        return self.config.url

    def steps(self) -> list[int]:
        """Committed steps at ``url``, ascending (this rank's own listing; not a collective).
        A step being saved in the background is listed once it is committed."""
        self._check_open()
        return self._catalog.committed_steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save
    def save(self, step: int, *, force: bool = False, overwrite: bool = False) -> bool:
        """Save ``step`` if it is due (``interval``) or ``force``; return whether it saved.

        With ``async_save`` it returns once the state is snapshotted; the step is committed
        in the background (``wait()``). A pending save is waited for first, and its failure
        raised here. Raises CheckpointExistsError if ``step`` is committed already, unless
        ``overwrite``: the new version is written beside the committed step and replaces it
        once committed (if this save fails, the old version stays).
        """
        self._check_open()
        step = self._check_step(step)
        if not force and self.config.interval is not None and step % self.config.interval:
            return False
        self.wait()
        t0 = time.perf_counter()
        if self.config.async_save and self._group is None:
            self._group = coll.new_group()  # collective: every rank's first save makes it
        coll.on_rank0(lambda: self._catalog.begin(step, overwrite))
        t1 = time.perf_counter()
        error: Exception | None = None
        try:
            spec, background, release = self._snapshot(step)
        except Exception as e:  # every rank must learn of it before any starts to write
            error = e
        failed = [r for r, ok in enumerate(coll.all_gather(error is None)) if not ok]
        if failed:
            if error is not None:
                raise error
            self._staging.finish()
            if release is not None:
                release()
            raise CheckpointError(
                f"saving step {step}: taking the snapshot failed on rank(s) {failed} (their "
                "own error says why); nothing was written and every committed step is intact"
            )
        t2 = time.perf_counter()
        spec.overwrite = overwrite
        spec.timings.update(snapshot=t2 - t1, prepare=t1 - t0, blocked=t2 - t0)
        job = SaveJob(spec, finish=lambda: self._finished(spec, release))
        if background:
            job.start()
            self._pending = job
        else:
            job.run()
        return True

    def _snapshot(self, step: int) -> tuple[WriteSpec, bool, Any]:
        """The state of this moment, as DCP will write it: (spec, background?, release)."""
        opt, background = self._optimizer, self.config.async_save
        flat = FlatState.build(self._model, opt, self._extra)
        views = self._offloaded_views()
        keep = flat.host_state_keys(views)
        limit = self.config.max_staging_bytes
        if background and limit is not None:
            need = self._staging.bytes_needed(flat.sd, copy_cpu=True, keep=keep)
            need += sum(_nbytes(flat.sd[k]) for k in keep)  # the pool's second buffer
            need = max(coll.all_gather(need))  # every rank takes the same path
            if need > limit:
                if not self._warned_budget:
                    _log.warning(
                        "an asynchronous save of this state needs %d bytes of host memory, "
                        "more than max_staging_bytes=%d: saves run synchronously, without "
                        "staging copies",
                        need,
                        limit,
                    )
                    self._warned_budget = True
                background = False
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
            io_threads=self.config.io_threads,
            keep_last=self.config.keep_last,
            confirm=self.config.confirm,
            group=self._group if background else None,
            gate=self._write_gate if background else None,
        )
        return spec, background, release

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
    def load(self, step: int | None = None) -> int | None:
        """Load ``step`` (default: the newest committed one) in place; return the step loaded.

        On a fresh run (nothing committed, no ``resume_from``) returns None and changes nothing.
        A pending asynchronous save is committed first.
        """
        self._check_open()
        if step is not None:
            step = self._check_step(step)
        self.wait()
        t0 = time.perf_counter()
        decision = coll.on_rank0(lambda: self._decide(step))
        t1 = time.perf_counter()
        if decision is None:
            return None
        from_resume, chosen, files, metadata = decision
        catalog = self._resume[0] if from_resume and self._resume else self._catalog
        where = catalog.storage.url_of(step_dirname(chosen))
        fresh: set[int] = set()
        if self._optimizer is not None:
            fresh = prepare_optimizer_state(self._optimizer)
        flat = FlatState.build(self._model, self._optimizer, self._extra)
        flat.use_host_states(self._offloaded_views())
        flat.check_against(metadata, fresh, where)
        t2 = time.perf_counter()
        reader = VerifyingReader(
            catalog.storage.child(step_dirname(chosen)),
            files,
            metadata=metadata,
            rank=coll.rank(),
            world_size=coll.world_size(),
            io_threads=self.config.io_threads,
            verify_crc=self.config.verify == "crc32",
        )
        try:
            dcp.load(
                flat.sd,
                storage_reader=reader,
                planner=SafeLoadPlanner(),
                no_dist=not coll.is_dist(),
            )
        except DCP_ERRORS as e:
            raise dcp_failure(e, f"loading {where}") from e
        t3 = time.perf_counter()
        flat.apply_loaded(self._optimizer, self._extra, where)
        t4 = time.perf_counter()
        self.last_load_timings = {
            "decide": t1 - t0,
            "prepare": t2 - t1,
            "dcp_load": t3 - t2,
            "apply": t4 - t3,
            **reader.timings,
            "total": t4 - t0,
        }
        _log.info("loaded step %d from %s in %.3f s", chosen, where, t4 - t0)
        _log.debug("loaded step %d: %s", chosen, _fmt(self.last_load_timings))
        return chosen

    def _decide(self, step: int | None) -> tuple[bool, int, dict[str, FileEntry], Any] | None:
        catalog, from_resume = self._catalog, False
        steps = catalog.committed_steps()
        if step is not None:
            if step not in steps:
                raise catalog.not_found(step, steps)
        elif steps:
            step = steps[-1]
        elif self._resume is not None:
            catalog, step = self._resume
            from_resume = True
            rsteps = catalog.committed_steps()
            if step is None and not rsteps:
                raise catalog.not_found(None, rsteps)
            if step is None:
                step = rsteps[-1]
            elif step not in rsteps:
                raise catalog.not_found(step, rsteps)
        else:
            return None
        manifest, metadata = catalog.checked(step)
        return from_resume, step, manifest.files, metadata

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Finish a pending save (its failure is raised here); the manager cannot be used
        afterwards. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._staging.release()
            self._closed = True
            if coll.rank() == 0:  # the next job may write at once
                with contextlib.suppress(CheckpointError):
                    self._catalog.lease.release()

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
        if value is None or not 0 <= value <= MAX_STEP:
            raise ValueError(f"step must be an integer in [0, {MAX_STEP}], got {step!r}")
        return value

    def __repr__(self) -> str:
        c = self.config
        return (
            f"CheckpointManager({c.url!r}, keep_last={c.keep_last}, interval={c.interval}, "
            f"async_save={c.async_save}, resume_from={c.resume_from!r})"
        )


def _fmt(t: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}s" for k, v in t.items())
