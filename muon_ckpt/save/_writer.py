"""The save path's DCP writer: every file checksummed while it is written.

``ChecksumWriter`` is DCP's ``FileSystemWriter`` with its ``fs`` swapped for one whose write
streams compute the manifest's checksums (CRC32C per chunk, ``store.Checksum``) and size as
the bytes pass through, so the manifest costs no read-back; a large buffer's crc runs in a
helper thread while the same buffer is written (both release the GIL). Locally, each large write's pages are queued for write-out right away
(``_writeback``), and every file is fsynced once, by DCP. While a writer thread writes a file,
``torch.save`` (which DCP calls once per tensor) is told not to compute its zip records' crc32
(``torch.serialization.set_crc32_options``, set in that thread): that is a second full pass
over the bytes, and the manifest's checksums already cover them. The files stay plain
DCP files; ``torch.load`` reads zip records without a crc.

DCP's writer threads die silently on an error (``dcp.save`` would still return): failures are
recorded per file, and ``write_data`` raises, so a partial step is never committed.
"""

from __future__ import annotations

import dataclasses
import io
import os
import posixpath
import threading
import time
from collections.abc import Generator
from contextlib import ExitStack, contextmanager, suppress
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemBase,
    _split_by_size_and_type,
    _StorageInfo,
)
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

import muon_ckpt._collective as coll
from muon_ckpt._errors import CheckpointCorruptError, CheckpointError, CheckpointStorageError
from muon_ckpt._threads import beside, run_all
from muon_ckpt.save._dedup import MIN_REF_BYTES, DedupBase, DedupRecords, Stored, tensor_digest
from muon_ckpt.save._writeback import start_writeback
from muon_ckpt.save._zip_crc import torch_save_without_zip_crc
from muon_ckpt.store import DATA, FileEntry, Storage, check_stored, data_ref_name
from muon_ckpt.store import is_storage_failure as storage_failed
from muon_ckpt.store.checksums import Checksum
from muon_ckpt.store.codec import DESCRIPTOR, MIN_COMPRESS_BYTES, Encoder, stride_of
from muon_ckpt.store.dcp import DelegatingFileSystem, dcp_filesystem

__all__ = ["ChecksumWriter", "FileRecords"]

_PARALLEL_CRC_BYTES = 4 << 20  # buffers at least this big: crc in a helper thread during write
# Writes at least this big (a tensor's bytes) start and end a checksum chunk: a reader of some
# of its rows then reads at most one chunk more before them, and the zip records around it
# (small chunks of their own), not the neighbouring megabytes.
_CUT_BYTES = 64 << 10
_COPY_BYTES = 16 << 20  # a copied file's bytes go through one buffer of this size


