"""CheckpointManager: save and resume model, optimizer and extra state on any number of ranks.

One save is three stages, kept apart so that an asynchronous save can later run the last two
in the background without changing the API:

1. snapshot (caller's thread, offload paused): the flat FQN-keyed state dict (``_flatten``),
   its device tensors copied into reusable host buffers on a side stream (``_staging``);
2. write (``_writer``): ``dcp.save`` through a writer that checksums every file it writes, each
   writer thread waiting only for the copy of the tensor it writes next;
3. commit (``_commit``, rank 0): manifest.json with every file's size and crc32, written last,
   then retention. ``_pending`` is the slot an asynchronous save would occupy; every public
   method waits for it first.
"""

from __future__ import annotations

import logging
import posixpath
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from muon_ckpt import _collective as coll
from muon_ckpt import _commit
from muon_ckpt._config import ManagerConfig
from muon_ckpt._dcp import SafeLoadPlanner
from muon_ckpt._errors import CheckpointError, CheckpointExistsError, CheckpointMismatchError
from muon_ckpt._flatten import FlatState, check_extra, param_fqns, prepare_optimizer_state
from muon_ckpt._layout import FileEntry, parse_step_dirname, step_dirname
from muon_ckpt._staging import HostStaging, StagedSavePlanner
from muon_ckpt._storage import Storage
from muon_ckpt._writer import ChecksumWriter, FileRecords, VerifyingReader

__all__ = ["CheckpointManager"]

_log = logging.getLogger("muon_ckpt")


def _open_storage(field: str, url: str, options: dict[str, Any]) -> Storage:
    try:
        storage = Storage(url, options)
        storage.check_root()
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from e
    except CheckpointError as e:
        raise ValueError(f"{field} must be a directory or bucket prefix, got {url!r}: {e}") from e
    return storage


class _PhaseClock:
    def __init__(self) -> None:
        self._t0 = self._last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self._last
        self._last = now

    def total(self) -> float:
        return self._last - self._t0


def _fmt_timings(t: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}s" for k, v in t.items())


