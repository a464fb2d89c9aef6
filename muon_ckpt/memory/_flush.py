"""``close()``'s flush (``MemoryOptions.flush``): the newest memory step committed to the url
with the bytes the tier holds of it, or nothing -- never the live state, which may have moved
on (a data position or RNG advanced by gradient accumulation, EMA weights swapped in).

Every rank checks its own part of that save: its manifest names the step, the save, the rank
and the world size, and every file is read and compared with the manifest's CRC32C. One
all-gather: when any rank's part is missing or damaged, nothing is written (a WARNING names
the ranks). Otherwise the url's save copies the parts (``copy_in``: the same begin, lease,
line, commit and retention as the save of a snapshot): each rank copies its part's data files
item by item (checked again on the way, named as DCP names a rank's files), referring to a
tensor the url holds unchanged instead of copying it, by the digest the part records
(``save.StepWriter.copy_file``, the same choice and checks as a snapshot's save); rank 0
writes the step's ``.metadata`` from every part's (each tensor's chunks from the ranks that
hold them; an item several ranks hold, from the lowest of them), checked as every load checks
it before the commit. A part is stored uncompressed: so is what the flush writes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

import muon_ckpt._collective as coll
from muon_ckpt._errors import CheckpointCorruptError, CheckpointError, handled, raise_interrupt
from muon_ckpt.memory._dirs import own_dirname
from muon_ckpt.memory._restore import check_part
from muon_ckpt.memory._tier import MemoryTier
from muon_ckpt.save import StepWriter
from muon_ckpt.state import ABOUT
from muon_ckpt.store import METADATA, FileEntry, Manifest, Storage, open_regular
from muon_ckpt.store.checksums import file_checksum
from muon_ckpt.store.dcp import parse_metadata

__all__ = ["PartCopy", "flush"]

_log = logging.getLogger("muon_ckpt")


def flush(
    tier: MemoryTier,
    step: int,
    save_id: str,
    calls: coll.Calls,
    url_steps: Callable[[], list[int]],
    copy_in: Callable[[int, PartCopy], None],
    url: str,
) -> None:
    """Commit memory step ``step`` (the parts of save ``save_id``) to ``url`` when the url's
    newest step (``url_steps``, rank 0) is older, with every rank's part as the tier holds it
    (``copy_in``); else nothing."""
    calls.join(f"close(flush step={step})")
    group = calls.group
    steps = coll.on_rank0(url_steps, group)
    if steps and steps[-1] >= step:
        return
    part = PartCopy.checked(tier, step, save_id)
    problems = coll.all_gather(part if isinstance(part, str) else None, group)
    bad = {r: why for r, why in enumerate(problems) if why is not None}
    if bad or isinstance(part, str):
        if coll.rank() == 0:
            _log.warning(
                "close(): memory-tier step %d is not saved to %s (nothing was written): %s",
                step,
                url,
                "; ".join(f"rank {r}'s part: {why}" for r, why in bad.items()),
            )
        return
    copy_in(step, part)
    if coll.rank() == 0:
        _log.info("close(): saved memory-tier step %d to %s (MemoryOptions.flush)", step, url)


@dataclasses.dataclass
class _Share:
    """What rank 0 needs of one rank's part to write the step's ``.metadata``."""

    state: dict[str, Any]  # the part's state_dict_metadata
    planner: Any
    items: dict[Any, Any]  # MetadataIndex -> _StorageInfo, named as the url's files


class PartCopy:
    """This rank's part of a memory step, as the url's save copies it (``save.Prebuilt``)."""

    def __init__(self, run_dir: str, rel: str, m: Manifest, md: Metadata) -> None:
        self.run_dir, self.rel, self.m, self.md = run_dir, rel, m, md
        self.keys = len(md.state_dict_metadata)
        self.about = {k: m.extra[k] for k in ABOUT if k in m.extra}  # (rank 0's commits)

    @classmethod
    def checked(cls, tier: MemoryTier, step: int, save_id: str) -> PartCopy | str:
        """This rank's part of save ``save_id`` of ``step``, every byte checked against its
        manifest; or why it cannot be flushed."""
        rank, world = coll.rank(), coll.world_size()
        rel = own_dirname(step, rank)
        since = handled()
        why = tier.readable()
        if why is not None:
            return why
        checked = check_part(Storage(tier.run_dir), rel, step, save_id, since)
        if isinstance(checked, str):
            return checked
        m, md = checked
        if m.world_size != world or m.extra["memory"].get("rank") != rank:
            return f"{rel} is rank {m.extra['memory'].get('rank')}'s of {m.world_size} rank(s)"
        part = cls(tier.run_dir, rel, m, md)
        try:
            for name, entry in part.data_files():
                part._verify(name, entry)
        except (CheckpointError, OSError) as e:
            raise_interrupt(e, since)
            return str(e)
        return part

    def data_files(self) -> list[tuple[str, FileEntry]]:
        return sorted((n, e) for n, e in self.m.files.items() if n != METADATA)

    def _where(self, name: str) -> str:
        return os.path.join(self.run_dir, self.rel, name)

    def _open(self, name: str) -> Any:
        where = self._where(name)
        return os.fdopen(open_regular(where, where), "rb")

    def _verify(self, name: str, entry: FileEntry) -> None:
        with self._open(name) as f:
            got = file_checksum(f, entry, where=self._where(name))
        if got.size != entry.size or got.hexdigest() != entry.digest:
            raise CheckpointCorruptError(
                f"{self._where(name)}: {got.size} bytes with {entry.algorithm} "
                f"{got.hexdigest()}, its manifest says {entry.size} bytes with {entry.digest}"
            )

    def copy(self, writer: StepWriter) -> _Share:
        """Every data file of the part copied through ``writer`` as this rank's
        ``__<rank>_<i>.distcp``, each item written or referred to; the part's metadata with
        the items where they now are."""
        files = dict(self.data_files())
        by_file: dict[str, dict[Any, Any]] = {}
        for index, info in (self.md.storage_data or {}).items():
            if info.relative_path not in files:
                raise CheckpointCorruptError(
                    f"{self._where(METADATA)}: an item is in {info.relative_path!r}, which the "
                    "part's manifest does not list"
                )
            by_file.setdefault(info.relative_path, {})[index] = info
        writer.prepare(self.md.storage_data or {})
        rank = coll.rank()
        items: dict[Any, Any] = {}
        for i, (name, entry) in enumerate(sorted(files.items())):
            with self._open(name) as f:
                new = f"__{rank}_{i}{DEFAULT_SUFFIX}"
                where = self._where(name)
                items.update(writer.copy_file(new, f, entry, where, by_file.get(name, {})))
        return _Share(dict(self.md.state_dict_metadata), self.md.planner_data, items)

    def metadata(self, shares: list[_Share]) -> tuple[Metadata, list[list[WriteResult]]]:
        """Rank 0: the step's metadata from every rank's share, checked as a load checks it
        (chunks that tile every tensor), and each rank's write results."""
        return merged(shares)


