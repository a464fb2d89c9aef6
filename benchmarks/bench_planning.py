"""Planning for thousands of ranks, timed in one process: the save's and the load's planning,
the ``.metadata``, the manifest's merge and the commit, for N ranks of an 8B model sharded
FSDP-style, from synthetic local plans (no real ranks).

The model is Llama-3-8B's shapes (32 layers of wq, wo 4096², wk, wv 1024x4096, w1, w3
14336x4096, w2 4096x14336, two norms; embeddings and output 128256x4096): Muon's
``momentum_buffer`` for the layers' matrices, AdamW's ``moment1``, ``moment2`` and ``step`` (a
plain scalar on every rank) for the rest, every parameter and state ``Shard(0)`` over the N
ranks as ``torch.chunk`` cuts it (uneven, and empty, shards where N does not divide the rows);
the two param groups' values, an ``extra`` and a ``rank_extra`` per rank, as ``FlatState``
builds them. Each rank's local plan is DCP's own ``WriteItem`` list for that state (the one
timed rank's is made by DCP itself from DTensors on a fake process group of N ranks, and
checked equal to the synthetic one); each rank writes ``io_threads`` files as
``ChecksumWriter`` splits them (format 3: under ``data/``), their manifest entries with
CRC32C per chunk, the cuts around every tensor and a SHA-256 per tensor, as a save records
them; the files are sparse, of their sizes, in a temporary directory.

Phases, each timed where it runs (one rank, or rank 0 over all N):

- ``save: local plan``: DCP's ``create_local_plan`` on one rank (the last: its shards are the
  uneven ones);
- ``save: global plan``: rank 0's ``create_global_plan`` over the N local plans (DCP's dedup
  of replicated items, the metadata, the check that chunks tile each tensor) and the writer's
  ``prepare_global_plan``;
- ``save: .metadata``: rank 0's ``ChecksumWriter.finish`` (every rank's write results into
  the metadata, pickled, written and checksummed);
- ``save: commit``: the merge of the N ranks' file records and ``Catalog.commit`` (the sizes
  listed and compared, the manifest written and read back);
- ``load: decide``: rank 0's check of the step (``Catalog.checked_at``: the manifest, every
  file's size, the ``.metadata`` checksummed, unpickled and checked: chunks tile every
  tensor, items inside their files);
- ``load: metadata``: unpickling the decision's metadata, what every rank does when rank 0
  broadcasts it;
- ``load: local plan``: one rank's planning (``SafeLoadPlanner`` and ``VerifyingReader``: its
  read items against the metadata).

``--torch`` also times ``save: global plan`` with DCP's own ``DefaultSavePlanner`` (whose
``_validate_global_plan`` is quadratic in ranks for a tensor whose widest dimension is not the
sharded one, such as w2), up to ``--torch-max`` ranks.

``--gloo P``: P real processes on this host (gloo) save and load a small FSDP-style model
through ``CheckpointManager``, bitwise.

Run: ``python -m benchmarks.bench_planning [--ranks 64 256 1024 2048] [--torch]``;
``--tiny`` for the CI smoke (small model, 4 and 8 ranks, every check).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import pickle
import resource
import tempfile
import time
from collections.abc import Callable
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
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from muon_ckpt.store import (
    DATA,
    MANIFEST,
    METADATA,
    Catalog,
    FileEntry,
    data_dirname,
    data_ref,
    data_ref_name,
    open_storage,
    step_dirname,
)

STEP = 100
SAVE_ID = "0123456789abcdef"
IO_THREADS = 4  # files per rank (the manager's default write_threads)
CHUNK = 1 << 20  # manifest checksum chunk
CUT = 64 << 10  # a write this big starts and ends a checksum chunk (ChecksumWriter)
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
    return ps + [Param("norm.weight", (dim,), False), Param("output.weight", (vocab, dim), False)]


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
        return out + ["extra.trainer.step", "extra.trainer.tokens"]

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
        items += [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self.values()]
        mappings = {it.index.fqn: _path(it.index.fqn) for it in items}
        return SavePlan(items, planner_data=mappings)


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
    ChecksumWriter splits them) and the manifest entries of the files."""
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
            entry = FileEntry(at, crc32c="", chunk_bytes=CHUNK, cuts=cuts or None, sha256=sha or None)
            entry.crc32c = "%08x" % 0 * len(entry.chunk_starts())
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


