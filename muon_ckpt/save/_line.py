"""What a manager remembers of its run's line between calls (the rules: ``store._lines``):
whether it loaded (or found nothing to load) or saved, the line id its commits carry, the
steps its next commit retires (a rewind's newer steps, or another run's with ``new_run``) and,
of those, the ones a load passed over (kept, ``passed``), what this rank's next save may
refer to instead of writing (``base``: the items of the step it loaded from ``url`` or last
committed there; ``_dedup``), and the newest step known to verify (``verified``: read whole
and checked by a load or a commit's read-back), which retention keeps."""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import muon_ckpt._collective as coll
from muon_ckpt.save._dedup import DedupBase
from muon_ckpt.store import Catalog, SavePlan

__all__ = ["Admission", "RunLine", "new_id"]

_log = logging.getLogger("muon_ckpt")


def new_id() -> str:
    """A new line's id, or a save's (rank 0 draws it: the memory tier's parts record it, so
    that parts of one step written by different saves, a step saved again, never mix)."""
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class Admission:
    """A save as rank 0 admitted it, the same on every rank: what it retires and its
    generation (``plan``), the line its commit carries, its id, and what this rank's save may
    refer to instead of writing (``base``). ``recheck``: admitted from the steps the catalog
    knows, the ``Catalog.begin`` rank 0 runs in the save's job before it writes."""

    plan: SavePlan
    line: str
    save_id: str
    base: DedupBase | None = None
    recheck: Callable[[], SavePlan] | None = None


