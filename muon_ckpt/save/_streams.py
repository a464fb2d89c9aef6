"""The streams a save writes its files through: every file checksummed while it is written.

DCP's writer gets a file system (``RecordingFileSystem``) whose write streams compute the
manifest's checksums (CRC32C per chunk, ``store.Checksum``) and size as the bytes pass
through, so the manifest costs no read-back; a large buffer's crc runs in a helper thread while
the same buffer is written (both release the GIL). Locally, each large write's pages are queued
for write-out right away (``_writeback``). While a writer thread writes a file, ``torch.save``
(which DCP calls once per tensor) is told not to compute its zip records' crc32
(``torch.serialization.set_crc32_options``, set in that thread): that is a second full pass
over the bytes, and the manifest's checksums already cover them. The files stay plain DCP
files; ``torch.load`` reads zip records without a crc.

DCP's writer threads die silently on an error (``dcp.save`` would still return): failures are
recorded per file (``FileRecords``), and the writer raises, so a partial step is never
committed.
"""

from __future__ import annotations

import io
import os
import posixpath
import threading
import time
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemBase

from muon_ckpt._errors import CheckpointError
from muon_ckpt._interrupts import Stop
from muon_ckpt._threads import beside
from muon_ckpt.save._writeback import start_writeback
from muon_ckpt.save._zip_crc import torch_save_without_zip_crc
from muon_ckpt.store import FileEntry
from muon_ckpt.store.checksums import Checksum
from muon_ckpt.store.dcp import DelegatingFileSystem

__all__ = ["FileRecords", "RecordingFileSystem"]

_PARALLEL_CRC_BYTES = 4 << 20  # buffers at least this big: crc in a helper thread during write
# Writes at least this big (a tensor's bytes) start and end a checksum chunk: a reader of some
# of its rows then reads at most one chunk more before them, and the zip records around it
# (small chunks of their own), not the neighbouring megabytes.
_CUT_BYTES = 64 << 10


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


class RecordingFileSystem(DelegatingFileSystem):
    """Delegates to ``inner``; write streams are checksummed into ``records``, by their name
    from the step directory ``step_path`` (``../data/<dir>/<file>`` for a data file). Once
    ``stop`` is set (Ctrl-C), no new file is created: the save fails as not committed."""

    def __init__(
        self, inner: FileSystemBase, records: FileRecords, step_path: str, stop: Stop | None = None
    ) -> None:
        super().__init__(inner)
        self.records = records
        self._step_path = step_path
        self._stop = stop

    def name(self, path: str | os.PathLike) -> str:
        return posixpath.relpath(os.fspath(path), self._step_path)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        name = self.name(path)
        s: _CrcStream | None = None
        try:
            if "w" in mode and self._stop is not None and self._stop.is_set:
                raise CheckpointError(f"{name} not written: stopped by Ctrl-C")
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
            # so that the writer fails the save instead of committing a partial step.
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
    if not isinstance(raw, io.IOBase):
        return None
    try:
        return raw.fileno()
    except (OSError, AttributeError, io.UnsupportedOperation):
        return None
