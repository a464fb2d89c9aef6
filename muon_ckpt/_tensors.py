"""Two small tensor helpers shared by the save, load and interop paths."""

from __future__ import annotations

import ctypes

from torch import Tensor

__all__ = ["local_tensor", "tensor_bytes"]


def local_tensor(t: Tensor) -> Tensor:
    """The tensor that holds the data: a DTensor's local shard, else ``t`` itself."""
    return getattr(t, "_local_tensor", t)


def tensor_bytes(t: Tensor) -> memoryview:
    """A zero-copy, writable byte view of a contiguous CPU tensor (the caller keeps ``t``
    alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")
