"""Park optimizer states in flat pinned CPU buffers between steps."""

from offload._pool import CPUOffloadPool

__all__ = ["CPUOffloadPool"]
