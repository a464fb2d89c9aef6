"""Park optimizer states in flat pinned CPU buffers between steps."""

from offload._host import FrozenViews
from offload._parked import OffloadedStateError
from offload._pinned import pinned_empty
from offload._pipeline import OffloadPipeline
from offload._pool import CPUOffloadPool
from offload._protocol import OffloadingOptimizer

__all__ = [
    "CPUOffloadPool",
    "FrozenViews",
    "OffloadPipeline",
    "OffloadedStateError",
    "OffloadingOptimizer",
    "pinned_empty",
]
