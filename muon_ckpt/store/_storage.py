"""The one module that calls fsspec: a filesystem plus a root, and the operations on it.

Remote paths are joined with ``posixpath`` only (never ``os.path``/``pathlib``, which break
``s3://`` URLs). A plain local path and ``file://`` both map to the local filesystem.

Trust: a local file is read only when it is a regular file reached without following a link
in its last component (``O_NOFOLLOW``; a FIFO, device or symlink is a CheckpointCorruptError,
and opening never blocks), and small files are read up to a bound. A step's reference to the
run's data is read only when no directory on its way below the root is a symlink
(``check_unlinked``). Deleting never follows a symlink: the link goes, its target stays;
nothing is created or deleted through one. Every other failure of the storage is raised as a
``CheckpointStorageError`` naming the URL and the cause (a missing file stays a
``FileNotFoundError``). Every request to S3 runs within one retry budget (``_retry``:
``storage_timeout`` bounds it, its retries included).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat
import uuid
from collections.abc import Iterator
from typing import IO, Any

from muon_ckpt._errors import CheckpointCorruptError, CheckpointError
from muon_ckpt.store._failure import is_storage_failure, storage_error
from muon_ckpt.store._local import link_new, open_regular, rmtree
from muon_ckpt.store._readahead import ReadAhead
from muon_ckpt.store._rename import exchange
from muon_ckpt.store._retry import Budget, client_options, own_retries
from muon_ckpt.store._url import OBJECT_STORES, open_fs

__all__ = [
    "DEFAULT_TIMEOUT",
    "Storage",
    "is_storage_failure",
    "open_regular",
    "storage_error",
]

DEFAULT_TIMEOUT = 60.0  # seconds: one storage request, its retries included (_retry)
_S3 = ("s3", "s3a")


def _climbs(parts: tuple[str, ...]) -> bool:
    """Whether ``parts`` has a ``..``: a step's name for a file of the run's data."""
    return any(".." in part.split("/") for part in parts)


def _target(link: str) -> str:
    """Where a symbolic link leads, for a message ("?" once it is gone)."""
    try:
        return os.readlink(link)
    except OSError:
        return "?"


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
        options = dict(storage_options or {})
        if url.split("://", 1)[0] in _S3:  # (our own client: its retries are the budget's)
            options = client_options(options, timeout)
        fs, root, protocol = open_fs(url, options, timeout)
        own_retries(fs, Budget(timeout))
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.fs = fs
        self.root = root
        self.protocol = protocol
        self.is_local = self.protocol in ("file", "local")
        self.object_store = self.protocol in OBJECT_STORES

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
        if not _climbs(parts):
            return posixpath.join(self.root, *parts)
        base, names = self._resolved(parts)
        return posixpath.join(base, *names)

    def _resolved(self, parts: tuple[str, ...]) -> tuple[str, list[str]]:
        """``parts`` as (where its ``..`` lead, the names below that)."""
        base, names = self.root, []
        for name in posixpath.join(*parts).split("/") if parts else []:
            if name != "..":
                names.append(name)
            elif names:
                names.pop()
            elif base.strip("/"):
                base = posixpath.dirname(base)
            else:
                raise ValueError(f"{'/'.join(parts)!r} leads out of {self.url!r}")
        return base, [n for n in names if n not in ("", ".")]

    def link_in(self, *parts: str, last: bool = True) -> str | None:
        """Locally, the first of the directories ``parts`` names below the root (below
        where its ``..`` lead), and (``last``) the entry itself, that is a symbolic link;
        None when none is (or on object stores, which have none)."""
        if not self.is_local:
            return None
        base, names = self._resolved(parts)
        for i in range(1, len(names) + (1 if last else 0)):
            p = posixpath.join(base, *names[:i])
            if os.path.islink(p):
                return p
        return None

    def check_unlinked(self, *parts: str) -> None:
        """A CheckpointCorruptError when ``parts`` is reached through a symbolic link below
        the root (``link_in``): a step names its run's own data, and a link there leads to
        another run's, or to a copy that nothing keeps in step with this run."""
        link = self.link_in(*parts)
        if link is not None:
            raise CheckpointCorruptError(
                f"{self.url_of(*parts)}: reached through the symbolic link {link} (to "
                f"{_target(link)!r}); a step reads only its own run's data, never "
                "through a link (two runs never share data), so it cannot be trusted here. "
                "Load the step from the run that holds its data, or replace the link with a "
                "copy of what it links to"
            )

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

    def walk_info(self, *parts: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        """Relative path -> fsspec info (``size``, ``type``, times, an object store's tag...)
        of every file below ``parts`` (``prefix``: whose path below it begins so, on an
        object store: one listing, paged; locally, a FIFO or device is listed with ``type``
        "other", a symlink with ``islink``)."""
        base = self.path(*parts)
        kw = {"prefix": prefix} if prefix else {}
        try:
            with self._calling("listing", *parts):
                self.fs.invalidate_cache(base)
                found = self.fs.find(base, detail=True, **kw)
        except FileNotFoundError:
            return {}
        cut = len(base.rstrip("/")) + 1  # (a path below base: the rest of it, as relpath says)
        inside = base.rstrip("/") + "/"
        return {
            full[cut:] if full.startswith(inside) else posixpath.relpath(full, base): info
            for full, info in found.items()
        }

    def info(self, *parts: str) -> dict[str, Any]:
        """fsspec's info of one file (on an object store, a HEAD)."""
        with self._calling("checking", *parts):
            return self.fs.info(self.path(*parts))

    # ------------------------------------------------------------------ reads
    def open(self, *parts: str, ahead: list[tuple[int, int]] | None = None) -> IO[bytes]:
        """A file to read; locally a regular file only (``open_regular``; a link is followed
        only when it is the root the user named). ``ahead``: the byte ranges the caller will
        read front to back; a remote file then reads ahead inside them only (``ReadAhead``:
        every other read fetches exactly its bytes). Without it, fsspec's own read-ahead."""
        p = self.path(*parts)
        if self.is_local:
            if _climbs(parts):  # a step's reference to the run's data
                self.check_unlinked(*parts)
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
            if _climbs(parts):  # a step's reference to the run's data
                self.check_unlinked(*parts)
            with os.fdopen(open_regular(p, where, follow=not parts), "rb") as f:
                if limit is not None and os.fstat(f.fileno()).st_size > limit:
                    raise _larger(where, limit)  # (unread: a limit of 1 GiB is no read of it)
                data = f.read() if limit is None else f.read(limit + 1)
        else:
            with self._calling("reading", *parts):
                data = self._cat(p, limit)
        if limit is not None and len(data) > limit:
            raise _larger(where, limit)
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
        """Create directory ``parts`` under the root, never through a symbolic link below
        it (a CheckpointError naming the link: what a run writes stays in its own root)."""
        if self.object_store:  # no directories; s3fs would even create a missing bucket
            return
        link = self.link_in(*parts)
        if link is not None:
            raise CheckpointError(
                f"{self.url_of(*parts)}: {link} is a symbolic link (to {_target(link)!r}); "
                "muon-ckpt writes only into its run's own directories, never through a link "
                "(two runs never share data, and another run would delete what this one "
                "wrote there). Replace the link with a copy of what it links to, or use "
                "another url; nothing was written"
            )
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
        """Remove a file or a directory tree; a symlink is unlinked, its target kept, and
        nothing is deleted through one (a CheckpointError). What is gone already, or goes
        meanwhile (another process deleting the same step), is no error."""
        p = self.path(*parts)
        if self.is_local:
            link = self.link_in(*parts, last=False)
            if link is not None:  # (the link itself may go: rm of the link's own parts)
                raise CheckpointError(
                    f"{self.url_of(*parts)}: not deleted: it is reached through the symbolic "
                    f"link {link}, and deleting never follows a link out of the run's root"
                )
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


def _larger(where: str, limit: int) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{where}: larger than the {limit} bytes it may have; the step cannot be "
        "trusted. Load another step (muon-ckpt ls lists them) or delete it"
    )
