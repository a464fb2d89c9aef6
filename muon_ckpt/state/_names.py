"""Parameter names as checkpoint keys: the model's FQNs without wrapper prefixes.

``torch.compile(model)`` names every parameter ``_orig_mod.<fqn>``, DDP ``module.<fqn>`` and
activation checkpointing ``..._checkpoint_wrapped_module.<name>``. Stored under those names, a
checkpoint of a compiled model would not load into the plain one. The rules are those of
torch's ``get_model_state_dict`` (``torch.distributed.checkpoint.state_dict._get_fqns``, which
is private): an atom is dropped where the module that holds it is such a wrapper, so a
submodule of the user's own that happens to be called ``module`` keeps its name. Checkpoints
written before these rules (by muon-ckpt 0.2) may hold the wrapped names; ``legacy_aliases``
finds them on load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["canonical_names", "legacy_aliases", "param_fqns", "strip_wrappers"]

# Atoms that are always a wrapper's attribute, whatever module holds them.
_WRAPPER_ATTRS = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
_LEGACY_ATOMS = _WRAPPER_ATTRS | {"_orig_mod"}


def _is_wrapper(mod: Any, atom: str) -> bool:
    if atom in _WRAPPER_ATTRS:
        return True
    if atom == "_orig_mod":
        # By name: isinstance() would need torch._dynamo, a slow import most runs never make.
        return type(mod).__name__ == "OptimizedModule"
    if atom == "module":
        return isinstance(mod, nn.parallel.DistributedDataParallel)
    return False


def canonical_names(model: nn.Module, names: list[str]) -> dict[str, str]:
    """``{name: canonical name}`` for state-dict keys or parameter names of ``model``; raises
    ValueError if two names become one."""
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name in names:
        mod: Any = model
        atoms = []
        for atom in name.split("."):
            if not _is_wrapper(mod, atom):
                atoms.append(atom)
            mod = mod._modules.get(atom) if isinstance(mod, nn.Module) else None
        clean = ".".join(atoms)
        if clean in seen and seen[clean] != name:
            raise ValueError(
                f"model keys {seen[clean]!r} and {name!r} both become {clean!r} without wrapper "
                "prefixes (_orig_mod., module.); rename one of the modules"
            )
        seen[clean] = name
        out[name] = clean
    return out


def strip_wrappers(fqn: str) -> str:
    """A stored name without wrapper atoms, when the model that saved it is unknown: every
    ``_orig_mod``/``_checkpoint_wrapped_module``/``_fsdp_wrapped_module`` and a leading
    ``module`` (DDP wraps the root; a ``module`` deeper down may be the user's own)."""
    parts = [p for p in fqn.split(".") if p not in _LEGACY_ATOMS]
    while len(parts) > 1 and parts[0] == "module":
        parts = [p for p in parts[1:] if p not in _LEGACY_ATOMS]
    return ".".join(parts)


def legacy_aliases(saved_keys: Any) -> dict[str, str]:
    """``{canonical key: saved key}`` for saved keys (``<section>.<fqn>``) that still carry a
    wrapper atom (written before names were canonical); a key that two saved keys would claim
    is left out."""
    out: dict[str, str] = {}
    ambiguous: set[str] = set()
    for key in saved_keys:
        for section in ("model.", "optim.state.", "optim.param_groups."):
            if key.startswith(section):
                clean = section + strip_wrappers(key[len(section) :])
                break
        else:
            continue
        if clean == key:
            continue
        if clean in out:
            ambiguous.add(clean)
        out[clean] = key
    for k in ambiguous:
        del out[k]
    return out


def param_fqns(model: nn.Module | None, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The canonical FQN of every optimizer param, group by group (model names first, else
    the group's ``names``)."""
    by_id: dict[int, str] = {}
    if model is not None:
        named = list(model.named_parameters())
        clean = canonical_names(model, [n for n, _ in named])
        for name, p in named:
            by_id.setdefault(id(p), clean[name])
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
