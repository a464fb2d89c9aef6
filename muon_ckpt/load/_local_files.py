"""Local loads: read DCP's files item by item, straight into the target tensors.

DCP's ``FileSystemReader`` turns every stored tensor into a fresh CPU tensor with
``torch.load`` and then copies it into the target: each byte is read into newly allocated
(page-faulted) memory, copied once more, and a checksum needs a second pass over the file.
Here, for a local file:

* each item's zip (DCP stores one ``torch.save`` per item) is parsed from its first and last
  bytes (``_item_zip``: record offsets; dtype, size, stride and storage offset from the pickle);
* the tensor record is read with ``pread`` straight into the target when the target is a
  contiguous CPU tensor of the stored dtype that takes the whole item; on CUDA in chunks
  through page-locked buffers; in chunks through one reused host buffer on other devices,
  and through a reused buffer holding the whole record otherwise (slices of it for
  resharding, dtype casts, odd strides);
* when this rank verifies the file, every byte of it, gaps and other ranks' items included,
  goes through the checksum in file order right after it is read, while it is still in cache;
* otherwise (another rank checks the file whole) only the bytes the targets need are read
  (``_chunk_spans``): the rows of a resharded slice, not the whole item, each chunk checked
  against the manifest's per-chunk checksums when it has them.

Anything this module does not recognise (another pickle, several storages, a big-endian file)
is loaded the way DCP does it: the item's bytes through ``torch.load(weights_only=True)``, once
its zip cannot expand beyond its own bytes (``_declared``: no compressed or overlapping records).
A stored tensor must be the chunk the metadata declares (shape and dtype), whichever way it is
read. A compressed item (``store._codec``) is read whole, expanded in the reading thread and
loaded from memory (``_item_bytes.load_blob``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from muon_ckpt._errors import CheckpointCorruptError
from muon_ckpt._tensors import tensor_bytes
from muon_ckpt.load._chunk_spans import SpanReader
from muon_ckpt.load._declared import StoredChunks, load_object, load_stored
from muon_ckpt.load._item_bytes import load_blob
from muon_ckpt.load._item_zip import EDGE, Layout, parse_layout
from muon_ckpt.load._read_buffers import CHUNK, ReadBuffers
from muon_ckpt.load._targets import commit_part, commit_slices, narrow, slice_spans
from muon_ckpt.store import FileEntry, open_regular
from muon_ckpt.store.checksums import Checksum


class Edges:
    """The bytes of one stored item of a local file, read as the layout parser asks for them:
    its last ``EDGE`` bytes and its first ``EDGE`` bytes with one read each (a small item
    whole with one), anything outside them with a read of its own (``read``). ``pread`` is
    the ``FileLoad``'s (counted, truncation reported)."""

    def __init__(self, fd: int, offset: int, length: int, pread: Any) -> None:
        self._fd, self.offset, self.length, self._pread = fd, offset, length, pread
        self._held: list[tuple[int, memoryview]] = []  # (from, bytes) read so far

    def _fetch(self, lo: int, hi: int) -> memoryview:
        buf = memoryview(bytearray(hi - lo))
        self._pread(self._fd, buf, self.offset + lo)
        self._held.append((lo, buf))
        return buf

    def held(self, lo: int, hi: int) -> memoryview | None:
        """Bytes ``[lo, hi)`` of the item if already read, else None."""
        for at, buf in self._held:
            if at <= lo and hi <= at + len(buf):
                return buf[lo - at : hi - at]
        return None

    def read(self, lo: int, hi: int) -> memoryview:
        """Bytes ``[lo, hi)`` of the item."""
        if lo < 0 or hi > self.length or lo > hi:
            raise ValueError(f"bytes {lo}-{hi} of an item of {self.length}")
        if (got := self.held(lo, hi)) is not None:
            return got
        if self.length <= 2 * EDGE:
            return self._fetch(0, self.length)[lo:hi]
        if hi <= EDGE:
            return self._fetch(0, EDGE)[lo:hi]
        if lo >= self.length - EDGE:
            start = self.length - EDGE
            return self._fetch(start, self.length)[lo - start : hi - start]
        return self._fetch(lo, hi)


