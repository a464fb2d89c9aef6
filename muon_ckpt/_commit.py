"""Commit protocol on a Storage: which steps exist, the manifest, leftovers and retention.

A step exists once ``step-XXXXXXXX/manifest.json`` exists. The manifest is written last, by
rank 0, after every rank's files are closed (and fsynced, locally); it lists every file with
its size and crc32. Deleting a step removes the manifest FIRST, so a crash while deleting
leaves an uncommitted directory, never a committed step with missing files. Everything here
runs on rank 0 only; the manager broadcasts the outcome.
"""

from __future__ import annotations

import datetime
import zlib
from typing import Any

import torch

from muon_ckpt._dcp import parse_metadata
from muon_ckpt._errors import CheckpointCorruptError, CheckpointNotFoundError
from muon_ckpt._layout import MANIFEST, FileEntry, Manifest, parse_step_dirname, step_dirname
from muon_ckpt._storage import Storage

__all__ = [
    "apply_retention",
    "committed_steps",
    "delete_step",
    "not_found",
    "read_checked_manifest",
    "remove_leftovers",
    "write_manifest",
]

DCP_METADATA = ".metadata"


def _step_dirs(storage: Storage) -> dict[int, str]:
    out = {}
    for name in storage.listdir():
        step = parse_step_dirname(name)
        if step is not None:
            out[step] = name
    return out


def committed_steps(storage: Storage) -> list[int]:
    """Sorted steps whose manifest exists (the manifest's contents are checked at load)."""
    return sorted(s for s, d in _step_dirs(storage).items() if storage.exists(d, MANIFEST))


def not_found(storage: Storage, step: int | None, steps: list[int]) -> CheckpointNotFoundError:
    have = ", ".join(str(s) for s in steps) if steps else "none"
    if step is None:
        return CheckpointNotFoundError(
            f"{storage.url!r}: no committed checkpoint (committed steps: {have}). Check the URL "
            "and storage_options, or start without resume_from"
        )
    return CheckpointNotFoundError(
        f"{storage.url!r}: step {step} is not a committed checkpoint; committed steps: {have}. "
        "Call load() for the newest, or load(step=...) with one of these"
    )


def remove_leftovers(storage: Storage) -> list[int]:
    """Delete every step directory without a manifest (a crashed save); return their steps."""
    removed = []
    for step, name in sorted(_step_dirs(storage).items()):
        if not storage.exists(name, MANIFEST):
            storage.rm(name)
            removed.append(step)
    return removed


def delete_step(storage: Storage, step: int) -> None:
    """Uncommit (manifest first), then remove the files."""
    name = step_dirname(step)
    storage.rm(name, MANIFEST)
    storage.rm(name)


def apply_retention(storage: Storage, keep_last: int, just_saved: int) -> list[int]:
    """Delete the oldest committed steps beyond ``keep_last``; never the newest nor
    ``just_saved``. Returns the deleted steps."""
    steps = committed_steps(storage)
    keep = set(steps[-keep_last:]) | {just_saved}
    victims = [s for s in steps if s not in keep]
    for s in victims:
        delete_step(storage, s)
    return victims


def write_manifest(
    storage: Storage, step: int, world_size: int, files: dict[str, FileEntry], extra: dict
) -> Manifest:
    """Check that every recorded file is there with its size, then commit the step."""
    from muon_ckpt import __version__

    name = step_dirname(step)
    listed = storage.walk_files(name)
    for fname, entry in sorted(files.items()):
        if listed.get(fname) != entry.size:
            raise CheckpointCorruptError(
                f"{storage.url_of(name, fname)}: written with {entry.size} bytes but the "
                f"storage reports {listed.get(fname)}; step {step} is NOT committed"
            )
    if DCP_METADATA not in files:
        raise CheckpointCorruptError(
            f"{storage.url_of(name)}: DCP wrote no {DCP_METADATA}; step {step} is NOT committed"
        )
    manifest = Manifest(
        step=step,
        world_size=world_size,
        files=dict(sorted(files.items())),
        time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch_version=torch.__version__,
        muon_ckpt_version=__version__,
        extra=extra,
    )
    storage.write_bytes(manifest.to_json(), name, MANIFEST)
    return manifest


def read_checked_manifest(storage: Storage, step: int) -> tuple[Manifest, Any]:
    """Manifest of a committed step with every file present at its size, and the DCP metadata
    (crc-checked). Raises CheckpointCorruptError naming the first bad file."""
    name = step_dirname(step)
    where = storage.url_of(name, MANIFEST)
    try:
        raw = storage.read_bytes(name, MANIFEST)
    except FileNotFoundError as e:
        raise not_found(storage, step, committed_steps(storage)) from e
    manifest = Manifest.from_json(raw, where)
    if manifest.step != step:
        raise CheckpointCorruptError(
            f"{where}: manifest says step {manifest.step} but lies in the directory of step "
            f"{step}; the step cannot be trusted. Load another step or delete this one"
        )
    listed = storage.walk_files(name)
    for fname, entry in sorted(manifest.files.items()):
        got = listed.get(fname)
        if got is None:
            raise CheckpointCorruptError(
                f"{storage.url_of(name, fname)}: listed in the manifest ({entry.size} bytes) but "
                "missing; load another step or restore the file"
            )
        if got != entry.size:
            raise CheckpointCorruptError(
                f"{storage.url_of(name, fname)}: {got} bytes, the manifest says {entry.size} "
                "(truncated or overwritten); load another step or restore the file"
            )
    md_entry = manifest.files.get(DCP_METADATA)
    if md_entry is None:
        raise CheckpointCorruptError(f"{where}: the manifest lists no {DCP_METADATA} file")
    md_bytes = storage.read_bytes(name, DCP_METADATA)
    crc = f"{zlib.crc32(md_bytes) & 0xFFFFFFFF:08x}"
    if len(md_bytes) != md_entry.size or crc != md_entry.crc32:
        raise CheckpointCorruptError(
            f"{storage.url_of(name, DCP_METADATA)}: crc32 {crc} ({len(md_bytes)} bytes), the "
            f"manifest says {md_entry.crc32} ({md_entry.size} bytes); load another step"
        )
    # DCP's metadata format is a pickle; a matching checksum proves integrity, not trust, so it
    # goes through the unpickler that accepts DCP's metadata classes only.
    metadata = parse_metadata(md_bytes, storage.url_of(name, DCP_METADATA))
    return manifest, metadata
