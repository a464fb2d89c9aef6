"""One attempt at loading the decided step, all or nothing: prepare -> agree -> read -> agree.

prepare: the flat state to read into, fitted to the step's metadata (``state.FlatState``),
and its backup (``state.Rollback``: host copies of everything the load overwrites). agree:
every rank is ready before any starts DCP's collectives. read: the verifying reader
(``VerifyingReader``) writes into the live tensors in place, then what DCP does not write in
place is applied. agree: every rank has read and applied before any keeps what it read. A
failure anywhere, on any rank, is a ``LoadOutcome`` with failures, which the caller undoes
(``undo``); an interrupt or a failed agreement undoes this rank's part before it propagates.
Once the ranks agreed to keep it, the load is kept: undoing it on one rank would leave the
ranks apart. Ctrl-C from just before that agreement on is deferred to the end of the load's
tail (``LoadTargets.tail``: the caller's records of it), where it is raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

import muon_ckpt._collective as coll
import muon_ckpt._dcp as _dcp
from muon_ckpt._config import ManagerConfig, checks_content
from muon_ckpt._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    handled,
    interrupt_in,
    raise_interrupt,
)
from muon_ckpt._interrupts import interrupts_deferred
from muon_ckpt.load._decide import Decision
from muon_ckpt.load._planner import SafeLoadPlanner
from muon_ckpt.load._read_once import failure_kind
from muon_ckpt.load._reader import VerifyingReader
from muon_ckpt.state import (
    FlatState,
    HostStaging,
    LoadReport,
    Rollback,
    RuleCheck,
    apply_loaded,
    fit,
    module_extra_states,
    offloaded_views,
    prepare_optimizer_state,
)
from muon_ckpt.store import Storage
from muon_ckpt.store.dcp import check_held_chunks

__all__ = ["LoadOutcome", "LoadTargets", "RankFailure", "attempt", "release_backup", "undo"]

_log = logging.getLogger("muon_ckpt")


@dataclasses.dataclass
class LoadTargets:
    """What a load writes into, and where its backup goes; with the process group and
    what it needs of the manager's options."""

    model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    extra: dict[str, Any]
    rank_extra: dict[str, Any]
    staging: HostStaging
    config: ManagerConfig
    group: Any
    hosts: int  # hosts the ranks run on (read_once's default)
    warned: set[str]  # warnings given once per manager
    # Inside ``tail()``: where a deferral begun at the last agreement ends
    _tail: contextlib.ExitStack | None = dataclasses.field(default=None, init=False, repr=False)

    @contextlib.contextmanager
    def tail(self) -> Iterator[None]:
        """A load and the caller's records of it: Ctrl-C after the ranks agreed to keep the
        load is raised when this block ends, not inside it."""
        with contextlib.ExitStack() as self._tail:
            try:
                yield
            finally:
                self._tail = None

    def reads_once(self, storage: Storage) -> bool:
        """Whether a load from ``storage`` reads shared items once (``read_once``)."""
        if self.config.read_once is not None:
            return self.config.read_once
        return not storage.is_local or self.hosts > 1


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """A rank's failure as every rank sees it."""

    corrupt: bool  # the step's data is damaged (a reason to fall back to an older step)
    message: str
    mismatch: bool = False  # the step does not fit this job (never a reason to load another)
    kind: type[CheckpointError] = CheckpointError  # what the other ranks raise (failure_kind)

    @classmethod
    def of(cls, error: Exception | None, since: BaseException | None) -> RankFailure | None:
        """``error`` as the other ranks see it; one an interrupt caused is not corrupt data
        (``since``: what was being handled when the load began, see ``interrupt_in``)."""
        if error is None:
            return None
        corrupt = isinstance(error, CheckpointCorruptError) and interrupt_in(error, since) is None
        mismatch = isinstance(error, CheckpointMismatchError)
        return cls(corrupt, f"{type(error).__name__}: {error}", mismatch, failure_kind(error))


