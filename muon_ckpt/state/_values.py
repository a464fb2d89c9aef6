"""Python values as a load reads them back.

Every non-tensor value of a step (``extra``/``rank_extra`` state, hyperparameters, a module's
extra state) is read by one unpickler, ``torch.load(weights_only=True)`` (``load_value``),
which refuses NumPy objects and any class of the user's. So a save converts NumPy values on
the way in (``loadable``: scalars to Python's int/float/bool/complex/str/bytes, arrays to CPU
tensors of their dtype) and refuses, before anything is written, a value that unpickler would
refuse (``check_loadable``): a step that commits is a step that loads. ``pack``/``unpack`` are
the same rules for a state an integration keeps as one ``torch.save`` blob.
"""

from __future__ import annotations

import collections
import io
from typing import Any

import numpy as np
import torch
from torch import Tensor

from muon_ckpt._errors import CheckpointError

__all__ = ["check_loadable", "display_key", "load_value", "loadable", "pack", "unpack"]

# Values the unpickler takes whatever they hold; anything else is tried with it.
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_CONTAINERS = (dict, collections.OrderedDict, list, tuple)


def load_value(value: io.BytesIO) -> Any:
    """A stored non-tensor value, as every load reads it (``load._declared`` bounds its
    bytes first)."""
    return torch.load(value, weights_only=True)


def unpack(data: bytes) -> Any:
    """A blob written by ``pack``, read as every load reads values (tensors to the CPU)."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def pack(value: Any, where: str) -> bytes:
    """``value`` as one ``torch.save`` blob that ``unpack`` reads back: NumPy values
    converted (``loadable``), anything else the unpickler refuses raised as a CheckpointError
    naming ``where`` and the path inside it."""
    value = loadable(value)
    _check(value, where, "", _blob_read)
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def loadable(v: Any) -> Any:
    """``v`` with every NumPy scalar as the Python value of it (``.item()``: exact) and
    every NumPy array of a dtype torch has as a CPU tensor (a copy: a load writes into it),
    inside dicts, lists and tuples; ``v`` itself when it holds none."""
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        try:
            return torch.from_numpy(np.array(v, copy=True, order="C"))
        except TypeError:  # strings, objects: no tensor dtype (check_loadable names it)
            return v
    if type(v) in (dict, collections.OrderedDict):
        items = [(loadable(k), loadable(x)) for k, x in v.items()]
        if all(a is k and b is x for (a, b), (k, x) in zip(items, v.items(), strict=True)):
            return v
        return type(v)(items)
    if type(v) in (list, tuple):
        out = [loadable(x) for x in v]
        return v if all(a is b for a, b in zip(out, v, strict=True)) else type(v)(out)
    return v


def check_loadable(values: dict[str, Any], step: int) -> None:
    """Raise a CheckpointError naming the first value of ``values`` (a flat state's
    non-tensor entries, by key) that ``load_value`` could not read back."""
    for key, v in values.items():
        name, rank = _split(key)
        _check(v, f"saving step {step}: {name}", rank, _unpickled)


def display_key(key: str) -> str:
    """A flat key as the user wrote it: ``extra.sched`` -> ``extra['sched']``;
    ``rank_extra.1.data`` -> ``rank_extra['data'] of rank 1``."""
    name, rank = _split(key)
    return name + rank


def _split(key: str) -> tuple[str, str]:
    head, _, rest = key.partition(".")
    if head == "rank_extra" and "." in rest:
        rank, name = rest.split(".", 1)
        return f"rank_extra[{name!r}]", f" of rank {rank}"
    return f"{head}[{rest!r}]", ""


def _check(v: Any, where: str, tail: str, read: Any) -> None:
    bad = _refused(v, "", read)
    if bad is None:
        return
    path, value, why = bad
    raise CheckpointError(
        f"{where}{path}{tail} is a {type(value).__module__}.{type(value).__qualname__}, which a "
        f"load cannot read back (torch.load(weights_only=True): {why}); nothing was written "
        "and every committed step is intact. Return plain values from state_dict() "
        "(numbers, strings, bytes, None, lists, tuples, dicts), tensors or NumPy "
        "arrays/scalars, e.g. this object's fields, and rebuild it in load_state_dict()"
    )


def _refused(v: Any, path: str, read: Any) -> tuple[str, Any, str] | None:
    """(path, value, why) of the first value inside ``v`` that ``read`` refuses; only
    values of types other than plain ones and tensors are tried (each on its own)."""
    if type(v) in _PLAIN or isinstance(v, Tensor):
        return None
    if type(v) in _CONTAINERS:
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, x in items:
            sub = f"{path}[{k!r}]"
            bad = _refused(k, f"{path} (the key {k!r})", read) or _refused(x, sub, read)
            if bad is not None:
                return bad
        return None
    try:
        read(v)
    except Exception as e:
        return path, v, _why(e)
    return None


def _why(e: Exception) -> str:
    """The unpickler's reason, without its advice to allow the class (a load never does)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    line = next((ln for ln in lines if ln.startswith("WeightsUnpickler error:")), None)
    if line is None:
        return f"{type(e).__name__}: {(lines or [''])[0][:300]}"
    return line.removeprefix("WeightsUnpickler error:").split(". Please use")[0].strip()[:300]


def _unpickled(v: Any) -> Any:
    buf = io.BytesIO()
    torch.save(v, buf)
    buf.seek(0)
    return load_value(buf)


def _blob_read(v: Any) -> Any:
    buf = io.BytesIO()
    torch.save(v, buf)
    return unpack(buf.getvalue())
