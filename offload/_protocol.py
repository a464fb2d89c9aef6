"""What a checkpoint manager needs of an optimizer whose states may be offloaded."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from offload._host import FrozenViews

__all__ = ["OffloadingOptimizer"]


@runtime_checkable
class OffloadingOptimizer(Protocol):
    """An optimizer whose states may live in CPU memory between steps, read and written there
    by whoever saves or loads them (``optim.Muon`` is one).

    ``isinstance(opt, OffloadingOptimizer)`` checks that the three members exist, not their
    signatures (``runtime_checkable``); a type checker checks those.
    """

    @property
    def cpu_offload(self) -> bool:
        """True while the states are parked in CPU memory between steps."""
        ...

    def cpu_state_views(self) -> dict[int, Tensor]:
        """With offload on, between steps: ``id(state tensor) ->`` the CPU tensor holding its
        value; writing one sets the value the next step uses."""
        ...

    def freeze_cpu_state(self) -> FrozenViews:
        """With offload on, between steps: the states' values now, as CPU views that keep them
        until ``release()`` while training goes on."""
        ...
