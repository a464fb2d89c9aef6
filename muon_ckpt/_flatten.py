"""Model / optimizer / extra state <-> one flat DCP state dict keyed by parameter FQN.

Save and load build the same dict; its tensor values ARE the live tensors (parameters, buffers,
optimizer states), so ``dcp.load`` writes into them in place and DTensors reshard on the way.
Keys (see ``_layout``)::

    model.<fqn>                        every entry of model.state_dict()
    optim.state.<fqn>.<key>            every entry of optimizer.state[param]
    optim.param_groups.<fqn>.<hparam>  every hyperparameter of the param's group (not params/names)
    extra.<name>                       obj.state_dict(), nested; DCP flattens it to extra.<name>.<k>
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from muon_ckpt._errors import CheckpointMismatchError
from muon_ckpt.store import model_key, optim_group_key, optim_state_key

__all__ = ["FlatState", "check_extra", "param_fqns", "prepare_optimizer_state"]

_GROUP_SKIP = ("params", "names")


def check_extra(extra: Any) -> dict[str, Any]:
    """Validate ``extra`` (construction time): a dict of name -> Stateful object."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise ValueError(
            f"extra must be a dict of name -> object with state_dict()/load_state_dict(), got "
            f"{type(extra).__name__}"
        )
    for name, obj in extra.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"extra names must be non-empty strings without '/', got {name!r}")
        missing = [
            m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))
        ]
        if missing:
            raise ValueError(
                f"extra[{name!r}] must have state_dict() and load_state_dict() (torch's "
                f"Stateful protocol), got a {type(obj).__name__} without {' and '.join(missing)}; "
                "wrap it in an object that defines both"
            )
    return dict(extra)


