"""The run's index, ``<url>/index.json``: what each step directory's manifest says of the
run's history, written by rank 0 after each save's last change, so that a process reads the
manifest of the step it loads and not every one (which step is live needs every commit's
generation and retirements: ``_lines``).

The index is a cache, never the truth: an entry stands only where the manifest it was made
from is still the one there, by the stamp it records (``_memo``: locally device, inode, size
and modification time, from a ``stat``; on object stores entity tag and size, from a listing
of the step directories). A directory the index does not name, or names with another stamp
(a step written since, by hand or by an older version), is read as before; an index that
does not parse is no index. It also names the data directories found with every file live,
and the step directories naming their files then (``_data.collect_data``): such a directory
is not listed again while each of those stands. Cost: one PUT by rank 0 after each save (in
its job, after retention) and a HEAD of the manifest it committed; one GET by a process that
finds a step directory it knows nothing of.

Shape::

    {"format": "muon-ckpt-index", "version": 1,
     "steps": [{"dir": "step-00000500", "step": 500, "gen": 7, "line": "...",
                "retires": [[600, 6]], "passes": [[600, 6, "why"]], "size": 9437199,
                "files": 5, "stored": 2, "data": ["00000500-5f0c2a9e7b1d4c83"],
                "time": "2026-...", "world_size": 2,
                "stamp": [dev, inode, size, mtime_ns] or ["<entity tag>", size]}, ...],
     "clean": {"00000500-5f0c2a9e7b1d4c83": ["step-00000500", ...]}}
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from muon_ckpt._errors import CheckpointCorruptError
from muon_ckpt.store._entry import _bounded
from muon_ckpt.store._layout import (
    _LINE_RE,
    _mapping,
    _passed,
    _retired,
    parse_data_dirname,
    parse_step_dirname,
)
from muon_ckpt.store._steps import COMMITTED, OVERWRITE, StepInfo
from muon_ckpt.store._storage import Storage

__all__ = ["INDEX", "Index", "read_index", "write_index"]

Stamp = tuple[int | str, ...]

INDEX = "index.json"
_FORMAT = "muon-ckpt-index"
_VERSION = 1
MAX_INDEX_BYTES = 256 << 20  # ~300 bytes a step: a million steps

_log = logging.getLogger("muon_ckpt")


@dataclass(frozen=True)
class Index:
    """An index as read: each directory's entry (its manifest's stamp, its info), and the
    data directories found with every file live (-> the step directories naming them)."""

    entries: dict[str, tuple[Stamp, StepInfo]]
    clean: dict[str, frozenset[str]]


def read_index(storage: Storage) -> Index | None:
    """The run's index; None where there is none, or it does not parse (then the manifests
    are read, as without one)."""
    try:
        data = storage.read_bytes(INDEX, limit=MAX_INDEX_BYTES)
    except (FileNotFoundError, CheckpointCorruptError):
        return None
    try:
        return _parse(json.loads(data))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        _log.debug("%s: not used (%s)", storage.url_of(INDEX), e)
        return None


def write_index(
    storage: Storage, entries: list[tuple[Stamp, StepInfo]], clean: dict[str, frozenset[str]]
) -> None:
    """Write the index of ``entries`` (committed directories' infos, as ``read_step`` gives
    them, with their manifests' stamps) and ``clean`` (``_data.collect_data``'s)."""
    out = [_entry(stamp, i) for stamp, i in sorted(entries, key=lambda e: e[1].dirname)]
    named = {i.dirname for _, i in entries}
    data = {d: sorted(by) for d, by in sorted(clean.items()) if by <= named}
    d = {"format": _FORMAT, "version": _VERSION, "steps": out, "clean": data}
    storage.write_bytes(json.dumps(d, separators=(",", ":")).encode(), INDEX, durable=False)


def _entry(stamp: Stamp, i: StepInfo) -> dict[str, Any]:
    return {
        "dir": i.dirname,
        "step": i.step,
        "gen": i.gen or 0,
        "line": i.line,
        "retires": [list(r) for r in i.retires],
        "passes": [list(p) for p in i.passes],
        "size": i.size,
        "files": i.files,
        "stored": i.stored,
        "data": list(i.refers),
        "time": i.time,
        "world_size": i.world_size,
        "stamp": list(stamp),
    }


def _parse(d: Any) -> Index:
    if not isinstance(d, dict) or d.get("format") != _FORMAT or d.get("version") != _VERSION:
        raise ValueError("not an index of this version")
    entries: dict[str, tuple[Stamp, StepInfo]] = {}
    for e in d["steps"]:
        stamp, info = _info(e)
        entries[info.dirname] = (stamp, info)
    clean = {}
    for name, by in _mapping("clean", d.get("clean", {})).items():
        if parse_data_dirname(name) is None or not all(n in entries for n in by):
            raise ValueError(f"clean: {str(name)[:40]!r}")
        clean[name] = frozenset(by)
    return Index(entries, clean)


def _info(e: dict[str, Any]) -> tuple[Stamp, StepInfo]:
    """One entry, checked as a manifest's fields are (``Manifest.from_json``)."""
    name = e["dir"]
    step = parse_step_dirname(name.removeprefix(OVERWRITE)) if isinstance(name, str) else None
    if step is None or step != _bounded("step", e["step"]):
        raise ValueError(f"dir {str(name)[:40]!r} is not the directory of step {e['step']!r}")
    line = e["line"]
    if line is not None and not (isinstance(line, str) and _LINE_RE.fullmatch(line)):
        raise ValueError(f"line {str(line)[:40]!r}")
    if not isinstance(e["time"], str):
        raise ValueError("time is not a string")
    stamp = e["stamp"]
    if not (isinstance(stamp, list) and all(type(x) in (int, str) for x in stamp)):
        raise ValueError("stamp is not a list of integers and strings")
    info = StepInfo(
        step,
        name,
        COMMITTED,
        size=_bounded("size", e["size"]),
        files=_bounded("files", e["files"]),
        time=e["time"],
        world_size=_bounded("world_size", e["world_size"], low=1),
        gen=_bounded("gen", e["gen"]),
        line=line,
        retires=[_retired(r) for r in e["retires"]],
        passes=[_passed(p) for p in e["passes"]],
        stored=None if e["stored"] is None else _bounded("stored", e["stored"]),
        refers=[_data_dir(x) for x in e["data"]],
    )
    return tuple(stamp), info


def _data_dir(name: Any) -> str:
    if not isinstance(name, str) or parse_data_dirname(name) is None:
        raise ValueError(f"data {str(name)[:40]!r} is not a data directory's name")
    return name