class FileRecords:
    """name -> FileEntry for the files one rank wrote (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.files: dict[str, FileEntry] = {}
        self.errors: list[tuple[str, BaseException]] = []  # (file, error) of failed writes
        kinds = ("write", "writeback", "crc_wait", "sync")
        self._seconds = dict.fromkeys(kinds, 0.0)  # summed over threads

    def add_seconds(self, kind: str, seconds: float) -> None:
        with self._lock:
            self._seconds[kind] += seconds

    def thread_seconds(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)

    def fail(self, name: str, error: BaseException) -> None:
        with self._lock:
            self.errors.append((name, error))

    def put(self, name: str, entry: FileEntry) -> None:
        with self._lock:
            self.files[name] = entry

    def rename(self, old: str, new: str) -> None:
        with self._lock:
            if old in self.files:
                self.files[new] = self.files.pop(old)

    def digests(self, name: str, sha256: dict[int, str]) -> None:
        """The digests of the tensors file ``name`` (written and closed) stores, by offset."""
        with self._lock:
            self.files[name].sha256 = dict(sorted(sha256.items()))


class _CrcStream(io.RawIOBase):
    """Write-only pass-through that keeps the running checksum and byte count."""

    def __init__(self, raw: Any, records: FileRecords, fd: int | None = None) -> None:
        super().__init__()
        self._raw = raw
        self._records = records
        self._fd = fd  # a local file's descriptor: large writes start their write-out at once
        self.sum = Checksum.for_writing()
        self.size = 0
        self.last_write_end = time.perf_counter()
        self.failed: Exception | None = None  # a write's (torch.save raises its own instead)

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        try:
            return self._write(b)
        except Exception as e:
            self.failed = self.failed or e
            raise

    def _write(self, b: Any) -> int:
        mv = memoryview(b)
        n = mv.nbytes
        if n >= _CUT_BYTES:  # a tensor's bytes: a checksum chunk of their own from here
            self.sum.cut()
        if n >= _PARALLEL_CRC_BYTES:
            flat = mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv
            # Joined even when the write fails: the crc thread reads ``b``, whose memory the
            # caller may free as soon as this returns or raises.
            with beside(self.sum.update, flat, name="muon_ckpt-crc"):
                t0 = time.perf_counter()
                written = self._raw.write(b)
                t1 = time.perf_counter()
                if self._fd is not None:
                    start_writeback(self._fd, self.size, n)
                t2 = time.perf_counter()
            if self.sum.size != self.size + n:
                raise OSError("the checksum thread failed; see the error above")
            self.last_write_end = time.perf_counter()
            self._records.add_seconds("write", t1 - t0)
            self._records.add_seconds("writeback", t2 - t1)
            self._records.add_seconds("crc_wait", self.last_write_end - t2)
        else:
            t0 = time.perf_counter()
            written = self._raw.write(b)
            self.sum.update(mv)
            self.last_write_end = time.perf_counter()
            self._records.add_seconds("write", self.last_write_end - t0)
        if n >= _CUT_BYTES:
            self.sum.cut()
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


class _RecordingFileSystem(DelegatingFileSystem):
    """Delegates to ``inner``; write streams are checksummed into ``records``, by their name
    from the step directory ``step_path`` (``../data/<dir>/<file>`` for a data file)."""

    def __init__(self, inner: FileSystemBase, records: FileRecords, step_path: str) -> None:
        super().__init__(inner)
        self.records = records
        self._step_path = step_path

    def name(self, path: str | os.PathLike) -> str:
        return posixpath.relpath(os.fspath(path), self._step_path)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        name = self.name(path)
        s: _CrcStream | None = None
        try:
            with self.inner.create_stream(path, mode) as raw:
                if "w" not in mode:
                    yield raw
                    return
                s = _CrcStream(raw, self.records, _local_fd(raw))
                # In the writer thread that runs torch.save: the switch is per thread in
                # recent torch, so setting it around write_data missed DCP's other threads.
                with torch_save_without_zip_crc():
                    yield s
                # DCP fsyncs (locally) after the last write; the file closes on leaving here.
                tail_start = s.last_write_end
        except BaseException as e:
            # DCP's writer threads die silently (dcp.save still returns): remember the error
            # so that ChecksumWriter fails the save instead of committing a partial step.
            self.records.fail(name, getattr(s, "failed", None) or e)
            raise
        # Recorded only once the inner stream closed cleanly (an object store's upload done).
        self.records.add_seconds("sync", time.perf_counter() - tail_start)
        self.records.put(name, s.sum.entry())

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.inner.rename(path, new_path)
        self.records.rename(self.name(path), self.name(new_path))


def _local_fd(raw: Any) -> int | None:
    """The OS file descriptor behind a local file stream, else None (object stores)."""
    with suppress(OSError, AttributeError, io.UnsupportedOperation):
        return raw.fileno() if isinstance(raw, io.IOBase) else None
    return None


class ChecksumWriter(FileSystemWriter):
    """DCP writer for one step directory of ``storage``; fills ``records`` while writing.

    ``data_dir``: the directory under ``<root>/data/`` the data files go to (format 3;
    ``.metadata`` stays in the step directory and names them ``../data/<dir>/<file>``);
    then a tensor that ``base`` holds unchanged is referred to, not written (``_dedup``),
    where its file was written fewer than ``max_age`` saves before this one (generation
    ``gen``) and checks out (``store.check_stored``, as ``confirm`` says), and ``dedup``
    records what the next save's base needs. ``compress``: tensors of at least
    ``MIN_COMPRESS_BYTES`` are stored compressed (``store._codec``, format 4), by the writer
    threads. Without either: DCP's own writer, every file in the step directory (format 2)."""

    def __init__(
        self,
        storage: Storage,
        step_dir: str,
        records: FileRecords,
        io_threads: int,
        *,
        data_dir: str | None = None,
        base: DedupBase | None = None,
        compress: bool = False,
        gen: int = 0,
        max_age: int = 1,
        confirm: str = "checksum",
    ) -> None:
        super().__init__(
            storage.path(step_dir),
            single_file_per_rank=True,
            # fsync once per file, locally; object stores have no fsync (DCP would os.sync()).
            sync_files=storage.is_local,
            thread_count=io_threads,
            overwrite=True,
        )
        self.fs = _RecordingFileSystem(dcp_filesystem(storage), records, storage.path(step_dir))
        self.path = self.fs.init_path(storage.path(step_dir))
        self.storage, self.step_dir = storage, step_dir
        self.data_dir, self.base, self.compress = data_dir, base, compress
        self.gen, self.max_age, self.confirm = gen, max_age, confirm
        self.referable: set[str] = set()  # the base's files this save may refer to
        self.dedup = DedupRecords()
        self.write_seconds = 0.0  # wall time of write_data (all writer threads)
        self._lock = threading.Lock()
        self.packed = [0, 0]  # compressed tensors written: their bytes in, the bytes stored
        self.compressed = False  # (rank 0, once finished) whether the step has such items

    def prepare_local_plan(self, plan: Any) -> Any:
        # DCP's also asks the storage whether a .metadata is there, only to warn (overwrite=
        # True): one request per rank for nothing, where a slow rank stalls DCP's planning.
        self.fs.mkdir(self.path)
        return plan

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        infos = (metadata.storage_data or {}).values()
        self.compressed = any(getattr(i, "transform_descriptors", None) for i in infos)

    def write_data(self, plan: Any, planner: Any) -> torch.futures.Future[Any]:
        t0 = time.perf_counter()
        if self.data_dir is None and not self.compress:
            fut = super().write_data(plan, planner)
        else:
            fut = self._write_own(plan, planner)
        results = fut.wait()  # (a completed future)
        self.write_seconds = time.perf_counter() - t0
        coll.arrive("DCP's gather of the written files")  # (names a rank that never gets there)
        errors = self.fs.records.errors
        written = {r.index for r in results or ()}
        missing = [it.index.fqn for it in plan.items if it.index not in written]
        if errors or missing:
            name, err = errors[0] if errors else ("?", None)
            failed = CheckpointStorageError if storage_failed(err) else CheckpointError
            raise failed(
                f"writing {self.path}: {len(missing)} of {len(plan.items)} items were not "
                f"written (first failed file: {name}: {type(err).__name__}: {err}); the step "
                "is not committed and nothing committed was touched"
            ) from err
        return fut

    def _write_own(self, plan: Any, planner: Any) -> torch.futures.Future[Any]:
        """DCP's write of this rank's items (its split into ``thread_count`` files, each
        item as ``torch.save`` writes it), into ``data_dir`` (else the step directory),
        leaving out the tensors ``base`` holds unchanged; the files run on ``thread_count``
        threads."""
        if self.data_dir is not None:
            self.storage.makedirs(DATA, self.data_dir)
        if self.base is not None and self.data_dir is not None:
            st, where, threads = self.storage, self.step_dir, self.thread_count
            self.referable = self.base.referable(
                (it.index for it in plan.items),
                self.gen,
                self.max_age,
                lambda files: check_stored(st, where, files, self.confirm, threads),
                st.url_of(where),
            )
        prefix = plan.storage_data.prefix  # __<rank>_
        buckets = _split_by_size_and_type(self.thread_count, plan.items)
        jobs = [(f"{prefix}{k}{DEFAULT_SUFFIX}", b) for k, b in enumerate(buckets) if b]
        results: list[WriteResult] = []

        def one(job: tuple[str, list[Any]]) -> None:
            fname, items = job
            try:
                got = self._write_file(fname, items, planner)
            except Exception as e:  # as DCP's writer threads: its items are missing (below)
                self.fs.records.fail(self._where(fname)[0], e)
                return
            with self._lock:
                results.extend(got)

        run_all(self.thread_count, one, jobs, name="-write")
        fut: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        fut.set_result(results)
        return fut

    def copy_file(self, fname: str, src: Any, entry: FileEntry, where: str) -> str:
        """A file written and checksummed elsewhere (a memory-tier part's), copied from the
        open binary file ``src`` as this rank's data file ``fname``: its bytes checked
        against ``entry`` on the way (CheckpointCorruptError naming ``where`` when they
        differ), and ``entry`` recorded for it. Returns its name from the step directory."""
        name, path = self._where(fname)
        if self.data_dir is not None:
            self.storage.makedirs(DATA, self.data_dir)
        check = Checksum.like(entry, where)
        buf = memoryview(bytearray(_COPY_BYTES))
        try:
            with self.fs.inner.create_stream(path, "wb") as out:
                while n := src.readinto(buf):
                    check.update(buf[:n])
                    out.write(buf[:n])
                if self.sync_files:
                    out.flush()
                    os.fsync(out.fileno())
        except BaseException as e:
            self.fs.records.fail(name, e)
            raise
        if check.size != entry.size or check.hexdigest() != entry.digest:
            raise CheckpointCorruptError(
                f"{where}: {check.size} bytes with {entry.algorithm} {check.hexdigest()}, its "
                f"manifest says {entry.size} bytes with {entry.digest}: damaged, not copied"
            )
        self.fs.records.put(name, entry)
        return name

    def _where(self, fname: str) -> tuple[str, str]:
        """A data file's name from the step directory, and its path."""
        if self.data_dir is None:
            return fname, self.storage.path(self.step_dir, fname)
        return data_ref_name(self.data_dir, fname), self.storage.path(DATA, self.data_dir, fname)

    def _base_entry(self, name: str) -> FileEntry:
        assert self.base is not None
        return self.base.files[name]

    def _write_file(self, fname: str, items: list[Any], planner: Any) -> list[WriteResult]:
        """One data file: its non-tensor items, then its tensors, each written unless the
        base holds it unchanged (then referred to). The file is made only when something
        is written to it."""
        name, path = self._where(fname)
        dedup = self.data_dir is not None
        results: list[WriteResult] = []
        digests: dict[int, str] = {}
        with ExitStack() as stack:
            stream: Any = None

            def out() -> Any:
                nonlocal stream
                if stream is None:
                    stream = stack.enter_context(self.fs.create_stream(path, "wb"))
                return stream

            for item in items:
                if item.type == WriteItemType.BYTE_IO:
                    s = out()
                    at = s.tell()
                    s.write(planner.resolve_data(item).getbuffer())
                    results.append(_result(item, name, at, s.tell() - at))
            for item in items:
                if item.type == WriteItemType.BYTE_IO:
                    continue
                t = planner.resolve_data(item).detach().cpu()  # (as DCP's writer takes it)
                if t.untyped_storage().size() != t.nbytes:
                    t = t.clone()  # torch.save writes the whole storage: only its bytes
                prev = None if self.base is None else self.base.items.get(item.index)
                big = dedup and t.nbytes >= MIN_REF_BYTES
                digest = None
                if big and prev is not None and prev.name in self.referable:
                    digest = tensor_digest(t)  # first: it may not need writing
                    if digest == prev.sha256:
                        held = dataclasses.replace(prev, changed=False)
                        results.append(_result(item, *held.where()))
                        self.dedup.referred(item.index, held, self._base_entry(held.name))
                        continue
                s = out()
                at = s.tell()
                how = (DESCRIPTOR,) if self.compress and t.nbytes >= MIN_COMPRESS_BYTES else ()
                dst = Encoder(s, stride_of(t.element_size())) if how else s
                if big and digest is None:
                    # Nothing to refer to, or it changed at its last save (most likely again):
                    # written while its digest (for the next save) is taken on another thread.
                    digest = _save_hashing(t, dst)
                else:
                    torch.save(t, dst)
                if isinstance(dst, Encoder):
                    dst.finish()
                    with self._lock:
                        self.packed[0] += dst.raw
                        self.packed[1] += dst.stored
                stored = Stored(name, at, s.tell() - at, digest or "", None, how)
                results.append(_result(item, *stored.where()))
                if digest is not None:
                    digests[at] = digest
                    changed = None if prev is None else digest != prev.sha256
                    self.dedup.stored(item.index, dataclasses.replace(stored, changed=changed))
            if stream is not None and self.sync_files:
                os.fsync(stream.fileno())
        if digests:
            self.fs.records.digests(name, digests)
        return results


def _save_hashing(t: torch.Tensor, stream: Any) -> str | None:
    """``torch.save(t, stream)`` while ``tensor_digest(t)`` runs on a helper thread (both
    release the GIL for large buffers); the digest, or None where it failed."""
    box: list[str | None] = []
    with beside(lambda: box.append(tensor_digest(t)), name="muon_ckpt-sha"):
        torch.save(t, stream)
    return box[0] if box else None


def _result(
    item: Any, name: str, offset: int, length: int, how: tuple[str, ...] = ()
) -> WriteResult:
    info = _StorageInfo(name, offset, length, transform_descriptors=list(how) or None)
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=info)
