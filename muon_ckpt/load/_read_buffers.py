"""The buffers a local load's reading threads reuse, and what their time goes to.

Each reading thread keeps one ``ReadBuffers`` for all the parts it reads: a pageable chunk, a
whole-record buffer, and two page-locked chunks for copies to the GPU, which come from (and
go back to) a list kept for the process's next load (``_PINNED``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from muon_ckpt._tensors import tensor_bytes
from offload import pinned_empty

__all__ = ["CHUNK", "PHASES", "ReadBuffers"]

# Bytes per pread (and per crc32 call): big enough that syscalls cost nothing, small enough
# that the bytes are still in cache when the checksum runs over them.
CHUNK = 4 << 20

# What a reading thread's time goes to: reads (``pread``), the checksum, page-locking its
# buffers, and waiting for its copies to the device to finish with a buffer.
PHASES = ("io", "checksum", "pin", "h2d_wait")


class _PinnedChunks:
    """Page-locked ``CHUNK`` buffers kept from one load for the next in this process:
    page-locking costs about 1 s/GiB (``cudaHostRegister``), which a load would otherwise pay
    again for every reading thread's two chunks (8 MiB a thread). Registered for every
    device (portable). At most ``keep`` are kept (two for each of 64 threads: 512 MiB);
    more are unregistered when freed."""

    def __init__(self, keep: int) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._keep = keep

    def take(self, device: torch.device) -> torch.Tensor:
        with self._lock:
            if self._free:
                return self._free.pop()
        return pinned_empty(CHUNK, pin=True, device=device)

    def give(self, bufs: list[torch.Tensor]) -> None:
        with self._lock:
            self._free.extend(bufs[: max(0, self._keep - len(self._free))])


_PINNED = _PinnedChunks(keep=2 * 64)


class ReadBuffers:
    """The reused buffers of one reading thread: a pageable chunk, a whole-record buffer and
    two page-locked chunks for copies to the GPU. A thread's ``FileLoad``s share them one
    after another (each waits for its copies out of them before it ends), so a load split
    into many parts takes page-locked memory once per thread, not once per part; the load
    gives them back (``release``) for the next load of the process."""

    def __init__(self) -> None:
        self._chunk: bytearray | None = None
        self._whole: bytearray | None = None
        self._pinned: list[tuple[torch.Tensor, memoryview, Any]] = []
        self._device: torch.device | None = None
        # Seconds this thread spent in each phase (PHASES), for the load's timings.
        self.phases = dict.fromkeys(PHASES, 0.0)

    def chunk(self) -> memoryview:
        if self._chunk is None:
            self._chunk = bytearray(CHUNK)
        return memoryview(self._chunk)

    def chunk_tensor(self) -> torch.Tensor:
        self.chunk()
        return torch.frombuffer(self._chunk, dtype=torch.uint8)

    def record(self, nbytes: int) -> bytearray:
        if self._whole is None or len(self._whole) < nbytes:
            self._whole = bytearray(nbytes)
        return self._whole

    def pinned(self, i: int, device: torch.device) -> tuple[torch.Tensor, memoryview, Any]:
        """Page-locked chunk buffer ``i`` (of two), once its last copy to the device is done.
        Its event belongs to ``device`` (a CUDA event records on one device only)."""
        if self._device != device:
            self.drain()
            if not self._pinned:
                t0 = time.perf_counter()
                for _ in range(2):
                    t = _PINNED.take(device)
                    self._pinned.append((t, tensor_bytes(t), None))
                self.phases["pin"] += time.perf_counter() - t0
            self._pinned = [(t, v, torch.cuda.Event()) for t, v, _ in self._pinned]
            self._device = device
        buf, view, event = self._pinned[i]
        t0 = time.perf_counter()
        event.synchronize()  # returns at once if never recorded
        self.phases["h2d_wait"] += time.perf_counter() - t0
        return buf, view, event

    def drain(self) -> None:
        """Wait for the copies out of the page-locked buffers (no-op without any)."""
        if not self._pinned:
            return
        t0 = time.perf_counter()
        for _, _, event in self._pinned:
            if event is not None:
                event.synchronize()
        self.phases["h2d_wait"] += time.perf_counter() - t0

    def release(self) -> None:
        """Wait for the copies out of the page-locked chunks and keep them for the next load."""
        self.drain()
        _PINNED.give([t for t, _, _ in self._pinned])
        self._pinned, self._device = [], None
