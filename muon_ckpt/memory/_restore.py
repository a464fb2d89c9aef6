"""A load from the memory tier: the newest step of the run across tiers, each rank's part
from its own memory, else from a replica on another rank, else the whole load from storage.

1. rank 0 scans the url (every step, of any format, and the line records in the same
   listing: the load's one scan); every rank lists its tier (nothing where the tier is not
   this user's own); one all-gather;
2. every rank computes the same history (``load.History``: ``store.mark_tier`` once): the
   tier's complete steps -- every rank's part somewhere, of one save, at this world size,
   ``node_size`` and layout -- are commits of the run beside the url's, retiring and retired
   as they are. A newer format anywhere (the url, or a part) is refused by the one rule
   (``load.refuse_newer``). The newest live step is loaded from memory when the tier has it,
   its decision built as the url's are (``History.decision``);
3. parts to fetch move from their holders (``memory._parts``, checked as they arrive), and
   every rank loads its part alone, all or nothing as a load from storage (``attempt``);
4. a rank whose part fails (damaged, missing) takes its next source, with a WARNING naming
   the tier, the step and the rank; a step that does not fit this job (keys, shapes, update
   rules: ``CheckpointMismatchError``) is raised on every rank, as from the url; when a rank
   has none left, or anything else failed (I/O), the load goes to storage (``load.resume``, with the same history: the url is not scanned
   again), the state as it was.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import muon_ckpt._collective as coll
from muon_ckpt._errors import CheckpointError, CheckpointMismatchError, handled, raise_interrupt
from muon_ckpt.load import (
    History,
    Loaded,
    LoadTargets,
    attempt,
    loaded,
    refusal,
    refuse_newer,
    resume,
    undo,
)
from muon_ckpt.memory._dirs import (
    PartInfo,
    copy_dirname,
    layout_digest,
    model_digest,
    own_dirname,
    part_manifest,
)
from muon_ckpt.memory._parts import drop_part, receive_part, send_part
from muon_ckpt.memory._tier import MemoryTier
from muon_ckpt.state import FlatState
from muon_ckpt.store import MANIFEST, Catalog, Manifest, Status, StepInfo, Storage, step_dirname
from muon_ckpt.store.dcp import check_files

__all__ = ["check_part", "load_tiers", "restore_from_memory"]

_UPGRADE = "Upgrade muon-ckpt, or remove the tier (muon-ckpt prune --memory) to resume from the url"

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
    model: Any  # model_digest (None: a part of a version that did not record it)
    url: Any
    save: Any  # the memory save that wrote it
    gen: int
    retires: list[tuple[int, int]]
    base: Any


def load_tiers(
    t: LoadTargets,
    catalog: Catalog,
    resume_from: tuple[Catalog, int | None] | None,
    tier: MemoryTier | None,
    step: int | None,
    *,
    strict: bool,
    parts: tuple[str, ...],
    elastic: bool,
) -> Loaded | None:
    """A load of the run: the memory tier's step when it holds the newest (or ``step``),
    else the url's (``load.resume``, which sees the tier's commits), from one scan of the
    url; None on a fresh run."""
    history = None
    if tier is not None:
        history, got = restore_from_memory(t, catalog, tier, step, strict=strict, parts=parts)
        if got is not None:
            return got
    return resume(
        t,
        catalog,
        resume_from,
        step,
        strict=strict,
        parts=parts,
        elastic=elastic,
        history=history,
    )


def restore_from_memory(
    t: LoadTargets,
    catalog: Catalog,
    tier: MemoryTier,
    step: int | None,
    *,
    strict: bool,
    parts: tuple[str, ...],
) -> tuple[History, Loaded | None]:
    """Load the newest step of the run from memory when the tier has it. Returns the run's
    history across both tiers (the url's load sees the tier's commits in it), and what was
    loaded (None: the url's turn)."""
    t0 = time.perf_counter()
    since = handled()  # (an interrupt is never a reason to take the next source)
    group, rank, world = t.group, coll.rank(), coll.world_size()
    scan, records = coll.on_rank0(lambda: (catalog.scan(), catalog.records.gens), group)
    why_not = tier.readable()
    # Its own part and the replicas it holds (ranks of a node may share a directory: the
    # other ranks' own parts there are theirs to report).
    try:
        found = [] if why_not is not None else tier.parts()
    except OSError as e:
        found, why_not = [], f"{tier.run_dir}: {e}"
    mine = [p for p in found if p.copy or p.rank == rank]
    for p in mine:  # damage, as a url's step that fails its checks: said, never loaded
        if p.problem is not None and not p.newer:
            _log.warning(
                "memory tier: rank %d's %s of step %d is not used: %s (the next complete "
                "memory save drops it)",
                p.rank,
                "replica" if p.copy else "part",
                p.step,
                p.problem,
            )
    held = [_held(p) for p in mine if p.manifest]
    newer = sorted({p.step for p in mine if p.newer})
    flat = FlatState.build(t.model, None, {}, rank=rank)
    layout = (layout_digest(flat.sd), model_digest(flat.sd))
    gathered = coll.all_gather((held, layout, why_not, newer), group)
    if rank == 0:
        for r, (_, _, why, _) in enumerate(gathered):
            if why is not None:
                _log.warning("the memory tier of rank %d is not read: %s", r, why)
    newer = sorted({s for g in gathered for s in g[3]})
    refuse_newer(tier.run_dir, "memory-tier step(s)", newer, step, _UPGRADE)
    node = tier.node_size(world)
    by_save = _complete(gathered, world, node, tier.url)
    commits = {key: _commit(key, gathered) for key in by_save}
    # Steps of another model are commits of the run too: a load past them retires them (only
    # a load of the model can tell: without one, every step's model differs from none).
    sees_model = t.model is not None and "model" in parts
    other = _complete(gathered, world, node, tier.url, other=True) if sees_model else {}
    others = [_commit(k, gathered) for k in other]
    history = History.of(scan, [*commits.values(), *others], records)
    history.refuse_newer(catalog.storage.url, step)
    choice = _choose(scan, commits, step)
    if strict:
        _refuse_other_model(tier, scan, others, -1 if choice is None else choice[0], step)
    if choice is None:
        return history, None
    chosen, save = choice
    sources = by_save[chosen, save]
    for slot in sources:  # its own part first, then copies by holder
        slot.sort(key=lambda hc: (hc[1], hc[0]))
    cur = [0] * world
    decided = time.perf_counter() - t0
    storage = Storage(tier.run_dir)
    rel = own_dirname(chosen, rank)
    where = os.path.join(tier.run_dir, rel)
    while True:
        problem = _fetch(tier, chosen, save, sources, cur, group)
        checked = check_part(storage, rel, chosen, save, since) if problem is None else problem
        problems = coll.all_gather(checked if isinstance(checked, str) else None, group)
        if _advance(problems, sources, cur, chosen, "memory tier"):
            continue
        if any(c >= len(s) for c, s in zip(cur, sources, strict=True)):
            return _to_storage(history, chosen, "no rank has a whole copy of some rank's part")
        assert not isinstance(checked, str)
        m, md = checked
        asked = step is not None
        d = history.decision(chosen, m, md, rel, source="memory", skipped=[], asked=asked)
        out = attempt(t, storage, d, where, strict, parts, alone=True)
        if not out.failures:
            break
        if out.mismatch:  # the url's copy of this step would not fit either: raised, as there
            undo(t, out.rollback)
            raise refusal(t, out, d, where, parts)
        undo(t, out.rollback, again=out.corrupt)  # (a copy elsewhere copies into the same buffers)
        failed = {r: f.message for r, f in out.failures.items()}
        if not out.corrupt:
            why = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
            return _to_storage(history, chosen, why)
        _advance([failed.get(r) for r in range(world)], sources, cur, chosen, "memory tier")
        if any(c >= len(s) for c, s in zip(cur, sources, strict=True)):
            return _to_storage(history, chosen, "no rank has a whole copy of some rank's part")
    holder, _ = sources[rank][cur[rank]]
    where_from = "memory" if holder == rank else "peer"
    tier.complete_steps.add(chosen)  # kept by retention as a step complete on every rank
    return history, loaded(t, out, d, where, where_from, t0, decided)


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
        p.meta("model"),
        p.meta("url"),
        p.meta("save"),
        m.gen or 0,
        [(int(a), int(b)) for a, b in m.retires],
        _base(p.meta("base")),
    )