@dataclass
class RunLine:
    new_run: bool  # a first save without a load may replace another run's steps
    loads_check: bool = True  # a load checks every byte it reads (verify="checksum")
    resumed: bool = False
    line: str | None = None
    abandoned: list[tuple[int, int | None]] = field(default_factory=list)  # (step, gen)
    passed: list[tuple[int, int | None, str]] = field(default_factory=list)  # (step, gen, why)
    base: DedupBase | None = None
    verified: tuple[int, int] | None = None  # (step, gen)

    def admit(
        self,
        catalog: Catalog,
        step: int,
        group: Any,
        *,
        url: bool,
        memory: bool = False,
        overwrite: bool = False,
        cached: bool = False,
    ) -> Admission:
        """Every rank, before a save of ``step`` (``url``: to the url; else to the memory tier
        only; ``memory``: to the memory tier too): rank 0 readies it (``_ready``; a memory
        step's line vouched for by the url, ``store._records``) and draws its id; every rank
        learns them and what the save may refer to (``saving``). ``cached``: decided from the
        steps the catalog knows where it knows them (``Catalog.plan_cached``: no storage
        request), the url's ``begin`` (a save to the url alone) or ``admit`` and the line's
        record (to the memory tier alone) left to the save's job (``Admission.recheck``)."""
        later: list[Any] = [None]  # (rank 0's ``begin``: a closure is not broadcast)

        def ready() -> tuple[SavePlan, str, str, bool]:
            plan, line, later[0] = self._ready(catalog, step, url, overwrite, cached)
            if later[0] is None and (memory or not url):  # (after the scan that planned it,
                catalog.records.vouch(line, step, plan)  # under the lease)
            return plan, line, new_id(), later[0] is not None

        def recheck() -> SavePlan:  # (rank 0, in the save's job)
            checked = later[0]()
            if not url:  # (a memory save admitted from the cache: its record comes here)
                catalog.records.vouch(line, step, checked)
            return checked

        plan, line, save_id, deferred = coll.on_rank0(ready, group)
        return Admission(
            plan, line, save_id, self.saving(plan, line, url=url), recheck if deferred else None
        )

    def _ready(
        self, catalog: Catalog, step: int, url: bool, overwrite: bool, cached: bool
    ) -> tuple[SavePlan, str, Callable[[], SavePlan] | None]:
        """Rank 0: the url's rules for a save of ``step`` and what it retires: to the url,
        ``Catalog.begin`` readies the step directory (``cached``: ``Catalog.plan_cached``
        decides, and ``begin`` is returned for the save's job; else None); to the memory tier
        only, ``Catalog.admit`` (the lease, another run's steps, a newer format; nothing
        written there; ``cached``: likewise left to the job). Returns the plan, the line id
        its commit carries (this run's, or new) and the check left to the job."""
        if not url:
            kw: dict[str, Any] = dict(
                resumed=self.resumed,
                new_run=self.new_run,
                abandon=list(self.abandoned),
                line=self.line,  # (its own record is no other run's)
            )
            got = catalog.plan_cached(step, overwrite=True, **kw) if cached else None
            later = None if got is None else functools.partial(catalog.admit, step, **kw)
            return got or catalog.admit(step, **kw), self.line or new_id(), later
        kw = dict(
            overwrite=overwrite,
            resumed=self.resumed,
            new_run=self.new_run,
            abandon=list(self.abandoned),
            refer_to=None if self.base is None else self.base.key,
            pass_over=list(self.passed),
            line=self.line,
        )
        got = catalog.plan_cached(step, **kw) if cached else None
        later = None if got is None else functools.partial(catalog.begin, step, **kw)
        plan = got or catalog.begin(step, **kw)
        url_name = catalog.storage.url
        newly = {s for s, _, _ in self.passed}  # (gen None: its manifest was unreadable)
        for s, _, why in plan.passed:
            if s in newly:
                _log.warning(
                    "%s: step %d, which the load passed over (%s), is retired from this run's "
                    "line by step %d%s",
                    url_name,
                    s,
                    why,
                    step,
                    ", which takes its place"
                    if s == step
                    else "; its files are kept until retention or prune deletes it (muon-ckpt "
                    "verify says whether it is damaged)",
                )
        if plan.replacing and not self.resumed:
            _log.warning(
                "%s: new_run=True: starting a new run here; the steps of the previous one %s "
                "are deleted once step %d is committed",
                url_name,
                plan.replacing,
                step,
            )
        elif plan.replacing:
            _log.warning(
                "%s: this run was rewound to an earlier step; step %d retires the steps of the "
                "abandoned line %s, which are deleted once it is committed",
                url_name,
                step,
                plan.replacing,
            )
        return plan, self.line or new_id(), later

    def saving(self, plan: SavePlan, line: str, *, url: bool = True) -> DedupBase | None:
        """Every rank, once a save began: its line id is the run's from now on. A save to the
        url retires what its plan retires until it commits (the next save retires them too),
        and may refer to the base while rank 0 found its step committed (else it is
        forgotten: a step deleted meanwhile, by a prune or by hand). A memory step leaves
        both to the next save to the url, which the memory step is not in. Returns what the
        save may refer to."""
        self.line = line
        if not url:
            return self.base
        self.resumed = True
        self.abandoned = [*((s, g) for s, g in plan.retires), *((s, None) for s in plan.drop)]
        if self.base is not None and plan.refer_to != self.base.key:
            self.base = None
        return self.base

    def committed(self, base: DedupBase | None, verified: tuple[int, int] | None) -> None:
        """The save committed: what it retired is retired, ``base`` (its items) is what the
        next save may refer to, and ``verified`` (its commit, when read back whole) the
        newest step known to verify."""
        self.abandoned, self.passed = [], []
        self.base = base
        self.verified = verified or self.verified

    def loaded(self, url: str, d: Any) -> None:
        """A load of decision ``d``: a plain resume continues the step's line; a rewind (newer
        steps exist) or a start from ``resume_from`` begins one, whose first commit retires
        the newer steps."""
        self.resumed, self.abandoned = True, list(d.newer)
        self.line = d.line if not d.newer and not d.from_resume else None
        # The newer steps of url this load could not read (not those of a rewind asked for)
        why = {(k.step, k.gen): k.why[:500] for k in d.skipped if not k.from_resume}
        self.passed = [(s, g, why[s, g]) for s, g in d.newer if (s, g) in why]
        # A step of url (not resume_from's, nor a memory tier's part) is what it holds.
        gen = getattr(d, "gen", None)
        if gen is not None:
            self.base = DedupBase.of_step(d.step, gen, d.files, d.metadata, d.data_gens)
            self.verified = (d.step, gen) if self.loads_check else self.verified
        else:
            self.base = None
        dropped = [s for s, g in d.newer if (s, g) not in why]
        if dropped and coll.rank() == 0:
            _log.warning(
                "%s: loaded step %d while newer steps %s exist; the first save of this run "
                "retires them and deletes them once it is committed (to keep them, resume "
                "into another url with resume_from)",
                url,
                d.step,
                dropped,
            )

    def fresh(self) -> None:
        """A load that found nothing: the next save starts the url's first line."""
        self.resumed, self.line, self.abandoned, self.base = True, None, [], None
        self.passed = []
