"""One stored item already in memory (a remote read) into its targets, without ``torch.load``.

DCP's reader ``torch.load``s every item into fresh memory and copies it into the target. Here
the item's zip records are parsed in memory (``_itemzip``) and its tensor bytes viewed in place and copied into each target
(narrowed to the part a resharded target takes). An item that is not a plain dense tensor
goes through ``torch.load(weights_only=True)``, as in DCP; a non-tensor item to the planner.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from muon_ckpt._errors import CheckpointCorruptError
from muon_ckpt.io._itemread import _narrow, commit_part, commit_slices, slice_spans
from muon_ckpt.io._itemzip import EDGE, parse_layout
from muon_ckpt.io._ranged import SpanReader
from muon_ckpt.store import FileEntry, check_chunks, chunk_span

__all__ = ["Capture", "WholeItems", "fetch_items", "load_blob"]


class WholeItems:
    """Whether a read item takes its whole stored chunk (from the DCP metadata's chunk sizes),
    not a slice of it (a resharded rank's rows)."""

    def __init__(self, metadata: Any) -> None:
        self._md = metadata
        self._by_fqn: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}

    def __call__(self, item: ReadItem) -> bool:
        if item.type == LoadItemType.BYTE_IO:
            return True
        fqn = item.storage_index.fqn
        table = self._by_fqn.get(fqn)
        if table is None:
            meta = self._md.state_dict_metadata.get(fqn)
            chunks = getattr(meta, "chunks", None) or []
            table = self._by_fqn[fqn] = {tuple(c.offsets): tuple(c.sizes) for c in chunks}
        sizes = table.get(tuple(item.storage_index.offset or ()))
        return sizes is not None and not any(item.storage_offsets) and tuple(item.lengths) == sizes


class Capture:
    """Stands for the read items of a stored item that this rank reads only to send it to the
    ranks that need it (``_shared``): its bytes are copied into ``buf`` (of its length)."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf


def load_blob(data: Any, reqs: list[ReadItem] | Capture, planner: LoadPlanner, where: str) -> None:
    """``data``: the whole stored item that ``reqs`` read from (a bytes-like object, viewed in
    place, only read)."""
    if isinstance(reqs, Capture):
        reqs.buf[:] = memoryview(data).cast("B")
        return
    if reqs[0].type == LoadItemType.BYTE_IO:
        for req in reqs:
            planner.load_bytes(req, io.BytesIO(data))
        return
    view = memoryview(data).cast("B")
    lay = parse_layout(lambda lo, hi: view[lo:hi], len(view))
    if lay is None:
        src = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    elif lay.nbytes == 0:
        src = torch.empty(lay.size, dtype=lay.dtype)
    else:
        with warnings.catch_warnings():
            # bytes are read-only: torch warns that writing the view would be undefined; the
            # view is only the source of the copies below.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=torch.uint8, count=lay.nbytes, offset=lay.start)
        src = flat.view(lay.dtype).as_strided(lay.size, lay.stride, lay.offset)
    for req in reqs:
        commit_part(planner, req, _narrow(src, req.storage_offsets, req.lengths), where)


def fetch_items(
    step: Any,
    name: str,
    where: str,
    items: dict[int, tuple[int, list[ReadItem] | Capture]],
    planner: LoadPlanner,
    entry: FileEntry | None,
    whole: Any = None,
) -> int:
    """The stored items of remote file ``name`` that this rank reads (offset -> (length, read
    items)), one ranged read each; with ``entry`` (a format-2 entry: checksums on), each read
    is widened to whole checksum chunks and checked before the item is loaded. An item of
    which every read item takes a slice (``whole``: ``WholeItems``) is read in part: its zip
    records at both ends, then the span of the slices' elements. Returns the bytes read."""
    chunked = entry is not None and entry.chunk_bytes is not None
    entry = entry if chunked else None

    def in_part(reqs: list[ReadItem] | Capture) -> bool:
        return whole is not None and isinstance(reqs, list) and not any(map(whole, reqs))

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
                done, got = _fetch_slices(f, off, length, reqs, planner, where, entry)
                read += got
                if done:
                    continue
            read += _fetch_one(f, off, length, reqs, planner, where, entry)
    return read


def _fetch_slices(
    f: Any,
    off: int,
    length: int,
    reqs: list[ReadItem],
    planner: LoadPlanner,
    where: str,
    entry: FileEntry | None,
) -> tuple[bool, int]:
    """The slices ``reqs`` take of the item at ``off``, read in part (``fetch_items``):
    whether they were loaded (not when the item's records cannot be parsed from its ends:
    the caller reads it whole), and the bytes read."""
    count = [0]

    def pread(fd: Any, mv: memoryview, at: int) -> None:
        fd.seek(at)
        done = 0
        while done < len(mv):
            got = fd.readinto(mv[done:]) or 0
            if got == 0:
                raise CheckpointCorruptError(
                    f"{where}: file is truncated: it ends at byte {at + done}, the "
                    f"checkpoint's metadata has data up to byte {at + len(mv)}. Load another "
                    "step (muon-ckpt ls lists them) or restore this file"
                )
            done += got
        count[0] += len(mv)

    spans = SpanReader(where, entry, pread)
    edge = min(length, EDGE)
    spans.read(f, [(off, off + edge), (off + length - edge, off + length)])
    lay = parse_layout(lambda a, b: spans.view(off + a, off + b), length)
    if lay is None:
        return False, count[0]
    parts, lo, hi = slice_spans(lay, reqs)
    isz, data_at = lay.dtype.itemsize, off + lay.start
    view = None
    if hi > lo:
        spans.read(f, [(data_at + lo * isz, data_at + hi * isz)])
        view = spans.view(data_at + lo * isz, data_at + hi * isz)
    commit_slices(planner, lay, parts, lo, view, where)
    return True, count[0]


def _fetch_one(
    f: Any,
    off: int,
    length: int,
    reqs: list[ReadItem] | Capture,
    planner: LoadPlanner,
    where: str,
    entry: FileEntry | None,
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
    load_blob(data, reqs, planner, where)
    return got
