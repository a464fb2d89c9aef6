"""The memory tier of one manager: which steps go there, the background job that writes a
step's parts and replicates them, retention, and what this rank holds.

Replicas: rank ``r``'s part goes to ``r + k * node_size`` (mod the world size) for ``k`` in
``1..replicas``, skipping ranks on ``r``'s own node (a node is ``node_size`` consecutive
ranks): with two nodes and one replica, each rank's twin on the other node holds its copy.

A memory save never counts as persisted and never touches persistent storage. Its job, on
every rank: write this rank's own part (unless the tier's directory lacks the room or the
budget: skipped with a WARNING), offer it to the ranks that hold its replicas and take the
parts of the ranks whose replicas it holds (``_parts``: the same transfers in the same order
on every rank), then agree (one all-gather) on which ranks' parts are complete. Only once a
step is complete on every rank does retention drop older steps: a process killed while
writing step ``s`` leaves step ``s - 1`` whole; while a complete step lacks some replica,
the newest step that has them all is kept too; steps of another line (a rewind, another run
in the same url) are dropped. Every part of one save carries its id (rank 0 draws it): a step
saved twice never loads from parts of both saves."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import muon_ckpt._collective as coll
from muon_ckpt._config import MemoryOptions
from muon_ckpt._interrupts import Stop, interrupts_deferred
from muon_ckpt._threads import join, start
from muon_ckpt.memory._dirs import (
    PartInfo,
    copy_dirname,
    default_root,
    list_parts,
    own_dirname,
    run_dirname,
    secure_dir,
    step_dirs,
    unsafe_reason,
    write_run_file,
)
from muon_ckpt.memory._parts import (
    drop_part,
    nbytes_of,
    receive_part,
    send_part,
    write_own_part,
)
from muon_ckpt.state import HostStaging
from muon_ckpt.store import Manifest

__all__ = ["MemoryJob", "MemoryTier"]

_log = logging.getLogger("muon_ckpt")


class MemoryTier:
    """This rank's side of the memory tier of the run at ``url``."""

    def __init__(self, opts: MemoryOptions, url: str, budget: int | None) -> None:
        self.opts = opts
        self.url = url
        self.root = opts.dir or default_root()
        self.run_dir = os.path.join(self.root, run_dirname(url))
        self._budget = budget
        self._made = False
        self.skipped = 0  # memory saves skipped (one still running, no room, over budget)
        self.failed = 0  # memory saves that failed on this rank (WARNING each)
        self.last_complete: int | None = None  # newest step complete on every rank, by a job
        # Steps known complete on every rank (a job agreed, or a load read them): retention
        # keeps the newest of these; and the newest whose replicas all arrived.
        self.complete_steps: set[int] = set()
        self.replicated: int | None = None
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ where
    def check_root(self) -> None:
        """The tier's root, made 0700 or checked to be this user's own and private
        (CheckpointError otherwise: a configuration to fix before training)."""
        secure_dir(self.root)

    def ensure_dirs(self) -> None:
        """The run's directory too (CheckpointError when it is not this user's own), checked
        at every save: a directory removed and made again by someone else is never used."""
        secure_dir(self.root)
        secure_dir(self.run_dir)
        if not self._made:
            write_run_file(self.run_dir, self.url)
            self._made = True

    def readable(self) -> str | None:
        """Why this rank must not read its tier (another user's, open to others), or None."""
        for path in (self.root, self.run_dir):
            why = unsafe_reason(path)
            if why is not None:
                return why
        return None

    def due(self, step: int) -> bool:
        return step % self.opts.interval == 0

    def node_size(self, world: int) -> int:
        n = self.opts.node_size
        if n is None:
            local = os.environ.get("LOCAL_WORLD_SIZE", "")
            n = int(local) if local.isdigit() and int(local) > 0 else world
        return max(1, min(n, world))

    def holders(self, rank: int, world: int) -> list[int]:
        """The ranks that hold replicas of ``rank``'s part, in order."""
        node = self.node_size(world)
        out: list[int] = []
        for k in range(1, self.opts.replicas + 1):
            h = (rank + k * node) % world
            if h // node != rank // node and h not in out:
                out.append(h)
        return out

    def warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _log.warning(msg, *args)

    # ------------------------------------------------------------------ what is here
    def parts(self) -> list[PartInfo]:
        return list_parts(self.run_dir)

    def held_bytes(self, steps: set[int], rank: int, world: int) -> int:
        """Bytes of ``rank``'s parts of ``steps`` here: its own and the copies it holds
        (the node's other ranks may keep theirs in the same directory)."""
        total = 0
        for p in self.parts():
            mine = rank in self.holders(p.rank, world) if p.copy else p.rank == rank
            if p.step in steps and p.manifest is not None and mine:
                total += p.manifest.total_bytes
        return total

    def room_problem(self, need: int, keep_steps: set[int], rank: int, world: int) -> str | None:
        """Why ``need`` more bytes on ``rank`` do not fit here: free space for as much on
        each rank of its node (they write at the same time, and usually to one file system),
        or ``max_staging_bytes`` for this rank."""
        try:
            st = os.statvfs(self.run_dir)
        except OSError as e:
            return f"{self.run_dir}: {e}"
        free = st.f_bavail * st.f_frsize
        margin = 64 << 20  # leave the node something
        ranks = self.node_size(world)
        if need * ranks + margin > free:
            return (
                f"{self.run_dir} has {free / 2**20:.0f} MiB free, the {ranks} rank(s) of this "
                f"node need about {need * ranks / 2**20:.0f} MiB (and 64 MiB spare): "
                f"{(need * ranks + margin - free) / 2**20:.0f} MiB short"
            )
        if self._budget is not None:
            held = self.held_bytes(keep_steps, rank, world)
            if held + need > self._budget:
                return (
                    f"the memory tier would hold {(held + need) / 2**20:.0f} MiB on this rank, "
                    f"more than max_staging_bytes={self._budget}"
                )
        return None

    def kept_steps_after(self, step: int) -> set[int]:
        """The older steps retention keeps beside ``step`` (``keep - 1`` of them, and the
        newest fully replicated one)."""
        older = sorted((s for s in self.complete_steps if s < step), reverse=True)
        kept = set(older[: self.opts.keep - 1])
        if self.replicated is not None and self.replicated < step:
            kept.add(self.replicated)
        return kept

    def retain(self, step: int, line: str | None, replicated: bool) -> None:
        """``step`` is complete on every rank (``replicated``: its replicas too): keep it,
        the ``keep - 1`` newest older complete steps of its line and, while ``step``'s
        replicas are not all there, the newest step whose replicas were; drop every other
        step here (older ones, incomplete ones, other lines', newer leftovers)."""
        self.complete_steps.add(step)
        if replicated:
            self.replicated = step
        # By line, not by the parts' ``retires`` as the url's retention goes: a step of another
        # line here is one a later line retired, or another run's, which no ``retires`` names.
        lines: dict[int, set[str | None]] = {}
        for p in self.parts():
            if p.manifest is not None:
                lines.setdefault(p.step, set()).add(p.manifest.line)
        ours = sorted(
            (s for s in self.complete_steps if s <= step and lines.get(s) == {line}),
            reverse=True,
        )
        keep = set(ours[: self.opts.keep])
        if self.replicated is not None and lines.get(self.replicated) == {line}:
            keep.add(self.replicated)
        else:
            self.replicated = None
        self.complete_steps &= keep
        for s, path in step_dirs(self.run_dir).items():
            if s not in keep:
                _drop_step(path)

    def clear(self) -> None:
        """Remove this run's memory tier on this rank."""
        if os.path.isdir(self.run_dir) and self.readable() is None:
            for path in step_dirs(self.run_dir).values():
                _drop_step(path)
            shutil.rmtree(self.run_dir, ignore_errors=True)
        self._made = False
        self.complete_steps.clear()
        self.replicated = None


