"""The load planner: DCP's default one, with non-tensor values loaded with
``weights_only=True``, a hook before every write into a target, each DTensor's shard
read where it lies (``shard_box``: torch misreads uneven strided shards), and a local plan that
crosses DCP's round trip through rank 0 as a key, not its items (``KeyedPlan``).

DCP gathers every rank's local plan to rank 0 (pickled, unpickled there), runs rank 0's
global step on them (the planner's ``create_global_plan``, the reader's
``prepare_global_plan``) and scatters each plan back (pickled again). A load's global step is
the identity (DCP's ``create_default_global_load_plan``, ``FileSystemReader``'s): the round
trip only costs, ~1.4 M read items unpickled and pickled on rank 0 for 2,048 ranks of an 8B
model. So where rank 0's global step is ours and the identity (``_identity``), a rank's plan
pickles as a random key (``muon_ckpt._plans``) with its ``storage_data`` and
``planner_data``: rank 0 sees stand-ins without items (``StandIn``) and hands them back, and
the key unpickled on its own rank is the rank's own plan again. A plan that comes back as
anything else (a stand-in, another plan) fails the load: nothing is read from a plan rank 0
never saw.

DCP loads non-tensor values with ``torch.load(weights_only=False)``; here they go through
``weights_only=True``, after ``_declared`` made sure the item cannot expand beyond its own
bytes. (The ``.metadata`` pickle is read by ``store``'s restricted unpickler; tensors are read
by ``_local_files`` and ``_item_bytes``.)
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import muon_ckpt._plans as _plans
from muon_ckpt._errors import CheckpointError
from muon_ckpt._shards import chunk_of, has_strided
from muon_ckpt.load._overlap import narrowed, restored
from muon_ckpt.state import load_value

__all__ = ["KeyedPlan", "SafeLoadPlanner", "StandIn", "keyed", "load_value", "unchanged"]


@dataclasses.dataclass
class KeyedPlan(LoadPlan):
    """A rank's local load plan that pickles as its key (``_plans.remember``), its
    ``storage_data`` and ``planner_data``; unpickled, the key is this plan again in the
    process that made it (``_arrived``), a ``StandIn`` anywhere else."""

    key: str = ""

    def __reduce__(self) -> tuple[Any, ...]:
        own = _plans.recall(self.key)  # (rank 0's global step kept the items: the key says all)
        intact = own is not None and self.items is own.items
        return _arrived, (self.key, self.storage_data, self.planner_data, intact)


def keyed(plan: LoadPlan) -> KeyedPlan:
    """``plan`` as a ``KeyedPlan``, kept under its key (weakly: hold it) until forgotten."""
    out = KeyedPlan(plan.items, plan.storage_data, plan.planner_data)
    out.key = _plans.remember(out)
    return out


def unchanged(self: Any, plans: Any) -> Any:
    """A planner's or reader's plan step that returns its plans as they came."""
    return plans


class _NoItems(tuple):
    """A stand-in's items: none, and no other empty sequence (a global step that gives it any
    other items, none included, changed the plan)."""


_NO_ITEMS = _NoItems()


@dataclasses.dataclass
class StandIn(LoadPlan):
    """Another rank's ``KeyedPlan`` as rank 0 sees it: its key, no items."""

    key: str = ""

    def __reduce__(self) -> tuple[Any, ...]:
        intact = self.items is _NO_ITEMS
        return _arrived, (self.key, self.storage_data, self.planner_data, intact)


def _arrived(key: str, storage_data: Any, planner_data: Any, intact: bool) -> LoadPlan:
    """A ``KeyedPlan`` unpickled: the plan of this process that ``key`` names, with the
    ``storage_data`` and ``planner_data`` that came with it; a ``StandIn`` without items in
    another process, or where the items were changed on the way (``finish_plan`` refuses it)."""
    own = _plans.recall(key) if intact else None
    if own is None:
        return StandIn(_NO_ITEMS, storage_data, planner_data, key=key)
    if own.storage_data is storage_data and own.planner_data is planner_data:
        return own
    return dataclasses.replace(own, storage_data=storage_data, planner_data=planner_data)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with ``weights_only=True``.

    ``before_write(key)``: called before a target tensor is handed out to be written into
    (every write of a load goes through ``resolve_tensor``), from the reading threads.
    ``reader``: the load's reader; where rank 0's global step with it is the identity
    (``_identity``), the local plan is a ``KeyedPlan``, kept under its key until
    ``finish_plan`` or ``forget``."""

    def __init__(
        self, before_write: Callable[[str], None] | None = None, reader: Any = None
    ) -> None:
        super().__init__()
        self._before_write = before_write
        self._keyed = reader is not None and _identity(self, reader)
        self._sent: KeyedPlan | None = None  # (held here: the registry keeps it weakly)

    def create_local_plan(self) -> LoadPlan:
        full = self.metadata
        # DCP's planner sweeps only the saved chunks each shard can overlap (_overlap)
        self.metadata, runs = narrowed(self.state_dict, full) if full else (full, {})
        try:
            plan = restored(super().create_local_plan(), runs)
        finally:
            self.metadata = full
        boxed = {k: v for k, v in self.state_dict.items() if has_strided(v)}
        if boxed:
            items = [it for it in plan.items if it.dest_index.fqn not in boxed]
            for key, v in boxed.items():
                md = self.metadata.state_dict_metadata.get(key) if self.metadata else None
                if isinstance(md, TensorStorageMetadata):
                    items += create_read_items_for_chunk_list(key, md, [chunk_of(v)])
            plan = dataclasses.replace(plan, items=items)
        if not self._keyed:
            return plan
        self.forget()  # (a planner planned twice sends its last plan)
        self._sent = keyed(plan)
        return self._sent

    # The identity, as DCP's (``create_default_global_load_plan``), but ours: rank 0's global
    # step with KeyedPlans stays the identity whatever torch's becomes (``_identity``)
    create_global_plan = unchanged

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        sent, self._sent = self._sent, None
        if sent is None:
            return central_plan
        _plans.forget(sent.key)
        if type(central_plan) is not KeyedPlan or central_plan.key != sent.key:
            raise CheckpointError(
                f"rank 0's global load plan did not hand this rank its own plan back (sent "
                f"{len(sent.items)} read items under a key, got {type(central_plan).__name__} "
                f"with {len(central_plan.items)}): a planner or storage reader that changes "
                "a load's plans on rank 0 must not be given KeyedPlans (SafeLoadPlanner's "
                "reader argument)"
            )
        return central_plan

    def forget(self) -> None:
        """Drop the local plan kept under its key (a load that ended before ``finish_plan``)."""
        if self._sent is not None:
            _plans.forget(self._sent.key)
            self._sent = None

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


def _identity(planner: Any, reader: Any) -> bool:
    """Whether rank 0's global step of a load with ``planner`` and ``reader`` hands every plan
    back as it came, and the reader's local step too: each of those steps is ``unchanged``
    (SafeLoadPlanner's, VerifyingReader's; any other: DCP's round trip, items and all)."""
    steps = (
        getattr(type(planner), "create_global_plan", None),
        getattr(type(reader), "prepare_local_plan", None),
        getattr(type(reader), "prepare_global_plan", None),
    )
    return all(step is unchanged for step in steps)
