"""An optimizer's offloaded states, as a checkpoint reads and writes them: host views of the
pinned CPU buffers that hold them (``cpu_state_views()``), or those views frozen while a
background save writes them (``freeze_cpu_state()``). The manager never toggles offload."""

from __future__ import annotations

import torch

from offload import FrozenViews, OffloadingOptimizer

__all__ = ["freeze_offloaded", "offloaded_views", "optimizer_name"]


def _offloading(opt: torch.optim.Optimizer | None) -> OffloadingOptimizer | None:
    """``opt`` when its states are offloaded now, else None."""
    if not isinstance(opt, OffloadingOptimizer):
        if getattr(opt, "cpu_offload", False) is True:  # says so, but cannot be read there
            raise TypeError(
                f"{type(opt).__name__} has CPU offload on but does not implement "
                "offload.OffloadingOptimizer (cpu_state_views(), freeze_cpu_state()), through "
                "which the checkpoint manager reads and writes offloaded states (see optim.Muon)"
            )
        return None
    return opt if opt.cpu_offload else None


def offloaded_views(opt: torch.optim.Optimizer | None) -> dict[int, torch.Tensor]:
    """With CPU offload on: ``id(state tensor) ->`` the host view holding its value; {}
    otherwise."""
    off = _offloading(opt)
    return {} if off is None else off.cpu_state_views()


def freeze_offloaded(opt: torch.optim.Optimizer | None) -> FrozenViews:
    """The offloaded states frozen (``FrozenViews``: ``views``, ``release()``) while training
    goes on; call only with offload on."""
    off = _offloading(opt)
    if off is None:
        raise AssertionError("freeze_offloaded without CPU offload on")
    return off.freeze_cpu_state()


def optimizer_name(opt: object | None) -> str | None:
    """``module.Class`` of ``opt``'s type (None for None): how manifests name the optimizer."""
    return None if opt is None else f"{type(opt).__module__}.{type(opt).__qualname__}"
