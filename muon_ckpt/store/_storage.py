"""The one module that calls fsspec: a filesystem plus a root, and the operations on it.

Remote paths are joined with ``posixpath`` only (never ``os.path``/``pathlib``, which break
``s3://`` URLs). A plain local path and ``file://`` both map to the local filesystem.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Iterator
from typing import IO, Any

import fsspec
from fsspec.core import url_to_fs

from muon_ckpt._errors import CheckpointError

__all__ = ["Storage"]


class Storage:
    """A checkpoint root on any fsspec filesystem; every path is given as parts under it."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"url must be a non-empty string, got {url!r}")
        try:
            fs, root = url_to_fs(url, **(storage_options or {}))
        except (ValueError, ImportError) as e:
            scheme = url.split("://", 1)[0] if "://" in url else "file"
            known = sorted(fsspec.available_protocols())
            raise ValueError(
                f"url {url!r}: cannot open scheme {scheme!r} ({e}). Use a local path or an "
                f"fsspec URL whose filesystem is installed (e.g. pip install 'muon-ckpt[s3]' "
                f"for s3://); known schemes: {', '.join(known[:20])}, ..."
            ) from e
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.is_local = self.protocol in ("file", "local")

    def path(self, *parts: str) -> str:
        """Filesystem path under the root (posix joins only)."""
        return posixpath.join(self.root, *parts)

    def url_of(self, *parts: str) -> str:
        """A full URL (with scheme) for ``parts`` under the root, for messages and readers."""
        p = self.path(*parts)
        return p if self.is_local else self.fs.unstrip_protocol(p)

    def child(self, *parts: str) -> Storage:
        """The storage rooted at ``parts`` under this root (same filesystem and options)."""
        sub = Storage.__new__(Storage)
        sub.__dict__.update(self.__dict__)
        sub.root = self.path(*parts)
        sub.url = self.url_of(*parts)
        return sub

    # ------------------------------------------------------------------ queries
    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self.path(*parts))

    def isfile(self, *parts: str) -> bool:
        return self.fs.isfile(self.path(*parts))

    def size(self, *parts: str) -> int:
        return int(self.fs.size(self.path(*parts)))

    def check_root(self) -> None:
        """The root must be a directory (or absent); a file there is a configuration error."""
        try:
            if self.fs.isfile(self.root):
                raise CheckpointError(
                    f"{self.url!r} is a file, not a directory: give a directory (or bucket "
                    "prefix) for the checkpoints"
                )
        except (PermissionError, FileNotFoundError):
            return

    def listdir(self, *parts: str) -> list[str]:
        """Base names directly under ``parts``; [] when it does not exist."""
        p = self.path(*parts)
        try:
            self.fs.invalidate_cache(p)
            entries = self.fs.ls(p, detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def walk_files(self, *parts: str) -> dict[str, int]:
        """Relative path -> size of every file below ``parts``."""
        return {k: int(v.get("size") or 0) for k, v in self.walk_info(*parts).items()}

    def walk_info(self, *parts: str) -> dict[str, dict[str, Any]]:
        """Relative path -> fsspec info (``size``, times...) of every file below ``parts``."""
        base = self.path(*parts)
        self.fs.invalidate_cache(base)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return {posixpath.relpath(full, base): info for full, info in found.items()}

    # ------------------------------------------------------------------ reads
    def open(self, *parts: str, mode: str = "rb") -> IO[bytes]:
        return self.fs.open(self.path(*parts), mode)

    def read_bytes(self, *parts: str) -> bytes:
        return self.fs.cat_file(self.path(*parts))

    def read_range(self, start: int, end: int, *parts: str) -> bytes:
        return self.fs.cat_file(self.path(*parts), start=start, end=end)

    # ------------------------------------------------------------------ writes
    def makedirs(self, *parts: str) -> None:
        self.fs.makedirs(self.path(*parts), exist_ok=True)

    @contextlib.contextmanager
    def open_atomic(self, *parts: str) -> Iterator[IO[bytes]]:
        """A file to write that readers see whole or not at all. Local: a ``.tmp`` file,
        fsynced, renamed over the target (and the directory fsynced); removed on error. Object
        stores: one upload, committed when the file closes and discarded on error."""
        p = self.path(*parts)
        if not self.is_local:
            f = self.fs.open(p, "wb")
            try:
                yield f
            except BaseException:
                if hasattr(f, "discard"):
                    f.discard()
                raise
            f.close()
            return
        parent = posixpath.dirname(p)
        os.makedirs(parent, exist_ok=True)
        tmp = p + ".tmp"
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise
        dfd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Write a small file atomically (``open_atomic``)."""
        with self.open_atomic(*parts) as f:
            f.write(data)

    def rm(self, *parts: str) -> None:
        p = self.path(*parts)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(p, recursive=True)
        self.fs.invalidate_cache(p)
