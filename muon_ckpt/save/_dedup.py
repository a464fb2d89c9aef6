"""Unchanged tensors are not written again: a save refers to where the run holds them.

"Unchanged" is decided by the bytes, never by how the tensor was reached: ``requires_grad``,
the autograd version counter (blind to writes through ``.data``) and a 32-bit checksum all
let a changed tensor pass as unchanged. A stored tensor item is identified by its DCP index
(key and chunk offsets) and the SHA-256 of its dtype, shape and bytes (``tensor_digest``),
recorded in the manifest entry of the file that stores it (``FileEntry.sha256``, by offset).
A save refers to a stored item only when the item of the same index in its base (the step
the run continues from: the last one this manager committed, or the one it loaded) has the
same digest; otherwise it writes the tensor (``Dedup.refer``: the one choice, for a tensor
a writer thread writes and for an item the flush at ``close()`` copies from a memory-tier
part, whose manifest records the digests too). SHA-256 (``hashlib``, which releases the GIL)
runs in the writer threads, on the snapshot's host copies, at about 1.8 GiB/s per thread
with SHA extensions (docs/benchmarks.md): a save that finds nothing unchanged pays that
next to its write; one that finds a tensor unchanged skips its write, its CRC and its
read-back.

Tensors under ``MIN_REF_BYTES`` and non-tensor values are always written: a reference would
save less than the manifest's record of it.

What it refers to must still be there as it was written: before a save writes, the files
it would refer to are checked (``store.check_stored``: sizes, and with ``confirm="checksum"``
their checksums, each file read back once per process while the storage reports no change
to it), and the tensors of a file that is missing or damaged are written again, from the
saved state, with a WARNING. Nor does a save refer to data written ``dedup_bound`` or more
saves before it (``dedup_max_age``, at most ``keep_last - 1``; by the generations of the
commits, ``DedupBase.gens``): such a tensor is written again, so the damage of one file
reaches at most that many steps, never every step retention keeps.

Order: a tensor the base holds is hashed before it is written, unless it changed at the save
that recorded it (then it most likely changed again); that one, and a tensor the base does
not hold (the first save, a new key, another sharding), is written while its digest, for the
next save, is taken on another thread. So a save where everything changes does not wait for
the hash before each write, and a tensor that stops changing is written once more than
needed, then referred to from the save after.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from muon_ckpt.store import FileEntry, data_ref

__all__ = ["MIN_REF_BYTES", "Dedup", "DedupBase", "Stored", "tensor_digest"]

MIN_REF_BYTES = 16 << 10

_log = logging.getLogger("muon_ckpt")


def tensor_digest(t: torch.Tensor) -> str | None:
    """SHA-256 (hex) of ``t``'s dtype, shape and bytes in row-major order; None for a tensor
    whose bytes have no plain view (quantized, sparse, not on the CPU): always written."""
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
        return None
    c = t.detach().resolve_conj().resolve_neg().contiguous()
    try:
        raw = c.reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):  # a dtype numpy cannot view as bytes
        return None
    h = hashlib.sha256(f"{c.dtype}|{tuple(c.shape)}|".encode())
    h.update(raw.data)  # (large buffers: the GIL is released)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Stored:
    """Where a tensor item is stored: ``name`` (``../data/<dir>/<file>``), its bytes there,
    and the digest of the tensor it holds; ``changed``: whether it differed from its base at
    the save that recorded it (None: not known, e.g. after a load); ``how``: its DCP
    storage transforms (``store.codec.DESCRIPTOR`` when compressed)."""

    name: str
    offset: int
    length: int
    sha256: str
    changed: bool | None = None
    how: tuple[str, ...] = ()

    def where(self) -> tuple[str, int, int, tuple[str, ...]]:
        """What DCP's metadata says of the item: file, offset, length, transforms."""
        return self.name, self.offset, self.length, self.how


@dataclasses.dataclass
class DedupBase:
    """What the run holds, for one rank's next save: the stored items of commit ``key``
    ((step, gen)) by DCP index, the manifest entries of their files, and the generation of
    the save that wrote each of their data directories (``gens``)."""

    key: tuple[int, int]
    items: dict[MetadataIndex, Stored]
    files: dict[str, FileEntry]
    gens: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of_step(
        cls,
        step: int,
        gen: int,
        files: dict[str, FileEntry],
        metadata: Any,
        gens: dict[str, int] | None = None,
    ) -> DedupBase:
        """The base of a committed step (a load's decision): its tensor items whose file's
        entry records their digest (format 3; a step of format 2 has none); ``gens``: its
        manifest's ``data_gens`` (a data directory it does not name is not referred to)."""
        items = {}
        for index, info in (metadata.storage_data or {}).items():
            name = info.relative_path
            entry = files.get(name)
            if entry is None or entry.sha256 is None or data_ref(name) is None:
                continue
            digest = entry.sha256.get(info.offset)
            if digest is not None:
                how = tuple(info.transform_descriptors or ())
                items[index] = Stored(name, info.offset, info.length, digest, None, how)
        used = {s.name for s in items.values()}
        return cls((step, gen), items, {n: files[n] for n in used}, dict(gens or {}))


