"""The ``.metadata`` in columns: plain ``pickle.load`` (DCP's own readers) builds from it the
Metadata DCP's pickle holds, also written from a save's gathered write results; store's
reader keeps its stored items as columns and finds each as DCP's dict does, and gives each
tensor columns of its own; its writing is a fixed number of Python calls whatever the ranks,
leaves nothing to the collector, and stores each equal offset, size, name and chunk column
once."""

from __future__ import annotations

import gc
import pickle
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
from torch.distributed.checkpoint.storage import WriteResult

from muon_ckpt import CheckpointCorruptError
from muon_ckpt.store import _packed
from muon_ckpt.store._index import Call, pickled_items
from muon_ckpt.store.dcp import (
    Gathered,
    StorageIndex,
    Written,
    metadata_bytes,
    parse_metadata,
    unpack_metadata,
)
from tests._calls import calls

_F32 = TensorProperties(dtype=torch.float32)
_SHAPES = {"a": (700, 4), "b.w2": (300, 19), "c": (500,), "d.w2": (300, 19)}


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
    small, large = (calls(lambda md=md: metadata_bytes(md)) for md in steps.values())
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


def _gathered(md: Metadata, hints_and_how: bool = False) -> tuple[list[Written], dict[Any, Any]]:
    """Each rank's write results for ``md``'s stored items, as its writer hands them to DCP
    (``Written``), and the dict of them DCP's finish makes; ``hints_and_how``: some with
    index hints and storage transforms."""
    by_rank: dict[int, list[WriteResult]] = {}
    for k, (key, info) in enumerate(md.storage_data.items()):
        if hints_and_how:
            key = MetadataIndex(key.fqn, key.offset, k % 3 if key.offset is not None else None)
            how = ["zstd"] if k % 2 else None
            info = _StorageInfo(info.relative_path, info.offset, info.length, how)
        rank = int(info.relative_path[2:].split("_")[0])
        by_rank.setdefault(rank, []).append(WriteResult(key, info.length, info))
    ranks = range(max(by_rank) + 2)  # (the last rank wrote nothing)
    results = [Written.of(by_rank.get(r, [])) for r in ranks]
    want = {wr.index: wr.storage_data for r in ranks for wr in by_rank.get(r, [])}
    return results, want


@pytest.mark.parametrize("hints_and_how", [False, True])
@pytest.mark.parametrize("n", [1, 5, 64])
def test_a_saves_gathered_write_results_read_as_dcps_dict_of_them(n, hints_and_how):
    md = _step(n)
    results, want = _gathered(md, hints_and_how)
    md.storage_data = Gathered(results)
    data = metadata_bytes(md)
    got = pickle.loads(data)  # (what torch's FileSystemReader.read_metadata does)
    assert type(got.storage_data) is dict and got.storage_data == want
    assert [(k, k.index) for k in got.storage_data] == [(k, k.index) for k in want]
    assert got.state_dict_metadata == md.state_dict_metadata
    index = unpack_metadata(data, "here").storage_data
    assert isinstance(index, StorageIndex) and dict(index.items()) == want
    assert md.storage_data.compressed() == hints_and_how


def _equal_tensors(n: int, k: int) -> Metadata:
    """``k`` tensors of one shape, each sharded over ``n`` ranks, their chunks' offsets and
    sizes objects of their own (as DCP receives them, rank by rank)."""
    state: dict[str, Any] = {}
    for t in range(k):
        chunks = [
            ChunkStorageMetadata(torch.Size([2 * r, 0]), torch.Size([2, 8])) for r in range(n)
        ]
        state[f"layers.{t}.w"] = TensorStorageMetadata(_F32, torch.Size([2 * n, 8]), chunks)
    return Metadata(state)


def test_equal_chunk_columns_are_stored_once():
    """Tensors of one shape and sharding (every layer's matrices, params and states) have
    equal chunk columns: one more such tensor adds the same bytes at any ranks."""
    more = {
        n: len(metadata_bytes(_equal_tensors(n, 9))) - len(metadata_bytes(_equal_tensors(n, 1)))
        for n in (16, 256)
    }
    assert more[256] <= more[16] + 8 * 16, more  # (a memo reference may take a few bytes more)
    md = _equal_tensors(64, 3)
    assert pickle.loads(metadata_bytes(md)) == md


def test_each_tensor_read_has_chunk_columns_of_its_own():
    """The file refers to one column from every tensor of equal ones; read, each tensor's
    chunks keep columns of their own (a ChunkList's columns are appended to)."""
    got = unpack_metadata(metadata_bytes(_equal_tensors(8, 2)), "here").state_dict_metadata
    a, b = (got[f"layers.{t}.w"].chunks for t in (0, 1))
    assert a.columns() == b.columns() and a.columns() is not None
    assert a.offsets is not b.offsets and a.sizes is not b.sizes


def test_writing_the_metadata_leaves_nothing_to_the_collector():
    """The pickler and what it made are freed as the file is written: none of it is left in a
    cycle (its memo refers to every object pickled, which the collector would walk). What the
    collector finds is kept and looked at (other threads of the process may leave garbage of
    their own meanwhile: only the pickler's counts)."""
    md = _step(64)
    results, _ = _gathered(md)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        metadata_bytes(md)
        md.storage_data = Gathered(results)
        metadata_bytes(md)
        gc.collect()
        ours = [o for o in gc.garbage if isinstance(o, (_packed._Pickler, _packed._Same))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not ours, f"{len(ours)} of the pickler's objects were left to the collector"


def test_writing_a_saves_gathered_results_is_the_same_work_at_any_ranks():
    """From the gathered write results (what rank 0's finish writes), the Python calls do
    not grow with the ranks either: every rank's columns are read in C."""

    def write(md: Metadata, results: list[Written]) -> None:
        md.storage_data = Gathered(results)
        metadata_bytes(md)

    steps = {n: (_step(n), _gathered(_step(n))[0]) for n in (64, 256)}
    small, large = (calls(lambda s=s: write(*s)) for s in steps.values())
    assert large <= 1.1 * small, f"{small} calls at 64 ranks, {large} at 256"
