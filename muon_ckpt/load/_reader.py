"""The load path's one DCP reader: every byte it hands on is checked against the manifest.

Used by the manager's ``load`` and, in one process, by import, export and inspect (through
``CheckpointReader``). How files are read depends on where they are:

* local files (``_local_files``): the files this rank needs, cut into parts (``_split``), are
  tasks on ``io_threads`` threads; items are parsed (torch's zip reader, a restricted
  unpickler) and their tensor bytes read with ``pread`` straight into the targets (through
  page-locked chunk buffers for CUDA targets), with no ``torch.load``. A file is checksummed
  on the way when this reader checks it whole (below): each part its window of whole chunks,
  in order;
* remote files with ``verify="checksum"`` (``_remote_files``): a file read completely is streamed
  front to back, chaining the checksum, each stored blob handed to DCP as it arrives; a file
  needed only in part is read by slices;
* remote files with ``verify="size"``: ranged reads of the items, file by file in parallel
  (sizes were checked when the step was chosen).

Which files a rank checks whole: the ones it owns (the rank that wrote it, modulo this world
size) and, with ``check_unread``, the owned files it does not read at all. So on N ranks every
file is checked by some rank; a file is checked at most once per reader. A corrupt file fails
the load with a CheckpointCorruptError naming it.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import re
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

import muon_ckpt._collective as coll
from muon_ckpt._errors import CheckpointCorruptError
from muon_ckpt._tensors import local_tensor, overlapping
from muon_ckpt._threads import run_all
from muon_ckpt.load._chunk_spans import corrupt_chunk
from muon_ckpt.load._corruption import parsing, prefer_corruption
from muon_ckpt.load._declared import StoredChunks
from muon_ckpt.load._local_files import FileLoad
from muon_ckpt.load._planner import unchanged
from muon_ckpt.load._read_buffers import PHASES, ReadBuffers
from muon_ckpt.load._read_once import agree, distribute, plan_shared
from muon_ckpt.load._remote_files import ServingFileSystem, read_remote
from muon_ckpt.store import FileEntry, Storage
from muon_ckpt.store.checksums import Checksum, chunk_span, file_checksum, mismatched_chunks

__all__ = ["VerifyingReader"]

_RANK_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")

# The size parts of a file aim at (``_split``), at least: far above the cost of a task (an
# open, a few small reads of zip records) and of the chunk two neighbours may share. A load
# aims higher where that leaves more than about 4 parts per reading thread; a file's last
# part may be half of it, and an item is never cut, so one large item makes a larger part.
PART_BYTES = 32 << 20


class VerifyingReader(FileSystemReader):
    """DCP reader for one checkpoint directory ``step`` (a Storage rooted there).

    ``files``: the manifest's files (None for a plain DCP directory: nothing to check against).
    ``metadata``: the DCP metadata, already read and checked by the caller.
    """

    def __init__(
        self,
        step: Storage,
        files: dict[str, FileEntry] | None,
        *,
        metadata: Any,
        rank: int = 0,
        world_size: int = 1,
        io_threads: int = 4,
        verify_crc: bool = True,
        check_unread: bool = True,
        group: Any = None,
    ) -> None:
        super().__init__(step.root)
        self.fs = ServingFileSystem(step)
        self.path = self.fs.init_path(step.root)
        self.step = step
        self._files = files
        self._metadata = metadata
        self._rank, self._world = rank, world_size
        self.threads = io_threads
        self._verify_crc = verify_crc and files is not None
        self._check_unread = check_unread
        self._checked: set[str] = set()
        self._lock = threading.Lock()
        self._verdict_lock = threading.Lock()
        self._verdicts: dict[str, BaseException | None] = {}
        self._group = group  # with world_size > 1: shared items are read once (_shared)
        self.chunks = StoredChunks(metadata)  # what the metadata declares for each stored chunk
        self.captures: dict[str, dict[int, memoryview]] = {}  # read here for other ranks
        self.timings: dict[str, float] = {}  # "read": wall time of read_data
        self.phases: dict[str, float] = {}  # local reads: thread-seconds per PHASES entry
        self.bytes_read = 0  # bytes this reader read from storage
        self.shared_bytes = 0  # bytes of stored items read once for several ranks (all ranks)
        self._shared_targets: frozenset[str] = frozenset()  # (set per local read)

    # FileSystemReader's local and global steps, but ours: a KeyedPlan's round trip needs them
    prepare_local_plan = prepare_global_plan = unchanged  # (SafeLoadPlanner's _identity)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        # Already read (and checked) by the caller: no second round trip.
        md = dataclasses.replace(self._metadata)
        if md.storage_meta is not None:
            md.storage_meta = dataclasses.replace(md.storage_meta, load_id=self.load_id)
        return md

    # ------------------------------------------------------------------ checks
    def where(self, name: str) -> str:
        return self.step.url_of(name)

    def entry(self, name: str) -> FileEntry | None:
        """The manifest's entry for ``name`` (None without a manifest); a file the manifest
        does not list is an error."""
        if self._files is None:
            return None
        want = self._files.get(name)
        if want is None:
            raise CheckpointCorruptError(
                f"{self.where(name)}: the DCP metadata refers to this file but the manifest "
                "does not list it; the step was not written by one save. Load another step"
            )
        return want

    def owner(self, name: str) -> int:
        """The rank that checks file ``name`` whole: the rank that wrote it, modulo this world
        size (a file not named by rank: its place among the files, modulo world size)."""
        m = _RANK_FILE_RE.match(name.rsplit("/", 1)[-1])  # (a data file: ../data/<dir>/__r_k)
        if m:
            return int(m.group(1)) % self._world
        names = sorted(self._files if self._files is not None else {name})
        return names.index(name) % self._world if name in names else 0

    def to_check(self, read: set[str]) -> set[str]:
        """The files this reader checksums whole (and marks as checked): owned ones, among
        those it reads unless ``check_unread``."""
        if not self._verify_crc or self._files is None:
            return set()
        owned = {n for n in self._files if self.owner(n) == self._rank}
        if not self._check_unread:
            owned &= read
        with self._lock:
            todo = owned - self._checked
            self._checked |= todo
        return todo

    def checksum(self, name: str) -> Checksum:
        """A running checksum computed the way the manifest's entry for ``name`` was."""
        want = self.entry(name)
        if want is None:
            raise AssertionError(f"{name}: no manifest entry to check against")
        return Checksum.like(want, self.where(name))

    def check(self, name: str, got: Checksum) -> None:
        want = self.entry(name)
        if want is not None and (got.size != want.size or got.hexdigest() != want.digest):
            what = want.algorithm if want.chunk_bytes is None else f"{want.algorithm} per chunk"
            raise CheckpointCorruptError(
                f"{self.where(name)}: file is corrupt: {got.size} bytes with {what} "
                f"{_brief(got.hexdigest())}, the manifest says {want.size} bytes with "
                f"{_brief(want.digest)}. Load another step (muon-ckpt ls lists them) or "
                "restore this file"
            )

    def count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def fetch_and_check(self, name: str) -> None:
        """Read ``name`` whole only to check its size and checksums."""
        want = self.entry(name)
        if want is None:
            return
        with self.step.open(name, ahead=[(0, want.size)]) as f:
            got = file_checksum(f, want, where=self.where(name))
        self.count(got.size)
        self.check(name, got)

    def verdict(self, name: str) -> BaseException | None:
        """The corruption of ``name`` if its checksum finds one (for ``prefer_corruption``);
        found once per file however many of its parts fail."""
        if not self._verify_crc:
            return None
        with self._verdict_lock:
            if name not in self._verdicts:
                try:
                    self.fetch_and_check(name)
                    self._verdicts[name] = None
                except CheckpointCorruptError as e:
                    self._verdicts[name] = e
            return self._verdicts[name]

    def window_verdict(self, name: str, window: tuple[int, int]) -> BaseException | None:
        """``verdict`` for the chunks of ``name`` in ``window`` only (one part of a file)."""
        entry = self.entry(name)
        if entry is None:
            return None
        with self.step.open(name) as f:
            got = file_checksum(f, entry, where=self.where(name), span=window)
        self.count(got.size)
        bad = mismatched_chunks(entry, window[0], got)
        return corrupt_chunk(entry, bad[0], self.where(name)) if bad else None

    # ------------------------------------------------------------------ reading
    def read_data(self, plan: Any, planner: Any) -> torch.futures.Future[None]:
        t0 = time.perf_counter()
        share = None
        if self._group is not None and self._world > 1:
            share = plan_shared(
                plan.items,
                self.storage_data,
                self.chunks.whole,
                self.owner,
                self._rank,
                self._group,
            )
            plan = dataclasses.replace(plan, items=share.items)
            self.captures, self.shared_bytes = share.captures, share.shared_bytes
        error = None
        try:
            if self.step.is_local:
                self._read_local(plan, planner)
            else:
                read_remote(self, plan, planner, stream=self._verify_crc)
        except BaseException as e:
            if share is None:
                raise
            error = e
        finally:
            self.captures = {}
            coll.arrive("DCP's gather of the reads")  # (names a rank that never gets there)
        t1 = time.perf_counter()
        if share is not None:
            agree(error, self._rank, self._group)
            distribute(
                share, planner, self.where, self.chunks, self._rank, self._world, self._group
            )
        self.timings = {"read": t1 - t0, "share": time.perf_counter() - t1}
        self.timings.update({f"threads_{k}": v for k, v in self.phases.items()})
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _read_local(self, plan: Any, planner: Any) -> None:
        """Parts of files as tasks on ``threads`` threads (``_local_files``): the items this rank
        needs go straight into their targets, a file to check is checksummed on the way (one
        that is not read, only checksummed). Files are split into parts (``_split``), so that
        the threads share the work however few and uneven the files are; a checked file is
        then checked window by window against the manifest's per-chunk checksums. A file
        whose manifest has one checksum for all of it (format 1) is one task. (No item needs
        DCP's own reader: the metadata's check refuses storage transforms.)"""
        self._shared_targets = _shared_targets(planner, plan.items)
        per_file: dict[str, dict[int, tuple[int, list[Any]]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            slot = per_file.setdefault(info.relative_path, {})
            slot.setdefault(info.offset, (info.length, []))[1].append(item)
        captures = self.captures
        check = self.to_check(set(per_file) | set(captures))
        names = sorted(set(per_file) | set(captures) | check)
        work = sum(e.size for n in names if (e := self.entry(n)) is not None)
        part_bytes = max(PART_BYTES, -(-work // (4 * self.threads)))
        local = threading.local()
        made: list[ReadBuffers] = []

        def buffers() -> ReadBuffers:  # one set per thread, reused by all its parts
            if not hasattr(local, "buffers"):
                local.buffers = ReadBuffers()
                made.append(local.buffers)
            return local.buffers

        tasks: list[tuple[int, Callable[[], None]]] = []
        for name in names:
            loads, caps, verify = per_file.get(name, {}), captures.get(name, {}), name in check
            entry = self.entry(name)
            size = entry.size if entry is not None else 0
            if verify and (entry is None or entry.chunk_bytes is None):
                tasks.append((size, partial(self._whole_file, name, planner, loads, caps)))
            else:
                for offs, window, n in _split(loads, caps, entry if verify else None, part_bytes):
                    part = {o: loads[o] for o in offs if o in loads}
                    cap = {o: caps[o] for o in offs if o in caps}
                    run = partial(self._load_file, name, part, planner, verify, cap)
                    tasks.append((n, lambda run=run, window=window: run(buffers(), window)))
        tasks.sort(key=lambda t: -t[0])  # largest first: even finish
        try:
            run_all(self.threads, lambda task: task[1](), tasks)
        finally:
            for b in made:
                b.release()
            self.phases = {k: sum(b.phases[k] for b in made) for k in PHASES}  # thread-seconds

    def _whole_file(
        self,
        name: str,
        planner: Any,
        loads: dict[int, tuple[int, list[Any]]],
        caps: dict[int, memoryview],
    ) -> None:
        """A file to check whose manifest has one checksum for all of it: front to back."""
        if loads or caps:
            self._load_file(name, loads, planner, True, caps)
        else:
            self.fetch_and_check(name)

    def _load_file(
        self,
        name: str,
        items: dict[int, tuple[int, list[Any]]],
        planner: Any,
        verify: bool,
        capture: dict[int, memoryview] | None = None,
        buffers: ReadBuffers | None = None,
        window: tuple[int, int] | None = None,
    ) -> None:
        """``items`` of file ``name``; with ``verify``, checksums the whole file on the way, or
        with ``window``, its bytes ``[lo, hi)`` (whole chunks around the items)."""
        where, entry = self.where(name), self.entry(name)
        whole = None
        if verify:
            whole = (
                self.checksum(name) if window is None else Checksum.like(entry, where, window[0])
            )
        # Otherwise (another rank checks it whole) only the parts read, by chunk.
        part = entry if self._verify_crc and not verify else None
        path = self.step.path(name)
        load = FileLoad(
            path,
            where,
            planner,
            whole,
            part,
            chunks=self.chunks,
            window=window,
            buffers=buffers,
            shared=self._shared_targets,
        )

        hint = (
            ""
            if self._verify_crc
            else '. If the file is damaged, load another step; verify="checksum" '
            "(the default) checks every byte of it"
        )

        def run() -> Checksum | None:
            return parsing(partial(load.run, items, capture), where, hint)

        # A damaged item often fails to parse before the checksum is known: the corruption
        # is then looked for in this part's window (in the whole file without one).
        if window is None:
            find = partial(self.verdict, name)
        else:
            find = partial(self.window_verdict, name, window)
        try:
            got = prefer_corruption(run, find)
        finally:
            self.count(load.bytes_read)
        if got is None or entry is None:
            return
        if window is None:
            self.check(name, got)
            return
        lo, hi = window
        if hi == entry.size and load.file_size != entry.size:
            raise CheckpointCorruptError(
                f"{where}: file is corrupt: it has {load.file_size} bytes, the manifest says "
                f"{entry.size}. Load another step (muon-ckpt ls lists them) or restore this file"
            )
        if got.size != hi - lo:
            raise AssertionError(f"{where}: checksummed {got.size} bytes of window {lo}-{hi}")
        bad = mismatched_chunks(entry, lo, got)
        if bad:
            raise corrupt_chunk(entry, bad[0], where)


def _shared_targets(planner: Any, items: list[Any]) -> frozenset[str]:
    """The keys of this plan's host targets whose memory overlaps another's (tied weights, a
    buffer that is a view of another): ``FileLoad`` does not read into those directly."""
    sd = getattr(planner, "state_dict", None) or {}
    host = {}
    for fqn in {item.dest_index.fqn for item in items}:
        v = sd.get(fqn)
        if isinstance(v, torch.Tensor) and local_tensor(v).device.type == "cpu":
            host[fqn] = local_tensor(v)
    return frozenset(overlapping(host))


def _split(
    loads: dict[int, tuple[int, list[Any]]],
    caps: dict[int, memoryview],
    entry: FileEntry | None,
    part_bytes: int,
) -> list[tuple[list[int], tuple[int, int] | None, int]]:
    """A file's work in parts of about ``part_bytes``: (the offsets of its stored items, the
    bytes to check or None, its size). Without ``entry`` (nothing to check whole) the items
    are grouped. With ``entry`` (a chunked manifest entry: the file is checked whole) a part
    starts at an item's first byte or at a chunk start between items, never inside an item,
    and checks the whole chunks from the one its first byte is in to the one its last byte is
    in: the windows cover the file, neighbours share at most the chunk at their border, and
    every byte a part loads is checked by that part."""
    spans = sorted((o, loads[o][0] if o in loads else len(caps[o])) for o in {*loads, *caps})
    parts: list[tuple[list[int], tuple[int, int] | None, int]] = []
    if entry is None:
        cur: list[int] = []
        acc = 0
        for off, n in spans:
            if cur and acc + n > part_bytes:
                parts.append((cur, None, acc))
                cur, acc = [], 0
            cur.append(off)
            acc += n
        if cur:
            parts.append((cur, None, acc))
        return parts
    size = entry.size
    cands = {off for off, _ in spans}
    j = 0
    for s in entry.chunk_starts():  # chunk starts outside every item
        while j < len(spans) and spans[j][0] + spans[j][1] <= s:
            j += 1
        if j == len(spans) or s <= spans[j][0]:
            cands.add(s)
    bounds = [0]
    for c in sorted(cands):
        if c - bounds[-1] >= part_bytes and size - c >= part_bytes // 2:
            bounds.append(c)
    owned: list[list[int]] = [[] for _ in bounds]
    for off, _ in spans:  # (an item at or past the end: the last part, which says so)
        owned[bisect.bisect_right(bounds, off) - 1].append(off)
    edges = [*bounds, size]
    for k, (b, e) in enumerate(itertools.pairwise(edges)):
        lo = chunk_span(entry, b, b + 1)[0] if k else 0
        hi = chunk_span(entry, e - 1, e)[1] if e < size else size
        parts.append((owned[k], (lo, hi), hi - lo))
    return parts


def _brief(digest: str) -> str:
    return digest if len(digest) <= 24 else f"{digest[:16]}...({len(digest) // 8} chunks)"
