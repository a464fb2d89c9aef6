"""CPUOffloadPool: park tensors in flat (pinned) CPU buffers between uses.

Layout (``_layout.py``): one flat CPU buffer per ``(dtype, device)`` group
(``_groups[key].cpu_flat``), pinned when the device is a GPU, allocated once and reused. Within
a group each *bucket* (a label the caller chooses, e.g. a pipeline chunk) has one contiguous
range, and on the device its tensors are views into one flat buffer. So moving a bucket is a
single copy per (bucket, dtype), never one copy per tensor.

Offload = copy the bucket's device buffer into its range of ``cpu_flat``, then free the device
storage (``untyped_storage().resize_(0)``); every tensor keeps its Python identity, shape and
dtype, and reports a storage of 0 bytes. Reload = re-allocate the storage and copy back. Copies
are bit-exact, so anything computed with offload on equals the same computation with it off.

Tensors made by ``new_offloaded`` start life offloaded: their value (zeros) is written into
the CPU buffer and no device memory is allocated until their bucket is first reloaded.

Host views and snapshots (``host_views()``, ``freeze()``, ``cpu_views()``) are read by a
``HostViews`` (``_host.py``) that holds the same ``Layout`` as the pool: a snapshot swaps each
group to a second CPU buffer, so ``seg.host`` names the buffer that holds a segment's newest
bytes when it is not the group's current one.

On CUDA the copies run on two side streams (host-to-device and device-to-host, which the
hardware runs concurrently) and are ordered with events; every synchronisation point says why
it is there. A reload allocates on the h2d stream, and that block is freed only once h2d waits
for the copy that reads it out, so the allocator hands it to the next reload at once and the
host never waits. ``pipeline(order)`` (``_pipeline.py``) moves a step's buckets in order, at
most three of them holding device memory. On a CPU-only machine the same bookkeeping runs with
plain synchronous copies, so the logic is exercised without a GPU.

The pool knows nothing of optimizers: it holds tensors, buckets and buffers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from offload._host import FrozenViews, HostViews
from offload._layout import Bucket, Entry, Group, Key, Layout, Segment, dense_strides, point_at
from offload._pipeline import OffloadPipeline

__all__ = ["CPUOffloadPool", "FrozenViews"]


def _local(t: Tensor) -> Tensor:
    """The tensor that owns the storage: a DTensor's local shard, else the tensor itself."""
    return getattr(t, "_local_tensor", t)


def _labelled(e: Entry, what: str | None, read: str | None) -> Entry:
    e.what = what or e.what
    e.read = read or e.read
    return e


