"""A load from the memory tier: the newest step complete across tiers, each rank's part from
its own memory, else from a replica on another rank, else the whole load from storage.

1. rank 0 reads the newest committed step of the url (its line); every rank lists its tier
   (nothing where the tier is not this user's own); one all-gather;
2. every rank computes the same choice: the newest step of that line, not older than the
   newest committed one (the url's step wins a tie only when memory has none), for which
   every rank's part is somewhere, saved at this world size and ``node_size`` by a rank
   whose tensors lay out as this rank's do. A memory step is never loaded where the url has
   no committed step of its line (another run, a rewound line);
3. parts to fetch move from their holders (``memory._parts``, checked as they arrive), and
   every rank loads its part alone, all or nothing as a load from storage (``attempt``);
4. a rank whose part fails (damaged, missing) takes its next source, with a WARNING naming
   the tier, the step and the rank; when a rank has none left, or anything else failed, the
   load goes to storage (the caller's path), the state as it was.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import muon_ckpt._collective as coll
from muon_ckpt._errors import CheckpointError
from muon_ckpt.load._attempt import LoadTargets, attempt, release_backup, undo
from muon_ckpt.load._decide import Decision
from muon_ckpt.memory._dirs import PartInfo, copy_dirname, layout_digest, own_dirname, part_manifest
from muon_ckpt.memory._parts import drop_part, receive_part, send_part
from muon_ckpt.memory._tier import MemoryTier
from muon_ckpt.state import FlatState
from muon_ckpt.store import MANIFEST, Catalog, Manifest, Storage
from muon_ckpt.store.dcp import check_files

__all__ = ["MemoryLoaded", "restore_from_memory"]

_log = logging.getLogger("muon_ckpt")


@dataclasses.dataclass(frozen=True)
class _Held:
    """What one rank reports of one part it holds."""

    step: int
    rank: int  # whose part
    copy: bool
    line: str | None
    world_size: int
    node_size: Any
    layout: Any
    url: Any
    save: Any  # the memory save that wrote it


@dataclasses.dataclass
class MemoryLoaded:
    """A memory-tier load: what a load from storage returns, and where this rank's part
    came from (``"memory"``: its own tier; ``"peer"``: a replica on another rank)."""

    decision: Decision
    where: str
    report: Any
    timings: dict[str, float]
    tier: str


def restore_from_memory(
    t: LoadTargets,
    catalog: Catalog,
    tier: MemoryTier,
    step: int | None,
    *,
    strict: bool,
    parts: tuple[str, ...],
) -> MemoryLoaded | None:
    """Load the newest step complete across tiers from memory, or None (then from storage)."""
    t0 = time.perf_counter()
    group, rank, world = t.group, coll.rank(), coll.world_size()
    newest = coll.on_rank0(lambda: _newest_committed(catalog), group)
    why_not = tier.readable()
    # Its own part and the replicas it holds (ranks of a node may share a directory: the
    # other ranks' own parts there are theirs to report).
    try:
        found = [] if why_not is not None else tier.parts()
    except OSError as e:
        found, why_not = [], f"{tier.run_dir}: {e}"
    held = [_held(p) for p in found if p.manifest and (p.copy or p.rank == rank)]
    flat = FlatState.build(t.model, None, {}, rank=rank)
    layout = layout_digest(flat.sd)
    gathered = coll.all_gather((held, layout, why_not), group)
    if rank == 0:
        for r, (_, _, why) in enumerate(gathered):
            if why is not None:
                _log.warning("the memory tier of rank %d is not read: %s", r, why)
    node = tier.node_size(world)
    choice = _choose(gathered, newest, step, world, node, tier.url)
    if choice is None:
        return None
    chosen, save, sources = choice
    cur = [0] * world
    decided = time.perf_counter() - t0
    storage = Storage(tier.run_dir)
    rel = own_dirname(chosen, rank)
    where = os.path.join(tier.run_dir, rel)
    while True:
        problem = _fetch(tier, chosen, save, sources, cur, group)
        checked = _check(storage, rel, chosen, save) if problem is None else problem
        problems = coll.all_gather(checked if isinstance(checked, str) else None, group)
        if _advance(problems, sources, cur, chosen, "memory tier"):
            continue
        if any(c >= len(s) for c, s in zip(cur, sources, strict=True)):
            return _to_storage(chosen, "no rank has a whole copy of some rank's part")
        assert not isinstance(checked, str)
        m, md = checked
        d = Decision(
            from_resume=False,
            step=chosen,
            world_size=m.world_size,
            files=m.files,
            metadata=md,
            newer=[],
            skipped=[],
            dirname=rel,
            line=m.line,
            optimizer=m.extra.get("optimizer"),
        )
        out = attempt(t, storage, d, where, strict, parts, alone=True)
        if not out.failures:
            break
        undo(t, out.rollback)
        failed = {r: f.message for r, f in out.failures.items()}
        if not out.corrupt:
            return _to_storage(chosen, "; ".join(f"rank {r}: {m}" for r, m in failed.items()))
        _advance([failed.get(r) for r in range(world)], sources, cur, chosen, "memory tier")
        if any(c >= len(s) for c, s in zip(cur, sources, strict=True)):
            return _to_storage(chosen, "no rank has a whole copy of some rank's part")
    try:
        if out.rollback is not None:
            out.rollback.done()
    finally:
        release_backup(t)
    holder, _ = sources[rank][cur[rank]]
    where_from = "memory" if holder == rank else "peer"
    tier.complete_steps.add(chosen)  # kept by retention as a step complete on every rank
    timings = {"decide": decided, **out.timings, "total": time.perf_counter() - t0}
    timings["apply"] = timings["total"] - sum(
        timings.get(k, 0.0) for k in ("decide", "prepare", "backup", "dcp_load")
    )
    _log.info(
        "loaded step %d from the memory tier (%s) in %.3f s", chosen, where_from, timings["total"]
    )
    return MemoryLoaded(d, where, out.report, timings, where_from)


def _held(p: PartInfo) -> _Held:
    m = p.manifest
    assert m is not None
    return _Held(
        p.step,
        p.rank,
        p.copy,
        m.line,
        m.world_size,
        p.meta("node_size"),
        p.meta("layout"),
        p.meta("url"),
        p.meta("save"),
    )


def _newest_committed(catalog: Catalog) -> tuple[int, str | None] | None:
    committed = [s for s in catalog.scan() if s.committed]
    return (committed[-1].step, committed[-1].line) if committed else None


def _choose(
    gathered: list[tuple[list[_Held], str, str | None]],
    newest: tuple[int, str | None] | None,
    step: int | None,
    world: int,
    node: int,
    url: str,
) -> tuple[int, str, list[list[tuple[int, bool]]]] | None:
    """The step to load from memory, the save that wrote it and, for each rank, where its
    part is (holder, copy), its own first; None when no step qualifies (rank 0 says why at
    INFO). Every rank's part must come from one save: parts of a step saved twice (after a
    restart or a rewind) never mix."""
    if newest is None or len(gathered) != world:
        return None
    layouts = [g[1] for g in gathered]
    by_save: dict[tuple[int, str], list[list[tuple[int, bool]]]] = {}
    seen_newer: set[int] = set()
    for holder, (held, _, _) in enumerate(gathered):
        for h in held:
            if h.step > newest[0]:
                seen_newer.add(h.step)
            ok = (
                h.url == url
                and isinstance(h.save, str)
                and h.line == newest[1]
                and h.world_size == world
                and h.node_size == node
                and 0 <= h.rank < world
                and h.layout == layouts[h.rank]
                and h.step >= newest[0]
                and (step is None or h.step == step)
            )
            if ok:
                slots = by_save.setdefault((h.step, h.save), [[] for _ in range(world)])
                slots[h.rank].append((holder, h.copy))
    for s, save in sorted(by_save, reverse=True):
        sources = by_save[s, save]
        if all(sources):
            for slot in sources:  # its own part first, then copies by holder
                slot.sort(key=lambda hc: (hc[1], hc[0]))
            return s, save, sources
    if seen_newer and coll.rank() == 0:
        _log.info(
            "memory tier: step(s) %s newer than the url's step %d are not loadable here (another "
            "line, world size, node_size or layout, or some rank's part is missing)",
            sorted(seen_newer),
            newest[0],
        )
    return None


def _check(storage: Storage, rel: str, step: int, save: str) -> str | tuple[Manifest, Any]:
    """This rank's own part of ``step`` as far as its manifest and sizes tell (the load
    checks every byte): (its manifest, its DCP metadata), or why it cannot be read."""
    where = os.path.join(storage.url, rel)
    try:
        m = part_manifest(storage.read_bytes(rel, MANIFEST), where)
        if m.step != step or m.extra["memory"].get("save") != save:
            return f"{where} is another save's part than the one chosen"
        return m, check_files(storage, (rel,), m, tiles=False)
    except (CheckpointError, OSError) as e:
        return str(e)


def _fetch(
    tier: MemoryTier,
    step: int,
    save: str,
    sources: list[list[tuple[int, bool]]],
    cur: list[int],
    group: Any,
) -> str | None:
    """Every part whose current source is a replica moves from its holder to its rank (the
    same transfers, in rank order, on every rank; a replica this rank holds of its own part
    is moved in place). Returns why this rank's fetch failed, or None (also when it fetched
    nothing; ``_check`` then looks at its own part)."""
    rank, problem = coll.rank(), None
    for r, slot in enumerate(sources):
        if cur[r] >= len(slot):
            continue
        holder, is_copy = slot[cur[r]]
        if not is_copy or (rank != holder and rank != r):
            continue
        copy, own = (os.path.join(tier.run_dir, f(step, r)) for f in (copy_dirname, own_dirname))
        if holder == r:  # (the nodes' ranks were numbered otherwise when it was taken)
            try:
                drop_part(own)
                os.rename(copy, own)
            except OSError as e:
                problem = f"{copy}: {e}"
        elif rank == holder:
            send_part(copy, r, group)
        else:
            try:
                tier.ensure_dirs()
                unsafe = None
            except (CheckpointError, OSError) as e:  # declined: the holder sends nothing
                unsafe = str(e)

            def expect(
                m: Any, r: int = r, holder: int = holder, unsafe: str | None = unsafe
            ) -> str | None:
                if unsafe is not None:
                    return unsafe
                if m.step != step or m.extra["memory"].get("rank") != r:
                    return f"rank {holder} sent another part than rank {r}'s of step {step}"
                if m.extra["memory"].get("save") != save:
                    return f"rank {holder} sent a part of another save of step {step}"
                return None

            m, why = receive_part(tier.run_dir, own_dirname(step, r), holder, group, expect=expect)
            if m is None:
                problem = why or f"rank {holder} no longer holds rank {r}'s part of step {step}"
    return problem


def _advance(
    problems: list[str | None],
    sources: list[list[tuple[int, bool]]],
    cur: list[int],
    step: int,
    what: str,
) -> bool:
    """Move each rank with a problem to its next source (WARNING on rank 0); whether any
    moved."""
    moved = False
    for r, why in enumerate(problems):
        if why is None or cur[r] >= len(sources[r]):
            continue
        holder, is_copy = sources[r][cur[r]]
        cur[r] += 1
        moved = True
        if coll.rank() == 0:
            nxt = (
                f"its replica on rank {sources[r][cur[r]][0]}"
                if cur[r] < len(sources[r])
                else "storage"
            )
            _log.warning(
                "%s: rank %d's part of step %d (%s) is not usable: %s; loading it from %s",
                what,
                r,
                step,
                f"the replica on rank {holder}" if is_copy else "its own",
                why,
                nxt,
            )
    return moved


def _to_storage(step: int, why: str) -> None:
    if coll.rank() == 0:
        _log.warning(
            "memory tier: step %d cannot be loaded from host memory (%s); loading from storage",
            step,
            why,
        )
    return None
