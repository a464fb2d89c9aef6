"""What a catalog remembers of the manifests it read, so a save's storage calls do not grow
with the run: a committed manifest never changes in place (a save of its step number writes
beside it and swaps it in, a prune deletes it), so it is read once, not at every save.

A remembered manifest is used only while nothing else can have changed it:

* locally, while its file is the same one (inode, size and modification time from a ``stat``,
  which is no read: a manifest edited by hand or swapped in by another process is read again);
* on other stores (no such stamp without a request per step), while this process has held
  the run's write lease since it read it: another job writes only after taking the lease over,
  which ``forget_unless`` sees at this process's next acquire, and then everything is read
  again. A catalog that has not taken the lease (a reader: ``load``, ``ls``) reads every time.

This catalog's own writes (a commit, a swap, a delete) update or drop what they change. The
data directories are remembered the same way (``clean``: a directory listed once with every
file live is not listed again while every one of them stays live; an old data directory never
gains files, a save writes a new one), so retention lists only what a deletion changed.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from muon_ckpt.store._layout import MANIFEST, Manifest
from muon_ckpt.store._steps import read_manifest
from muon_ckpt.store._storage import Storage

__all__ = ["ManifestMemo"]


class ManifestMemo:
    def __init__(self, storage: Storage, lease_ours: Callable[[], bool]) -> None:
        self.storage = storage
        self._ours = lease_ours
        self._manifests: dict[tuple[str, int | None], tuple[object, Manifest]] = {}
        self.clean: dict[str, frozenset[str]] = {}  # data directory -> its files, all live

    def _stamp(self, name: str) -> object | None:
        """What must be unchanged for a remembered manifest to stand; None: read it."""
        st = self.storage
        if st.is_local:
            try:
                s = os.stat(st.path(name, MANIFEST))
            except OSError:
                return None
            return (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns)
        return "lease" if st.object_store and self._ours() else None

    def read(self, storage: Storage, name: str, step: int | None) -> Manifest:
        """``read_manifest``, from memory where it stands (see the module)."""
        if storage is not self.storage:
            return read_manifest(storage, name, step)
        stamp = self._stamp(name)
        got = self._manifests.get((name, step))
        if stamp is not None and got is not None and got[0] == stamp:
            return got[1]
        m = read_manifest(storage, name, step)
        if stamp is not None:
            self._manifests[name, step] = (stamp, m)
        return m

    def wrote(self, name: str, manifest: Manifest) -> None:
        """This catalog wrote ``manifest`` into ``name`` (and read it back)."""
        self.drop(name)
        stamp = self._stamp(name)
        if stamp is not None:
            self._manifests[name, manifest.step] = (stamp, manifest)

    def drop(self, name: str) -> None:
        """``name`` was deleted or replaced by this catalog."""
        for key in [k for k in self._manifests if k[0] == name]:
            del self._manifests[key]

    def forget(self) -> None:
        """Another job may have written here: read everything again."""
        self._manifests.clear()
        self.clean.clear()
