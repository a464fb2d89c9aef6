"""The ``.metadata`` in columns: plain ``pickle.load`` (DCP's own readers) builds from it the
Metadata DCP's pickle holds; store's reader keeps its stored items as columns and finds each
as DCP's dict does; its writing is a fixed number of Python calls whatever the ranks, and it
stores each equal offset, size and name once."""

from __future__ import annotations

import pickle
import sys
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
from muon_ckpt.store._index import Call, pickled_items
from muon_ckpt.store.dcp import StorageIndex, metadata_bytes, parse_metadata

_F32 = TensorProperties(dtype=torch.float32)
_SHAPES = {"a": (700, 4), "b.w2": (300, 19), "c": (500,)}


def _step(n: int) -> Metadata:
    """DCP's metadata of a Shard(0) save of ``_SHAPES`` on ``n`` ranks (as torch.chunk cuts,
    empty shards at the end once), an object, each rank's items in a file of its own, as
    DCP's finish makes it: its stored items a dict, rank by rank."""
    state: dict[str, Any] = {}
    items: dict[MetadataIndex, _StorageInfo] = {}
    at = [0] * n
    for key, shape in _SHAPES.items():
        per, rows, chunks = -(-shape[0] // n), shape[0], []
        for r in range(n):
            start = min(r * per, rows)
            size = max(0, min(rows, start + per) - start)
            offsets = torch.Size([start, *[0] * (len(shape) - 1)])
            if any(c.offsets == offsets for c in chunks):
                continue  # (DCP keeps one of equal indexes: the empty shards at the end)
            chunks.append(ChunkStorageMetadata(offsets, torch.Size([size, *shape[1:]])))
            length = 4 * size * (shape[1] if len(shape) > 1 else 1) + 1000
            items[MetadataIndex(key, offsets)] = _StorageInfo(f"__{r}_0.distcp", at[r], length)
            at[r] += length
        state[key] = TensorStorageMetadata(_F32, torch.Size(shape), chunks)
    state["lr"] = BytesStorageMetadata()
    items[MetadataIndex("lr")] = _StorageInfo("__0_0.distcp", at[0], 600)
    by_rank = sorted(items.items(), key=lambda kv: int(kv[1].relative_path[2:].split("_")[0]))
    return Metadata(state, planner_data={k: (k,) for k in state}, storage_data=dict(by_rank))


def _calls(fn: Callable[[], Any]) -> int:
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


@pytest.mark.parametrize("n", [1, 5, 64])
def test_plain_pickle_reads_the_metadata_dcp_pickles(n):
    md = _step(n)
    data = metadata_bytes(md)
    got = pickle.loads(data)  # (what torch's FileSystemReader.read_metadata does)
    assert got == md
    assert type(got.storage_data) is dict and list(got.storage_data) == list(md.storage_data)
    assert all(
        type(c) is ChunkStorageMetadata
        for m in got.state_dict_metadata.values()
        for c in getattr(m, "chunks", [])
    )
    parsed = parse_metadata(data, "here")
    assert isinstance(parsed.storage_data, StorageIndex)
    assert dict(parsed.storage_data.items()) == md.storage_data
    assert parsed.state_dict_metadata == md.state_dict_metadata


def test_writing_the_metadata_is_the_same_work_at_any_ranks_and_stores_offsets_once():
    """Python calls to write it do not grow with the ranks (DCP's pickle makes one per stored
    item); it takes half the bytes of DCP's pickle or less."""
    steps = {n: _step(n) for n in (64, 256)}
    small, large = (_calls(lambda md=md: metadata_bytes(md)) for md in steps.values())
    assert large <= 1.1 * small, f"{small} calls at 64 ranks, {large} at 256"
    assert len(metadata_bytes(steps[256])) * 2 < len(pickle.dumps(steps[256]))


def test_stored_items_are_found_as_dcps_dict_finds_them():
    md = _step(7)
    index = parse_metadata(metadata_bytes(md), "here").storage_data
    for key, info in md.storage_data.items():
        assert index[key] == info
        if key.offset is not None:  # (a hint right, wrong, or past the end: the same item)
            for hint in (0, 3, 99):
                assert index[MetadataIndex(key.fqn, key.offset, hint)] == info
    for missing in (MetadataIndex("a", (1, 0)), MetadataIndex("zz"), MetadataIndex("lr", (0,))):
        assert missing not in index
        with pytest.raises(KeyError):
            index[missing]
    assert len(index) == len(md.storage_data) and set(index) == set(md.storage_data)


def test_an_index_twice_is_kept_once_as_dcps_dict_keeps_it():
    """A crafted file naming an item twice: its last place, as plain pickle's dict has it."""
    md = _step(3)
    key = MetadataIndex("a", torch.Size([234, 0]))
    twice = StorageIndex.of_items(list(md.storage_data), list(md.storage_data.values()))
    cols = twice.columns()
    for col, value in zip(cols, [key.fqn, key.offset, None, "__1_0.distcp", 0, 9999, None]):
        col.append(value)
    md.storage_data = Call(*_reduced(pickled_items(cols)))
    data = pickle.dumps(md)
    want = pickle.loads(data).storage_data
    got = parse_metadata(data, "here").storage_data
    assert dict(got.items()) == want and got[key].length == 9999


def _reduced(r: tuple[Any, ...]) -> tuple[Any, ...]:
    return (r[0], *r[1])


def test_offsets_that_are_not_sizes_are_unreadable_as_for_dcp():
    md = _step(2)
    cols = StorageIndex.of_items(list(md.storage_data), list(md.storage_data.values())).columns()
    cols[1] = [None if o is None else (float(o[0]), *o[1:]) for o in cols[1]]
    md.storage_data = Call(*_reduced(pickled_items(cols)))
    data = pickle.dumps(md)
    with pytest.raises(TypeError):
        pickle.loads(data)  # (MetadataIndex makes a torch.Size of it)
    with pytest.raises(CheckpointCorruptError, match="unreadable"):
        parse_metadata(data, "here")