class CPUOffloadPool:
    """Flat CPU parking space for tensors that are idle between uses.

    ``track(t, bucket)`` registers a tensor; ``offload(bucket)`` / ``reload(bucket)`` move one
    bucket (or, with ``bucket=None``, all of them); ``wait_reload(bucket)`` makes the current
    stream wait until a reload has landed. ``clear()`` forgets all tensors (the buffers are kept
    for reuse). All methods take a bucket label that was used with ``track``.
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._layout = Layout(pin)  # where the bytes are: groups, buckets, segments
        self._host = HostViews(self._layout)
        self._managed: dict[int, Entry] = {}  # id(tracked tensor) -> its entry
        self._storage_nbytes: dict[int, int] = {}  # id(tracked tensor) -> its bytes
        self._initialized = False  # True once the tracked tensors are laid out
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._held_bytes = 0  # device bytes the laid-out buckets hold (``device_nbytes``)
        self._max_held = 0  # its high-water mark since ``reset_max_device_nbytes``

    @property
    def _groups(self) -> dict[Key, Group]:
        """The layout's CPU buffers by (dtype, device). The seed acceptance test
        (tests/gpu/test_cpu_offload.py) reads it, as it reads ``_managed``,
        ``_storage_nbytes`` and ``_initialized``: keep these four names."""
        return self._layout.groups

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
        self._add(_labelled(Entry(tensor, local, bucket, (local.dtype, local.device)), what, read))

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
        stride = dense_strides(src.shape)
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
            Entry(obj, local, bucket, (local.dtype, local.device), cold=True), what, read
        )
        self._add(entry)
        entry.park()
        return obj

    def _add(self, e: Entry) -> None:
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
        self._layout.forget()
        self._held_bytes = 0
        self._initialized = False

    # ------------------------------------------------------------------ layout
    def _ensure_initialized(self) -> None:
        if self._initialized:
            return
        self._layout.build(self._managed.values())
        self._held_bytes = self._layout.device_bytes()
        self._max_held = max(self._max_held, self._held_bytes)
        self._initialized = True

    # ------------------------------------------------------------------ streams
    def _side_streams(self, device: torch.device):
        s = self._streams.get(device)
        if s is None:
            s = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
            self._streams[device] = s
        return s

    def _select(self, bucket: Hashable | None) -> list[Bucket]:
        self._ensure_initialized()
        if bucket is None:
            return list(self._layout.buckets.values())
        b = self._layout.buckets.get(bucket)
        return [] if b is None else [b]

    # ------------------------------------------------------------------ moves
    def offload(self, bucket: Hashable | None = None) -> None:
        """Copy the bucket's tensors to the CPU and free their device storage."""
        for b in self._select(bucket):
            self._offload_bucket(b)
            self._release(b)

    def reload(self, bucket: Hashable | None = None) -> None:
        """Re-allocate the bucket's device storage and start copying its data back.

        On CUDA the copy is asynchronous: call ``wait_reload(bucket)`` before the current
        stream reads the tensors.
        """
        for b in self._select(bucket):
            self._reload_bucket(b)

    def wait_reload(self, bucket: Hashable | None = None) -> None:
        """Make the current stream wait until the bucket's reload has landed; the tensors may
        then be used on it like any others (and freed whenever their owner drops them)."""
        for b in self._select(bucket):
            self._wait_bucket(b, shared=True)

    def pipeline(
        self, order: Sequence[Hashable], *, ahead: int = 1, behind: int = 1
    ) -> OffloadPipeline:
        """A pass of the buckets ``order`` names, one after another, through the device,
        with at most ``ahead`` of them coming in and ``behind`` going out beside the one in use
        (``OffloadPipeline``)."""
        self._ensure_initialized()
        return OffloadPipeline(self, list(order), ahead, behind)

    def _bucket(self, label: Hashable) -> Bucket | None:
        self._ensure_initialized()
        return self._layout.buckets.get(label)

    def _offload_bucket(self, b: Bucket) -> None:
        """Start copying the bucket to the CPU and park its tensors; its device storage is
        held until ``_release``."""
        if b.offloaded:
            return
        for key, seg in b.segments.items():
            seg.host = None  # offloads always write the group's current buffer
            cpu = self._layout.host_range(seg)
            if key[1].type == "cuda":
                _, d2h = self._side_streams(key[1])
                # Sync: the copy must read the values the compute stream has written so far
                # (e.g. this step's momentum update), so d2h waits for that stream ...
                d2h.wait_stream(torch.cuda.current_stream(key[1]))
                landing = b.h2d_done.pop(key[1], None)
                if landing is not None:
                    # ... and for a reload of these bytes that nobody waited for.
                    d2h.wait_event(landing)
                with torch.cuda.stream(d2h):
                    cpu.copy_(seg.flat, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(d2h)
                b.d2h_done[key[1]] = done
            else:
                cpu.copy_(seg.flat)
            if seg.numel:
                for e in seg.entries:
                    e.park()
        b.offloaded = True
        b.held = True

    def _release(self, b: Bucket) -> None:
        """Free the device storage of an offloaded bucket (once its copies are ordered)."""
        if not b.held:
            return
        for key, seg in b.segments.items():
            if not seg.numel:
                continue
            if key[1].type == "cuda":
                h2d, d2h = self._side_streams(key[1])
                if seg.on_h2d:
                    # Sync: the block was allocated on h2d, so the allocator hands it only to
                    # later h2d allocations; h2d waits here for the D2H that reads it (which
                    # waited for the compute that wrote it), so their copies land after it.
                    h2d.wait_event(b.d2h_done[key[1]])
                else:
                    # Sync: allocated on another stream: the allocator must not hand the block
                    # to anyone else before d2h has finished reading it.
                    seg.flat.record_stream(d2h)
            seg.flat.untyped_storage().resize_(0)
            self._held_bytes -= seg.numel * seg.flat.element_size()
        b.held = False

    def _reload_bucket(self, b: Bucket) -> None:
        if not b.offloaded:
            return
        self._release(b)
        for key, seg in b.segments.items():
            cpu = self._layout.host_range(seg)
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
                    # Allocated on h2d, so the allocator hands out a block that is free for
                    # h2d (``_release`` orders every free of one); the compute stream's
                    # queued work need not drain first.
                    seg.flat.untyped_storage().resize_(nbytes)
                    seg.on_h2d = True
                    self._bind(seg)
                    seg.flat.copy_(cpu, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(h2d)
                b.h2d_done[key[1]] = done
            else:
                seg.flat.untyped_storage().resize_(nbytes)
                self._bind(seg)
                seg.flat.copy_(cpu)
            self._held_bytes += nbytes
        b.offloaded = False
        self._max_held = max(self._max_held, self._held_bytes)

    def _wait_bucket(self, b: Bucket, *, shared: bool) -> None:
        """Make the current stream wait for the bucket's reload. ``shared``: the tensors may
        be freed by anyone after uses on that stream (not only by ``_release``)."""
        for dev, evt in list(b.h2d_done.items()):
            stream = torch.cuda.current_stream(dev)
            # Sync: compute reads the tensors only after the H2D copy is complete.
            stream.wait_event(evt)
            if shared:
                for seg in b.segments.values():
                    if seg.key[1] == dev:
                        # Sync: the block was allocated on h2d and is now used by the compute
                        # stream; a free other than ``_release`` must wait for that use too.
                        seg.flat.record_stream(stream)
            del b.h2d_done[dev]

    @staticmethod
    def _bind(seg: Segment) -> None:
        """Point cold entries at the (now sized) flat storage: no allocation, it is big enough."""
        if not seg.bound:
            for e in seg.entries:
                point_at(e.local, seg.flat, e.offset)
                e.cold = False
            seg.bound = True

    def synchronize(self) -> None:
        """Block the host until every copy this pool issued has finished."""
        for b in self._layout.buckets.values():
            for evt in (*b.h2d_done.values(), *b.d2h_done.values()):
                evt.synchronize()
        self.wait_reload()

    # ------------------------------------------------------------------ host views
    def cpu_views(self) -> dict[int, Tensor]:
        """A CPU copy of every tracked tensor, served from the flat CPU buffers.

        Resident buckets are first copied into their CPU ranges (one copy per segment); the
        call returns once every copy has landed. Returns ``id(tracked tensor) -> CPU tensor``
        viewing the buffer (a DTensor with the same spec for a DTensor). The views alias the
        pool's buffers: they hold the values of this call until the pool next offloads.
        """
        self._ensure_initialized()
        for b in self._layout.buckets.values():
            if b.offloaded:
                continue
            for key, seg in b.segments.items():
                seg.host = None
                cpu = self._layout.host_range(seg)
                if key[1].type == "cuda":
                    _, d2h = self._side_streams(key[1])
                    # Sync: read the values the compute stream has written so far.
                    d2h.wait_stream(torch.cuda.current_stream(key[1]))
                    with torch.cuda.stream(d2h):
                        cpu.copy_(seg.flat, non_blocking=True)
                    seg.flat.record_stream(d2h)
                else:
                    cpu.copy_(seg.flat)
        for dev in {key[1] for key in self._layout.groups if key[1].type == "cuda"}:
            # Sync: the host may read the views as soon as this returns.
            self._side_streams(dev)[1].synchronize()
        self.synchronize()
        return self._host.views(self._managed.values())

    def host_views(self) -> dict[int, Tensor]:
        """For every offloaded tensor, ``id(tensor) ->`` the CPU view holding its value
        (resident tensors are left out). Writing into a view sets the value that the next
        reload brings back. Valid until the pool next moves that tensor. While a snapshot is
        frozen, the views are of the current buffer (bytes still only in the frozen one are
        copied over first), so writing them never changes the snapshot."""
        self._ensure_initialized()
        return self._host.host_views()

    def freeze(self) -> FrozenViews:
        """``host_views()`` that keep their values until ``release()``, whatever the pool
        does meanwhile (offloads go to a second CPU buffer). No bytes are copied; the second
        buffer is allocated (and pinned) by the first freeze and reused by later ones. One
        freeze at a time."""
        self._ensure_initialized()
        return self._host.freeze()

    # ------------------------------------------------------------------ introspection
    def device_nbytes(self) -> int:
        """Bytes of device storage the tracked tensors hold now: resident ones, and (inside a
        pipeline) offloaded ones whose storage is not released yet."""
        if self._initialized:
            return self._held_bytes
        return sum(n for i, n in self._storage_nbytes.items() if not self._managed[i].cold)

    def max_device_nbytes(self) -> int:
        """The most ``device_nbytes()`` has been since the pool was made or
        ``reset_max_device_nbytes()`` (as ``torch.cuda.max_memory_allocated`` for the
        allocator): what a pipeline kept on the device at once."""
        return max(self._max_held, self.device_nbytes())

    def reset_max_device_nbytes(self) -> None:
        self._max_held = self.device_nbytes()

    def cpu_nbytes(self) -> int:
        """Bytes held by the flat CPU buffers (allocated once, reused; a second buffer per
        group once ``freeze`` was used)."""
        return sum(g.nbytes() for g in self._layout.groups.values())
