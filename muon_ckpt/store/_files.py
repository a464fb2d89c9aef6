"""A step's files against its manifest: each there at its size and a regular file, and the DCP
metadata checksummed, parsed and checked (``_metadata``) before anything else is read.
"""

from __future__ import annotations

from torch.distributed.checkpoint.metadata import Metadata

from muon_ckpt._errors import CheckpointCorruptError
from muon_ckpt._gcpause import paused_gc
from muon_ckpt.store._checksum import Checksum
from muon_ckpt.store._data import listing
from muon_ckpt.store._entry import FileEntry
from muon_ckpt.store._layout import MANIFEST, METADATA, Manifest, data_ref
from muon_ckpt.store._metadata import check_paths, check_ranges, parse_metadata
from muon_ckpt.store._storage import Storage

__all__ = ["check_files", "check_written"]


def check_written(
    storage: Storage, name: str, files: dict[str, FileEntry], step: int, data: str | None
) -> None:
    """Before a commit: every file a save recorded (``files``, in step directory ``name``;
    its own data directory ``data``) is on the storage at its size, the run's data it refers
    to included, and DCP wrote its metadata. A CheckpointCorruptError otherwise."""
    listed = listing(storage, (name,), set(files))
    for fname, entry in sorted(files.items()):
        got = listed.get(fname, {}).get("size")
        if got is None or int(got) != entry.size:
            ours = (ref := data_ref(fname)) is None or ref[0] == data
            raise CheckpointCorruptError(
                f"{storage.url_of(name, fname)}: {'written' if ours else 'referred to'} with "
                f"{entry.size} bytes but the storage reports {got}; step {step} is NOT "
                "committed (the next save writes again what an earlier save's file held)"
            )
    if METADATA not in files:
        raise CheckpointCorruptError(
            f"{storage.url_of(name)}: DCP wrote no {METADATA}; step {step} is NOT committed"
        )


def check_files(
    storage: Storage, parts: tuple[str, ...], m: Manifest, tiles: bool = True
) -> Metadata:
    """Every file of manifest ``m`` present at its size; the DCP metadata checksummed and
    parsed (``tiles``: chunks must tile each tensor). Raises CheckpointCorruptError naming
    the first bad file."""
    infos = listing(storage, parts, set(m.files))
    for fname, entry in sorted(m.files.items()):
        info = infos.get(fname)
        got = None if info is None else int(info.get("size") or 0)
        if info is not None and (info.get("type") != "file" or info.get("islink")):
            kind = "a symbolic link" if info.get("islink") else f"of type {info.get('type')}"
            raise CheckpointCorruptError(
                f"{storage.url_of(*parts, fname)}: is {kind}, not a regular file; a "
                "checkpoint holds regular files only. Load another step or delete this one"
            )
        if got is None:
            raise CheckpointCorruptError(
                f"{storage.url_of(*parts, fname)}: listed in the manifest ({entry.size} bytes) "
                "but missing; load another step or restore the file"
            )
        if got != entry.size:
            raise CheckpointCorruptError(
                f"{storage.url_of(*parts, fname)}: {got} bytes, the manifest says "
                f"{entry.size} (truncated or overwritten); load another step or restore the file"
            )
    where = storage.url_of(*parts, METADATA)
    md_entry = m.files.get(METADATA)
    if md_entry is None:
        raise CheckpointCorruptError(f"{storage.url_of(*parts, MANIFEST)}: lists no {METADATA}")
    data = storage.read_bytes(*parts, METADATA, limit=md_entry.size)
    got = Checksum.like(md_entry, where)
    got.update(data)
    if len(data) != md_entry.size or got.hexdigest() != md_entry.digest:
        raise CheckpointCorruptError(
            f"{where}: {md_entry.algorithm} {got.hexdigest()} ({len(data)} bytes), the "
            f"manifest says {md_entry.digest} ({md_entry.size} bytes); load another step"
        )
    with paused_gc():  # (the metadata's millions of objects: see parse_metadata)
        md = parse_metadata(data, where, tiles)
        check_paths(md, set(m.files), where)
        check_ranges(md, {n: e.size for n, e in m.files.items()}, where)
    return md
