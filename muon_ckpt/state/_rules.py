"""The update rule of each parameter: recorded by a save, compared by a load.

An optimizer that reports how it updates each param (``ReportsRules``: ``optim.Muon``, whose
``update_rule(p)`` says Muon with its Newton-Schulz method and dtype, or AdamW) has that rule
recorded per param FQN in the manifest (``update_rules``, by ``state.describe``); other
optimizers record nothing (the manifest names their type), and a load between such an
optimizer and one that reports rules changes every param's rule (named by the type). A load compares the record with
the rule the optimizer it loads into would use, before anything is read
(``RuleCheck.before``): a param that was Muon and is now in an AdamW group (or the reverse),
or another Newton-Schulz method or dtype its group asks for, is a change. A strict load
refuses it (``CheckpointMismatchError`` listing the params); ``strict=False`` loads what
fits, reports it (``LoadReport.rules``) and goes on with this optimizer's rule: its groups
keep their rule keys (``update_rule_keys``). Where a group left the choice to ``"auto"``, the
saved value comes back with the hyperparameters, as any hyperparameter does (the rule
``adopts`` it).

After the read (``RuleCheck.after``), rule keys that the saved groups lack (a checkpoint of a
version before the key existed) get what the optimizer's ``__setstate__`` gives an old state
dict (torch's convention, which its ``load_state_dict`` follows: Muon's ``ns_method`` is what
those versions ran), and every param with a record must go on by it. A checkpoint without a
record (saved before it existed) is accepted as it is: its params go on by the rule its
hyperparameters give, as they did when it was saved, never by a default of this version.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from muon_ckpt._errors import CheckpointCorruptError, CheckpointMismatchError
from muon_ckpt.state._apply import saved_hparams
from muon_ckpt.state._flat import FlatState
from muon_ckpt.state._names import param_fqns
from muon_ckpt.state._offloaded import optimizer_name

__all__ = ["ReportsRules", "RuleCheck", "record_rules"]


class Rule(Protocol):
    """What ``update_rule`` returns: recorded as its ``str``."""

    def adopts(self, saved: str) -> bool:
        """Whether a param saved under rule ``saved`` goes on by the same rule here."""
        ...


@runtime_checkable
class ReportsRules(Protocol):
    """An optimizer that says how it updates each param (``optim.Muon``)."""

    update_rule_keys: tuple[str, ...]  # the group keys a rule is made of

    def update_rule(self, param: Tensor) -> Rule: ...


def _params(
    model: torch.nn.Module | None, optimizer: torch.optim.Optimizer
) -> Iterator[tuple[int, str, Tensor]]:
    """(group index, FQN, param) of every param of ``optimizer``."""
    for gi, (g, names) in enumerate(
        zip(optimizer.param_groups, param_fqns(model, optimizer), strict=True)
    ):
        for p, fqn in zip(g["params"], names, strict=True):
            yield gi, fqn, p


def record_rules(
    model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None
) -> dict[str, str] | None:
    """FQN -> the rule ``optimizer`` updates it by, or None for an optimizer that does not
    report rules."""
    if not isinstance(optimizer, ReportsRules):
        return None
    return {fqn: str(optimizer.update_rule(p)) for _, fqn, p in _params(model, optimizer)}


def _record(saved: Any, where: str) -> dict[str, str] | None:
    if saved is None:
        return None
    if not isinstance(saved, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in saved.items()
    ):
        raise CheckpointCorruptError(
            f"{where}: the manifest's update_rules is not a mapping of parameter names to "
            "rules; the step cannot be trusted. Load another step"
        )
    return saved


@dataclass
class RuleCheck:
    """One load's comparison of the recorded rules with ``optimizer``'s."""

    optimizer: Any
    where: str
    strict: bool
    saved: dict[str, str] | None  # the record (None: the checkpoint has none)
    params: dict[str, tuple[int, Tensor]]  # FQN -> (group index, param)
    keys: dict[int, dict[str, Any]]  # group index -> its rule keys as given
    changed: list[tuple[str, str, str]] = field(default_factory=list)  # (FQN, saved, here)

    @classmethod
    def before(
        cls,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        saved: Any,
        where: str,
        strict: bool,
        saved_by: str | None = None,
    ) -> RuleCheck | None:
        """The check of a load into ``optimizer`` of a step whose record is ``saved``,
        written by an optimizer of type ``saved_by`` (the manifest's; None for no optimizer
        to load into); a strict load that would change a rule raises here, before anything is
        read. Rules are compared where both sides report them; where only one side does (a
        Muon checkpoint into torch's SGD, another optimizer's into Muon), every param changes
        rule unless the types are the same."""
        if optimizer is None:
            return None
        record = _record(saved, where)
        params = {fqn: (gi, p) for gi, fqn, p in _params(model, optimizer)}
        if not isinstance(optimizer, ReportsRules):
            check = cls(optimizer, where, strict, None, params, {})
            if record is not None and saved_by != optimizer_name(optimizer):
                here = _shown(optimizer_name(optimizer))
                check._changed([(f, r, here) for f, r in record.items() if f in params])
            return check
        if record is None and saved_by is not None and saved_by != optimizer_name(optimizer):
            record = dict.fromkeys(params, _shown(saved_by))  # (no rule it could adopt)
        built = {fqn: optimizer.update_rule(p) for fqn, (_, p) in params.items()}
        keys = {
            gi: {k: g[k] for k in optimizer.update_rule_keys if k in g}
            for gi, g in enumerate(optimizer.param_groups)
        }
        check = cls(optimizer, where, strict, record, params, keys)
        if record is not None:
            check._changed(
                [
                    (f, record[f], str(r))
                    for f, r in built.items()
                    if f in record and not r.adopts(record[f])
                ]
            )
        return check

    def after(self, flat: FlatState) -> None:
        """After the hyperparameters of ``flat`` were applied: rule keys the saved groups
        lack get the optimizer's defaults for old state dicts; the groups of accepted
        changes keep their rule; every other param with a record must go on by it."""
        if not isinstance(self.optimizer, ReportsRules):
            return  # (its rule is its type's: the changes were all known before the read)
        self._fill_absent(saved_hparams(flat))
        self._keep_given({gi for f, *_ in self.changed for gi in [self.params[f][0]]})
        done = {f for f, *_ in self.changed}
        later = []
        for fqn, (_, p) in self.params.items():
            if fqn in done:
                continue
            if self.saved is None or fqn not in self.saved:
                continue  # (no record: the rule its saved hyperparameters give, accepted)
            now = str(self.optimizer.update_rule(p))
            if now != self.saved[fqn]:
                later.append((fqn, self.saved[fqn], now))
        self._changed(later)
        self._keep_given({self.params[f][0] for f, *_ in later})

    def _changed(self, changes: list[tuple[str, str, str]]) -> None:
        if changes and self.strict:
            raise CheckpointMismatchError(_message(self.where, changes, self.optimizer))
        self.changed += changes

    def _keep_given(self, groups: set[int]) -> None:
        for gi in groups:
            self.optimizer.param_groups[gi].update(self.keys[gi])

    def _fill_absent(self, saved_hparams: dict[str, dict[str, Any]]) -> None:
        popped: dict[int, dict[str, Any]] = {}
        for gi, g in enumerate(self.optimizer.param_groups):
            mine = [
                saved_hparams[f]
                for f, (i, _) in self.params.items()
                if i == gi and f in saved_hparams
            ]
            if not mine:
                continue  # (nothing saved for this group: it keeps its own)
            absent = [
                k
                for k in self.optimizer.update_rule_keys
                if k in g and not any(k in h for h in mine)
            ]
            popped[gi] = {k: g.pop(k) for k in absent}
        if not any(popped.values()):
            return
        # torch's hook for a state dict of an older version (load_state_dict calls it too)
        self.optimizer.__setstate__({"param_groups": self.optimizer.param_groups})
        for gi, kept in popped.items():
            for k, v in kept.items():
                self.optimizer.param_groups[gi].setdefault(k, v)


def _shown(name: str | None) -> str:
    """An optimizer's ``module.Class`` as its users write it: from the shortest parent
    package already imported that exports the same class (``torch.optim.SGD``)."""
    if name is None or "." not in name:
        return str(name)
    module, cls = name.rsplit(".", 1)
    kind = getattr(sys.modules.get(module), cls, None)
    while "." in module and kind is not None:
        parent = module.rsplit(".", 1)[0]
        if getattr(sys.modules.get(parent), cls, None) is not kind:
            break
        module = parent
    return f"{module}.{cls}"


def _message(where: str, changes: list[tuple[str, str, str]], optimizer: Any) -> str:
    shown = "; ".join(f"{f!r}: saved {s}, here {h}" for f, s, h in changes[:6])
    more = f"; ... ({len(changes)} in all)" if len(changes) > 6 else ""
    if isinstance(optimizer, ReportsRules):
        keys = ", ".join(optimizer.update_rule_keys)
        fix = f"put each param in a group with the rule it had (the group keys {keys})"
    else:
        fix = "load into the optimizer that saved it"
    return (
        f"{where}: {len(changes)} param(s) would be updated by another rule than when the "
        f"checkpoint was saved: {shown}{more}. A load does not change how a param is "
        f"updated: {fix}, or accept the change with load(strict=False), which loads the "
        "state that fits, goes on with this optimizer's rules and reports them "
        "(last_load_report.rules)"
    )
