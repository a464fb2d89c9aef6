"""The pool's layout: where the bytes of every tracked tensor live, on the device and on the host.

Tracked tensors are grouped by ``(dtype, device)``; each group owns ONE flat CPU buffer
(``Group.cpu_flat``), pinned when the device is a GPU, allocated once and reused. Tensors are
further labelled with a *bucket* (any hashable the caller chooses, e.g. a pipeline chunk).
Within a group, every bucket occupies one contiguous range of ``cpu_flat`` (its *segment*), and
on the device the segment's tensors are views into one flat device buffer. So moving a bucket
is a single copy per (bucket, dtype), never one copy per tensor.

The pool (``_pool.py``) moves bytes through this layout; its host views (``_host.py``) read it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from offload._parked import park, unpark
from offload._pinned import pinned_empty

__all__ = ["Bucket", "Entry", "Group", "Key", "Layout", "Segment"]

Key = tuple[torch.dtype, torch.device]  # a group: the dtype and device of its tensors


@dataclass
class Entry:
    """One tracked tensor."""

    obj: Tensor  # what the caller tracks (a Tensor or a DTensor)
    local: Tensor  # the tensor whose storage is managed
    bucket: Hashable
    key: Key
    offset: int = 0  # element offset inside the bucket's flat device buffer
    cold: bool = False  # made by new_offloaded: no data on the device yet, value zeros
    what: str = "a tensor tracked by CPUOffloadPool"  # names it in OffloadedStateError
    read: str = "CPUOffloadPool.host_views()"  # where its value can be read while offloaded

    def park(self) -> None:
        """Its storage is freed: any use of it but its metadata raises (``_parked``)."""
        if self.local.numel():
            park(self.obj, self.local, self.what, self.read)

    def unpark(self) -> None:
        unpark(self.obj, self.local)


@dataclass
class Segment:
    """One bucket's tensors of one (dtype, device) group."""

    key: Key
    entries: list[Entry] = field(default_factory=list)
    numel: int = 0
    cpu_start: int = 0  # element offset of this segment in its group's CPU buffers
    flat: Tensor | None = None  # flat device buffer; the entries are views into it
    bound: bool = True  # False: cold entries, not views of ``flat`` until the first reload
    host: Tensor | None = None  # the CPU buffer holding the bytes, if not the group's cpu_flat
    on_h2d: bool = False  # ``flat``'s storage was allocated on the host-to-device stream


@dataclass
class Bucket:
    segments: dict[Key, Segment] = field(default_factory=dict)
    offloaded: bool = False
    held: bool = False  # offloaded, but its device storage is not released yet (a pipeline's)
    h2d_done: dict = field(default_factory=dict)  # device -> CUDA event of the last reload
    d2h_done: dict = field(default_factory=dict)  # device -> CUDA event of the last offload


@dataclass
class Group:
    """The flat CPU buffers of one (dtype, device) group, each allocated once and reused.

    ``cpu_flat`` receives offloads; ``frozen`` is the buffer a held snapshot froze (``freeze()``
    in ``_host.py``), None when none is held; ``spare`` is the second buffer between snapshots.
    """

    cpu_flat: Tensor
    spare: Tensor | None = None
    frozen: Tensor | None = None

    def __getitem__(self, name: str) -> Tensor:
        """``group["cpu_flat"]``: groups were dicts, and the seed acceptance test
        (tests/gpu/test_cpu_offload.py, never edited) reads ``pool._groups[key]["cpu_flat"]``."""
        if name != "cpu_flat":
            raise KeyError(name)
        return self.cpu_flat

    def nbytes(self) -> int:
        """Bytes of the buffers this group holds (one, or two once a snapshot was taken)."""
        bufs = (self.cpu_flat, self.spare, self.frozen)
        return sum(t.numel() * t.element_size() for t in bufs if t is not None)


