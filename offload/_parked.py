"""Parked tensors: what a tracked tensor is while the pool holds its bytes.

An offloaded tensor keeps its identity, shape and dtype, but its device storage is freed
(``untyped_storage().resize_(0)``): reading it would read through a null pointer and kill the
process (a segmentation fault on the CPU, an illegal address on the GPU). So while it is
offloaded its class is swapped for a subclass (``_ParkedTensor``, or ``_ParkedDTensor`` for a
DTensor, whose local tensor is parked too) whose ``__torch_function__`` lets through what only
reads metadata (shape, dtype, device, ``untyped_storage()``, ``repr``) and refuses the rest with
an ``OffloadedStateError`` that names the tensor and says where its value can be read. The class
goes back to the original one before the pool gives the tensor storage again, so a step computes
on plain tensors, at no cost.

Only the class changes (both classes have the base's layout): ``isinstance`` checks, ``id()``
and every attribute stay as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["OffloadedStateError", "is_parked", "park", "unpark"]

_ATTR = "_offload_parked_as"  # (what it is, how to read it), set while parked


class OffloadedStateError(RuntimeError):
    """A tensor whose bytes the CPU offload pool holds was read or written as a tensor."""


def _metadata_calls() -> frozenset[Any]:
    """The torch functions a parked tensor answers: they read its metadata, never its bytes
    (views and copies are not among them: they would share the freed storage)."""
    getters = (
        "shape", "dtype", "device", "layout", "ndim", "requires_grad", "is_leaf", "grad",
        "grad_fn", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested",
        "itemsize", "nbytes", "names", "_base",
    )  # fmt: skip
    methods = (
        "size", "dim", "numel", "nelement", "stride", "storage_offset", "element_size",
        "untyped_storage", "data_ptr", "is_contiguous", "is_floating_point", "is_complex",
        "is_signed", "get_device", "__hash__", "__len__", "_is_view", "ndimension",
    )  # fmt: skip
    calls = {getattr(Tensor, m) for m in methods if hasattr(Tensor, m)}
    calls |= {getattr(Tensor, g).__get__ for g in getters if hasattr(Tensor, g)}
    return frozenset(calls)


_METADATA = _metadata_calls()
_TEXT = frozenset({Tensor.__repr__, Tensor.__str__, Tensor.__format__})


def _describe(t: Any) -> tuple[str, str]:
    return getattr(t, _ATTR, None) or ("a tensor", "CPUOffloadPool.host_views()")


def _refuse(func: Any, args: Any, kwargs: Any) -> OffloadedStateError:
    parked = next((a for a in [*args, *(kwargs or {}).values()] if is_parked(a)), None)
    what, read = _describe(parked)
    name = getattr(func, "__name__", None) or repr(func)
    return OffloadedStateError(
        f"{what} is offloaded: CPU offload keeps its value in pinned CPU memory between steps "
        f"and its device storage is freed, so it cannot be used as a tensor here ({name}). "
        f"Read or write its value through {read} (a CPU tensor; writing it sets the value the "
        "next step uses), or call turn_off_cpu_offload() first"
    )


def _text(t: Any) -> str:
    what, read = _describe(t)
    return (
        f"<offloaded {what}: shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}; "
        f"value in pinned CPU memory: {read}>"
    )


def _handle(func: Any, args: Any, kwargs: Any) -> Any:
    if func in _TEXT:
        return _text(args[0])
    if func not in _METADATA:
        raise _refuse(func, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))


class _ParkedTensor(Tensor):
    """A plain tensor whose bytes are offloaded (see the module docstring)."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func: Any, _types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _handle(func, args, kwargs)


class _ParkedDTensor(DTensor):
    """A DTensor whose local tensor is offloaded (see the module docstring)."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func: Any, _types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _handle(func, args, kwargs)

    def to_local(self, *args: Any, **kwargs: Any) -> Tensor:
        """The (parked) local tensor itself: a state has no autograd to wrap it in."""
        return self._local_tensor

    def full_tensor(self, *args: Any, **kwargs: Any) -> Tensor:
        raise _refuse(DTensor.full_tensor, (self,), {})

    def redistribute(self, *args: Any, **kwargs: Any) -> DTensor:
        raise _refuse(DTensor.redistribute, (self,), {})


_PARKED: dict[type, type] = {Tensor: _ParkedTensor, DTensor: _ParkedDTensor}
_OWN = {parked: own for own, parked in _PARKED.items()}


def park(obj: Tensor, local: Tensor, what: str, read: str) -> None:
    """Mark ``obj`` (and its local tensor ``local``, the same object for a plain tensor) as
    offloaded: ``what`` names it in errors, ``read`` says where its value can be read. A
    tensor of another class (a user's subclass) is left as it is."""
    for t in {id(local): local, id(obj): obj}.values():
        cls = _PARKED.get(type(t))
        if cls is not None:
            t.__class__ = cls
            setattr(t, _ATTR, (what, read))


def unpark(obj: Tensor, local: Tensor) -> None:
    """Give ``obj`` and ``local`` their own classes back (before their storage is restored)."""
    for t in {id(local): local, id(obj): obj}.values():
        cls = _OWN.get(type(t))
        if cls is not None:
            t.__class__ = cls
            t.__dict__.pop(_ATTR, None)


def is_parked(t: Any) -> bool:
    return type(t) in _OWN
