"""Muon: Newton-Schulz-orthogonalised momentum for matrices, AdamW for everything else.

A real ``torch.optim.Optimizer``: LR schedulers, ``zero_grad``, ``add_param_group``,
``state_dict``/``load_state_dict`` and grad clipping keep working. Parameters may be plain
tensors or DTensors on a 1-D mesh (what FSDP2 ``fully_shard`` makes; Shard(dim) with uneven
shards, or Replicate). See README.md for every param-group key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

import optim._config as _config
from offload import CPUOffloadPool, FrozenViews
from optim._adamw import adamw_step
from optim._muon_step import muon_step
from optim._ns_dtype import resolve_ns_dtype
from optim._plan import Plan, build_plan

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


class Muon(torch.optim.Optimizer):
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
    """

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
        super().__init__(params, {**_config.GROUP_DEFAULTS, **defaults})
        _config.check_same_mesh(self.param_groups)

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
                _config.check_same_mesh(self.param_groups)
        except ValueError:
            self.param_groups.pop()
            raise
        resolve_ns_dtype(group)
        self._plan = None

    def _get_plan(self) -> Plan:
        for gi, g in enumerate(self.param_groups):  # (set since: a scheduler, a load)
            _config.check_ns_dtype(g["ns_dtype"], gi)
            resolve_ns_dtype(g)
        # Items hold their group dict: a new dict (load_state_dict replaces them all) or a new
        # ns_steps or ns_dtype (they shape the batches) means a new plan.
        key = tuple(
            (id(g), g["use_muon"], g["ns_steps"], g["ns_dtype"], tuple(id(p) for p in g["params"]))
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

    def _offload_slots(self) -> list[tuple[Tensor, str, Any]]:
        """(param, state key, pool bucket) of every state the pool parks: a Muon matrix's
        momentum in the bucket of its pipeline chunk, AdamW moments in one bucket per group."""
        out: list[tuple[Tensor, str, Any]] = [
            (it.param, "momentum_buffer", ("muon", it.chunk)) for it in self._get_plan().items
        ]
        for gi, g in enumerate(self.param_groups):
            if not g["use_muon"]:
                out += [(p, k, ("adamw", gi)) for p in g["params"] for k in ("moment1", "moment2")]
        return out

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

    @torch.no_grad()
    def turn_on_cpu_offload(self) -> None:
        """Park all states in (pinned) CPU memory now and after every step. Idempotent."""
        if self._cpu_offload:
            return
        self._sync_pool()
        self._cpu_offload_pool.offload()
        self._cpu_offload = True

    @torch.no_grad()
    def turn_off_cpu_offload(self) -> None:
        """Bring all states back to their devices and keep them there. Idempotent."""
        if not self._cpu_offload:
            return
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
        for g in self.param_groups:
            # A state dict from before ns_dtype existed: Newton-Schulz ran in bf16 then.
            g.setdefault("ns_dtype", "bf16")
        after = {id(t) for st in self.state.values() for t in st.values()}
        if after != before:
            # New state tensors replaced tracked ones: the pool re-learns them at turn-on.
            self._cpu_offload_pool.clear()
            self._pool_key = None

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

    # ------------------------------------------------------------------ step
    def _active(self, plan: Plan) -> set[int]:
        """ids of params with a grad; all ranks of the mesh must agree for those a step
        exchanges: Muon's split matrices, and AdamW's DTensors (a Partial grad is reduced
        across the ranks)."""
        active = {id(p) for g in self.param_groups for p in g["params"] if p.grad is not None}
        checked = [("a Muon param", it.param) for it in plan.items if it.exchanged]
        checked += [
            ("an AdamW param", p)
            for g in self.param_groups
            if not g["use_muon"]
            for p in g["params"]
            if isinstance(p, DTensor) and p.device_mesh.size() > 1
        ]
        if checked:
            mesh = checked[0][1].device_mesh  # (one mesh for all: _config.check_same_mesh)
            has = torch.tensor(
                [id(p) in active for _, p in checked],
                dtype=torch.int32,
                device=checked[0][1].to_local().device,
            )
            dist.all_reduce(has, group=mesh.get_group())
            for (what, p), n in zip(checked, has.tolist(), strict=True):
                if n not in (0, mesh.size()):
                    raise RuntimeError(
                        f"{what} of shape {tuple(p.shape)} has a grad on {n} of {mesh.size()} "
                        "ranks; every rank must have a grad for it, or none"
                    )
        return active

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._get_plan()
        active = self._active(plan)
        created = False
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) in active:
                    created |= self._init_param_state(p, g["use_muon"])
        offload = self._cpu_offload
        pool = self._cpu_offload_pool
        if offload:
            self._sync_pool()  # cheap unless states were created or the plan changed
            # Prefetch AdamW moments now: they copy in while the Muon chunks compute.
            for gi, g in enumerate(self.param_groups):
                if not g["use_muon"]:
                    pool.reload(("adamw", gi))

        def before_chunk(ci: int) -> None:
            pool.reload(("muon", ci))
            pool.reload(("muon", ci + 1))  # prefetch the next chunk's momentum
            pool.wait_reload(("muon", ci))

        def after_momentum(ci: int) -> None:
            pool.offload(("muon", ci))  # momentum is final for this step: park it

        muon_step(
            plan,
            active,
            self.state,
            self.adjust_lr_fn,
            self.warmup_step,
            before_chunk if offload else None,
            after_momentum if offload else None,
        )

        for gi, g in enumerate(self.param_groups):
            if g["use_muon"]:
                continue
            ps = [p for p in g["params"] if id(p) in active]
            if offload:
                pool.wait_reload(("adamw", gi))
            if ps:
                adamw_step(ps, g, self.state)
            if offload:
                pool.offload(("adamw", gi))

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
