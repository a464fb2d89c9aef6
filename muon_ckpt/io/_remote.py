"""Remote reads of ``VerifyingReader`` (object stores and other non-local fsspec filesystems).

With checksums (``stream=True``): a file this rank reads completely is read front to back by a
worker thread, one stored blob at a time, chaining the checksum; the calling thread hands each
blob to DCP as it arrives (through ``ServingFileSystem``, which serves DCP's read stream from
the blob already in memory). A file needed only in part is read by DCP in slices; the files
this rank checks but does not stream are checksummed by workers meanwhile.
Without (``verify="size"``): DCP's own reads, one task per file on ``io_threads`` threads
(sizes were checked when the step was chosen).
"""

from __future__ import annotations

import io
import os
import posixpath
import queue
import threading
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from muon_ckpt._errors import CheckpointCorruptError
from muon_ckpt.io._tasks import prefer_corruption, run_all
from muon_ckpt.store import DelegatingFileSystem, Storage, dcp_filesystem

if TYPE_CHECKING:
    from muon_ckpt.io._reader import VerifyingReader

__all__ = ["ServingFileSystem", "read_remote"]

_Msg = tuple[str, int, "bytes | None", "BaseException | None"]


class _SliceStream(io.RawIOBase):
    """Read-only view of one slice of a file, addressed by absolute file offsets."""

    def __init__(self, offset: int, data: bytes) -> None:
        super().__init__()
        self._off = offset
        self._data = memoryview(data)
        self._pos = offset

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self._pos = pos
        elif whence == io.SEEK_CUR:
            self._pos += pos
        else:
            self._pos = self._off + len(self._data) + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def _window(self, n: int) -> memoryview:
        start = self._pos - self._off
        if start < 0 or start > len(self._data):
            raise OSError(f"read at offset {self._pos} outside the slice being loaded")
        end = len(self._data) if n < 0 else min(len(self._data), start + n)
        self._pos = self._off + end
        return self._data[start:end]

    def readinto(self, b: Any) -> int:
        mv = self._window(memoryview(b).nbytes)
        memoryview(b).cast("B")[: len(mv)] = mv
        return len(mv)

    def read(self, size: int | None = -1) -> bytes:
        return bytes(self._window(-1 if size is None else size))


class ServingFileSystem(DelegatingFileSystem):
    """Read streams come from ``cache`` (the slice being loaded, already read) when there."""

    def __init__(self, step: Storage) -> None:
        super().__init__(dcp_filesystem(step))
        self.cache: dict[str, _SliceStream] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        cached = self.cache.get(posixpath.basename(os.fspath(path)))
        if cached is not None and "r" in mode:
            yield cached
            return
        with self.inner.create_stream(path, mode) as s:
            yield s


def read_remote(r: VerifyingReader, plan: Any, planner: Any, *, stream: bool) -> None:
    # Group the read items by file, and by slice (one stored blob) within the file.
    slices: dict[str, dict[int, list[Any]]] = {}
    lengths: dict[tuple[str, int], int] = {}
    for item in plan.items:
        info = r.storage_data[item.storage_index]
        slices.setdefault(info.relative_path, {}).setdefault(info.offset, []).append(item)
        lengths[(info.relative_path, info.offset)] = info.length
    if not stream:
        run_all(r.threads, lambda n: r.read_items(plan, planner, _all(slices[n])), sorted(slices))
        return
    streamed, sliced = [], []
    for name, by_off in sorted(slices.items()):
        pos = 0
        for off in sorted(by_off):
            pos = pos + lengths[(name, off)] if off == pos else -1
        entry = r.entry(name)
        (streamed if entry is not None and pos == entry.size else sliced).append(name)
    only_check = sorted(r.to_check(set(slices)) - set(streamed))
    with ThreadPoolExecutor(r.threads, thread_name_prefix="muon_ckpt_read") as ex:
        checks = [ex.submit(r.fetch_and_check, n) for n in only_check]

        def read_all() -> None:
            _stream_files(r, ex, streamed, slices, lengths, plan, planner)
            for name in sliced:
                r.read_items(plan, planner, _all(slices[name]))

        def found() -> BaseException | None:
            return next(
                (e for c in checks if isinstance(e := c.exception(), CheckpointCorruptError)),
                None,
            )

        prefer_corruption(read_all, found)
        for c in checks:
            c.result()


def _all(by_off: dict[int, list[Any]]) -> list[Any]:
    return [it for items in by_off.values() for it in items]


def _stream_files(
    r: VerifyingReader,
    ex: ThreadPoolExecutor,
    names: list[str],
    slices: dict[str, dict[int, list[Any]]],
    lengths: dict[tuple[str, int], int],
    plan: Any,
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
            with r.step.open(name) as f:
                for off in sorted(slices[name]):
                    if stop.is_set():
                        return
                    data = f.read(lengths[(name, off)])
                    got.update(data)
                    put((name, off, data, None))
                got.update(f.read(1))  # anything past the manifest's size
            r.check(name, got)
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

    futures = [ex.submit(produce, n) for n in names]
    done = 0
    try:
        while done < len(names):
            name, off, data, err = q.get()
            if err is not None:
                raise err
            if data is None:
                done += 1
                continue
            r.fs.cache[name] = _SliceStream(off, data)
            try:
                prefer_corruption(
                    lambda n=name, o=off: r.read_items(plan, planner, slices[n][o]),
                    lambda n=name: file_verdict(n),
                )
            finally:
                del r.fs.cache[name]
    finally:
        stop.set()
        for f in futures:
            f.exception()