@dataclasses.dataclass
class LoadOutcome:
    """One attempt: every rank's failure (rank -> RankFailure; empty when it loaded), this
    rank's own error, the report of what was left out, the backup that undoes it, and the
    timings and bytes of this rank."""

    failures: dict[int, RankFailure]
    error: Exception | None = None
    report: LoadReport | None = None
    rollback: Rollback | None = None
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_read: int = 0
    rules: RuleCheck | None = None  # the update rules compared (None: no optimizer loaded)

    @property
    def corrupt(self) -> bool:
        """Every failure was damaged data (the caller may fall back to an older step)."""
        return bool(self.failures) and all(f.corrupt for f in self.failures.values())

    @property
    def mismatch(self) -> bool:
        """Some rank found the step not fitting this job (keys, shapes, update rules): a strict
        load raises it, as another tier's copy of the step would fit no better."""
        return any(f.mismatch for f in self.failures.values())


def attempt(
    t: LoadTargets,
    storage: Storage,
    d: Decision,
    where: str,
    strict: bool,
    parts: tuple[str, ...],
    *,
    alone: bool = False,
) -> LoadOutcome:
    """One try at loading ``d.step`` (``d.dirname`` of ``storage``) on every rank (two
    agreement points, see the module). ``alone``: each rank reads a checkpoint of its own
    (a memory-tier part), without DCP's collectives; the agreements are the same."""
    out = LoadOutcome({})
    flat: FlatState | None = None
    since = handled()
    try:
        try:
            model = t.model if "model" in parts else None
            kept = module_extra_states(model)  # what the load may change, to restore
            kept |= t.extra if "extra" in parts else {}
            kept |= t.rank_extra if "rank_extra" in parts else {}
            out.rollback = Rollback(t.optimizer, kept, t.staging)
            prepared = _prepare(t, d, where, strict, parts, out.rollback)
            flat, out.report, out.timings, out.rules = prepared
        except Exception as e:
            out.error = e
        out.failures = _agree(RankFailure.of(out.error, since), t.group)
        raise_interrupt(out.error, since)  # (never a step to fall back past)
        if not out.failures:
            if flat is None or out.report is None or out.rollback is None:
                raise AssertionError("an agreed load without its state, report or backup")
            try:
                _read(t, storage, d, where, flat, out, strict, parts, out.rollback, alone)
            except Exception as e:
                out.error = e
            out.failures = _keep_agreed(t, RankFailure.of(out.error, since))
            raise_interrupt(out.error, since)  # (never a step to fall back past)
    except BaseException:
        undo(t, out.rollback)
        raise
    return out


def undo(t: LoadTargets, rollback: Rollback | None, *, again: bool = False) -> None:
    """Put back what a failed load changed on this rank; free the host backup, unless
    another attempt follows (``again``: it copies into the same buffers)."""
    try:
        if rollback is not None:
            rollback.restore()
    finally:
        if not again:
            t.staging.release("cpu")


def release_backup(t: LoadTargets) -> None:
    """After a load that succeeded (its rollback done): the buffer of host tensors' copies is
    kept where the manager's next save copies the same tensors into it (asynchronous and
    memory-tier saves stage every host tensor there and keep the buffer between saves, so
    holding it now costs no memory those saves do not hold), else freed (a synchronous save
    copies no host tensor). The buffer of device tensors' copies is always kept: every save
    stages into it."""
    c = t.config
    if not ((c.async_save or c.memory is not None) and c.max_staging_bytes is None):
        t.staging.release("cpu")


def _agree(failure: RankFailure | None, group: Any) -> dict[int, RankFailure]:
    """Every rank's failure so far (this rank's: ``failure``), on every rank."""
    outcome = coll.all_gather(failure, group)
    return {r: o for r, o in enumerate(outcome) if o is not None}


def _keep_agreed(t: LoadTargets, failure: RankFailure | None) -> dict[int, RankFailure]:
    """The last agreement: kept by every rank (no failures), Ctrl-C from just before it is
    deferred to the end of ``t.tail()``; else raised at once (every rank undoes)."""
    if t._tail is None:
        return _agree(failure, t.group)
    with contextlib.ExitStack() as deferred:
        deferred.enter_context(interrupts_deferred())
        failures = _agree(failure, t.group)
        if not failures:
            t._tail.enter_context(deferred.pop_all())
    return failures


