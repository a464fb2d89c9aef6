"""The url's records of memory-tier lines: what lets a memory step saved before its line's
first commit to the url be restored after a crash.

The url vouches for a memory step (``_lines.mark_tier``) when it holds a commit of the step's
line, the commit the step was saved after (its ``base``), or its line's record. A memory save
of a line the url vouches for in none of these ways (a fresh url, a rewind of a line that is
in the memory tier only, a new run with nothing committed) first writes the record: one
small object ``<url>/line-<line>-<gen>.json``, once per line (one PUT per line, never per
step), whose name says all a reader needs, so the catalog knows the records from the listing
of the root that it makes anyway (no GET). Its content (line, gen, first step, time, version)
is for people; nothing reads it. ``gen`` orders the records: one more than any record there,
and not below the memory step's generation. A complete memory step of a line with a record
abandons the memory steps of every line with an older record (a rewind's abandoned line,
another run's steps), as the tier's own retention drops them once that step is complete.

A commit to the url removes the records of every other line (after it, ``Catalog.tidy``;
``prune`` keeps the record of the newest commit's line only): that newer commit abandons the
memory steps of the lines before it (``mark_tier``), and a line with commits of its own is
vouched for by them. A url emptied (its folder or prefix deleted) loses its records with its
steps, and so vouches for none of the memory steps it held: a restart there starts afresh.
"""

from __future__ import annotations

import datetime
import json
import logging

from muon_ckpt._version import __version__
from muon_ckpt.store._layout import parse_record_name, record_name
from muon_ckpt.store._lines import SavePlan
from muon_ckpt.store._steps import COMMITTED, SUPERSEDED, StepInfo
from muon_ckpt.store._storage import Storage

__all__ = ["LineRecords"]

_log = logging.getLogger(__name__)


class LineRecords:
    """The line records of ``storage``'s root as of its catalog's last scan. Its dicts are
    replaced, never changed in place: rank 0's admissions and its save job's ``tidy`` (in
    another thread) both use them."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.gens: dict[str, int] = {}  # line -> its newest record's gen
        self.names: dict[str, list[str]] = {}  # line -> its records' names, as listed
        self._committed: set[str | None] = set()  # the lines of the url's commits

    def scanned(self, names: list[str], infos: list[StepInfo]) -> None:
        """What a scan found: the records' names (``_steps.step_dirs``) and the steps."""
        by_line: dict[str, list[str]] = {}
        gens: dict[str, int] = {}
        for name in names:
            line, gen = parse_record_name(name) or ("", 0)
            by_line.setdefault(line, []).append(name)
            gens[line] = max(gen, gens.get(line, gen))
        self.names, self.gens = by_line, gens
        self._committed = {i.line for i in infos if i.status in (COMMITTED, SUPERSEDED)}

    def vouch(self, line: str, step: int, plan: SavePlan) -> None:
        """Rank 0, under the lease, as a memory step of ``line`` is admitted by ``plan`` (after
        this catalog's scan): write the line's record unless the url already vouches for it
        (a record of it, a commit of it, or the commit the step is saved after)."""
        gens = self.gens
        if line in gens or line in self._committed or plan.base is not None:
            return
        gen = max([plan.gen, *(g + 1 for g in gens.values())])
        name = record_name(line, gen)
        if parse_record_name(name) is None:  # (a line id no record can name: never silent)
            _log.warning(
                "%s: memory step %d of line %r is not recorded (no record name holds that line "
                "id): should this job die before the url's first commit of it, a restart "
                "does not restore its memory steps",
                self.storage.url,
                step,
                line,
            )
            return
        doc = {
            "format": "muon-ckpt-line",
            "line": line,
            "gen": gen,
            "step": step,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "muon_ckpt_version": __version__,
        }
        self.storage.write_bytes(json.dumps(doc, sort_keys=True).encode(), name)
        self.gens, self.names = {**gens, line: gen}, {**self.names, line: [name]}

    def others(self, line: str | None) -> bool:
        """Whether there are records of other lines than ``line`` (a commit of it removes
        them: ``stale``)."""
        return any(other != line for other in self.gens)

    def stale(self, infos: list[StepInfo], deleted: list[int], step: int | None) -> list[str]:
        """The lines whose records go once ``deleted`` are deleted from the scan ``infos``:
        all but that of committed ``step`` (None: of the newest live commit; none live: no
        record goes)."""
        gone = set(deleted)
        live = [i for i in infos if i.committed and i.step not in gone and step in (None, i.step)]
        return sorted(line for line in self.gens if live and line != live[-1].line)

    def drop(self, lines: list[str]) -> list[str]:
        """Delete every record of ``lines`` by the names the scan listed (two of one line, a
        gen written with leading zeros). Returns the lines whose records went."""
        out = []
        for line in lines:
            names = self.names.get(line, [])
            for name in names:
                self.storage.rm(name)
            if names:
                out.append(line)
            self.gens = {k: g for k, g in self.gens.items() if k != line}
            self.names = {k: n for k, n in self.names.items() if k != line}
        return out
