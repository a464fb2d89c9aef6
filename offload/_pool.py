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

On CUDA the copies run on two side streams (host-to-device and device-to-host, which the
hardware runs concurrently) and are ordered with events; every synchronisation point says why
it is there. On a CPU-only machine the same bookkeeping runs with plain synchronous copies, so
the logic is exercised without a GPU.

The pool knows nothing of optimizers: it holds tensors, buckets and buffers.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["CPUOffloadPool"]


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


@dataclass
class _Segment:
    """One bucket's tensors of one (dtype, device) group."""

    key: tuple[torch.dtype, torch.device]
    entries: list[_Entry] = field(default_factory=list)
    numel: int = 0
    cpu_start: int = 0  # element offset of this segment in the group's cpu_flat
    flat: Tensor | None = None  # flat device buffer; the entries are views into it


@dataclass
class _Bucket:
    segments: dict[tuple[torch.dtype, torch.device], _Segment] = field(default_factory=dict)
    offloaded: bool = False
    h2d_done: dict = field(default_factory=dict)  # device -> CUDA event of the last reload
    d2h_done: dict = field(default_factory=dict)  # device -> CUDA event of the last offload


class CPUOffloadPool:
    """Flat CPU parking space for tensors that are idle between uses.

    ``track(t, bucket)`` registers a tensor; ``offload(bucket)`` / ``reload(bucket)`` move one
    bucket (or, with ``bucket=None``, all of them); ``wait_reload(bucket)`` makes the current
    stream wait until a reload has landed. ``clear()`` forgets all tensors (the buffers are kept
    for reuse). All methods take a bucket label that was used with ``track``.
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self._pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._managed: dict[int, _Entry] = {}
        self._groups: dict[tuple[torch.dtype, torch.device], dict] = {}
        self._storage_nbytes: dict[int, int] = {}
        self._buckets: dict[Hashable, _Bucket] = {}
        self._initialized = False
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    # ------------------------------------------------------------------ registration
    def track(self, tensor: Tensor, bucket: Hashable = 0) -> None:
        """Manage ``tensor`` (resident on its device) as part of ``bucket``."""
        if id(tensor) in self._managed:
            return
        local = _local(tensor)
        if local.untyped_storage().size() == 0 and local.numel() > 0:
            raise ValueError(
                "CPUOffloadPool.track: the tensor has no storage (already freed); "
                "track tensors while they hold their data"
            )
        if self._initialized:
            # Adding to a laid-out pool: bring everything home, then lay out again.
            self.reload()
            self.synchronize()
            self._initialized = False
        key = (local.dtype, local.device)
        self._managed[id(tensor)] = _Entry(tensor, local, bucket, key)
        self._storage_nbytes[id(tensor)] = local.numel() * local.element_size()

    def is_tracked(self, tensor: Tensor) -> bool:
        return id(tensor) in self._managed

    def tracked(self) -> list[Tensor]:
        return [e.obj for e in self._managed.values()]

    def clear(self) -> None:
        """Bring every tensor home and forget it. Pinned buffers stay allocated for reuse."""
        if self._initialized:
            self.reload()
            self.synchronize()
        self._managed.clear()
        self._storage_nbytes.clear()
        self._buckets.clear()
        for grp in self._groups.values():
            grp["used"] = 0
        self._initialized = False

    def buckets(self) -> list[Hashable]:
        self._ensure_initialized()
        return list(self._buckets)

    # ------------------------------------------------------------------ layout
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
            if grp is None or grp["cpu_flat"].numel() < n:
                # Allocate once per group; grow only when more state is tracked (first step,
                # add_param_group). Pinning costs ~1 s/GiB, so it is never done per step.
                pin = self._pin and key[1].type == "cuda"
                grp = {"cpu_flat": torch.empty(n, dtype=key[0], pin_memory=pin)}
                self._groups[key] = grp
            grp["used"] = n
        # Move each segment's tensors into one flat device buffer (views keep their identity).
        for b in buckets.values():
            for seg in b.segments.values():
                flat = torch.empty(seg.numel, dtype=seg.key[0], device=seg.key[1])
                for e in seg.entries:
                    n = e.local.numel()
                    flat[e.offset : e.offset + n].copy_(e.local.reshape(-1))
                    e.local.set_(flat.untyped_storage(), e.offset, e.local.shape)
                seg.flat = flat
        self._buckets = buckets
        self._initialized = True

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
                cpu = self._groups[key]["cpu_flat"][seg.cpu_start : seg.cpu_start + seg.numel]
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
                cpu = self._groups[key]["cpu_flat"][seg.cpu_start : seg.cpu_start + seg.numel]
                nbytes = seg.numel * seg.flat.element_size()
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
                        seg.flat.copy_(cpu, non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(h2d)
                    b.h2d_done[key[1]] = done
                else:
                    seg.flat.untyped_storage().resize_(nbytes)
                    seg.flat.copy_(cpu)
            b.offloaded = False

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

    def cpu_views(self) -> dict[int, Tensor]:
        """A CPU copy of every tracked tensor, served from the flat CPU buffers.

        Resident buckets are first copied into their CPU ranges (one copy per segment); the
        call returns once every copy has landed. Returns ``id(tracked tensor) -> CPU tensor``
        viewing the buffer (a DTensor with the same spec for a DTensor). The views alias the
        pool's buffers: they hold the values of this call until the pool next offloads.
        """
        self._ensure_initialized()
        for b in self._buckets.values():
            if b.offloaded:
                continue
            for key, seg in b.segments.items():
                cpu = self._groups[key]["cpu_flat"][seg.cpu_start : seg.cpu_start + seg.numel]
                if key[1].type == "cuda":
                    _, d2h = self._side_streams(key[1])
                    # Sync: read the values the compute stream has written so far.
                    d2h.wait_stream(torch.cuda.current_stream(key[1]))
                    with torch.cuda.stream(d2h):
                        cpu.copy_(seg.flat, non_blocking=True)
                    seg.flat.record_stream(d2h)
                else:
                    cpu.copy_(seg.flat)
        for dev in {key[1] for key in self._groups if key[1].type == "cuda"}:
            # Sync: the host may read the views as soon as this returns.
            self._side_streams(dev)[1].synchronize()
        self.synchronize()
        out: dict[int, Tensor] = {}
        for e in self._managed.values():
            seg = self._buckets[e.bucket].segments[e.key]
            start = seg.cpu_start + e.offset
            flat = self._groups[e.key]["cpu_flat"]
            if e.local is e.obj:
                out[id(e.obj)] = flat[start : start + e.local.numel()].view(e.local.shape)
                continue
            from torch.distributed.tensor import DTensor

            # Wrap a tensor that owns its (empty) storage first, then point it at the buffer:
            # a DTensor built around an offset view cannot be deep-copied (torch 2.11-2.13).
            local = torch.empty(0, dtype=flat.dtype)
            view = DTensor(local, e.obj._spec, requires_grad=False)
            local.set_(flat.untyped_storage(), start, e.local.shape)
            out[id(e.obj)] = view
        return out

    # ------------------------------------------------------------------ introspection
    def is_offloaded(self, bucket: Hashable) -> bool:
        self._ensure_initialized()
        return self._buckets[bucket].offloaded

    def device_nbytes(self) -> int:
        """Bytes of tracked tensors currently resident on their devices."""
        total = 0
        for b in self._buckets.values():
            if not b.offloaded:
                total += sum(s.numel * s.flat.element_size() for s in b.segments.values())
        if not self._initialized:
            total += sum(self._storage_nbytes.values())
        return total

    def cpu_nbytes(self) -> int:
        """Bytes held by the flat CPU buffers (allocated once, reused)."""
        return sum(
            g["cpu_flat"].numel() * g["cpu_flat"].element_size() for g in self._groups.values()
        )

    def track_many(self, tensors: Iterable[Tensor], bucket: Hashable = 0) -> None:
        for t in tensors:
            self.track(t, bucket)
