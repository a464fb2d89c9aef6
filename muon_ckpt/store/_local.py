"""Local files, handled so that nothing a checkpoint holds can hang, mislead or outlive a
reader: regular files opened without following a last-component symlink and without blocking
(``open_regular``), trees deleted where another process may delete too (``rmtree``), small
files created whole or not at all (``link_new``)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import sys
import uuid
from typing import Any

from muon_ckpt._errors import CheckpointCorruptError

__all__ = ["link_new", "open_regular", "rmtree"]


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _not_regular(where: str, kind: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{where}: is {kind}, not a regular file; a checkpoint holds regular files only, so "
        "this one cannot be trusted. Load another step (muon-ckpt ls lists them) or delete it"
    )


def open_regular(path: str, where: str, *, follow: bool = False) -> int:
    """A read-only descriptor of the local regular file ``path``, opened without following a
    symlink in its last component (unless ``follow``: a path the user named) and without
    blocking (a FIFO would block an ordinary open); anything else is a
    CheckpointCorruptError naming ``where``."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):
            raise _not_regular(where, "a symbolic link") from e
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(where, _kind(mode))
    os.set_blocking(fd, True)
    return fd


def rmtree(path: str) -> None:
    """``shutil.rmtree``, where an entry another process removed first is no error."""

    def gone_is_fine(func: Any, p: str, exc: Any) -> None:
        err = exc if isinstance(exc, BaseException) else exc[1]  # onexc / onerror
        if not isinstance(err, FileNotFoundError):
            raise err

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=gone_is_fine)
    else:
        shutil.rmtree(path, onerror=gone_is_fine)


def link_new(data: bytes, path: str) -> bool:
    """Create local ``path`` holding ``data`` unless it exists (FileExistsError). A file
    created with ``O_EXCL`` is empty until written, and a reader that came in between would
    take the lease it is to hold for unreadable, hence stale; a hard link of a file written
    aside appears whole."""
    tmp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    try:
        os.link(tmp, path)
    except OSError as e:  # no hard links on this filesystem (some FUSE and SMB mounts)
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    return True
