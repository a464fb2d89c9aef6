"""Whether the GPU could check the CRC32C of what a load copies there: a design study.

A verified load into GPU tensors checksums every byte on the host, between its read and its
copy to the GPU. The bytes end up in GPU memory anyway, so the GPU could check them there,
with plain torch operations (no kernel of our own). This benchmark measures how fast, by this
method:

Let ``reg(M)`` be the CRC32C register after feeding the bytes ``M`` from 0 (no initial or
final xor). It is linear over GF(2) in the bits of ``M``, and feeding ``n`` zero bytes is a
linear map of its 32 bits (``shift(x, n)``), so:

* the register of a 256-byte segment is its 2048 bits times a 2048 x 32 matrix of 0s and 1s,
  mod 2 (row ``256 b + q``: the register of byte ``q`` holding ``1 << b``, shifted by the
  ``255 - q`` bytes after it); the bits are taken eight bytes at a time, bit ``b`` of each
  byte of a 64-bit word in one shift and mask, so a segment's row holds its bits 0, then its
  bits 1, and so on;
* the register of ``g`` consecutive segments of ``S`` bytes is their registers' bits
  (``32 g``) times a ``32 g x 32`` matrix, mod 2 (segment ``s`` shifted by ``S (g - 1 - s)``);
* the CRC32C of ``n`` bytes is ``reg xor tail(n)`` (``tail``: what the initial and final xor
  add), and zeros in front of a short chunk add nothing to its register.

Levels of 256 B, 16 KiB and 1 MiB give a 1 MiB chunk's register. The products are integer
products of int8 matrices into int32 (``torch._int_mm``): exact, sums of at most 2048 ones,
and ``mod 2`` is ``& 1``; the matrices are kept column-major, the layout the int8 products run
fastest with. Per call: about 15 operations whatever the length, and eight bytes of scratch
per byte checked (the bits), so long inputs go in slices of ``SLICE`` bytes.

Prints the GPU's speed over ``--size-gib`` of random bytes, called once per ``--call-mib`` (a
stored tensor's record: one call per tensor in a load), next to the host's ``crc32c`` over
the same bytes on 1 and ``--threads`` threads, and checks every chunk's value against the
host's (a short last chunk in each call too, with ``--odd``). Run:
``python -m benchmarks.bench_gpu_crc --size-gib 4 [--device cuda] [--call-mib 16]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import threading
import time

import torch

from muon_ckpt.store._crc import _table, crc_function, implementation

MiB = 1 << 20

_ALL = 0xFFFFFFFF
_SEG = 256  # bytes per first-level segment: 2048 bits, one matrix row per bit
_LOW_BITS = 0x0101010101010101  # bit 0 of each byte of a 64-bit word
_FAN = 64  # segments merged per later level: 64 registers of 32 bits, 2048 rows
SLICE = 16 << 20  # bytes per pass at most (--slice-mib): 128 MiB of bits

_T = _table()

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


_ONE_ZERO: Map = [(1 << j >> 8) ^ _T[(1 << j) & 0xFF] for j in range(32)]


@functools.lru_cache(maxsize=64)
def _shift(n: int) -> tuple[int, ...]:
    """Feeding ``n`` zero bytes to the register, as a linear map."""
    one, out = _ONE_ZERO, [1 << j for j in range(32)]
    while n:
        if n & 1:
            out = _compose(one, out)
        one = _compose(one, one)
        n >>= 1
    return tuple(out)


@functools.lru_cache(maxsize=256)
def tail(length: int) -> int:
    """What turns ``reg`` of ``length`` bytes into their CRC32C (the initial and final xor)."""
    return _apply(list(_shift(length)), _ALL) ^ _ALL


def crc_of(register: int, length: int) -> int:
    """The CRC32C of ``length`` bytes whose register (``DeviceCrc32c``) is ``register``."""
    return register ^ tail(length)


def _fans(chunk: int) -> list[int] | None:
    """The later levels' fan-ins for a chunk of ``chunk`` bytes, or None if it has no such
    form (256 x a power of two)."""
    n, fans = chunk // _SEG, []
    if chunk <= 0 or chunk % _SEG or n & (n - 1):
        return None
    while n > 1:
        fans.append(min(_FAN, n))
        n //= fans[-1]
    return fans


def _bits(values: list[int]) -> list[list[int]]:
    return [[(v >> j) & 1 for j in range(32)] for v in values]


class MatrixCrc32c:
    """``registers(data)``: the register of each ``chunk`` bytes of a uint8 tensor, on its
    device."""

    def __init__(self, chunk: int, device: torch.device) -> None:
        fans = _fans(chunk)
        if fans is None:
            raise ValueError(f"chunks of {chunk} bytes: must be 256 x a power of two")
        self.chunk, self.device = chunk, device
        rows = [0] * (8 * _SEG)
        for b in range(8):
            v = _T[1 << b]  # byte 255 holding 1 << b: nothing after it
            for q in range(_SEG - 1, -1, -1):
                rows[_SEG * b + q] = v
                v = (v >> 8) ^ _T[v & 0xFF]  # one zero byte more after it
        levels = [rows]
        seg = _SEG
        for g in fans:
            step = list(_shift(seg))
            merge = [0] * (32 * g)
            for j in range(32):
                v = 1 << j
                for s in range(g - 1, -1, -1):
                    merge[32 * s + j] = v
                    v = _apply(step, v)
            levels.append(merge)
            seg *= g

        def matrix(values: list[int]) -> torch.Tensor:  # column-major
            return torch.tensor(_bits(values), dtype=torch.int8, device=device).t().contiguous().t()

        self._levels = [matrix(m) for m in levels]
        self._fans = fans
        self._shifts = torch.arange(8, dtype=torch.int64, device=device).view(1, 8, 1)
        self._powers = torch.arange(32, dtype=torch.int64, device=device)

    def registers(self, data: torch.Tensor) -> torch.Tensor:
        """int64 registers of ``data`` (1-D uint8 on this device) cut into chunks of
        ``chunk`` bytes, the last one possibly shorter (CRC32C: ``crc_of(reg, length)``).
        Queued on the current stream."""
        if data.storage_offset() % 8:  # read as 64-bit words: copied to an aligned start
            data = data.clone()
        n, c = data.numel(), self.chunk
        full = n // c
        out = torch.empty(full + (n % c > 0), dtype=torch.int64, device=self.device)
        per = max(1, SLICE // c)
        for i in range(0, full, per):
            k = min(per, full - i)
            out[i : i + k] = self._rows(data[i * c : (i + k) * c])
        if n % c:
            row = torch.zeros(c, dtype=torch.uint8, device=self.device)
            row[c - n % c :] = data[full * c :]
            out[full:] = self._rows(row)
        return out

    def _rows(self, data: torch.Tensor) -> torch.Tensor:
        words = data.view(torch.int64).view(-1, 1, _SEG // 8)
        bits = (words >> self._shifts).bitwise_and_(_LOW_BITS).view(torch.int8)
        v = _mm(bits.view(-1, 8 * _SEG), self._levels[0])
        del bits
        for g, m in zip(self._fans, self._levels[1:], strict=True):
            v = _mm((v & 1).to(torch.int8).view(-1, 32 * g), m)
        return ((v & 1).to(torch.int64) << self._powers).sum(-1)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of int8 matrices into int32; CUDA's wants more than 16 rows (zeros added)."""
    m = a.shape[0]
    if m > 16:
        return torch._int_mm(a, b)
    pad = torch.zeros(17, a.shape[1], dtype=a.dtype, device=a.device)
    pad[:m] = a
    return torch._int_mm(pad, b)[:m]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    global SLICE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--chunk-mib", type=int, default=1, help="the manifest's chunk (1 MiB)")
    ap.add_argument("--call-mib", type=float, default=16, help="bytes per call (a record)")
    ap.add_argument("--odd", type=int, default=0, help="bytes short of --call-mib per call")
    ap.add_argument("--slice-mib", type=int, default=SLICE // MiB)
    ap.add_argument("--threads", type=int, default=4, help="host threads for the reference")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    SLICE = args.slice_mib * MiB
    dev = torch.device(args.device)
    chunk = args.chunk_mib * MiB
    call = int(args.call_mib * MiB) - args.odd
    calls = max(1, int(args.size_gib * (1 << 30)) // call)
    data = torch.randint(0, 256, (calls, call), dtype=torch.uint8, device=dev)
    host = data.cpu().numpy()
    crc = MatrixCrc32c(chunk, dev)
    per_call = -(-call // chunk)
    out = torch.empty(calls, per_call, dtype=torch.int64, device=dev)

    def gpu() -> None:
        for i in range(calls):
            out[i] = crc.registers(data[i])
        _sync(dev)

    fn = crc_function("crc32c")
    pieces = [(i, p) for i in range(calls) for p in range(0, call, chunk)]

    def host_crc(threads: int) -> list[int]:
        got = [0] * len(pieces)

        def run(t: int) -> None:
            for k in range(t, len(pieces), threads):
                i, p = pieces[k]
                got[k] = fn(0, host[i, p : p + chunk])

        ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return got

    want = host_crc(args.threads)
    gpu()
    regs = out.cpu().tolist()
    got = [crc_of(regs[i][p // chunk], min(chunk, call - p)) for i, p in pieces]
    bad = sum(a != b for a, b in zip(got, want, strict=True))
    mine = f"torch on {dev.type}"
    times: dict[str, list[float]] = {mine: [], "host 1 thread": [], f"host {args.threads}": []}
    for _ in range(args.repeat):
        for k in times:
            t0 = time.perf_counter()
            if k == mine:
                gpu()
            else:
                host_crc(1 if k == "host 1 thread" else args.threads)
            times[k].append(time.perf_counter() - t0)
    total = calls * call
    print(
        f"{total / (1 << 30):.2f} GiB in {calls} calls of {call} bytes, chunks of "
        f"{args.chunk_mib} MiB, slices of {args.slice_mib} MiB, on {dev}; host CRC32C: "
        f"{implementation()}; torch {torch.__version__}"
    )
    print(f"  every chunk's value equals the host's: {not bad} ({bad} of {len(pieces)} differ)")
    ref = statistics.median(times[f"host {args.threads}"])
    for k, xs in times.items():
        m = statistics.median(xs)
        print(f"  {k:<16} {total / m / 1e9:8.2f} GB/s  {ref / m:6.2f}x host x{args.threads}")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