def _drop_step(path: str) -> None:
    """A step's directory, each part's manifest first (the node's other ranks may be
    dropping it too: what is gone already is skipped)."""
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in names:
        drop_part(os.path.join(path, name))
    shutil.rmtree(path, ignore_errors=True)


@dataclasses.dataclass
class MemoryWrite:
    """What one memory save writes on this rank."""

    step: int
    sd: dict[str, Any]
    staging: HostStaging
    line: str | None
    gen: int  # the commit's generation and what it retires, as a url commit's (store._lines)
    retires: list[tuple[int, int]]
    base: tuple[int, int, str | None] | None  # the url's newest commit then (store._lines)
    save_id: str  # the same on every rank, new at every memory save
    world_size: int
    rank: int
    layout: tuple[str, str]  # layout_digest and model_digest of this rank's state
    extra: dict[str, Any]  # the manifest's extra (the optimizer's type)
    io_threads: int
    group: Any
    digests: bool = False  # each tensor's SHA-256 recorded (the flush refers by them)
    before_commit: Callable[[], None] | None = None
    owns_staging: bool = True  # the snapshot is this save's alone: its copies end here
    gate: threading.Event | None = None  # tests: the job starts once this is set
    # The url's admission, left to the job (rank 0 runs it first): its plan is recorded
    recheck: Callable[[], Any] | None = None
    timings: dict[str, float] = dataclasses.field(default_factory=dict)


