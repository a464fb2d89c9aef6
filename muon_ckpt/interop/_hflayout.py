"""The Hugging Face checkpoint layout, exactly as ``huggingface_hub.save_torch_state_dict`` writes
it (with ``filename_pattern="{stem}{suffix}.safetensors"``)::

    model.safetensors                        everything, when it fits in one shard (no index)
    model-00001-of-00003.safetensors, ...    else shards of at most max_shard_size bytes, and
    model.safetensors.index.json             {"metadata": {"total_size": N, ...},
                                              "weight_map": {name: shard file}}

Shards are filled in order: a tensor joins the current shard unless it would tip it over
``max_shard_size`` (a new shard starts); a tensor larger than ``max_shard_size`` gets a shard
of its own. Every file's safetensors metadata holds ``{"format": "pt"}`` (transformers refuses
files without it). A tied weight is written once; the dropped name maps to the kept one in the
index's metadata (one file: in that file's metadata), as huggingface_hub records it.

Names: model FQNs with the wrappers that torch.compile (``_orig_mod``), DDP (``module``) and
activation checkpointing add removed (``_fqn.strip_wrappers``), then an optional user rename
(``make_renamer``). huggingface_hub is never imported here: it is not a dependency.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from muon_ckpt._errors import CheckpointCorruptError, CheckpointNotFoundError
from muon_ckpt.store import Storage

__all__ = [
    "MODEL_STEM",
    "OPTIMIZER_STEM",
    "index_json",
    "index_name",
    "make_renamer",
    "old_files",
    "parse_size",
    "plan_shards",
    "read_set",
    "single_name",
]

MODEL_STEM, OPTIMIZER_STEM = "model", "optimizer"  # model*.safetensors, optimizer*.safetensors
_MAX_INDEX = 10 * 1024 * 1024  # huggingface_hub's limit: an index is metadata
SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # as huggingface_hub

Renamer = Callable[[str], str]


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB``, ``100KB``, ``1.5MB`` (decimal units, as huggingface_hub parses
    them), a number of bytes, or its digits."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str) and size.strip().isdigit():
        value = int(size.strip())
    elif isinstance(size, str) and size.strip()[-2:].upper() in SIZE_UNITS:
        s = size.strip()
        try:
            value = int(float(s[:-2]) * SIZE_UNITS[s[-2:].upper()])
        except ValueError:
            value = 0
    else:
        value = 0
    if value <= 0:
        raise ValueError(
            f"max_shard_size must be a positive number of bytes or a size such as '5GB', "
            f"'500MB', '100KB' (units {', '.join(SIZE_UNITS)}, as huggingface_hub writes them), "
            f"got {size!r}"
        )
    return value


def make_renamer(rename: Mapping[str, str] | Callable[[str], str] | None) -> Renamer:
    """A name -> name function from ``rename``: a callable as is; a mapping of regular
    expression -> replacement, where the first pattern that matches the whole name rewrites it
    (``re.fullmatch``, groups as ``\\1``), and a name that no pattern matches is kept."""
    if rename is None:
        return lambda name: name
    if callable(rename) and not isinstance(rename, Mapping):
        return rename
    if not isinstance(rename, Mapping):
        raise TypeError(
            f"rename must be a mapping of regex -> replacement or a callable, got "
            f"{type(rename).__name__}"
        )
    rules = []
    for pattern, repl in rename.items():
        if not isinstance(pattern, str) or not isinstance(repl, str):
            raise TypeError(f"rename must map strings to strings, got {pattern!r}: {repl!r}")
        try:
            rules.append((re.compile(pattern), repl))
        except re.error as e:
            raise ValueError(f"rename pattern {pattern!r} is not a regular expression: {e}") from e

    def renamer(name: str) -> str:
        for rx, repl in rules:
            m = rx.fullmatch(name)
            if m is not None:
                try:
                    return m.expand(repl)
                except (re.error, IndexError) as e:
                    raise ValueError(
                        f"rename replacement {repl!r} of pattern {rx.pattern!r} does not fit "
                        f"{name!r}: {e}"
                    ) from e
        return name

    return renamer


def single_name(stem: str) -> str:
    return f"{stem}.safetensors"


def index_name(stem: str) -> str:
    return f"{stem}.safetensors.index.json"


def old_files(stem: str, names: Iterable[str]) -> list[str]:
    """The files of a previous export with this ``stem`` among ``names``, index first (so
    that a crash while removing them never leaves an index over missing shards)."""
    rx = re.compile(re.escape(stem) + r"(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
    found = [n for n in names if rx.fullmatch(n)]
    return sorted(found, key=lambda n: (not n.endswith(".index.json"), n))


def plan_shards(sizes: Iterable[tuple[str, int]], max_size: int, stem: str) -> dict[str, list[str]]:
    """File name -> tensor names, in order: huggingface_hub's split of ``sizes`` (name, bytes)."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes:
        if size > max_size:
            shards.append([name])
            continue
        if current and current_size + size > max_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    if len(shards) <= 1:
        return {single_name(stem): shards[0] if shards else []}
    n = len(shards)
    return {f"{stem}-{k + 1:05d}-of-{n:05d}.safetensors": s for k, s in enumerate(shards)}


def index_json(total_size: int, files: Mapping[str, list[str]], meta: Mapping[str, str]) -> bytes:
    """``model.safetensors.index.json``'s bytes, as huggingface_hub writes them."""
    weight_map = {name: fname for fname, names in files.items() for name in names}
    index = {"metadata": {"total_size": total_size, **meta}, "weight_map": weight_map}
    return json.dumps(index, indent=2).encode()


def read_set(st: Storage, stem: str) -> tuple[list[str], dict[str, Any]]:
    """The files of the set ``stem`` at ``st`` (the index's shards, or the one file) and the
    index's metadata ({} for one file). Shard names must be plain file names (no paths)."""
    if not st.exists(index_name(stem)):
        if st.exists(single_name(stem)):
            return [single_name(stem)], {}
        raise CheckpointNotFoundError(
            f"{st.url!r}: no {index_name(stem)} or {single_name(stem)} (the Hugging Face "
            f"layout that export_hf writes); found {st.listdir()[:8]}"
        )
    where = st.url_of(index_name(stem))
    if st.size(index_name(stem)) > _MAX_INDEX:
        raise CheckpointCorruptError(f"{where}: larger than {_MAX_INDEX} bytes; not an index")
    try:
        index = json.loads(st.read_bytes(index_name(stem)))
        files = sorted(set(index["weight_map"].values()))
        meta = dict(index.get("metadata") or {})
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointCorruptError(
            f"{where}: not a safetensors index (expected JSON with a 'weight_map' object of "
            f"name -> file; {type(e).__name__}: {e})"
        ) from e
    for f in files:
        if not isinstance(f, str) or posixpath.basename(f) != f or not f.endswith(".safetensors"):
            raise CheckpointCorruptError(
                f"{where}: weight_map names {f!r}; expected a .safetensors file in the same "
                "directory"
            )
        if not st.exists(f):
            raise CheckpointCorruptError(
                f"{st.url_of(f)}: named by {index_name(stem)} but missing; the export is "
                "incomplete: export again or restore the file"
            )
    return files, meta
