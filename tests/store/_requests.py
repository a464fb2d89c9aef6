"""Counting a run's storage requests (tests/store/test_request_counts.py,
benchmarks/bench_requests.py): ``LocalCounter`` counts the opens and directory listings under
a local root (a Python audit hook: it sees fsspec's too); ``ProxyCounter`` the S3 requests a
``tests._faults.FaultProxy`` saw on one rank's port, the multipart ones as one kind.
``synthetic_steps`` makes a long run quickly."""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any


class LocalCounter:
    """Counts ``open`` and directory listings under ``root`` (a Python audit hook: it sees
    every open and listing this process makes, fsspec's included)."""

    def __init__(self) -> None:
        self.root: str | None = None
        self.seen: dict[str, int] = {}
        self.opened: list[str] = []  # the paths opened since ``clear()``, in order
        self.thread: int | None = None  # set: count only this thread's (not a save's job)
        sys.addaudithook(self._hook)

    def clear(self) -> None:
        self.seen.clear()
        self.opened.clear()

    def read(self) -> dict:
        return dict(self.seen)

    def _hook(self, event: str, args: tuple) -> None:
        if self.root is None or event not in ("open", "os.listdir", "os.scandir"):
            return
        if self.thread is not None and threading.get_ident() != self.thread:
            return
        path = args[0] if args else None
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if isinstance(path, str) and path.startswith(self.root):
            kind = "open" if event == "open" else "listdir"
            self.seen[kind] = self.seen.get(kind, 0) + 1
            if kind == "open":
                self.opened.append(path)


class ProxyCounter:
    """The requests that came to ``rank``'s port of a ``FaultProxy`` since ``clear()``, by
    kind (CREATE, PART, COMPLETE and ABORT as ``multipart``; BUCKET, the bucket's own, left
    out), read through its control path (``control_url``: from any process, a rank of a
    distributed run too)."""

    def __init__(self, control_url: str, rank: int = 0, *, paths: bool = False) -> None:
        from tests._faults import FaultControl

        self.control = FaultControl(control_url)
        self.rank = rank
        self.since: dict[str, int] = {}
        self._logged: int | None = 0 if paths else None  # (``paths``: the proxy's whole log)

    def _totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (rank, kind), n in self.control.seen().items():
            kind = _MULTIPART.get(kind, kind)
            if rank == self.rank and kind != "BUCKET":
                out[kind] = out.get(kind, 0) + n
        return out

    def clear(self) -> None:
        self.since = self._totals()
        if self._logged is not None:
            self._logged = len(self.control.log())

    def paths(self, kind: str) -> list[str]:
        """The keys (path-style: ``/bucket/key``) of this rank's requests of ``kind`` since
        ``clear()``, in order (made with ``paths=True``)."""
        assert self._logged is not None, "ProxyCounter(..., paths=True)"
        log = self.control.log()[self._logged :]
        return [
            path.partition("?")[0] for rank, k, _, path, _ in log if rank == self.rank and k == kind
        ]

    def read(self) -> dict[str, int]:
        got = {k: n - self.since.get(k, 0) for k, n in self._totals().items()}
        return {k: n for k, n in got.items() if n}


_MULTIPART = dict.fromkeys(("CREATE", "PART", "COMPLETE", "ABORT"), "multipart")


def synthetic_steps(url: str, opts: dict[str, Any], last: int) -> None:
    """Steps 2..``last`` as copies of step 1's manifest and metadata (step number changed),
    each also naming a data directory of its own (a copy of step 1's data files, listed in its
    manifest beside the ones its metadata reads), so the run's data grows with its steps as
    a run's whose every save writes new data does."""
    from muon_ckpt.store import MANIFEST, METADATA, Storage, data_dirname, step_dirname
    from muon_ckpt.store._layout import data_ref, data_ref_name

    st = Storage(url, opts)
    src = step_dirname(1)
    manifest = json.loads(st.read_bytes(src, MANIFEST))
    meta = st.read_bytes(src, METADATA)
    data = {n: (ref, e) for n, e in manifest["files"].items() if (ref := data_ref(n))}
    blobs = {n: st.read_bytes(src, n) for n in data}
    files = {}
    for s in range(2, last + 1):
        own = data_dirname(s, f"{s:016x}")
        entries = dict(manifest["files"])
        for n, ((_, fname), e) in data.items():
            entries[data_ref_name(own, fname)] = e
            files[st.path("data", own, fname)] = blobs[n]
        gens = {**manifest.get("data_gens", {}), own: manifest.get("gen", 0)}
        m = {**manifest, "step": s, "files": entries, "data_gens": gens}
        files[st.path(step_dirname(s), METADATA)] = meta
        files[st.path(step_dirname(s), MANIFEST)] = json.dumps(m, indent=1).encode()
    if st.is_local:
        for p, blob in files.items():
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(blob)
    else:
        st.fs.pipe(files)
