"""Planning for thousands of ranks: the save's global plan, the metadata's checks and the
manifest grow linearly with the ranks, and a step of 2,048 ranks reads back.

Linearity is pinned by counting Python calls (``sys.setprofile``), never by timing: the work
at 2N ranks is at most about twice the work at N. The timings are benchmarks/
bench_planning.py's (docs/benchmarks.md)."""

from __future__ import annotations

import pickle
import random
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from muon_ckpt import CheckpointError
from muon_ckpt.save import StagedSavePlanner
from muon_ckpt.save._global import SavePlanner
from muon_ckpt.store import FileEntry, Manifest, Storage, data_ref_name, step_dirname
from muon_ckpt.store._steps import read_manifest
from muon_ckpt.store.dcp import parse_metadata
from tests._calls import calls

_F32 = TensorProperties(dtype=torch.float32)


def _shard(rows: int, n: int, r: int) -> tuple[int, int]:
    """Rank ``r``'s rows of ``rows`` over ``n`` ranks, as torch.chunk (DTensor) cuts them."""
    per = -(-rows // n)
    start = min(r * per, rows)
    return start, max(0, min(rows, start + per) - start)


def _item(key: str, shape: tuple[int, ...], start: int, rows: int) -> WriteItem:
    off = torch.Size([start, *[0] * (len(shape) - 1)])
    size = torch.Size([rows, *shape[1:]])
    return WriteItem(
        index=MetadataIndex(key, off),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(ChunkStorageMetadata(off, size), _F32, torch.Size(shape)),
    )


def _plans(
    n: int, shapes: dict[str, tuple[int, ...]], replicas: int = 1, objects: int = 2
) -> list[SavePlan]:
    """Every rank's local save plan, as DCP makes it: each tensor Shard(0) over ``n //
    replicas`` ranks (HSDP: ``replicas`` copies of each shard), a scalar and ``objects``
    Python values on every rank, a value of each rank's own."""
    group = n // replicas
    plans = []
    for r in range(n):
        items = [_item(k, s, *_shard(s[0], group, r % group)) for k, s in shapes.items()]
        scalar = torch.Size([])
        items.append(
            WriteItem(
                index=MetadataIndex("optim.state.w.step", scalar),
                type=WriteItemType.TENSOR,
                tensor_data=TensorWriteData(ChunkStorageMetadata(scalar, scalar), _F32, scalar),
            )
        )
        keys = [f"optim.param_groups.w.v{i}" for i in range(objects)] + [f"rank_extra.{r}.x"]
        items += [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in keys]
        plans.append(SavePlan(items, planner_data={it.index.fqn: (it.index.fqn,) for it in items}))
    return plans


# Wider than tall, as a transformer's w2 (4096 x 14336): DCP's _validate_global_plan sweeps
# along the widest dimension, which every shard spans, and compares each shard with all others
_WIDE = {f"layers.{i}.w2": (256, 1024) for i in range(4)}


def test_the_save_plan_of_2n_ranks_is_about_twice_the_work_of_n():
    def work(n: int) -> int:
        plans = _plans(n, _WIDE)
        return calls(lambda: StagedSavePlanner(None).create_global_plan(plans))

    small, large = work(64), work(128)
    assert large <= 2.2 * small, f"{small} calls at 64 ranks, {large} at 128"


@pytest.mark.parametrize(
    "case",
    [
        pytest.param((6, 1, {"a": (10, 3), "w2": (4, 7)}), id="fsdp-uneven-and-empty-shards"),
        pytest.param((8, 2, {"a": (16, 2), "b": (5,)}), id="hsdp-replicated-shards"),
        pytest.param((5, 5, {"a": (3, 3)}), id="replicated-everywhere"),
        pytest.param((1, 1, {"a": (3, 3)}), id="one-rank"),
    ],
)
def test_the_save_plan_is_dcps_own(case):
    """The same dedup (which rank writes each replicated item, ties included), the same
    metadata (chunks in DCP's order) and mappings as DCP's DefaultSavePlanner."""
    n, replicas, shapes = case
    plans = _plans(n, shapes, replicas, objects=3)
    ours, md = StagedSavePlanner(None).create_global_plan(plans)
    theirs, want = DefaultSavePlanner().create_global_plan(_plans(n, shapes, replicas, 3))
    assert [p.items for p in ours] == [p.items for p in theirs]  # (index hints aside)
    assert md.state_dict_metadata == want.state_dict_metadata
    assert list(md.planner_data.items()) == list(want.planner_data.items())


@pytest.mark.parametrize("seed", range(60))
def test_the_dedup_picks_the_rank_dcp_picks(seed):
    """Random plans whose items several ranks hold (replicated tensors and objects, empty
    shards at a tensor's end), of random sizes and orders: the same items stay in the same
    plans as with DCP's own dedup_save_plans, ties included."""
    rng = random.Random(seed)
    n = rng.randrange(1, 9)
    pool = [
        _item(f"t{k}", (rng.randrange(1, 50), 3), rng.randrange(0, 3), rng.randrange(0, 3))
        for k in range(12)
    ]
    pool += [WriteItem(index=MetadataIndex(f"o{k}"), type=WriteItemType.BYTE_IO) for k in range(4)]
    plans = []
    for _ in range(n):
        items = rng.sample(pool, rng.randrange(0, len(pool)))
        for j, it in enumerate(items):  # the same key, other bytes (DCP counts its last one's)
            if it.tensor_data is not None and rng.random() < 0.3:
                start, rows = it.index.offset[0], it.tensor_data.chunk.sizes[0]
                items[j] = _item(it.index.fqn, (rng.randrange(1, 50), 3), start, rows)
        plans.append(SavePlan(sorted(items, key=lambda it: rng.random())))
    for lowest in (False, True):
        planner = SavePlanner(dedup_save_to_lowest_rank=lowest)
        ours = [p.items for p in planner._dedup_save_plans(plans)]
        theirs = [p.items for p in dedup_save_plans(plans, lowest)]
        assert ours == theirs


@pytest.mark.parametrize(
    "chunks",
    [
        pytest.param([(0, 3), (2, 4)], id="overlap"),
        pytest.param([(0, 3), (4, 2)], id="gap"),
        pytest.param([(0, 3), (3, 4)], id="outside"),
    ],
)
def test_a_save_plan_whose_shards_do_not_tile_a_tensor_is_refused(chunks):
    """What DCP's validation refused is refused (and what a load would refuse as corrupt)."""
    plans = [
        SavePlan([_item("w", (6, 2), start, rows)], planner_data={"w": ("w",)})
        for start, rows in chunks
    ]
    with pytest.raises(ValueError, match=r"Failed to validate global plan: .*w"):
        StagedSavePlanner(None).create_global_plan(plans)


def test_the_metadata_check_of_2n_ranks_is_about_twice_the_work_of_n():
    """A load's check of the .metadata (chunks tiling every tensor, items inside their files)
    is linear in ranks x tensors."""

    def work(n: int) -> int:
        final, md = StagedSavePlanner(None).create_global_plan(_plans(n, _WIDE))
        md.storage_data = {}
        for r, plan in enumerate(final):
            at = 0
            for it in plan.items:
                n_bytes = 4 * (it.tensor_data.chunk.sizes.numel() if it.tensor_data else 1)
                md.storage_data[it.index] = _info(f"__{r}_0.distcp", at, n_bytes)
                at += n_bytes
        data = pickle.dumps(md)
        return calls(lambda: parse_metadata(data, "here"))

    small, large = work(64), work(128)
    assert large <= 2.2 * small, f"{small} calls at 64 ranks, {large} at 128"


def _info(name: str, offset: int, length: int) -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(name, offset, length)


def _manifest(ranks: int, files: int, tensors: int) -> Manifest:
    """The manifest of a save of ``ranks`` ranks that wrote ``files`` files each, each of
    ``tensors`` tensors (a CRC32C per 1 MiB chunk, cut around each tensor, and its SHA-256)."""
    out = {}
    data = "00000100-0123456789abcdef"
    for r in range(ranks):
        for k in range(files):
            at = [1024 + t * (1 << 16) for t in range(tensors)]
            cuts = [c for a in at for c in (a, a + 60000)]
            e = FileEntry(at[-1] + (1 << 16), crc32c="", chunk_bytes=1 << 20, cuts=cuts)
            e.sha256 = {a: f"{(r * files + k) * tensors + i:064x}" for i, a in enumerate(at)}
            e.crc32c = "0badf00d" * len(e.chunk_starts())
            out[data_ref_name(data, f"__{r}_{k}.distcp")] = e
    out[".metadata"] = FileEntry(1000, crc32c="0badf00d", chunk_bytes=1 << 20)
    return Manifest(
        step=100,
        world_size=ranks,
        files=out,
        time="2026-01-01T00:00:00+00:00",
        torch_version=torch.__version__,
        muon_ckpt_version="test",
        format_version=3,
        data=data,
        data_gens={data: 1},
    )


def test_the_manifest_of_a_2048_rank_save_reads_back(tmp_path):
    """An 8B model on 2,048 ranks writes about 90 bytes of manifest per tensor shard, over
    64 MiB (where every reader refused the step as corrupt); it reads back as written."""
    m = _manifest(2048, 4, 90)
    data = m.to_json()
    assert len(data) > 64 << 20
    st = Storage(str(tmp_path))
    st.write_bytes(data, step_dirname(100), "manifest.json")
    got = read_manifest(st, step_dirname(100), 100)
    assert got == m


def test_a_manifest_no_reader_would_accept_is_not_committed():
    m = _manifest(2, 1, 3)
    data = m.to_json()
    assert Manifest.from_json(data, "here") == m
    with pytest.raises(CheckpointError, match=r"manifest would have \d+ bytes.*not committed"):
        m.to_json(limit=len(data) - 1)


def test_the_metadata_dcp_returns_after_a_save_carries_no_chunks(tmp_path):
    """DCP broadcasts the metadata dcp.save returns to every rank once the files are written:
    an object per chunk, seconds at thousands of ranks, and nothing here reads it. The
    ``.metadata`` holds all of it."""
    import torch.distributed.checkpoint as dcp

    from muon_ckpt.save._streams import FileRecords
    from muon_ckpt.save._writer import StepWriter

    st = Storage(str(tmp_path))
    sd = {"w": torch.randn(4, 3), "lr": 0.1}
    writer = StepWriter(st, step_dirname(1), FileRecords(), 1)
    returned = dcp.save(sd, storage_writer=writer, planner=SavePlanner(), no_dist=True)
    assert returned.state_dict_metadata == {} and not returned.storage_data
    md = parse_metadata(st.read_bytes(step_dirname(1), ".metadata"), "here")
    assert set(md.state_dict_metadata) == {"w", "lr"} and len(md.storage_data) == 2
