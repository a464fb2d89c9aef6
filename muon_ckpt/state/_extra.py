"""What a load changes besides tensors: ``extra``/``rank_extra`` objects (Statefuls) and a
module's extra state (``get_extra_state``/``set_extra_state``); their validation at
construction and the digests that compare ``extra`` across ranks at each save."""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import torch
from torch import Tensor

from muon_ckpt.state._names import param_fqns

__all__ = [
    "_ExtraState",
    "check_objects",
    "check_stateful",
    "extra_digests",
    "extra_state_owner",
    "module_extra_states",
]

_EXTRA_STATE = "_extra_state"  # torch's key for a module's get_extra_state()
_WRAPPED = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod", "module")


def extra_state_owner(model: torch.nn.Module, key: str) -> torch.nn.Module | None:
    """The module whose ``get_extra_state()`` is ``model.state_dict()``'s entry ``key``, or
    None when ``key`` is not such an entry."""
    if key != _EXTRA_STATE and not key.endswith("." + _EXTRA_STATE):
        return None
    owner: Any = model.get_submodule(key[: -len(_EXTRA_STATE)].rstrip("."))
    while type(owner).get_extra_state is torch.nn.Module.get_extra_state:
        # A wrapper whose state_dict() names its wrapped module's entries as its own
        # (activation checkpointing, FSDP1, torch.compile), or a parameter or buffer of
        # that name (None).
        inner = next((getattr(owner, a) for a in _WRAPPED if hasattr(owner, a)), None)
        if not isinstance(inner, torch.nn.Module):
            return None
        owner = inner
    return owner


class _ExtraState:
    """A module's extra state (``get_extra_state``/``set_extra_state``) as a Stateful."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def state_dict(self) -> Any:
        return self._module.get_extra_state()

    def load_state_dict(self, state: Any) -> None:
        self._module.set_extra_state(state)


def module_extra_states(model: torch.nn.Module | None) -> dict[str, Any]:
    """Every module's extra state of ``model`` as a Stateful, by its state-dict key (what a
    load changes besides tensors, kept to be restored)."""
    if model is None:
        return {}
    out: dict[str, Any] = {}
    for key in model.state_dict(keep_vars=True):
        owner = extra_state_owner(model, key)
        if owner is not None:
            out[key] = _ExtraState(owner)
    return out


def check_stateful(field_name: str, objs: Any) -> dict[str, Any]:
    """Validate ``extra`` / ``rank_extra`` (construction time): a dict of name -> Stateful."""
    if objs is None:
        return {}
    if not isinstance(objs, dict):
        raise ValueError(
            f"{field_name} must be a dict of name -> object with state_dict()/load_state_dict(), "
            f"got {type(objs).__name__}"
        )
    for name, obj in objs.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(
                f"{field_name} names must be non-empty strings without '/', got {name!r}"
            )
        missing = [
            m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))
        ]
        if missing:
            raise ValueError(
                f"{field_name}[{name!r}] must have state_dict() and load_state_dict() (torch's "
                f"Stateful protocol), got a {type(obj).__name__} without {' and '.join(missing)}; "
                "wrap it in an object that defines both"
            )
    return dict(objs)


def check_objects(
    model: Any, optimizer: Any, extra: Any, rank_extra: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Validate the objects a manager saves and loads (construction time); the ``extra`` and
    ``rank_extra`` dicts."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    extra, rank_extra = check_stateful("extra", extra), check_stateful("rank_extra", rank_extra)
    both = sorted(set(extra) & set(rank_extra))
    if both:
        raise ValueError(f"{both} are names in both extra and rank_extra; use each name once")
    if optimizer is not None:
        fqns = param_fqns(model, optimizer)  # a param without a name is a configuration error
        _refuse_fsdp1(optimizer, fqns)
    return extra, rank_extra


def _refuse_fsdp1(optimizer: torch.optim.Optimizer, fqns: list[list[str]]) -> None:
    """FSDP1's flattened params (its mark, ``_fsdp_flattened``) hold each rank's piece of a
    flat shard: their optimizer state has no place in a checkpoint keyed by parameter."""
    for group, names in zip(optimizer.param_groups, fqns, strict=True):
        flat = [n for p, n in zip(group["params"], names, strict=True) if _fsdp1(p)]
        if flat:
            raise ValueError(
                f"optimizer params {flat} are flattened by FSDP1 (FullyShardedDataParallel; "
                "Lightning's FSDPStrategy): each rank's optimizer state is its piece of a flat "
                "shard, which a checkpoint cannot place or reshard, and saving it would keep one "
                "rank's piece. Shard the model with fully_shard (FSDP2; Lightning's "
                "ModelParallelStrategy), whose DTensors the manager saves and reshards"
            )


def _fsdp1(p: Tensor) -> bool:
    return bool(getattr(p, "_fsdp_flattened", False))


def extra_digests(extra: dict[str, Any]) -> dict[str, str]:
    """A digest of each ``extra`` object's state (values, tensors by their bytes), so ranks can
    check cheaply that they save the same thing."""
    out = {}
    for name, obj in extra.items():
        h = hashlib.blake2b(digest_size=16)
        _feed(h, obj.state_dict())
        out[name] = h.hexdigest()
    return out


def _feed(h: Any, v: Any) -> None:
    """Feed ``v`` into ``h`` independently of the process: dict items and set elements in
    sorted order (insertion order and string hashing differ between processes)."""
    if isinstance(v, Tensor):
        h.update(f"T{v.dtype}{tuple(v.shape)}".encode())
        if not hasattr(v, "_local_tensor"):  # a DTensor's shards differ by rank: shape only
            t = v.detach().cpu().contiguous()
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(v, dict):
        h.update(b"D%d" % len(v))
        for k, x in sorted(v.items(), key=lambda kv: repr(kv[0])):
            _feed(h, k)
            _feed(h, x)
    elif isinstance(v, (set, frozenset)):
        h.update(b"S%d" % len(v))
        for x in sorted(v, key=repr):
            _feed(h, x)
    elif isinstance(v, (list, tuple)):
        h.update(b"L%d" % len(v))
        for x in v:
            _feed(h, x)
    else:
        h.update(pickle.dumps(v, protocol=4))
