"""DCP's ``FileSystemBase`` over a Storage: DCP's own local ``FileSystem`` for local roots, a
small fsspec one for everything else (paths joined with posixpath), and a delegating base
that the save and load paths extend to checksum what passes through."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase

from muon_ckpt.store._storage import Storage

__all__ = ["DelegatingFileSystem", "dcp_filesystem"]


class _AnyPathFileSystem(FileSystemBase):
    """The paths handed in are built by muon-ckpt, never user checkpoint ids to validate."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


class _FsspecFileSystem(_AnyPathFileSystem):
    def __init__(self, fs: Any, dirs: bool) -> None:
        self.fs = fs
        self.dirs = dirs  # False on object stores: no directories to make

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        f = self.fs.open(os.fspath(path), mode)
        try:
            yield f
        except BaseException:
            if "w" in mode and hasattr(f, "discard"):
                f.discard()  # an object store must not commit half a file
            else:
                f.close()
            raise
        f.close()

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return posixpath.join(os.fspath(path), suffix)

    def init_path(self, path: str | os.PathLike) -> str:
        return os.fspath(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.fs.mv(os.fspath(path), os.fspath(new_path))

    def mkdir(self, path: str | os.PathLike) -> None:
        if self.dirs:  # s3fs's makedirs would create a missing bucket
            self.fs.makedirs(os.fspath(path), exist_ok=True)

    def exists(self, path: str | os.PathLike) -> bool:
        return self.fs.exists(os.fspath(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.fs.rm(os.fspath(path))

    def ls(self, path: str | os.PathLike) -> list[str]:
        return self.fs.ls(os.fspath(path), detail=False)


def dcp_filesystem(storage: Storage) -> FileSystemBase:
    if storage.is_local:
        return FileSystem()
    return _FsspecFileSystem(storage.fs, dirs=not storage.object_store)


class DelegatingFileSystem(_AnyPathFileSystem):
    """Every FileSystemBase call goes to ``inner``; subclasses change ``create_stream``."""

    def __init__(self, inner: FileSystemBase) -> None:
        self.inner = inner

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        with self.inner.create_stream(path, mode) as s:
            yield s

    def concat_path(self, path: str | os.PathLike, suffix: str) -> Any:
        return self.inner.concat_path(path, suffix)

    def init_path(self, path: str | os.PathLike) -> Any:
        return self.inner.init_path(path)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.inner.rename(path, new_path)

    def mkdir(self, path: str | os.PathLike) -> None:
        self.inner.mkdir(path)

    def exists(self, path: str | os.PathLike) -> bool:
        return self.inner.exists(path)

    def rm_file(self, path: str | os.PathLike) -> None:
        self.inner.rm_file(path)
