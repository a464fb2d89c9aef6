"""What the offload pool shows of its CPU buffers: views of the tensors' values there, and
snapshots of them that stay unchanged while the pool goes on working.

``HostViews`` reads and re-points the ``Layout`` (``_layout.py``) it shares with
``CPUOffloadPool``; it moves nothing between host and device. ``freeze()`` swaps each
(dtype, device) group to a second CPU buffer (allocated by the first freeze, then reused):
later offloads write there, a reload reads each bucket from whichever buffer holds its newest
bytes (``seg.host``), and the frozen buffer keeps the values of the freeze until
``release()``. No byte is copied to take the snapshot; a release copies back only the
buckets whose newest bytes are still in the frozen buffer, and swaps the buffers instead when
nothing was offloaded since the freeze.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from offload._layout import Entry, Group, Key, Layout

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
    """Host views and snapshots of a pool's layout. The pool lays itself out (and lands its
    copies, for ``views`` of resident tensors) before it calls these."""

    def __init__(self, layout: Layout) -> None:
        self._layout = layout

    def host_views(self) -> dict[int, Tensor]:
        """``CPUOffloadPool.host_views()``: ``id(tensor) ->`` the CPU view holding the value of
        every offloaded tensor, in the group's current buffer."""
        self._wait_offloads()
        for key, grp in self._layout.groups.items():
            if grp.frozen is not None:
                self._unfreeze(key, grp, swap_back=False)
        return self.views(self._layout.offloaded_entries())

    def freeze(self) -> FrozenViews:
        """``CPUOffloadPool.freeze()``: views of the offloaded tensors that keep their values
        until ``release()``, as later offloads go to each group's second buffer."""
        layout = self._layout
        if any(g.frozen is not None for g in layout.groups.values()):
            raise RuntimeError(
                "CPUOffloadPool.freeze: a snapshot of these states is still held (one at a "
                "time: is another asynchronous save of this optimizer pending?); release() it "
                "first"
            )
        self._wait_offloads()
        entries = layout.offloaded_entries()
        spares = {}
        for key, grp in layout.groups.items():  # allocate first: a failure changes nothing
            spare = grp.spare
            n = grp.cpu_flat.numel()
            spares[key] = spare if spare is not None and spare.numel() >= n else None
        for key in spares:
            if spares[key] is None:
                spares[key] = layout.pinned(key, layout.groups[key].cpu_flat.numel())
        frozen = {}
        for key, grp in layout.groups.items():
            cur = frozen[key] = grp.cpu_flat
            grp.frozen, grp.cpu_flat, grp.spare = cur, spares[key], None
            for b in layout.buckets.values():
                seg = b.segments.get(key)
                if seg is not None and b.offloaded and seg.host is None:
                    seg.host = cur
        return FrozenViews(self.views(entries), lambda: self._release(frozen))

    def views(self, entries: Iterable[Entry]) -> dict[int, Tensor]:
        """``id(tracked tensor) ->`` a CPU view of its newest bytes, for each of ``entries``."""
        out: dict[int, Tensor] = {}
        for e in entries:
            seg = self._layout.buckets[e.bucket].segments[e.key]
            view = _exact_view(
                self._layout.host_buffer(seg), seg.cpu_start + e.offset, e.local.shape
            )
            if e.local is not e.obj:
                from torch.distributed.tensor import DTensor

                view = DTensor(view, e.obj._spec, requires_grad=False)
            out[id(e.obj)] = view
        return out

    def _release(self, frozen: dict[Key, Tensor]) -> None:
        """Give back the buffers ``frozen`` (key -> buffer) froze, where they still are."""
        for key, buf in frozen.items():
            grp = self._layout.groups.get(key)
            if grp is not None and grp.frozen is buf:
                self._unfreeze(key, grp, swap_back=True)

    def _unfreeze(self, key: Key, grp: Group, *, swap_back: bool) -> None:
        """Move every bucket whose newest bytes are only in the frozen buffer back to the
        group's current one: by swapping the two when nothing was offloaded since the freeze
        (``swap_back``), else by copying those buckets' ranges. The frozen buffer becomes the
        spare (``swap_back``) or stays frozen with its bytes unchanged."""
        buckets = self._layout.buckets.values()
        frozen = grp.frozen
        segs = [b.segments[key] for b in buckets if key in b.segments]
        still = [s for s in segs if s.host is frozen]
        newer = [
            b.segments[key]
            for b in buckets
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

    def _wait_offloads(self) -> None:
        for b in self._layout.buckets.values():
            for evt in b.d2h_done.values():
                # Sync: the host reads (or a writer fills) the CPU ranges only after the
                # offload copies into them have landed.
                evt.synchronize()
