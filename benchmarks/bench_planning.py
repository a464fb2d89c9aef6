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
``StepWriter`` splits them (format 3: under ``data/``), their manifest entries with
CRC32C per chunk, the cuts around every tensor and a SHA-256 per tensor, as a save records
them; the files are sparse, of their sizes, in a temporary directory.

Phases, each timed where it runs (one rank, or rank 0 over all N):

- ``save: local plan``: DCP's ``create_local_plan`` on one rank (the last: its shards are the
  uneven ones);
- ``save: global plan``: rank 0's ``create_global_plan`` over the N local plans (DCP's dedup
  of replicated items, the metadata, the check that chunks tile each tensor) and the writer's
  ``prepare_global_plan``;
- ``save: write results gathered``: rank 0 unpickling every rank's write results (what
  ``StepWriter.write_data`` hands DCP, which gathers them: ``store.Written``);
- ``save: .metadata``: rank 0's ``StepWriter.finish`` (every rank's write results into
  the metadata, pickled, written and checksummed);
- ``save: DCP's broadcast of the metadata``: the metadata ``dcp.save`` returns, which DCP
  broadcasts to every rank after the finish, pickled on rank 0 and unpickled on each rank;
- ``save: manifest merge``: the N ranks' gathered file records into one, as the commit merges
  them;
- ``save: commit``: ``Catalog.commit`` (the sizes listed and compared, the manifest written and
  read back);
- ``load: decide``: rank 0's check of the step (``Catalog.checked_at``: the manifest, every
  file's size, the ``.metadata`` checksummed, unpickled and checked: chunks tile every
  tensor, items inside their files);
- ``load: decision sent``: pickling the decision (its metadata in columns) for
  ``broadcast_object_list``, on rank 0;
- ``load: metadata``: unpickling the decision's metadata, what every rank does when rank 0
  broadcasts it;
- ``load: local plan``: one rank's planning (``SafeLoadPlanner`` and ``VerifyingReader``: its
  read items against the metadata);
