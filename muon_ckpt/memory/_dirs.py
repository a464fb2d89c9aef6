"""Where the memory tier lives, who may read it, and what each part there says it is.

A tier root (``MemoryOptions.dir``; default ``/dev/shm/muon-ckpt-<uid>``) holds one directory
per run, named from the run's url, and in it one directory per step::

    <dir>/run-<16 hex>/run.json                  {"url": ...}: for muon-ckpt ls --memory
    <dir>/run-<16 hex>/step-00000700/rank-00002/  rank 2's own part of step 700
    <dir>/run-<16 hex>/step-00000700/copy-00000/  a replica of rank 0's part, held here

A part is what a rank needs to restore its own state at the same world size and layout: a
DCP checkpoint of this rank's flat state dict (its DTensors' local shards, every other tensor
and object whole) written alone, and a ``manifest.json`` written last (sizes and CRC32C of
every file, like a step's, plus what the part belongs to: url, line, rank, world size,
``node_size``, a digest of the rank's tensor layout). Directories are 0700 and files 0600; a
root or run directory that another user owns, or that others may write, is never read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import stat
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from muon_ckpt._errors import CheckpointError, CheckpointVersionError
from muon_ckpt._shards import chunk_of
from muon_ckpt._tensors import local_tensor
from muon_ckpt.store import MANIFEST, Manifest, parse_step_dirname, step_dirname

__all__ = [
    "RUN_FILE",
    "PartInfo",
    "copy_dirname",
    "default_root",
    "is_run_dirname",
    "layout_digest",
    "list_parts",
    "model_digest",
    "own_dirname",
    "part_manifest",
    "read_run_file",
    "run_dirname",
    "secure_dir",
    "step_dirs",
    "unsafe_reason",
    "write_run_file",
]

_OWN = re.compile(r"rank-(\d{5})")
_COPY = re.compile(r"copy-(\d{5})")
_RUN = re.compile(r"run-[0-9a-f]{16}")
RUN_FILE = "run.json"
MAX_PART_MANIFEST = 64 << 20  # bytes: a part's manifest is read only up to this


def default_root() -> str:
    """``/dev/shm/muon-ckpt-<uid>``: host memory that outlives the process (not the node)."""
    return os.path.join("/dev/shm", f"muon-ckpt-{os.getuid()}")


def run_dirname(url: str) -> str:
    """The run's directory in a tier root, from its url."""
    return "run-" + hashlib.blake2b(url.encode(), digest_size=8).hexdigest()


def own_dirname(step: int, rank: int) -> str:
    return f"{step_dirname(step)}/rank-{rank:05d}"


def copy_dirname(step: int, rank: int) -> str:
    return f"{step_dirname(step)}/copy-{rank:05d}"


def unsafe_reason(path: str) -> str | None:
    """Why the directory ``path`` must not be read (None when it is this user's own, not a
    symlink, and neither group nor others may write or read it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link, not a directory"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.getuid():
        return f"{path} belongs to user id {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & 0o077:
        return f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: others may read or change it"
    return None


def secure_dir(path: str) -> None:
    """Create ``path`` (and missing parents) 0700, or check that it is this user's own and
    private; CheckpointError saying what is wrong otherwise."""
    parent = os.path.dirname(path.rstrip("/"))
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    why = unsafe_reason(path)
    if why is not None:
        raise CheckpointError(
            f"memory tier: {why}; it is neither written nor read. Pass a directory of your "
            "own (MemoryOptions(dir=...), created 0700), or remove that directory"
        )


def layout_digest(sd: dict[str, Any]) -> str:
    """A digest of the model's tensors in a rank's flat state dict as this rank holds them:
    key, dtype, global shape and the chunk(s) it has (optimizer states follow their
    parameters, and may not exist yet when a load compares). A part restores only where the
    digest is the same."""
    h = hashlib.blake2b(digest_size=8)
    for key in sorted(sd):
        v = sd[key]
        if not isinstance(v, torch.Tensor) or not key.startswith("model."):
            continue
        if isinstance(v, DTensor):
            c = chunk_of(v)
            chunks = [(tuple(c.offsets), tuple(c.sizes))]
        else:
            chunks = [((0,) * v.dim(), tuple(v.shape))]
        t = local_tensor(v)
        h.update(repr((key, str(t.dtype), tuple(v.shape), chunks)).encode())
    return h.hexdigest()


def model_digest(sd: dict[str, Any]) -> str:
    """A digest of the model's tensors as any layout holds them: key and global shape. Two
    parts of one layout digest differ in it only when the model itself changed (a param
    renamed, added or resized): a load would refuse that step, not read another."""
    h = hashlib.blake2b(digest_size=8)
    for key in sorted(sd):
        v = sd[key]
        if isinstance(v, torch.Tensor) and key.startswith("model."):
            h.update(repr((key, tuple(v.shape))).encode())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class PartInfo:
    """A part found in a run directory: whose (``rank``), held as its own or as a copy, and
    what its manifest says (None with ``problem`` when it cannot be used)."""

    step: int
    rank: int
    copy: bool
    dirname: str
    manifest: Manifest | None
    problem: str | None = None
    newer: bool = False  # written by a newer muon-ckpt (its manifest's format)

    def meta(self, name: str) -> Any:
        m = self.manifest
        return None if m is None else m.extra.get("memory", {}).get(name)


def part_manifest(data: bytes, where: str) -> Manifest:
    """A part's manifest from its bytes; CheckpointError when it is not one."""
    m = Manifest.from_json(data, where)
    mem = m.extra.get("memory")
    ok = (
        isinstance(mem, dict)
        and isinstance(mem.get("url"), str)
        and type(mem.get("rank")) is int
        and type(mem.get("node_size")) is int
        and isinstance(mem.get("layout"), str)
        and isinstance(mem.get("save", ""), str)
    )
    if not ok:
        raise CheckpointError(f"{where}: not a memory-tier part (no 'memory' record)")
    return m


