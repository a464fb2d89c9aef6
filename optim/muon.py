"""Muon: Newton-Schulz-orthogonalised momentum for matrices, AdamW for everything else.

A real ``torch.optim.Optimizer``: LR schedulers, ``zero_grad``, ``add_param_group``,
``state_dict``/``load_state_dict`` and grad clipping keep working. Parameters may be plain
tensors or DTensors on a mesh of any number of dims with the placements FSDP2 ``fully_shard``
and tensor parallelism make (``Shard(dim)``, uneven included, ``_StridedShard``,
``Replicate()``); each matrix is orthogonalised once in the whole mesh. See README.md for
every param-group key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

import optim._config as _config
from offload import CPUOffloadPool
from optim._adamw import adamw_step
from optim._exchange import agree_on_grads
from optim._muon_step import muon_step
from optim._ns_dtype import resolve_ns_dtype, resolve_ns_method
from optim._offloading import CPUOffloadMixin
from optim._plan import Item, Plan, build_plan
from optim._report import RULE_KEYS, NSWork, UpdateRule, ns_work, update_rule

__all__ = ["Muon"]

_SAVE_MSG = (
    "Muon.state_dict() was called while CPU offload is on: the optimizer states are parked in "
    "CPU buffers. Call turn_off_cpu_offload() before checkpoint save (or save with muon_ckpt's "
    "CheckpointManager, which reads the states where they are, with offload on)."
)
_LOAD_MSG = (
    "Muon.load_state_dict() was called while CPU offload is on. Call turn_off_cpu_offload() "
    "before checkpoint load, then turn_on_cpu_offload() again (or load with muon_ckpt's "
    "CheckpointManager, which writes the states where they are, with offload on)."
)


class Muon(CPUOffloadMixin, torch.optim.Optimizer):
    """Distributed Muon with AdamW for non-matrix params and optional CPU offload of states.

    Args:
        params: params or param groups (dicts with the keys documented in README.md).
        chunk_size: matrices per pipeline chunk (one gather and one scatter per chunk).
        warmup_step: chunks whose gathers are in flight while a chunk computes.
        adjust_lr_fn: ``"match_rms_adamw"`` (0.2 * sqrt(max(A, B))) or ``"original"``
            (sqrt(max(1, A / B))), as torch.optim.Muon defines them.
        **defaults: default values for the group keys (``lr``, ``weight_decay``, ...).
            ``ns_dtype`` (``"auto"``, ``"bf16"``, ``"fp32"``) is the dtype Newton-Schulz runs
            in; a group's ``"auto"`` becomes ``"bf16"`` or ``"fp32"`` when it is added (bf16
            on CUDA and on CPUs with AMX or AVX512-BF16), so that the group, its ``repr`` and
            a checkpoint of it name the dtype the run computes in, and a resumed run keeps it.
            ``ns_method`` (``"auto"``, ``"standard"``, ``"gram"``): ``"gram"`` runs the Gram
            iteration on matrices whose aspect ratio exceeds 2; ``"auto"`` becomes ``"gram"``
            on CUDA and in fp32, else ``"standard"``, recorded as ``ns_dtype`` is.
    """

    # The group keys of a param's update rule (``update_rule``; a checkpoint records it)
    update_rule_keys = RULE_KEYS

    def __init__(
        self,
        params: Iterable[Any],
        *,
        chunk_size: int = 8,
        warmup_step: int = 1,
        adjust_lr_fn: str = "match_rms_adamw",
        **defaults: Any,
    ) -> None:
        _config.check_constructor(chunk_size, warmup_step, adjust_lr_fn)
        unknown = set(defaults) - set(_config.GROUP_DEFAULTS)
        if unknown:
            raise ValueError(
                f"unknown Muon argument(s) {sorted(unknown)}; expected group keys "
                f"{sorted(_config.GROUP_DEFAULTS)} or chunk_size/warmup_step/adjust_lr_fn"
            )
        self.chunk_size = chunk_size
        self.warmup_step = warmup_step
        self.adjust_lr_fn = adjust_lr_fn
        self._plan: Plan | None = None
        self._plan_key: tuple | None = None
        self._cpu_offload = False
        self._cpu_offload_pool = CPUOffloadPool()
        self._pool_key: tuple | None = None
        self._ns_done: list[Item] = []  # what this rank orthogonalised in the last step
        # id(group) -> (group, the keys of the NS rule it left to "auto", resolved since)
        self._auto: dict[int, tuple[dict[str, Any], frozenset[str]]] = {}
        super().__init__(params, {**_config.GROUP_DEFAULTS, **defaults})
        _config.check_meshes(self.param_groups)

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        if isinstance(group.get("names"), tuple):
            group["names"] = list(group["names"])
        try:
            _config.check_keys(group, gi)
            _config.check_group(group, gi)
            if gi > 0:
                _config.check_meshes(self.param_groups)
        except ValueError:
            self.param_groups.pop()
            raise
        self._resolve(group)
        self._plan = None

    def _resolve(self, group: dict[str, Any]) -> None:
        """Resolve the group's ``"auto"`` keys, remembering which they were."""
        asked = frozenset(k for k in ("ns_dtype", "ns_method") if group.get(k) == "auto")
        if asked:
            self._auto[id(group)] = (group, self._auto_of(group) | asked)
        resolve_ns_dtype(group)
        resolve_ns_method(group)

    def _auto_of(self, group: dict[str, Any]) -> frozenset[str]:
        held = self._auto.get(id(group))
        return held[1] if held is not None and held[0] is group else frozenset()

    def _get_plan(self) -> Plan:
        for gi, g in enumerate(self.param_groups):  # (set since: a scheduler, a load)
            _config.check_ns_dtype(g["ns_dtype"], gi)
            _config.check_ns_method(g["ns_method"], gi)
            self._resolve(g)
        # Items hold their group dict: a new dict (load_state_dict replaces them all) or a new
        # ns_steps, ns_dtype or ns_method (they shape the batches) means a new plan.
        hp = ("use_muon", "ns_steps", "ns_dtype", "ns_method")
        key = tuple(
            (id(g), *(g[k] for k in hp), tuple(id(p) for p in g["params"]))
            for g in self.param_groups
        )
        if self._plan is None or key != self._plan_key:
            self._plan = build_plan(self.param_groups, self.chunk_size)
            self._plan_key = key
        return self._plan

    # ------------------------------------------------------------------ state
    def _init_param_state(self, p: Tensor, use_muon: bool) -> bool:
        st = self.state[p]
        if use_muon:
            if "momentum_buffer" in st:
                return False
            st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        else:
            if "moment1" in st:
                return False
            st["moment1"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            st["moment2"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
        return True

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the state of every param (zeros; ``step`` = 0) without taking a step.

        Used to load a checkpoint into a fresh optimizer. Existing state is left untouched.
        Call it on every rank (it may build the distributed plan, a collective). With CPU
        offload on, a fresh optimizer's states are created in the pinned CPU buffers and no
        device memory is used for them until the next step.
        """
        fresh = not any(self.state.get(p) for g in self.param_groups for p in g["params"])
        if self._cpu_offload and fresh:
            pool = self._cpu_offload_pool
            pool.clear()
            labels = self._labels()
            for p, key, bucket in self._offload_slots():
                what, read = self._label(labels[id(p)], key)
                self.state[p][key] = pool.new_offloaded(p, bucket, what=what, read=read)
            for g in self.param_groups:
                for p in g["params"]:
                    if not g["use_muon"]:
                        self.state[p]["step"] = torch.tensor(0.0, dtype=torch.float32)
            self._pool_key = self._pool_key_of(self._state_buckets())
            pool.offload()  # lays the pool out; every bucket starts offloaded
            return
        created = False
        for g in self.param_groups:
            for p in g["params"]:
                created |= self._init_param_state(p, g["use_muon"])
        if self._cpu_offload and created:
            self._sync_pool()
            self._cpu_offload_pool.offload()

    # ------------------------------------------------------------------ checkpoint guards
    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict (positional, as torch.optim defines it).

        Once CPU offload has been used, the pinned CPU buffers hold a copy of every state, so
        the tensors returned are served from there (refreshed by one device-to-host copy per
        flat group): saving a checkpoint then needs no extra GPU memory. Like torch's, the
        returned tensors are references, not copies: save or deepcopy them before the next
        step with offload on.
        """
        if self._cpu_offload:
            raise RuntimeError(_SAVE_MSG)
        sd = super().state_dict()
        pool = self._cpu_offload_pool
        if pool.cpu_nbytes() > 0:
            self._sync_pool()
            views = pool.cpu_views()
            # torch's state_dict shares the inner dicts with self.state: copy before editing.
            sd["state"] = {i: dict(st) for i, st in sd["state"].items()}
            for st in sd["state"].values():
                for k, v in st.items():
                    if id(v) in views:
                        st[k] = views[id(v)]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._cpu_offload:
            raise RuntimeError(_LOAD_MSG)
        state_dict = self._copy_into_existing_state(state_dict)
        before = {id(t) for st in self.state.values() for t in st.values()}
        super().load_state_dict(state_dict)
        self._auto.clear()  # (new groups, whose values a state dict set)
        after = {id(t) for st in self.state.values() for t in st.values()}
        if after != before:
            # New state tensors replaced tracked ones: the pool re-learns them at turn-on.
            self._cpu_offload_pool.clear()
            self._pool_key = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's hook for state dicts of older versions (load_state_dict calls it): keys
        # added since get what those versions ran.
        super().__setstate__(state)
        for g in self.param_groups:
            # From before ns_dtype existed: Newton-Schulz ran in bf16 then; from before
            # ns_method: the Gram iteration ran in fp32 (on wide matrices), never in bf16.
            g.setdefault("ns_dtype", "bf16")
            g.setdefault("ns_method", "gram" if g["ns_dtype"] == "fp32" else "standard")

    @torch.no_grad()
    def _copy_into_existing_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy loaded values into the state tensors that already exist (same shape, dtype and
        placement) and hand those very tensors to torch's loader, which then keeps them: no
        new device memory, and the offload pool's layout stays valid."""
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups):
            return state_dict  # torch's loader raises its own clear error
        id_map = {}
        for saved, group in zip(saved_groups, self.param_groups):
            if len(saved.get("params", ())) != len(group["params"]):
                return state_dict
            id_map.update(zip(saved["params"], group["params"]))
        new_state = {}
        for pid, st in state_dict.get("state", {}).items():
            cur = self.state.get(id_map.get(pid)) if pid in id_map else None
            if not cur:
                new_state[pid] = st
                continue
            st = dict(st)
            for k, v in st.items():
                old = cur.get(k)
                if _same_layout(old, v):
                    old_local, v_local = (
                        getattr(old, "_local_tensor", old),
                        getattr(v, "_local_tensor", v),
                    )
                    old_local.copy_(v_local)
                    st[k] = old
            new_state[pid] = st
        return {**state_dict, "state": new_state}

    # ------------------------------------------------------------------ reports
    def update_rule(self, param: Tensor) -> UpdateRule:
        """How ``param`` is updated: Muon with its Newton-Schulz iteration and dtype, or
        AdamW (``UpdateRule``; ``auto`` names what its group left to ``"auto"``); a
        checkpoint records it and compares it on load."""
        for g in self.param_groups:
            if g.get("use_muon") and "auto" in (g.get("ns_dtype"), g.get("ns_method")):
                self._resolve(g)
        return update_rule(self.param_groups, param, self._auto_of)

    def ns_work(self) -> NSWork:
        """The Newton-Schulz work this rank did in the last ``step()``: the matrices it
        orthogonalised, by name, and their FLOPs. Over a mesh, each matrix is in the
        ``ns_work()`` of exactly one rank."""
        return ns_work(self.param_groups, self._ns_done)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._get_plan()
        active = agree_on_grads(plan, self.param_groups)
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) in active:
                    self._init_param_state(p, g["use_muon"])
        if self._cpu_offload:
            self._sync_pool()  # cheap unless states were created or the plan changed
        pipe = self._offload_pipeline(plan) if self._cpu_offload else None
        try:
            self._ns_done = muon_step(
                plan,
                active,
                self.state,
                self.adjust_lr_fn,
                self.warmup_step,
                (lambda ci: pipe.enter(("muon", ci))) if pipe else None,
                (lambda ci: pipe.leave(("muon", ci))) if pipe else None,  # momentum is final
            )
            for gi, c, chunk in self._adamw_chunks():
                if pipe:
                    pipe.enter(("adamw", gi, c))
                ps = [p for p in chunk if id(p) in active]
                if ps:
                    adamw_step(ps, self.param_groups[gi], self.state)
                if pipe:
                    pipe.leave(("adamw", gi, c))
        finally:
            if pipe:
                pipe.close()

        for g in self.param_groups:
            if g["none_grad"]:
                for p in g["params"]:
                    p.grad = None
        return loss


def _same_layout(old: Any, new: Any) -> bool:
    if not isinstance(old, Tensor) or not isinstance(new, Tensor):
        return False
    if old.shape != new.shape or old.dtype != new.dtype or type(old) is not type(new):
        return False
    if hasattr(old, "placements"):
        return old.placements == new.placements and old.to_local().shape == new.to_local().shape
    return True