- ``load: DCP's plans gathered``: rank 0 unpickling every rank's local load plan as it
  travels (a key: ``load._planner.KeyedPlan``; the other ranks' as from other processes),
  what DCP's ``gather_object`` does inside ``dcp.load``, the collector running as there;
- ``load: DCP's plans scattered``: rank 0's global step on them and each plan pickled for
  DCP's ``scatter_object_list`` (``load plans gathered``: the bytes of the gather).

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
import functools
import gc
import math
import os
import pickle
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan

from benchmarks._planning_state import (
    IO_THREADS,
    SAVE_ID,
    STEP,
    FakeRanks,
    Layout,
    make_files,
    model_8b,
    model_tiny,
    same_items,
    same_reads,
    shard,
    write_results,
)
from muon_ckpt.store import (
    MANIFEST,
    METADATA,
    Catalog,
    FileEntry,
    data_dirname,
    data_ref,
    open_storage,
    step_dirname,
)
from muon_ckpt.store.dcp import Written


# ---------------------------------------------------------------------- phases
def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """CPU seconds of ``fn()`` (this process's, its threads' included): on a shared machine
    other jobs' load inflates wall time, not this; every phase runs on one core."""
    gc.collect() if gc.isenabled() else None
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


@dataclass
class Row:
    seconds: dict[str, float]
    sizes: dict[str, int]
    rss: int


def run(
    layout: Layout, n: int, tmp: str, use_torch: bool, check: bool, dcp_plans: bool = False
) -> Row:
    """Every phase at ``n`` ranks (``use_torch``: DCP's own global save plan too)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    from muon_ckpt._gcpause import paused_gc
    from muon_ckpt._plans import forget
    from muon_ckpt.load import Decision, SafeLoadPlanner
    from muon_ckpt.load._planner import keyed
    from muon_ckpt.load._reader import VerifyingReader
    from muon_ckpt.save import StagedSavePlanner
    from muon_ckpt.save._plan import LocalPlan
    from muon_ckpt.save._writer import FileRecords, StepWriter

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
            torch_plan = functools.partial(DefaultSavePlanner().create_global_plan, plans)
            sec["save: global plan, torch's (rank 0)"], _ = timed(torch_plan)
        records = FileRecords()
        writer = StepWriter(storage, step_dirname(STEP), records, IO_THREADS, data_dir=data_dir)
        writer.set_up_storage_writer(True, rank=0, use_collectives=True)
        writer.fs.mkdir(writer.path)

        # Each rank's plan as our planner sends it (LocalPlan: columns), gathered to rank 0 by
        # DCP (gather_object: pickled there, unpickled on rank 0 with the collector running)
        local = [LocalPlan(p.items, p.storage_data, p.planner_data) for p in plans]
        del plans
        sec["save: local plan sent (1 rank)"], _ = timed(
            functools.partial(pickle.dumps, local[last])
        )
        sent = [pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL) for p in local]
        sizes["local plans sent"] = sum(map(len, sent))
        if dcp_plans:  # (DCP's own plans, as its planner sends them: before)
            raw = [pickle.dumps(SavePlan(p.items, planner_data=p.planner_data)) for p in local]
            sizes["local plans sent, DCP's"] = sum(map(len, raw))
            sec["save: local plans gathered, DCP's (rank 0)"], _ = timed(
                functools.partial(list, map(pickle.loads, raw))
            )
            del raw
        sec["save: local plans gathered (rank 0)"], received = timed(
            functools.partial(list, map(pickle.loads, sent))
        )
        del sent

        def global_save(plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
            final, md = StagedSavePlanner(None).create_global_plan(plans)
            return writer.prepare_global_plan(final), md

        sec["save: global plan (rank 0)"], (final, md) = timed(
            functools.partial(global_save, received)
        )
        del received  # (each phase's inputs go once used: the peak is one phase's)
        # ... and scattered back (scatter_object_list: pickled on rank 0, each rank its own)
        sec["save: final plans sent (rank 0)"], back = timed(
            functools.partial(list, map(pickle.dumps, final))
        )
        sizes["final plans sent"] = sum(map(len, back))
        sec["save: final plan received (1 rank)"], _ = timed(
            functools.partial(pickle.loads, back[last])
        )
        final = [pickle.loads(b) for b in back]
        del back, local
        results, files = write_results(final, data_dir)
        make_files(root, files)
        # Each rank's writer hands DCP its results, which DCP gathers to rank 0 (pickled)
        sent = [pickle.dumps(Written.of(r), protocol=pickle.HIGHEST_PROTOCOL) for r in results]
        sizes["write results sent"] = sum(map(len, sent))
        del results, final

        gather = functools.partial(list, map(pickle.loads, sent))  # (as gather_object does)
        sec["save: write results gathered (rank 0)"], results = timed(gather)
        del sent
        sec["save: .metadata (rank 0)"], _ = timed(functools.partial(writer.finish, md, results))
        del results
        # DCP then broadcasts the metadata to every rank (dcp.save's return value)
        sec["save: DCP's broadcast of the metadata (rank 0)"], sent = timed(
            functools.partial(pickle.dumps, md)
        )
        sec["save: DCP's broadcast of the metadata (each rank)"], _ = timed(
            functools.partial(pickle.loads, sent)
        )
        del md, sent
        by_rank: dict[int, dict[str, FileEntry]] = {}
        for name, e in files.items():
            r = int(name.rsplit("/", 1)[1][2:].split("_", 1)[0])
            by_rank.setdefault(r, {})[name] = e
        by_rank[0][METADATA] = records.files[METADATA]
        gathered = [(by_rank.get(r, {}), None, {data_dir: plan.gen}, None) for r in range(n)]
        del by_rank, files

        def merge(gathered: list) -> tuple[dict[str, FileEntry], dict[str, int]]:
            """The merge of the ranks' gathered file records, as save/_job.py's commit."""
            merged: dict[str, FileEntry] = {}
            gens: dict[str, int] = {}
            for part, _err, part_gens, _ in gathered:
                merged.update(part)
                gens.update(part_gens)
            listed = {ref[0] for name in merged if (ref := data_ref(name)) is not None}
            return merged, {d: g for d, g in gens.items() if d in listed}

        sec["save: manifest merge (rank 0)"], (merged, gens) = timed(
            functools.partial(merge, gathered)
        )
        del gathered
        commit = functools.partial(
            catalog.commit,
            STEP,
            n,
            merged,
            {"io_threads": IO_THREADS, "keys": len(sd)},
            plan=plan,
            line="bench",
            data=data_dir,
            data_gens=gens,
        )
        sec["save: commit (rank 0)"], _ = timed(commit)
        del commit, merged
        sizes[".metadata"] = os.path.getsize(os.path.join(root, step_dirname(STEP), METADATA))
        sizes["manifest"] = os.path.getsize(os.path.join(root, step_dirname(STEP), MANIFEST))

        def decide() -> Any:  # (as load() runs it: inside its broadcast, the collector paused)
            with paused_gc():
                return catalog.checked_at(STEP)

        sec["load: decide (rank 0)"], (name, m, md) = timed(decide)
        decision = Decision(False, STEP, n, m.files, md, [], [], name)
        send = functools.partial(pickle.dumps, decision, protocol=pickle.HIGHEST_PROTOCOL)
        sec["load: decision sent (rank 0)"], sent = timed(send)
        sizes["decision sent"] = len(sent)
        del md, decision

        def receive(sent: bytes) -> Any:  # (broadcast_object_list unpickles it)
            with paused_gc():
                return pickle.loads(sent).metadata

        sec["load: metadata (each rank)"], md = timed(functools.partial(receive, sent))
        del sent

        def local_load() -> Any:  # (as load() plans: its plan a key for DCP's round trip)
            reader = VerifyingReader(
                storage.child(name), m.files, metadata=md, rank=last, world_size=n
            )
            lp = SafeLoadPlanner(reader=reader)
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
            same_reads(layout.rank_load_plan(n, last), lplan)
        del lplan
        # Each rank's plan as its planner hands it to DCP (a key: KeyedPlan), pickled by
        # gather_object; rank 0 holds its own plan only (the others are other processes')
        plans = [keyed(layout.rank_load_plan(n, r)) for r in range(n)]
        sent = list(map(pickle.dumps, plans))
        sizes["load plans gathered"] = sum(map(len, sent))
        for p in plans[1:]:
            forget(p.key)
        # DCP's gather_object to rank 0, then its scatter_object_list of rank 0's global plan
        # (``create_global_plan`` and the reader's ``prepare_global_plan``), with the
        # collector running as it does there
        sec["load: DCP's plans gathered (rank 0)"], got = timed(
            functools.partial(list, map(pickle.loads, sent))
        )
        del sent

        def scatter(got: list) -> list[bytes]:
            lp = SafeLoadPlanner()
            reader = VerifyingReader(storage.child(name), m.files, metadata=md)
            return list(map(pickle.dumps, reader.prepare_global_plan(lp.create_global_plan(got))))

        sec["load: DCP's plans scattered (rank 0)"], sent = timed(functools.partial(scatter, got))
        if check:  # rank 0's own plan comes back as itself, its items never sent
            assert pickle.loads(sent[0]) is plans[0], "rank 0's plan did not come back"
        forget(plans[0].key)
        del got, sent, plans
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
    lines.append(
        "| peak RSS of the process | " + " | ".join(cells) + (" | - |" if len(ns) > 1 else " |")
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------- real ranks
def _gloo_model(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Two layers ``fully_shard`` over every rank, 37 rows each (over 16 ranks: 3 rows to
    each of ranks 0-11, 1 to rank 12, none after), Muon for the matrices, AdamW the rest."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from optim.muon import Muon

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(24, 37), torch.nn.Linear(37, 37))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    groups = [{"params": mats, "lr": 0.02}, {"params": rest, "use_muon": False, "lr": 2e-3}]
    return model, Muon(groups)


def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model's and the optimizer's state, this rank's part of it."""
    from torch.distributed.tensor import DTensor

    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, state in opt.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in out.items()}