def list_parts(run_dir: str) -> list[PartInfo]:
    """Every committed-looking part under ``run_dir``, newest step first; a part without a
    manifest (written when the process died) is left out, one whose manifest is unreadable
    comes with ``problem``."""
    out: list[PartInfo] = []
    for step, sdir in step_dirs(run_dir).items():
        sname = os.path.basename(sdir)
        try:
            names = os.listdir(sdir)
        except (FileNotFoundError, NotADirectoryError):
            continue  # (another rank of the node dropped the step since step_dirs saw it)
        for pname in sorted(names):
            own, cp = _OWN.fullmatch(pname), _COPY.fullmatch(pname)
            if (own is None and cp is None) or os.path.islink(os.path.join(sdir, pname)):
                continue  # (a link is never a part, as a linked step directory is no step)
            rank = int((own or cp).group(1))  # type: ignore[union-attr]
            rel = f"{sname}/{pname}"
            path = os.path.join(run_dir, rel, MANIFEST)
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            try:
                with open(path, "rb") as f:
                    data = f.read(MAX_PART_MANIFEST + 1)
            except FileNotFoundError:
                continue  # (dropped by another rank since: no part, as one without a manifest)
            except OSError as e:
                out.append(PartInfo(step, rank, cp is not None, rel, None, str(e)))
                continue
            try:
                if len(data) > MAX_PART_MANIFEST:
                    raise CheckpointError(f"{path}: larger than {MAX_PART_MANIFEST} bytes")
                m = part_manifest(data, path)
                if m.step != step or m.extra["memory"]["rank"] != rank:
                    raise CheckpointError(
                        f"{path}: names step {m.step} rank {m.extra['memory']['rank']}, in the "
                        f"directory of step {step} rank {rank}"
                    )
                out.append(PartInfo(step, rank, cp is not None, rel, m))
            except CheckpointVersionError as e:
                out.append(PartInfo(step, rank, cp is not None, rel, None, str(e), newer=True))
            except CheckpointError as e:
                out.append(PartInfo(step, rank, cp is not None, rel, None, str(e)))
    out.sort(key=lambda p: (-p.step, p.rank, p.copy))
    return out


def write_run_file(run_dir: str, url: str) -> None:
    """``run.json``: which url the run directory belongs to (for listings)."""
    path = os.path.join(run_dir, RUN_FILE)
    if os.path.exists(path):
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps({"url": url}).encode())
    os.replace(tmp, path)


def read_run_file(run_dir: str) -> str | None:
    try:
        with open(os.path.join(run_dir, RUN_FILE), "rb") as f:
            url = json.loads(f.read(1 << 16)).get("url")
        return url if isinstance(url, str) else None
    except (OSError, ValueError, AttributeError):
        return None


def is_run_dirname(name: str) -> bool:
    return _RUN.fullmatch(name) is not None


def step_dirs(run_dir: str) -> dict[int, str]:
    """step -> its directory, under ``run_dir``."""
    out = {}
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return out
    for n in names:
        s, path = parse_step_dirname(n), os.path.join(run_dir, n)
        if s is not None and os.path.isdir(path) and not os.path.islink(path):
            out[s] = path
    return out