class _Pread:
    """``pread`` of all of ``mv`` from ``offset`` of ``fd``: the bytes counted, the time added to
    the reading thread's ``io`` phase, a file that ends early reported as truncated. Its own
    object, not a ``FileLoad`` method: the ``SpanReader`` and ``Edges`` a ``FileLoad`` holds
    keep it, and a bound method would make a cycle that keeps the load's planner (and through
    it the optimizer) alive until a full garbage collection."""

    def __init__(self, where: str, bufs: ReadBuffers) -> None:
        self._where, self._bufs = where, bufs
        self.count = 0

    def __call__(self, fd: int, mv: memoryview, offset: int) -> None:
        done, t0 = 0, time.perf_counter()
        while done < len(mv):
            got = os.preadv(fd, [mv[done:]], offset + done)
            if got == 0:
                raise CheckpointCorruptError(
                    f"{self._where}: file is truncated: it ends at byte {offset + done}, "
                    f"the checkpoint's metadata has data up to byte {offset + len(mv)}. "
                    "Load another step (muon-ckpt ls lists them) or restore this file"
                )
            done += got
            self.count += got
        self._bufs.phases["io"] += time.perf_counter() - t0


def item_layout(edges: Edges) -> Layout | None:
    """The layout of the dense tensor stored in an item of a local file (``_item_zip``), or
    None (torch.load's turn)."""
    return parse_layout(edges.read, edges.length)


