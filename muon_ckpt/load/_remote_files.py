"""Remote reads of ``VerifyingReader`` (object stores and other non-local fsspec filesystems).

Every stored item is loaded from memory into its targets (``_item_bytes``: its zip records parsed,
its tensor bytes viewed in place and copied), without a ``torch.load`` per item; a compressed
item is expanded by the thread that read it.
With checksums (``stream=True``): a file this rank reads completely is read front to back by a
worker thread, one stored item at a time, chaining the checksum; the calling thread loads each
item as it arrives. A file needed only in part is read item by item with ranged reads, each
widened to whole checksum chunks and checked (format-2 manifests); the files this rank checks
but does not stream are checksummed by workers meanwhile.
Without (``verify="size"``): ranged reads of the items this rank needs, one task per file on
``io_threads`` threads (sizes were checked when the step was chosen).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Protocol

from muon_ckpt._errors import CheckpointCorruptError
from muon_ckpt._threads import pool, run_all, submit_all
from muon_ckpt.load._corruption import prefer_corruption
from muon_ckpt.load._declared import StoredChunks, UntrustedItem
from muon_ckpt.load._item_bytes import Capture, fetch_items, load_blob
from muon_ckpt.store import FileEntry, Storage, data_ref, is_file_name
from muon_ckpt.store.checksums import Checksum
from muon_ckpt.store.dcp import DelegatingFileSystem, dcp_filesystem


class VerifyingReader(Protocol):
    """What a remote read needs of the reader it reads for (``_reader.VerifyingReader``)."""

    step: Storage
    threads: int
    storage_data: Any
    captures: dict[str, dict[int, memoryview]]
    chunks: StoredChunks

    def entry(self, name: str) -> FileEntry | None: ...
    def where(self, name: str) -> str: ...
    def checksum(self, name: str) -> Checksum: ...
    def check(self, name: str, got: Checksum) -> None: ...
    def count(self, n: int) -> None: ...
    def fetch_and_check(self, name: str) -> None: ...
    def to_check(self, read: set[str]) -> set[str]: ...


__all__ = ["ServingFileSystem", "read_remote"]

_Msg = tuple[str, int, "bytes | None", "BaseException | None"]


class ServingFileSystem(DelegatingFileSystem):
    """DCP's filesystem for a remote step (``Storage`` underneath): every item is read by this
    package's readers, but should DCP read a file itself, it goes through ``step.open`` and
    only for files directly inside the step directory or of the run's data (the metadata's
    paths were checked when it was read; this is the second line)."""

    def __init__(self, step: Storage) -> None:
        super().__init__(dcp_filesystem(step))
        self.step = step

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "r" not in mode:
            with self.inner.create_stream(path, mode) as s:
                yield s
            return
        p = os.fspath(path)
        root = self.step.root.rstrip("/")
        name = p[len(root) + 1 :] if p.startswith(root + "/") else ""
        if not (is_file_name(name) or data_ref(name) is not None):
            raise CheckpointCorruptError(
                f"{self.step.url}: refusing to read {p!r}, which is not a file of this "
                "checkpoint's directory"
            )
        with self.step.open(name) as s:
            yield s


def read_remote(r: VerifyingReader, plan: Any, planner: Any, *, stream: bool) -> None:
    # Group the read items by file, and by slice (one stored blob) within the file.
    slices: dict[str, dict[int, list[Any]]] = {}
    lengths: dict[tuple[str, int], int] = {}
    for item in plan.items:
        info = r.storage_data[item.storage_index]
        slices.setdefault(info.relative_path, {}).setdefault(info.offset, []).append(item)
        lengths[(info.relative_path, info.offset)] = info.length
    for name, caps in r.captures.items():  # read here for other ranks (_shared)
        for off, buf in caps.items():
            slices.setdefault(name, {})[off] = Capture(buf)  # type: ignore[assignment]
            lengths[(name, off)] = len(buf)

    def fetch(name: str) -> None:
        items = {off: (lengths[(name, off)], reqs) for off, reqs in slices[name].items()}
        entry = r.entry(name) if stream else None
        r.count(fetch_items(r.step, name, r.where(name), items, planner, entry, r.chunks))

    if not stream:
        run_all(r.threads, fetch, sorted(slices))
        return
    # A file is streamed whole (one read serves the loads and the file's checksum) when its
    # items cover it and this rank checks it whole, or loads every item whole; otherwise its
    # items are read one by one (slices of an item: only their rows), checked by chunk.
    check = r.to_check(set(slices))
    streamed, sliced = [], []
    for name, by_off in sorted(slices.items()):
        pos = 0
        for off in sorted(by_off):
            pos = pos + lengths[(name, off)] if off == pos else -1
        entry = r.entry(name)
        every = all(
            isinstance(reqs, Capture) or all(map(r.chunks.whole, reqs)) for reqs in by_off.values()
        )
        covers = entry is not None and pos == entry.size
        (streamed if covers and (name in check or every) else sliced).append(name)
    only_check = sorted(check - set(streamed))
    with pool(r.threads, "muon_ckpt_read") as ex:
        checks = submit_all(ex, r.fetch_and_check, only_check)

        def read_all() -> None:
            _stream_files(r, ex, streamed, slices, lengths, planner)
            run_all(r.threads, fetch, sliced)

        def found() -> BaseException | None:
            return next(
                (e for c in checks if isinstance(e := c.exception(), CheckpointCorruptError)),
                None,
            )

        prefer_corruption(read_all, found)
        for c in checks:
            c.result()


def _stream_files(
    r: VerifyingReader,
    ex: ThreadPoolExecutor,
    names: list[str],
    slices: dict[str, dict[int, list[Any]]],
    lengths: dict[tuple[str, int], int],
    planner: Any,
) -> None:
    """Files this rank reads completely: worker threads read each file's slices in order
    (chaining the crc32); this thread loads each slice as it arrives. A file whose size or
    crc differs from the manifest raises before this returns."""
    if not names:
        return
    q: queue.Queue[_Msg] = queue.Queue(maxsize=2 * r.threads)
    stop = threading.Event()

    def put(msg: _Msg) -> None:
        while not stop.is_set():
            try:
                q.put(msg, timeout=0.1)
                return
            except queue.Full:
                continue

    def produce(name: str) -> None:
        try:
            got = r.checksum(name)
            entry = r.entry(name)
            bad: UntrustedItem | None = None  # raised once the file's checksum matched
            with r.step.open(name, ahead=[(0, entry.size)] if entry is not None else None) as f:
                for off in sorted(slices[name]):
                    if stop.is_set():
                        return
                    data: Any = f.read(lengths[(name, off)])
                    r.count(len(data))
                    got.update(data)
                    reqs = slices[name][off]
                    if isinstance(reqs, list):  # a compressed item expands here, not below
                        try:
                            data = r.chunks.decode(reqs[0], data, r.where(name))
                        except UntrustedItem as e:
                            bad = bad or e
                            continue
                    put((name, off, data, None))
                tail = f.read(1)  # anything past the manifest's size
                r.count(len(tail))
                got.update(tail)
            r.check(name, got)
            if bad is not None:
                raise bad
            put((name, -1, None, None))
        except BaseException as e:
            put((name, -1, None, e))

    def file_verdict(name: str) -> BaseException | None:
        # Drain the queue (other files' slices are dropped) until the producer of ``name``
        # has read the whole file: its error (size or crc32 mismatch), or None.
        while True:
            got, _, data, err = q.get()
            if got == name and data is None:
                return err

    futures = submit_all(ex, produce, names)
    done = 0
    try:
        while done < len(names):
            name, off, data, err = q.get()
            if err is not None:
                raise err
            if data is None:
                done += 1
                continue
            prefer_corruption(
                lambda n=name, o=off, d=data: load_blob(
                    d, slices[n][o], planner, r.where(n), r.chunks, decoded=True
                ),
                lambda n=name: file_verdict(n),
            )
    finally:
        stop.set()
        for f in futures:
            f.exception()
