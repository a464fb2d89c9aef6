"""The one module that calls fsspec: a filesystem plus a root, and the operations on it.

Remote paths are joined with ``posixpath`` only (never ``os.path``/``pathlib``, which break
``s3://`` URLs). A plain local path and ``file://`` both map to the local filesystem.

Trust: a local file is read only when it is a regular file reached without following a link
in its last component (``O_NOFOLLOW``; a FIFO, device or symlink is a CheckpointCorruptError,
and opening never blocks), and small files are read up to a bound. Deleting never follows a
symlink: the link goes, its target stays. Every other failure of the storage is raised as a
``CheckpointStorageError`` naming the URL and the cause (a missing file stays a
``FileNotFoundError``).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import stat
import uuid
from collections.abc import Iterator
from typing import IO, Any

import fsspec
from fsspec.core import split_protocol, url_to_fs

from muon_ckpt._errors import CheckpointCorruptError, CheckpointError, CheckpointStorageError
from muon_ckpt.store._local import link_new, open_regular, rmtree
from muon_ckpt.store._readahead import ReadAhead
from muon_ckpt.store._rename import exchange

__all__ = [
    "DEFAULT_TIMEOUT",
    "Storage",
    "bad_options",
    "is_storage_failure",
    "open_regular",
    "storage_error",
]

DEFAULT_TIMEOUT = 60.0  # seconds: connect and read timeout of one storage request
# Object stores: no directories (and creating one may create a bucket).
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"}
_FLAT = _OBJECT_STORES | {"memory"}  # a path is a key: nothing resolves '.', '..' or '//'
_STORAGE_MODULES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "fsspec")


def is_storage_failure(e: BaseException) -> bool:
    """Whether ``e`` comes from the storage (I/O, network, the storage client)."""
    if isinstance(e, (OSError, TimeoutError, ConnectionError)):
        return True
    return any(c.__module__.startswith(_STORAGE_MODULES) for c in type(e).__mro__[:-1])


def storage_error(e: BaseException, what: str) -> CheckpointStorageError:
    """The CheckpointStorageError for ``e``, raised while doing ``what`` (names the URL)."""
    return CheckpointStorageError(
        f"{what} failed: {type(e).__name__}: {e}. Check the URL and storage_options "
        "(endpoint_url, credentials) and that the storage is reachable; then retry"
    )


def bad_options(url: str, options: dict[str, Any], e: TypeError) -> ValueError:
    """The ValueError for storage options the filesystem does not accept (a typo)."""
    m = re.search(r"unexpected keyword argument '([^']+)'", str(e))
    which = f"the option {m.group(1)!r}" if m else f"one of {sorted(options)}"
    return ValueError(
        f"url {url!r}: storage_options: {which} is not accepted ({e}); check the spelling "
        "against the filesystem's documentation (s3fs: key, secret, token, endpoint_url, "
        "client_kwargs, config_kwargs, ...)"
    )


def _check_key(url: str, scheme: str, root: str) -> None:
    """A ValueError for a url of a flat key space whose key has an empty, ``.`` or ``..``
    component (``runs//run7``, ``runs/./run7``): the store keeps it in the key as it is,
    where it names no directory, some S3-compatible stores rewrite or refuse it, and
    another tool, or the url spelled plainly, looks under another key."""
    names = root.strip("/").split("/") if root.strip("/") else []
    odd = [n for n in names if n in ("", ".", "..")]
    if not odd:
        return
    kept: list[str] = []
    for n in names:
        if n == "..":
            if len(kept) <= 1:  # (not above the bucket)
                kept = []
                break
            kept.pop()
        elif n not in ("", "."):
            kept.append(n)
    what = "an empty component ('//')" if "" in odd else f"a {odd[0]!r} component"
    plain = "/".join(kept)
    why = f"it is another key than {plain!r}" if kept else "'..' leads above the bucket"
    fix = f"{scheme}://{plain}" if kept else "a prefix inside the bucket"
    raise ValueError(
        f"url {url!r}: the object key has {what}, which {scheme}:// keeps as it is ({why}; "
        "it names no directory); S3-compatible stores may rewrite or refuse it, and other "
        f"tools look under another key. Write the key plainly: use {fix}"
    )


def _timeout_options(url: str, options: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """``options`` with ``timeout`` as the connect and read timeout of the S3 client, unless
    the user set those (other schemes: as given)."""
    if timeout is None or split_protocol(url)[0] not in ("s3", "s3a"):
        return options
    cfg = dict(options.get("config_kwargs") or {})
    cfg.setdefault("connect_timeout", timeout)
    cfg.setdefault("read_timeout", timeout)
    return {**options, "config_kwargs": cfg}


class Storage:
    """A checkpoint root on any fsspec filesystem; every path is given as parts under it."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"url must be a non-empty string, got {url!r}")
        options = _timeout_options(url, dict(storage_options or {}), timeout)
        try:
            fs, root = url_to_fs(url, **options)
        except TypeError as e:
            raise bad_options(url, options, e) from e
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
        if self.protocol in _FLAT:
            _check_key(url, self.protocol, self.root)
        self.is_local = self.protocol in ("file", "local")
        self.object_store = self.protocol in _OBJECT_STORES

    @contextlib.contextmanager
    def _calling(self, what: str, *parts: str) -> Iterator[None]:
        """Storage failures inside become a CheckpointStorageError naming ``what`` and the
        URL; a missing file stays a FileNotFoundError."""
        try:
            yield
        except (FileNotFoundError, CheckpointError):
            raise
        except Exception as e:
            if not is_storage_failure(e):
                raise
            raise storage_error(e, f"{what} {self.url_of(*parts)}") from e

    def path(self, *parts: str) -> str:
        """Filesystem path under the root (posix joins only). A ``..`` in ``parts`` (a step's
        name for a file of the run's data, ``../data/<dir>/<file>``) is resolved here, on the
        components: it takes the last one off (the root's, once those of ``parts`` are used
        up), and the root is never rewritten, so a read finds what a write with the same
        parts wrote whatever the root's text is. Object stores keep ``..`` in a key, and
        locally the step directory may be a symbolic link (then ``..`` is the run's root,
        never the link target's parent)."""
        if not any(".." in part.split("/") for part in parts):
            return posixpath.join(self.root, *parts)
        base, names = self.root, []
        for name in posixpath.join(*parts).split("/"):
            if name != "..":
                names.append(name)
            elif names:
                names.pop()
            elif base.strip("/"):
                base = posixpath.dirname(base)
            else:
                raise ValueError(f"{'/'.join(parts)!r} leads out of {self.url!r}")
        return posixpath.join(base, *names)

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
        p = self.path(*parts)
        with self._calling("checking", *parts):
            self.fs.invalidate_cache(p)  # another process may have written or deleted it
            return self.fs.exists(p)

    def isfile(self, *parts: str) -> bool:
        with self._calling("checking", *parts):
            return self.fs.isfile(self.path(*parts))

    def size(self, *parts: str) -> int:
        with self._calling("checking", *parts):
            return int(self.fs.size(self.path(*parts)))

    def is_link(self, *parts: str) -> bool:
        """Whether ``parts`` is a symbolic link (local only; object stores have none)."""
        return self.is_local and os.path.islink(self.path(*parts))

    def check_root(self) -> None:
        """The root must be a directory (or absent); a file there is a configuration error."""
        try:
            if self.isfile():
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
            with self._calling("listing", *parts):
                self.fs.invalidate_cache(p)
                entries = self.fs.ls(p, detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    def list_dirs(self, *parts: str) -> dict[str, bool]:
        """Base name -> whether it is a directory, for every entry directly under ``parts``
        (locally a symlink to a directory counts as one); {} when ``parts`` does not exist."""
        p = self.path(*parts)
        try:
            with self._calling("listing", *parts):
                self.fs.invalidate_cache(p)
                entries = self.fs.ls(p, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for e in entries:
            name = posixpath.basename(str(e["name"]).rstrip("/"))
            is_dir = e.get("type") == "directory"
            if not is_dir and self.is_local and e.get("islink"):
                is_dir = os.path.isdir(self.path(*parts, name))
            out[name] = is_dir
        return dict(sorted(out.items()))

    def walk_files(self, *parts: str) -> dict[str, int]:
        """Relative path -> size of every file below ``parts``."""
        return {k: int(v.get("size") or 0) for k, v in self.walk_info(*parts).items()}

    def walk_info(self, *parts: str) -> dict[str, dict[str, Any]]:
        """Relative path -> fsspec info (``size``, ``type``, times...) of every file below
        ``parts`` (locally, a FIFO or device is listed with ``type`` "other", a symlink with
        ``islink``)."""
        base = self.path(*parts)
        try:
            with self._calling("listing", *parts):
                self.fs.invalidate_cache(base)
                found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return {posixpath.relpath(full, base): info for full, info in found.items()}

    # ------------------------------------------------------------------ reads
    def open(self, *parts: str, ahead: list[tuple[int, int]] | None = None) -> IO[bytes]:
        """A file to read; locally a regular file only (``open_regular``; a link is followed
        only when it is the root the user named). ``ahead``: the byte ranges the caller will
        read front to back; a remote file then reads ahead inside them only (``ReadAhead``:
        every other read fetches exactly its bytes). Without it, fsspec's own read-ahead."""
        p = self.path(*parts)
        if self.is_local:
            return os.fdopen(open_regular(p, self.url_of(*parts), follow=not parts), "rb")
        with self._calling("opening", *parts):
            if ahead is None:
                return self.fs.open(p, "rb")
            try:
                raw = self.fs.open(p, "rb", cache_type="none")
            except TypeError:  # a caching wrapper (blockcache::...) that sets it itself
                raw = self.fs.open(p, "rb")
            return ReadAhead(raw, ahead)  # type: ignore[return-value]

    def read_bytes(self, *parts: str, limit: int | None = None) -> bytes:
        """The whole file; with ``limit``, a file of more than ``limit`` bytes is a
        CheckpointCorruptError (read no further than that)."""
        p, where = self.path(*parts), self.url_of(*parts)
        if self.is_local:
            with os.fdopen(open_regular(p, where, follow=not parts), "rb") as f:
                data = f.read() if limit is None else f.read(limit + 1)
        else:
            with self._calling("reading", *parts):
                data = self._cat(p, limit)
        if limit is not None and len(data) > limit:
            raise CheckpointCorruptError(
                f"{where}: larger than the {limit} bytes it may have; the step cannot be "
                "trusted. Load another step (muon-ckpt ls lists them) or delete it"
            )
        return data

    def _cat(self, p: str, limit: int | None) -> bytes:
        """A remote file, whole or (``limit``) its first ``limit + 1`` bytes: one ranged GET,
        no listing (whose cache could be stale)."""
        if limit is None:
            return self.fs.cat_file(p)
        try:
            return self.fs.cat_file(p, start=0, end=limit + 1)
        except OSError as e:
            if isinstance(e, FileNotFoundError) or "range" not in str(e).lower():
                raise
            return b""  # an empty object: S3 answers 416 to any range of it

    def read_range(self, start: int, end: int, *parts: str) -> bytes:
        with self._calling("reading", *parts):
            return self.fs.cat_file(self.path(*parts), start=start, end=end)

    # ------------------------------------------------------------------ writes
    def makedirs(self, *parts: str) -> None:
        if self.object_store:  # no directories; s3fs would even create a missing bucket
            return
        with self._calling("creating", *parts):
            self.fs.makedirs(self.path(*parts), exist_ok=True)

    @contextlib.contextmanager
    def open_atomic(self, *parts: str, durable: bool = True) -> Iterator[IO[bytes]]:
        """A file to write that readers see whole or not at all. Local: a ``.tmp`` file of
        this writer's own, fsynced (``durable``), renamed over the target (and the directory
        fsynced); removed on error. Object stores: one upload, committed when the file closes
        and discarded on error."""
        p = self.path(*parts)
        if not self.is_local:
            with self._calling("opening", *parts):
                f = self.fs.open(p, "wb")
            try:
                yield f
            except BaseException:
                if hasattr(f, "discard"):
                    f.discard()
                raise
            with self._calling("writing", *parts):
                f.close()
            return
        parent = posixpath.dirname(p)
        os.makedirs(parent, exist_ok=True)
        tmp = f"{p}.{uuid.uuid4().hex[:12]}.tmp"  # two writers never share one
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise
        if not durable:
            return
        dfd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def write_bytes(self, data: bytes, *parts: str, durable: bool = True) -> None:
        """Write a small file atomically (``open_atomic``)."""
        with self._calling("writing", *parts), self.open_atomic(*parts, durable=durable) as f:
            f.write(data)

    def create_exclusive(self, data: bytes, *parts: str) -> bool:
        """Write a small file only if none is there; False when one is. Atomic, and never seen
        half-written, locally (written aside, then hard-linked into place; not fsynced: for
        advisory files such as the lease) and on S3 (a conditional ``If-None-Match: *``
        upload); elsewhere a check then a write (not atomic)."""
        p = self.path(*parts)
        with self._calling("creating", *parts):
            try:
                if self.is_local:
                    return link_new(data, p)
                with self.fs.open(p, "xb") as f:
                    f.write(data)
                return True
            except FileExistsError:  # S3: 412 Precondition Failed, as s3fs raises it
                return False

    def rename(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` under the root (local only)."""
        with self._calling("renaming", src):
            os.rename(self.path(src), self.path(dst))

    def exchange(self, a: str, b: str) -> None:
        """Swap directories ``a`` and ``b`` under the root atomically (local only)."""
        with self._calling("renaming", a):
            exchange(self.path(a), self.path(b))

    def copy(self, src: tuple[str, ...], dst: tuple[str, ...]) -> None:
        """Copy one file under the root (server-side on object stores)."""
        with self._calling("copying", *src):
            self.fs.copy(self.path(*src), self.path(*dst))

    def rm(self, *parts: str) -> None:
        """Remove a file or a directory tree; a symlink is unlinked, its target kept. What is
        gone already, or goes meanwhile (another process deleting the same step), is no
        error."""
        p = self.path(*parts)
        if self.is_local:
            with self._calling("deleting", *parts):
                try:
                    st = os.lstat(p)
                except FileNotFoundError:
                    return
                if stat.S_ISDIR(st.st_mode):
                    rmtree(p)  # never follows the links inside
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)  # a file, or a symlink (its target stays)
            return
        with self._calling("deleting", *parts):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(p, recursive=True)
            self.fs.invalidate_cache(p)
