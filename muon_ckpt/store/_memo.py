"""What a catalog remembers of the manifests it read, so that storage calls do not grow with
the run: a committed manifest never changes in place but when a save of its step number
replaces it (an overwrite, a rewind's) or a prune or retention deletes it, so it is read
once per process, and the run's index (``_run_index``) spares even that where it stands.

A remembered manifest, or a step directory's info (what ``read_step`` makes of it, from the
manifest or the index), stands while its manifest is the same object:

* locally, by its stamp: device, inode, size and modification time, from a ``stat`` (no
  read: a manifest edited by hand or swapped in by another process is read again);
* on object stores, by its entity tag and size (S3's ETag, GCS's generation) from one
  listing of the step directories (``Storage.stamps``: a page per 1,000 objects, two objects
  a step with dedup), made by a scan that has something to check against it; and, while the
  catalog's lease is ``ours`` (acquired, not expired since, not renewed by another manager of
  this process since), whatever it checked or read since it acquired it (``_leased``: another
  job writes only after the expiry and a takeover, another manager of the process only after
  its own acquire; the next acquire sees either, and what was read is checked against the
  listing once more);
* on ``memory://`` (no stamps), never.

This catalog's own writes (a commit, a swap, a delete) update or drop what they change. The
data directories are remembered the same way (``clean``: a directory found with every file
live, and the step directories naming them, from the index too; it is not listed again while
each of those steps stands: an old data directory never gains files, a save writes a new
one), so a save lists only what a deletion or a crash changed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import Any

from muon_ckpt.store._layout import MANIFEST, STEP_PREFIX, Manifest
from muon_ckpt.store._run_index import Index, read_index, write_index
from muon_ckpt.store._steps import StepInfo, read_manifest, read_step
from muon_ckpt.store._storage import Storage

__all__ = ["ManifestMemo"]

Stamp = tuple  # (dev, inode, size, mtime_ns, ctime_ns) locally; (entity tag, size) on object stores
_PAGE = 1000  # objects a listing returns per request (S3's and GCS's most)


class ManifestMemo:
    def __init__(self, storage: Storage, lease_ours: Callable[[], bool]) -> None:
        self.storage = storage
        self._ours = lease_ours
        self._manifests: dict[tuple[str, int | None], tuple[Stamp | None, Manifest]] = {}
        self._infos: dict[str, tuple[Stamp | None, StepInfo]] = {}  # committed directories'
        self._listed: dict[str, Stamp] | None = None  # object stores: the last stamps listed
        self._leased: set[str] = set()  # checked or read since this process took the lease
        self._indexed: set[str] | None = None  # directories the index was last read for
        # Data directory -> the step directories naming its files, when all were live
        self.clean: dict[str, frozenset[str]] = {}

    # ------------------------------------------------------------------ what stands
    def _now(self, name: str) -> Stamp | None:
        """The stamp ``name``'s manifest has now, where it is known without a read."""
        st = self.storage
        if st.is_local:
            try:
                s = os.stat(st.path(name, MANIFEST))
            except OSError:
                return None
            # (ctime too: os.utime can set a rewritten file's mtime back, never its ctime)
            return (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)
        return None if self._listed is None else self._listed.get(name)

    def _stands(self, name: str, stamp: Stamp | None) -> bool:
        """Whether what was remembered of ``name`` with ``stamp`` stands (see the module)."""
        st = self.storage
        if st.object_store and self._ours() and name in self._leased:
            return True
        if not (st.is_local or st.object_store) or stamp is None or stamp != self._now(name):
            return False
        if st.object_store and self._ours():
            self._leased.add(name)
        return True

    # ------------------------------------------------------------------ reads
    def read(self, storage: Storage, name: str, step: int | None) -> Manifest:
        """``read_manifest``, from memory where it stands (see the module)."""
        if storage is not self.storage:
            return read_manifest(storage, name, step)
        got = self._manifests.pop((name, step), None)
        if got is not None and self._stands(name, got[0]):
            self._manifests[name, step] = got
            return got[1]
        # (stamped as listed before the read: one changed in between is read again)
        stamp = self._now(name)
        m = read_manifest(storage, name, step)
        if self.storage.is_local or self.storage.object_store:
            self._manifests[name, step] = (stamp, m)
            if name in self._infos and self._infos[name][0] != stamp:
                del self._infos[name]  # (made from another manifest, or not known to be)
            if self.storage.object_store and self._ours():
                self._leased.add(name)
        return m

    def info(self, name: str, step: int) -> StepInfo:
        """``read_step`` of directory ``name``, from memory (or the index) where it stands."""
        got = self._infos.pop(name, None)
        if got is not None and got[1].step == step and self._stands(name, got[0]):
            self._infos[name] = got
            return _copy(got[1])
        if got is not None:
            self._changed(name)
        info = read_step(self.storage, name, step, read=self.read)
        read = self._manifests.get((name, step))
        if info.committed and read is not None:
            self._infos[name] = (read[0], _copy(info))
        return info

    def check(self, names: Iterable[str]) -> None:
        """Before a scan reads the step directories ``names``: what is remembered of them
        made checkable -- the index read where some have nothing remembered (and it was not
        read for them), and on an object store the stamps listed where something remembered
        is not known to stand (under this process's lease, nothing) and a listing costs
        fewer requests than reading those manifests."""
        st = self.storage
        if not (st.is_local or st.object_store):
            return
        self._listed = None
        names = [n for n in names if n.startswith(STEP_PREFIX)]  # (an overwrite's: read)
        leased = self._leased if st.object_store and self._ours() else set()
        names = [n for n in names if n not in leased]
        missing = {n for n in names if n not in self._infos}
        if missing and (self._indexed is None or not missing <= self._indexed):
            self._indexed = set(names)
            self._take(read_index(st))
        known = [self._infos[n][1] for n in names if n in self._infos]
        if st.object_store and known:
            objects = sum(i.stored or 2 for i in known) + 2 * (len(names) - len(known))
            if -(-objects // _PAGE) < len(known):  # (a page lists 1,000 objects)
                self._listed = _stamps(st)

    def _take(self, index: Index | None) -> None:
        """The index's entries where nothing is remembered of a directory, and its data
        directories found all live where every step naming them is as the index says (then
        they stand while those steps do: ``_changed``)."""
        same = set()
        for name, (stamp, info) in ({} if index is None else index.entries).items():
            if name not in self._infos and name not in self._leased:
                self._infos[name] = (stamp, info)
            if self._infos.get(name, (None,))[0] == stamp:
                same.add(name)
        for name, by in ({} if index is None else index.clean).items():
            if by <= same:
                self.clean.setdefault(name, by)

    # ------------------------------------------------------------------ writes
    def publish(self, names: list[str]) -> None:
        """Write the index of the committed directories ``names`` from what is remembered of
        them (under this process's lease); on an object store a stamp not known yet (a
        manifest this process wrote or read without a listing) is asked for: a HEAD each,
        or one listing for more than two."""
        st = self.storage
        lacking = [n for n in names if n in self._infos and self._infos[n][0] is None]
        if st.object_store and lacking:
            found = _stamps(st) if len(lacking) > 2 else {}
            for n in lacking:
                stamp = found.get(n) or _tag(st.info(n, MANIFEST))
                self._infos[n] = (stamp, self._infos[n][1])
        entries = [self._infos[n] for n in names if n in self._infos]
        write_index(st, [(s, i) for s, i in entries if s is not None], self.clean)

    def wrote(self, name: str, manifest: Manifest) -> None:
        """This catalog wrote ``manifest`` into ``name`` (and read it back)."""
        self.drop(name)
        stamp = self._now(name) if self.storage.is_local else None
        if self.storage.object_store:
            self._leased.add(name)  # (under the lease: no stamp needed until it is published)
        if self.storage.is_local or self.storage.object_store:
            self._manifests[name, manifest.step] = (stamp, manifest)

    def drop(self, name: str) -> None:
        """``name`` was deleted or replaced by this catalog."""
        self._changed(name)
        self._infos.pop(name, None)
        self._leased.discard(name)
        if self._listed is not None:  # (what was listed is no longer there)
            self._listed.pop(name, None)
        for key in [k for k in list(self._manifests) if k[0] == name]:
            self._manifests.pop(key, None)

    def handover(self) -> None:
        """An acquire or check found the lease not this process's: what was read stands
        only as its stamps say (``clean`` as the steps naming each directory stand)."""
        self._leased.clear()

    def _changed(self, name: str) -> None:
        """Step directory ``name`` holds another commit now (or none): a data directory
        whose files it named may hold dead ones."""
        for d, by in list(self.clean.items()):  # (a list: a save's job may add meanwhile)
            if name in by:
                self.clean.pop(d, None)


def _stamps(st: Storage) -> dict[str, Stamp]:
    """Step directory -> its manifest's stamp, from one listing of every object of the step
    directories ({} where the store lists no tags: then manifests are read)."""
    try:
        found = st.walk_info(prefix=STEP_PREFIX)
    except TypeError:  # (a filesystem whose find takes no prefix)
        return {}
    out = {}
    for path, info in found.items():
        name, _, fname = path.partition("/")
        if fname == MANIFEST and (tag := _tag(info)) is not None:
            out[name] = tag
    return out


def _tag(info: dict[str, Any]) -> Stamp | None:
    """An object's stamp: its entity tag (S3's ETag, GCS's generation) and size."""
    tag = info.get("ETag") or info.get("etag") or info.get("generation")
    return None if tag is None else (str(tag), int(info.get("size") or 0))


def _copy(info: StepInfo) -> StepInfo:
    """A copy a scan may mark (``mark_superseded`` sets status and problem in place)."""
    return dataclasses.replace(info, retires=list(info.retires), passes=list(info.passes))