class FileLoad:
    """Loads the requested items of one local file; with ``checksum``, also checksums the
    file (or its ``window``) on the way.

    ``where`` names the file in errors. Call :meth:`run`; it returns ``checksum`` over the
    whole file (or window) when verifying (the caller compares it with the manifest), else
    None. With
    ``window`` (``lo, hi``: chunk boundaries around the items), the checksum covers just
    those bytes, from ``lo`` (a ``Checksum.like(entry, start=lo)``): a file split into parts
    that run on several threads is checked window by window. Without ``checksum``, only the
    bytes the targets need are read, and checked against ``entry``'s per-chunk checksums when
    given. ``bytes_read``: what this load read from the file; ``file_size``: its size.
    ``shared``: the keys of targets whose memory overlaps another target's (never read into
    directly: ``_direct_target``). ``chunks``: what the metadata declares for each stored
    item (a stored tensor that is not its chunk is refused: ``_stored.UntrustedItem``).
    """

    def __init__(
        self,
        path: str,
        where: str,
        planner: LoadPlanner,
        checksum: Checksum | None,
        entry: FileEntry | None = None,
        *,
        chunks: StoredChunks,
        window: tuple[int, int] | None = None,
        buffers: ReadBuffers | None = None,
        shared: frozenset[str] = frozenset(),
    ) -> None:
        self._path, self._where, self._planner = path, where, planner
        self._chunks = chunks
        self._shared = shared
        self._sum, self._verify = checksum, checksum is not None
        self._window = window
        self._pos = window[0] if window is not None else 0
        self._own_bufs = buffers is None
        self._bufs = buffers if buffers is not None else ReadBuffers()
        self._pread = _Pread(where, self._bufs)
        self._spans = SpanReader(where, entry, self._pread)
        self.file_size = -1

    # ------------------------------------------------------------------ reading
    @property
    def bytes_read(self) -> int:
        return self._pread.count

    def _take(self, fd: int, mv: memoryview, offset: int) -> None:
        """Read ``mv`` from ``offset``; checksum it when verifying (offsets come in order)."""
        self._pread(fd, mv, offset)
        self._check(mv, offset)

    def _check(self, mv: Any, offset: int) -> None:
        """Checksum the bytes of the file from ``offset`` held in ``mv`` when verifying."""
        if self._sum is not None:
            if offset != self._pos:
                raise AssertionError(f"crc out of order: at {self._pos}, read at {offset}")
            t0 = time.perf_counter()
            self._sum.update(mv)
            self._bufs.phases["checksum"] += time.perf_counter() - t0
            self._pos = offset + len(mv)

    def _take_discard(self, fd: int, offset: int, end: int) -> None:
        """Bytes nobody here loads (gaps, other ranks' items): checksum only."""
        buf = self._bufs.chunk()
        while offset < end:
            n = min(CHUNK, end - offset)
            self._take(fd, buf[:n], offset)
            offset += n

    def _take_edge(self, fd: int, edges: Edges, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` of an item around its tensor's record: checksummed out of what
        its layout was parsed from when they are there, else read (the checksum needs them;
        without one they are not read)."""
        held = edges.held(lo, hi)
        if held is None:
            if self._verify:
                self._take_discard(fd, edges.offset + lo, edges.offset + hi)
            return
        self._check(held, edges.offset + lo)

    def _take_chunked(self, fd: int, target: torch.Tensor, offset: int, nbytes: int) -> None:
        """The record into ``target`` (contiguous, the stored dtype, all of it), chunk by chunk:
        straight into its memory on CPU; on CUDA through two page-locked chunk buffers, each
        chunk's copy to the device running while the next chunk is read; through one pageable
        buffer on other devices."""
        if target.device.type == "cpu":
            dst = tensor_bytes(target)
            for p in range(0, nbytes, CHUNK):
                self._take(fd, dst[p : p + CHUNK], offset + p)
            if not target.is_inference():
                # Written behind autograd's back: count it as the in-place write it is (as
                # DCP's copy_ does), so a graph that saved this tensor refuses to backprop.
                torch.autograd.graph.increment_version(target)
            return
        dst_t = target.reshape(-1).view(torch.uint8)
        if target.device.type == "cuda":
            stream = torch.cuda.current_stream(target.device)
            for i, p in enumerate(range(0, nbytes, CHUNK)):
                n = min(CHUNK, nbytes - p)
                buf, view, event = self._bufs.pinned(i % 2, target.device)
                self._take(fd, view[:n], offset + p)
                dst_t[p : p + n].copy_(buf[:n], non_blocking=True)
                event.record(stream)
            return
        buf, src = self._bufs.chunk(), self._bufs.chunk_tensor()
        for p in range(0, nbytes, CHUNK):
            n = min(CHUNK, nbytes - p)
            self._take(fd, buf[:n], offset + p)
            dst_t[p : p + n].copy_(src[:n])  # from pageable memory: done when it returns

    def _record_tensor(self, fd: int, lay: Layout, offset: int) -> torch.Tensor:
        """The whole record read into a reused buffer, viewed as the stored tensor."""
        if lay.nbytes == 0:
            return torch.empty(lay.size, dtype=lay.dtype)
        whole = self._bufs.record(lay.nbytes)
        mv = memoryview(whole)[: lay.nbytes]
        for p in range(0, lay.nbytes, CHUNK):
            self._take(fd, mv[p : p + CHUNK], offset + p)
        flat = torch.frombuffer(whole, dtype=torch.uint8, count=lay.nbytes)
        return flat.view(lay.dtype).as_strided(lay.size, lay.stride, lay.offset)

    # ------------------------------------------------------------------ items
    def _deliver(self, req: ReadItem, src: torch.Tensor) -> None:
        self._commit(req, narrow(src, req.storage_offsets, req.lengths))

    def _commit(self, req: ReadItem, src: torch.Tensor) -> None:
        """``src`` (the part of the stored tensor ``req`` wants) into its target."""
        commit_part(self._planner, req, src, self._where)

    def _direct_target(self, reqs: list[ReadItem], lay: Layout) -> torch.Tensor | None:
        """The target when the record can be read straight into it, else None."""
        if len(reqs) != 1 or not lay.whole_and_contiguous:
            return None
        req = reqs[0]
        if any(req.storage_offsets) or tuple(req.lengths) != lay.size:
            return None
        if req.dest_index.fqn in self._shared:
            # Its memory is another target's too (tied weights, a buffer inside another),
            # which another thread may write meanwhile: the bytes are checksummed in a buffer
            # of this thread's own before they are copied in, not in the target.
            return None
        target = self._planner.resolve_tensor(req).detach()
        ok = (
            target.dtype == lay.dtype
            and target.layout == torch.strided
            and tuple(target.size()) == lay.size
            and target.is_contiguous()
            and not target.is_conj()
            and not target.is_neg()
        )
        return target if ok else None

    def _whole_item(self, fd: int, offset: int, length: int) -> bytes | bytearray:
        """The item's bytes: through the file's checksum when verifying it whole, else
        checked by chunk (when the manifest has chunks)."""
        if self._verify or not self._spans.verifies:
            data = bytearray(length)
            self._take(fd, memoryview(data), offset)
            return data
        self._spans.read(fd, [(offset, offset + length)])
        return bytes(self._spans.view(offset, offset + length))

    def _load_ranged(
        self, fd: int, offset: int, length: int, lay: Layout, reqs: list[ReadItem]
    ) -> None:
        """Read only the bytes that ``reqs`` take from the stored tensor (one span from the
        first to the last element any of them takes), checked by chunk with the item's zip
        header and directory when the manifest has chunks; then copy each part out."""
        parts, lo, hi = slice_spans(lay, reqs)
        isz, data_at = lay.dtype.itemsize, offset + lay.start
        ranges = [(data_at + lo * isz, data_at + hi * isz)]
        if self._spans.verifies:  # the bytes that said where the tensor is, too
            ranges += [(offset, data_at), (data_at + lay.nbytes, offset + length)]
        self._spans.read(fd, ranges)
        view = self._spans.view(data_at + lo * isz, data_at + hi * isz) if hi > lo else None
        commit_slices(self._planner, lay, parts, lo, view, self._where)

    def _load_item(self, fd: int, offset: int, length: int, reqs: list[ReadItem]) -> None:
        if reqs[0].type == LoadItemType.BYTE_IO:
            data = self._whole_item(fd, offset, length)
            for req in reqs:
                load_object(data, req, self._planner.load_bytes, self._where)
            return
        if self._chunks.encoded(reqs[0]):  # compressed: its stored bytes, expanded here
            stored = self._whole_item(fd, offset, length)
            data = self._chunks.decode(reqs[0], stored, self._where)
            load_blob(data, reqs, self._planner, self._where, self._chunks, decoded=True)
            return
        edges = Edges(fd, offset, length, self._pread)
        lay = item_layout(edges)
        if lay is None:  # not a plain dense tensor: DCP's way, torch.load of the item
            data = self._whole_item(fd, offset, length)
            src = load_stored(data, reqs[0], self._chunks, self._where)
            for req in reqs:
                self._deliver(req, src)
            return
        self._chunks.check(reqs[0], lay.size, lay.dtype, self._where)
        target = self._direct_target(reqs, lay)
        if not self._verify and (target is None or self._spans.verifies):
            self._load_ranged(fd, offset, length, lay, reqs)
            return
        self._take_edge(fd, edges, 0, lay.start)
        if target is not None:
            self._take_chunked(fd, target, offset + lay.start, lay.nbytes)
            # The target is complete before the planner sees it, as with DCP's reader.
            self._bufs.drain()
            self._planner.commit_tensor(reqs[0], target)
        else:
            src = self._record_tensor(fd, lay, offset + lay.start)
            for req in reqs:
                self._deliver(req, src)
        if self._verify:
            self._take_edge(fd, edges, lay.start + lay.nbytes, length)

    def _capture(self, fd: int, offset: int, buf: memoryview) -> None:
        """A stored item's raw bytes into ``buf`` (read once here, sent to the other ranks
        that need it: ``_read_once``), through the file's checksum or checked by chunk."""
        if self._verify or not self._spans.verifies:
            self._take(fd, buf, offset)
            return
        self._spans.read(fd, [(offset, offset + len(buf))])
        buf[:] = self._spans.view(offset, offset + len(buf))

    def run(
        self,
        items: dict[int, tuple[int, list[ReadItem]]],
        capture: dict[int, memoryview] | None = None,
    ) -> Checksum | None:
        """``items``: stored item offset -> (its length, the read items it serves);
        ``capture``: stored item offset -> a buffer of its length, filled with its bytes."""
        fd = open_regular(self._path, self._where)  # no FIFO, device or symlink
        capture = capture or {}
        try:
            size = self.file_size = os.fstat(fd).st_size
            for off in sorted({*items, *capture}):
                length = items[off][0] if off in items else len(capture[off])
                if off + length > size:  # before any buffer is sized from the metadata
                    raise CheckpointCorruptError(
                        f"{self._where}: file is truncated: it has {size} bytes, the "
                        f"checkpoint's metadata has data up to byte {off + length}. Load "
                        "another step (muon-ckpt ls lists them) or restore this file"
                    )
                if self._verify:
                    self._take_discard(fd, self._pos, off)
                if off in capture:
                    self._capture(fd, off, capture[off])
                else:
                    self._load_item(fd, off, length, items[off][1])
            if self._sum is None:
                return None
            self._take_discard(fd, self._pos, size if self._window is None else self._window[1])
            return self._sum
        finally:
            try:
                if self._own_bufs:
                    self._bufs.release()
                else:
                    self._bufs.drain()
            finally:
                os.close(fd)
