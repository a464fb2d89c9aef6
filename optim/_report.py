"""What a Muon optimizer tells about itself: the update rule of each parameter, and the
Newton-Schulz work a rank did in the last step."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from optim._ns_dtype import resolve_ns_dtype, resolve_ns_method
from optim._plan import Item
from optim.newton_schulz import ns_flops, uses_gram

__all__ = ["NSWork", "UpdateRule", "ns_work", "update_rule"]


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

    def __str__(self) -> str:
        if self.kind != "muon":
            return self.kind
        return f"muon(ns_method={self.ns_method}, ns_dtype={self.ns_dtype})"


@dataclass(frozen=True)
class NSWork:
    """The Newton-Schulz work one rank did in a step: the matrices it orthogonalised (their
    names: the group's ``names``, else ``#i of param group g``) and the floating-point
    operations of their matrix products (``newton_schulz.ns_flops``)."""

    matrices: int
    flops: int
    params: tuple[str, ...]


def update_rule(groups: list[dict], param: Tensor) -> UpdateRule:
    """The rule ``param`` of ``groups`` is updated by (``Muon.update_rule``)."""
    for g in groups:
        if any(p is param for p in g["params"]):
            if not g["use_muon"]:
                return UpdateRule("adamw")
            resolve_ns_dtype(g)  # (a group set to "auto" since: what it means here)
            resolve_ns_method(g)
            rows = param.shape[0]
            cols = param.numel() // max(rows, 1)
            gram = uses_gram(rows, cols, g["ns_method"])
            return UpdateRule("muon", "gram" if gram else "standard", g["ns_dtype"])
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
