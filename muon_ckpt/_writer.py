"""DCP storage plugins: a writer that checksums every file while writing it, a reader that
verifies the files it reads.

Both subclass DCP's ``FileSystemWriter``/``FileSystemReader`` and only swap their ``fs``
(``FileSystemBase``): DCP's own local ``FileSystem`` for local paths, a small fsspec one for
everything else. The writer's streams compute crc32 and size as bytes pass through, so the
manifest costs no read-back; a large buffer's crc runs in a helper thread while the same
buffer is written (both release the GIL). Locally, each large write's pages are queued for
write-out right away (``_writeback``), and every file is fsynced once, by DCP.
While a writer thread writes a file, ``torch.save`` (which DCP calls once per tensor) is told not
to compute its zip records' crc32 (``torch.serialization.set_crc32_options``, set in that
thread): that is a second full pass over the bytes, and the manifest's per-file crc32 already
covers them. The
files stay plain DCP files; ``torch.load`` reads zip records without a crc.

The reader, for local files (``_itemread``): each file this rank needs is one task on
``io_threads`` threads; its items are parsed (torch's zip reader, a restricted unpickler) and
their tensor bytes read with ``pread`` straight into the targets (through page-locked chunk
buffers for CUDA targets), with no ``torch.load``. A file this rank owns (the rank that wrote
it, modulo the new world size) is checksummed on the way, every byte once, in order; owned
files it does not need are only checksummed. So every file is checked by some rank, and size
and crc are compared with the manifest before the load returns (a corrupt file fails the
load; the objects are then partly loaded).
For remote files (``verify="crc32"``): a file this rank reads completely is read front to back
by a worker thread, one stored blob at a time, chaining the crc32; this thread hands each blob
to DCP as it arrives. A file this rank needs only part of is read by slices and verified in
full by its owner rank. With ``verify="size"``, remote files go through DCP's own reader.
"""

from __future__ import annotations

import dataclasses
import io
import os
import posixpath
import queue
import re
import threading
import time
import zlib
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase

from muon_ckpt._errors import CheckpointCorruptError, CheckpointError
from muon_ckpt._itemread import FileLoad
from muon_ckpt._layout import FileEntry
from muon_ckpt._storage import Storage
from muon_ckpt._writeback import start_writeback

__all__ = ["ChecksumWriter", "FileRecords", "VerifyingReader", "crc_hex"]

_PARALLEL_CRC_BYTES = 4 << 20  # buffers at least this big: crc in a helper thread during write
_READ_CHUNK = 16 << 20
_RANK_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


_tls = threading.local()


def _crc_buffer() -> bytearray:
    """This thread's read buffer for checksumming whole files (allocated once per thread)."""
    buf = getattr(_tls, "buf", None)
    if buf is None:
        buf = _tls.buf = bytearray(_READ_CHUNK)
    return buf


def crc_hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


_zip_crc_get = getattr(torch.serialization, "get_crc32_options", None)
_zip_crc_set = getattr(torch.serialization, "set_crc32_options", None)
_zip_crc_lock = threading.Lock()
_zip_crc_users = 0
_zip_crc_saved = True
_zip_crc_thread_local: bool | None = None


def _zip_crc_per_thread() -> bool:
    """Whether torch keeps the crc32 switch per thread (torch 2.13 does; older builds share
    one setting). Probed once: a helper thread flips it and this thread looks."""
    global _zip_crc_thread_local
    if _zip_crc_thread_local is None:
        assert _zip_crc_get is not None and _zip_crc_set is not None
        with _zip_crc_lock:
            before = _zip_crc_get()
            t = threading.Thread(target=lambda: _zip_crc_set(not before))
            t.start()
            t.join()
            _zip_crc_thread_local = _zip_crc_get() == before
            if not _zip_crc_thread_local:
                _zip_crc_set(before)  # shared: undo the probe
    return _zip_crc_thread_local


