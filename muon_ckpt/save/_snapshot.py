"""A save's snapshot: the state of the ``save()`` call, on every rank, as DCP will write it.

The only part of a save that blocks training: the flat FQN-keyed state dict (``state``);
with CPU offload on, the optimizer's offloaded states as views of its pinned CPU buffers
(frozen for an asynchronous save, so steps taken meanwhile do not change them; no copy);
every other tensor copied into reused host buffers (``state.HostStaging``: device tensors on
a side stream; for an asynchronous save also CPU tensors and, deep-copied, Python values).

Every rank takes its part, then the ranks share their outcome (one all-gather, which also
compares the digests of ``extra``): a rank that failed makes every rank raise, before any
starts to write. With ``max_staging_bytes``, the ranks first agree on whether an asynchronous
save fits in it (else the save runs synchronously, handing DCP the live tensors).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

import muon_ckpt._collective as coll
from muon_ckpt._errors import CheckpointError
from muon_ckpt._shards import chunk_of, has_strided
from muon_ckpt._tensors import local_tensor
from muon_ckpt.save._deferred import DeferredCopies
from muon_ckpt.save._global import SavePlanner
from muon_ckpt.state import (
    FlatState,
    HostStaging,
    extra_digests,
    freeze_offloaded,
    offloaded_views,
    structure_records,
)

__all__ = ["SaveSources", "Snapshot", "StagedSavePlanner", "take"]

_log = logging.getLogger("muon_ckpt")


@dataclasses.dataclass
class SaveSources:
    """What a save reads, and the host buffers its copies go to."""

    model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    extra: dict[str, Any]
    rank_extra: dict[str, Any]
    staging: HostStaging
    group: Any
    max_staging_bytes: int | None
    warned: set[str]  # warnings given once per manager
    deferred: bool = False  # async_save="deferred": parameters and states copied after the call
    # Offloaded states are frozen (no copy) unless another save holds the pool's one freeze:
    # then they are copied like any host tensor (a memory save while a write is in flight).
    freeze: bool = True


@dataclasses.dataclass
class Snapshot:
    """The state dict DCP writes (host copies, or the live tensors for a synchronous save),
    whether its write may run in the background, and what gives the optimizer's frozen
    offloaded states back once written."""

    sd: dict[str, Any]
    staging: HostStaging
    background: bool
    release: Callable[[], None] | None = None
    deferred: DeferredCopies | None = None  # copies that finish after save() returns
    readers: int = 1  # the jobs that write it (two for a step due for both tiers)

    def reader_done(self) -> None:
        """A job that wrote it has ended (in the caller's thread); the last one releases it."""
        self.readers -= 1
        if self.readers == 0 and self.release is not None:
            self.release()


def take(src: SaveSources, step: int, background: bool, readers: int = 1) -> Snapshot:
    """The snapshot of this moment on every rank, or the same error on every rank;
    ``readers``: the jobs that write it (each calls ``reader_done`` once it has ended)."""
    error: Exception | None = None
    digests: dict[str, str] = {}
    need = 0
    try:
        flat = FlatState.build(
            src.model, src.optimizer, src.extra, rank_extra=src.rank_extra, rank=coll.rank()
        )
        flat.check_loadable(step)  # a step that commits is one a load can read back
        digests = extra_digests(src.extra)
        views = offloaded_views(src.optimizer)
        keep = flat.host_state_keys(views)
        need = _async_need(src, flat, keep) if background else 0
    except Exception as e:
        error = e
    # No collective between here and the outcome's all-gather but the budget's, which every
    # rank reaches (the configuration is the same everywhere): a rank that fails goes
    # straight to the next gather that all reach.
    limit = src.max_staging_bytes
    if background and limit is not None:
        gathered = coll.all_gather((error is None, need), src.group)
        _raise_failed(step, error, [r for r, (ok, _) in enumerate(gathered) if not ok])
        background = _within_budget(src, max(n for _, n in gathered), limit)
    snap = None
    if error is None:
        try:
            snap = _copy(src, step, flat, views, keep, background, readers)
        except Exception as e:  # every rank must learn of it before any starts to write
            error = e
    outcome = coll.all_gather((error is None, digests), src.group)
    failed = [r for r, (ok, _) in enumerate(outcome) if not ok]
    differs = None if failed else _differing_extra(step, [d for _, d in outcome])
    if snap is None or failed or differs:
        if snap is not None:
            src.staging.finish()
            if snap.release is not None:
                snap.release()
        if differs is not None:
            raise differs
        _raise_failed(step, error, failed)
        raise AssertionError("a snapshot that failed without an error")
    return snap


def _copy(
    src: SaveSources,
    step: int,
    flat: FlatState,
    views: dict[int, torch.Tensor],
    keep: set[str],
    background: bool,
    readers: int,
) -> Snapshot:
    """The copies of this moment: offloaded states frozen (asynchronous) or viewed in place,
    every other tensor into the host buffers (all of them for an asynchronous save, device
    tensors for a synchronous one unless over ``max_staging_bytes``)."""
    release, deferred = None, None
    try:
        if background and keep and not src.freeze:
            keep = set()  # copied into the host buffers: the pool's freeze is taken
        if background and keep:
            frozen = freeze_offloaded(src.optimizer)  # these values while training goes on
            views, release = frozen.views, frozen.release
        flat.use_host_states(views)
        if background:
            flat.detach_objects()
        staged = flat.sd
        limit = src.max_staging_bytes
        defer = flat.deferrable_keys() - keep if background and src.deferred else set()
        if background or limit is None or _fits(src.staging, flat.sd, keep, limit):
            staged = src.staging.stage(flat.sd, copy_cpu=background, keep=keep, defer=defer)
        if defer:  # the next step waits for these copies (DeferredCopies.before_step)
            deferred = DeferredCopies(step, src.staging, {k: flat.sd[k] for k in defer})
        elif background:
            src.staging.finish()  # every copy has landed: training may change anything
    except BaseException:
        try:
            src.staging.finish()
        finally:
            if release is not None:
                release()
        raise
    return Snapshot(staged, src.staging, background, release, deferred, readers)


def _fits(staging: HostStaging, sd: dict[str, Any], keep: set[str], limit: int) -> bool:
    return staging.bytes_needed(sd, copy_cpu=False, keep=keep) <= limit


def _async_need(src: SaveSources, flat: FlatState, keep: set[str]) -> int:
    """Host bytes an asynchronous save of ``flat`` holds (0 when there is no bound)."""
    if src.max_staging_bytes is None:
        return 0
    need = src.staging.bytes_needed(flat.sd, copy_cpu=True, keep=keep)
    return need + sum(_nbytes(flat.sd[k]) for k in keep)  # the pool's second buffer


def _within_budget(src: SaveSources, need: int, limit: int) -> bool:
    if need <= limit:
        return True
    if "async budget" not in src.warned:
        _log.warning(
            "an asynchronous save of this state needs %d bytes of host memory, more than "
            "max_staging_bytes=%d: saves run synchronously, without staging copies",
            need,
            limit,
        )
        src.warned.add("async budget")
    return False


def _nbytes(t: torch.Tensor) -> int:
    t = local_tensor(t)
    return t.numel() * t.element_size()


def _raise_failed(step: int, error: Exception | None, failed: list[int]) -> None:
    if isinstance(error, CheckpointError):
        raise error
    if error is not None:  # (an extra's state_dict(), the optimizer's offload snapshot)
        raise CheckpointError(
            f"saving step {step}: taking the snapshot failed: {type(error).__name__}: "
            f"{error}; nothing was written and every committed step is intact"
        ) from error
    if failed:
        raise CheckpointError(
            f"saving step {step}: taking the snapshot failed on rank(s) {failed} (their own "
            "error says why); nothing was written and every committed step is intact"
        )


def _differing_extra(step: int, digests: list[dict[str, str]]) -> CheckpointError | None:
    """The error for ``extra`` state that is not the same on every rank, or None."""
    names = sorted({n for d in digests for n in d})
    for name in names:
        groups: dict[str | None, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d.get(name), []).append(r)
        if len(groups) > 1:
            ranks = " vs ".join(str(g) for g in groups.values())
            return CheckpointError(
                f"saving step {step}: extra[{name!r}] differs between ranks {ranks}; extra is "
                "saved once for all ranks, so it must be the same everywhere: put per-rank "
                "state (a data position per rank, RNG state) in rank_extra. Nothing was written."
            )
    return None


class StagedSavePlanner(SavePlanner):
    """The save planner (``_global.SavePlanner``: DCP's, its plans sent as columns and its
    global plan linear in ranks); a
    writer thread resolving an item first waits for its copy. A DTensor's chunk is where its shard lies (``shard_box``: torch misreads uneven strided
    shards, which then overlap and fail the plan)."""

    def __init__(self, staging: HostStaging) -> None:
        super().__init__()
        self._staging = staging

    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        # Beside DCP's map of each key's path, what that map loses: the original dict keys
        # and containers of nested values, so a load hands back what was saved.
        self.mappings.update(structure_records(state_dict, self.mappings))

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if any(has_strided(v) for v in self.state_dict.values()):
            items = [_boxed(it, self.state_dict[it.index.fqn]) for it in plan.items]
            plan = self.plan = dataclasses.replace(plan, items=items)
        return plan

    def resolve_data(self, write_item: Any) -> Any:
        self._staging.wait(write_item.index.fqn)
        return super().resolve_data(write_item)


def _boxed(item: WriteItem, value: Any) -> WriteItem:
    """``item`` of a DTensor with a strided shard, its chunk where the shard lies."""
    if not has_strided(value) or item.tensor_data is None:
        return item
    chunk = chunk_of(value)
    data = dataclasses.replace(item.tensor_data, chunk=chunk)
    return dataclasses.replace(
        item, index=MetadataIndex(item.index.fqn, chunk.offsets), tensor_data=data
    )
