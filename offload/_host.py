"""What the offload pool shows of its CPU buffers: views of the tensors' values there, and
snapshots of them that stay unchanged while the pool goes on working.

``HostViews`` is a part of ``CPUOffloadPool`` (kept apart for length); it reads the pool's
groups, buckets and segments (see ``_pool.py``). ``freeze()`` swaps each (dtype, device) group
to a second CPU buffer (allocated by the first freeze, then reused): later offloads write
there, a reload reads each bucket from whichever buffer holds its newest bytes (``seg.host``),
and the frozen buffer keeps the values of the freeze until ``release()``. No byte is copied to
take the snapshot; a release copies back only the buckets whose newest bytes are still in the
frozen buffer, and swaps the buffers instead when nothing was offloaded since the freeze.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from offload._layout import Group

__all__ = ["FrozenViews", "HostViews"]


def _exact_view(buf: Tensor, start: int, shape: torch.Size) -> Tensor:
    """A view of ``buf`` (a flat CPU buffer) from element ``start``, of ``shape``, whose
    storage is exactly its own bytes (made through a numpy slice): DCP writes such a tensor
    as it is, where it would first clone one whose storage is larger than itself."""
    size = buf.element_size()
    n = 1
    for d in shape:
        n *= d
    raw = buf.view(torch.uint8).numpy()[start * size : (start + n) * size]
    return torch.from_numpy(raw).view(buf.dtype).view(shape)


class FrozenViews:
    """The values of every offloaded tensor at ``CPUOffloadPool.freeze()``, as CPU views that
    keep those values until ``release()``. ``views`` maps ``id(tracked tensor)`` to its view."""

    def __init__(self, views: dict[int, Tensor], release: Callable[[], None]) -> None:
        self.views = views
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        """Give the frozen buffer back to the pool (call from the thread that steps). Idempotent."""
        rel, self._release = self._release, None
        self.views = {}
        if rel is not None:
            rel()


class HostViews:
    """Host views and snapshots of a ``CPUOffloadPool`` (mixed into it)."""

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
                seg.host = None
                cpu = self._host_range(seg)
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
        return self._views(self._managed.values())

    def host_views(self) -> dict[int, Tensor]:
        """For every offloaded tensor, ``id(tensor) ->`` the CPU view holding its value
        (resident tensors are left out). Writing into a view sets the value that the next
        reload brings back. Valid until the pool next moves that tensor. While a snapshot is
        frozen, the views are of the current buffer (bytes still only in the frozen one are
        copied over first), so writing them never changes the snapshot."""
        self._ensure_initialized()
        self._wait_offloads()
        for key, grp in self._groups.items():
            if grp.frozen is not None:
                self._unfreeze(key, grp, swap_back=False)
        return self._views(self._offloaded_entries())

    def freeze(self) -> FrozenViews:
        """``host_views()`` that keep their values until ``release()``, whatever the pool
        does meanwhile (offloads go to a second CPU buffer). No bytes are copied; the second
        buffer is allocated (and pinned) by the first freeze and reused by later ones. One
        freeze at a time."""
        self._ensure_initialized()
        if any(g.frozen is not None for g in self._groups.values()):
            raise RuntimeError(
                "CPUOffloadPool.freeze: a snapshot of these states is still held (one at a "
                "time: is another asynchronous save of this optimizer pending?); release() it "
                "first"
            )
        self._wait_offloads()
        entries = self._offloaded_entries()
        spares = {}
        for key, grp in self._groups.items():  # allocate first: a failure changes nothing
            spare = grp.spare
            n = grp.cpu_flat.numel()
            spares[key] = spare if spare is not None and spare.numel() >= n else None
        for key in spares:
            if spares[key] is None:
                spares[key] = self._pinned(key, self._groups[key].cpu_flat.numel())
        frozen = {}
        for key, grp in self._groups.items():
            cur = frozen[key] = grp.cpu_flat
            grp.frozen, grp.cpu_flat, grp.spare = cur, spares[key], None
            for b in self._buckets.values():
                seg = b.segments.get(key)
                if seg is not None and b.offloaded and seg.host is None:
                    seg.host = cur
        return FrozenViews(self._views(entries), lambda: self._release(frozen))

    def _release(self, frozen: dict) -> None:
        """Give back the buffers ``frozen`` (key -> buffer) froze, where they still are."""
        for key, buf in frozen.items():
            grp = self._groups.get(key)
            if grp is not None and grp.frozen is buf:
                self._unfreeze(key, grp, swap_back=True)

    def _unfreeze(self, key: tuple, grp: Group, *, swap_back: bool) -> None:
        """Move every bucket whose newest bytes are only in the frozen buffer back to the
        group's current one: by swapping the two when nothing was offloaded since the freeze
        (``swap_back``), else by copying those buckets' ranges. The frozen buffer becomes the
        spare (``swap_back``) or stays frozen with its bytes unchanged."""
        frozen = grp.frozen
        segs = [b.segments[key] for b in self._buckets.values() if key in b.segments]
        still = [s for s in segs if s.host is frozen]
        newer = [
            b.segments[key]
            for b in self._buckets.values()
            if b.offloaded and key in b.segments and b.segments[key].host is None
        ]
        if swap_back and still and not newer:
            # Nothing was offloaded since the freeze: the frozen buffer is current again.
            grp.spare, grp.cpu_flat = grp.cpu_flat, frozen
        else:
            for s in still:  # offloaded before the freeze and not moved since
                grp.cpu_flat[s.cpu_start : s.cpu_start + s.numel].copy_(
                    frozen[s.cpu_start : s.cpu_start + s.numel]
                )
            if swap_back:
                grp.spare = frozen
        for s in still:
            s.host = None
        if swap_back:
            grp.frozen = None

    def _offloaded_entries(self) -> list:
        return [
            e
            for b in self._buckets.values()
            if b.offloaded
            for seg in b.segments.values()
            for e in seg.entries
        ]

    def _wait_offloads(self) -> None:
        for b in self._buckets.values():
            for evt in b.d2h_done.values():
                # Sync: the host reads (or a writer fills) the CPU ranges only after the
                # offload copies into them have landed.
                evt.synchronize()

    def _views(self, entries) -> dict[int, Tensor]:
        out: dict[int, Tensor] = {}
        for e in entries:
            seg = self._buckets[e.bucket].segments[e.key]
            buf = seg.host if seg.host is not None else self._groups[e.key].cpu_flat
            view = _exact_view(buf, seg.cpu_start + e.offset, e.local.shape)
            if e.local is not e.obj:
                from torch.distributed.tensor import DTensor

                view = DTensor(view, e.obj._spec, requires_grad=False)
            out[id(e.obj)] = view
        return out