class Dedup:
    """One rank's refer-or-write choice in one save (thread-safe), for the tensors its writer
    threads write and for the items a save copies from files written elsewhere (the memory
    tier's parts): a tensor whose item of the same DCP index in ``base`` is in a file the save
    may refer to (``referable``) and has the same digest is referred to; every other is
    written. What was chosen is recorded for the next save's base."""

    def __init__(self, base: DedupBase | None, *, hashes: bool) -> None:
        self._base = base
        self._hashes = hashes  # whether tensors' digests are taken (dedup, or recorded only)
        self.referable: set[str] = set()  # the base's files this save may refer to
        self._lock = threading.Lock()
        self.items: dict[MetadataIndex, Stored] = {}
        self.refs: dict[str, FileEntry] = {}  # files of earlier saves this step refers to
        self.referred_bytes = 0  # bytes of items not written because they were unchanged

    def prepare(
        self,
        wanted: Iterable[MetadataIndex],
        gen: int,
        max_age: int,
        check: Callable[[dict[str, FileEntry]], dict[str, str]],
        where: str,
    ) -> None:
        """Before anything is written, the base's files a save into ``where`` (generation
        ``gen``) may refer to for the items ``wanted`` (its own, where unchanged): written
        fewer than ``max_age`` saves before it, and found as recorded by ``check`` (name ->
        what the storage holds instead); the tensors of any other file are written again (a
        WARNING names a damaged file)."""
        base = self._base
        if base is None:
            return
        young = {d for d, g in base.gens.items() if 0 <= gen - g < max_age}
        held = [s for i in wanted if (s := base.items.get(i)) is not None and s.changed is not True]
        names = {s.name for s in held if (ref := data_ref(s.name)) and ref[0] in young}
        bad = check({n: base.files[n] for n in sorted(names)})
        for name, what in sorted(bad.items()):
            _log.warning(
                "%s: unchanged tensors would refer to %s of an earlier save, where the "
                "storage now holds %s: they are written again from the saved state",
                where,
                name,
                what,
            )
        self.referable = names - set(bad)

    def hashes(self, nbytes: int) -> bool:
        """Whether a tensor of ``nbytes`` has its digest taken (smaller ones are always
        written: a reference would save less than the manifest's record of it)."""
        return self._hashes and nbytes >= MIN_REF_BYTES

    def _held(self, index: MetadataIndex) -> Stored | None:
        return None if self._base is None else self._base.items.get(index)

    def hash_first(self, index: MetadataIndex) -> bool:
        """Whether the tensor's digest decides before it is written: the base holds its index
        in a file the save may refer to."""
        held = self._held(index)
        return held is not None and held.name in self.referable

    def refer(self, index: MetadataIndex, digest: str | None) -> Stored | None:
        """Where the run holds the tensor of ``index`` and ``digest`` unchanged (recorded as
        referred to), or None: write it."""
        base = self._base
        held = None if base is None else base.items.get(index)
        if base is None or held is None or held.name not in self.referable:
            return None
        if digest is None or digest != held.sha256:
            return None
        held = dataclasses.replace(held, changed=False)
        with self._lock:
            self.items[index] = held
            self.refs[held.name] = base.files[held.name]
            self.referred_bytes += held.length
        return held

    def wrote(self, index: MetadataIndex, s: Stored) -> None:
        """The tensor of ``index`` was written as ``s`` (with its digest): recorded, with
        whether it changed since the base."""
        held = self._held(index)
        changed = None if held is None else s.sha256 != held.sha256
        with self._lock:
            self.items[index] = dataclasses.replace(s, changed=changed)

    def next_base(
        self, key: tuple[int, int], own: dict[str, FileEntry], gens: dict[str, int]
    ) -> DedupBase:
        """The base for the next save, once this one committed as ``key``; ``own``: the
        entries of the files it wrote (with their digests); ``gens``: the generation of each
        data directory it lists."""
        files = {**self.refs, **{n: e for n, e in own.items() if data_ref(n) is not None}}
        return DedupBase(key, dict(self.items), files, dict(gens))

    def gens(self, own: str | None, gen: int) -> dict[str, int]:
        """The generation of each data directory this rank's step lists: ``own`` (written
        now, at ``gen``) and those of the files it refers to (from the base)."""
        dirs = {ref[0] for n in self.refs if (ref := data_ref(n)) is not None}
        base = self._base
        out = {d: base.gens[d] for d in dirs if base is not None and d in base.gens}
        return out | ({own: gen} if own is not None else {})