# ---------------------------------------------------------------------- phases
def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """CPU seconds of ``fn()`` (this process's, its threads' included): on a shared machine
    other jobs' load inflates wall time, not this; every phase runs on one core."""
    gc.collect() if gc.isenabled() else None
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


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
                local, self.mesh, [Shard(0)], shape=torch.Size(shape), stride=stride, run_check=False
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


@dataclass
class Row:
    seconds: dict[str, float]
    sizes: dict[str, int]
    rss: int


def run(layout: Layout, n: int, tmp: str, use_torch: bool, check: bool) -> Row:
    """Every phase at ``n`` ranks (``use_torch``: DCP's own global save plan too)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    from muon_ckpt.load import SafeLoadPlanner
    from muon_ckpt.load._reader import VerifyingReader
    from muon_ckpt.save import StagedSavePlanner
    from muon_ckpt.save._writer import ChecksumWriter, FileRecords

    sec: dict[str, float] = {}
    sizes: dict[str, int] = {}
    root = os.path.join(tmp, f"n{n}")
    storage = open_storage(root)
    catalog = Catalog(storage)
    plan = catalog.begin(STEP)
    data_dir = data_dirname(STEP, SAVE_ID)
    last = n - 1

    plans = [layout.rank_plan(n, r) for r in range(n)]
    ranks = FakeRanks(n, last)
    try:
        sd = ranks.state(layout)
        planner = StagedSavePlanner(None)

        def local_save() -> SavePlan:
            planner.set_up_planner(sd, None, False)
            return planner.create_local_plan()

        sec["save: local plan (1 rank)"], mine = timed(local_save)
        if check:
            same_items(plans[last], mine)
        if use_torch:
            sec["save: global plan, torch's (rank 0)"], _ = timed(
                lambda: DefaultSavePlanner().create_global_plan(plans)
            )
        records = FileRecords()
        writer = ChecksumWriter(
            storage, step_dirname(STEP), records, IO_THREADS, data_dir=data_dir
        )
        writer.set_up_storage_writer(True, rank=0, use_collectives=True)
        writer.fs.mkdir(writer.path)

        def global_save() -> tuple[list[SavePlan], Any]:
            final, md = StagedSavePlanner(None).create_global_plan(plans)
            return writer.prepare_global_plan(final), md

        sec["save: global plan (rank 0)"], (final, md) = timed(global_save)
        del plans
        results, files = write_results(final, data_dir)
        del final
        make_files(root, files)
        sec["save: .metadata (rank 0)"], _ = timed(lambda: writer.finish(md, results))
        del results, md
        by_rank: dict[int, dict[str, FileEntry]] = {}
        for name, e in files.items():
            r = int(name.rsplit("/", 1)[1][2:].split("_", 1)[0])
            by_rank.setdefault(r, {})[name] = e
        by_rank[0][METADATA] = records.files[METADATA]
        gathered = [(by_rank.get(r, {}), None, {data_dir: plan.gen}, None) for r in range(n)]

        def commit() -> Any:
            merged: dict[str, FileEntry] = {}
            gens: dict[str, int] = {}
            for part, _err, part_gens, _ in gathered:
                merged.update(part)
                gens.update(part_gens)
            listed = {ref[0] for name in merged if (ref := data_ref(name)) is not None}
            return catalog.commit(
                STEP,
                n,
                merged,
                {"io_threads": IO_THREADS, "keys": len(sd)},
                plan=plan,
                line="bench",
                data=data_dir,
                data_gens={d: g for d, g in gens.items() if d in listed},
            )

        sec["save: commit (rank 0)"], _ = timed(commit)
        del gathered, by_rank, files
        sizes[".metadata"] = os.path.getsize(os.path.join(root, step_dirname(STEP), METADATA))
        sizes["manifest"] = os.path.getsize(os.path.join(root, step_dirname(STEP), MANIFEST))

        sec["load: decide (rank 0)"], (name, m, md) = timed(lambda: catalog.checked_at(STEP))
        sent = pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)
        sizes["metadata pickled"] = len(sent)
        sec["load: metadata (each rank)"], md = timed(lambda: pickle.loads(sent))
        del sent

        def local_load() -> Any:
            lp = SafeLoadPlanner()
            reader = VerifyingReader(
                storage.child(name), m.files, metadata=md, rank=last, world_size=n
            )
            lp.set_up_planner(sd, md, False)
            reader.set_up_storage_reader(md, False)
            return reader.prepare_local_plan(lp.create_local_plan())

        sec["load: local plan (1 rank)"], lplan = timed(local_load)
        if check:  # every element of the rank's shards, from exactly its own chunks
            want = {k: shard(s, n, last) for k, s in layout.sharded()}
            got = {it.dest_index.fqn: it for it in lplan.items if it.dest_index.fqn in want}
            for k, (off, size) in want.items():
                if not all(size):
                    continue
                it = got[k]
                assert tuple(it.storage_index.offset) == tuple(off), (k, it)
                assert tuple(it.lengths) == tuple(size), (k, it)
    finally:
        ranks.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return Row(sec, sizes, rss)


def table(rows: dict[int, Row]) -> str:
    ns = sorted(rows)
    head = "| phase | " + " | ".join(f"{n} ranks" for n in ns)
    head += " | ratio per doubling (last) |" if len(ns) > 1 else " |"
    lines = [head, "|" + " --- |" * (len(ns) + 1 + (len(ns) > 1))]
    phases = [k for k in rows[ns[-1]].seconds] + [
        k for n in ns for k in rows[n].seconds if k not in rows[ns[-1]].seconds
    ]
    phases = list(dict.fromkeys(phases))

    def ratio(a: float, b: float, na: int, nb: int) -> str:
        if a <= 0:
            return "-"
        return f"{(b / a) ** (1 / math.log2(nb / na)):.2f}"

    for k in phases:
        vals = [rows[n].seconds.get(k) for n in ns]
        cells = [f"{v:.3f} s" if v is not None else "-" for v in vals]
        have = [(n, v) for n, v in zip(ns, vals) if v is not None]
        r = ratio(have[-2][1], have[-1][1], have[-2][0], have[-1][0]) if len(have) > 1 else "-"
        lines.append(f"| {k} | " + " | ".join(cells) + (f" | {r} |" if len(ns) > 1 else " |"))
    for k in rows[ns[-1]].sizes:
        vals = [rows[n].sizes[k] for n in ns]
        cells = [f"{v / 2**20:.1f} MiB" for v in vals]
        r = ratio(vals[-2], vals[-1], ns[-2], ns[-1]) if len(ns) > 1 else "-"
        lines.append(f"| {k} | " + " | ".join(cells) + (f" | {r} |" if len(ns) > 1 else " |"))
    cells = [f"{rows[n].rss / 2**30:.2f} GiB" for n in ns]
    lines.append("| peak RSS of the process | " + " | ".join(cells) + (" | - |" if len(ns) > 1 else " |"))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 2048])
    ap.add_argument("--tiny", action="store_true", help="small model, 4 and 8 ranks (CI)")
    ap.add_argument("--torch", action="store_true", help="time DCP's own global save plan too")
    ap.add_argument("--torch-max", type=int, default=1024, help="... up to this many ranks")
    ap.add_argument("--gloo", type=int, default=0, help="P real gloo processes save and load")
    ap.add_argument("--check", action="store_true", help="check the plans (always with --tiny)")
    args = ap.parse_args()
    import logging
    import warnings

    logging.getLogger("muon_ckpt").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*fake.*")
    layout = Layout(model_tiny() if args.tiny else model_8b())
    ns = [4, 8] if args.tiny else args.ranks
    n_params = sum(math.prod(p.shape) for p in layout.params)
    print(
        f"{n_params / 1e9:.2f}B parameters, {len(layout.params)} tensors; per rank "
        f"{len(layout.sharded())} shards, {len(layout.steps()) + 1} plain tensors, "
        f"{len(layout.values())} values"
    )
    rows: dict[int, Row] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in ns:
            use_torch = args.torch and n <= args.torch_max
            rows[n] = run(layout, n, tmp, use_torch, args.check or args.tiny)
            print(f"{n} ranks: " + ", ".join(f"{k} {v:.3f} s" for k, v in rows[n].seconds.items()), flush=True)
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
