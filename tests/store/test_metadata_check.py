"""The ``.metadata``'s check at scale: the Python calls of reading and checking a step's
metadata do not grow with the ranks; a tensor's chunk objects are built only when a reader
takes them, and then are DCP's; every problem is still found and the first one, in the
metadata's order, named, whether or not the rows are in the order a save stores them."""

from __future__ import annotations

import copy
import math
import operator
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from muon_ckpt import CheckpointCorruptError
from muon_ckpt.store._metadata import check_ranges
from muon_ckpt.store.dcp import ChunkList, metadata_bytes, parse_metadata
from tests._calls import calls

_F32 = TensorProperties(dtype=torch.float32)
# (layers of one shape: their chunks are the very same offsets and sizes in the pickle)
_SHAPES = {f"l{i}.{w}": s for i in range(3) for w, s in (("w", (512, 8)), ("b", (512,)))}


def _save(n: int, shapes: dict[str, tuple[int, ...]] = _SHAPES) -> tuple[Metadata, dict]:
    """DCP's metadata of a Shard(0) save on ``n`` ranks as the global plan makes it (its
    chunks ``ChunkList``s), each rank's items in a file of its own in byte order, rank by
    rank (as a save stores them); and the files' sizes."""
    state: dict[str, Any] = {}
    rows: list[tuple[int, str, Any, int]] = []
    for key, shape in shapes.items():
        chunks, per = ChunkList(), -(-shape[0] // n)
        for r in range(n):
            start = min(r * per, shape[0])
            size = max(0, min(shape[0], start + per) - start)
            offsets = torch.Size([start, *[0] * (len(shape) - 1)])
            if any(c.offsets == offsets for c in chunks):
                continue  # (DCP keeps one of equal indexes: the empty shards at the end)
            chunks.add(ChunkStorageMetadata(offsets, torch.Size([size, *shape[1:]])))
            rows.append((r, key, offsets, 4 * size * math.prod(shape[1:]) + 100))
        state[key] = TensorStorageMetadata(_F32, torch.Size(shape), chunks)
    state["lr"] = BytesStorageMetadata()
    rows.append((0, "lr", None, 60))
    items, at = {}, [0] * n
    for r, key, offsets, length in sorted(rows, key=lambda row: row[0]):
        items[MetadataIndex(key, offsets)] = _StorageInfo(f"__{r}_0.distcp", at[r], length)
        at[r] += length
    sizes = {f"__{r}_0.distcp": at[r] for r in range(n)}
    return Metadata(state, planner_data={}, storage_data=items), sizes


def _check(md: Metadata, sizes: dict[str, int]) -> Metadata:
    got = parse_metadata(metadata_bytes(md), "here")
    check_ranges(got, sizes, "here")
    return got


def test_reading_and_checking_a_steps_metadata_is_the_same_python_calls_at_any_ranks():
    """Passes in C over the columns, each layout checked once, no chunk object built: the
    Python calls depend on the tensors, not on the ranks (a chunk object each grew them)."""
    _check(*_save(2))  # (torch's and the unpickler's first-use work out of the count)
    steps = {n: _save(n) for n in (64, 256)}
    small, large = (calls(lambda md=md: _check(*md)) for md in steps.values())
    assert large <= 1.1 * small, f"{small} calls at 64 ranks, {large} at 256"


def test_chunk_objects_are_built_when_first_used_and_are_dcps():
    md, sizes = _save(5)
    got = _check(md, sizes)
    for key, meta in got.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        chunks, want = meta.chunks, list(md.state_dict_metadata[key].chunks)
        assert isinstance(chunks, ChunkList) and list.__len__(chunks) == 0  # (none built)
        assert len(chunks) == len(want) and bool(chunks)
        assert chunks.columns() == ([c.offsets for c in want], [c.sizes for c in want])
        assert chunks.part(1, 3) == want[1:3] and list.__len__(chunks) == 0
        assert chunks == want  # (the first use as a list builds them)
        assert type(chunks) is ChunkList and list.__len__(chunks) == len(want)
        assert all(type(c) is ChunkStorageMetadata for c in chunks)
    # Every way of reading a list, on chunks not built yet
    uses: list[Callable[[Any], Any]] = [
        list,
        len,
        lambda c: c[1],
        lambda c: c[-2:],
        lambda c: list(reversed(c)),
        lambda c: c[0] in c,
        lambda c: c.index(c[2]),
        lambda c: c.count(c[0]),
        lambda c: operator.add(c, [1]),
        lambda c: operator.add([1], c),
        lambda c: c * 2,
        repr,
        lambda c: c.copy(),
        lambda c: copy.deepcopy(c),
        lambda c: pickle.loads(pickle.dumps(c)),
        lambda c: sorted(c, key=lambda x: -x.offsets[0]),
        lambda c: [x for x in c],
        lambda c: c != [],
    ]
    want = list(md.state_dict_metadata["l1.w"].chunks)
    for use in uses:
        chunks = parse_metadata(metadata_bytes(md), "here").state_dict_metadata["l1.w"].chunks
        assert use(chunks) == use(list(want)), use
    chunks = parse_metadata(metadata_bytes(md), "here").state_dict_metadata["l1.w"].chunks
    chunks.append(want[0])
    assert chunks == [*want, want[0]] and chunks.columns() is None  # (no longer its columns)


def test_a_layout_checked_for_one_tensor_is_checked_again_for_a_smaller_one():
    """Two tensors whose chunks are the very same offsets and sizes but of other sizes: the
    layout fits the first, not the second."""
    md, sizes = _save(4, {"a": (96, 8), "b": (96, 8)})
    state = md.state_dict_metadata
    state["b"] = TensorStorageMetadata(_F32, torch.Size([90, 8]), state["b"].chunks)
    with pytest.raises(CheckpointCorruptError, match=r"tensor 'b' has a chunk at \[72, 0\]"):
        _check(md, sizes)


def test_equal_chunks_of_another_type_are_checked_not_taken_for_a_checked_layout():
    md, sizes = _save(4, {"a": (96, 8), "b": (96, 8)})
    chunks = ChunkList()  # (b's chunks equal a's, one size of floats: 24.0 == 24)
    for c in md.state_dict_metadata["a"].chunks:
        chunks.add(ChunkStorageMetadata(c.offsets, (float(c.sizes[0]), c.sizes[1])))
    md.state_dict_metadata["b"].chunks = chunks
    with pytest.raises(CheckpointCorruptError, match=r"tensor 'b' of 2 dimensions has the chunk"):
        _check(md, sizes)


def test_of_two_problems_the_first_in_the_metadatas_order_is_named():
    """a's item too short (found by its rows), b's chunks leaving a gap (found by its
    layout, which is checked before any row): a's is named, as the checks one by one do."""
    md, sizes = _save(4, {"a": (96, 8), "b": (96, 8)})
    items = md.storage_data
    key = MetadataIndex("a", torch.Size([24, 0]))
    was = items[key]
    items[key] = _StorageInfo(was.relative_path, was.offset, 10)
    chunks = ChunkList()
    for c in list(md.state_dict_metadata["b"].chunks)[:-1]:
        chunks.add(c)
    md.state_dict_metadata["b"].chunks = chunks
    del items[MetadataIndex("b", torch.Size([72, 0]))]
    with pytest.raises(CheckpointCorruptError, match=r"tensor 'a' declares 768 bytes"):
        _check(md, sizes)
    items[key] = was
    with pytest.raises(CheckpointCorruptError, match=r"tensor 'b' has no chunk that stores"):
        _check(md, sizes)


def test_rows_in_another_order_are_found_as_dcps_dict_finds_them():
    """A key's items stored in another order than its chunks' (not a save's): checked and
    found all the same."""
    md, sizes = _save(4)
    items = list(md.storage_data.items())
    items[0], items[3] = items[3], items[0]
    items[1], items[-1] = items[-1], items[1]
    md.storage_data = dict(items)
    got = _check(md, sizes)
    assert dict(got.storage_data.items()) == md.storage_data
    for key, info in md.storage_data.items():
        assert got.storage_data[key] == info


def test_items_of_a_file_in_two_runs_are_checked_apart():
    """A file's items not all one after another in the rows: apart they pass, overlapping
    they are refused (naming the overlap), as in save order."""
    md, sizes = _save(2)
    items = list(md.storage_data.items())
    items.append(items.pop(0))  # (rank 0's first item last, after rank 1's)
    md.storage_data = dict(items)
    _check(md, sizes)
    key, info = items[-1]
    md.storage_data[key] = _StorageInfo(info.relative_path, info.offset + 50, info.length)
    with pytest.raises(
        CheckpointCorruptError, match=r"items at bytes .* of '__0_0.distcp' overlap"
    ):
        _check(md, sizes)
