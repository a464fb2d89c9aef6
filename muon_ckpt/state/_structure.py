"""The structure of a stateful's value as saved, so that a load hands back that value.

DCP stores a nested value as its leaves, each under its path joined with ``.`` (``extra.<name>.
<key path>``), and names a dict's key by ``str(key)``: the leaves alone do not say that a key
was ``0`` rather than ``"0"``, that a dict was empty, or an ``OrderedDict``. So a save records,
beside DCP's own map of each key's path (the metadata's ``planner_data``), the skeleton of every
value stored as more than one leaf (``structure_records``): its containers with their original
keys, ``None`` at each leaf, as a ``pack`` blob under ``RECORD + <key>``. A load rebuilds the
value from that skeleton and the leaves read (``layout``, ``rebuild``), whatever the fresh
object's ``state_dict()`` holds; a step saved without a record is rebuilt on the object's own
structure (the keys it lacks cannot be typed: ``Layout.unknown``).

Skeleton nodes: ``None`` (a leaf), ``("d" | "o", [(key, node), ...])`` (a dict, an
OrderedDict), ``("l", [node, ...])`` (a list DCP stored element by element).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from muon_ckpt._errors import CheckpointCorruptError, CheckpointError
from muon_ckpt.state._values import display_key, pack, unpack

__all__ = [
    "RECORD",
    "Layout",
    "check_keys",
    "first_device",
    "layout",
    "rebuild",
    "skeleton_of",
    "structure_records",
]

RECORD = "muon_ckpt.structure:"  # planner_data key of a value's skeleton: RECORD + its DCP key


def structure_records(sd: dict[str, Any], mappings: dict[str, Any]) -> dict[str, bytes]:
    """``RECORD + key -> skeleton blob`` for every value of ``sd`` (a state dict before DCP
    flattens it) that DCP stores as other than one leaf; ``mappings``: DCP's flatten map of
    ``sd`` (flat key -> path)."""
    paths: dict[str, set[tuple[Any, ...]]] = {}
    for path in mappings.values():
        paths.setdefault(path[0], set()).add(tuple(path))
    out = {}
    for key, v in sd.items():
        if isinstance(v, (Mapping, list)) and paths.get(key) != {(key,)}:
            out[RECORD + key] = pack(_skeleton(v, (key,), paths.get(key, set())), key)
    return out


def check_keys(key: str, value: Any, step: int) -> None:
    """A save's check that DCP can store ``value`` under ``key``: no two of its entries have
    one flat key (``0`` and ``"0"``, ``"a.b"`` and ``["a"]["b"]``)."""
    try:
        flatten_state_dict({key: value})
    except ValueError as e:
        flat = str(e).removeprefix("duplicated flatten key ")
        raise CheckpointError(
            f"saving step {step}: {display_key(key)} has two entries stored as the key "
            f"{flat!r} (DCP joins a value's path with '.' and names a dict key by str(key), "
            "so 0 and '0', or 'a.b' and ['a']['b'], are one key); nothing was written and "
            "every committed step is intact. Give them names that stay apart"
        ) from None


def skeleton_of(key: str, value: Any) -> Any:
    """The skeleton of ``value`` stored under ``key`` (ValueError: two of its entries have
    one DCP key)."""
    _, mappings = flatten_state_dict({key: value})
    return _skeleton(value, (key,), {tuple(p) for p in mappings.values()})


def _skeleton(v: Any, path: tuple[Any, ...], leaves: set[tuple[Any, ...]]) -> Any:
    if path in leaves:
        return None
    if isinstance(v, Mapping):
        kind = "o" if isinstance(v, collections.OrderedDict) else "d"
        return (kind, [(k, _skeleton(x, (*path, str(k)), leaves)) for k, x in v.items()])
    # DCP stores every other value it reaches as a leaf: this is a list it walked into
    return ("l", [_skeleton(x, (*path, i), leaves) for i, x in enumerate(v)])


@dataclass
class Layout:
    """How a step stores one stateful's value: ``skeleton`` (the recorded one, or the fresh
    object's when the step has no record), the flat key of each of its ``leaves``, and the
    step's keys of this value that the skeleton does not place (``unknown``: only without a
    record)."""

    skeleton: Any
    leaves: list[str]
    unknown: list[str]


def layout(key: str, template: Any, stored: set[str], planner_data: Any, where: str) -> Layout:
    """The layout of ``key``'s value in a step whose flat keys of that value are ``stored``;
    without a record, the fresh object's ``template`` gives the skeleton."""
    blob = planner_data.get(RECORD + key) if isinstance(planner_data, dict) else None
    if blob is None:
        skeleton = skeleton_of(key, template)
        leaves = _leaves(skeleton, (key,))
        return Layout(skeleton, leaves, sorted(stored - set(leaves)))
    try:
        skeleton = unpack(blob) if isinstance(blob, bytes) else None
        leaves = _leaves(skeleton, (key,))
    except Exception as e:  # (a crafted record: anything from the unpickler, a deep nest)
        raise CheckpointCorruptError(
            f"{where}: the record of {key!r} is unreadable ({type(e).__name__}: {e})"
        ) from e
    if set(leaves) != stored or len(leaves) != len(stored):
        raise CheckpointCorruptError(
            f"{where}: the record of {key!r} places {sorted(leaves)[:6]} but the step stores "
            f"{sorted(stored)[:6]}; the step was not written by one save. Load another step"
        )
    return Layout(skeleton, leaves, [])


def _leaves(node: Any, path: tuple[Any, ...]) -> list[str]:
    """The flat key of every leaf of a skeleton (CheckpointCorruptError: not a skeleton)."""
    if node is None:
        return [".".join(map(str, path))]
    kind, items = node if isinstance(node, tuple) and len(node) == 2 else (None, None)
    if kind in ("d", "o") and isinstance(items, list):
        if not all(isinstance(i, tuple) and len(i) == 2 for i in items):
            raise CheckpointCorruptError(f"a dict node at {path} is not (key, node) pairs")
        return [f for k, sub in items for f in _leaves(sub, (*path, str(k)))]
    if kind == "l" and isinstance(items, list):
        return [f for i, sub in enumerate(items) for f in _leaves(sub, (*path, i))]
    raise CheckpointCorruptError(f"not a skeleton node at {path}: {str(node)[:80]}")


def rebuild(node: Any, leaves: dict[str, Any], path: tuple[Any, ...]) -> Any:
    """The value a skeleton describes, each leaf taken from ``leaves`` by its flat key."""
    if node is None:
        return leaves[".".join(map(str, path))]
    kind, items = node
    if kind == "l":
        return [rebuild(sub, leaves, (*path, i)) for i, sub in enumerate(items)]
    out = collections.OrderedDict() if kind == "o" else {}
    for k, sub in items:
        out[k] = rebuild(sub, leaves, (*path, str(k)))
    return out


def first_device(value: Any) -> Any:
    """The device of the first tensor in ``value`` (a DTensor's local one), else None."""
    if isinstance(value, Tensor):
        return getattr(value, "_local_tensor", value).device
    items = value.values() if isinstance(value, Mapping) else value
    if isinstance(value, (Mapping, list, tuple)):
        for x in items:
            dev = first_device(x)
            if dev is not None:
                return dev
    return None