def _base(v: Any) -> tuple[int, int, str | None] | None:
    """A part's ``base`` as written (a JSON list), or None when it is not one."""
    ok = isinstance(v, list) and len(v) == 3 and all(type(x) is int for x in v[:2])
    return (v[0], v[1], v[2]) if ok and (v[2] is None or isinstance(v[2], str)) else None


def _complete(
    gathered: list[tuple[list[_Held], str, str | None, list[int]]],
    world: int,
    node: int,
    url: str,
    *,
    other: bool = False,
) -> dict[tuple[int, str], list[list[tuple[int, bool]]]]:
    """The tier's complete steps: for each (step, save) of which every rank's part is held
    somewhere (saved at this world size and ``node_size``, by a rank whose tensors lay out
    as that rank's do now), where each part is: (holder, copy). Parts of one step written by
    two saves (after a restart or a rewind) never mix. ``other``: instead the steps whose
    parts were saved by another model than this rank's now (``model_digest``)."""
    if len(gathered) != world:
        return {}
    layouts = [g[1][0] for g in gathered]
    models = [g[1][1] for g in gathered]
    by_save: dict[tuple[int, str], list[list[tuple[int, bool]]]] = {}
    for holder, (held, _, _, _) in enumerate(gathered):
        for h in held:
            ok = (
                h.url == url
                and isinstance(h.save, str)
                and h.world_size == world
                and h.node_size == node
                and 0 <= h.rank < world
                and (
                    h.model is not None and h.model != models[h.rank]
                    if other
                    else h.layout == layouts[h.rank]
                )
            )
            if ok:
                slots = by_save.setdefault((h.step, h.save), [[] for _ in range(world)])
                slots[h.rank].append((holder, h.copy))
    return {k: v for k, v in by_save.items() if all(v)}


