"""The replica check's cost in a save (certified replicas, docs/semantics.md): HSDP 2x2 on 4
CPU gloo ranks (real processes through ``tests/_dist.run_on_ranks``), every shard held by two
ranks, so each rank checksums all it holds.

The state is ``--size-gib`` (the full model) of 2048x2048 fp32 parameters on a (replicate 2,
shard 2) mesh: each rank holds half of it. Each rank times its ``save()`` call (the blocking
time), the save to its commit (``save()`` then ``wait()``: the total) and the checksum pass
(``last_save_timings["replicas"]``, which runs in the save's write path, before the commit:
in the background for an asynchronous save). The check adds that pass and one gather of the
checksums (bytes) to a save; the figures are the slowest rank's, medians of ``--repeat``
saves, synchronous and asynchronous interleaved.

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/bench_replicas.py --size-gib 0.5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch

from tests._dist import run_on_ranks

SIDE = 2048


def _ranks(rank: int, world: int, url: str, n: int, repeat: int) -> list[tuple]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from muon_ckpt import CheckpointManager

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    model = torch.nn.Module()
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        full = torch.randn(SIDE, SIDE, generator=g)
        w = distribute_tensor(full, mesh, [Replicate(), Shard(0)])
        model.register_parameter(f"w{i}", torch.nn.Parameter(w))
    out = []
    for mode in (False, True):
        kw = {"async_save": mode, "certify_replicas": True}
        with CheckpointManager(f"{url}/{mode}", model=model, **kw) as m:
            for step in range(1, repeat + 2):
                with torch.no_grad():  # (every save writes: nothing unchanged to refer to)
                    for p in model.parameters():
                        p.to_local().add_(1.0)
                t0 = time.perf_counter()
                m.save(step)
                t1 = time.perf_counter()
                m.wait()
                t2 = time.perf_counter()
                if step > 1:  # (the first faults in buffers)
                    out.append((mode, t1 - t0, t2 - t0, m.last_save_timings.get("replicas", 0.0)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n = max(1, round(args.size_gib * (1 << 30) / (SIDE * SIDE * 4)))
    url = tempfile.mkdtemp(prefix="muon_ckpt_replicas_")
    try:
        per_rank = run_on_ranks(_ranks, 4, url, n, args.repeat, timeout=3600)
    finally:
        shutil.rmtree(url, ignore_errors=True)
    held = n * SIDE * SIDE * 4 / 2
    print(f"HSDP 2x2, 4 gloo ranks: {n} x {SIDE}x{SIDE} fp32, {held / 2**20:.0f} MiB per rank")
    for mode in (False, True):
        rows = [[r for r in rk if r[0] == mode] for rk in per_rank]
        blocking = statistics.median(max(rk[i][1] for rk in rows) for i in range(len(rows[0])))
        total = statistics.median(max(rk[i][2] for rk in rows) for i in range(len(rows[0])))
        check = statistics.median(max(rk[i][3] for rk in rows) for i in range(len(rows[0])))
        blocked = check if not mode else 0.0
        print(
            f"  async_save={mode}: save() blocks {blocking:.3f} s, commits after {total:.3f} s; "
            f"replica check {check:.3f} s ({held / max(check, 1e-9) / 2**30:.1f} GiB/s): "
            f"+{100 * blocked / max(blocking - blocked, 1e-9):.1f} % blocking, "
            f"+{100 * check / max(total - check, 1e-9):.1f} % total"
        )


if __name__ == "__main__":
    main()
