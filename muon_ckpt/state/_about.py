"""What a manifest says of the state a save holds (``describe``): the optimizer's type, the
model's parallel layout (the mesh and placements of each DTensor param), which inform a
reader (``step_info()``, ``muon-ckpt inspect``, messages), and each param's update rule,
which a load compares (``state._rules``)."""

from __future__ import annotations

from typing import Any

import torch

from muon_ckpt._shards import describe_layout
from muon_ckpt.state._offloaded import optimizer_name
from muon_ckpt.state._rules import record_rules

__all__ = ["ABOUT", "describe"]

MODEL = "model."

# The entries of a manifest's ``extra`` that describe the state saved (``describe``)
ABOUT = ("optimizer", "layout", "update_rules")


def describe(
    model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None, sd: dict[str, Any]
) -> dict[str, Any]:
    """What a manifest records of the state saved from ``model``/``optimizer`` as the flat
    dict ``sd``: ``optimizer`` (its type), ``layout`` (the mesh and placements of each
    DTensor of the model, ``describe_layout``), ``update_rules`` (``record_rules``); each
    only where there is one."""
    got = {
        "optimizer": optimizer_name(optimizer),
        "layout": describe_layout(
            (k[len(MODEL) :], v) for k, v in sd.items() if k.startswith(MODEL)
        ),
        "update_rules": record_rules(model, optimizer),
    }
    return {k: v for k, v in got.items() if v is not None}
