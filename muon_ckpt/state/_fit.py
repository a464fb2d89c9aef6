"""Fit the flat state to a checkpoint before anything is read (``fit``), in named passes:

1. hyperparameters: every saved group entry is read (small Python values), to be mapped to
   this optimizer's groups after the read (``_apply``), whatever the grouping;
2. legacy names: keys saved before canonical FQNs (wrapper prefixes) are read under those;
3. statefuls (``extra``, ``rank_extra``, a module's extra state): all their keys, or a
   mismatch;
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
    _fit_statefuls(flat, have, url, strict, report)
    _fit_tensors(flat, have, fresh, url, strict, report)
    report.unexpected = _unexpected(flat, have, url, strict, report)
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


def _fit_statefuls(
    flat: FlatState, have: dict[str, Any], url: str, strict: bool, report: LoadReport
) -> None:
    for key in list(flat.stateful):
        nested, _ = flatten_state_dict({key: flat.sd[key]})
        missing = sorted(k for k in nested if k not in have)
        if not missing:
            why = next(
                (
                    f"{k!r} {w}"
                    for k, v in nested.items()
                    if (w := _mismatch(v, have[k])) is not None
                ),
                None,
            )
            if why is None:
                continue
            if strict:
                raise CheckpointMismatchError(f"{url}: {display_key(key)}: key {why}")
            report.mismatched.append((key, why))
        elif strict:
            raise CheckpointMismatchError(
                f"{url}: {display_key(key)} has key(s) {missing[:8]} that the checkpoint does not: "
                "its state_dict() differs from the one saved; the checkpoint has "
                f"{sorted(k for k in have if k.startswith(f'{key}.'))[:8]}; load(strict=False) "
                "leaves it as it is"
            )
        else:
            report.missing.append(key)
        flat.drop(key)
        del flat.stateful[key]


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
        if key in flat.stateful or key.startswith(GROUPS):
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
