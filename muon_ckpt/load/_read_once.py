"""Read once, send to the ranks that need it: stored items that several ranks load whole.

Replicated state (DTensors with ``Replicate`` placements, plain tensors on every rank as with
DDP, ``extra``) is stored once (DCP's save plan writes each replicated item once) but loaded
by every rank: N ranks would read it N times from storage. Inside
``VerifyingReader.read_data`` (every rank calls it at the same point of ``dcp.load``):

1. ``plan_shared``: the ranks all-gather which stored items they need, and whether whole. An
   item that two or more ranks need whole is *shared*: it is read only by the rank that owns
   its file (the rank that checks that file whole, ``VerifyingReader.owner``), in its pass
   over the file and through the same checksum, into a buffer; no other rank reads it. Every
   other item is read as before by the ranks that need it (a resharded slice stays a ranged
   read of the rows a rank needs);
2. ``agree``: the ranks all-gather the outcome of their reads, so that a failure anywhere
   (a corrupt file, storage errors) fails every rank with the same kind of error before
   anything is sent;
3. ``distribute``: each shared item goes from its reader to the ranks that need it over the
   manager's gloo group, packed into messages of at most ``MESSAGE_BYTES``: a broadcast when
   every rank takes part, point-to-point sends otherwise, ``WINDOW`` messages in flight while
   an earlier one is loaded. Each receiver loads the item from memory into its targets
   (``_item_bytes``: no ``torch.load``).

When it pays (``ManagerConfig.read_once``): for remote storage, and for ranks on several
hosts. On one host the page cache already serves every rank's read of a local file after the
first, faster than gloo moves the bytes (1 GiB replicated on 4 ranks of the H200 host: see
docs/benchmarks.md).

Each stored byte is read from storage once per group (``VerifyingReader.bytes_read`` counts
them). Verification is unchanged: the reader checks the bytes it sends against the manifest
(whole file or per chunk) before ``agree``; the bytes travel over the process group's TCP
connections. Memory: a reader holds the shared items of the files it owns until they are sent
(about the replicated bytes / world size per rank); a receiver up to WINDOW + 1 messages.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import ReadItem

import muon_ckpt._collective as coll
from muon_ckpt._errors import CheckpointCorruptError, CheckpointError, CheckpointStorageError
from muon_ckpt._tensors import tensor_bytes
from muon_ckpt.load._declared import StoredChunks
from muon_ckpt.load._item_bytes import load_blob
from muon_ckpt.store import is_storage_failure

__all__ = ["MESSAGE_BYTES", "SharePlan", "agree", "distribute", "failure_kind", "plan_shared"]

MESSAGE_BYTES = 64 << 20  # largest message packing several shared items (a larger one alone)
WINDOW = 3  # messages in flight while an earlier one is loaded

Key = tuple[str, int, int]  # a stored item: file, offset, length


@dataclass(frozen=True)
class SharedItem:
    name: str
    offset: int
    length: int
    reader: int  # the rank that reads it from storage
    ranks: tuple[int, ...]  # the ranks that load it

    @property
    def key(self) -> Key:
        return (self.name, self.offset, self.length)


@dataclass
class SharePlan:
    items: list[ReadItem]  # this rank's read items that it still reads itself
    messages: list[list[SharedItem]]  # every rank's schedule, in the same order
    wanted: dict[Key, list[ReadItem]]  # this rank's read items served by shared items
    # what this rank reads for the others: file -> offset -> buffer; one tensor per message
    captures: dict[str, dict[int, memoryview]] = field(default_factory=dict)
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)  # message # -> its bytes

    @property
    def shared_bytes(self) -> int:
        return sum(s.length for m in self.messages for s in m)


def plan_shared(
    items: list[ReadItem],
    storage_data: dict[Any, Any],
    whole_item: Callable[[ReadItem], bool],
    owner: Callable[[str], int],
    rank: int,
    group: Any,
) -> SharePlan:
    """Collective: which stored items are shared, who reads each, and this rank's part."""
    by_key: dict[Key, list[ReadItem]] = {}
    whole: dict[Key, bool] = {}
    kept: list[ReadItem] = []
    for item in items:
        info = storage_data[item.storage_index]
        key = (info.relative_path, info.offset, info.length)
        by_key.setdefault(key, []).append(item)
        whole[key] = whole.get(key, False) or whole_item(item)
    needs = coll.all_gather(sorted(whole.items()), group)
    ranks: dict[Key, list[int]] = {}
    wholes: dict[Key, int] = {}
    for r, got in enumerate(needs):
        for key, w in got:
            ranks.setdefault(key, []).append(r)
            wholes[key] = wholes.get(key, 0) + int(w)
    shared = sorted(
        (
            SharedItem(*key, owner(key[0]), tuple(rs))
            for key, rs in ranks.items()
            if wholes[key] > 1
        ),
        key=lambda s: (s.reader, s.ranks, s.name, s.offset),
    )
    plan = SharePlan(items=kept, messages=_pack(shared), wanted={})
    keys = {s.key for s in shared}
    for key, reqs in by_key.items():
        if key in keys:
            plan.wanted[key] = reqs
        else:
            plan.items.extend(reqs)
    for i, msg in enumerate(plan.messages):
        if msg[0].reader != rank:
            continue
        buf = torch.empty(sum(s.length for s in msg), dtype=torch.uint8)
        plan.buffers[i] = buf
        view, at = tensor_bytes(buf), 0
        for s in msg:
            plan.captures.setdefault(s.name, {})[s.offset] = view[at : at + s.length]
            at += s.length
    return plan


