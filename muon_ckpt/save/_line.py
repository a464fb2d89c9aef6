"""What a manager remembers of its run's line between calls (the rules: ``store._lines``):
whether it loaded (or found nothing to load) or saved, the line id its commits carry, the
steps its next commit retires (a rewind's newer steps, or another run's with ``new_run``),
and what this rank's next save may refer to instead of writing (``base``: the items of the
step it loaded from ``url`` or last committed there; ``_dedup``)."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import muon_ckpt._collective as coll
from muon_ckpt.save._dedup import DedupBase
from muon_ckpt.store import Catalog, SavePlan

__all__ = ["RunLine"]

_log = logging.getLogger("muon_ckpt")


@dataclass
class RunLine:
    new_run: bool  # a first save without a load may replace another run's steps
    resumed: bool = False
    line: str | None = None
    abandoned: list[tuple[int, int | None]] = field(default_factory=list)  # (step, gen)
    base: DedupBase | None = None

    def begin(self, catalog: Catalog, step: int, overwrite: bool) -> tuple[SavePlan, str]:
        """Rank 0, before a save: ready ``step`` and decide what it retires (``Catalog.begin``);
        the line id its commit carries (this run's, or a new one)."""
        plan = catalog.begin(
            step,
            overwrite=overwrite,
            resumed=self.resumed,
            new_run=self.new_run,
            abandon=self.abandoned,
            refer_to=None if self.base is None else self.base.key,
        )
        url = catalog.storage.url
        if plan.replacing and not self.resumed:
            _log.warning(
                "%s: new_run=True: starting a new run here; the steps of the previous one %s "
                "are deleted once step %d is committed",
                url,
                plan.replacing,
                step,
            )
        elif plan.replacing:
            _log.warning(
                "%s: this run was rewound to an earlier step; step %d retires the steps of the "
                "abandoned line %s, which are deleted once it is committed",
                url,
                step,
                plan.replacing,
            )
        return plan, self.line or uuid.uuid4().hex[:16]

    def admit(self, catalog: Catalog, step: int) -> tuple[SavePlan, str]:
        """Rank 0, before a save of ``step`` to the memory tier only: the url's rules
        (``Catalog.admit``: the lease, another run's steps, a newer format, what it retires)
        and the line id it carries, kept for the saves after it. ``base`` is left as it is:
        the memory step's bytes are not in the url, so the next url save refers only to the
        url's last commit."""
        plan = catalog.admit(
            step, resumed=self.resumed, new_run=self.new_run, abandon=self.abandoned
        )
        self.line = self.line or uuid.uuid4().hex[:16]
        return plan, self.line

    def saving(self, plan: SavePlan, line: str) -> DedupBase | None:
        """Every rank, once the save began: until it commits, the next save retires them.
        Returns what the save may refer to: the base, while rank 0 found its step committed
        (else it is forgotten: a step deleted meanwhile, by a prune or by hand)."""
        self.resumed, self.line = True, line
        self.abandoned = [*((s, g) for s, g in plan.retires), *((s, None) for s in plan.drop)]
        if self.base is not None and plan.refer_to != self.base.key:
            self.base = None
        return self.base

    def committed(self, base: DedupBase | None) -> None:
        """The save committed: what it retired is retired, and ``base`` (its items) is what
        the next save may refer to."""
        self.abandoned = []
        self.base = base

    def loaded(self, url: str, d: Any) -> None:
        """A load of decision ``d``: a plain resume continues the step's line; a rewind (newer
        steps exist) or a start from ``resume_from`` begins one, whose first commit retires
        the newer steps."""
        self.resumed, self.abandoned = True, list(d.newer)
        self.line = d.line if not d.newer and not d.from_resume else None
        # A step of url (not resume_from's, nor a memory tier's part) is what it holds.
        gen = getattr(d, "gen", None)
        self.base = None if gen is None else DedupBase.of_step(d.step, gen, d.files, d.metadata)
        if d.newer and coll.rank() == 0:
            _log.warning(
                "%s: loaded step %d while newer steps %s exist; the first save of this run "
                "retires them and deletes them once it is committed (to keep them, resume "
                "into another url with resume_from)",
                url,
                d.step,
                [s for s, _ in d.newer],
            )

    def fresh(self) -> None:
        """A load that found nothing: the next save starts the url's first line."""
        self.resumed, self.line, self.abandoned, self.base = True, None, [], None
