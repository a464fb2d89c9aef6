"""Small tensor helpers shared by the save, load and interop paths."""

from __future__ import annotations

import collections
import copy
import ctypes
from typing import Any

import torch
from torch import Tensor

__all__ = ["copy_into", "host_copy", "local_tensor", "overlapping", "tensor_bytes"]


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


def copy_into(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)``; between plain contiguous CPU tensors of one dtype and shape, one
    ``memmove`` on the calling thread with the interpreter lock released, ``dst``'s version
    counter bumped as ``copy_`` bumps it (autograd refuses a backward through a value a load
    overwrote). ``copy_`` there runs torch's intra-op thread pool from every calling thread:
    the reading threads of a load, each copying on its own, ran a pool each on the same cores
    (a hot 1 GiB load on 2 cores spent more time in the pools' spinning than in the
    copies)."""
    if _plain_cpu(dst) and _plain_cpu(src) and dst.dtype == src.dtype and dst.shape == src.shape:
        if (n := dst.numel() * dst.element_size()) > 0:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
            if not dst.is_inference():
                torch.autograd.graph.increment_version(dst)
        return
    dst.copy_(src)


def _plain_cpu(t: Tensor) -> bool:
    """A plain (not a wrapper subclass: a DTensor's ``data_ptr`` is 0), dense, contiguous CPU
    tensor whose bytes are its values (no conjugate or negative bit)."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_quantized
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        and (t.numel() == 0 or t.data_ptr() != 0)
    )


def host_copy(v: Any) -> Any:
    """A deep copy of a (nested) value whose tensors are CPU copies: what a state dict holds
    now, unaffected by later changes to the live objects."""
    if isinstance(v, Tensor):
        return v.detach().to("cpu", copy=True)
    if isinstance(v, dict):  # (an OrderedDict stays one: a load hands back what was saved)
        cls = collections.OrderedDict if isinstance(v, collections.OrderedDict) else dict
        return cls((k, host_copy(x)) for k, x in v.items())
    if isinstance(v, (list, tuple)) and type(v) in (list, tuple):
        return type(v)(host_copy(x) for x in v)
    return copy.deepcopy(v)


def overlapping(tensors: dict[str, Tensor]) -> set[str]:
    """The keys whose tensors' memory (from their first to their last element's byte)
    overlaps another's (same device; an empty tensor overlaps nothing)."""
    spans = []
    for k, t in tensors.items():
        if t.numel() == 0:
            continue
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        spans.append((t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size(), k))
    spans.sort()
    out: set[str] = set()
    reach, last = -1, None  # the furthest end so far, and the key that reaches it
    for lo, hi, k in spans:
        if lo < reach and last is not None:
            out |= {k, last}
        if hi > reach:
            reach, last = hi, k
    return out
