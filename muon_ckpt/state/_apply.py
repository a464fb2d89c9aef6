"""Apply what DCP does not write in place, after the read: Python values of optimizer state,
hyperparameters (mapped from the saved groups to this optimizer's groups by their params'
names), ``extra``/``rank_extra`` and modules' extra state."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from muon_ckpt._errors import CheckpointMismatchError
from muon_ckpt.state._fit import LoadReport
from muon_ckpt.state._flat import GROUP_SKIP, GROUPS, FlatState
from muon_ckpt.state._names import strip_wrappers

__all__ = ["apply_loaded", "saved_hparams"]


def apply_loaded(
    flat: FlatState,
    optimizer: torch.optim.Optimizer | None,
    url: str,
    report: LoadReport,
    *,
    strict: bool = True,
) -> None:
    """Write back what DCP could not load in place (Python values, hyperparameters, extra)."""
    if optimizer is not None:
        for p in flat.stateless:
            optimizer.state.pop(p, None)
        for key, (p, sk) in flat.state_slots.items():
            v = flat.sd[key]
            if not isinstance(v, Tensor):
                optimizer.state[p][sk] = v
        saved = saved_hparams(flat)
        for gi, fqns in enumerate(flat.group_fqns):
            _apply_group(
                flat, optimizer, gi, [f for f in fqns if f in saved], saved, url, report, strict
            )
    for key, obj in flat.stateful.items():
        obj.load_state_dict(flat.loaded_value(key))


def saved_hparams(flat: FlatState) -> dict[str, dict[str, Any]]:
    """Param FQN -> the hyperparameters of its group when saved, from the group entries
    read (``<lead>.params`` lists), or from per-param entries (muon-ckpt <= 0.2)."""
    groups: dict[str, dict[str, Any]] = {}
    for key, v in flat.sd.items():
        if key.startswith(GROUPS):
            lead, hk = key[len(GROUPS) :].rsplit(".", 1)
            groups.setdefault(strip_wrappers(lead), {})[hk] = v
    out: dict[str, dict[str, Any]] = {}
    for lead, hp in groups.items():
        params = hp.pop("params", None)
        for fqn in params if isinstance(params, list) else [lead]:
            out[strip_wrappers(fqn)] = hp
    return out


def _apply_group(
    flat: FlatState,
    optimizer: torch.optim.Optimizer,
    gi: int,
    fqns: list[str],
    saved: dict[str, dict[str, Any]],
    url: str,
    report: LoadReport,
    strict: bool,
) -> None:
    """Set group ``gi``'s hyperparameters from the saved group(s) of its params ``fqns``."""
    group = optimizer.param_groups[gi]
    for hk in sorted({h for f in fqns for h in saved[f]} - set(GROUP_SKIP)):
        have = [(f, saved[f][hk]) for f in fqns if hk in saved[f]]
        (f0, v0), rest = have[0], have[1:]
        odd = next(((f, v) for f, v in rest if v is not v0 and not _same(v0, v)), None)
        if odd is not None:
            if strict:
                raise CheckpointMismatchError(
                    f"{url}: params {f0!r} and {odd[0]!r} share param group {gi} here but "
                    f"were in groups with {hk}={v0!r} and {hk}={odd[1]!r} when saved (was a "
                    "param moved to another group?); load(strict=False) keeps this group's "
                    "own hyperparameters"
                )
            report.kept_hparams.append((gi, hk, "its params had different values"))
        elif gi in flat.unsure_groups:
            if not _same(group.get(hk), v0):
                why = "a param of the group has state that does not match the checkpoint"
                report.kept_hparams.append((gi, hk, why))
        elif _same_layout(group.get(hk), v0):
            group[hk].copy_(v0)  # in place: a scheduler or a captured graph holds it
        else:
            group[hk] = v0


def _same_layout(a: Any, b: Any) -> bool:
    return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:
        return False