def _pack(shared: list[SharedItem]) -> list[list[SharedItem]]:
    """Consecutive items of one reader and the same ranks, up to MESSAGE_BYTES a message."""
    out: list[list[SharedItem]] = []
    size = 0
    for s in shared:
        last = out[-1] if out else None
        if (
            last is not None
            and (last[0].reader, last[0].ranks) == (s.reader, s.ranks)
            and size + s.length <= MESSAGE_BYTES
        ):
            last.append(s)
            size += s.length
        else:
            out.append([s])
            size = s.length
    return out


def failure_kind(e: BaseException) -> type[CheckpointError]:
    """The class another rank raises for this rank's failure ``e`` (bytes, storage, other)."""
    if isinstance(e, (CheckpointCorruptError, CheckpointStorageError)):
        return type(e)
    storage = not isinstance(e, CheckpointError) and is_storage_failure(e)
    return CheckpointStorageError if storage else CheckpointError


def agree(error: BaseException | None, rank: int, group: Any) -> None:
    """Collective: raise on every rank if the reads failed on any (this rank's own error as
    it is; another rank's as the same kind of error, ``failure_kind``, naming that rank)."""
    mine = None
    if error is not None:
        mine = (failure_kind(error), f"{type(error).__name__}: {error}")
    outcome = coll.all_gather(mine, group)
    if error is not None:
        raise error
    for r, got in enumerate(outcome):
        if got is not None:
            kind, text = got
            raise kind(f"rank {r} could not read its part of the checkpoint: {text}")


def distribute(
    plan: SharePlan,
    planner: Any,
    where: Callable[[str], str],
    chunks: StoredChunks,
    rank: int,
    world: int,
    group: Any,
) -> None:
    """Collective: send every message from its reader to the ranks that load it, and load
    the items this rank wants. Up to ``WINDOW`` messages are in flight (asynchronous sends)
    while this rank loads an earlier one. A failure to load (a shape mismatch) is raised
    after every message has been sent, so that no rank is left waiting."""
    error: list[BaseException] = []
    flight: collections.deque[tuple[list[SharedItem], torch.Tensor, list[Any]]] = (
        collections.deque()
    )

    def land() -> None:
        msg, buf, works = flight.popleft()
        with coll.communicating(f"sending shared items from rank {msg[0].reader}"):
            for w in works:
                w.wait()
        if rank not in msg[0].ranks or error:
            return
        view, at = tensor_bytes(buf), 0
        for s in msg:
            data = view[at : at + s.length]
            at += s.length
            try:
                load_blob(data, plan.wanted[s.key], planner, where(s.name), chunks)
            except BaseException as e:  # keep sending: the others wait for the messages
                error.append(e)
                return

    for i, msg in enumerate(plan.messages):
        first = msg[0]
        everyone = len(set(first.ranks) | {first.reader}) == world
        if rank == first.reader:
            buf = plan.buffers.pop(i)
        elif rank in first.ranks or everyone:
            buf = torch.empty(sum(s.length for s in msg), dtype=torch.uint8)
        else:
            continue  # neither reads nor loads it, and it goes point to point
        flight.append((msg, buf, _send(buf, first, everyone, group)))
        if len(flight) > WINDOW:
            land()
    while flight:
        land()
    if error:
        raise error[0]


def _send(buf: torch.Tensor, s: SharedItem, everyone: bool, group: Any) -> list[Any]:
    """Start sending ``buf`` from ``s.reader`` to ``s.ranks`` (a broadcast when every rank
    takes part); the works to wait for."""
    peers = [r for r in s.ranks if r != s.reader]
    if not peers:
        return []
    with coll.communicating(f"sending shared items from rank {s.reader}"):
        if everyone:
            return [dist.broadcast(buf, src=s.reader, group=group, async_op=True)]
        if dist.get_rank() == s.reader:
            return [dist.isend(buf, dst=r, group=group) for r in peers]
        return [dist.irecv(buf, src=s.reader, group=group)]
