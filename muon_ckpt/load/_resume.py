"""A load, the life of it: decide -> attempt (read, agree) -> apply, falling back past damage.

Rank 0 decides (``_decide``) and every rank gets the decision; every rank attempts it
(``_attempt``). An attempt that failed only because the step's data read as damaged (on any
rank) is undone and tried once more (a read fault of the storage or the network is no proof
of damage); if it fails again, without a step asked for, the next older step is tried, with a
WARNING naming the one passed over; any other failure is raised on every rank, the state as
it was.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import muon_ckpt._collective as coll
from muon_ckpt._errors import CheckpointMismatchError
from muon_ckpt._gcpause import paused_gc
from muon_ckpt.load._attempt import LoadOutcome, LoadTargets, attempt, release_backup, undo
from muon_ckpt.load._decide import Decision, History, Skip, decide
from muon_ckpt.state import LoadReport, optimizer_name
from muon_ckpt.store import Catalog, Storage, check_stored

__all__ = ["Loaded", "loaded", "refusal", "resume"]

_log = logging.getLogger("muon_ckpt")


@dataclasses.dataclass
class Loaded:
    """What a load loaded: the decision (step, the newer steps a save then retires, ...), where
    it was read from, what was left out, and this rank's seconds per phase and bytes read."""

    decision: Decision
    where: str
    report: LoadReport
    timings: dict[str, float]
    bytes_read: int
    tier: str  # where this rank's state came from: "storage", "memory" or "peer"


def resume(
    t: LoadTargets,
    catalog: Catalog,
    resume_from: tuple[Catalog, int | None] | None,
    step: int | None,
    *,
    strict: bool,
    parts: tuple[str, ...],
    elastic: bool,
    history: History | None = None,
) -> Loaded | None:
    """Load ``step`` (None: the newest that loads cleanly) into ``t``; None on a fresh run.
    ``history``: the url's steps and the memory tier's commits, which retire steps of the
    url as its own do (None: rank 0 scans the url, once for the whole load)."""
    skipped: list[Skip] = []
    retried: set[tuple[bool, int]] = set()  # the steps read once more after a damaged read
    scanned = [] if history is None else [history]

    def how() -> Decision | None:  # (rank 0)
        if not scanned:
            scanned.append(History.of(catalog.scan()))
        return decide(catalog, resume_from, step, skipped, scanned[0])

    while True:
        t0 = time.perf_counter()
        try:
            with paused_gc():  # (the decision's metadata: see store.parse_metadata)
                d = coll.on_rank0(how, t.group)
        except BaseException:
            release_backup(t)  # (the buffers an attempt before this one kept for the next)
            raise
        if d is None:
            release_backup(t)
            return None
        decided = time.perf_counter() - t0
        chosen = _elastic(t, d, parts) if elastic else parts
        source = resume_from[0] if d.from_resume and resume_from else catalog
        where = source.storage.url_of(d.dirname)
        out = attempt(t, source.storage, d, where, strict, chosen)
        if not out.failures:
            break
        why = out.failures[min(out.failures)].message
        recheck = out.corrupt and (d.from_resume, d.step) not in retried
        again = recheck or (step is None and out.corrupt)  # this step once more, or the next
        undo(t, out.rollback, again=again)
        if recheck:  # a read fault is no proof of damage: the storage's copy decides
            retried.add((d.from_resume, d.step))
            if not _damaged(t, source.storage, d, where):
                skipped = list(d.skipped)
                continue
            if step is not None:
                undo(t, None)  # (lets the backup's buffers go)
                again = False
        if not again:
            raise refusal(t, out, d, where, chosen)
        if coll.rank() == 0:
            _log.warning(
                "skipping step %d (%s): %s; trying the next older step", d.step, where, why
            )
        skipped = [*d.skipped, Skip(d.from_resume, d.step, why, d.gen)]
    return loaded(t, out, d, where, "storage", t0, decided)


