"""Model / optimizer / extra state <-> one flat DCP state dict keyed by parameter FQN.

Save and load build the same dict; its tensor values ARE the live tensors (parameters, buffers,
optimizer states), so ``dcp.load`` writes into them in place and DTensors reshard on the way.
Keys (see ``store._layout``; FQNs without wrapper prefixes, see ``state._names``)::

    model.<fqn>                        every entry of model.state_dict()
    optim.state.<fqn>.<key>            every entry of optimizer.state[param]
    optim.param_groups.<lead>.<hparam>  every hyperparameter of a group (not params/names), once:
                                       <lead> is the FQN of the group's first param
    optim.param_groups.<lead>.params   the FQNs of the group's params (a list)
    extra.<name>                       obj.state_dict(), nested; DCP flattens it to extra.<name>.<k>
    rank_extra.<rank>.<name>           the same, for each rank's own objects
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from muon_ckpt._tensors import host_copy
from muon_ckpt.state._extra import _ExtraState, extra_state_owner
from muon_ckpt.state._names import canonical_names, param_fqns
from muon_ckpt.state._structure import check_keys, rebuild
from muon_ckpt.state._values import check_loadable, loadable
from muon_ckpt.store.keys import (
    extra_key,
    model_key,
    optim_group_key,
    optim_state_key,
    rank_extra_key,
)

__all__ = ["GROUPS", "GROUP_SKIP", "PARTS", "FlatState", "check_parts", "prepare_optimizer_state"]

PARTS = ("model", "optim", "extra", "rank_extra")


def check_parts(parts: Any) -> tuple[str, ...]:
    """A load's ``parts`` (None: all of ``PARTS``); ValueError for anything else."""
    if parts is None:
        return PARTS
    if isinstance(parts, str) or not parts or not all(p in PARTS for p in parts):
        raise ValueError(f"parts must be a non-empty subset of {PARTS}, got {parts!r}")
    return tuple(parts)


GROUP_SKIP = ("params", "names")  # group entries that are not hyperparameters
GROUPS = "optim.param_groups."


def prepare_optimizer_state(optimizer: torch.optim.Optimizer) -> set[int]:
    """Create missing state (no step, parameters untouched) so a load can fill it in place.

    Returns the ids of params whose state was created here.
    """
    before = {id(p) for p, st in optimizer.state.items() if st}
    init = getattr(optimizer, "init_state", None)
    if callable(init):
        init()
    elif not before:
        # Any other torch optimizer: one step with zero grads and lr=0 (torch's own helper for
        # the same purpose); parameters do not change, the state tensors are created.
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(optimizer)
    return {id(p) for p, st in optimizer.state.items() if st} - before