def merged(shares: list[_Share]) -> tuple[Metadata, list[list[WriteResult]]]:
    """One step's DCP metadata from the parts of its ranks: every tensor with the chunks of
    all of them (a chunk two ranks hold, a replica, once), every object once; each item from
    the lowest rank that stored it."""
    state: dict[str, Any] = {}
    planner: dict[str, Any] = {}
    taken: set[tuple[str, Any]] = set()
    results: list[list[WriteResult]] = []
    for share in shares:
        for key, meta in share.state.items():
            have = state.get(key)
            if have is None:
                if isinstance(meta, TensorStorageMetadata):
                    meta = dataclasses.replace(meta, chunks=list(meta.chunks))
                state[key] = meta
            elif isinstance(have, TensorStorageMetadata) and isinstance(
                meta, TensorStorageMetadata
            ):
                if (have.size, have.properties.dtype) != (meta.size, meta.properties.dtype):
                    raise CheckpointCorruptError(
                        f"the memory tier's parts disagree on {key!r}: {tuple(have.size)} "
                        f"{have.properties.dtype} against {tuple(meta.size)} "
                        f"{meta.properties.dtype}; nothing was committed"
                    )
                at = {tuple(c.offsets) for c in have.chunks}
                have.chunks.extend(c for c in meta.chunks if tuple(c.offsets) not in at)
        if isinstance(share.planner, dict):
            planner.update(share.planner)
        mine = []
        for index, info in share.items.items():
            key = (index.fqn, None if index.offset is None else tuple(index.offset))
            if key not in taken:
                taken.add(key)
                mine.append(WriteResult(index=index, size_in_bytes=info.length, storage_data=info))
        results.append(mine)
    md = Metadata(state_dict_metadata=state, planner_data=planner)
    md.storage_data = {r.index: r.storage_data for rs in results for r in rs}
    parse_metadata(pickle.dumps(md), "the metadata of the memory tier's parts")
    return md, results
