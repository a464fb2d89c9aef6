"""The one module that knows local vs remote paths: an fsspec filesystem plus a root.

Remote paths are joined with ``posixpath`` only (never ``os.path``/``pathlib``, which break
``s3://`` URLs). A plain local path and ``file://`` both map to the local filesystem.
"""

from __future__ import annotations

import contextlib
import posixpath
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from muon_ckpt._errors import CheckpointError

__all__ = ["Storage"]


class Storage:
    """A checkpoint root on any fsspec filesystem."""

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
        """A full URL (with scheme) for ``parts`` under the root, for fsspec-based readers."""
        p = self.path(*parts)
        return p if self.is_local else self.fs.unstrip_protocol(p)

    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self.path(*parts))

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

    def read_bytes(self, *parts: str) -> bytes:
        return self.fs.cat_file(self.path(*parts))

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Write a small file. Local: tmp + fsync + rename, so readers never see half a file.
        Object stores: a single PUT, which is atomic."""
        p = self.path(*parts)
        if self.is_local:
            import os

            os.makedirs(posixpath.dirname(p), exist_ok=True)
            tmp = p + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
            dfd = os.open(posixpath.dirname(p), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        else:
            with self.fs.open(p, "wb") as f:
                f.write(data)

    def size(self, *parts: str) -> int:
        return int(self.fs.size(self.path(*parts)))

    def rm(self, *parts: str) -> None:
        p = self.path(*parts)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(p, recursive=True)
        self.fs.invalidate_cache(p)

    def walk_files(self, *parts: str) -> dict[str, int]:
        """Relative path -> size of every file below ``parts``."""
        base = self.path(*parts)
        self.fs.invalidate_cache(base)
        out = {}
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return out
        for full, info in found.items():
            rel = posixpath.relpath(full, base)
            out[rel] = int(info.get("size") or 0)
        return out
