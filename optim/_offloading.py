"""Muon's CPU offload: which states the pool parks, in which buckets, and the toggle, views and
snapshots of them between steps (``optim.Muon`` mixes this in).

Each Muon pipeline chunk's momentum is one pool bucket, and so is each chunk of ``chunk_size``
params of an AdamW group (its two moments). A step moves them through the device in that
order with ``CPUOffloadPool.pipeline`` (``offload/_pipeline.py``): chunk k+1's states come in
while chunk k computes and chunk k-1's go out, so at most three chunks' states are on the
device at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from offload import CPUOffloadPool, FrozenViews, OffloadPipeline
from optim._adamw import adamw_chunks
from optim._plan import Plan

__all__ = ["CPUOffloadMixin"]


class CPUOffloadMixin:
    """Offload of an optimizer's states between steps. The optimizer sets ``_cpu_offload``
    (False), ``_cpu_offload_pool`` (a ``CPUOffloadPool``) and ``_pool_key`` (None) and has
    ``param_groups``, ``state``, ``chunk_size``, ``_plan_key`` and ``_get_plan()``."""

    param_groups: list[dict[str, Any]]
    state: Any
    chunk_size: int
    _cpu_offload: bool
    _cpu_offload_pool: CPUOffloadPool
    _pool_key: tuple | None
    _plan_key: tuple | None
    _get_plan: Callable[[], Plan]
    # (ahead, behind) of a step's pipeline: chunk k+1 comes in and k-1 goes out while k
    # computes. A class attribute, so a benchmark can weigh (1, 0) against it.
    _offload_window = (1, 1)

    def _offload_slots(self) -> list[tuple[Tensor, str, Any]]:
        """(param, state key, pool bucket) of every state the pool parks: a Muon matrix's
        momentum in the bucket of its pipeline chunk, AdamW moments in the bucket of their
        chunk of their group (``adamw_chunks``)."""
        out: list[tuple[Tensor, str, Any]] = [
            (it.param, "momentum_buffer", ("muon", it.chunk)) for it in self._get_plan().items
        ]
        for gi, c, chunk in self._adamw_chunks():
            out += [(p, k, ("adamw", gi, c)) for p in chunk for k in ("moment1", "moment2")]
        return out

    def _adamw_chunks(self) -> list[tuple[int, int, list[Tensor]]]:
        """(group index, chunk index, params) of every AdamW chunk, in step order."""
        return [
            (gi, c, chunk)
            for gi, g in enumerate(self.param_groups)
            if not g["use_muon"]
            for c, chunk in enumerate(adamw_chunks(g["params"], self.chunk_size))
        ]

    def _offload_pipeline(self, plan: Plan) -> OffloadPipeline:
        """This step's pass of the states through the device: the Muon chunks, then the AdamW
        chunks (the first of them comes in while the last Muon chunk computes)."""
        order = [("muon", ci) for ci in range(len(plan.chunks))]
        order += [("adamw", gi, c) for gi, c, _ in self._adamw_chunks()]
        ahead, behind = self._offload_window
        return self._cpu_offload_pool.pipeline(order, ahead=ahead, behind=behind)

    def _state_buckets(self) -> dict[int, tuple[Tensor, Any, Tensor, str]]:
        """Map id(state tensor) -> (tensor, pool bucket, param, state key) for every
        offloadable state."""
        out: dict[int, tuple[Tensor, Any, Tensor, str]] = {}
        for p, key, bucket in self._offload_slots():
            t = self.state.get(p, {}).get(key)
            if t is not None:
                out[id(t)] = (t, bucket, p, key)
        return out

    def _pool_key_of(self, want: dict[int, Any]) -> tuple:
        return (self._plan_key, tuple(sorted(want)))

    def _sync_pool(self) -> None:
        """Make the pool track exactly the current states, bucketed by the current plan."""
        want = self._state_buckets()
        key = self._pool_key_of(want)
        if key == self._pool_key:
            return
        pool = self._cpu_offload_pool
        pool.clear()
        labels = self._labels()
        for t, bucket, p, name in want.values():
            what, read = self._label(labels[id(p)], name)
            pool.track(t, bucket, what=what, read=read)
        self._pool_key = key

    def _labels(self) -> dict[int, str]:
        """id(param) -> how errors name it: its FQN (the group's ``names``) or its place."""
        out = {}
        for gi, g in enumerate(self.param_groups):
            names = g.get("names")
            for i, p in enumerate(g["params"]):
                where = f"#{i} of param group {gi} (shape {tuple(p.shape)})"
                out[id(p)] = repr(names[i]) if names else where
        return out

    @staticmethod
    def _label(param: str, key: str) -> tuple[str, str]:
        """What an offloaded state is called in errors, and where its value is read."""
        return f"Muon state {key!r} of param {param}", f"optimizer.cpu_state(param)[{key!r}]"

    # ------------------------------------------------------------------ offload toggle
    @property
    def cpu_offload(self) -> bool:
        """True while optimizer states are parked in CPU memory between steps."""
        return self._cpu_offload

    def register_relayout_pre_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Call ``hook()`` before a toggle moves the states (a checkpoint's deferred copies,
        which may still read them, are waited for there, as before a step); its handle."""
        hooks = self.__dict__.setdefault("_relayout_hooks", OrderedDict())
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def _before_relayout(self) -> None:
        for hook in list(self.__dict__.get("_relayout_hooks", {}).values()):
            hook()

    @torch.no_grad()
    def turn_on_cpu_offload(self) -> None:
        """Park all states in (pinned) CPU memory now and after every step. Idempotent."""
        if self._cpu_offload:
            return
        self._before_relayout()
        self._sync_pool()
        self._cpu_offload_pool.offload()
        self._cpu_offload = True

    @torch.no_grad()
    def turn_off_cpu_offload(self) -> None:
        """Bring all states back to their devices and keep them there. Idempotent."""
        if not self._cpu_offload:
            return
        self._before_relayout()
        self._cpu_offload_pool.reload()
        self._cpu_offload_pool.synchronize()
        self._cpu_offload = False

    # ------------------------------------------------------------------ offloaded snapshots
    def cpu_state_views(self) -> dict[int, Tensor]:
        """With CPU offload on: ``id(state tensor) ->`` the CPU tensor (a view of the pinned
        buffer; a DTensor for a DTensor state) that holds its value between steps.

        Writing into a view sets that state: the next step reloads it from there. Reading
        one gives the state as of the last step. Valid until the next ``step()`` or toggle;
        call it between steps. This is how a checkpoint is loaded into (or, while training
        waits, saved from) an offloading optimizer without bringing its states to the GPU.
        """
        self._check_offload_on("cpu_state_views")
        return self._cpu_offload_pool.host_views()

    def cpu_state(self, param: Tensor) -> dict[str, Tensor]:
        """The state of ``param`` to read or write between steps, offload on or off: with
        offload on, each offloaded state as the CPU tensor that holds its value (a view of the
        pinned buffer: writing it sets the value the next step uses; valid until the next
        ``step()`` or toggle), other entries (AdamW's ``step``) as they are; with offload off,
        ``optimizer.state[param]`` itself."""
        state = self.state.get(param, {})
        if not self._cpu_offload:
            return dict(state)
        views = self.cpu_state_views()
        return {k: views.get(id(v), v) for k, v in state.items()}

    def freeze_cpu_state(self) -> FrozenViews:
        """With CPU offload on: the values of every offloaded state now, as CPU views that keep
        these values until ``.release()``, while training goes on (steps write the states to a
        second pinned buffer, allocated by the first call and reused). Nothing is copied.
        Call it between steps, and ``release()`` from the same thread once done reading."""
        self._check_offload_on("freeze_cpu_state")
        return self._cpu_offload_pool.freeze()

    def _check_offload_on(self, what: str) -> None:
        if not self._cpu_offload:
            raise RuntimeError(
                f"Muon.{what}() needs CPU offload on (turn_on_cpu_offload()); with offload off "
                "the states are ordinary device tensors in optimizer.state"
            )
        self._sync_pool()  # states created or replaced since the last step are tracked ...
        self._cpu_offload_pool.offload()  # ... and parked (a no-op for parked buckets)
