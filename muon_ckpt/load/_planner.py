"""The load planner: DCP's default one, with non-tensor values loaded with
``weights_only=True`` and a hook before every write into a target.

DCP loads non-tensor values with ``torch.load(weights_only=False)``; here they go through
``weights_only=True``, after ``_declared`` made sure the item cannot expand beyond its own
bytes. (The ``.metadata`` pickle is read by ``store``'s restricted unpickler; tensors are read
by ``_local_files`` and ``_item_bytes``.)
"""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from muon_ckpt.state import load_value

__all__ = ["SafeLoadPlanner", "load_value"]


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with ``weights_only=True``.

    ``before_write(key)``: called before a target tensor is handed out to be written into
    (every write of a load goes through ``resolve_tensor``), from the reading threads."""

    def __init__(self, before_write: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self._before_write = before_write

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
