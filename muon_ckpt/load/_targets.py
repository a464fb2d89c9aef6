"""Bytes read from a stored item into the targets of its read items: the part of the stored
tensor each one wants (``narrow``; a resharded rank's rows), copied into the tensor the
planner resolves, then committed. Shared by the local and in-memory routes."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from muon_ckpt._tensors import copy_into
from muon_ckpt.load._item_zip import Layout

__all__ = ["Span", "commit_part", "commit_slices", "narrow", "slice_spans"]


def commit_part(planner: LoadPlanner, req: ReadItem, src: torch.Tensor, where: str) -> None:
    """``src`` (the part of a stored tensor that ``req`` wants) into its target."""
    target = planner.resolve_tensor(req).detach()
    if target.size() != src.size():
        raise RuntimeError(
            f"{where}: item {req.storage_index.fqn} at {list(req.storage_offsets)} "
            f"has shape {list(src.size())}, the tensor it loads into {list(target.size())}"
        )
    copy_into(target, src)  # a reading thread: one memmove where it can be
    planner.commit_tensor(req, target)


Span = tuple[int, int]


def slice_spans(
    lay: Layout, reqs: list[ReadItem]
) -> tuple[list[tuple[ReadItem, Span | None]], int, int]:
    """For each read item, the elements ``[first, last + 1)`` of the stored tensor's storage
    it takes (None: none), and the span of all of them ``lo, hi`` (in elements)."""
    parts: list[tuple[ReadItem, Span | None]] = []
    for req in reqs:
        if any(n == 0 for n in req.lengths):
            parts.append((req, None))
            continue
        first = lay.offset + sum(o * s for o, s in zip(req.storage_offsets, lay.stride))
        last = first + sum((n - 1) * s for n, s in zip(req.lengths, lay.stride))
        parts.append((req, (first, last + 1)))
    spans = [p for _, p in parts if p is not None]
    lo = min((a for a, _ in spans), default=0)
    hi = max((b for _, b in spans), default=0)
    return parts, lo, hi


def commit_slices(
    planner: LoadPlanner,
    lay: Layout,
    parts: list[tuple[ReadItem, Span | None]],
    lo: int,
    view: Any,
    where: str,
) -> None:
    """Each read item's part of the stored tensor, from ``view``: the bytes of its elements
    ``[lo, hi)`` (``slice_spans``; None when empty), into its target."""
    flat = None if view is None else torch.frombuffer(view, dtype=lay.dtype)
    for req, span in parts:
        if span is None or flat is None:
            src = torch.empty(tuple(req.lengths), dtype=lay.dtype)
        else:
            src = flat.as_strided(tuple(req.lengths), lay.stride, span[0] - lo)
        commit_part(planner, req, src, where)


def narrow(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The part of a stored chunk that a read item wants (resharding)."""
    for dim, (start, n) in enumerate(zip(offsets, lengths)):
        if start != 0 or n != t.size(dim):
            t = t.narrow(dim, start, n)
    return t
