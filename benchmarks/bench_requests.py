"""Storage requests per save and per load, and the time ``save()`` blocks, against the number
of steps a run keeps (2, 10, 100, 1,000 by default), on S3 and a local disk.

For each storage (moto S3 behind a counting loopback proxy, ``tests._faults.FaultProxy``, a
port per rank; a local directory, where an audit hook counts the ``open``, ``os.listdir`` and
``os.scandir`` calls under the run's root) and each number of steps N, a run of N committed
steps is made: one real save of step 1, steps 2..N-1 written by rank 0 as copies of step 1's
``manifest.json`` and ``.metadata`` with their step number changed, each naming a data
directory of its own (``tests.store._requests.synthetic_steps``: seconds, not a thousand
saves), then a job that loads N-1, saves N and closes (its save writes the run's index). Then:

* a new manager (``async_save=True``: a job restarting into the run) loads the newest step:
  the requests of that ``load()``;
* its first save (which reads the run once: the manifests the load did not, every data
  directory) is counted apart;
* then ``--saves`` rounds: in each, one save into every run, the runs taken in turn
  (alternating order from round to round), so that every configuration meets the machine's
  noise alike: the requests of each save from ``save()`` until ``wait()`` returns, by kind,
  and the time ``save()`` blocked (medians over the rounds).

The ratios are paired: round by round, ``save()``'s blocked time at the most steps over that
at the fewest (same storage), and on S3 over a local disk (same steps); printed as the median
of those ratios with their 25th-75th percentiles (the spread). Each rank counts its own
requests (rank 0 and rank 1 of ``--ranks`` gloo processes). The requests are counted, not
sampled: they do not depend on the machine's speed; the blocked times do.

Usage::

    python -m benchmarks.bench_requests                      # 2 ranks, S3 and local
    python -m benchmarks.bench_requests --ranks 1 --steps 2 10 --store local --saves 5
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
LOAD_KINDS = {"s3": ("LIST", "HEAD", "GET"), "local": LOCAL_KINDS}  # (a load writes nothing)


class _Run:
    """One run of N steps on one storage, its manager open (``async_save=True``)."""

    def __init__(self, rank: int, store: str, url: str, opts: dict, counter: Any, n: int):
        from muon_ckpt import CheckpointManager
        from tests._ckpt import TinyNet, make_muon, train
        from tests.store._requests import synthetic_steps

        self.store, self.n, self.counter = store, n, counter
        self.url = run = f"{url}/n{n}"  # (the same on every rank)
        self.local_root = run if store == "local" else None
        torch.manual_seed(0)
        self.model = TinyNet()
        self.opt = make_muon(self.model)
        train(self.model, self.opt, 1)
        kw = dict(model=self.model, optimizer=self.opt, storage_options=opts)
        with CheckpointManager(run, **kw) as m:
            m.save(1)
        if rank == 0 and n > 2:
            synthetic_steps(run, opts, n - 1)
        dist.barrier()
        if n > 1:
            with CheckpointManager(run, **kw) as m:  # (a job that ends after a save)
                m.load()
                train(self.model, self.opt, 1)
                m.save(n)
        self.m = CheckpointManager(run, async_save=True, **kw)
        self.load = self._counted(self.m.load)[0]
        self.step = n
        self.first, _ = self._save()
        self.requests: list[dict[str, int]] = []
        self.blocked: list[float] = []

    def _counted(self, fn: Any) -> tuple[dict[str, int], Any]:
        if self.local_root is not None:
            self.counter.root = self.local_root
        self.counter.clear()
        dist.barrier()  # (every rank starts together, its counter cleared)
        try:
            out = fn()
            return self.counter.read(), out
        finally:
            if self.local_root is not None:
                self.counter.root = None

    def _save(self) -> tuple[dict[str, int], float]:
        from tests._ckpt import train

        train(self.model, self.opt, 1)
        self.step += 1

        def one() -> float:
            t0 = time.perf_counter()
            self.m.save(self.step)
            t1 = time.perf_counter()
            self.m.wait()
            return (t1 - t0) * 1e3

        got, ms = self._counted(one)
        return got, ms

    def round(self) -> None:
        got, ms = self._save()
        self.requests.append(got)
        self.blocked.append(ms)

    def row(self) -> dict[str, Any]:
        self.m.close()
        kinds = sorted({k for d in self.requests for k in d})
        med = {k: statistics.median(d.get(k, 0) for d in self.requests) for k in kinds}
        return {"med": med, "load": self.load, "first": self.first, "blocked": self.blocked}


def _rank(rank: int, world: int, urls: dict, steps: list[int], saves: int) -> dict:
    from tests.store._requests import LocalCounter, ProxyCounter

    local = LocalCounter()
    runs = []
    for store, (url, opts, proxy) in urls.items():
        for n in steps:
            if store == "local":
                runs.append(_Run(rank, store, url, opts, local, n))
            else:
                control, endpoints = proxy
                o = {**opts, "endpoint_url": endpoints[rank]}
                runs.append(_Run(rank, store, url, o, ProxyCounter(control, rank), n))
    for i in range(saves):  # (every run once a round, in alternating order: the noise alike)
        for r in runs if i % 2 == 0 else runs[::-1]:
            r.round()
    return {(r.store, r.n): r.row() for r in runs}


def _spread(xs: list[float]) -> str:
    """The median of ``xs`` and its 25th-75th percentiles."""
    if len(xs) < 2:
        return f"{xs[0]:.2f}" if xs else "-"
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs):.2f} ({q[0]:.2f}-{q[2]:.2f})"


def _ratios(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True) if y > 0]


def _print(res: list[dict], urls: dict, steps: list[int], args: Any) -> None:
    print(f"# {args.ranks} gloo rank(s), async_save=True, medians of {args.saves} rounds")
    for store in urls:
        kinds = KINDS if store == "s3" else LOCAL_KINDS
        print(f"\n## {store}\n")
        cols = [*kinds, *(f"load: {k}" for k in LOAD_KINDS[store]), "`save()` blocked ms"]
        print("| steps kept | rank | " + " | ".join(cols) + " |")
        print("|" + "---|" * (2 + len(cols)))
        for rank in range(min(2, args.ranks)):
            for n in steps:
                row = res[rank][store, n]
                cells = [f"{row['med'].get(k, 0):g}" for k in kinds]
                cells += [str(row["load"].get(k, 0)) for k in LOAD_KINDS[store]]
                cells.append(f"{statistics.median(row['blocked']):.1f}")
                print(f"| {n} | {rank} | " + " | ".join(cells) + " |")
        print("\nfirst save after the load (rank 0): ", end="")
        print("; ".join(f"{n}: {res[0][store, n]['first']}" for n in steps))
    lo, hi = min(steps), max(steps)
    print("\n## save() blocked, paired ratios (rank 0): median (25th-75th percentile)\n")
    for store in urls:
        r = _ratios(res[0][store, hi]["blocked"], res[0][store, lo]["blocked"])
        print(f"{store}: {hi} steps / {lo} steps = {_spread(r)}")
    if len(urls) == 2:
        for n in steps:
            r = _ratios(res[0]["s3", n]["blocked"], res[0]["local", n]["blocked"])
            print(f"S3 / local disk at {n} steps = {_spread(r)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[2, 10, 100, 1000])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--saves", type=int, default=20, help="rounds (one save into every run)")
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
    steps = sorted(set(args.steps))
    try:
        timeout = 300.0 + 0.5 * sum(steps) * len(urls) + 5.0 * args.saves * len(steps) * len(urls)
        res = run_on_ranks(_rank, args.ranks, urls, steps, args.saves, timeout=timeout)
    finally:
        if proxy is not None:
            proxy.stop()
        if server is not None:
            server.stop()
    _print(res, urls, steps, args)


if __name__ == "__main__":
    main()
