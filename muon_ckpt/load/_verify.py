"""A step verified as a load would find it: its files (presence, sizes, checksums), what a
load checks before it reads (``store.verify``: the metadata, every tensor's coverage, every
item's bounds) and every stored item as the load path parses it when it reads (``check_items``),
through the same functions: ``_declared`` (the declared chunk, bounded zips, ``weights_only``
values), ``_item_zip`` (the layout parser) and ``_local_files``' item reader. A tensor item is
parsed from its zip's two ends, not materialised: verifying needs the memory of one item.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from muon_ckpt._errors import CheckpointError
from muon_ckpt.load._corruption import parsing, prefer_corruption
from muon_ckpt.load._declared import StoredChunks, load_object, load_stored
from muon_ckpt.load._item_bytes import read_into
from muon_ckpt.load._item_zip import parse_layout
from muon_ckpt.load._local_files import Edges, item_layout
from muon_ckpt.load._planner import load_value
from muon_ckpt.store import Resolved, Storage, VerifyResult
from muon_ckpt.store import verify as verify_files

__all__ = ["check_items", "verify_step"]


def verify_step(r: Resolved, *, progress: bool | None = None, tiles: bool = True) -> VerifyResult:
    """``store.verify`` of ``r`` with every item checked as a load reads it: its
    ``VerifyResult`` has a problem wherever a load of the step would raise before applying
    anything (``tiles``: False for a memory-tier part, which holds one rank's shards)."""
    return verify_files(r, progress=progress, tiles=tiles, check_items=check_items)


def check_items(step: Storage, md: Metadata) -> list[str]:
    """The problems of the stored items a load of ``md`` reads (step: the storage rooted at
    the step's directory; ``md`` checked by ``store``: every item inside its file), one per
    item that a load refuses, each naming the file and the key."""
    chunks = StoredChunks(md)
    by_file: dict[str, list[tuple[int, int, ReadItem]]] = {}
    for idx, info in md.storage_data.items():
        item = _read_item(md, idx, chunks)
        if item is not None:
            by_file.setdefault(info.relative_path, []).append((info.offset, info.length, item))
    problems = []
    for name, items in sorted(by_file.items()):
        where = step.url_of(name)
        pread = partial(read_into, where=where)
        with step.open(name) as f:
            for off, length, item in sorted(items, key=lambda x: x[0]):
                why = _problem(Edges(f, off, length, pread), item, chunks, where)
                if why is not None:
                    problems.append(why)
    return problems


def _read_item(md: Metadata, idx: Any, chunks: StoredChunks) -> ReadItem | None:
    """The read item a load of the whole of ``idx``'s chunk makes, or None when no load reads
    the item (no key or chunk of the metadata names it)."""
    meta = md.state_dict_metadata.get(idx.fqn)
    if meta is None:
        return None
    if not isinstance(meta, TensorStorageMetadata):
        if idx.offset is not None:
            return None
        return ReadItem(
            LoadItemType.BYTE_IO, idx, torch.Size([]), idx, torch.Size([]), torch.Size([])
        )
    zeros = torch.Size([0] * len(meta.size))
    item = ReadItem(LoadItemType.TENSOR, idx, zeros, idx, zeros, zeros)
    declared = chunks.declared(item)
    if declared is None:
        return None
    sizes = torch.Size(declared[0])
    return ReadItem(LoadItemType.TENSOR, idx, zeros, idx, zeros, sizes)


def _problem(edges: Edges, item: ReadItem, chunks: StoredChunks, where: str) -> str | None:
    """Why a load refuses the item ``edges`` reads, or None. Its file's checksums matched
    (``store.verify``), so there is no corruption to prefer (``prefer_corruption``): an
    untrusted item is a corrupt step, anything else the parsers raise a CheckpointError, as
    the load reports them."""
    try:
        prefer_corruption(
            lambda: parsing(lambda: _check(edges, item, chunks, where), where), lambda: None
        )
    except CheckpointError as e:
        return str(e)
    return None


def _check(edges: Edges, item: ReadItem, chunks: StoredChunks, where: str) -> None:
    """One item as ``FileLoad._load_item`` takes it, its tensor copied nowhere."""
    if item.type == LoadItemType.BYTE_IO:
        load_object(_whole(edges), item, lambda _item, value: load_value(value), where)
        return
    if chunks.encoded(item):  # compressed: expanded (bounded) and parsed as the load does
        data = chunks.decode(item, _whole(edges), where)
        view = memoryview(data)
        lay = parse_layout(lambda lo, hi: view[lo:hi], len(view))
        if lay is None:
            load_stored(data, item, chunks, where)
        else:
            chunks.check(item, lay.size, lay.dtype, where)
        return
    lay = item_layout(edges)
    if lay is None:  # not a plain dense tensor: torch.load of the item, bounded first
        load_stored(_whole(edges), item, chunks, where)
        return
    chunks.check(item, lay.size, lay.dtype, where)


def _whole(edges: Edges) -> memoryview:
    return edges.read(0, edges.length)
