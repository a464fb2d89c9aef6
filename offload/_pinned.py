"""The one host-memory allocator for buffers that feed device copies (pool, staging, reader).

Policy: a plain ``torch.empty`` CPU tensor, page-locked with ``cudaHostRegister`` when CUDA is
available; unpinned (pageable) memory otherwise, with the same bookkeeping.

Why not ``torch.empty(..., pin_memory=True)``: that goes through torch's caching host
allocator, which rounds every request up to the next power of two (a 5 GiB buffer takes
8 GiB of page-locked memory) and keeps freed blocks cached for reuse by later pinned
requests. Registering exactly the bytes asked for costs the same one-off pinning time
(~1 s/GiB), returns them to the system when the buffer dies, and copies run at the pinned
rate (``tensor.is_pinned()`` is True). The registration is undone when the buffer's storage
is freed, i.e. after its last view is gone, never while a view can still be copied from.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["pinned_empty"]

_PORTABLE = 0x01  # cudaHostRegisterPortable


def pinned_empty(
    numel: int,
    dtype: torch.dtype = torch.uint8,
    *,
    pin: bool | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """A flat CPU tensor of ``numel`` elements, page-locked when ``pin`` (default: when CUDA
    is available) for copies to and from CUDA ``device`` (default: the current one; a thread
    other than the one that set it starts on device 0, so threads pass it). Contents are
    uninitialised."""
    buf = torch.empty(numel, dtype=dtype)
    if pin is None:
        pin = torch.cuda.is_available()
    nbytes = numel * buf.element_size()
    if pin and nbytes > 0:
        cudart = torch.cuda.cudart()
        ptr = buf.data_ptr()
        # Portable: page-locked for every device's context, not just the one current here.
        if device is not None and device.type == "cuda":
            with torch.cuda.device(device):
                err = cudart.cudaHostRegister(ptr, nbytes, _PORTABLE)
        else:
            err = cudart.cudaHostRegister(ptr, nbytes, _PORTABLE)
        if int(err) != 0:
            raise RuntimeError(
                f"cudaHostRegister of {nbytes} bytes of host memory failed; the machine may "
                "be out of page-lockable memory (ulimit -l) or out of RAM"
            )
        # On the storage, not the tensor: views (DTensor wrappers, slices) keep it alive.
        weakref.finalize(buf.untyped_storage(), cudart.cudaHostUnregister, ptr)
    return buf
