"""An optimizer's offloaded states, as a checkpoint reads and writes them: host views of the
pinned CPU buffers that hold them (``cpu_state_views()``), or those views frozen while a
background save writes them (``freeze_cpu_state()``). The manager never toggles offload."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["freeze_offloaded", "offloaded_views", "optimizer_name"]


def _offloading(opt: torch.optim.Optimizer | None) -> Any:
    """``opt`` when its states are offloaded now (the offload protocol), else None."""
    if opt is None or getattr(opt, "cpu_offload", False) is not True:
        return None
    for m in ("cpu_state_views", "freeze_cpu_state"):
        if not callable(getattr(opt, m, None)):
            raise TypeError(
                f"{type(opt).__name__} has CPU offload on but no {m}(); the checkpoint "
                "manager reads and writes offloaded states through cpu_state_views() and "
                "freeze_cpu_state() (see optim.Muon)"
            )
    return opt


def offloaded_views(opt: torch.optim.Optimizer | None) -> dict[int, torch.Tensor]:
    """With CPU offload on: ``id(state tensor) ->`` the host view holding its value; {}
    otherwise."""
    off = _offloading(opt)
    return {} if off is None else off.cpu_state_views()


def freeze_offloaded(opt: torch.optim.Optimizer | None) -> Any:
    """The offloaded states frozen (``FrozenViews``: ``views``, ``release()``) while training
    goes on; call only with offload on."""
    off = _offloading(opt)
    if off is None:
        raise AssertionError("freeze_offloaded without CPU offload on")
    return off.freeze_cpu_state()


def optimizer_name(opt: object | None) -> str | None:
    """``module.Class`` of ``opt``'s type (None for None): how manifests name the optimizer."""
    return None if opt is None else f"{type(opt).__module__}.{type(opt).__qualname__}"