@contextmanager
def _torch_save_without_zip_crc() -> Generator[None, None, None]:
    """torch.save in this thread skips its per-record crc32 for the duration. Where torch
    shares one setting between threads, concurrent uses share one switch and the last one
    out restores the caller's setting."""
    global _zip_crc_users, _zip_crc_saved
    if _zip_crc_get is None or _zip_crc_set is None:  # pragma: no cover - no switch in torch
        yield
        return
    if _zip_crc_per_thread():
        saved = _zip_crc_get()
        _zip_crc_set(False)
        try:
            yield
        finally:
            _zip_crc_set(saved)
        return
    with _zip_crc_lock:
        if _zip_crc_users == 0:
            _zip_crc_saved = _zip_crc_get()
            _zip_crc_set(False)
        _zip_crc_users += 1
    try:
        yield
    finally:
        with _zip_crc_lock:
            _zip_crc_users -= 1
            if _zip_crc_users == 0:
                _zip_crc_set(_zip_crc_saved)


class FileRecords:
    """name -> FileEntry for the files one rank wrote (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.files: dict[str, FileEntry] = {}
        self.errors: list[tuple[str, BaseException]] = []  # (file, error) of failed writes
        self._seconds = {
            "write": 0.0,
            "writeback": 0.0,
            "crc_wait": 0.0,
            "sync": 0.0,
        }  # summed over threads

    def add_seconds(self, kind: str, seconds: float) -> None:
        with self._lock:
            self._seconds[kind] += seconds

    def thread_seconds(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)

    def fail(self, name: str, error: BaseException) -> None:
        with self._lock:
            self.errors.append((name, error))

    def put(self, name: str, size: int, crc: int) -> None:
        with self._lock:
            self.files[name] = FileEntry(size, crc_hex(crc))

    def rename(self, old: str, new: str) -> None:
        with self._lock:
            if old in self.files:
                self.files[new] = self.files.pop(old)


class _CrcStream(io.RawIOBase):
    """Write-only pass-through that keeps the running crc32 and byte count."""

    def __init__(self, raw: Any, records: FileRecords, fd: int | None = None) -> None:
        super().__init__()
        self._raw = raw
        self._records = records
        self._fd = fd  # a local file's descriptor: large writes start their write-out at once
        self.crc = 0
        self.size = 0
        self.last_write_end = time.perf_counter()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b)
        n = mv.nbytes
        if n >= _PARALLEL_CRC_BYTES:
            box: list[int] = []
            flat = mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv
            t = threading.Thread(target=lambda: box.append(zlib.crc32(flat, self.crc)))
            t.start()
            try:
                t0 = time.perf_counter()
                written = self._raw.write(b)
                t1 = time.perf_counter()
                if self._fd is not None:
                    start_writeback(self._fd, self.size, n)
                t2 = time.perf_counter()
            finally:
                # Even when the write fails: the crc thread reads ``b``, whose memory the
                # caller may free as soon as this returns or raises.
                t.join()
            self.crc = box[0]
            self.last_write_end = time.perf_counter()
            self._records.add_seconds("write", t1 - t0)
            self._records.add_seconds("writeback", t2 - t1)
            self._records.add_seconds("crc_wait", self.last_write_end - t2)
        else:
            t0 = time.perf_counter()
            written = self._raw.write(b)
            self.crc = zlib.crc32(mv, self.crc)
            self.last_write_end = time.perf_counter()
            self._records.add_seconds("write", self.last_write_end - t0)
        if written is not None and written != n:
            raise OSError(f"short write: {written} of {n} bytes")
        self.size += n
        return n

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()


class FsspecFileSystem(FileSystemBase):
    """DCP ``FileSystemBase`` over one fsspec filesystem instance; paths joined with posixpath."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        f = self.fs.open(os.fspath(path), mode)
        try:
            yield f
        except BaseException:
            if "w" in mode and hasattr(f, "discard"):
                f.discard()  # an object store must not commit half a file
            else:
                f.close()
            raise
        f.close()

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return posixpath.join(os.fspath(path), suffix)

    def init_path(self, path: str | os.PathLike) -> str:
        return os.fspath(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.fs.mv(os.fspath(path), os.fspath(new_path))

    def mkdir(self, path: str | os.PathLike) -> None:
        self.fs.makedirs(os.fspath(path), exist_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        return self.fs.exists(os.fspath(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.fs.rm(os.fspath(path))

    def ls(self, path: str | os.PathLike) -> list[str]:
        return self.fs.ls(os.fspath(path), detail=False)


class _DelegatingFileSystem(FileSystemBase):
    """Every FileSystemBase call goes to ``inner``; subclasses change ``create_stream``."""

    def __init__(self, inner: FileSystemBase) -> None:
        self.inner = inner

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        with self.inner.create_stream(path, mode) as s:
            yield s

    def concat_path(self, path: str | os.PathLike, suffix: str) -> Any:
        return self.inner.concat_path(path, suffix)

    def init_path(self, path: str | os.PathLike) -> Any:
        return self.inner.init_path(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.inner.rename(path, new_path)

    def mkdir(self, path: str | os.PathLike) -> None:
        self.inner.mkdir(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        return self.inner.exists(path)

    def rm_file(self, path: str | os.PathLike) -> None:
        self.inner.rm_file(path)


class _RecordingFileSystem(_DelegatingFileSystem):
    """Delegates to ``inner``; write streams are checksummed into ``records``."""

    def __init__(self, inner: FileSystemBase, records: FileRecords) -> None:
        super().__init__(inner)
        self.records = records

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        name = posixpath.basename(os.fspath(path))
        try:
            with self.inner.create_stream(path, mode) as raw:
                if "w" not in mode:
                    yield raw
                    return
                s = _CrcStream(raw, self.records, _local_fd(raw))
                # In the writer thread that runs torch.save: the switch is per thread in
                # recent torch, so setting it around write_data missed DCP's other threads.
                with _torch_save_without_zip_crc():
                    yield s
                # DCP fsyncs (locally) after the last write; the file closes on leaving here.
                tail_start = s.last_write_end
        except BaseException as e:
            # DCP's writer threads die silently (dcp.save still returns): remember the error
            # so that ChecksumWriter fails the save instead of committing a partial step.
            self.records.fail(name, e)
            raise
        # Recorded only once the inner stream closed cleanly (an object store's upload done).
        self.records.add_seconds("sync", time.perf_counter() - tail_start)
        self.records.put(posixpath.basename(os.fspath(path)), s.size, s.crc)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.inner.rename(path, new_path)
        self.records.rename(
            posixpath.basename(os.fspath(path)), posixpath.basename(os.fspath(new_path))
        )


def _local_fd(raw: Any) -> int | None:
    """The OS file descriptor behind a local file stream, else None (object stores)."""
    if not isinstance(raw, io.IOBase):
        return None
    try:
        return raw.fileno()
    except (OSError, AttributeError, io.UnsupportedOperation):
        return None


def _inner_fs(storage: Storage) -> FileSystemBase:
    return FileSystem() if storage.is_local else FsspecFileSystem(storage.fs)


class ChecksumWriter(FileSystemWriter):
    """DCP writer for one step directory of ``storage``; fills ``records`` while writing."""

    def __init__(
        self, storage: Storage, step_dir: str, records: FileRecords, io_threads: int
    ) -> None:
        super().__init__(
            storage.path(step_dir),
            single_file_per_rank=True,
            # fsync once per file, locally; object stores have no fsync (DCP would os.sync()).
            sync_files=storage.is_local,
            thread_count=io_threads,
            overwrite=True,
        )
        self.fs = _RecordingFileSystem(_inner_fs(storage), records)
        self.path = self.fs.init_path(storage.path(step_dir))
        self.write_seconds = 0.0  # wall time of write_data (all writer threads)

    def write_data(self, plan: Any, planner: Any) -> torch.futures.Future[Any]:
        t0 = time.perf_counter()
        fut = super().write_data(plan, planner)
        results = fut.wait()  # DCP's writer returns a completed future
        self.write_seconds = time.perf_counter() - t0
        errors = self.fs.records.errors
        written = {r.index for r in results or ()}
        missing = [it.index.fqn for it in plan.items if it.index not in written]
        if errors or missing:
            name, err = errors[0] if errors else ("?", None)
            raise CheckpointError(
                f"writing {self.path}: {len(missing)} of {len(plan.items)} items were not "
                f"written (first failed file: {name}: {type(err).__name__}: {err}); the step "
                "is not committed and nothing committed was touched"
            ) from err
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


class _ServingFileSystem(_DelegatingFileSystem):
    """Read streams come from ``cache`` (the slice being loaded, already read) when there."""

    def __init__(self, inner: FileSystemBase) -> None:
        super().__init__(inner)
        self.cache: dict[str, _SliceStream] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        cached = self.cache.get(posixpath.basename(os.fspath(path)))
        if cached is not None and "r" in mode:
            yield cached
            return
        with self.inner.create_stream(path, mode) as s:
            yield s


class VerifyingReader(FileSystemReader):
    """DCP reader for one committed step; checks every file it reads against the manifest."""

    def __init__(
        self,
        storage: Storage,
        step_dir: str,
        files: dict[str, FileEntry],
        *,
        metadata: Any,
        rank: int,
        world_size: int,
        io_threads: int,
        verify_crc: bool,
    ) -> None:
        super().__init__(storage.path(step_dir))
        self.fs = _ServingFileSystem(_inner_fs(storage))
        self.path = self.fs.init_path(storage.path(step_dir))
        self._storage = storage
        self._step_dir = step_dir
        self._files = files
        self._metadata = metadata
        self._rank = rank
        self._world = world_size
        self._threads = io_threads
        self._verify_crc = verify_crc
        self.timings: dict[str, float] = {}  # "read": wall time of read_data (see manager)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        # Already read (and crc-checked) on rank 0 and broadcast: no second round trip.
        md = dataclasses.replace(self._metadata)
        if md.storage_meta is not None:
            md.storage_meta = dataclasses.replace(md.storage_meta, load_id=self.load_id)
        return md

    # ------------------------------------------------------------------ verification
    def _where(self, name: str) -> str:
        return self._storage.url_of(self._step_dir, name)

    def _owner(self, name: str, index: int) -> int:
        m = _RANK_FILE_RE.match(name)
        return (int(m.group(1)) if m else index) % self._world

    def _entry(self, name: str) -> FileEntry:
        """The manifest's entry for ``name``; a file it does not list is an error."""
        want = self._files.get(name)
        if want is None:
            raise CheckpointCorruptError(
                f"{self._where(name)}: the DCP metadata refers to this file but the manifest "
                "does not list it; the step was not written by one save. Load another step"
            )
        return want

    def _fetch(self, name: str) -> None:
        """Read ``name`` whole (in chunks) only to check its size and crc32."""
        want = self._entry(name)
        crc, size = 0, 0
        # One reused buffer: a fresh 64 MiB bytes object per read would be a fresh mmap,
        # page-faulted in on every read (slower than the read itself from the page cache).
        buf = _crc_buffer()
        view = memoryview(buf)
        with self._storage.fs.open(self._storage.path(self._step_dir, name), "rb") as f:
            while n := f.readinto(buf):
                crc, size = zlib.crc32(view[:n], crc), size + n
        self._check(name, want, size, crc)

    def _read_items(self, plan: Any, planner: Any, items: list[Any]) -> None:
        """DCP's own reader on a subset of this rank's plan."""
        super().read_data(dataclasses.replace(plan, items=items), planner).wait()

    def _read_files_in_parallel(self, plan: Any, planner: Any, ex: ThreadPoolExecutor) -> None:
        """DCP's own reader, one task per file on ``ex``: DCP reads a rank's files one after
        the other on one thread; the file reads and the copies into the target tensors
        release the GIL, so ``io_threads`` files load at once. Items of one file go to
        disjoint parts of the targets, so the tasks never write the same bytes."""
        per_file: dict[str, list[Any]] = {}
        sizes: dict[str, int] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append(item)
            sizes[info.relative_path] = sizes.get(info.relative_path, 0) + info.length
        order = sorted(per_file, key=lambda n: (-sizes[n], n))  # largest first: even finish

        for f in [ex.submit(self._read_items, plan, planner, per_file[n]) for n in order]:
            f.result()

    def _load_local(self, plan: Any, planner: Any) -> None:
        """Local files: each file one task on ``io_threads`` threads (``_itemread``): the
        items this rank needs go straight into their targets, and a file this rank owns is
        checksummed on the way, every byte once (a file it owns but does not read, only
        checksummed). Items with a DCP storage transform go through DCP's own reader."""
        per_file: dict[str, dict[int, tuple[int, list[Any]]]] = {}
        dcp_items: dict[str, list[Any]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if getattr(info, "transform_descriptors", None):  # (absent in older torch)
                dcp_items.setdefault(info.relative_path, []).append(item)
                continue
            slot = per_file.setdefault(info.relative_path, {})
            slot.setdefault(info.offset, (info.length, []))[1].append(item)
        names = sorted(self._files)
        owned = {n for i, n in enumerate(names) if self._owner(n, i) == self._rank}
        if not self._verify_crc:
            owned = set()
        work = sorted(set(per_file) | set(dcp_items) | owned)
        work.sort(key=lambda n: (-self._entry(n).size, n))  # largest first: even finish

        def one(name: str) -> None:
            # An owned file is checksummed once: by its own pass when DCP's reader is involved
            # or nothing is read from it, else on the way by FileLoad.
            separate_crc = name in owned and (name in dcp_items or name not in per_file)
            if separate_crc:
                self._fetch(name)
            if name in dcp_items:
                self._read_items(plan, planner, dcp_items[name])
            if name in per_file:
                verify = name in owned and not separate_crc
                self._load_file(name, per_file[name], planner, verify=verify)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(self._threads, thread_name_prefix="muon_ckpt_read") as ex:
            futures = [ex.submit(one, n) for n in work]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                for f in futures:  # files not started yet: the load has failed already
                    f.cancel()
                raise
        self.timings = {"read": time.perf_counter() - t0}

    def _load_file(
        self, name: str, items: dict[int, tuple[int, list[Any]]], planner: Any, verify: bool
    ) -> None:
        where = self._where(name)
        load = FileLoad(self._storage.path(self._step_dir, name), where, planner, verify)
        try:
            got = load.run(items)
        except CheckpointError:
            raise
        except Exception as e:
            # A damaged item often fails to parse before the file's checksum is known:
            # checksum the whole file, and report the corruption if that is what it is.
            if verify:
                try:
                    self._fetch(name)
                except CheckpointCorruptError as corrupt:
                    raise corrupt from e
            hint = (
                ""
                if verify
                else '. If the file is damaged, load another step; verify="crc32" '
                "(the default) checks every byte of it"
            )
            raise CheckpointError(f"{where}: cannot load it: {type(e).__name__}: {e}{hint}") from e
        if got is not None:
            self._check(name, self._files[name], *got)

    def read_data(self, plan: Any, planner: Any) -> torch.futures.Future[None]:
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        if self._storage.is_local:
            self._load_local(plan, planner)
            return done
        if not self._verify_crc:
            # Remote with verify="size": sizes were checked when the step was chosen, so
            # DCP's reads (file by file in parallel) are all that is left.
            t0 = time.perf_counter()
            with ThreadPoolExecutor(self._threads, thread_name_prefix="muon_ckpt_read") as rd:
                self._read_files_in_parallel(plan, planner, rd)
            self.timings = {"read": time.perf_counter() - t0}
            return done
        # Group the read items by file, and by slice (one stored blob) within the file.
        slices: dict[str, dict[int, list[Any]]] = {}
        lengths: dict[tuple[str, int], int] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            slices.setdefault(info.relative_path, {}).setdefault(info.offset, []).append(item)
            lengths[(info.relative_path, info.offset)] = info.length
        names = sorted(self._files)
        owned = {n for i, n in enumerate(names) if self._owner(n, i) == self._rank}
        streamed, sliced = [], []
        for name, by_off in sorted(slices.items()):
            pos = 0
            for off in sorted(by_off):
                pos = pos + lengths[(name, off)] if off == pos else -1
            entry = self._files.get(name)
            covers = entry is not None and pos == entry.size
            (streamed if covers else sliced).append(name)
        verify_only = [n for n in names if n in owned and n not in streamed]

        def sub_read(items: list[Any]) -> None:
            self._read_items(plan, planner, items)

        with ThreadPoolExecutor(self._threads, thread_name_prefix="muon_ckpt_read") as ex:
            checks = [ex.submit(self._fetch, n) for n in verify_only]
            try:
                self._stream_files(ex, streamed, slices, lengths, sub_read)
                for name in sliced:
                    sub_read([it for items in slices[name].values() for it in items])
            except Exception as read_error:
                _prefer_corruption(checks, read_error)
                raise
            for c in checks:
                c.result()
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut

    def _stream_files(
        self,
        ex: ThreadPoolExecutor,
        names: list[str],
        slices: dict[str, dict[int, list[Any]]],
        lengths: dict[tuple[str, int], int],
        sub_read: Any,
    ) -> None:
        """Files this rank reads completely: worker threads read each file's slices in order
        (chaining the crc32); this thread loads each slice as it arrives. A file whose size or
        crc differs from the manifest raises before read_data returns."""
        if not names:
            return
        q: queue.Queue[tuple[str, int, bytes | None, BaseException | None]] = queue.Queue(
            maxsize=2 * self._threads
        )
        stop = threading.Event()

        def put(msg: tuple[str, int, bytes | None, BaseException | None]) -> None:
            while not stop.is_set():
                try:
                    q.put(msg, timeout=0.1)
                    return
                except queue.Full:
                    continue

        def produce(name: str) -> None:
            try:
                want = self._files[name]
                crc, size = 0, 0
                with self._storage.fs.open(self._storage.path(self._step_dir, name), "rb") as f:
                    for off in sorted(slices[name]):
                        if stop.is_set():
                            return
                        data = f.read(lengths[(name, off)])
                        crc, size = zlib.crc32(data, crc), size + len(data)
                        put((name, off, data, None))
                    size += len(f.read(1))  # anything past the manifest's size
                self._check(name, want, size, crc)
                put((name, -1, None, None))
            except BaseException as e:
                put((name, -1, None, e))

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
                self.fs.cache[name] = _SliceStream(off, data)
                try:
                    sub_read(slices[name][off])
                except Exception as load_error:
                    # A damaged slice often fails to unpickle before its file's checksum is
                    # known: let the file finish, and report the corruption if that is it.
                    verdict = self._file_verdict(q, name)
                    if isinstance(verdict, CheckpointCorruptError):
                        raise verdict from load_error
                    raise
                finally:
                    del self.fs.cache[name]
        finally:
            stop.set()
            for f in futures:
                f.exception()

    @staticmethod
    def _file_verdict(q: queue.Queue, name: str) -> BaseException | None:
        """Drain ``q`` (other files' slices are dropped) until the producer of ``name`` has
        read the whole file: its error (size or crc32 mismatch), or None."""
        while True:
            got, _, data, err = q.get()
            if got == name and data is None:
                return err

    def _check(self, name: str, want: FileEntry, size: int, crc: int) -> None:
        if size != want.size or crc_hex(crc) != want.crc32:
            raise CheckpointCorruptError(
                f"{self._where(name)}: file is corrupt: {size} bytes with crc32 {crc_hex(crc)}, "
                f"the manifest says {want.size} bytes with crc32 {want.crc32}. Load another "
                "step (muon-ckpt ls lists them) or restore this file"
            )


def _prefer_corruption(checks: list[Any], read_error: BaseException) -> None:
    """A damaged file often fails to unpickle before its checksum is done: once the checks
    have finished, raise the corruption a checksum found (naming the file), if any, instead
    of the unpickler's complaint."""
    for c in checks:
        err = c.exception()
        if isinstance(err, CheckpointCorruptError):
            raise err from read_error


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