def _damaged(t: LoadTargets, storage: Storage, d: Decision, where: str) -> bool:
    """Whether the storage holds ``d``'s step damaged: every rank reads its share of the
    step's files once more (a file that fails, twice: a fault of one read is no proof),
    and the ranks agree (a collective). A WARNING says what was found."""
    rank, world = coll.rank(), coll.world_size()
    mine = {n: d.files[n] for n in sorted(d.files)[rank::world]}
    threads = t.config.read_threads(storage.is_local)
    try:
        bad = check_stored(storage, d.dirname, mine, "checksum", threads)
        bad = check_stored(storage, d.dirname, {n: mine[n] for n in bad}, "checksum", threads)
    except Exception as e:  # (the storage failed: nothing is known of the files)
        bad = {"?": f"{type(e).__name__}: {e}"}
    found = {n: p for part in coll.all_gather(bad, t.group) for n, p in part.items()}
    if rank == 0:
        if found:
            name, what = sorted(found.items())[0]
            _log.warning("step %d (%s) is damaged: %s holds %s", d.step, where, name, what)
        else:
            _log.warning(
                "step %d (%s) read as damaged, but read again every file of it is as it was "
                "written (a read fault): loading it once more",
                d.step,
                where,
            )
    return bool(found)


def loaded(
    t: LoadTargets,
    out: LoadOutcome,
    d: Decision,
    where: str,
    tier: str,
    t0: float,
    decided: float,
) -> Loaded:
    """The end of a load that succeeded on every rank, from either tier: the backup let go,
    this rank's phases and what it left out said."""
    try:
        if out.rollback is not None:
            out.rollback.done()
    finally:
        # Also on an interrupt: release waits for the backup's copies into them.
        release_backup(t)
    if out.report is None:  # (set whenever no rank failed)
        raise AssertionError("a load that succeeded without a report")
    timings = {"decide": decided, **out.timings}
    timings["total"] = time.perf_counter() - t0
    # apply: also the ranks' agreements and the bookkeeping, so the phases add up to total
    timings["apply"] = timings["total"] - sum(
        timings.get(k, 0.0) for k in ("decide", "prepare", "backup", "dcp_load")
    )
    via = "" if tier == "storage" else f" (the memory tier: {tier})"
    _log.info("loaded step %d from %s%s in %.3f s", d.step, where, via, timings["total"])
    _log.debug("loaded step %d: %s", d.step, ", ".join(f"{k} {v:.3f}s" for k, v in timings.items()))
    if out.report:
        _log.warning("loaded step %d from %s partially: %s", d.step, where, out.report.summary())
    return Loaded(d, where, out.report, timings, out.bytes_read, tier)


def _elastic(t: LoadTargets, d: Decision, parts: tuple[str, ...]) -> tuple[str, ...]:
    """``parts`` without ``rank_extra`` when the step was saved at another world size."""
    if "rank_extra" not in parts or d.world_size == coll.world_size():
        return parts
    if t.rank_extra and coll.rank() == 0:
        _log.warning(
            "step %d was saved on %d rank(s), this run has %d: loading everything but "
            "rank_extra %s, which keeps its current values (elastic=True)",
            d.step,
            d.world_size,
            coll.world_size(),
            sorted(t.rank_extra),
        )
    return tuple(p for p in parts if p != "rank_extra")


def refusal(
    t: LoadTargets, out: LoadOutcome, d: Decision, where: str, parts: tuple[str, ...]
) -> Exception:
    """The error a failed attempt raises on this rank: its own (explained), or one naming
    the ranks that failed."""
    if out.error is None:
        return out.failures[min(out.failures)].kind(
            f"loading {where} failed on rank(s) {sorted(out.failures)} "
            f"({out.failures[min(out.failures)].message}); this rank's model, optimizer and "
            "extra state are as they were"
        )
    ours = optimizer_name(t.optimizer)
    error, saved = out.error, d.optimizer
    if not isinstance(error, CheckpointMismatchError) or "optim" not in parts:
        return error
    if ours is None or saved is None or saved == ours:
        return error
    return CheckpointMismatchError(
        f"{error}. The checkpoint's optimizer state was saved by {saved}, this optimizer is "
        f"{ours}: optimizer types differ, and so do their states and param groups. To carry "
        "the state over, load(parts=('model', 'extra', 'rank_extra')) and convert it with "
        "import_optimizer_state(optimizer, url) (AdamW moments, Muon momentum)"
    )