class MemoryJob:
    """One memory save's write, replication and agreement, in a background thread;
    ``finish`` (the snapshot's release) runs in the caller's thread, at ``wait()``. Ctrl-C
    (``stop``) starts no new file of this rank's part; the replication runs to its end."""

    def __init__(self, tier: MemoryTier, w: MemoryWrite, finish: Callable[[], None]) -> None:
        self.tier, self.w = tier, w
        self.step = w.step
        self._finish: Callable[[], None] | None = finish
        self._ended = threading.Event()
        self._written = threading.Event()  # the snapshot is no longer read
        self.complete = False  # every rank's own part was written (this job's agreement)
        self.stopped = Stop()
        self._thread = threading.Thread(
            target=self._run, name=f"muon_ckpt-memory-{w.step}", daemon=False
        )

    def start(self) -> None:
        start(self._thread)

    def stop(self) -> None:
        self.stopped.set()

    def done(self) -> bool:
        return self._ended.is_set()

    def wait_written(self) -> None:
        """Until this rank's part is written (or given up): the snapshot is free again. Ctrl-C
        meanwhile stops the part (``stop``) and is raised once it no longer reads."""
        with interrupts_deferred(self.stop):
            self._written.wait()

    def wait(self) -> int:
        """Until the job has ended (Ctrl-C: still held), then its release (Ctrl-C deferred)."""
        self._ended.wait()
        with interrupts_deferred():
            join(self._thread)
            finish, self._finish = self._finish, None
            if finish is not None:
                finish()
        return self.step

    def _run(self) -> None:
        try:
            self._work()
        except BaseException as e:  # a peer gone, a timeout: the step is not complete
            self.tier.failed += 1
            _log.warning(
                "keeping step %d in host memory failed on rank %d: %s: %s",
                self.step,
                self.w.rank,
                type(e).__name__,
                e,
            )
        finally:
            self._written.set()
            self._ended.set()

    def _work(self) -> None:
        w, tier = self.w, self.tier
        if w.gate is not None:
            w.gate.wait()
        t0 = time.perf_counter()
        try:
            if w.recheck is not None:  # (a collective: every rank's job is here)
                plan = coll.on_rank0(w.recheck, w.group)
                w.gen, w.retires, w.base = plan.gen, list(plan.retires), plan.base
            own = self._write_own()
        finally:
            if w.owns_staging:
                w.staging.finish()
            self._written.set()
        t1 = time.perf_counter()
        taken = self._replicate(own)
        t2 = time.perf_counter()
        outcome = coll.all_gather((own is not None, taken), w.group)
        self.complete = all(ok for ok, _ in outcome)
        if self.complete:
            held = {(src, h) for h, (_, srcs) in enumerate(outcome) for src in srcs}
            want = {(r, h) for r in range(w.world_size) for h in tier.holders(r, w.world_size)}
            replicated = want <= held
            if not replicated and w.rank == 0:
                _log.warning(
                    "step %d is in host memory on every rank, but %d of its %d replica(s) did "
                    "not arrive: the newest step with all its replicas is kept beside it",
                    w.step,
                    len(want - held),
                    len(want),
                )
            tier.last_complete = w.step
            tier.retain(w.step, w.line, replicated)
        w.timings.update(memory_write=t1 - t0, replicate=t2 - t1)

    def _write_own(self) -> str | None:
        """This rank's part, or None (WARNING) when it has no room or could not be written."""
        w, tier = self.w, self.tier
        rel = own_dirname(w.step, w.rank)
        need = nbytes_of(w.sd)
        copies = sum(1 for r in range(w.world_size) if w.rank in tier.holders(r, w.world_size))
        try:
            tier.ensure_dirs()
            drop_part(os.path.join(tier.run_dir, rel))  # an earlier save's, never mixed in
            kept = tier.kept_steps_after(w.step)
            why = tier.room_problem(need * (1 + copies), kept, w.rank, w.world_size)
        except Exception as e:  # (a directory another user owns, or others may read)
            why = f"{type(e).__name__}: {e}"
        if why is not None:
            tier.skipped += 1
            _log.warning("step %d is not kept in host memory on rank %d: %s", w.step, w.rank, why)
            return None
        try:
            write_own_part(
                tier.run_dir,
                rel,
                w.step,
                w.sd,
                w.staging,
                world_size=w.world_size,
                line=w.line,
                gen=w.gen,
                retires=w.retires,
                memory={
                    "url": tier.url,
                    "save": w.save_id,
                    "rank": w.rank,
                    "node_size": tier.node_size(w.world_size),
                    "layout": w.layout[0],
                    "model": w.layout[1],
                    "base": w.base,
                },
                extra=w.extra,
                io_threads=w.io_threads,
                digests=w.digests,
                before_commit=w.before_commit,
                stop=self.stopped,
            )
        except Exception as e:
            tier.failed += 1
            drop_part(os.path.join(tier.run_dir, rel))
            _log.warning(
                "step %d is not kept in host memory on rank %d: %s: %s",
                w.step,
                w.rank,
                type(e).__name__,
                e,
            )
            return None
        return os.path.join(tier.run_dir, rel)

    def _replicate(self, own: str | None) -> list[int]:
        """Every rank's transfers, in one order: ``rank -> its k-th holder``, for each ``k``
        then each rank. Returns the ranks whose copies this rank now holds."""
        w, tier = self.w, self.tier
        world = w.world_size
        taken = []
        for k in range(tier.opts.replicas):
            for src in range(world):
                holders = tier.holders(src, world)
                if k >= len(holders):
                    continue
                dst = holders[k]
                if src == w.rank:
                    send_part(own, dst, w.group)
                elif dst == w.rank:
                    m, why = receive_part(
                        tier.run_dir,
                        copy_dirname(w.step, src),
                        src,
                        w.group,
                        expect=lambda m, src=src: _expected(m, w, src, tier),
                    )
                    if m is not None:
                        taken.append(src)
                    elif why is not None:
                        _log.warning(
                            "rank %d does not keep rank %d's replica of step %d: %s",
                            w.rank,
                            src,
                            w.step,
                            why,
                        )
        return taken


def _expected(m: Manifest, w: MemoryWrite, src: int, tier: MemoryTier) -> str | None:
    """Why a replica offered by ``src`` for this save is not taken (None: take it)."""
    mem = m.extra.get("memory", {})
    if m.step != w.step or mem.get("rank") != src or mem.get("save") != w.save_id:
        return f"it is not rank {src}'s part of this save of step {w.step}"
    return tier.room_problem(m.total_bytes, tier.kept_steps_after(w.step), w.rank, w.world_size)
