"""One stored item already in memory (a remote read) into its targets, without ``torch.load``.

DCP's reader ``torch.load``s every item into fresh memory and copies it into the target. Here
the item's zip records are parsed in memory (``_item_zip``) and its tensor bytes viewed in place
and copied into each target (narrowed to the part a resharded target takes), once the stored
tensor is the one its chunk declares. An item that is not a plain dense tensor goes through
``torch.load(weights_only=True)``, as in DCP, and a non-tensor item to the planner, each once
its zip cannot expand beyond its bytes (``_declared``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from muon_ckpt._errors import CheckpointCorruptError
from muon_ckpt.load._chunk_spans import SpanReader
from muon_ckpt.load._declared import StoredChunks, load_object, load_stored
from muon_ckpt.load._item_zip import EDGE, Layout, parse_layout
from muon_ckpt.load._targets import commit_part, commit_slices, narrow, slice_spans
from muon_ckpt.store import FileEntry
from muon_ckpt.store.checksums import check_chunks, chunk_span

__all__ = ["Capture", "fetch_items", "load_blob", "read_into"]


class Capture:
    """Stands for the read items of a stored item that this rank reads only to send it to the
    ranks that need it (``_read_once``): its bytes are copied into ``buf`` (of its length)."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf


def load_blob(
    data: Any,
    reqs: list[ReadItem] | Capture,
    planner: LoadPlanner,
    where: str,
    chunks: StoredChunks,
    *,
    decoded: bool = False,
) -> None:
    """``data``: the whole stored item that ``reqs`` read from (a bytes-like object, viewed in
    place, only read), expanded here when compressed unless ``decoded`` (already, by a reading
    thread); ``chunks``: what the metadata declares for it."""
    if isinstance(reqs, Capture):
        reqs.buf[:] = memoryview(data).cast("B")
        return
    if reqs[0].type == LoadItemType.BYTE_IO:
        for req in reqs:
            load_object(data, req, planner.load_bytes, where)
        return
    if not decoded:
        data = chunks.decode(reqs[0], data, where)
    view = memoryview(data).cast("B")
    lay = parse_layout(lambda lo, hi: view[lo:hi], len(view))
    src = load_stored(data, reqs[0], chunks, where) if lay is None else _view(data, lay)
    if lay is not None:
        chunks.check(reqs[0], lay.size, lay.dtype, where)
    for req in reqs:
        commit_part(planner, req, narrow(src, req.storage_offsets, req.lengths), where)


def _view(data: Any, lay: Layout) -> torch.Tensor:
    """The stored tensor of layout ``lay``, viewed in the item's bytes ``data``."""
    if lay.nbytes == 0:
        return torch.empty(lay.size, dtype=lay.dtype)
    with warnings.catch_warnings():
        # bytes are read-only: torch warns that writing the view would be undefined; the
        # view is only the source of the copies below.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8, count=lay.nbytes, offset=lay.start)
    return flat.view(lay.dtype).as_strided(lay.size, lay.stride, lay.offset)


def fetch_items(
    step: Any,
    name: str,
    where: str,
    items: dict[int, tuple[int, list[ReadItem] | Capture]],
    planner: LoadPlanner,
    entry: FileEntry | None,
    chunks: StoredChunks,
) -> int:
    """The stored items of remote file ``name`` that this rank reads (offset -> (length, read
    items)), one ranged read each; with ``entry`` (a format-2 entry: checksums on), each read
    is widened to whole checksum chunks and checked before the item is loaded. An item of
    which every read item takes a slice (``chunks.whole``) is read in part: its zip records
    at both ends, then the span of the slices' elements. Returns the bytes read."""
    chunked = entry is not None and entry.chunk_bytes is not None
    entry = entry if chunked else None

    def in_part(reqs: list[ReadItem] | Capture) -> bool:  # (a compressed item: read whole)
        return (
            isinstance(reqs, list)
            and not any(map(chunks.whole, reqs))
            and not chunks.encoded(reqs[0])
        )

    # One open file, items in file order. Each run of whole items without a gap between
    # them is read ahead (in requests of up to STREAM_BLOCK: one cat_file per item was 2.6x
    # slower against S3 on moto, 4.0 s against 1.5 s for 0.25 GiB); an item read in part
    # fetches exactly the bytes it reads.
    offs = sorted(items)
    runs: list[tuple[int, int]] = []
    for off in offs:
        length, reqs = items[off]
        if in_part(reqs):
            continue
        lo, hi = chunk_span(entry, off, off + length) if entry is not None else (off, off + length)
        if runs and runs[-1][1] >= lo:
            runs[-1] = (runs[-1][0], max(runs[-1][1], hi))
        else:
            runs.append((lo, hi))
    read = 0
    with step.open(name, ahead=runs) as f:
        for off in offs:
            length, reqs = items[off]
            if in_part(reqs):
                done, got = _fetch_slices(f, off, length, reqs, planner, where, entry, chunks)
                read += got
                if done:
                    continue
            read += _fetch_one(f, off, length, reqs, planner, where, entry, chunks)
    return read


