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

import muon_ckpt._collective as coll
from muon_ckpt._errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from muon_ckpt.store import Catalog, FileEntry, Manifest, Status, StepInfo, mark_tier
from muon_ckpt.store.dcp import metadata_bytes, unpack_metadata

__all__ = ["Decision", "History", "Skip", "decide", "refuse_newer"]

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
    update_rules: Any = None  # each param's update rule when saved (its manifest's; unchecked)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rank 0 broadcasts it: the metadata in columns (store.metadata_bytes), which every
        # rank unpickles in a tenth of the time of DCP's object per chunk and per item.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["metadata"] = metadata_bytes(self.metadata)
        return (_received, (fields,))


def _received(fields: dict[str, Any]) -> Decision:
    """A decision as rank 0 sent it (``Decision.__reduce__``)."""
    md = unpack_metadata(fields["metadata"], "the load's decision, from rank 0")
    return Decision(**{**fields, "metadata": md})


@dataclasses.dataclass
class History:
    """The run's history for one load: the url's steps (one scan) and the memory tier's
    complete steps as commits beside them, marked once (``store.mark_tier``); ``retired``:
    the url's commits only the tier retires."""

    scan: list[StepInfo]
    tier: list[StepInfo]
    retired: list[tuple[int, int]]

    @classmethod
    def of(
        cls,
        scan: list[StepInfo],
        tier: list[StepInfo] | None = None,
        records: dict[str, int] | None = None,
    ) -> History:
        """``records``: the url's line records (``Catalog.records``), which vouch for the
        tier's steps of their lines."""
        tier = list(tier or ())
        return cls(scan, tier, mark_tier(scan, tier, records))

    def refuse_newer(self, url: str, step: int | None) -> None:
        """The url's steps of a newer format (``refuse_newer``)."""
        newer = [s for s in self.scan if s.status == Status.NEWER]
        if newer:
            fix = f"Upgrade muon-ckpt. ({newer[-1].problem})"
            refuse_newer(url, "step(s)", [s.step for s in newer], step, fix)

    def decision(
        self,
        s: int,
        m: Manifest,
        md: Any,
        dirname: str,
        *,
        source: str,
        skipped: list[Skip],
        asked: bool,
    ) -> Decision:
        """The load of step ``s`` (manifest ``m``, metadata ``md``, in ``dirname``) from
        ``source``: "url", "resume_from" or "memory" (a part of the memory tier). It carries
        what a save after it retires: the url's newer steps (committed, with their commit's
        gen, or CORRUPT; every one of them after a load from ``resume_from``; superseded ones
        are retired already, newer-format ones never are), the tier's newer commits, and the
        url's commits only the tier retires."""
        from_resume = source == "resume_from"
        present = [
            (i.step, (i.gen or 0) if i.committed else None)
            for i in self.scan
            if i.status in (Status.COMMITTED, Status.CORRUPT)
        ]
        newer = present if from_resume else [(n, g) for n, g in present if n > s]
        newer += [(t.step, t.gen or 0) for t in self.tier if t.committed and t.step > s]
        newer += [r for r in self.retired if r not in newer]
        if not asked:  # (passed over: its manifest read as damaged twice; kept, store._lines)
            skipped = [*skipped, *self._unread(newer, skipped)]
        url = source == "url"
        return Decision(
            from_resume,
            s,
            m.world_size,
            m.files,
            md,
            newer,
            skipped,
            dirname,
            line=None if from_resume else m.line,
            optimizer=m.extra.get("optimizer"),
            gen=m.gen if url else None,
            data_gens=m.data_gens if url else {},
            update_rules=m.extra.get("update_rules"),
        )

    def _unread(self, newer: list[tuple[int, int | None]], skipped: list[Skip]) -> list[Skip]:
        """The url's newer steps whose manifest could not be read (CORRUPT, gen unknown) not
        yet in ``skipped``, said once (rank 0: every rank decides a load from memory)."""
        out = []
        for info in self.scan:
            if info.status == Status.CORRUPT and (info.step, None) in newer:
                if coll.rank() == 0:
                    _log.warning("skipping step %d: %s", info.step, info.problem)
                if not any(k.unread and k.step == info.step for k in skipped):
                    out.append(Skip(False, info.step, str(info.problem), unread=True))
        return out


def refuse_newer(where: str, what: str, newer: list[int], step: int | None, fix: str) -> None:
    """A step of a newer format (the url's, or the memory tier's) is never read, nor loaded
    past: CheckpointVersionError, unless another ``step`` was asked for."""
    if newer and (step is None or step in newer):
        raise CheckpointVersionError(
            f"{where}: {what} {newer} were written by a newer muon-ckpt; this version neither "
            f"reads them nor resumes an older step past them. {fix}"
        )


def decide(
    catalog: Catalog,
    resume: tuple[Catalog, int | None] | None,
    step: int | None,
    skipped: list[Skip],
    history: History,
) -> Decision | None:
    """Rank 0: what to load from ``catalog`` (else ``resume``), or None on a fresh run;
    ``skipped``: the steps that failed so far (not tried again); ``history``: the url's
    steps and the memory tier's commits, which retire url steps and count as newer."""
    scan = history.scan
    history.refuse_newer(catalog.storage.url, step)
    committed = [s.step for s in scan if s.committed]
    if step is not None:
        candidates = [(catalog, _asked_for(catalog, scan, step, committed), False)]
    else:
        candidates = [(catalog, s, False) for s in reversed(committed)]
        more = _resume_candidates(resume, bool(committed))
        if more is None:
            return None
        candidates += more
    return _first_that_checks_out(catalog, history, candidates, step, list(skipped))


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
    history: History,
    candidates: list[tuple[Catalog, int, bool]],
    step: int | None,
    skipped: list[Skip],
) -> Decision:
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
            gen = None if from_resume else next((i.gen for i in history.scan if i.step == s), None)
            skipped.append(Skip(from_resume, s, str(e), gen))
            continue
        source = "resume_from" if from_resume else "url"
        return history.decision(
            s, m, md, where, source=source, skipped=skipped, asked=step is not None
        )
    raise CheckpointCorruptError(
        f"{catalog.storage.url}: no committed step loads cleanly; "
        + "; ".join(f"step {k.step}{' of resume_from' * k.from_resume}: {k.why}" for k in skipped)
    )
