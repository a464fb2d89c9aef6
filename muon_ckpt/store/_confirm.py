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

Bytes also change after their commit (bit rot, a tool rewriting an object, a lifecycle rule
deleting it). ``check_stored`` tells which of a committed step's files the storage no longer
holds as recorded: sizes always (one listing per directory), and with ``"checksum"`` the
checksums, reading a file back unless this process read it back already since the storage
last reported a change to it (``_stamp``: locally size, inode and the modification and
status-change times in nanoseconds; an object's ETag or generation; another backend's
``mtime``). A file changed less than ``SETTLED_SECONDS`` before (within the coarse tick of a
file system's clock), or on a backend that reports no such stamp (``memory://`` keeps only
its creation time through an in-place write), is read back every time. A file in a data
directory that is a symbolic link is reported, never read through the link. A save asks it
of the files of earlier saves it would refer to for its unchanged tensors, and writes those
tensors again where one fails (``save._dedup``); a load asks it of the files of a step that
read as damaged before it passes over the step.

Seam: a store that checks a checksum sent with the upload (S3 and GCS accept CRC32C;
``x-amz-checksum-crc32c``) could confirm on the way: manifests record CRC32C per chunk, and a
store's composite or full-object CRC32C can be derived from them, so such uploads would need
no read-back here.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from typing import Any

from muon_ckpt._collective import is_dist, rank
from muon_ckpt._config import reads_back
from muon_ckpt._errors import CheckpointCorruptError, CheckpointError
from muon_ckpt._threads import run_all
from muon_ckpt.store._checksum import file_checksum
from muon_ckpt.store._data import listing
from muon_ckpt.store._layout import DATA, FileEntry, data_ref
from muon_ckpt.store._storage import Storage, is_storage_failure

__all__ = ["check_stored", "confirm_files"]

SETTLED_SECONDS = 2.0  # a file changed this recently may change again unseen by its times
_MAX_CHECKED = 1 << 16
_checked: dict[str, tuple[Any, ...]] = {}  # a data file's url -> its state when it checked out
_lock = threading.Lock()


def _mismatch(where: str, what: str) -> CheckpointCorruptError:
    by = f" (written by rank {rank()})" if is_dist() else ""  # (every rank raises it)
    return CheckpointCorruptError(
        f"{where}{by}: after the upload the storage holds {what} (the upload was damaged or "
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
    if not reads_back(mode):
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


def check_stored(
    storage: Storage, dirname: str, files: dict[str, FileEntry], mode: str, threads: int = 4
) -> dict[str, str]:
    """Which of ``files`` (committed files, by name from the step directory ``dirname``,
    with their manifest entries) the storage does not hold as recorded: name -> what it holds
    instead. See the module for what is checked, and when a file is read back."""
    if not files:
        return {}
    now = time.time()
    bad = _linked(storage, dirname, files)
    listed = listing(storage, (dirname,), set(files) - set(bad))

    def one(name: str) -> None:
        want, info = files[name], listed.get(name)
        ref = data_ref(name)  # (one key per file, whichever step names it)
        parts = (DATA, *ref) if ref is not None else (dirname, name)
        key = storage.url_of(*parts)
        got = None if info is None else int(info.get("size") or 0)
        if got != want.size:
            bad[name] = "nothing" if got is None else f"{got} bytes, not {want.size}"
            return
        if not reads_back(mode):
            return
        state = _stamp(storage, parts, info, now)
        with _lock:
            if state is not None and _checked.get(key) == state:
                return
            _checked.pop(key, None)
        try:
            with storage.open(dirname, name, ahead=[(0, want.size)]) as f:
                sums = file_checksum(f, want, where=key)
        except Exception as e:  # a file that cannot be read back is written again too
            if not (isinstance(e, CheckpointError) or is_storage_failure(e)):
                raise
            bad[name] = f"a file that cannot be read back ({type(e).__name__}: {e})"
            return
        if sums.size != want.size or sums.hexdigest() != want.digest:
            bad[name] = f"other bytes: their {want.algorithm} differs from the manifest's"
        elif state is not None:
            with _lock:
                if len(_checked) >= _MAX_CHECKED:
                    del _checked[next(iter(_checked))]
                _checked[key] = state

    run_all(threads, one, sorted(set(files) - set(bad)), name="-refs")
    return bad


def _linked(storage: Storage, dirname: str, files: dict[str, FileEntry]) -> dict[str, str]:
    """The files of ``files`` in a data directory that is (or lies behind) a symbolic link:
    never read through it, they count as not held (a save writes their tensors again)."""
    out = {}
    for name in files:
        ref = data_ref(name)
        link = None if ref is None else storage.link_in(dirname, "..", DATA, ref[0])
        if link is not None:
            out[name] = f"its directory behind the symbolic link {link} (never read through)"
    return out


def _stamp(
    storage: Storage, parts: tuple[str, ...], info: dict[str, Any], now: float
) -> tuple[Any, ...] | None:
    """What changes whenever a file's bytes do: locally its ``os.stat`` (size, inode, device,
    modification and status-change times in ns: a rewrite that restores the modification
    time still moves the status-change time); an object's ETag or generation; another
    backend's ``mtime``. None where the storage reports no such stamp (``memory://``'s
    ``created`` survives an in-place write) or the file changed so recently that another
    change in the same tick of the clock would go unseen: then it is read back every time."""
    if storage.is_local:
        try:
            st = os.lstat(storage.path(*parts))
        except OSError:
            return None
        changed = max(st.st_mtime_ns, st.st_ctime_ns) / 1e9
        if now - changed < SETTLED_SECONDS:
            return None
        return "stat", st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns
    for k in ("ETag", "etag", "generation", "md5Hash"):
        if info.get(k):
            return k, info.get("size"), str(info[k])
    mtime = _seconds(info.get("mtime"))
    if mtime is None or now - mtime < SETTLED_SECONDS:
        return None
    return "mtime", info.get("size"), mtime


def _seconds(v: Any) -> float | None:
    if isinstance(v, datetime.datetime):
        return v.timestamp()
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return None