@dataclass
class FlatState:
    """The flat dict handed to DCP, plus where each optimizer entry goes back."""

    sd: dict[str, Any] = field(default_factory=dict)
    # key -> (param, state key) for optimizer state
    state_slots: dict[str, tuple[Tensor, str]] = field(default_factory=dict)
    group_fqns: list[list[str]] = field(default_factory=list)  # each group's param FQNs
    # key -> extra, rank_extra or a module's extra state (a Stateful)
    stateful: dict[str, Any] = field(default_factory=dict)
    group_of: dict[str, int] = field(default_factory=dict)  # param FQN -> its group's index
    unsure_groups: set[int] = field(default_factory=set)  # relaxed: groups with a changed param
    stateless: list[Tensor] = field(default_factory=list)  # params without state when saved
    param_keys: set[str] = field(default_factory=set)  # model.<fqn> keys of parameters
    # load: a stateful's value is read leaf by leaf (flat key -> the stateful's key) and
    # rebuilt on the skeleton the step stores (stateful key -> skeleton, ``_structure``)
    leaf_of: dict[str, str] = field(default_factory=dict)
    skeletons: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        extra: dict[str, Any],
        *,
        rank_extra: dict[str, Any] | None = None,
        rank: int = 0,
        parts: tuple[str, ...] = PARTS,
    ) -> FlatState:
        fs = cls()
        if model is not None and "model" in parts:
            msd = model.state_dict()
            clean = canonical_names(model, list(msd))
            params = {n for n, _ in model.named_parameters()}
            for k, v in msd.items():
                fs.sd[model_key(clean[k])] = v if isinstance(v, Tensor) else loadable(v)
                if k in params:
                    fs.param_keys.add(model_key(clean[k]))
                owner = extra_state_owner(model, k)
                if owner is not None:  # loaded through set_extra_state, as extra is
                    fs.stateful[model_key(clean[k])] = _ExtraState(owner)
        if optimizer is not None and "optim" in parts:
            fqns = param_fqns(model, optimizer)
            for gi, (group, names) in enumerate(zip(optimizer.param_groups, fqns, strict=True)):
                fs.group_fqns.append(names)
                for p, fqn in zip(group["params"], names, strict=True):
                    fs.group_of[fqn] = gi
                    for sk, v in optimizer.state.get(p, {}).items():
                        key = optim_state_key(fqn, sk)
                        fs.sd[key] = v if isinstance(v, Tensor) else loadable(v)
                        fs.state_slots[key] = (p, sk)
                if not names:
                    continue
                # Once per group, under its first param's name, with the names of all of them:
                # a load maps each of its groups to the saved group that held its params.
                fs.sd[optim_group_key(names[0], "params")] = list(names)
                for hk, hv in group.items():
                    if hk not in GROUP_SKIP:
                        fs.sd[optim_group_key(names[0], hk)] = loadable(hv)
        objs = []
        if "extra" in parts:
            objs += [(extra_key(n), o) for n, o in extra.items()]
        if "rank_extra" in parts:
            objs += [(rank_extra_key(rank, n), o) for n, o in (rank_extra or {}).items()]
        for key, obj in objs:
            fs.sd[key] = loadable(obj.state_dict())
            fs.stateful[key] = obj
        return fs

    def check_loadable(self, step: int) -> None:
        """A save's check that a load can read back every Python value, and every stateful's
        value as it was (a CheckpointError naming the first that it could not)."""
        check_loadable({k: v for k, v in self.sd.items() if not isinstance(v, Tensor)}, step)
        for key in self.stateful:
            check_keys(key, self.sd[key], step)

    def loaded_value(self, key: str) -> Any:
        """After a load: stateful ``key``'s value as the step stores it."""
        if key not in self.skeletons:
            return self.sd[key]
        return rebuild(self.skeletons[key], self.sd, (key,))

    def deferrable_keys(self) -> set[str]:
        """The keys that only an optimizer step changes: parameters and optimizer states (not
        buffers, which a forward may write in place, nor Python values)."""
        tensors = {
            k for k in self.param_keys | set(self.state_slots) if isinstance(self.sd.get(k), Tensor)
        }
        return tensors

    def host_state_keys(self, views: dict[int, Tensor]) -> set[str]:
        """The keys whose state has a host view in ``views`` (``id(state tensor) -> view``)."""
        return {k for k in self.state_slots if id(self.sd[k]) in views}

    def use_host_states(self, views: dict[int, Tensor]) -> set[str]:
        """Put the host view of each offloaded state (from the optimizer) where the state
        itself was; returns the keys replaced."""
        keys = self.host_state_keys(views)
        for k in keys:
            self.sd[k] = views[id(self.sd[k])]
        return keys

    def detach_objects(self) -> None:
        """Deep copies of every non-tensor value (hyperparameters, ``extra`` state dicts; their
        tensors as CPU copies), so that a background write sees the values of this moment."""
        for key, v in self.sd.items():
            if not isinstance(v, Tensor):
                self.sd[key] = host_copy(v)

    # ------------------------------------------------------------------ load side
    def drop(self, key: str) -> None:
        """Leave ``key`` out of the load."""
        del self.sd[key]
        self.state_slots.pop(key, None)

    def rename(self, key: str, saved: str) -> None:
        """Load ``key`` from the checkpoint's ``saved`` (a name from before canonical FQNs)."""
        self.sd[saved] = self.sd.pop(key)
        if key in self.state_slots:
            self.state_slots[saved] = self.state_slots.pop(key)
        if key in self.stateful:
            self.stateful[saved] = self.stateful.pop(key)