def param_fqns(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The FQN of every optimizer param, group by group (model names first, else ``names``)."""
    by_id: dict[int, str] = {}
    if model is not None:
        for name, p in model.named_parameters():
            by_id.setdefault(id(p), name)
    out: list[list[str]] = []
    seen: dict[str, tuple[int, int]] = {}
    for gi, group in enumerate(optimizer.param_groups):
        names = group.get("names")
        fqns = []
        for pi, p in enumerate(group["params"]):
            fqn = by_id.get(id(p))
            if fqn is None and names is not None and pi < len(names):
                fqn = names[pi]
            if fqn is None:
                where = "is not a parameter of the model" if model is not None else "has no name"
                raise ValueError(
                    f"optimizer param group {gi}, param {pi} (shape {tuple(p.shape)}) {where}; "
                    "checkpoint keys are parameter FQNs: pass the model that owns it, or give "
                    "the group a 'names' list (one FQN per param)"
                )
            if fqn in seen:
                raise ValueError(
                    f"parameter name {fqn!r} is used twice (groups/params {seen[fqn]} and "
                    f"{(gi, pi)}); FQNs must be unique"
                )
            seen[fqn] = (gi, pi)
            fqns.append(fqn)
        out.append(fqns)
    return out


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
    # key -> (param, state key) for optimizer state; key -> (group index, hparam) for groups
    state_slots: dict[str, tuple[Tensor, str]] = field(default_factory=dict)
    group_slots: dict[str, tuple[int, str]] = field(default_factory=dict)
    extra_names: list[str] = field(default_factory=list)
    stateless: list[Tensor] = field(default_factory=list)  # params without state when saved

    @classmethod
    def build(
        cls,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        extra: dict[str, Any],
    ) -> FlatState:
        fs = cls()
        if model is not None:
            for k, v in model.state_dict().items():
                fs.sd[model_key(k)] = v
        if optimizer is not None:
            fqns = param_fqns(model, optimizer)
            for gi, (group, names) in enumerate(zip(optimizer.param_groups, fqns, strict=True)):
                for p, fqn in zip(group["params"], names, strict=True):
                    for sk, v in optimizer.state.get(p, {}).items():
                        key = optim_state_key(fqn, sk)
                        fs.sd[key] = v
                        fs.state_slots[key] = (p, sk)
                    for hk, hv in group.items():
                        if hk in _GROUP_SKIP:
                            continue
                        key = optim_group_key(fqn, hk)
                        fs.sd[key] = hv
                        fs.group_slots[key] = (gi, hk)
        for name, obj in extra.items():
            fs.sd[f"extra.{name}"] = obj.state_dict()
            fs.extra_names.append(name)
        return fs

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
                self.sd[key] = _host_copy(v)

    # ------------------------------------------------------------------ load side
    def check_against(self, metadata: Any, fresh: set[int], url: str) -> None:
        """Fit the dict to the checkpoint: raise CheckpointMismatchError for a missing key or a
        wrong shape/dtype; drop optimizer state of params that had none when saved (only
        state created by this load) and hyperparameters the checkpoint does not have."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        have = metadata.state_dict_metadata
        for name in self.extra_names:
            flat, _ = flatten_state_dict({f"extra.{name}": self.sd[f"extra.{name}"]})
            missing = sorted(k for k in flat if k not in have)
            if missing:
                raise CheckpointMismatchError(
                    f"{url}: extra[{name!r}] has key(s) {missing[:8]} that the checkpoint does "
                    f"not: its state_dict() differs from the one saved; the checkpoint has "
                    f"{sorted(k for k in have if k.startswith(f'extra.{name}.'))[:8]}"
                )
        saved_state_fqns = {k.rsplit(".", 1)[0] for k in have if k.startswith("optim.state.")}
        for key in list(self.sd):
            if key.startswith("extra."):
                continue
            if key in self.group_slots and key not in have:
                del self.sd[key]  # a hyperparameter the saving optimizer did not have
                del self.group_slots[key]
                continue
            if key in self.state_slots and key not in have:
                p, _ = self.state_slots[key]
                fqn = key.rsplit(".", 1)[0]
                if id(p) in fresh and fqn not in saved_state_fqns:
                    del self.sd[key]  # no state when saved: removed again after the load
                    del self.state_slots[key]
                    self.stateless.append(p)
                    continue
            if key not in have:
                raise CheckpointMismatchError(_missing_msg(key, have, set(self.sd), url))
            value, md = self.sd[key], have[key]
            is_tensor = isinstance(value, Tensor)
            if is_tensor != isinstance(md, TensorStorageMetadata):
                kind = "a tensor" if isinstance(md, TensorStorageMetadata) else "a Python object"
                raise CheckpointMismatchError(
                    f"{url}: key {key!r} is {kind} in the checkpoint but "
                    f"{'a tensor' if is_tensor else type(value).__name__} here"
                )
            if is_tensor:
                if tuple(value.shape) != tuple(md.size):
                    raise CheckpointMismatchError(
                        f"{url}: key {key!r} has shape {tuple(md.size)} in the checkpoint but "
                        f"{tuple(value.shape)} in this model/optimizer; build the model with "
                        "the shapes it was saved with"
                    )
                if value.dtype != md.properties.dtype:
                    raise CheckpointMismatchError(
                        f"{url}: key {key!r} has dtype {md.properties.dtype} in the checkpoint "
                        f"but {value.dtype} here; cast the model/optimizer to match first"
                    )
        ours = set(self.sd)
        sections = [s for s in ("model.", "optim.state.") if any(k.startswith(s) for k in ours)]
        extra_ckpt = sorted(k for k in have if k.startswith(tuple(sections)) and k not in ours)
        if sections and extra_ckpt:
            raise CheckpointMismatchError(
                f"{url}: the checkpoint has {len(extra_ckpt)} key(s) this model/optimizer does "
                f"not: {extra_ckpt[:8]}; was a parameter renamed or removed?"
            )

    def apply_loaded(
        self, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any], url: str
    ) -> None:
        """Write back what DCP could not load in place (Python values, hyperparameters, extra)."""
        if optimizer is not None:
            for p in self.stateless:
                optimizer.state.pop(p, None)
            for key, (p, sk) in self.state_slots.items():
                v = self.sd[key]
                if not isinstance(v, Tensor):
                    optimizer.state[p][sk] = v
            per_group: dict[tuple[int, str], tuple[str, Any]] = {}
            for key, (gi, hk) in self.group_slots.items():
                v = self.sd[key]
                prev = per_group.setdefault((gi, hk), (key, v))
                if prev[1] is not v and not _same(prev[1], v):
                    raise CheckpointMismatchError(
                        f"{url}: {prev[0]!r} = {prev[1]!r} but {key!r} = {v!r}: these params "
                        "share a param group here but had different hyperparameters when saved"
                    )
            for (gi, hk), (_, v) in per_group.items():
                optimizer.param_groups[gi][hk] = v
        for name in self.extra_names:
            extra[name].load_state_dict(self.sd[f"extra.{name}"])


def _host_copy(v: Any) -> Any:
    if isinstance(v, Tensor):
        return v.detach().to("cpu", copy=True)
    if isinstance(v, dict):
        return {k: _host_copy(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)) and type(v) in (list, tuple):
        return type(v)(_host_copy(x) for x in v)
    return copy.deepcopy(v)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:
        return False


def _missing_msg(key: str, have: dict[str, Any], ours: set[str], url: str) -> str:
    prefix = key.split(".", 1)[0] + "."
    unknown = sorted(k for k in have if k.startswith(prefix) and k not in ours)
    hint = f" The checkpoint has keys this model does not: {unknown[:8]}." if unknown else ""
    return (
        f"{url}: key {key!r} is not in the checkpoint.{hint} Was a parameter renamed? Keys are "
        "parameter FQNs; load with the model the checkpoint was saved from, or rename the "
        "checkpoint keys (muon-ckpt import)"
    )
