"""Park optimizer states in flat pinned CPU buffers between steps."""

from offload._parked import OffloadedStateError
from offload._pinned import pinned_empty
from offload._pool import CPUOffloadPool, FrozenViews

__all__ = ["CPUOffloadPool", "FrozenViews", "OffloadedStateError", "pinned_empty"]
