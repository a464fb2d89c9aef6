"""The synthetic state of benchmarks/bench_planning.py: an 8B model's shapes sharded FSDP-style
over N ranks, each rank's local save plan as DCP makes it, the files and manifest entries a
save of it writes, and a fake process group of N ranks on which DCP makes one rank's plan from
DTensors (to check the synthetic one against)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from muon_ckpt.store import (
    DATA,
    FileEntry,
    data_ref,
    data_ref_name,
)

STEP = 100
SAVE_ID = "0123456789abcdef"
IO_THREADS = 4  # files per rank (the manager's default write_threads)
CHUNK = 1 << 20  # manifest checksum chunk
CUT = 64 << 10  # a write this big starts and ends a checksum chunk (StepWriter)
SHA_MIN = 16 << 10  # a tensor this big has a SHA-256 in the manifest (dedup)
ZIP_BYTES = 1152  # torch.save's records around a tensor's bytes, about
PROPS = TensorProperties(dtype=torch.float32)
RNG_BYTES = 5056  # torch.get_rng_state()


@dataclass(frozen=True)
class Param:
    fqn: str
    shape: tuple[int, ...]
    muon: bool  # Muon's momentum_buffer; else AdamW's moment1, moment2, step


def llama(layers: int, dim: int, kv: int, hidden: int, vocab: int) -> list[Param]:
    ps = [Param("tok_embeddings.weight", (vocab, dim), False)]
    for i in range(layers):
        a, f = f"layers.{i}.attention.", f"layers.{i}.feed_forward."
        ps += [
            Param(a + "wq.weight", (dim, dim), True),
            Param(a + "wk.weight", (kv, dim), True),
            Param(a + "wv.weight", (kv, dim), True),
            Param(a + "wo.weight", (dim, dim), True),
            Param(f + "w1.weight", (hidden, dim), True),
            Param(f + "w2.weight", (dim, hidden), True),
            Param(f + "w3.weight", (hidden, dim), True),
            Param(f"layers.{i}.attention_norm.weight", (dim,), False),
            Param(f"layers.{i}.ffn_norm.weight", (dim,), False),
        ]
    return [*ps, Param("norm.weight", (dim,), False), Param("output.weight", (vocab, dim), False)]


def model_8b() -> list[Param]:
    return llama(32, 4096, 1024, 14336, 128256)


def model_tiny() -> list[Param]:
    return llama(2, 64, 16, 224, 512)


def states(p: Param) -> tuple[str, ...]:
    return ("momentum_buffer",) if p.muon else ("moment1", "moment2")


GROUP_VALUES = {
    "lr": 0.02,
    "weight_decay": 0.0,
    "momentum": 0.95,
    "nesterov": True,
    "ns_steps": 5,
    "ns_dtype": "bf16",
    "ns_method": "gram",
    "none_grad": False,
    "adamw_betas": (0.9, 0.95),
    "adamw_eps": 1e-8,
    "initial_lr": 0.02,
}


def shard(shape: tuple[int, ...], n: int, r: int) -> tuple[torch.Size, torch.Size]:
    """Rank ``r``'s (offsets, sizes) of a ``Shard(0)`` tensor over ``n`` ranks, as
    ``torch.chunk`` cuts it (DTensor's placement)."""
    rows = shape[0]
    per = -(-rows // n)
    start = min(r * per, rows)
    size = max(0, min(rows, start + per) - start)
    return torch.Size([start, *[0] * (len(shape) - 1)]), torch.Size([size, *shape[1:]])


@dataclass
class Layout:
    """The state every rank saves: its keys, in FlatState's order."""

    params: list[Param]

    def sharded(self) -> list[tuple[str, tuple[int, ...]]]:
        out = [(f"model.{p.fqn}", p.shape) for p in self.params]
        for muon in (True, False):
            for p in self.params:
                if p.muon == muon:
                    out += [(f"optim.state.{p.fqn}.{s}", p.shape) for s in states(p)]
        return out

    def steps(self) -> list[str]:
        return [f"optim.state.{p.fqn}.step" for p in self.params if not p.muon]

    def values(self) -> list[str]:
        out = []
        for muon in (True, False):
            lead = next(p.fqn for p in self.params if p.muon == muon)
            out += [f"optim.param_groups.{lead}.params"]
            out += [f"optim.param_groups.{lead}.{k}" for k in GROUP_VALUES]
            out += [f"optim.param_groups.{lead}.use_muon"]
        return [*out, "extra.trainer.step", "extra.trainer.tokens"]

    def rank_plan(self, n: int, r: int) -> SavePlan:
        """Rank ``r``'s local save plan, as DCP's ``create_local_plan`` makes it."""
        items = []
        for key, shape in self.sharded():
            off, size = shard(shape, n, r)
            items.append(
                WriteItem(
                    index=MetadataIndex(key, off),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        ChunkStorageMetadata(off, size), PROPS, torch.Size(shape)
                    ),
                )
            )
        scalar = torch.Size([])
        tensors = [(k, scalar, PROPS) for k in self.steps()]
        tensors.append((f"rank_extra.{r}.rng.cpu", torch.Size([RNG_BYTES]), _UINT8))
        for key, shape, props in tensors:
            items.append(
                WriteItem(
                    index=MetadataIndex(key, torch.Size([0] * len(shape))),
                    type=WriteItemType.TENSOR,
                    tensor_data=TensorWriteData(
                        ChunkStorageMetadata(torch.Size([0] * len(shape)), shape), props, shape
                    ),
                )
            )
        items += [
            WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self.values()
        ]
        mappings = {it.index.fqn: _path(it.index.fqn) for it in items}
        return SavePlan(items, planner_data=mappings)

    def rank_load_plan(self, n: int, r: int) -> LoadPlan:
        """Rank ``r``'s local load plan of a step saved on ``n`` ranks, as ``SafeLoadPlanner``
        makes it: a read of each of its own saved chunks (none for an empty shard), of its
        plain tensors and of every value."""
        items = []
        for it in self.rank_plan(n, r).items:
            if it.type == WriteItemType.BYTE_IO:
                zero = torch.Size([0])
                items.append(ReadItem(LoadItemType.BYTE_IO, it.index, zero, it.index, zero, zero))
                continue
            chunk = it.tensor_data.chunk
            if not all(chunk.sizes):
                continue
            shards = it.type == WriteItemType.SHARD  # (non-empty shards are saved in rank order)
            zeros = torch.Size([0] * len(chunk.sizes))
            dest = MetadataIndex(it.index.fqn, chunk.offsets, 0)
            at = MetadataIndex(it.index.fqn, chunk.offsets, r if shards else 0)
            items.append(ReadItem(LoadItemType.TENSOR, dest, zeros, at, zeros, chunk.sizes))
        return LoadPlan(items)


_UINT8 = TensorProperties(dtype=torch.uint8)


def _path(key: str) -> tuple[str, ...]:
    """DCP's flatten mapping of a key (a nested state dict for extra and rank_extra)."""
    if key.startswith("extra."):
        return ("extra.trainer", key.rsplit(".", 1)[1])
    if key.startswith("rank_extra."):
        head, name, leaf = key.rsplit(".", 2)
        return (f"{head}.{name}", leaf)
    return (key,)


# ---------------------------------------------------------------------- what a save writes
def item_bytes(it: WriteItem) -> int:
    if it.type == WriteItemType.BYTE_IO:
        return 600
    td = it.tensor_data
    return math.prod(td.chunk.sizes) * td.properties.dtype.itemsize + ZIP_BYTES


def write_results(plans: list[SavePlan], data_dir: str) -> tuple[list, dict[str, FileEntry]]:
    """Each rank's write results (its final plan's items split into IO_THREADS files as
    StepWriter splits them) and the manifest entries of the files."""
    results, files = [], {}
    for plan in plans:
        prefix = plan.storage_data.prefix
        mine = []
        for k, bucket in enumerate(_split_by_size_and_type(IO_THREADS, plan.items)):
            if not bucket:
                continue
            name = data_ref_name(data_dir, f"{prefix}{k}.distcp")
            at, cuts, sha = 0, [], {}
            ordered = [i for i in bucket if i.type == WriteItemType.BYTE_IO]
            ordered += [i for i in bucket if i.type != WriteItemType.BYTE_IO]
            for it in ordered:
                n = item_bytes(it)
                data = n - ZIP_BYTES
                if it.type != WriteItemType.BYTE_IO and data >= CUT:
                    cuts += [at + 1024, at + 1024 + data]
                if it.type != WriteItemType.BYTE_IO and data >= SHA_MIN:
                    sha[at] = f"{(at * 2654435761) & (2**256 - 1):064x}"
                info = _StorageInfo(name, at, n)
                mine.append(WriteResult(index=it.index, size_in_bytes=n, storage_data=info))
                at += n
            cuts = [c for c in cuts if 0 < c < at]
            entry = FileEntry(
                at, crc32c="", chunk_bytes=CHUNK, cuts=cuts or None, sha256=sha or None
            )
            entry.crc32c = "00000000" * len(entry.chunk_starts())
            files[name] = entry
        results.append(mine)
    return results, files


def make_files(root: str, files: dict[str, FileEntry]) -> None:
    """Sparse files of the entries' sizes, where the manifest names them."""
    for name, e in files.items():
        ref = data_ref(name)
        assert ref is not None
        path = os.path.join(root, DATA, *ref)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(e.size)


class FakeRanks:
    """A fake process group of ``n`` ranks in this process (torch's testing backend), as rank
    ``r``: DTensors on it hold zero-stride local tensors (no memory), which DCP's planners
    read only the shapes and placements of."""

    def __init__(self, n: int, r: int) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        self.n, self.r = n, r
        dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=n)
        self.mesh = init_device_mesh("cpu", (n,))

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()

    def state(self, layout: Layout) -> dict[str, Any]:
        """Rank ``r``'s flat state dict (FlatState's keys), its shards as DTensors."""
        from torch.distributed.tensor import DTensor, Shard

        sd: dict[str, Any] = {}
        for key, shape in layout.sharded():
            _, size = shard(shape, self.n, self.r)
            local = torch.zeros(1).expand(*size) if all(size) else torch.empty(size)
            stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
            sd[key] = DTensor.from_local(
                local,
                self.mesh,
                [Shard(0)],
                shape=torch.Size(shape),
                stride=stride,
                run_check=False,
            )
        for key in layout.steps():
            sd[key] = torch.tensor(0.0)
        sd[f"rank_extra.{self.r}.rng"] = {"cpu": torch.zeros(RNG_BYTES, dtype=torch.uint8)}
        for key in layout.values():
            if key.startswith("extra."):
                sd.setdefault("extra.trainer", {})[key.rsplit(".", 1)[1]] = 1
            else:
                sd[key] = 1.0
        return sd


def same_items(ours: SavePlan, dcps: SavePlan) -> None:
    """The synthetic plan of a rank is the one DCP makes from its state."""
    a = {it.index: (it.type, it.tensor_data) for it in ours.items}
    b = {it.index: (it.type, it.tensor_data) for it in dcps.items}
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b), key=str)[:5]
    for k, (ta, da) in a.items():
        tb, db = b[k]
        assert ta == tb and (da is None) == (db is None), k
        if da is not None:
            assert (da.chunk, da.size, da.properties.dtype) == (
                db.chunk,
                db.size,
                db.properties.dtype,
            ), (k, da, db)


def same_reads(ours: LoadPlan, planners: LoadPlan) -> None:
    """The synthetic load plan of a rank is the one its planner makes, in order, hints too."""

    def rows(plan: LoadPlan) -> list[tuple]:
        return [
            (it, it.dest_index.index, it.storage_index.index, it.storage_index.offset)
            for it in plan.items
        ]

    a, b = rows(ours), rows(planners)
    assert a == b, next(((x, y) for x, y in zip(a, b) if x != y), (len(a), len(b)))
