"""Host staging for a save: tensors are copied into one reusable host buffer per source device
before DCP writes them, so DCP's writer threads only see host tensors that training no longer
touches.

Why: left to itself, DCP copies each device tensor with a blocking ``.cpu()`` into freshly
allocated pageable memory, inside its writer threads (~9 GB/s on an H200, serialised with the
writes of that thread). Here every device tensor of the flat state dict gets a range of a flat
host buffer (page-locked where CUDA is, from ``offload.pinned_empty``; allocated once and reused
by every later save while the state keeps its layout) and all copies are queued at once on a
side stream (~55 GB/s pinned). A synchronous save lets each writer thread wait only for the
copy of the item it writes next (one event per tensor), so copies overlap the first writes;
an asynchronous save waits for all of them before ``save()`` returns, and also copies the CPU
tensors that training would otherwise change under the writer (``copy_cpu``).

Each staged tensor is a host tensor whose storage is exactly its own range of the buffer (made
through a numpy slice), so DCP neither clones it (it clones tensors whose storage is larger than
themselves) nor writes more than its bytes. A DTensor is staged as a DTensor with the same spec
around the staged local tensor, so the checkpoint keeps its sharding metadata.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from muon_ckpt._tensors import copy_into, local_tensor
from muon_ckpt._threads import join, start
from offload import pinned_empty

__all__ = ["HostStaging"]

_ALIGN = 64  # bytes; every range starts aligned for any dtype (and for torch.save's records)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class HostStaging:
    """Reusable host buffers (one per source device) and the copies of one save into them.

    ``stage(sd, ...)`` returns a dict with the same keys in which every top-level device
    tensor (or DTensor with a device local tensor), and with ``copy_cpu`` every CPU tensor, is
    replaced by its host copy; device copies are queued, not awaited. ``wait(key)`` blocks until
    that key's copy has landed, ``finish()`` until all have. Not thread-safe for ``stage`` (one
    save at a time); ``wait`` may be called from any thread.
    """

    def __init__(self) -> None:
        self._buffers: dict[torch.device, Tensor] = {}
        self._events: dict[str, Any] = {}
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()
        self._copier: threading.Thread | None = None  # deferred CPU copies (stage(defer=))
        self._copied: dict[str, threading.Event] = {}
        self._copy_error: BaseException | None = None
        self.wait_seconds = 0.0  # summed over the writer threads, since the last stage()

    @staticmethod
    def _plan(
        sd: dict[str, Any], copy_cpu: bool, keep: set[str]
    ) -> tuple[dict[torch.device, list[tuple[str, Tensor, int]]], dict[torch.device, int]]:
        layout: dict[torch.device, list[tuple[str, Tensor, int]]] = {}
        need: dict[torch.device, int] = {}
        for key, v in sd.items():
            if key in keep or not isinstance(v, Tensor):
                continue
            t = local_tensor(v)
            if t.numel() == 0 or (t.device.type == "cpu" and not copy_cpu):
                continue
            off = need.get(t.device, 0)
            layout.setdefault(t.device, []).append((key, t, off))
            need[t.device] = off + (_nbytes(t) + _ALIGN - 1) // _ALIGN * _ALIGN
        return layout, need

    def bytes_needed(self, sd: dict[str, Any], *, copy_cpu: bool, keep: set[str]) -> int:
        """Host bytes ``stage`` would hold for ``sd``."""
        return sum(self._plan(sd, copy_cpu, keep)[1].values())

    def release(self, source: str | None = None) -> None:
        """Drop the host buffers (of ``source`` devices only, e.g. ``"cpu"``; the next save
        allocates them again)."""
        self.finish()
        for dev in [d for d in self._buffers if source is None or d.type == source]:
            del self._buffers[dev]

    def _ranges(
        self, sd: dict[str, Any], copy_cpu: bool, keep: set[str]
    ) -> list[tuple[torch.device, str, Tensor, Tensor]]:
        """(source device, key, source local tensor, its range of the host buffer) for every
        tensor ``stage`` copies; the buffers are (re)allocated to fit, nothing is copied."""
        layout, need = self._plan(sd, copy_cpu, keep)
        out = []
        for dev, items in layout.items():
            buf = self._buffers.get(dev)
            if buf is None or buf.numel() < need[dev]:
                self._buffers.pop(dev, None)  # free (and unpin) the old one first
                buf = self._buffers[dev] = pinned_empty(
                    need[dev], pin=dev.type == "cuda", device=dev
                )
            flat = buf.numpy()
            for key, src, off in items:
                # Storage == exactly this range (a numpy slice), so DCP does not clone it.
                dst = torch.from_numpy(flat[off : off + _nbytes(src)])
                # (bytes -> dtype needs a dimension: a 0-dim tensor's range is viewed flat first)
                out.append((dev, key, src, dst.view(src.dtype).reshape(src.shape)))
        return out

    def reserve(self, sd: dict[str, Any], *, copy_cpu: bool = False) -> dict[str, Any]:
        """``key -> (source local tensor, its host range)`` for the tensors ``stage`` would
        copy, copying nothing: the caller copies each when it needs to."""
        return {key: (src, dst) for _, key, src, dst in self._ranges(sd, copy_cpu, set())}

    def stage(
        self,
        sd: dict[str, Any],
        *,
        copy_cpu: bool = False,
        keep: set[str] = frozenset(),
        defer: set[str] = frozenset(),
    ) -> dict[str, Any]:
        """Host copies of ``sd``'s tensors (not of the keys in ``keep``). The keys in
        ``defer`` are copied after every other (device copies are queued last; CPU tensors by
        a copier thread that starts when this returns); this returns once every other key's
        copy has landed. Their copies finish later: ``wait``/``finish`` wait for them, and
        ``before_step`` orders the next optimizer step after them."""
        ranges = self._ranges(sd, copy_cpu, keep)
        ranges.sort(key=lambda r: r[1] in defer)  # the copies waited for here, first
        self.wait_seconds = 0.0
        if not ranges:
            return sd
        out = dict(sd)
        streams = {dev: self._stream(dev) for dev in {r[0] for r in ranges}}
        later: list[tuple[str, Tensor, Tensor]] = []
        for dev, key, src, dst in ranges:
            stream = streams[dev]
            if stream is None and key in defer:
                later.append((key, src, dst))
                self._copied[key] = threading.Event()
            elif stream is None:
                dst.copy_(src)
            else:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                # Sync: a source that only the state dict held (a hook's temporary) must
                # not be handed to another tensor before the side stream has read it.
                src.record_stream(stream)
                self._events[key] = ev
            v = sd[key]
            out[key] = DTensor(dst, v._spec, requires_grad=False) if v is not src else dst
        waited = [k for _, k, _, _ in ranges if k not in defer and k in self._events]
        if waited:
            # Sync: copies run in order on each side stream; the last one not deferred landed.
            self._events[waited[-1]].synchronize()
        if later:
            self._copy_error = None
            self._copier = threading.Thread(
                target=self._copy_later, args=(later,), name="muon_ckpt-copier", daemon=True
            )
            start(self._copier)
        return out

    def _copy_later(self, later: list[tuple[str, Tensor, Tensor]]) -> None:
        """The copier thread: the deferred CPU copies, in order, each key's event set once its
        copy is done (or failed: ``wait`` raises it)."""
        try:
            for key, src, dst in later:
                copy_into(dst, src)  # one thread: the training step runs beside it
                self._copied[key].set()
        except BaseException as e:
            self._copy_error = e
            for ev in self._copied.values():
                ev.set()

    def before_step(self) -> None:
        """Order the next optimizer step after every deferred copy: on the GPU without waiting
        on the host (``fence``), on the CPU by joining the copier."""
        self.fence()
        copier = self._copier  # (the writer's finish() may clear it meanwhile)
        if copier is not None:
            join(copier)

    def _stream(self, dev: torch.device) -> Any:
        if dev.type != "cuda":
            return None  # other devices: a plain blocking copy
        s = self._streams.get(dev)
        if s is None:
            s = self._streams[dev] = torch.cuda.Stream(dev)
        # Sync: the copies must read what the compute stream has written so far.
        s.wait_stream(torch.cuda.current_stream(dev))
        return s

    def wait(self, key: str) -> None:
        copied = self._copied.get(key)
        if copied is not None:
            t0 = time.perf_counter()
            copied.wait()
            with self._lock:
                self.wait_seconds += time.perf_counter() - t0
            if self._copy_error is not None:
                raise self._copy_error
            return
        ev = self._events.get(key)
        if ev is not None:
            t0 = time.perf_counter()
            # Sync: the host buffer range of ``key`` is complete once its copy event fired.
            ev.synchronize()
            with self._lock:
                self.wait_seconds += time.perf_counter() - t0

    def fence(self) -> None:
        """Order whatever is queued next on each device's current and default streams after
        every copy queued so far, without waiting on the host (a load's reading threads copy
        on the default stream, the calling thread on its current one); ``finish`` still
        waits for them on the host."""
        for dev, side in self._streams.items():
            later = {torch.cuda.current_stream(dev), torch.cuda.default_stream(dev)}
            for stream in {s.cuda_stream: s for s in later}.values():
                stream.wait_stream(side)

    def finish(self) -> None:
        """Wait for every queued copy (before save() returns when it is asynchronous, after
        the writes when it is not, and on error before the buffers are reused or freed)."""
        for ev in self._events.values():
            ev.synchronize()
        self._events.clear()
        if self._copier is not None:
            join(self._copier)
            self._copier = None
        self._copied.clear()
