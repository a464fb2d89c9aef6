"""The cost of confirming a save on the storage before its commit (``confirm=``).

Saves the same state with ``confirm="checksum"`` (read-back of every file), ``"size"`` and
``"off"`` to a local directory and to a moto S3 server on 127.0.0.1, and prints the median
save time and the confirm phase. Run: ``python -m benchmarks.bench_confirm [--mib 256]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
from torch import nn

from muon_ckpt import CheckpointManager


def _model(mib: int) -> nn.Module:
    n = int((mib << 20) / 4 / 1024)
    layers = [nn.Linear(1024, 1024, bias=False) for _ in range(max(1, n // 1024))]
    return nn.Sequential(*layers)


def _bench(url: str, opts: dict, model: nn.Module, confirm: str, iters: int) -> tuple[float, float]:
    mgr = CheckpointManager(url, model=model, storage_options=opts, confirm=confirm, keep_last=1)
    saves, confirms = [], []
    for i in range(iters + 1):
        t0 = time.perf_counter()
        mgr.save(i)
        if i:  # the first save allocates its buffers
            saves.append(time.perf_counter() - t0)
            confirms.append(mgr.last_save_timings.get("confirm", 0.0))
    mgr.close()
    return statistics.median(saves), statistics.median(confirms)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="state size, local (MiB)")
    ap.add_argument("--s3-mib", type=int, default=32, help="state size, moto S3 (MiB)")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        model = _model(args.mib)
        for confirm in ("off", "size", "checksum"):
            s, c = _bench(os.path.join(tmp, confirm), {}, model, confirm, args.iters)
            print(f"local {args.mib} MiB confirm={confirm:<5}: save {s:.3f} s, confirm {c:.3f} s")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    import logging

    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        opts = {"key": "testing", "secret": "testing", "endpoint_url": f"http://127.0.0.1:{port}"}
        s3fs.S3FileSystem(**opts).mkdir("bench-confirm")
        model = _model(args.s3_mib)
        for confirm in ("off", "size", "checksum"):
            url = f"s3://bench-confirm/{confirm}"
            s, c = _bench(url, opts, model, confirm, args.iters)
            print(f"moto {args.s3_mib} MiB confirm={confirm:<5}: save {s:.3f} s, confirm {c:.3f} s")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
