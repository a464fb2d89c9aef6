"""Decide: which step a load reads (rank 0, from the catalog; every rank gets the decision).

Without a step asked for, the candidates are the committed steps of the url, newest first,
then ``resume_from``'s (its one step, or its steps newest first); the first whose manifest,
file sizes and metadata check out is chosen, and a step that fails those checks twice (a
read fault is read once more) is skipped with a WARNING (``Skip``), as is a newer step whose
manifest read as damaged twice (``Skip.unread``: tried again should it read; the next save
keeps it, ``store._lines``). With a step asked for, that step only. A step of a newer format
is never skipped: a CheckpointVersionError says to upgrade, before anything is read.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from muon_ckpt._errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from muon_ckpt.store import Catalog, FileEntry, Status, StepInfo, mark_tier

__all__ = ["Decision", "Skip", "decide"]

_log = logging.getLogger("muon_ckpt")


@dataclasses.dataclass(frozen=True)
class Skip:
    """A step that failed its checks (``why``) and was skipped by a load without a step."""

    from_resume: bool
    step: int
    why: str
    gen: int | None = None  # its commit's generation, where known
    unread: bool = False  # a newer step whose manifest could not be read (CORRUPT): not tried


@dataclasses.dataclass(frozen=True)
class Decision:
    """Rank 0's choice for a load, sent to every rank."""

    from_resume: bool  # a step of resume_from, not of url
    step: int
    world_size: int  # ranks that saved it
    files: dict[str, FileEntry]
    metadata: Any
    newer: list[tuple[int, int | None]]  # steps of url a save after this load retires: (step, gen)
    skipped: list[Skip]
    dirname: str  # the step's directory (Catalog.dirname)
    line: str | None = None  # the line the step belongs to (its manifest's)
    optimizer: str | None = None  # the type of the optimizer that saved it (its manifest's)
    gen: int | None = None  # its commit's generation, for a step of url (None: another source)
    data_gens: dict[str, int] = dataclasses.field(default_factory=dict)  # its manifest's


def decide(
    catalog: Catalog,
    resume: tuple[Catalog, int | None] | None,
    step: int | None,
    skipped: list[Skip],
    tier: list[StepInfo] | None = None,
) -> Decision | None:
    """Rank 0: what to load from ``catalog`` (else ``resume``), or None on a fresh run;
    ``skipped``: the steps that failed so far (not tried again); ``tier``: the memory
    tier's commits (``store.mark_tier``), which retire url steps and count as newer."""
    scan = catalog.scan()
    tier = list(tier or ())
    retired = mark_tier(scan, tier)
    _refuse_newer_format(catalog, scan, step)
    committed = [s.step for s in scan if s.committed]
    if step is not None:
        candidates = [(catalog, _asked_for(catalog, scan, step, committed), False)]
    else:
        candidates = [(catalog, s, False) for s in reversed(committed)]
        more = _resume_candidates(resume, bool(committed))
        if more is None:
            return None
        candidates += more
    d = _first_that_checks_out(catalog, scan, tier, candidates, step, list(skipped))
    more = [r for r in retired if r not in d.newer]
    return dataclasses.replace(d, newer=[*d.newer, *more]) if more else d


def _refuse_newer_format(catalog: Catalog, scan: list[StepInfo], step: int | None) -> None:
    """A step of a newer format is never read, nor loaded past."""
    newer = [s for s in scan if s.status == Status.NEWER]
    if newer and (step is None or step in [s.step for s in newer]):
        raise CheckpointVersionError(
            f"{catalog.storage.url}: step(s) {[s.step for s in newer]} were written by a newer "
            "muon-ckpt; this version neither reads them nor resumes an older step past them. "
            f"Upgrade muon-ckpt. ({newer[-1].problem})"
        )


def _asked_for(catalog: Catalog, scan: list[StepInfo], step: int, committed: list[int]) -> int:
    if step in committed:
        return step
    gone = next((s for s in scan if s.step == step and s.status == Status.SUPERSEDED), None)
    if gone is not None:
        raise CheckpointNotFoundError(
            f"{catalog.storage.url!r}: step {step} is not loadable: it was {gone.problem}. "
            f"Committed steps: {', '.join(map(str, committed)) or 'none'}"
        )
    raise catalog.not_found(step, committed)


def _resume_candidates(
    resume: tuple[Catalog, int | None] | None, have_steps: bool
) -> list[tuple[Catalog, int, bool]] | None:
    """``resume_from``'s candidates after the url's own; None on a fresh run (nothing
    anywhere, no ``resume_from``). A ``resume_from`` that names nothing committed is an error
    while the url has no step of its own (a typo must not start a run from scratch)."""
    if resume is None:
        return [] if have_steps else None
    rcat, rstep = resume
    rsteps = rcat.committed_steps()
    if rstep is not None:
        if rstep in rsteps:
            return [(rcat, rstep, True)]
        if have_steps:
            return []
        raise rcat.not_found(rstep, rsteps)
    if not rsteps and not have_steps:
        raise rcat.not_found(None, rsteps)
    return [(rcat, s, True) for s in reversed(rsteps)]


def _first_that_checks_out(
    catalog: Catalog,
    scan: list[StepInfo],
    tier: list[StepInfo],
    candidates: list[tuple[Catalog, int, bool]],
    step: int | None,
    skipped: list[Skip],
) -> Decision:
    # What a save after this load retires: newer committed steps (with their commit's gen) or
    # CORRUPT ones; superseded ones are retired already, newer-format ones never are.
    present = [
        (s.step, (s.gen or 0) if s.committed else None)
        for s in scan
        if s.status in (Status.COMMITTED, Status.CORRUPT)
    ]
    tried = {(s.from_resume, s.step) for s in skipped if not s.unread}
    for cat, s, from_resume in candidates:
        if (from_resume, s) in tried:
            continue
        try:
            try:
                where, m, md = cat.checked_at(s)
            except CheckpointCorruptError:  # a read fault is no proof: read it once more
                where, m, md = cat.checked_at(s)
        except CheckpointCorruptError as e:
            if step is not None:
                raise
            _log.warning("skipping step %d of %s: %s", s, cat.storage.url, e)
            gen = None if from_resume else next((i.gen for i in scan if i.step == s), None)
            skipped.append(Skip(from_resume, s, str(e), gen))
            continue
        newer = present if from_resume else [(n, g) for n, g in present if n > s]
        newer += [(t.step, t.gen or 0) for t in tier if t.committed and t.step > s]
        if step is None:  # (passed over: its manifest read as damaged twice; kept, _lines)
            for info in scan:
                if info.status == Status.CORRUPT and (info.step, None) in newer:
                    _log.warning("skipping step %d: %s", info.step, info.problem)
                    if not any(k.unread and k.step == info.step for k in skipped):
                        skipped.append(Skip(False, info.step, str(info.problem), unread=True))
        return Decision(
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
            gen=None if from_resume else m.gen,
            data_gens={} if from_resume else m.data_gens,
        )
    raise CheckpointCorruptError(
        f"{catalog.storage.url}: no committed step loads cleanly; "
        + "; ".join(f"step {k.step}{' of resume_from' * k.from_resume}: {k.why}" for k in skipped)
    )
