"""All-or-nothing loads: what a load may change, captured before it changes it.

A load writes into the live tensors (DCP reads in place, so DTensors reshard on the way), and
a failure can come after some of them are written: a checksum that fails in the last file, a
rank whose read failed while the others succeeded, a hyperparameter that does not fit.
``Rollback`` keeps what is needed to undo that:

- the optimizer's structure (which params have state, the state dicts' entries, every param
  group's hyperparameters), and each ``extra`` object's state dict (copies on their
  devices; tensor hyperparameters are restored in place): cheap;
- the values of every live tensor the load will write into (model parameters and buffers,
  optimizer states that existed before the load, offloaded states through their host views):
  one host copy of this rank's share of the state, in the manager's reusable host staging
  buffers (page-locked where CUDA is), so device tensors copy at PCIe speed and no device
  memory is used. Device tensors' copies are queued before the load starts, and the load's
  writes into them are queued after them on the GPU (the host does not wait: it reads
  meanwhile). Host tensors (CPU training, offloaded states) are copied while the load
  reads: a thread of the rollback's own copies them one after another from the start, and
  ``keep(key)``, called when the load is about to write into a tensor first (the load
  planner calls it, ``SafeLoadPlanner``), copies it there and then if that thread has not
  reached it yet (the copy is taken once, by whichever comes first; the other waits for it).
  A load that waits on storage (a remote read) thus finds its tensors copied already, and
  one that reads at memory speed shares the copies out over its reading threads. States
  created by the load itself are not copied: undoing the load removes them again.

Where the copies go: memory that is already faulted in wherever there is some, because a
fresh page costs more than the copy into it (a page fault per 4 KiB, ~0.2-0.5 s/GiB, against
~0.05 s/GiB for the copy: ``benchmarks/bench_host_memory.py``). The manager's staging buffers
are the ones its saves copy into (device tensors' buffer, kept; host tensors' buffer, which
an asynchronous save fills and keeps) and the loads after a first one reuse them; offloaded
states (``pooled``) are copied into buffers of the rollback's own, given up with it, since a
save copies none of them (it freezes the pool's buffer instead).

``restore()`` puts everything back; ``done()`` gives the host copies up. With
``max_staging_bytes`` below what the copy needs, no values are kept (the manager warns): a
failed load then restores the structure and ``extra`` only.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch
from torch import Tensor

from muon_ckpt._tensors import copy_into, local_tensor, overlapping
from muon_ckpt._threads import join, start
from muon_ckpt.state._staging import HostStaging

__all__ = ["Rollback"]


class Rollback:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer | None,
        extra: dict[str, Any],
        staging: HostStaging,
    ) -> None:
        self._optimizer = optimizer
        self._extra = extra
        self._staging = staging
        self._state: dict[Any, dict[str, Any]] = {}
        # Each group's hyperparameters: (the object, a copy of its value). A tensor (an lr
        # tensor a scheduler or a captured graph holds) is restored in place, keeping its
        # identity; anything else is put back from the copy.
        self._groups: list[dict[str, tuple[Any, Any]]] = []
        if optimizer is not None:
            self._state = {p: dict(st) for p, st in optimizer.state.items()}
            self._groups = [
                {k: (v, _copy(v)) for k, v in g.items() if k != "params"}
                for g in optimizer.param_groups
            ]
        self._extra_sd = {name: _copy(obj.state_dict()) for name, obj in extra.items()}
        self._own = HostStaging()  # the copies of offloaded states (``pooled``)
        self._pairs: list[tuple[Tensor, Tensor]] = []  # (live tensor, its copy)
        # Host tensors not copied yet: key -> (live tensor, its range), and a lock per key
        self._pending: dict[str, tuple[Tensor, Tensor]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._pairs_lock = threading.Lock()
        self._extra_touched = False
        self._copier: threading.Thread | None = None
        self._stop = threading.Event()

    def keep_values(
        self,
        sd: dict[str, Any],
        skip: set[str],
        limit: int | None,
        pooled: set[str] = frozenset(),
    ) -> bool:
        """Make ready to keep the values of ``sd``'s tensors (live tensors, or host views of
        offloaded states: the keys in ``pooled``), except the keys in ``skip`` (states this
        load created): device tensors are copied now, host tensors by the copier thread
        started here or by ``keep`` before their first write, whichever comes first. Returns
        False, keeping nothing, when that needs more than ``limit`` bytes."""
        live = {k: v for k, v in sd.items() if isinstance(v, Tensor) and k not in skip}
        self._extra_touched = True  # DCP writes into the tensors of extra's state dicts too
        if (
            limit is not None
            and self._staging.bytes_needed(live, copy_cpu=True, keep=set()) > limit
        ):
            return False
        host = {k for k, v in live.items() if local_tensor(v).device.type == "cpu"}
        device = {k: v for k, v in live.items() if k not in host}
        staged = self._staging.stage(device, copy_cpu=True)
        # Sync, on the GPU: the load's copies into these tensors come after their backup's;
        # the host goes on to read while the backup runs (restore() and the staging buffers'
        # release wait for it on the host).
        self._staging.fence()
        self._pairs = [(local_tensor(live[k]), local_tensor(staged[k])) for k in device]
        own = {k: live[k] for k in host if k in pooled}
        self._pending = {
            **self._staging.reserve({k: live[k] for k in host if k not in own}, copy_cpu=True),
            **self._own.reserve(own, copy_cpu=True),
        }
        self._locks = {k: threading.Lock() for k in self._pending}
        # Host tensors that share memory with another (tied weights, a buffer under two
        # names): the load writes them under either key, so they are copied now.
        for k in overlapping({k: src for k, (src, _) in self._pending.items()}):
            self.keep(k)
        if self._pending:
            order = list(self._pending)
            self._copier = threading.Thread(
                target=self._keep_all, args=(order,), name="muon_ckpt_keep", daemon=True
            )
            start(self._copier)
        return True

    def _keep_all(self, keys: list[str]) -> None:
        """The copier thread: ``keep`` every host tensor, until stopped. A copy that fails
        here is left to ``keep`` on the reading thread (which then raises it)."""
        try:
            for k in keys:
                if self._stop.is_set():
                    return
                self.keep(k)
        except Exception:  # (kept pending: the reading thread copies it, or fails the load)
            return

    def _stop_copier(self) -> None:
        if self._copier is not None:
            self._stop.set()
            join(self._copier)
            self._copier = None

    def keep(self, key: str) -> None:
        """Copy host tensor ``key`` before the load first writes into it (any thread; a
        thread that comes second waits for the copy); nothing for any other key (called
        before every write of a load: that case costs one lookup)."""
        lock = self._locks.get(key)
        if lock is None:
            return
        with lock, torch.no_grad():
            pending = self._pending.get(key)
            if pending is None:
                return
            live, copy_ = pending
            copy_into(copy_, live)  # on this thread: one memmove for host tensors
            with self._pairs_lock:
                self._pairs.append((live, copy_))
            del self._pending[key]  # only once copied: a failed copy is tried again

    @torch.no_grad()
    def restore(self) -> None:
        """Undo the load: values, optimizer structure and hyperparameters, extra state."""
        self._stop_copier()
        self._staging.finish()  # the backup of device tensors has landed
        for dst, src in self._pairs:
            dst.copy_(src)
        opt = self._optimizer
        if opt is not None:
            for p in list(opt.state):
                if p not in self._state:
                    del opt.state[p]  # created by this load
            for p, entries in self._state.items():
                st = opt.state[p]
                st.clear()
                st.update(entries)
            for g, saved in zip(opt.param_groups, self._groups, strict=True):
                for k in [k for k in g if k != "params" and k not in saved]:
                    del g[k]
                for k, (obj, value) in saved.items():
                    if isinstance(obj, Tensor):
                        obj.copy_(value)
                    g[k] = obj if isinstance(obj, Tensor) else value
        if self._extra_touched:
            for name, obj in self._extra.items():
                obj.load_state_dict(_copy(self._extra_sd[name]))
        self.done()

    def done(self) -> None:
        """Give the copies up (the manager's staging buffers stay with the manager)."""
        self._stop_copier()
        self._pairs, self._pending, self._locks = [], {}, {}
        self._own.release()


def _copy(v: Any) -> Any:
    """A deep copy whose tensors stay on their devices (hyperparameters, extra state: small)."""
    if isinstance(v, Tensor):
        return v.detach().clone()
    return copy.deepcopy(v)
