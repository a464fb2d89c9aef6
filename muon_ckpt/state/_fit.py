"""Fit the flat state to a checkpoint before anything is read (``fit``), in named passes:

1. hyperparameters: every saved group entry is read (small Python values), to be mapped to
   this optimizer's groups after the read (``_apply``), whatever the grouping;
2. legacy names: keys saved before canonical FQNs (wrapper prefixes) are read under those;
3. statefuls (``extra``, ``rank_extra``, a module's extra state): read as the step stores
   them (``_structure``), every key of the object's own in the step, or a mismatch;
4. tensors and optimizer state: each key present with its shape and dtype; optimizer state
   created for this load for a param that had none when saved is dropped again;
5. unexpected keys: a model or optimizer key of the checkpoint that nothing here takes.

Strict: each problem is a CheckpointMismatchError naming the key. Relaxed (``strict=False``):
the key is left out of the load and reported (``LoadReport``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from muon_ckpt._errors import CheckpointMismatchError
from muon_ckpt.state._flat import GROUPS, FlatState
from muon_ckpt.state._names import legacy_aliases
from muon_ckpt.state._structure import first_device, layout
from muon_ckpt.state._values import display_key

__all__ = ["LoadReport", "fit"]


@dataclass
class LoadReport:
    """What a load did not load as is (``load(strict=False)``; empty for a strict load).

    ``missing``: keys of this model/optimizer that the checkpoint lacks (left as they were;
    optimizer state created for the load starts fresh: zeros, step 0); ``unexpected``: keys of
    the checkpoint that nothing here takes; ``mismatched``: ``(key, why)`` for keys whose
    shape, dtype or kind differ (left as they were); ``kept_hparams``: ``(group, hparam, why)``
    for hyperparameters left as they are because the group's params disagreed when saved;
    ``rules``: ``(param, saved rule, rule here)`` for params this optimizer updates by another
    rule than the checkpoint's did (it goes on with its own: ``state._rules``).
    """

    step: int | None = None
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, str]] = field(default_factory=list)
    kept_hparams: list[tuple[int, str, str]] = field(default_factory=list)
    rules: list[tuple[str, str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.missing or self.unexpected or self.mismatched or self.kept_hparams or self.rules
        )

    def summary(self) -> str:
        parts = []
        for name, items in (
            ("missing from the checkpoint", self.missing),
            ("not taken from the checkpoint", self.unexpected),
            ("different shape/dtype/kind", [k for k, _ in self.mismatched]),
            ("hyperparameters kept", [f"group {g} {h}" for g, h, _ in self.kept_hparams]),
            ("update rule changed", [f"{p} ({s} -> {h})" for p, s, h in self.rules]),
        ):
            if items:
                shown = ", ".join(items[:6]) + (
                    f", ... ({len(items)} in all)" if len(items) > 6 else ""
                )
                parts.append(f"{name}: {shown}")
        return "; ".join(parts) or "everything matched"


def fit(
    flat: FlatState, metadata: Any, fresh: set[int], url: str, *, strict: bool = True
) -> LoadReport:
    """Fit ``flat`` to ``metadata`` (the passes above); ``fresh``: ids of the params whose
    optimizer state this load created."""
    report = LoadReport()
    have = metadata.state_dict_metadata
    _read_all_hyperparameters(flat, have)
    _follow_legacy_names(flat, have)
    _fit_statefuls(flat, metadata, url, strict, report)
    _fit_tensors(flat, have, fresh, url, strict, report)
    report.unexpected += _unexpected(flat, have, url, strict, report)
    return report


def _read_all_hyperparameters(flat: FlatState, have: dict[str, Any]) -> None:
    if not flat.group_fqns:
        return
    for key in [k for k in flat.sd if k.startswith(GROUPS)]:
        del flat.sd[key]
    for key, md in have.items():
        if key.startswith(GROUPS):  # a tensor hyperparameter is read into a new one
            tensor = isinstance(md, TensorStorageMetadata)
            flat.sd[key] = torch.empty(md.size, dtype=md.properties.dtype) if tensor else None


def _follow_legacy_names(flat: FlatState, have: dict[str, Any]) -> None:
    aliases = legacy_aliases(have)
    for key in [k for k in flat.sd if k not in have]:
        if key in aliases:
            flat.rename(key, aliases[key])
        elif key in flat.stateful:  # a dict module extra state, flattened, wrapped names
            under = next((a for a in aliases if a.startswith(f"{key}.")), None)
            if under is not None:
                flat.rename(key, aliases[under][: len(aliases[under]) - len(under) + len(key)])


def _fit_statefuls(flat: FlatState, md: Any, url: str, strict: bool, report: LoadReport) -> None:
    """Each stateful's value is read as the step stores it (``_structure``): the leaves it has
    into the object's own tensors where they fit, the rest into new ones; a leaf the object
    has that the step lacks, or holds with another shape, dtype or kind, is a mismatch."""
    have = md.state_dict_metadata
    stored = _stored_keys(flat, have, md.planner_data)
    for key in list(flat.stateful):
        template = flat.sd[key]
        try:
            ours, _ = flatten_state_dict({key: template})
        except ValueError as e:  # ("duplicated flatten key ...")
            ours, why = {}, f"its state_dict() has two entries under one key ({e})"
        else:
            why = next(
                (
                    f"key {k!r} {w}"
                    for k in ours
                    if k in have and (w := _mismatch(ours[k], have[k]))
                ),
                None,
            )
        missing = sorted(k for k in ours if k not in stored[key])
        lay = layout(key, template, stored[key], md.planner_data, url) if why is None else None
        if lay is not None and lay.unknown:
            if strict:
                raise CheckpointMismatchError(
                    f"{url}: {display_key(key)}: the checkpoint has key(s) {lay.unknown[:8]} "
                    "that its state_dict() does not; the step was saved by a muon-ckpt that did "
                    "not record the types of dict keys (0.2 and earlier), so they load only into "
                    "an object whose state_dict() has them (an optimizer after one step); "
                    "load(strict=False) loads the rest and reports them"
                )
            report.unexpected.extend(lay.unknown)
        if lay is not None and not missing and why is None:
            flat.sd.pop(key)
            device = first_device(template) or torch.device("cpu")
            for k in lay.leaves:
                flat.sd[k] = _target(ours.get(k), have[k], device)
                flat.leaf_of[k] = key
            flat.skeletons[key] = lay.skeleton
            continue
        if strict and why is not None:
            raise CheckpointMismatchError(f"{url}: {display_key(key)}: {why}")
        if strict:
            raise CheckpointMismatchError(
                f"{url}: {display_key(key)} has key(s) {missing[:8]} that the checkpoint does not: "
                "its state_dict() differs from the one saved; the checkpoint has "
                f"{sorted(stored[key])[:8]}; load(strict=False) leaves it as it is"
            )
        if why is not None:
            report.mismatched.append((key, why))
        else:
            report.missing.append(key)
        flat.drop(key)
        del flat.stateful[key]


def _stored_keys(flat: FlatState, have: dict[str, Any], planner_data: Any) -> dict[str, set[str]]:
    """Each stateful's flat keys in the step: those whose DCP path starts at it (by prefix
    where the step has no such map)."""
    out: dict[str, set[str]] = {key: set() for key in flat.stateful}
    paths = planner_data if isinstance(planner_data, dict) else {}
    for k in have:
        path = paths.get(k)
        if isinstance(path, tuple) and path and path[0] in out:
            out[path[0]].add(k)
        elif not isinstance(path, tuple):
            for key in out:
                if k == key or k.startswith(f"{key}."):
                    out[key].add(k)
    return out


def _target(ours: Any, md: Any, device: torch.device) -> Any:
    """What the load reads a stateful's leaf into: the object's own tensor where it has one
    the load can write (a DTensor reshards), else a new tensor of the stored shape and dtype
    (an expanded tensor's elements share memory: a load cannot write it); None for a Python
    value (the planner sets it)."""
    if not isinstance(md, TensorStorageMetadata):
        return None
    if isinstance(ours, Tensor) and not _self_overlapping(ours):
        return ours
    return torch.empty(md.size, dtype=md.properties.dtype, device=device)


def _self_overlapping(t: Tensor) -> bool:
    local = getattr(t, "_local_tensor", t)
    # (torch answers 0: no overlap, 1: overlap, 2: too hard to tell, so maybe)
    return local.layout == torch.strided and torch._debug_has_internal_overlap(local) != 0


def _fit_tensors(
    flat: FlatState,
    have: dict[str, Any],
    fresh: set[int],
    url: str,
    strict: bool,
    report: LoadReport,
) -> None:
    saved_state_fqns = {k.rsplit(".", 1)[0] for k in have if k.startswith("optim.state.")}
    for key in list(flat.sd):
        if key in flat.stateful or key in flat.leaf_of or key.startswith(GROUPS):
            continue
        if key in flat.state_slots and key not in have:
            p, _ = flat.state_slots[key]
            if id(p) in fresh and key.rsplit(".", 1)[0] not in saved_state_fqns:
                flat.drop(key)  # no state when saved: removed again after the load
                flat.stateless.append(p)
                continue
        why = "missing" if key not in have else _mismatch(flat.sd[key], have[key])
        if why is None:
            continue
        if strict:
            if why == "missing":
                raise CheckpointMismatchError(_missing_msg(key, have, set(flat.sd), url))
            raise CheckpointMismatchError(f"{url}: key {key!r} {why}")
        if why == "missing":
            report.missing.append(key)
        else:
            report.mismatched.append((key, why))
        if key in flat.state_slots:  # its group's saved hyperparameters may be another's
            gi = flat.group_of.get(key[len("optim.state.") :].rsplit(".", 1)[0])
            if gi is not None:
                flat.unsure_groups.add(gi)
        flat.drop(key)


def _unexpected(
    flat: FlatState, have: dict[str, Any], url: str, strict: bool, report: LoadReport
) -> list[str]:
    ours = set(flat.sd)
    sections = tuple(s for s in ("model.", "optim.state.") if any(k.startswith(s) for k in ours))
    nested = tuple(f"{k}." for k in flat.stateful)  # a module's extra state, flattened
    dropped = set(report.missing) | {k for k, _ in report.mismatched}
    unexpected = sorted(
        k
        for k in have
        if k.startswith(sections)
        and k not in ours
        and not k.startswith(nested)
        and k not in dropped
    )
    if unexpected and strict:
        raise CheckpointMismatchError(
            f"{url}: the checkpoint has {len(unexpected)} key(s) this model/optimizer does not: "
            f"{unexpected[:8]}; was a parameter renamed or removed? load(strict=False) loads "
            "what matches and reports the rest"
        )
    return unexpected


def _mismatch(value: Any, md: Any) -> str | None:
    is_tensor = isinstance(value, Tensor)
    if is_tensor != isinstance(md, TensorStorageMetadata):
        kind = "a tensor" if isinstance(md, TensorStorageMetadata) else "a Python object"
        here = "a tensor" if is_tensor else type(value).__name__
        return f"is {kind} in the checkpoint but {here} here"
    if not is_tensor:
        return None
    if tuple(value.shape) != tuple(md.size):
        return (
            f"has shape {tuple(md.size)} in the checkpoint but {tuple(value.shape)} in this "
            "model/optimizer; build the model with the shapes it was saved with"
        )
    if value.dtype != md.properties.dtype:
        return (
            f"has dtype {md.properties.dtype} in the checkpoint but {value.dtype} here; cast the "
            "model/optimizer to match first"
        )
    return None


def _missing_msg(key: str, have: dict[str, Any], ours: set[str], url: str) -> str:
    prefix = key.split(".", 1)[0] + "."
    unknown = sorted(k for k in have if k.startswith(prefix) and k not in ours)
    hint = f" The checkpoint has keys this model does not: {unknown[:8]}." if unknown else ""
    return (
        f"{url}: key {key!r} is not in the checkpoint.{hint} Was a parameter renamed? Keys are "
        "parameter FQNs; load with the model the checkpoint was saved from, or load(strict=False) "
        "to load what matches and report the rest"
    )
