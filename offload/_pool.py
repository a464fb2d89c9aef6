"""CPUOffloadPool: park tensors in flat (pinned) CPU buffers between uses.

Layout. Tracked tensors are grouped by ``(dtype, device)``; each group owns ONE flat CPU buffer
(``_groups[key]["cpu_flat"]``), pinned when the device is a GPU, allocated once and reused.
Tensors are further labelled with a *bucket* (any hashable the caller chooses, e.g. a pipeline
chunk). Within a group, every bucket occupies one contiguous range of ``cpu_flat``, and on the
device the bucket's tensors are views into one flat device buffer. So moving a bucket is a single
copy per (bucket, dtype), never one copy per tensor.

Offload = copy the bucket's device buffer into its range of ``cpu_flat``, then free the device
storage (``untyped_storage().resize_(0)``); every tensor keeps its Python identity, shape and
dtype, and reports a storage of 0 bytes. Reload = re-allocate the storage and copy back. Copies
are bit-exact, so anything computed with offload on equals the same computation with it off.

Tensors made by ``new_offloaded`` start life offloaded: their value (zeros) is written into
the CPU buffer and no device memory is allocated until their bucket is first reloaded.

Host views and snapshots (``host_views()``, ``freeze()``, ``cpu_views()``) are in
``_host.py``: a snapshot swaps each group to a second CPU buffer, so ``seg.host`` names the
buffer that holds a segment's newest bytes when it is not the group's current one.

On CUDA the copies run on two side streams (host-to-device and device-to-host, which the
hardware runs concurrently) and are ordered with events; every synchronisation point says why
it is there. On a CPU-only machine the same bookkeeping runs with plain synchronous copies, so
the logic is exercised without a GPU.

The pool knows nothing of optimizers: it holds tensors, buckets and buffers.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from offload._host import FrozenViews, HostViews
from offload._layout import Group
from offload._parked import park, unpark
from offload._pinned import pinned_empty

__all__ = ["CPUOffloadPool", "FrozenViews"]


def _local(t: Tensor) -> Tensor:
    """The tensor that owns the storage: a DTensor's local shard, else the tensor itself."""
    return getattr(t, "_local_tensor", t)


@dataclass
class _Entry:
    obj: Tensor  # what the caller tracks (a Tensor or a DTensor)
    local: Tensor  # the tensor whose storage is managed
    bucket: Hashable
    key: tuple[torch.dtype, torch.device]
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
class _Segment:
    """One bucket's tensors of one (dtype, device) group."""

    key: tuple[torch.dtype, torch.device]
    entries: list[_Entry] = field(default_factory=list)
    numel: int = 0
    cpu_start: int = 0  # element offset of this segment in its group's CPU buffers
    flat: Tensor | None = None  # flat device buffer; the entries are views into it
    bound: bool = True  # False: cold entries, not views of ``flat`` until the first reload
    host: Tensor | None = None  # the CPU buffer holding the bytes, if not the group's cpu_flat


@dataclass
class _Bucket:
    segments: dict[tuple[torch.dtype, torch.device], _Segment] = field(default_factory=dict)
    offloaded: bool = False
    h2d_done: dict = field(default_factory=dict)  # device -> CUDA event of the last reload
    d2h_done: dict = field(default_factory=dict)  # device -> CUDA event of the last offload


def _labelled(e: _Entry, what: str | None, read: str | None) -> _Entry:
    e.what = what or e.what
    e.read = read or e.read
    return e