def _fetch_slices(
    f: Any,
    off: int,
    length: int,
    reqs: list[ReadItem],
    planner: LoadPlanner,
    where: str,
    entry: FileEntry | None,
    chunks: StoredChunks,
) -> tuple[bool, int]:
    """The slices ``reqs`` take of the item at ``off``, read in part (``fetch_items``):
    whether they were loaded (not when the item's records cannot be parsed from its ends:
    the caller reads it whole), and the bytes read."""
    count = [0]

    def pread(fd: Any, mv: memoryview, at: int) -> None:
        read_into(fd, mv, at, where)
        count[0] += len(mv)

    spans = SpanReader(where, entry, pread)
    edge = min(length, EDGE)
    spans.read(f, [(off, off + edge), (off + length - edge, off + length)])
    lay = parse_layout(lambda a, b: spans.view(off + a, off + b), length)
    if lay is None:
        return False, count[0]
    chunks.check(reqs[0], lay.size, lay.dtype, where)
    parts, lo, hi = slice_spans(lay, reqs)
    isz, data_at = lay.dtype.itemsize, off + lay.start
    view = None
    if hi > lo:
        spans.read(f, [(data_at + lo * isz, data_at + hi * isz)])
        view = spans.view(data_at + lo * isz, data_at + hi * isz)
    commit_slices(planner, lay, parts, lo, view, where)
    return True, count[0]


def read_into(f: Any, mv: memoryview, at: int, where: str) -> None:
    """Bytes ``[at, at + len(mv))`` of the open file ``f`` (of ``where``) into ``mv``: all of
    them, or a CheckpointCorruptError (the file ends first)."""
    f.seek(at)
    done = 0
    while done < len(mv):
        got = f.readinto(mv[done:]) or 0
        if got == 0:
            raise CheckpointCorruptError(
                f"{where}: file is truncated: it ends at byte {at + done}, the "
                f"checkpoint's metadata has data up to byte {at + len(mv)}. Load another "
                "step (muon-ckpt ls lists them) or restore this file"
            )
        done += got


def _fetch_one(
    f: Any,
    off: int,
    length: int,
    reqs: list[ReadItem] | Capture,
    planner: LoadPlanner,
    where: str,
    entry: FileEntry | None,
    chunks: StoredChunks,
) -> int:
    lo, hi = chunk_span(entry, off, off + length) if entry is not None else (off, off + length)
    f.seek(lo)
    raw = bytearray(hi - lo)
    got = f.readinto(raw) or 0
    if got != hi - lo:
        raise CheckpointCorruptError(
            f"{where}: file is truncated: bytes {lo}-{hi} gave {got} bytes. Load "
            "another step (muon-ckpt ls lists them) or restore this file"
        )
    if entry is not None and check_chunks(entry, lo, raw, where):
        raise CheckpointCorruptError(
            f"{where}: file is corrupt: the {entry.algorithm} of its bytes {lo}-{hi} "
            "differs from the manifest's. Load another step (muon-ckpt ls lists them) or "
            "restore this file"
        )
    data = raw if (lo, hi) == (off, off + length) else raw[off - lo : off - lo + length]
    load_blob(data, reqs, planner, where, chunks)
    return got