def _prepare(
    t: LoadTargets,
    d: Decision,
    where: str,
    strict: bool,
    parts: tuple[str, ...],
    rollback: Rollback,
) -> tuple[FlatState, LoadReport, dict[str, float], RuleCheck | None]:
    """The flat state to read ``d.step`` into, fitted to its metadata, its backup taken
    (``rollback``), the seconds that took, and the comparison of update rules (a strict
    load that would change one raises here)."""
    t0 = time.perf_counter()
    if "rank_extra" in parts and t.rank_extra and d.world_size != coll.world_size():
        raise CheckpointMismatchError(
            f"{where} was saved on {d.world_size} rank(s), this run has {coll.world_size()}: "
            "rank_extra holds each rank's own state and loads back only at the same world "
            "size; load(elastic=True) loads the rest and leaves rank_extra as it is"
        )
    opt = t.optimizer if "optim" in parts else None
    rules = RuleCheck.before(t.model, opt, d.update_rules, where, strict, d.optimizer)
    fresh = prepare_optimizer_state(opt) if opt is not None else set()
    flat = FlatState.build(
        t.model, opt, t.extra, rank_extra=t.rank_extra, rank=coll.rank(), parts=parts
    )
    pooled = flat.use_host_states(offloaded_views(opt))
    report = fit(flat, d.metadata, fresh, where, strict=strict)
    report.step = d.step
    t1 = time.perf_counter()
    created = {k for k, (p, _) in flat.state_slots.items() if id(p) in fresh}
    created |= set(flat.leaf_of)  # (statefuls are undone through load_state_dict: Rollback)
    limit = t.config.max_staging_bytes
    kept = rollback.keep_values(flat.sd, skip=created, limit=limit, pooled=pooled)
    if not kept and "load backup" not in t.warned:
        _log.warning(
            "the backup that makes a load all-or-nothing needs more host memory than "
            "max_staging_bytes=%s: loads run without it (a failed load may leave the model "
            "and optimizer partly loaded)",
            limit,
        )
        t.warned.add("load backup")
    return flat, report, {"prepare": t1 - t0, "backup": time.perf_counter() - t1}, rules


def _read(
    t: LoadTargets,
    storage: Storage,
    d: Decision,
    where: str,
    flat: FlatState,
    out: LoadOutcome,
    strict: bool,
    parts: tuple[str, ...],
    rollback: Rollback,
    alone: bool,
) -> None:
    """Read ``d.step`` into the live state and apply what DCP does not write in place; the
    backup keeps each tensor before the first write into it (``Rollback.keep``)."""
    t0 = time.perf_counter()
    reader = VerifyingReader(
        storage.child(d.dirname),
        d.files,
        metadata=d.metadata,
        rank=0 if alone else coll.rank(),
        world_size=1 if alone else coll.world_size(),
        io_threads=t.config.read_threads(storage.is_local),
        verify_crc=checks_content(t.config.verify),
        group=t.group if t.reads_once(storage) and not alone else None,
    )
    # (with the reader, this rank's plan crosses DCP's round trip through rank 0 as a key)
    planner = SafeLoadPlanner(before_write=rollback.keep, reader=None if alone else reader)
    if alone:
        check_held_chunks(flat.sd, d.metadata, where)
    try:
        _dcp.load(flat.sd, reader, planner, t.group, f"loading {where}", alone=alone or None)
    finally:
        planner.forget()  # (a load that failed before its plan came back: nothing stays kept)
    out.timings.update(dcp_load=time.perf_counter() - t0, **reader.timings)
    out.bytes_read = reader.bytes_read
    report = out.report if out.report is not None else LoadReport()
    apply_loaded(flat, t.optimizer if "optim" in parts else None, where, report, strict=strict)
    if out.rules is not None:  # (after the hyperparameters: a rule they change is checked)
        out.rules.after(flat)
        report.rules = out.rules.changed