class Layout:
    """The groups (CPU buffers) and buckets (segments, device buffers) of one pool.

    ``build(entries)`` lays tracked tensors out; ``forget()`` drops the buckets and keeps the
    buffers for reuse. Both the pool and its host views hold the same ``Layout``.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.groups: dict[Key, Group] = {}
        self.buckets: dict[Hashable, Bucket] = {}

    def build(self, entries: Iterable[Entry]) -> None:
        """Lay ``entries`` out: segments in tracking order, one CPU range per segment, CPU
        buffers grown where needed, then each bucket's tensors moved into one flat device
        buffer per segment (or, made offloaded, left on the host)."""
        buckets = _segments(entries)
        self._grow_groups(_cpu_ranges(buckets))
        for b in buckets.values():
            self._place(b)
        self.buckets = buckets

    def forget(self) -> None:
        """Drop every bucket; the CPU buffers stay allocated for reuse."""
        self.buckets.clear()

    def device_bytes(self) -> int:
        """Bytes of device storage the buckets hold (resident, or offloaded and not released)."""
        return sum(
            seg.numel * seg.key[0].itemsize
            for b in self.buckets.values()
            if not b.offloaded or b.held
            for seg in b.segments.values()
        )

    def pinned(self, key: Key, numel: int) -> Tensor:
        return pinned_empty(numel, key[0], pin=self.pin and key[1].type == "cuda", device=key[1])

    def host_buffer(self, seg: Segment) -> Tensor:
        """The CPU buffer that holds ``seg``'s newest bytes."""
        return seg.host if seg.host is not None else self.groups[seg.key].cpu_flat

    def host_range(self, seg: Segment) -> Tensor:
        """The CPU range that holds (or will receive) ``seg``'s bytes."""
        return self.host_buffer(seg)[seg.cpu_start : seg.cpu_start + seg.numel]

    def offloaded_entries(self) -> list[Entry]:
        return [
            e
            for b in self.buckets.values()
            if b.offloaded
            for seg in b.segments.values()
            for e in seg.entries
        ]

    def _grow_groups(self, used: dict[Key, int]) -> None:
        for key, n in used.items():
            grp = self.groups.get(key)
            if grp is None or grp.cpu_flat.numel() < n:
                # Allocate once per group; grow only when more state is tracked (first step,
                # add_param_group). Pinning costs ~1 s/GiB, so it is never done per step.
                # A frozen buffer stays frozen (a writer may still read it) until released.
                grp = Group(self.pinned(key, n), frozen=grp.frozen if grp is not None else None)
                self.groups[key] = grp

    def _place(self, b: Bucket) -> None:
        """Put the bucket's values where its first move expects them."""
        if all(e.cold for seg in b.segments.values() for e in seg.entries):
            # Made offloaded: the value (zeros) goes to the CPU range; the device buffer
            # is a 0-byte storage that the first reload sizes, then binds the entries to.
            for seg in b.segments.values():
                self.host_range(seg).zero_()
                seg.flat = torch.ops.aten._reshape_alias(
                    torch.empty(0, dtype=seg.key[0], device=seg.key[1]), (seg.numel,), (1,)
                )
                seg.bound = False
            b.offloaded = True
            return
        # Move each segment's tensors into one flat device buffer (views keep identity).
        for seg in b.segments.values():
            flat = torch.empty(seg.numel, dtype=seg.key[0], device=seg.key[1])
            for e in seg.entries:
                n = e.local.numel()
                if e.cold:
                    e.unpark()
                    flat[e.offset : e.offset + n].zero_()
                    e.cold = False
                else:
                    flat[e.offset : e.offset + n].copy_(e.local.reshape(-1))
                point_at(e.local, flat, e.offset)
            seg.flat = flat


def dense_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    return torch.empty(shape, device="meta").stride()


def point_at(local: Tensor, flat: Tensor, offset: int) -> None:
    """Make ``local`` a contiguous view of ``flat`` from ``offset`` (keeping its identity): the
    pool's ranges hold values in row-major order, so a non-contiguous state's own strides would
    read them in another order, or past the range."""
    local.set_(flat.untyped_storage(), offset, local.shape, dense_strides(local.shape))


def _segments(entries: Iterable[Entry]) -> dict[Hashable, Bucket]:
    """The buckets of ``entries``: each entry joins its bucket's segment of its group, at the
    segment's end."""
    buckets: dict[Hashable, Bucket] = {}
    for e in entries:
        b = buckets.setdefault(e.bucket, Bucket())
        seg = b.segments.setdefault(e.key, Segment(e.key))
        e.offset = seg.numel
        seg.entries.append(e)
        seg.numel += e.local.numel()
    return buckets


def _cpu_ranges(buckets: dict[Hashable, Bucket]) -> dict[Key, int]:
    """Give each segment its range of its group's CPU buffers (the buckets one after another);
    return the elements each group uses."""
    used: dict[Key, int] = {}
    for b in buckets.values():
        for key, seg in b.segments.items():
            seg.cpu_start = used.get(key, 0)
            used[key] = seg.cpu_start + seg.numel
    return used
