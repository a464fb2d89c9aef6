"""The run's data (format 3): the data files under ``<url>/data/`` that steps refer to.

A save writes its data files to ``data/<step>-<save id>/`` and names every data file its
step needs in its ``.metadata`` and manifest as ``../data/<dir>/<file>``: the files it wrote
and the files of earlier saves that hold the tensors it did not write again (unchanged since).
So the manifests alone say which files are live: a data file is live while a manifest in a
step directory names it. ``collect`` deletes the others. It runs on rank 0 under the write
lease, at points where no save of the run is writing (``Catalog.begin``, ``Catalog.tidy``,
``prune``), so the only data files no manifest names are those of saves that crashed and
those of deleted steps that no kept step refers to. A crash anywhere in it (or in the step
deletions before it) leaves every manifest that was there, and so every file they name.
It reads a manifest only for a data directory that may hold dead files: one no step names
(all its files are), or one not found all live since the steps naming it last changed
(``clean``, kept by the catalog and in the run's index: an old data directory never gains
files, so it stays all live while every step naming it stays).

A step directory deleted by hand takes none of the data with it: the steps that refer to
its data still load, and ``collect`` deletes what only it named. A data file deleted by hand
makes every step that names it corrupt (missing, at load and ``verify``).

A run's data is its own. ``data`` or a directory in it that is a symbolic link (a run forked
by linking another's data) is never collected, deleted, read or written through: a step
naming data behind a link is corrupt here (``listing``; ``load()`` falls back, ``verify``
fails it), and a save that would write there is refused (``Storage.makedirs``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from muon_ckpt._errors import CheckpointError
from muon_ckpt.store._layout import (
    DATA,
    Manifest,
    data_ref,
    data_ref_name,
    is_file_name,
    parse_data_dirname,
)
from muon_ckpt.store._steps import CORRUPT, NEWER, StepInfo
from muon_ckpt.store._storage import Storage

__all__ = ["collect_data", "listing"]

_log = logging.getLogger("muon_ckpt")


def listing(storage: Storage, parts: tuple[str, ...], names: set[str]) -> dict[str, dict[str, Any]]:
    """fsspec info (``size``, ``type``, ...) of the files ``names`` (a manifest's: plain names
    of the step directory ``parts``, and ``../data/<dir>/<file>``), by name, from one listing
    of the step directory and one of each data directory named; a name not listed is absent."""
    out: dict[str, dict[str, Any]] = {}
    dirs = sorted({ref[0] for n in names if (ref := data_ref(n)) is not None})
    if len(dirs) < len(names) or not names:
        out.update(storage.walk_info(*parts))
    for d in dirs:
        storage.check_unlinked(*parts, "..", DATA, d)  # (never another run's, through a link)
        for fname, info in storage.walk_info(*parts, "..", DATA, d).items():
            out[data_ref_name(d, fname)] = info
    return out


def collect_data(
    storage: Storage,
    step_dirs: dict[int, list[str]],
    info: Callable[[str, int], StepInfo],
    read: Callable[[Storage, str, int | None], Manifest],
    clean: dict[str, frozenset[str]],
) -> list[str]:
    """Delete the data files under ``<root>/data/`` that no manifest in ``step_dirs`` (step ->
    its directories) names, and the data directories left empty. Nothing while a step of a
    newer format is there; a step whose manifest is invalid keeps the data directories of its
    step number (what it refers to is not known); a name this version does not make is never
    deleted, nor anything that is or lies behind a symbolic link (``data`` itself or one of
    its directories: another run's data, which that run collects). Returns what went.
    ``info``: a step directory's info (``refers``: the data directories its manifest names),
    ``read``: its manifest, read only for a data directory that may hold dead files;
    ``clean``: data directory -> the step directories naming its files when every one was
    found live (kept up to date here): not listed again while all of those still name it."""
    if storage.is_link(DATA):
        _log.warning(
            "%s: not collected: %s is a symbolic link (a run's data is its own; through the "
            "link it is another run's, which that run collects)",
            storage.url,
            storage.url_of(DATA),
        )
        return []
    dirs = storage.list_dirs(DATA)
    if not dirs:
        return []
    by: dict[str, dict[str, int]] = {}  # data directory -> the step directories naming it
    keep: set[int] = set()
    for step, names in step_dirs.items():
        for name in names:
            got = info(name, step)
            if got.status == NEWER:
                return []
            if got.status == CORRUPT:
                keep.add(step)
            elif got.committed:
                for d in got.refers:
                    by.setdefault(d, {})[name] = step
    gone = []
    for name in [n for n in clean if n not in dirs]:
        del clean[name]
    for name, is_dir in dirs.items():
        of = parse_data_dirname(name)
        if not is_dir or of is None or of in keep or storage.is_link(DATA, name):
            continue
        refs = by.get(name, {})
        if name in clean and clean[name] <= refs.keys():
            continue  # (every file live, and every step that named one still names it)
        clean.pop(name, None)
        live = _live(storage, name, refs, read)
        if live is None:
            continue
        files = storage.walk_files(DATA, name)
        dead = sorted(f for f in files if is_file_name(f) and f not in live)
        if files and not dead:
            clean[name] = frozenset(refs)
        if len(dead) == len(files):
            storage.rm(DATA, name)  # (never follows a link inside)
            gone.append(name)
            continue
        for f in dead:
            storage.rm(DATA, name, f)
            gone.append(f"{name}/{f}")
    return gone


def _live(
    storage: Storage,
    name: str,
    refs: dict[str, int],
    read: Callable[[Storage, str, int | None], Manifest],
) -> set[str] | None:
    """The files of data directory ``name`` that the manifests in ``refs`` name; None where
    one of them cannot be read now (then nothing there is deleted)."""
    live: set[str] = set()
    for step_dir, step in refs.items():
        try:
            m = read(storage, step_dir, step)
        except (FileNotFoundError, CheckpointError):
            return None
        live.update(ref[1] for n in m.files if (ref := data_ref(n)) is not None and ref[0] == name)
    return live
