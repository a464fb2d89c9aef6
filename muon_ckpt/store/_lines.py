"""A run's history: which committed steps are live, and what a save retires.

A url holds one line of steps. Every commit has a generation (``gen``: one more than any
commit in the root when it was made; 0 in manifests older than this rule) and may list
commits it retires (``retires``: ``[step, gen]`` pairs). A retired commit is SUPERSEDED: no
load resumes it, retention does not count it, and the save after the one that retired it (or
that save itself, once committed) deletes it. A save retires

* after a rewind (a load of a step older than the newest, asked for or fallen back to): the
  newer steps, which belong to the abandoned line;
* when a run starts over in a used url (``new_run``): every committed step there;
* and, always, every superseded commit that is still there, so that a retirement outlives
  the commit that made it (retention deletes old commits first).

A step that a load passed over (``load()`` fell back past it: it could not be read, even
once more) is retired as a rewind's newer steps are, so no restart resumes it and lines
never mix; but a read fault is no proof of damage, so its files are not deleted on that
account: the commit lists it in ``passed_over`` too, and it is deleted only once retention or
``prune`` keeps only newer steps (``aged_out``), or when a save takes its step number. That
holds for a step whose manifest the load could not read as well (a read fault, or a proxy
serving a damaged copy): found committed by the save, it is retired with its generation;
still unreadable (CORRUPT), its generation is not known, so the commit lists ``[step, its own
gen]``, which stands for every commit of that step not newer than itself (``_unread``; a save
of that step number is newer), and each later commit lists it again while it is unreadable.
A commit whose generation is below the unreadable one's (the commits above it deleted since:
a rewind's) cannot retire it: should it read again, its line lives on beside this one.

So deleting happens only after a commit, and a process that dies between a commit and the
deletions leaves a url whose next load resumes the new line. A first save of a manager that
has not loaded anything is refused where the url holds committed steps (another run's), and
every save where it holds a step of a newer format (this version must not write beside or
delete what it cannot read).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from muon_ckpt._errors import CheckpointExistsError, CheckpointVersionError
from muon_ckpt.store._steps import COMMITTED, CORRUPT, NEWER, SUPERSEDED, UNCOMMITTED, StepInfo

__all__ = ["SavePlan", "aged_out", "mark_superseded", "mark_tier", "plan_save"]


@dataclass(frozen=True)
class SavePlan:
    """What rank 0 decided before a save writes anything."""

    gen: int  # the commit's generation
    retires: list[tuple[int, int]]  # commits [step, gen] that it supersedes
    drop: list[int]  # CORRUPT steps of the replaced line, deleted after the commit
    replacing: list[int]  # the steps this save newly retires or drops (not those carried), to
    # be deleted after its commit (not the steps it passes over)
    beside: bool  # write beside the step's directory, swapped in at the commit (an overwrite,
    # or a step being replaced)
    base: tuple[int, int, str | None] | None = None  # the newest live commit: (step, gen, line)
    # The commit (step, gen) whose data the save may refer to (tensors unchanged since):
    # committed and not retired by this save; None: the save writes every tensor
    refer_to: tuple[int, int] | None = None
    # Of ``retires``, the commits a load passed over, (step, gen, why): kept, not deleted
    passed: list[tuple[int, int, str]] = field(default_factory=list)


def mark_superseded(infos: list[StepInfo]) -> None:
    """Set the status of every committed step that a commit retired to SUPERSEDED (and its
    ``passed_over`` where a load passed over it)."""
    retired: dict[tuple[int, int], int] = {}
    passed: dict[tuple[int, int], str] = {}
    for i in infos:
        if i.status in (COMMITTED, SUPERSEDED):
            for pair in i.retires:
                retired.setdefault(pair, i.step)
            for s, g, why in i.passes:
                passed.setdefault((s, g), why)
    unread = _unread(infos)
    for i in infos:
        key = (i.step, i.gen or 0)
        by = retired.get(key)
        gen, by_unread, why = unread.get(i.step, (-1, 0, ""))
        if i.status == CORRUPT and gen >= 0:  # (its manifest still cannot be read)
            i.passed_over, i.problem = why, f"{i.problem}; {_kept(why, by_unread)}"
            continue
        if by is None and (i.gen or 0) <= gen:
            by, passed[key] = by_unread, why
        if i.status != COMMITTED or by is None:
            continue
        i.status, i.passed_over = SUPERSEDED, passed.get(key)
        i.problem = (
            f"replaced by the line of step {by} (a rewind, or a new run in this url); "
            "never loaded, and deleted by the next save"
        )
        if i.passed_over is not None:
            i.problem = _kept(i.passed_over, by)


def _kept(why: str, by: int) -> str:
    return (
        f"passed over by a load that could not read it ({why}); retired by the line of step "
        f"{by}: never resumed, kept until retention or prune deletes it (muon-ckpt verify says "
        "whether it is damaged)"
    )


def _unread(infos: list[StepInfo]) -> dict[int, tuple[int, int, str]]:
    """step -> (gen, the step retiring it, why) of the passed-over commits ``[step, gen]``
    that a commit listed with its own generation: a step whose manifest it could not read
    (CORRUPT, generation unknown), retired at every generation up to that one."""
    out: dict[int, tuple[int, int, str]] = {}
    for i in infos:
        if i.status in (COMMITTED, SUPERSEDED):
            for s, g, why in i.passes:
                if g == (i.gen or 0) and s != i.step and g > out.get(s, (-1, 0, ""))[0]:
                    out[s] = (g, i.step, why)
    return out


def aged_out(infos: list[StepInfo], kept: set[int]) -> list[int]:
    """The passed-over steps older than every step in ``kept`` (the committed steps
    retention or prune keeps): they go with the steps of their age."""
    oldest = min(kept, default=None)
    if oldest is None:
        return []
    return [i.step for i in infos if i.passed_over is not None and i.step < oldest]


@dataclass
class Steps:
    """What ``plan_save`` reads of a scan's steps, in one pass: made once per scan or commit
    (``Catalog``: in the save's job), so that a save admitted from it costs no pass over a long
    run's steps while ``save()`` blocks."""

    newer: list[int]
    by_step: dict[int, StepInfo]
    live: list[StepInfo]  # committed, oldest first
    carried: list[tuple[int, int]]  # superseded (step, gen)
    corrupt: list[int]
    passed: list[StepInfo]  # passed over by a load
    top_gen: int  # the highest gen of a committed or superseded step (0: none)
    committed: set[tuple[int, int]]

    @classmethod
    def of(cls, infos: list[StepInfo]) -> Steps:
        out = cls([], {}, [], [], [], [], 0, set())
        for i in infos:
            out.by_step[i.step] = i
            gen = i.gen or 0
            if i.status == NEWER:
                out.newer.append(i.step)
            elif i.status == COMMITTED:
                out.live.append(i)
                out.committed.add((i.step, gen))
            elif i.status == SUPERSEDED:
                out.carried.append((i.step, gen))
            elif i.status == CORRUPT:
                out.corrupt.append(i.step)
            if i.status in (COMMITTED, SUPERSEDED):
                out.top_gen = max(out.top_gen, gen)
            if i.passed_over is not None:
                out.passed.append(i)
        return out


def plan_save(
    infos: list[StepInfo] | Steps,
    url: str,
    step: int,
    *,
    overwrite: bool,
    resumed: bool,
    new_run: bool,
    abandon: list[tuple[int, int | None]],
    refer_to: tuple[int, int] | None = None,
    pass_over: list[tuple[int, int | None, str]] | None = None,
    records: dict[str, int] | None = None,
    line: str | None = None,
) -> SavePlan:
    """Decide a save of ``step`` over the scan ``infos`` of ``url``. ``resumed``: the
    manager loaded (or found nothing to load) or saved before; ``abandon``: the steps newer
    than the one it loaded (``(step, gen)``, gen None for a CORRUPT one), which this save
    retires; ``pass_over``: those of them the load passed over (``(step, gen, why)``), which
    are kept; ``refer_to``: the commit ``(step, gen)`` whose data the save may refer to, kept
    in the plan while it is committed and not retired; ``records``: the url's memory-tier line
    records (line -> gen, ``_records``), another run's where nothing was loaded but ``line``'s
    (this run's, once a memory save recorded it). Raises
    CheckpointVersionError or CheckpointExistsError, writing nothing."""
    known = infos if isinstance(infos, Steps) else Steps.of(infos)
    newer = known.newer
    if newer:
        raise CheckpointVersionError(
            f"{url}: step(s) {newer} were written by a newer muon-ckpt; saving step {step} "
            "next to them could make a newer version resume the wrong steps, and this version "
            "never deletes them. Upgrade muon-ckpt, or save this run to another url. Nothing "
            "was written"
        )
    by_step, live, carried = known.by_step, known.live, known.carried
    retires: list[tuple[int, int]] = []
    drop: list[int] = []
    others = {k: g for k, g in (records or {}).items() if k != line}
    if not resumed and not new_run and others and not live:  # (a line the tier alone holds)
        raise CheckpointExistsError(_recorded(url, step, others))
    if not resumed and live:
        if not new_run:
            raise CheckpointExistsError(_foreign(url, step, live))
        retires += [(i.step, i.gen or 0) for i in live]
        drop += known.corrupt
    # A new run replaces every step of the old one; a resumed run keeps what it passes over.
    keeps: dict[tuple[int, int | None], str] = {}
    unread: dict[int, str] = {}  # passed over, its manifest still unreadable: retired, kept
    if resumed:
        keeps = {(s, g): why for s, g, why in pass_over or ()}
        for i in known.passed:  # (kept from an earlier commit: listed again, as ``carried`` are)
            if i.status == CORRUPT:
                unread[i.step] = i.passed_over
            else:
                keeps[i.step, i.gen or 0] = i.passed_over
    for s, g in abandon:
        info = by_step.get(s)
        status = None if info is None else info.status
        why = keeps.get((s, g), keeps.get((s, None)))  # (gen None: its manifest was unreadable)
        if status == CORRUPT and why is not None:
            unread[s] = why
            continue
        if status == CORRUPT:
            drop.append(s)
        if info is not None and status == COMMITTED and (g is None or (s, None) in keeps):
            g = info.gen or 0  # the load could not read its manifest; this save can
        if g is not None and status in (None, COMMITTED, CORRUPT):
            retires.append((s, g))  # (a step of the url, or of the memory tier: mark_tier)
            if why is not None:
                keeps[s, g] = why
    replacing = sorted({s for s, g in retires if (s, g) not in keeps} | set(drop))
    replaced = {s for s, _ in carried + retires} | set(drop) | set(unread)
    have = by_step.get(step)
    taken = have is not None and have.status in (COMMITTED, CORRUPT) and step not in replaced
    if taken and not overwrite:
        what = "committed" if have.committed else f"present but CORRUPT ({have.problem})"
        raise CheckpointExistsError(
            f"{url}: step {step} is already {what}; pass overwrite=True to replace it, or "
            "save another step"
        )
    # Above every commit it could retire, the memory tier's too: a commit never retires itself.
    gen = 1 + max([known.top_gen, *(g for _, g in abandon if g is not None)])
    for s, why in unread.items():  # (``_unread``; a save of that step takes its place instead)
        if s != step:
            retires.append((s, gen))
            keeps[s, gen] = why
    beside = overwrite or (have is not None and have.status != UNCOMMITTED)
    base = (live[-1].step, live[-1].gen or 0, live[-1].line) if live else None
    retired = sorted(set(retires + carried))
    referable = refer_to is not None and refer_to not in retired and refer_to in known.committed
    passed = sorted((s, g, why) for (s, g), why in keeps.items() if (s, g) in retired)
    referred = refer_to if referable else None
    return SavePlan(gen, retired, sorted(set(drop)), replacing, beside, base, referred, passed)


def _foreign(url: str, step: int, live: list[StepInfo]) -> str:
    steps = [i.step for i in live]
    shown = ", ".join(map(str, steps[-8:])) + (f" ({len(steps)} in all)" if len(steps) > 8 else "")
    newest = live[-1]
    return (
        f"{url}: holds committed steps {shown} of another run (the newest, step "
        f"{newest.step}, saved {newest.time or 'at an unknown time'}), and this manager saves "
        f"step {step} without having loaded anything: two runs would mix in one url (a "
        "restart would resume whichever step is newest, and retention would delete the "
        "other's steps). Call load() first to resume that run, give this run another url, "
        "or pass new_run=True to start a new run here (the steps there are deleted once this "
        "run's first step is committed). Nothing was written"
    )


def _recorded(url: str, step: int, records: dict[str, int]) -> str:
    line = max(records, key=lambda k: records[k])
    return (
        f"{url}: holds the record of memory-tier line {line} of another run (its steps may be "
        f"in the memory tier only, restorable after a crash: line-{line}-*.json), and this "
        f"manager saves step {step} without having loaded anything: two runs would mix in "
        "one url (a restart would resume this run's step instead of that run's newest). Call "
        "load() first to resume that run, give this run another url, or pass new_run=True to "
        "start a new run here. Nothing was written"
    )


def mark_tier(
    infos: list[StepInfo], tier: list[StepInfo], records: dict[str, int] | None = None
) -> list[tuple[int, int]]:
    """One history over the url's steps ``infos`` and the memory tier's complete steps
    ``tier`` (COMMITTED, with their parts' ``gen``, ``line``, ``retires`` and ``base``): a
    memory step is a commit of the run, so commits of either retire commits of either. A
    memory step is also SUPERSEDED where the url does not vouch for it -- no commit of its
    line, no record of it (``records``: line -> the gen of its record, ``_records``), nor the
    commit it was saved after (``base``): another run's tier, or a url emptied since --
    where a live url commit of another line is not older than it (a later line abandoned
    it), or where its line's record is older than that of another line with a live memory
    step (a rewind's line, or a new run, that the memory tier alone holds). Returns the
    url's commits that only the tier retires (``(step, gen)``): the next save retires them
    in the url too."""
    records = records or {}
    was = {(i.step, i.gen or 0) for i in infos if i.status == COMMITTED}
    mark_superseded([*infos, *tier])
    commits = [i for i in infos if i.status in (COMMITTED, SUPERSEDED)]
    lines = {i.line for i in commits} | set(records)
    bases = {(i.step, i.gen or 0, i.line) for i in commits}
    live_url = [i for i in infos if i.status == COMMITTED]
    for t in tier:
        if t.status != COMMITTED:
            continue
        later = [u.step for u in live_url if u.line != t.line and (u.gen or 0) >= (t.gen or 0)]
        if t.line not in lines and t.base not in bases:
            t.status, t.problem = SUPERSEDED, "of no line the url holds (another run's)"
        elif later:
            t.status = SUPERSEDED
            t.problem = f"abandoned by the line of step {later[-1]} of the url"
    recorded = [(records[t.line], t) for t in tier if t.committed and t.line in records]
    top = max(recorded, key=lambda gt: (gt[0], gt[1].step), default=None)
    for g, t in recorded:
        if top is not None and g < top[0]:
            t.status = SUPERSEDED
            t.problem = f"abandoned by the line of step {top[1].step} of the memory tier"
    return sorted(was - {(i.step, i.gen or 0) for i in infos if i.status == COMMITTED})
