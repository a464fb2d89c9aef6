"""What a stored item must be before the readers use it: the tensor its chunk declares, and, for
an item that goes to ``torch.load``, a zip that cannot expand beyond its own bytes.

The DCP metadata (checked once, ``store``: chunks tile each tensor, each chunk's item holds at
least its bytes) declares each stored chunk's shape and dtype; a stored tensor of another shape
or dtype would be narrowed or cast silently into the target, so it is a corrupt step, naming
the file and the key (``StoredChunks.check``). An item the layout parser (``_item_zip``) does not
recognise, and every non-tensor item, is loaded by ``torch.load(weights_only=True)`` only after
``_item_zip.unbounded_records`` finds every record stored, inside the item and apart from the
others: torch.load's zip reader inflates deflated records and reads overlapping entries once
each, which made a 300 KiB item allocate a gigabyte (``load_stored``). A compressed item
(``store._codec``) is expanded first, to at most its chunk's bytes and the zip's
(``StoredChunks.decode``), and then read as any other.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from muon_ckpt._dcp import UntrustedItem
from muon_ckpt.load._item_zip import unbounded_records
from muon_ckpt.store.codec import ZIP_SLACK, BadEncoding, decode
from muon_ckpt.store.dcp import ChunkList

__all__ = ["StoredChunks", "UntrustedItem", "load_object", "load_stored"]

_Chunk = tuple[tuple[int, ...], torch.dtype]


class StoredChunks:
    """The shape and dtype the DCP metadata declares for each stored chunk, by the read items
    that name it; ``whole(item)``: whether a read item takes its whole stored chunk, not a
    slice of it (a resharded rank's rows)."""

    def __init__(self, metadata: Any) -> None:
        self._md = metadata
        self._by_fqn: dict[str, dict[tuple[int, ...], _Chunk]] = {}

    def declared(self, item: ReadItem) -> _Chunk | None:
        """The declared (sizes, dtype) of the chunk ``item`` reads from (None: not a tensor)."""
        fqn = item.storage_index.fqn
        table = self._by_fqn.get(fqn)
        if table is None:
            meta = self._md.state_dict_metadata.get(fqn)
            chunks = getattr(meta, "chunks", None) or []
            dtype = getattr(getattr(meta, "properties", None), "dtype", None)
            # (from the columns where there are: the chunk objects are not built for this)
            cols = chunks.columns() if isinstance(chunks, ChunkList) else None
            pairs = zip(*cols) if cols else ((c.offsets, c.sizes) for c in chunks)
            table = {tuple(o): (tuple(s), dtype) for o, s in pairs}
            self._by_fqn[fqn] = table
        return table.get(tuple(item.storage_index.offset or ()))

    def encoded(self, item: ReadItem) -> bool:
        """Whether the item ``item`` reads from is compressed (``store._codec``; the metadata's
        check admits that encoding only, and only for tensors)."""
        info = self._md.storage_data.get(item.storage_index)
        return bool(getattr(info, "transform_descriptors", None))

    def decode(self, item: ReadItem, data: Any, where: str) -> Any:
        """``data`` (the stored bytes of ``item``'s item) as ``torch.save`` wrote them: itself,
        or expanded when compressed, to at most its chunk's bytes and ``ZIP_SLACK``; else
        UntrustedItem."""
        if not self.encoded(item):
            return data
        chunk = self.declared(item)
        key = item.storage_index.fqn
        if chunk is None or chunk[1] is None:
            raise UntrustedItem(f"{where}: the compressed item of {key[:200]!r} has no chunk")
        bound = math.prod(chunk[0]) * chunk[1].itemsize + ZIP_SLACK
        try:
            return decode(data, bound, where, key)
        except BadEncoding as e:
            raise UntrustedItem(str(e)) from e

    def whole(self, item: ReadItem) -> bool:
        if item.type == LoadItemType.BYTE_IO:
            return True
        chunk = self.declared(item)
        return (
            chunk is not None and not any(item.storage_offsets) and tuple(item.lengths) == chunk[0]
        )

    def check(self, item: ReadItem, size: Any, dtype: torch.dtype, where: str) -> None:
        """The stored tensor that ``item`` reads from (``size``, ``dtype``) is its chunk as
        declared; else UntrustedItem naming the file and the key."""
        chunk = self.declared(item)
        if chunk is not None and chunk == (tuple(size), dtype):
            return
        idx = item.storage_index
        want = "no tensor" if chunk is None else f"{chunk[1]} of shape {list(chunk[0])}"
        raise UntrustedItem(
            f"{where}: cannot load it: the item of {idx.fqn[:200]!r} at "
            f"{list(idx.offset or ())} holds {dtype} of shape {list(size)}, the checkpoint's "
            f"metadata declares {want}; the step cannot be trusted. Load another step "
            "(muon-ckpt ls lists them)"
        )


def _bounded(data: Any, where: str, key: str) -> None:
    view = memoryview(data).cast("B")
    why = unbounded_records(lambda lo, hi: view[lo:hi], len(view))
    if why is not None:
        raise UntrustedItem(
            f"{where}: cannot load it: the item of {key[:200]!r} ({len(view)} bytes) {why}, so "
            "torch.load could allocate far more than its size; the step cannot be trusted. "
            "Load another step (muon-ckpt ls lists them)"
        )


def load_stored(data: Any, item: ReadItem, chunks: StoredChunks, where: str) -> torch.Tensor:
    """The tensor stored in ``data`` (a whole item that the layout parser declined), through
    ``torch.load(weights_only=True)`` once its records are bounded, checked against its chunk."""
    key = item.storage_index.fqn
    _bounded(data, where, key)
    src = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(src, torch.Tensor):
        raise UntrustedItem(
            f"{where}: cannot load it: the item of {key[:200]!r} holds a "
            f"{type(src).__name__}, the checkpoint's metadata declares a tensor; the step "
            "cannot be trusted. Load another step (muon-ckpt ls lists them)"
        )
    chunks.check(item, src.shape, src.dtype, where)
    return src


def load_object(
    data: Any, item: ReadItem, load_bytes: Callable[[ReadItem, io.BytesIO], None], where: str
) -> None:
    """A non-tensor item (``data``: its bytes) through the planner's ``load_bytes`` (which
    torch.loads it), once its records are bounded."""
    _bounded(data, where, item.storage_index.fqn)
    load_bytes(item, io.BytesIO(data))