def _reraise(e: BaseException, what: str) -> None:
    """Turn DCP's CheckpointException (failures per rank) back into our error classes."""
    failures = getattr(e, "failures", None) or {}
    excs = [v[0] if isinstance(v, tuple) else v for _, v in sorted(failures.items())]
    for exc in excs:
        if isinstance(exc, CheckpointError):
            raise type(exc)(str(exc)) from e
    text = str(excs[0]) if excs else str(e)
    if "Missing key" in text or "Size mismatch" in text:
        raise CheckpointMismatchError(
            f"{what}: {text}. The model/optimizer/extra do not match the checkpoint"
        ) from e
    raise CheckpointError(f"{what} failed: {type(excs[0] if excs else e).__name__}: {text}") from e


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

    Save and load are collectives: call them on every rank.
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
    ) -> None:
        self.config = ManagerConfig(
            url=url,
            keep_last=keep_last,
            interval=interval,
            storage_options=storage_options,
            resume_from=resume_from,
            io_threads=io_threads,
            verify=verify,
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
        self._storage = _open_storage("url", self.config.url, opts)
        self._resume: tuple[Storage, int | None] | None = None
        rf = self.config.resume_from
        if rf is not None:
            rf_url, rf_step = (rf, None) if isinstance(rf, str) else rf
            base = posixpath.basename(rf_url.rstrip("/"))
            if rf_step is None and parse_step_dirname(base) is not None:
                rf_step = parse_step_dirname(base)
                rf_url = rf_url.rstrip("/")[: -len(base)].rstrip("/") or "/"
            self._resume = (_open_storage("resume_from", rf_url, opts), rf_step)
        self._pending: Callable[[], None] | None = None
        self._staging = HostStaging()  # host buffers allocated by the first save, then reused
        self._closed = False
        # Seconds per phase of the last save on this rank (diagnostics; also logged at DEBUG
        # on the "muon_ckpt" logger): snapshot, prepare, dcp_save, commit, total, and within
        # dcp_save: write_data (the writer threads' wall time) and, summed over those threads,
        # stage_wait (waiting for host copies), write (in the storage's write calls),
        # writeback (queueing local pages for write-out), crc_wait (checksum still running
        # after its write returned), sync (fsync and close).
        self.last_save_timings: dict[str, float] = {}
        # The same for the last load: decide, prepare, dcp_load, apply, total; also read
        # (the reader's wall time: reads, checksums, copies into place) for local files and
        # for remote ones with verify="size".
        self.last_load_timings: dict[str, float] = {}

    # ------------------------------------------------------------------ queries
    @property
    def url(self) -> str:
        return self.config.url

    def steps(self) -> list[int]:
        """Committed steps at ``url``, ascending (this rank's own listing; not a collective)."""
        self._check_open()
        return _commit.committed_steps(self._storage)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save
    def save(self, step: int, *, force: bool = False, overwrite: bool = False) -> bool:
        """Save ``step`` if it is due (``interval``) or ``force``; return whether it saved.

        Raises CheckpointExistsError if ``step`` is committed already, unless ``overwrite``.
        With ``overwrite=True`` the committed step is removed before the new one is written:
        if this save then fails, that step is gone (every other step is untouched).
        """
        self._check_open()
        self._check_step(step)
        if not force and self.config.interval is not None and step % self.config.interval:
            return False
        self._wait_pending()
        self.last_save_timings = {}
        clock = _PhaseClock()
        with self._offload_paused():
            flat = FlatState.build(self._model, self._optimizer, self._extra)
            staged = self._staging.stage(flat.sd)  # copies run while rank 0 prepares the dir
            clock.mark("snapshot")
            try:
                coll.on_rank0(lambda: self._begin_save(step, overwrite))
                clock.mark("prepare")
                records = FileRecords()
                writer = ChecksumWriter(
                    self._storage, step_dirname(step), records, self.config.io_threads
                )
                try:
                    dcp.save(
                        staged,
                        storage_writer=writer,
                        planner=StagedSavePlanner(self._staging),
                        no_dist=not coll.is_dist(),
                    )
                except BaseException as e:
                    if isinstance(e, (KeyboardInterrupt, SystemExit)):
                        raise
                    _reraise(e, f"saving step {step} to {self.url!r}")
            finally:
                self._staging.finish()
        clock.mark("dcp_save")
        self._pending = self._commit_job(step, records, len(flat.sd))
        self._wait_pending()  # synchronous today: commit before returning
        clock.mark("commit")
        self.last_save_timings = {
            **clock.phases,
            "write_data": writer.write_seconds,
            "stage_wait": self._staging.wait_seconds,
            **records.thread_seconds(),
            "total": clock.total(),
        }
        _log.debug("saved step %d: %s", step, _fmt_timings(self.last_save_timings))
        return True

    def _begin_save(self, step: int, overwrite: bool) -> None:
        committed = _commit.committed_steps(self._storage)
        if step in committed:
            if not overwrite:
                raise CheckpointExistsError(
                    f"{self._storage.url_of(step_dirname(step))}: step {step} is already "
                    "committed; pass overwrite=True to replace it, or save another step"
                )
            _commit.delete_step(self._storage, step)
        _commit.remove_leftovers(self._storage)

    def _commit_job(self, step: int, records: FileRecords, nkeys: int) -> Callable[[], None]:
        gathered = coll.gather_to_rank0(records.files)

        def commit() -> None:
            files: dict[str, FileEntry] = {}
            for part in gathered or []:
                files.update(part)
            extra = {"io_threads": self.config.io_threads, "keys": nkeys}
            _commit.write_manifest(self._storage, step, coll.world_size(), files, extra)
            if self.config.keep_last is not None:
                _commit.apply_retention(self._storage, self.config.keep_last, step)

        return lambda: coll.on_rank0(commit)

    # ------------------------------------------------------------------ load
    def load(self, step: int | None = None) -> int | None:
        """Load ``step`` (default: the newest committed one) in place; return the step loaded.

        On a fresh run (nothing committed, no ``resume_from``) returns None and changes nothing.
        """
        self._check_open()
        if step is not None:
            self._check_step(step)
        self._wait_pending()
        self.last_load_timings = {}
        clock = _PhaseClock()
        decision = coll.on_rank0(lambda: self._decide(step))
        clock.mark("decide")
        if decision is None:
            return None
        from_resume, chosen, files, metadata = decision
        storage = self._resume[0] if from_resume and self._resume else self._storage
        where = storage.url_of(step_dirname(chosen))
        with self._offload_paused():
            fresh: set[int] = set()
            if self._optimizer is not None:
                fresh = prepare_optimizer_state(self._optimizer)
            flat = FlatState.build(self._model, self._optimizer, self._extra)
            flat.check_against(metadata, fresh, where)
            clock.mark("prepare")
            reader = VerifyingReader(
                storage,
                step_dirname(chosen),
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
            except BaseException as e:
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                _reraise(e, f"loading {where}")
            clock.mark("dcp_load")
            flat.apply_loaded(self._optimizer, self._extra, where)
        clock.mark("apply")  # with offload on, this includes parking the states again
        self.last_load_timings = {**clock.phases, **reader.timings, "total": clock.total()}
        _log.debug("loaded step %d: %s", chosen, _fmt_timings(self.last_load_timings))
        return chosen

    def _decide(self, step: int | None) -> tuple[bool, int, dict[str, FileEntry], Any] | None:
        storage, from_resume = self._storage, False
        steps = _commit.committed_steps(storage)
        if step is not None:
            if step not in steps:
                raise _commit.not_found(storage, step, steps)
        elif steps:
            step = steps[-1]
        elif self._resume is not None:
            storage, step = self._resume
            from_resume = True
            rsteps = _commit.committed_steps(storage)
            if step is None and not rsteps:
                raise _commit.not_found(storage, None, rsteps)
            if step is None:
                step = rsteps[-1]
            elif step not in rsteps:
                raise _commit.not_found(storage, step, rsteps)
        else:
            return None
        manifest, metadata = _commit.read_checked_manifest(storage, step)
        return from_resume, step, manifest.files, metadata

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Finish any pending work; the manager cannot be used afterwards. Idempotent."""
        if self._closed:
            return
        try:
            self._wait_pending()
        finally:
            self._staging.release()
            self._closed = True

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
    def _check_step(step: Any) -> None:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")

    def _wait_pending(self) -> None:
        job, self._pending = self._pending, None
        if job is not None:
            job()

    @contextmanager
    def _offload_paused(self) -> Iterator[None]:
        """States on their devices for the duration; an offloading optimizer is restored (and
        its freshly loaded states offloaded again) afterwards, also on error."""
        opt = self._optimizer
        was_on = opt is not None and getattr(opt, "cpu_offload", False) is True
        if was_on:
            opt.turn_off_cpu_offload()
        try:
            yield
        finally:
            if was_on:
                opt.turn_on_cpu_offload()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"CheckpointManager({c.url!r}, keep_last={c.keep_last}, interval={c.interval}, "
            f"resume_from={c.resume_from!r})"
        )