def _refuse_other_model(
    tier: MemoryTier, scan: list[StepInfo], others: list[StepInfo], newest: int, step: int | None
) -> None:
    """A strict load raises CheckpointMismatchError (on every rank: all decide alike) when the
    run's newest step is a tier step saved by another model (a param renamed, added or
    resized): its url copy would be refused, and loading an older step would retire it."""
    newest = max([newest, *(i.step for i in scan if i.committed)])
    for o in others:
        if o.committed and o.step > newest and step in (None, o.step):
            where = os.path.join(tier.run_dir, step_dirname(o.step))
            raise CheckpointMismatchError(
                f"{where}: the memory tier's step {o.step}, the newest of the run, was saved by "
                "a model whose parameters differ from this one's (names or shapes); loading an "
                "older step would retire it. Load with the model that saved it, or "
                "load(strict=False) to resume from the newest step this model fits"
            )


def _commit(
    key: tuple[int, str], gathered: list[tuple[list[_Held], str, str | None, list[int]]]
) -> StepInfo:
    """A complete step of the tier as a commit of the run (rank 0's part says its line)."""
    step, save = key
    h = min(
        (h for g in gathered for h in g[0] if (h.step, h.save) == key),
        key=lambda h: (h.rank, h.copy),
    )
    return StepInfo(
        step,
        f"memory:{save}",
        Status.COMMITTED,
        gen=h.gen,
        line=h.line,
        retires=h.retires,
        base=h.base,
    )


def _choose(
    scan: list[StepInfo], commits: dict[tuple[int, str], StepInfo], step: int | None
) -> tuple[int, str] | None:
    """The tier's step to load, and the save that wrote it: the newest live step of the run
    (the tier's on a tie) when the tier holds it; None when the url's turn (rank 0 says why
    at INFO when the tier holds newer steps it does not load)."""
    live = [(k, c) for k, c in commits.items() if c.committed and step in (None, c.step)]
    if not live:
        return None
    newest_url = max((i.step for i in scan if i.committed), default=-1)
    (s, save), _ = max(live, key=lambda kc: (kc[0][0], kc[1].gen or 0))
    if step is None and s < newest_url:
        return None
    unused = sorted({c.step for c in commits.values() if not c.committed and c.step > s})
    if unused and coll.rank() == 0:
        why = "; ".join(sorted({str(c.problem) for c in commits.values() if c.step in unused}))
        _log.info("memory tier: step(s) %s are not loaded: %s", unused, why)
    return s, save


def check_part(
    storage: Storage, rel: str, step: int, save: str, since: BaseException | None
) -> str | tuple[Manifest, Any]:
    """This rank's own part of ``step`` as far as its manifest and sizes tell (the load
    checks every byte): (its manifest, its DCP metadata), or why it cannot be read."""
    where = os.path.join(storage.url, rel)
    try:
        m = part_manifest(storage.read_bytes(rel, MANIFEST), where)
        if m.step != step or m.extra["memory"].get("save") != save:
            return f"{where} is another save's part than the one chosen"
        return m, check_files(storage, (rel,), m, tiles=False)
    except (CheckpointError, OSError) as e:
        raise_interrupt(e, since)
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
    nothing; ``check_part`` then looks at its own part)."""
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


def _to_storage(history: History, step: int, why: str) -> tuple[History, Loaded | None]:
    if coll.rank() == 0:
        _log.warning(
            "memory tier: step %d cannot be loaded from host memory (%s); loading from storage",
            step,
            why,
        )
    return history, None
