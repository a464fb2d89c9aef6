"""A pass of buckets through the device in a fixed order, its copies hidden behind the compute.

A step that uses its offloaded states bucket by bucket (an optimizer's pipeline chunks) names
the order up front; then, for each bucket, ``enter(label)`` before the compute stream uses
its tensors and ``leave(label)`` right after its last use, and ``close()`` at the end::

    pipe = pool.pipeline(["a", "b", "c"])
    try:
        for label in ("a", "b", "c"):
            pipe.enter(label)
            ...  # compute on the bucket's tensors (the current stream)
            pipe.leave(label)
    finally:
        pipe.close()

What runs where (CUDA; on a CPU-only machine the same bookkeeping with synchronous copies):

* ``enter(k)`` starts the host-to-device copies of the ``ahead`` next buckets on the pool's
  h2d stream and makes the compute stream wait (an event) for bucket k's own;
* ``leave(k)`` starts bucket k's device-to-host copy on the d2h stream (after the compute
  queued so far) and parks its tensors. Its device storage is released only when a later
  bucket's reload needs the room: then h2d waits (an event) for that copy first. So while
  bucket k computes, k+1 comes in and k-1 goes out, the two directions at once (PCIe is full
  duplex), and at most ``ahead + 1 + behind`` buckets hold device memory at any moment: the
  allocator hands a released block only to later h2d allocations, which queue behind it.

The host never waits: every ordering is an event on a stream. ``pool.max_device_nbytes()``
shows what a pass held at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Any

import torch

__all__ = ["OffloadPipeline"]


class OffloadPipeline:
    """One pass of ``order`` (bucket labels) through the device; made by
    ``CPUOffloadPool.pipeline(order)``. Labels the pool does not hold (no tensors tracked
    with them) keep their place in the order and move nothing."""

    def __init__(self, pool: Any, order: list[Hashable], ahead: int, behind: int) -> None:
        if ahead < 0 or behind < 0:
            raise ValueError(f"ahead and behind must be >= 0, got {ahead} and {behind}")
        self._pool = pool
        self._order = order
        self._at = {label: i for i, label in enumerate(order)}
        if len(self._at) != len(order):
            raise ValueError(f"a pipeline's order names each bucket once, got {order!r}")
        self._ahead = ahead
        self._behind = behind
        self._held: deque[tuple[int, Any]] = deque()  # left, storage not released: (pos, bucket)
        self._entered: dict[int, Any] = {}  # entered and not left: pos -> bucket

    def enter(self, label: Hashable) -> None:
        """Bucket ``label`` is about to be used on the current stream: its reload is started
        (if a previous ``enter`` did not prefetch it) and waited for on that stream, and the
        reloads of the ``ahead`` next buckets are started."""
        i = self._at[label]
        # The buckets that left the window give their storage back first (room for the next).
        while self._held and self._held[0][0] < i - self._behind:
            self._pool._release(self._held.popleft()[1])
        for j in range(i, min(i + self._ahead, len(self._order) - 1) + 1):
            b = self._pool._bucket(self._order[j])
            if b is not None:
                self._pool._reload_bucket(b)  # (a no-op for a resident one)
        b = self._pool._bucket(label)
        if b is not None:
            self._pool._wait_bucket(b, shared=False)
            self._entered[i] = b

    def leave(self, label: Hashable) -> None:
        """The current stream has queued its last use of bucket ``label``: copy it out."""
        i = self._at[label]
        b = self._entered.pop(i, None) or self._pool._bucket(label)
        if b is None or b.offloaded:
            return
        self._pool._offload_bucket(b)
        self._held.append((i, b))

    def close(self) -> None:
        """Release the device storage of every bucket that left (the pass is over). Buckets
        entered and not left (an error cut the pass short) stay on the device, usable on the
        current stream like any tensor."""
        while self._held:
            self._pool._release(self._held.popleft()[1])
        for b in self._entered.values():
            for seg in b.segments.values():
                if seg.key[1].type == "cuda" and seg.numel:
                    # Sync: these blocks are freed by whoever drops them now, not by
                    # ``_release``: the allocator must wait for the uses queued on this stream.
                    seg.flat.record_stream(torch.cuda.current_stream(seg.key[1]))
        self._entered.clear()
