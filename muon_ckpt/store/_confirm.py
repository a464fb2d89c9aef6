"""Integrity before commit: confirm that the storage holds the bytes a save wrote.

A writer computes each file's size and checksums (``_checksum``) as it sends the bytes; that proves what left this
process, not what the storage kept (a proxy, a bad disk or a buggy gateway can accept a
corrupted upload and answer OK). Before the manifest is written, each rank confirms the files
it wrote, ``mode``:

* ``"checksum"`` (default; ``"crc32"``, its former name, means the same): reads every file
  back and compares its size and per-chunk checksums (CRC32C) with the record.
  Costs one read of the checkpoint (spread over the ranks, ``threads`` files at once per
  rank); measured in docs/internals.md;
* ``"size"``: compares the sizes the storage lists (catches truncation, not flipped bytes);
* ``"off"``: trusts the upload.

A mismatch is a CheckpointCorruptError: the step is not committed, so retention never counts
it and never deletes a good step because of it.

Seam: a store that checks a checksum sent with the upload (S3 and GCS accept CRC32C;
``x-amz-checksum-crc32c``) could confirm on the way: manifests record CRC32C per chunk, and a
store's composite or full-object CRC32C can be derived from them, so such uploads would need
no read-back here.
"""

from __future__ import annotations

from muon_ckpt._errors import CheckpointCorruptError
from muon_ckpt._threads import run_all
from muon_ckpt.store._checksum import file_checksum
from muon_ckpt.store._data import listing
from muon_ckpt.store._layout import FileEntry
from muon_ckpt.store._storage import Storage

__all__ = ["CONFIRM_MODES", "confirm_files"]

CONFIRM_MODES = ("checksum", "crc32", "size", "off")


def _mismatch(where: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{where}: after the upload the storage holds {what} (the upload was damaged or "
        "overwritten); the step is NOT committed and every committed step is kept. Check the "
        "storage and retry the save"
    )


def confirm_files(
    storage: Storage, dirname: str, files: dict[str, FileEntry], mode: str, threads: int = 4
) -> None:
    """Raise CheckpointCorruptError unless the storage holds ``files`` (name -> size and
    checksums of what was written) in ``dirname`` as written (``mode``: see the module)."""
    if mode == "off" or not files:
        return
    listed = {
        n: int(i.get("size") or 0) for n, i in listing(storage, (dirname,), set(files)).items()
    }
    for name, entry in sorted(files.items()):
        if listed.get(name) != entry.size:
            raise _mismatch(
                storage.url_of(dirname, name),
                f"{listed.get(name)} bytes, not the {entry.size} written",
            )
    if mode not in ("checksum", "crc32"):
        return

    def one(name: str) -> None:
        want, where = files[name], storage.url_of(dirname, name)
        with storage.open(dirname, name, ahead=[(0, want.size)]) as f:
            got = file_checksum(f, want, where=where)
        if got.size != want.size or got.hexdigest() != want.digest:
            raise _mismatch(
                where,
                f"{got.size} bytes whose {want.algorithm} differs from what was written "
                f"({want.size} bytes)",
            )

    run_all(threads, one, sorted(files), name="-confirm")
