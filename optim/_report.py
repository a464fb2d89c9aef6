"""What a Muon optimizer tells about itself: the update rule of each parameter, and the
Newton-Schulz work a rank did in the last step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from optim._ns_dtype import resolve_ns_dtype, resolve_ns_method
from optim._plan import Item
from optim.newton_schulz import ns_flops, uses_gram

__all__ = ["RULE_KEYS", "NSWork", "UpdateRule", "ns_work", "update_rule"]

# The group keys an update rule is made of (a checkpoint load keeps them where it accepts a
# change of rule: ``load(strict=False)``)
RULE_KEYS = ("use_muon", "ns_method", "ns_dtype")
_NS_FIELDS = ("ns_method", "ns_dtype")


@dataclass(frozen=True)
class UpdateRule:
    """How the optimizer updates one parameter: ``kind`` ``"muon"`` (momentum orthogonalised
    by Newton-Schulz) or ``"adamw"``; for Muon, the Newton-Schulz iteration this matrix runs
    (``ns_method``: ``"standard"``, or ``"gram"`` where its group's ``ns_method="gram"`` takes
    the Gram iteration on it, i.e. aspect ratio above 2) and its dtype (``ns_dtype``:
    ``"bf16"`` or ``"fp32"``). Two runs that update a parameter by the same rule give it the
    same arithmetic; hyperparameters (lr, betas, ...) are not part of it."""

    kind: str
    ns_method: str | None = None
    ns_dtype: str | None = None
    # The fields the group left to "auto" (resolved on this device): not part of the rule's
    # identity; a rule adopts another value there (``adopts``)
    auto: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __str__(self) -> str:
        if self.kind != "muon":
            return self.kind
        return f"muon(ns_method={self.ns_method}, ns_dtype={self.ns_dtype})"

    @classmethod
    def parse(cls, text: str) -> UpdateRule | None:
        """The rule ``str(rule)`` wrote, or None for text no rule writes."""
        if text in ("adamw",):
            return cls(text)
        head, _, rest = text.partition("(")
        if head != "muon" or not rest.endswith(")"):
            return None
        fields = dict(kv.split("=", 1) for kv in rest[:-1].split(", ") if "=" in kv)
        if set(fields) != set(_NS_FIELDS):
            return None
        return cls("muon", fields["ns_method"], fields["ns_dtype"])

    def adopts(self, saved: str) -> bool:
        """Whether a param a checkpoint says was updated by ``saved`` (a rule's ``str``)
        goes on by the same rule here: the same rule, or one that differs only where this
        param's group left the choice to ``"auto"`` (the saved group's value comes back with
        its hyperparameters, so a resume keeps computing as it did)."""
        if saved == str(self):
            return True
        other = UpdateRule.parse(saved)
        if other is None or other.kind != self.kind:
            return False
        return all(getattr(other, f) == getattr(self, f) or f in self.auto for f in _NS_FIELDS)


@dataclass(frozen=True)
class NSWork:
    """The Newton-Schulz work one rank did in a step: the matrices it orthogonalised (their
    names: the group's ``names``, else ``#i of param group g``) and the floating-point
    operations of their matrix products (``newton_schulz.ns_flops``)."""

    matrices: int
    flops: int
    params: tuple[str, ...]


def update_rule(
    groups: list[dict], param: Tensor, auto: Callable[[dict], frozenset[str]] | None = None
) -> UpdateRule:
    """The rule ``param`` of ``groups`` is updated by (``Muon.update_rule``); ``auto``: the
    keys a group left to ``"auto"``."""
    for g in groups:
        if any(p is param for p in g["params"]):
            if not g["use_muon"]:
                return UpdateRule("adamw")
            resolve_ns_dtype(g)  # (a group set to "auto" since: what it means here)
            resolve_ns_method(g)
            rows = param.shape[0]
            cols = param.numel() // max(rows, 1)
            gram = uses_gram(rows, cols, g["ns_method"])
            method = "gram" if gram else "standard"
            asked = auto(g) if auto is not None else frozenset()
            return UpdateRule("muon", method, g["ns_dtype"], asked)
    raise ValueError(
        f"a param of shape {tuple(param.shape)} is not in the optimizer's param groups; pass "
        "one of the tensors given to it (param_groups[i]['params'])"
    )


def ns_work(groups: list[dict], done: list[Item]) -> NSWork:
    """The ``NSWork`` of the items ``done`` (what ``muon_step`` returned)."""
    names = {}
    for gi, g in enumerate(groups):
        given = g.get("names")
        for i, p in enumerate(g["params"]):
            names[id(p)] = given[i] if given else f"#{i} of param group {gi}"
    flops = sum(ns_flops(*it.matrix_dims(), it.group["ns_steps"], it.method) for it in done)
    return NSWork(len(done), flops, tuple(names[id(it.param)] for it in done))