class CPUOffloadPool(HostViews):
    """Flat CPU parking space for tensors that are idle between uses.

    ``track(t, bucket)`` registers a tensor; ``offload(bucket)`` / ``reload(bucket)`` move one
    bucket (or, with ``bucket=None``, all of them); ``wait_reload(bucket)`` makes the current
    stream wait until a reload has landed. ``clear()`` forgets all tensors (the buffers are kept
    for reuse). All methods take a bucket label that was used with ``track``.
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self._pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._managed: dict[int, _Entry] = {}
        self._groups: dict[tuple[torch.dtype, torch.device], Group] = {}
        self._storage_nbytes: dict[int, int] = {}
        self._buckets: dict[Hashable, _Bucket] = {}
        self._initialized = False
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    # ------------------------------------------------------------------ registration
    def track(
        self,
        tensor: Tensor,
        bucket: Hashable = 0,
        *,
        what: str | None = None,
        read: str | None = None,
    ) -> None:
        """Manage ``tensor`` (resident on its device) as part of ``bucket``. ``what`` names it
        and ``read`` says where its value can be read, in the error raised by any use of it
        while it is offloaded (``OffloadedStateError``)."""
        if id(tensor) in self._managed:
            return
        local = _local(tensor)
        if local.untyped_storage().size() == 0 and local.numel() > 0:
            raise ValueError(
                "CPUOffloadPool.track: the tensor has no storage (already freed); "
                "track tensors while they hold their data"
            )
        self._add(_labelled(_Entry(tensor, local, bucket, (local.dtype, local.device)), what, read))

    def new_offloaded(
        self,
        like: Tensor,
        bucket: Hashable = 0,
        *,
        what: str | None = None,
        read: str | None = None,
    ) -> Tensor:
        """A new tracked tensor of ``like``'s shape, dtype and device (a DTensor with its
        placement for a DTensor), equal to zeros, that starts offloaded: no device memory is
        used until ``bucket`` is reloaded (if the bucket also holds resident tensors, it is
        laid out resident, with zeros)."""
        src = _local(like)
        stride = torch.empty(src.shape, device="meta").stride()
        # A tensor of this shape whose storage holds 0 bytes, made without allocating (a
        # slice or as_strided would bounds-check the storage); its bytes appear at reload.
        local = torch.ops.aten._reshape_alias(
            torch.empty(0, dtype=src.dtype, device=src.device), tuple(src.shape), stride
        )
        obj: Tensor = local
        if src is not like:
            from torch.distributed.tensor import DTensor

            obj = DTensor(local, like._spec, requires_grad=False)
        entry = _labelled(
            _Entry(obj, local, bucket, (local.dtype, local.device), cold=True), what, read
        )
        self._add(entry)
        entry.park()
        return obj

    def _add(self, e: _Entry) -> None:
        if self._initialized:
            # Adding to a laid-out pool: bring everything home, then lay out again.
            self.reload()
            self.synchronize()
            self._initialized = False
        self._managed[id(e.obj)] = e
        self._storage_nbytes[id(e.obj)] = e.local.numel() * e.local.element_size()

    def is_tracked(self, tensor: Tensor) -> bool:
        return id(tensor) in self._managed

    def clear(self) -> None:
        """Bring every tensor home and forget it. Pinned buffers stay allocated for reuse."""
        if self._initialized:
            self.reload()
            self.synchronize()
        self._managed.clear()
        self._storage_nbytes.clear()
        self._buckets.clear()
        self._initialized = False

    # ------------------------------------------------------------------ layout
    def _pinned(self, key: tuple[torch.dtype, torch.device], numel: int) -> Tensor:
        return pinned_empty(numel, key[0], pin=self._pin and key[1].type == "cuda", device=key[1])

    def _ensure_initialized(self) -> None:
        if self._initialized:
            return
        buckets: dict[Hashable, _Bucket] = {}
        for e in self._managed.values():
            b = buckets.setdefault(e.bucket, _Bucket())
            seg = b.segments.setdefault(e.key, _Segment(e.key))
            e.offset = seg.numel
            seg.entries.append(e)
            seg.numel += e.local.numel()
        used: dict[tuple, int] = {}
        for b in buckets.values():
            for key, seg in b.segments.items():
                seg.cpu_start = used.get(key, 0)
                used[key] = seg.cpu_start + seg.numel
        for key, n in used.items():
            grp = self._groups.get(key)
            if grp is None or grp.cpu_flat.numel() < n:
                # Allocate once per group; grow only when more state is tracked (first step,
                # add_param_group). Pinning costs ~1 s/GiB, so it is never done per step.
                # A frozen buffer stays frozen (a writer may still read it) until released.
                grp = Group(self._pinned(key, n), frozen=grp.frozen if grp is not None else None)
                self._groups[key] = grp
        for b in buckets.values():
            if all(e.cold for seg in b.segments.values() for e in seg.entries):
                # Made offloaded: the value (zeros) goes to the CPU range; the device buffer
                # is a 0-byte storage that the first reload sizes, then binds the entries to.
                for seg in b.segments.values():
                    self._host_range(seg).zero_()
                    seg.flat = torch.ops.aten._reshape_alias(
                        torch.empty(0, dtype=seg.key[0], device=seg.key[1]), (seg.numel,), (1,)
                    )
                    seg.bound = False
                b.offloaded = True
                continue
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
                    e.local.set_(flat.untyped_storage(), e.offset, e.local.shape)
                seg.flat = flat
        self._buckets = buckets
        self._initialized = True

    def _host_range(self, seg: _Segment) -> Tensor:
        """The CPU range that holds (or will receive) ``seg``'s bytes."""
        buf = seg.host if seg.host is not None else self._groups[seg.key].cpu_flat
        return buf[seg.cpu_start : seg.cpu_start + seg.numel]

    # ------------------------------------------------------------------ streams
    def _side_streams(self, device: torch.device):
        s = self._streams.get(device)
        if s is None:
            s = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
            self._streams[device] = s
        return s

    def _select(self, bucket: Hashable | None) -> list[_Bucket]:
        self._ensure_initialized()
        if bucket is None:
            return list(self._buckets.values())
        b = self._buckets.get(bucket)
        return [] if b is None else [b]

    # ------------------------------------------------------------------ moves
    def offload(self, bucket: Hashable | None = None) -> None:
        """Copy the bucket's tensors to the CPU and free their device storage."""
        for b in self._select(bucket):
            if b.offloaded:
                continue
            for key, seg in b.segments.items():
                seg.host = None  # offloads always write the group's current buffer
                cpu = self._host_range(seg)
                nbytes = seg.numel * seg.flat.element_size()
                if key[1].type == "cuda":
                    _, d2h = self._side_streams(key[1])
                    # Sync: the copy must read the values the compute stream has written so
                    # far (e.g. this step's momentum update), so d2h waits for that stream.
                    d2h.wait_stream(torch.cuda.current_stream(key[1]))
                    with torch.cuda.stream(d2h):
                        cpu.copy_(seg.flat, non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(d2h)
                    b.d2h_done[key[1]] = done
                    # Sync: the caching allocator must not hand this block to anyone else
                    # before d2h has finished reading it.
                    seg.flat.record_stream(d2h)
                else:
                    cpu.copy_(seg.flat)
                if nbytes:
                    seg.flat.untyped_storage().resize_(0)
                    for e in seg.entries:
                        e.park()
            b.offloaded = True

    def reload(self, bucket: Hashable | None = None) -> None:
        """Re-allocate the bucket's device storage and start copying its data back.

        On CUDA the copy is asynchronous: call ``wait_reload(bucket)`` before the current
        stream reads the tensors.
        """
        for b in self._select(bucket):
            if not b.offloaded:
                continue
            for key, seg in b.segments.items():
                cpu = self._host_range(seg)
                nbytes = seg.numel * seg.flat.element_size()
                for e in seg.entries:
                    e.unpark()
                if key[1].type == "cuda":
                    h2d, _ = self._side_streams(key[1])
                    prev = b.d2h_done.pop(key[1], None)
                    with torch.cuda.stream(h2d):
                        if prev is not None:
                            # Sync: the CPU range must hold the last offload's bytes before
                            # they are read back.
                            h2d.wait_event(prev)
                        # Allocated on h2d, so the allocator hands out a block that is free
                        # for h2d; the compute stream's queued work need not drain first.
                        seg.flat.untyped_storage().resize_(nbytes)
                        self._bind(seg)
                        seg.flat.copy_(cpu, non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(h2d)
                    b.h2d_done[key[1]] = done
                else:
                    seg.flat.untyped_storage().resize_(nbytes)
                    self._bind(seg)
                    seg.flat.copy_(cpu)
            b.offloaded = False

    @staticmethod
    def _bind(seg: _Segment) -> None:
        """Point cold entries at the (now sized) flat storage: no allocation, it is big enough."""
        if not seg.bound:
            for e in seg.entries:
                e.local.set_(seg.flat.untyped_storage(), e.offset, e.local.shape)
                e.cold = False
            seg.bound = True

    def wait_reload(self, bucket: Hashable | None = None) -> None:
        """Make the current stream wait until the bucket's reload has landed."""
        for b in self._select(bucket):
            for dev, evt in list(b.h2d_done.items()):
                stream = torch.cuda.current_stream(dev)
                # Sync: compute reads the tensors only after the H2D copy is complete.
                stream.wait_event(evt)
                for seg in b.segments.values():
                    if seg.key[1] == dev:
                        # Sync: the block was allocated on h2d and is now used by the compute
                        # stream; a later free must wait for that use too.
                        seg.flat.record_stream(stream)
                del b.h2d_done[dev]

    def synchronize(self) -> None:
        """Block the host until every copy this pool issued has finished."""
        for b in self._buckets.values():
            for evt in (*b.h2d_done.values(), *b.d2h_done.values()):
                evt.synchronize()
        self.wait_reload()

    # ------------------------------------------------------------------ introspection
    def device_nbytes(self) -> int:
        """Bytes of tracked tensors currently resident on their devices."""
        total = 0
        for b in self._buckets.values():
            if not b.offloaded:
                total += sum(s.numel * s.flat.element_size() for s in b.segments.values())
        if not self._initialized:
            total += sum(n for i, n in self._storage_nbytes.items() if not self._managed[i].cold)
        return total

    def cpu_nbytes(self) -> int:
        """Bytes held by the flat CPU buffers (allocated once, reused; a second buffer per
        group once ``freeze`` was used)."""
        return sum(g.nbytes() for g in self._groups.values())
