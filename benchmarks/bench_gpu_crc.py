"""How fast the GPU could check the CRC32C of what a load copies there: a design study.

A verified load into GPU tensors checksums every byte on the host, between the read and the
copy to the GPU (``bench_read_path``: the checksum costs a reading thread about a quarter of
its speed on the H200 host, where memory bandwidth, not cores, is the limit). The bytes end up
in GPU memory anyway, so the GPU could check them there, after the copy, and the host would
only read and copy. This benchmark measures whether the GPU is fast enough for that, with
plain torch operations (no kernel of our own):

CRC32C is linear over GF(2). With ``r(M)`` the CRC register after feeding ``M`` from 0,
``r(A + B) = shift(r(A), len(B)) xor r(B)``, where ``shift(x, n)`` (feeding ``n`` zero bytes)
is a linear map of 32 bits, applied as four 256-entry table lookups, one per byte of ``x``.
So each chunk (the manifest's 1 MiB) is checked in ``log2`` steps: every ``--word`` bytes
give their register by one table lookup per byte (``r`` of a word is the xor of each byte's
table entry shifted by its distance to the word's end), then neighbouring segments merge
pairwise (``shift`` by the left one's length) until one value per chunk is left; the CRC32C
is that value xor ``shift(0xFFFFFFFF, chunk)`` xor ``0xFFFFFFFF``. A shorter chunk (a file's
last one, one cut short by a writer) is the same with zeros in front (``r`` of leading zeros
is 0) and its own length in the last term.

Prints the GPU's GB/s over ``--size-gib`` of random bytes in batches of ``--batch-mib``, next
to the host's ``crc32c`` over the same bytes on 1 and ``--threads`` threads, and checks every
chunk's value against the host's. Run:
``python -m benchmarks.bench_gpu_crc --size-gib 4 [--device cuda] [--batch-mib 256]``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from muon_ckpt.store._crc import _table, crc_function, implementation

MiB = 1 << 20
_ALL = 0xFFFFFFFF


_T = _table()  # the CRC32C register after one byte, from 0

# A linear map of 32 bits as the images of its 32 unit vectors.
Map = list[int]


def _apply(m: Map, x: int) -> int:
    out, j = 0, 0
    while x:
        if x & 1:
            out ^= m[j]
        x >>= 1
        j += 1
    return out


def _compose(a: Map, b: Map) -> Map:  # a after b
    return [_apply(a, v) for v in b]


def _shift(n: int) -> Map:
    """Feeding ``n`` zero bytes to the register."""
    one = [_T[(1 << j) & 0xFF] ^ ((1 << j) >> 8) for j in range(32)]
    out = [1 << j for j in range(32)]
    while n:
        if n & 1:
            out = _compose(one, out)
        one = _compose(one, one)
        n >>= 1
    return out


def tail(length: int) -> int:
    """What turns ``r`` of ``length`` bytes into their CRC32C (the initial and final xor)."""
    return _apply(_shift(length), _ALL) ^ _ALL


class GpuCrc32c:
    """Per-chunk CRC32C of ``(B, chunk)`` uint8 tensors on ``device`` (torch ops only)."""

    def __init__(self, chunk: int, device: torch.device | str, word: int = 16) -> None:
        steps = (chunk // word).bit_length() - 1
        if chunk % word or (chunk // word) != 1 << steps:
            raise ValueError(f"chunk {chunk} must be {word} x a power of two")
        self.chunk, self.word = chunk, word

        def tensor(rows: list[list[int]]) -> torch.Tensor:
            return torch.tensor(rows, dtype=torch.int64, device=device)

        # word bytes: byte i's entry shifted by the bytes after it in the word
        after = [_shift(word - 1 - i) for i in range(word)]
        self._first = tensor([[_apply(after[i], _T[b]) for b in range(256)] for i in range(word)])
        # each merge: the left segment's register shifted by the right one's length
        self._merges = []
        for s in range(steps):
            m = _shift(word << s)
            self._merges.append(
                tensor([[_apply(m, b << (8 * k)) for b in range(256)] for k in range(4)])
            )
        self._tail = tail(chunk)

    def __call__(self, data: torch.Tensor) -> torch.Tensor:
        """The CRC32C of each row of ``data`` (``(B, chunk)`` uint8), as int64 (of a row that
        holds a shorter chunk after zeros: xor ``tail(chunk) ^ tail(its length)``)."""
        rows = data.shape[0]
        by_word = data.view(rows, self.chunk // self.word, self.word)
        v = self._first[0][by_word[:, :, 0].long()]
        for i in range(1, self.word):
            v ^= self._first[i][by_word[:, :, i].long()]
        for tab in self._merges:
            left, right = v[:, 0::2], v[:, 1::2]
            v = (
                tab[0][left & 0xFF]
                ^ tab[1][(left >> 8) & 0xFF]
                ^ tab[2][(left >> 16) & 0xFF]
                ^ tab[3][left >> 24]
                ^ right
            )
        return v[:, 0] ^ self._tail


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--chunk-mib", type=int, default=1, help="the manifest's chunk (1 MiB)")
    ap.add_argument("--batch-mib", type=int, default=256, help="chunks checked per call")
    ap.add_argument("--word", type=int, default=16, help="bytes per first table lookup step")
    ap.add_argument("--threads", type=int, default=4, help="host threads for the reference")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    dev = torch.device(args.device)
    chunk = args.chunk_mib * MiB
    per_batch = max(1, args.batch_mib * MiB // chunk)
    n = max(per_batch, int(args.size_gib * (1 << 30)) // chunk // per_batch * per_batch)
    data = torch.randint(0, 256, (n, chunk), dtype=torch.uint8, device=dev)
    host = data.cpu()
    crc = GpuCrc32c(chunk, dev, args.word)
    out = torch.empty(n, dtype=torch.int64, device=dev)

    def gpu() -> None:
        for b in range(0, n, per_batch):
            out[b : b + per_batch] = crc(data[b : b + per_batch])
        _sync(dev)

    fn = crc_function("crc32c")
    view = host.numpy()

    def host_crc(threads: int) -> list[int]:
        got = [0] * n

        def run(t: int) -> None:
            for i in range(t, n, threads):
                got[i] = fn(0, view[i])

        ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return got

    want = host_crc(args.threads)
    gpu()
    bad = [i for i, (a, b) in enumerate(zip(out.cpu().tolist(), want, strict=True)) if a != b]
    for k in (1, chunk // 3, chunk - 5):  # short chunks: zeros in front
        row = host[:1].clone()
        row[0, :k] = 0
        got = int(crc(row.to(dev))[0]) ^ tail(chunk) ^ tail(chunk - k)
        if got != fn(0, row[0, k:].numpy()):
            bad.append(-k)
    mine = f"torch on {dev.type}"
    times: dict[str, list[float]] = {
        mine: [],
        "host 1 thread": [],
        f"host {args.threads} threads": [],
    }
    for _ in range(args.repeat):
        for k in times:
            t0 = time.perf_counter()
            if k == mine:
                gpu()
            else:
                host_crc(1 if k == "host 1 thread" else args.threads)
            times[k].append(time.perf_counter() - t0)
    total = n * chunk
    print(
        f"{total / (1 << 30):.2f} GiB in {n} chunks of {args.chunk_mib} MiB, {per_batch} chunks "
        f"per call, {args.word}-byte words, on {dev}; host CRC32C: {implementation()}; "
        f"torch {torch.__version__}"
    )
    print(
        f"  every chunk's value (and 3 short ones) equals the host's: {not bad} ({len(bad)} differ)"
    )
    ref = statistics.median(times[f"host {args.threads} threads"])
    for k, xs in times.items():
        m = statistics.median(xs)
        print(f"  {k:<16} {total / m / 1e9:8.2f} GB/s  {ref / m:6.2f}x host x{args.threads}")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
