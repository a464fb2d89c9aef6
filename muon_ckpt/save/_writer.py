"""The save path's DCP writer (``StepWriter``): one rank's files of a step, each checksummed
as it is written (``_streams``), each tensor written or referred to where the run holds it
unchanged (``_dedup``), and compressed, as the save's ``WritePolicy`` says.

Without dedup, compression or digests it is DCP's own ``FileSystemWriter``, every file in the
step directory (format 2). Otherwise it runs its own loop over DCP's split of the rank's items
into ``io_threads`` files (each item as ``torch.save`` writes it; DCP's planner and
``.metadata`` unchanged), on ``io_threads`` threads: with dedup into the run's data
(``<url>/data/<dir>/``, format 3), where a tensor the run holds unchanged is referred to (a
write result naming the earlier file, offset and length) instead of written; with compression,
tensors of ``MIN_COMPRESS_BYTES`` or more through ``store.codec.Encoder`` (format 4). It also
copies files written elsewhere (a memory-tier part's, ``copy_file``), item by item through the
same choice.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import os
import threading
import time
from contextlib import ExitStack
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import filesystem as dcp_files
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    _split_by_size_and_type,
    _StorageInfo,
)
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

import muon_ckpt._collective as coll
from muon_ckpt._config import ManagerConfig
from muon_ckpt._errors import CheckpointCorruptError, CheckpointError, CheckpointStorageError
from muon_ckpt._gcpause import paused_gc
from muon_ckpt._interrupts import Stop
from muon_ckpt._threads import beside, run_all
from muon_ckpt.save._dedup import Dedup, DedupBase, Stored, tensor_digest
from muon_ckpt.save._streams import FileRecords, RecordingFileSystem
from muon_ckpt.store import DATA, METADATA, FileEntry, Storage, check_stored, data_ref_name
from muon_ckpt.store import is_storage_failure as storage_failed
from muon_ckpt.store.checksums import Checksum
from muon_ckpt.store.codec import DESCRIPTOR, MIN_COMPRESS_BYTES, Encoder, stride_of
from muon_ckpt.store.dcp import Gathered, Written, dcp_filesystem, dump_metadata

__all__ = ["StepWriter", "WritePolicy"]

_COPY_BYTES = 16 << 20  # a copied file's bytes go through one buffer of this size
_FINISH = "the end of DCP's save (the written files gathered, rank 0's .metadata written)"


@dataclasses.dataclass(frozen=True)
class WritePolicy:
    """How a save writes its tensors (the options ``dedup``, ``dedup_max_age`` and
    ``compression``). ``dedup``: its files go to the run's data (format 3) and a tensor the
    run holds unchanged is referred to, where its file was written fewer than ``max_age``
    saves before (``ManagerConfig.dedup_bound``: at most ``keep_last - 1``); ``compress``: tensors of ``MIN_COMPRESS_BYTES`` or more are stored
    compressed (format 4); ``digests``: each tensor's digest is recorded without dedup (the
    memory tier's parts, which the flush at ``close()`` refers by)."""

    dedup: bool = False
    max_age: int = 1
    compress: bool = False
    digests: bool = False

    @classmethod
    def of(cls, config: ManagerConfig) -> WritePolicy:
        return cls(config.dedup, config.dedup_bound, config.compression == "zstd")


