"""Storage requests per save and per load, and the time ``save()`` blocks, against the number
of steps a run keeps (2, 10, 100, 1,000 by default).

For each storage (moto S3 behind a counting loopback proxy, ``tests._faults.FaultProxy``, a
port per rank; a local directory, where an audit hook counts the ``open``, ``os.listdir`` and
``os.scandir`` calls under the run's root) and each number of steps N:

* one real save of step 1 (``keep_last=None``), then rank 0 writes steps 2..N-1 as copies of
  step 1's ``manifest.json`` and ``.metadata`` with their step number changed (synthetic
  committed steps that refer to step 1's data: two small objects per step, written directly,
  so 1,000 steps take seconds, not a thousand saves);
* a new manager (a job restarting into a run of N-1 steps) loads the newest step: the requests
  of that ``load()``;
* ``--saves`` saves (the first one, which allocates host buffers, is left out): the requests
  of each save from ``save()`` until ``wait()`` returns, by kind, and the time ``save()``
  blocked with ``async_save=True`` (medians over the saves).

Each rank counts its own requests (rank 0 and rank 1 of ``--ranks`` gloo processes). The
requests are counted, not sampled: they do not depend on the machine's speed; the blocked
times do.

Usage::

    python -m benchmarks.bench_requests                      # 2 ranks, S3 and local
    python -m benchmarks.bench_requests --ranks 1 --steps 2 10 --store local
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

KINDS = ("LIST", "HEAD", "GET", "PUT", "COPY", "multipart", "DELETE")
LOCAL_KINDS = ("listdir", "open")


def _one_store(rank: int, url: str, opts: dict, counter: Any, steps: list[int], saves: int):
    from muon_ckpt import CheckpointManager
    from tests._ckpt import TinyNet, make_muon, train
    from tests.store._requests import synthetic_steps

    rows = []
    for n in steps:
        run = f"{url}/n{n}"  # (the same on every rank)
        torch.manual_seed(0)
        model = TinyNet()
        opt = make_muon(model)
        train(model, opt, 1)
        m = CheckpointManager(run, model=model, optimizer=opt, storage_options=opts)
        m.save(1)
        m.close()
        if rank == 0 and n > 1:
            synthetic_steps(run, opts, n - 1)
        dist.barrier()
        m = CheckpointManager(
            run, model=model, optimizer=opt, storage_options=opts, async_save=True
        )
        counter.clear()
        m.load()
        load = counter.read()
        per_save, blocked = [], []
        for i in range(saves + 1):
            train(model, opt, 1)
            dist.barrier()
            counter.clear()
            t0 = time.perf_counter()
            m.save(n + i)
            t1 = time.perf_counter()
            m.wait()
            if i:
                per_save.append(counter.read())
                blocked.append((t1 - t0) * 1e3)
        m.close()
        kinds = sorted({k for d in per_save for k in d})
        med = {k: statistics.median(d.get(k, 0) for d in per_save) for k in kinds}
        rows.append((n, med, load, statistics.median(blocked)))
    return rows


def _rank(rank: int, world: int, urls: dict, steps: list[int], saves: int) -> dict:
    from tests.store._requests import LocalCounter, ProxyCounter

    out = {}
    local = LocalCounter()
    for store, (url, opts, proxy) in urls.items():
        if store == "local":
            local.root = url
            out[store] = _one_store(rank, url, opts, local, steps, saves)
            local.root = None
        else:
            control, endpoints = proxy
            counter = ProxyCounter(control, rank)
            opts = {**opts, "endpoint_url": endpoints[rank]}
            out[store] = _one_store(rank, url, opts, counter, steps, saves)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[2, 10, 100, 1000])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--store", choices=["s3", "local", "both"], default="both")
    args = ap.parse_args()
    from benchmarks.bench_checkpoint import start_moto
    from tests._dist import run_on_ranks
    from tests._faults import FaultProxy

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    urls: dict[str, Any] = {}
    server = proxy = None
    tmp = tempfile.mkdtemp(prefix="bench-requests-")
    if args.store in ("s3", "both"):
        import s3fs

        server, opts = start_moto()
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(**opts).mkdir(bucket)
        proxy = FaultProxy(opts["endpoint_url"], ranks=args.ranks).start()  # (no faults)
        urls["s3"] = (f"s3://{bucket}/run", opts, (proxy.control_url, proxy.urls))
    if args.store in ("local", "both"):
        urls["local"] = (os.path.join(tmp, "run"), {}, None)
    try:
        timeout = 120.0 + 2.0 * sum(args.steps) * (args.saves + 1)
        res = run_on_ranks(_rank, args.ranks, urls, args.steps, args.saves, timeout=timeout)
    finally:
        if proxy is not None:
            proxy.stop()
        if server is not None:
            server.stop()
    print(f"# {args.ranks} gloo rank(s), async_save=True, medians of {args.saves} saves")
    for store in urls:
        kinds = KINDS if store == "s3" else LOCAL_KINDS
        print(f"\n## {store}\n")
        head = "| steps kept | rank | " + " | ".join(kinds) + " | load: " + " | load: ".join(kinds)
        print(head + " | save() blocked ms |")
        print("|" + "---|" * (2 + 2 * len(kinds) + 1))
        for rank in range(min(2, args.ranks)):
            for n, med, load, ms in res[rank][store]:
                cells = [f"{med.get(k, 0):g}" for k in kinds] + [str(load.get(k, 0)) for k in kinds]
                print(f"| {n} | {rank} | " + " | ".join(cells) + f" | {ms:.1f} |")


if __name__ == "__main__":
    main()
