"""The load planner: DCP's default one, with non-tensor values loaded with
``weights_only=True``, a hook before every write into a target, and each DTensor's shard
read where it lies (``shard_box``: torch misreads uneven strided shards).

DCP loads non-tensor values with ``torch.load(weights_only=False)``; here they go through
``weights_only=True``, after ``_declared`` made sure the item cannot expand beyond its own
bytes. (The ``.metadata`` pickle is read by ``store``'s restricted unpickler; tensors are read
by ``_local_files`` and ``_item_bytes``.)
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable

import torch
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from muon_ckpt._shards import chunk_of, has_strided
from muon_ckpt.load._overlap import narrowed, restored
from muon_ckpt.state import load_value

__all__ = ["SafeLoadPlanner", "load_value"]


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with ``weights_only=True``.

    ``before_write(key)``: called before a target tensor is handed out to be written into
    (every write of a load goes through ``resolve_tensor``), from the reading threads."""

    def __init__(self, before_write: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self._before_write = before_write

    def create_local_plan(self) -> LoadPlan:
        full = self.metadata
        # DCP's planner sweeps only the saved chunks each shard can overlap (_overlap)
        self.metadata, runs = narrowed(self.state_dict, full) if full else (full, {})
        try:
            plan = restored(super().create_local_plan(), runs)
        finally:
            self.metadata = full
        boxed = {k: v for k, v in self.state_dict.items() if has_strided(v)}
        if not boxed:
            return plan
        items = [it for it in plan.items if it.dest_index.fqn not in boxed]
        for key, v in boxed.items():
            md = self.metadata.state_dict_metadata.get(key) if self.metadata else None
            if isinstance(md, TensorStorageMetadata):
                items += create_read_items_for_chunk_list(key, md, [chunk_of(v)])
        return dataclasses.replace(plan, items=items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        if self._before_write is not None:
            self._before_write(read_item.dest_index.fqn)
        return super().resolve_tensor(read_item)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = load_value(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
