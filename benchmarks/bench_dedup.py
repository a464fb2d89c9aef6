"""What a save writes and costs with ``dedup`` and ``compression``, against raw ``dcp.save``
of the same state; one run, one machine.

Three runs, each saved ``--saves`` times with an optimizer step (AdamW) between saves:

* ``full``: full fine-tune, every parameter trained: nothing is unchanged;
* ``lora``: a frozen base of 1024x1024 matrices with rank-5 adapters (1 % trainable);
* ``frozen-emb``: a frozen embedding (about half the parameters), the rest trained.

Each run is saved by raw ``dcp.save`` (``FileSystemWriter``, or ``FsspecWriter`` on S3, the
same threads) of the model's and optimizer's state dicts, and by the CheckpointManager in
each of four modes: ``dedup`` on (the default) or off (every step written whole, as before
dedup), ``compression`` off (the default) or ``"zstd"``, each synchronous and asynchronous
(``async_save``), all in interleaved rounds. Per save after the first (medians):
the bytes written (the storage's growth), the time of a synchronous ``save()`` (what it
blocks: write, the read-back of ``confirm``, the commit), the time an asynchronous
``save()`` blocks, and the ratios of bytes and time to raw ``dcp.save``'s.

Then, in the same run: the storage's plain write speed (write + fsync of 512 MiB), SHA-256
(dedup's test of "unchanged") in GiB/s on one thread and on the writer threads, and the
codec on real fp32 and bf16 optimizer state (a small language model trained 30 steps):
plain zstd-1 of the bytes as they are, against muon-ckpt's (``store.codec``: bytes grouped
by their place in the element, zstd-1, CRC32C per frame), ratio and GiB/s of encoding and
of decoding (with its CRC check) on one thread.

Run: ``python -m benchmarks.bench_dedup [--mib 128] [--saves 3] [--threads 4] [--dir DIR]
[--url moto]``. ``--mib``: the model's parameters per run (MiB, fp32); AdamW's state
adds twice the trained part.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from muon_ckpt import CheckpointManager

MODES = (  # (dedup, compression)
    (False, None),
    (False, "zstd"),
    (True, None),
    (True, "zstd"),
)


class _Lora(nn.Module):
    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim, bias=False)
        self.base.weight.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, dim) * 0.01)
        self.b = nn.Parameter(torch.zeros(dim, rank))


def _run(case: str, mib: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    dim = 1024
    layers = max(2, (mib << 20) // (4 * dim * dim))
    if case == "lora":
        m: nn.Module = nn.Sequential(*[_Lora(dim, 5) for _ in range(layers)])
    elif case == "frozen-emb":
        half = layers // 2
        m = nn.Sequential(
            nn.Embedding(half * dim, dim), *[nn.Linear(dim, dim) for _ in range(layers - half)]
        )
        m[0].weight.requires_grad_(False)
    else:
        m = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    _step(m, opt)
    return m, opt


def _step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    """One optimizer step on random gradients: the trained parameters and their moments
    change; the frozen ones do not."""
    for p in m.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p) * 1e-2
    opt.step()
    opt.zero_grad()


class _Place:
    """Where the runs are written: a local directory or a bucket of a moto S3 server."""

    def __init__(self, root: str, opts: dict[str, Any]) -> None:
        self.root, self.opts = root.rstrip("/"), opts
        self.fs, _ = fsspec.core.url_to_fs(root, **opts)

    def url(self, name: str) -> str:
        return f"{self.root}/{name}"

    def size(self, url: str) -> int:
        """The bytes of every file under ``url``."""
        path = self.fs._strip_protocol(url)
        self.fs.invalidate_cache()  # (s3fs caches listings)
        if not self.fs.exists(path):
            return 0
        return sum(i["size"] for i in self.fs.find(path, detail=True).values())

    def remove(self, url: str) -> None:
        path = self.fs._strip_protocol(url)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)


def _state_bytes(m: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    for s in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in s.values() if isinstance(t, torch.Tensor))
    return n


class _Saver:
    """One way of saving one run: its own copy of the run's model and optimizer (same seed,
    same steps: the same state as every other saver of the run), saved at each round."""

    def __init__(
        self, place: _Place, case: str, args: Any, mode: tuple[bool, str | None] | None, aio: bool
    ) -> None:
        self.place, self.args, self.mode, self.aio = place, args, mode, aio
        self.m, self.opt = _run(case, args.mib)
        tag = "raw" if mode is None else f"{mode[0]}-{mode[1]}-{aio}"
        self.url = place.url(f"{case}-{tag}")
        self.mgr = None
        if mode is not None:
            self.mgr = CheckpointManager(
                self.url,
                model=self.m,
                optimizer=self.opt,
                io_threads=args.threads,
                dedup=mode[0],
                compression=mode[1],
                async_save=aio,
                storage_options=place.opts,
            )
        self.written: list[int] = []
        self.blocked: list[float] = []

    def save(self, step: int) -> None:
        before = self.place.size(self.url)
        t0 = time.perf_counter()
        if self.mgr is not None:
            self.mgr.save(step)
            self.blocked.append(time.perf_counter() - t0)
            self.mgr.wait()
        else:
            url = f"{self.url}/step-{step}"
            if self.place.root.startswith("s3://"):
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

                opts, threads = self.place.opts, self.args.threads
                writer: Any = FsspecWriter(url, thread_count=threads, **opts)
            else:
                writer = dcp.FileSystemWriter(url, thread_count=self.args.threads)
            sd = {"model": self.m.state_dict(), "optim": self.opt.state_dict()}
            dcp.save(sd, storage_writer=writer, no_dist=True)
            self.blocked.append(time.perf_counter() - t0)
        self.written.append(self.place.size(self.url) - before)
        _step(self.m, self.opt)

    def close(self) -> tuple[float, float]:
        """Medians over the saves after the first: bytes written, seconds blocked."""
        if self.mgr is not None:
            self.mgr.close()
        self.place.remove(self.url)
        return statistics.median(self.written[1:]), statistics.median(self.blocked[1:])


def _case_rows(place: _Place, case: str, args: Any) -> list[str]:
    """The run ``case`` saved ``args.saves`` times by every saver, in interleaved rounds (the
    order rotating each round), so that a noisy machine slows all of them alike."""
    savers = [_Saver(place, case, args, None, False)]
    for mode in MODES:
        savers += [_Saver(place, case, args, mode, False), _Saver(place, case, args, mode, True)]
    state = f"{_state_bytes(savers[0].m, savers[0].opt) / 2**20:.0f} MiB"
    for step in range(1, args.saves + 1):
        k = step % len(savers)
        for sv in savers[k:] + savers[:k]:
            sv.save(step)
    got = [sv.close() for sv in savers]
    raw_w, raw_t = got[0]
    rows = [
        f"| {case} | {state} | raw dcp.save | {raw_w / 2**20:.1f} MiB | 1 | {raw_t:.3f} | 1 | - |"
    ]
    for n, mode in enumerate(MODES):
        (w, t), (_, b) = got[1 + 2 * n], got[2 + 2 * n]
        rows.append(
            f"| {case} | {state} | dedup={mode[0]}, compression={mode[1]!r} | "
            f"{w / 2**20:.1f} MiB | **{w / raw_w:.3f}** | {t:.3f} | {t / raw_t:.2f} | {b:.3f} |"
        )
    return rows


def _sha256_speed(threads: int, mib: int = 256) -> tuple[float, float]:
    """GiB/s of SHA-256 on one thread, and on ``threads`` threads at once (each its own
    buffer of ``mib`` MiB)."""
    bufs = [torch.randn((mib << 20) // 4).numpy().data for _ in range(threads)]
    t0 = time.perf_counter()
    hashlib.sha256(bufs[0]).digest()
    one = (mib / 1024) / (time.perf_counter() - t0)
    ts = [threading.Thread(target=lambda b=b: hashlib.sha256(b).digest()) for b in bufs]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return one, threads * (mib / 1024) / (time.perf_counter() - t0)


def _write_speed(place: _Place, mib: int = 512) -> float:
    """GiB/s of writing ``mib`` MiB to a new file (fsynced locally)."""
    buf = os.urandom(64 << 20)
    url = place.url("write-speed.bin")
    t0 = time.perf_counter()
    with place.fs.open(place.fs._strip_protocol(url), "wb") as f:
        for _ in range(mib // 64):
            f.write(buf)
        f.flush()
        if not place.root.startswith("s3://"):
            os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    place.remove(url)
    return (mib // 64 * 64 / 1024) / dt


def _trained_state() -> dict[str, torch.Tensor]:
    """Real optimizer state: a small language model trained 30 steps with AdamW."""
    torch.manual_seed(0)
    dim, vocab = 256, 2048
    blocks = [
        nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(4)
    ]
    m = nn.Sequential(nn.Embedding(vocab, dim), *blocks, nn.Linear(dim, vocab))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for _ in range(30):
        x, y = torch.randint(0, vocab, (16, 32)), torch.randint(0, vocab, (16, 32))
        nn.functional.cross_entropy(m(x).view(-1, vocab), y.view(-1)).backward()
        opt.step()
        opt.zero_grad()

    def flat(ts: Any) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in ts])

    ps = list(m.parameters())
    w, m1 = flat(ps), flat(opt.state[p]["exp_avg"] for p in ps)
    m2 = flat(opt.state[p]["exp_avg_sq"] for p in ps)
    return {
        "weights fp32": w,
        "exp_avg fp32": m1,
        "exp_avg_sq fp32": m2,
        "weights bf16": w.bfloat16(),
        "exp_avg bf16": m1.bfloat16(),
        "exp_avg_sq bf16": m2.bfloat16(),
    }


def _median_time(fn: Any, rounds: int = 5) -> float:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _codec_rows() -> list[str]:
    try:
        import zstandard
    except ImportError:
        return ["zstd: not measured (pip install zstandard)"]
    from muon_ckpt.store.codec import Encoder, decode, stride_of

    rows = []
    for name, t in _trained_state().items():
        raw = t.contiguous().view(torch.uint8).numpy()
        gib = raw.nbytes / 2**30
        c, d = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
        plain = c.compress(raw.data)
        pt = _median_time(lambda c=c, raw=raw: c.compress(raw.data))
        pd = _median_time(lambda d=d, plain=plain: d.decompress(plain))

        def encode(raw: Any = raw, stride: int = stride_of(t.element_size())) -> bytes:
            out = io.BytesIO()
            enc = Encoder(out, stride)
            enc.write(raw.data)
            enc.finish()
            return out.getvalue()

        ours = encode()
        et = _median_time(encode)
        dt = _median_time(lambda ours=ours, n=raw.nbytes: decode(ours, n, "bench", "k"))
        assert bytes(decode(ours, raw.nbytes, "bench", name)) == raw.tobytes()
        rows.append(
            f"| {name} | {raw.nbytes / 2**20:.1f} MiB | {raw.nbytes / len(plain):.3f} | "
            f"{gib / pt:.2f} / {gib / pd:.2f} | **{raw.nbytes / len(ours):.3f}** | "
            f"{gib / et:.2f} / {gib / dt:.2f} |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mib", type=int, default=128, help="model parameters per run (MiB, fp32)")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4, help="writer threads (io_threads)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    ap.add_argument("--url", default=None, help="'moto': write to a local moto S3 server")
    ap.add_argument("--cases", nargs="+", default=["full", "lora", "frozen-emb"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    server, tmp = None, None
    if args.url == "moto":
        import s3fs

        from benchmarks.bench_checkpoint import start_moto

        server, opts = start_moto()
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(**opts).mkdir(bucket)
        place = _Place(f"s3://{bucket}", opts)
    else:
        tmp = tempfile.mkdtemp(prefix="bench_dedup_", dir=args.dir)
        place = _Place(tmp, {})
    try:
        print(f"plain write of 512 MiB to {place.root}: {_write_speed(place):.2f} GiB/s")
        one, many = _sha256_speed(args.threads)
        print(f"SHA-256: {one:.2f} GiB/s on 1 thread, {many:.2f} GiB/s on {args.threads}")
        print()
        print(
            "| run | state | mode | written per save | / raw dcp.save | sync save() s "
            "| / raw dcp.save | async save() blocks s |"
        )
        print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        for case in args.cases:
            print("\n".join(_case_rows(place, case, args)), flush=True)
        print()
        print(
            "| state | bytes | zstd-1 as is: ratio | GiB/s comp / decomp | muon-ckpt codec: "
            "ratio | GiB/s encode / decode |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        print("\n".join(_codec_rows()))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