def gloo_rank(rank: int, world: int, url: str) -> tuple[float, float, int, list[str]]:
    """One rank: a step of Muon, a save, a load into a model built otherwise; the seconds of
    the save and of the load, the tensors compared and those that differ."""
    from torch.distributed.tensor import distribute_tensor

    from muon_ckpt import CheckpointManager

    model, opt = _gloo_model(world, 0)
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = distribute_tensor(torch.randn(p.shape, generator=g), p.device_mesh, p.placements)
    opt.step()
    want = {k: v.clone() for k, v in _tensors(model, opt).items()}
    with CheckpointManager(url, model=model, optimizer=opt, io_threads=1) as m:
        t0 = time.perf_counter()
        m.save(1)
        saved = time.perf_counter() - t0
    model, opt = _gloo_model(world, 1)
    with CheckpointManager(url, model=model, optimizer=opt, io_threads=1) as m:
        t0 = time.perf_counter()
        m.load()
        loaded = time.perf_counter() - t0
    got = _tensors(model, opt)
    differ = [k for k, v in want.items() if k not in got or not torch.equal(v, got[k])]
    return saved, loaded, len(want), differ + sorted(got.keys() - want.keys())


def gloo(world: int) -> str:
    """``world`` real processes (gloo, this host) save and load through the manager."""
    from tests._dist import run_on_ranks

    with tempfile.TemporaryDirectory() as url:
        out = run_on_ranks(gloo_rank, world, url, timeout=1800)
    differ = {r: d for r, (*_, d) in enumerate(out) if d}
    if differ:
        raise SystemExit(f"{world} gloo ranks: tensors that differ after the load: {differ}")
    return (
        f"{world} gloo processes on this host: save {max(o[0] for o in out):.2f} s, load "
        f"{max(o[1] for o in out):.2f} s (the slowest rank's; median "
        f"{statistics.median(o[1] for o in out):.2f} s), {sum(o[2] for o in out)} tensors "
        "over the ranks, every one bitwise equal after the load"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 2048])
    ap.add_argument("--tiny", action="store_true", help="small model, 4 and 8 ranks (CI)")
    ap.add_argument("--torch", action="store_true", help="time DCP's own global save plan too")
    ap.add_argument("--torch-max", type=int, default=1024, help="... up to this many ranks")
    ap.add_argument(
        "--dcp-plans", action="store_true", help="time the gather of DCP's own plans too (slow)"
    )
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
    if args.gloo:
        print(gloo(args.gloo), flush=True)
    rows: dict[int, Row] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in ns:
            use_torch = args.torch and n <= args.torch_max
            rows[n] = run(layout, n, tmp, use_torch, args.check or args.tiny, args.dcp_plans)
            done = ", ".join(f"{k} {v:.3f} s" for k, v in rows[n].seconds.items())
            print(f"{n} ranks: {done}", flush=True)
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