class StepWriter(FileSystemWriter):
    """DCP writer for one step directory of ``storage``; fills ``records`` while writing.

    ``data_dir``: the directory under ``<root>/data/`` the data files go to (dedup;
    ``.metadata`` stays in the step directory and names them ``../data/<dir>/<file>``), where
    a tensor ``base`` holds unchanged is referred to (``Dedup``) when its file was written
    fewer than ``policy.max_age`` saves before this one (generation ``gen``) and checks out
    (``store.check_stored``, as ``confirm`` says). Once ``stop`` is set, no file starts."""

    def __init__(
        self,
        storage: Storage,
        step_dir: str,
        records: FileRecords,
        io_threads: int,
        *,
        policy: WritePolicy = WritePolicy(),
        data_dir: str | None = None,
        base: DedupBase | None = None,
        gen: int = 0,
        confirm: str = "checksum",
        stop: Stop | None = None,
    ) -> None:
        super().__init__(
            storage.path(step_dir),
            single_file_per_rank=True,
            # fsync once per file, locally; object stores have no fsync (DCP would os.sync()).
            sync_files=storage.is_local,
            thread_count=io_threads,
            overwrite=True,
        )
        self.fs = RecordingFileSystem(
            dcp_filesystem(storage), records, storage.path(step_dir), stop
        )
        self.path = self.fs.init_path(storage.path(step_dir))
        self.storage, self.step_dir, self.data_dir = storage, step_dir, data_dir
        self.policy, self.gen, self.confirm = policy, gen, confirm
        self.dedup = Dedup(base, hashes=policy.dedup or policy.digests)
        self.write_seconds = 0.0  # wall time of write_data (all writer threads)
        self._lock = threading.Lock()
        self.packed = [0, 0]  # compressed tensors written: their bytes in, the bytes stored
        self.compressed = False  # (rank 0, once finished) whether the step has such items
        self._finish_due = False  # (rank 0) DCP's finish, an agreement point, not yet reached

    def prepare_local_plan(self, plan: Any) -> Any:
        # DCP's also asks the storage whether a .metadata is there, only to warn (overwrite=
        # True): one request per rank for nothing, where a slow rank stalls DCP's planning.
        self.fs.mkdir(self.path)
        return plan

    def finish(self, metadata: Any, results: Any) -> None:
        # DCP's finish, the same file, but its stored items kept as columns and the metadata
        # pickled in them (store.dump_metadata): DCP's dict of them and its pickle, an object
        # and a dict per item, took 22 s on rank 0 at 2,048 ranks of an 8B model.
        metadata.version = getattr(dcp_files, "CURRENT_DCP_VERSION", metadata.version)
        metadata.storage_meta = self.storage_meta()
        # The collector paused until the metadata is dropped: its million chunks, none of them
        # garbage, which a collection while the pickle is written would walk.
        with paused_gc():
            metadata.storage_data = items = Gathered(results)
            self._write_metadata(metadata)
            self.compressed = items.compressed()
            # DCP then hands this metadata to every rank (dcp.save's return value, which
            # nothing here reads), pickled an object per chunk: 4 s on rank 0 and 8 s on every
            # other rank at 512 ranks of an 8B model, each save. The file holds all of it.
            metadata.state_dict_metadata, metadata.storage_data = {}, {}
        self.ended()

    def _write_metadata(self, metadata: Any) -> None:
        """DCP's ``.metadata`` file (in columns, ``store.dump_metadata``), as DCP's finish
        writes it: a temporary name, fsync, then renamed."""
        rank, collective = getattr(self, "rank", None), getattr(self, "use_collectives", True)
        name = METADATA if collective or rank is None else f"__{rank}{METADATA}"  # (DCP's names)
        tmp = self.fs.concat_path(self.path, f"{name}.tmp")
        with self.fs.create_stream(tmp, "wb") as f:
            dump_metadata(metadata, f)
            if self.sync_files:
                try:
                    os.fsync(f.fileno())
                except (AttributeError, io.UnsupportedOperation):
                    os.sync()
        path = self.fs.concat_path(self.path, name)
        if self.fs.exists(path):
            self.fs.rm_file(path)
        self.fs.rename(tmp, path)

    def ended(self) -> None:
        """Rank 0 past DCP's finish (its ``.metadata`` written, or DCP's save over without
        it): the point the other ranks reached when they began to wait for it."""
        if self._finish_due:
            self._finish_due = False
            coll.arrive(_FINISH)

    def write_data(self, plan: Any, planner: Any) -> torch.futures.Future[Any]:
        t0 = time.perf_counter()
        p = self.policy
        if p.dedup or p.compress or p.digests:
            fut = self._write_own(plan, planner)
        else:
            fut = super().write_data(plan, planner)
        results = fut.wait()  # (a completed future)
        self.write_seconds = time.perf_counter() - t0
        coll.arrive("DCP's gather of the written files")  # (names a rank that never gets there)
        if coll.rank() == 0:  # (so a slow .metadata write names rank 0, not the waiting ranks)
            self._finish_due = True
        else:
            coll.arrive(_FINISH)
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
        # DCP gathers every rank's results to rank 0 for finish: as columns, not objects
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(Written.of(results or ()))
        return done

    def prepare(self, wanted: Any) -> None:
        """Before anything is written (``write_data``; a copy's ``Prebuilt`` calls it): the
        run's data directory, and the base's files the save may refer to for the items
        ``wanted`` (``Dedup.prepare``)."""
        if self.data_dir is None:
            return
        self.storage.makedirs(DATA, self.data_dir)
        if self.policy.dedup:
            st, where, threads = self.storage, self.step_dir, self.thread_count
            self.dedup.prepare(
                wanted,
                self.gen,
                self.policy.max_age,
                lambda files: check_stored(st, where, files, self.confirm, threads),
                st.url_of(where),
            )

    def _write_own(self, plan: Any, planner: Any) -> torch.futures.Future[Any]:
        """DCP's write of this rank's items (its split into ``thread_count`` files, each
        item as ``torch.save`` writes it), into ``data_dir`` (else the step directory),
        leaving out the tensors the run holds unchanged; the files run on ``thread_count``
        threads."""
        self.prepare(it.index for it in plan.items)
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

    def _where(self, fname: str) -> tuple[str, str]:
        """A data file's name from the step directory, and its path."""
        if self.data_dir is None:
            return fname, self.storage.path(self.step_dir, fname)
        return data_ref_name(self.data_dir, fname), self.storage.path(DATA, self.data_dir, fname)

    def _write_file(self, fname: str, items: list[Any], planner: Any) -> list[WriteResult]:
        """One data file: its non-tensor items, then its tensors, each written unless the
        run holds it unchanged (then referred to). The file is made only when something is
        written to it."""
        name, path = self._where(fname)
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
                hashed = self.dedup.hashes(t.nbytes)
                digest = None
                if hashed and self.dedup.hash_first(item.index):
                    digest = tensor_digest(t)  # first: it may not need writing
                    held = self.dedup.refer(item.index, digest)
                    if held is not None:
                        results.append(_result(item, *held.where()))
                        continue
                s = out()
                at = s.tell()
                how = (
                    (DESCRIPTOR,) if self.policy.compress and t.nbytes >= MIN_COMPRESS_BYTES else ()
                )
                dst = Encoder(s, stride_of(t.element_size())) if how else s
                if hashed and digest is None:
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
                    self.dedup.wrote(item.index, stored)
            if stream is not None and self.sync_files:
                os.fsync(stream.fileno())
        if digests:
            self.fs.records.digests(name, digests)
        return results

    def copy_file(
        self, fname: str, src: Any, entry: FileEntry, where: str, items: dict[Any, Any]
    ) -> dict[Any, Any]:
        """A file written and checksummed elsewhere (a memory-tier part's), read from the
        open binary file ``src``, as this rank's data file ``fname``: each of its ``items``
        (DCP index -> its place in the file) written, or referred to where the run holds it
        unchanged (``Dedup.refer``, by the digest ``entry`` records for it). Every byte read
        is checked against ``entry`` (CheckpointCorruptError naming ``where`` when they
        differ). Returns the items' places in this step; the file is made only when
        something is written to it."""
        name, path = self._where(fname)
        digests = entry.sha256 or {}
        placed: dict[Any, Any] = {}
        kept = []
        for index, info in sorted(items.items(), key=lambda kv: kv[1].offset):
            held = self.dedup.refer(index, digests.get(info.offset))
            if held is None:
                kept.append((index, info))
            else:
                placed[index] = _StorageInfo(*held.where()[:3], list(held.how) or None)
        if not kept:
            return placed
        written: dict[int, str] = {}
        check = Checksum.like(entry, where)
        copy = _Copy(src, check, sorted(entry.cuts or []))
        with self.fs.create_stream(path, "wb") as out:
            for index, info in kept:
                copy.through(info.offset - copy.pos, None)  # (checked, not written)
                at = out.tell()
                copy.through(info.length, out)
                how = tuple(info.transform_descriptors or ())
                placed[index] = _StorageInfo(name, at, info.length, list(how) or None)
                digest = digests.get(info.offset)
                if digest is not None:
                    written[at] = digest
                    self.dedup.wrote(index, Stored(name, at, info.length, digest, None, how))
            copy.through(None, None)
            if self.sync_files:
                out.flush()
                os.fsync(out.fileno())
        if check.size != entry.size or check.hexdigest() != entry.digest:
            raise CheckpointCorruptError(
                f"{where}: {check.size} bytes with {entry.algorithm} {check.hexdigest()}, its "
                f"manifest says {entry.size} bytes with {entry.digest}: damaged, not copied"
            )
        if written:
            self.fs.records.digests(name, written)
        return placed


class _Copy:
    """A copied file's bytes, read in order: every byte checked (``check``), those written
    passed on in pieces that end where the source's checksum chunks were cut (``cuts``), so
    the copy's chunks are cut where the source's were (a stored tensor's bytes start one)."""

    def __init__(self, src: Any, check: Checksum, cuts: list[int]) -> None:
        self.src, self.check, self.cuts = src, check, cuts
        self.pos = 0
        self.buf = memoryview(bytearray(_COPY_BYTES))

    def through(self, n: int | None, out: Any) -> None:
        """The next ``n`` bytes (None: to the end), written to ``out`` unless it is None."""
        end = None if n is None else self.pos + n
        while end is None or self.pos < end:
            stop = self.pos + len(self.buf) if end is None else min(end, self.pos + len(self.buf))
            k = bisect.bisect_right(self.cuts, self.pos)
            if k < len(self.cuts) and self.cuts[k] < stop:
                stop = self.cuts[k]
            view = self.buf[: stop - self.pos]
            got = self.src.readinto(view)
            if not got:  # shorter than its manifest says: the check after the copy says so
                return
            self.check.update(view[:got])
            if out is not None:
                out.write(view[:got])
            self.pos += got


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
