"""A load's local plan sweeps only the saved chunks a rank's shard can overlap, and is DCP's
own plan item for item: the same read items, in the same order, with the same index hints,
for steps saved by more, fewer or as many ranks (uneven and empty shards), for chunks out of
order and for blocks of a 2-D mesh (DCP's planner alone), on real gloo ranks."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from tests._dist import run_on_ranks

_SHAPES = {"w": (37, 6), "wide": (5, 40), "v": (11,), "few": (2, 3)}


def _saved(shape: tuple[int, ...], n: int, shuffle: bool) -> list[ChunkStorageMetadata]:
    """The chunks of a Shard(0) save of ``shape`` on ``n`` ranks, as torch.chunk cuts it (an
    empty shard at the end, its rows' count as offset), in rank order or shuffled."""
    per, rows, out = -(-shape[0] // n), shape[0], []
    for r in range(n):
        start = min(r * per, rows)
        size = max(0, min(rows, start + per) - start)
        out.append(
            ChunkStorageMetadata(
                torch.Size([start, *[0] * (len(shape) - 1)]), torch.Size([size, *shape[1:]])
            )
        )
    out = list({c.offsets: c for c in out}.values())  # (DCP keeps one of equal indexes)
    if shuffle:
        random.Random(len(out)).shuffle(out)
    return out


def _metadata(n: int, shuffle: bool) -> Metadata:
    from muon_ckpt.store.dcp import ChunkList

    state: dict[str, Any] = {}
    for key, shape in _SHAPES.items():
        chunks = ChunkList()
        for c in _saved(shape, n, shuffle):
            chunks.add(c)
        props = TensorProperties(dtype=torch.float32)
        state[key] = TensorStorageMetadata(props, torch.Size(shape), chunks)
    return Metadata(state)


def _plans(rank: int, world: int, mesh_2d: bool) -> list[list[Any]]:
    """This rank's local load plan, by our planner and by DCP's, for each saved layout."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from muon_ckpt.load import SafeLoadPlanner

    if mesh_2d:  # (a vector: its rows cut on one mesh dimension, copied on the other)
        mesh = init_device_mesh("cpu", (2, world // 2))
        placed = {1: [Shard(0), Replicate()], 2: [Shard(0), Shard(1)]}
    else:
        mesh, placed = init_device_mesh("cpu", (world,)), {1: [Shard(0)], 2: [Shard(0)]}
    out = []
    for n in (1, 3, world, 7):
        for shuffle in (False, True):
            md = _metadata(n, shuffle)
            rows = []
            for planner in (SafeLoadPlanner(), DefaultLoadPlanner()):
                sd = {
                    k: distribute_tensor(torch.zeros(s), mesh, placed[len(s)])
                    for k, s in _SHAPES.items()
                }
                planner.set_up_planner(sd, md, rank == 0)
                items = planner.create_local_plan().items
                rows.append([(it, it.storage_index.index, it.dest_index.index) for it in items])
            out.append(rows)
    return out


def body_plans(rank: int, world: int, mesh_2d: bool) -> None:
    for ours, dcps in _plans(rank, world, mesh_2d):
        assert ours == dcps
        assert ours  # (every shard reads something: the tensors are not empty)


@pytest.mark.parametrize("mesh_2d", [False, True], ids=["shard-0", "blocks-2d"])
def test_the_local_plan_is_dcps_item_for_item(mesh_2d: bool) -> None:
    run_on_ranks(body_plans, 4, mesh_2d)


def test_only_the_overlapping_run_of_chunks_is_swept() -> None:
    """The run is found by bisection: the chunks of a rank's rows, not all of them."""
    from muon_ckpt.load._overlap import _run

    md = _metadata(1000, False)
    meta = md.state_dict_metadata["w"]  # 37 rows over 1,000 ranks: 37 chunks and an empty
    local = ChunkStorageMetadata(torch.Size([10, 0]), torch.Size([5, 6]))
    run = _run(meta, local)
    assert run is not None and list(run) == list(range(10, 15))
    assert math.prod(meta.size) == 37 * 6
