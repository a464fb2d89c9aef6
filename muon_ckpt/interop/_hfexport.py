"""Export a checkpoint in the Hugging Face layout: model weights by their plain FQNs, sharded
``model-0000K-of-0000N.safetensors`` plus ``model.safetensors.index.json`` (``_hflayout``), so
``model.load_state_dict``, transformers and ``huggingface_hub.load_torch_model`` read it.

Runs in one process with no process group, whatever the world size of the save, through the
verifying reader (``load.CheckpointReader``) as ``export_safetensors`` does. Streams: a shard is
written tensor by tensor, read a batch (at most 256 MiB, or one larger tensor) at a time, so
memory holds at most one batch, never a whole shard set. Each file is written atomically; a
previous export's files of the same set are removed first (index first) and the index is
written last, so an interrupted export leaves no index that names a missing shard.

Optimizer state (``include=("optim",)``) goes to its own set, ``optimizer*.safetensors``, keys
``state.<name>.<state key>`` (as ``import_optimizer_state`` reads them); the step and the
hyperparameters (JSON, ``optim.param_groups``) go into the metadata (the file's, or the
index's when sharded).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from muon_ckpt._progress import progress_bar
from muon_ckpt.interop._export import (
    Item,
    export_items,
    nothing_to_export,
    parse_dtype,
    read_items,
    section_of,
)
from muon_ckpt.interop._hflayout import (
    MODEL_STEM,
    OPTIMIZER_STEM,
    index_json,
    index_name,
    make_renamer,
    old_files,
    parse_size,
    plan_shards,
)
from muon_ckpt.interop._safetensors import write_safetensors
from muon_ckpt.interop._sources import split_state_key
from muon_ckpt.load import CheckpointReader
from muon_ckpt.state import strip_wrappers
from muon_ckpt.store import Storage, resolve
from muon_ckpt.store.dcp import bytes_keys, tensor_entries

__all__ = ["HFExportSummary", "export_hf"]

HF_SECTIONS = ("model", "optim")
STEMS = {"model": MODEL_STEM, "optim": OPTIMIZER_STEM}


@dataclass
class HFExportSummary:
    """What ``export_hf`` wrote: ``files`` per section (``model``, ``optim``), in order."""

    out_dir: str
    step: int | None
    tensors: int
    bytes: int
    files: dict[str, list[str]] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)  # dropped name -> kept name
    skipped: list[str] = field(default_factory=list)  # non-tensor model keys (not written)


@dataclass
class _Set:
    """One file set: the tensors by output name, in order."""

    stem: str
    items: dict[str, Item] = field(default_factory=dict)  # output name -> item
    meta: dict[str, str] = field(default_factory=dict)  # index (or single file) metadata


def _name(section: str, key: str, rename: Callable[[str], str], nested: bool) -> str | None:
    """Output name of a stored key, or None when it is not a tensor of this section;
    ``nested``: model keys carry a ``model.`` section prefix to drop."""
    if section == "model":
        return rename(strip_wrappers(key.removeprefix("model.") if nested else key))
    parts = split_state_key(key)
    if parts is None:
        return None
    fqn, state_key = parts
    return f"state.{rename(strip_wrappers(fqn))}.{state_key}"


def _collect(
    md: Any, section: str, rename: Callable[[str], str], cast: torch.dtype | None, dcp: bool
) -> _Set:
    """The tensors of ``section``; ``dcp``: a plain DCP checkpoint, whose model keys are FQNs
    as saved, under a ``model.`` prefix only when every dotted one has it (a state dict
    saved as ``{"model": ..., "step": ...}``; a Hugging Face model's own ``model.`` FQNs sit
    beside ``lm_head``)."""
    out = _Set(STEMS[section])
    keys = [k for k in tensor_entries(md) if section_of(k) == section]  # in saved order
    nested = not dcp or all(k.startswith("model.") for k in keys if "." in k)
    seen: dict[str, str] = {}
    for item in export_items(md, keys, cast):
        name = _name(section, item.key, rename, nested)
        if name is None:
            continue
        if name in seen:
            raise ValueError(
                f"stored keys {seen[name]!r} and {item.key!r} both become {name!r} (after "
                "removing wrapper prefixes and renaming); give them distinct names with rename="
            )
        seen[name] = item.key
        out.items[name] = item
    return out


def _apply_ties(s: _Set, tied: Mapping[str, str]) -> dict[str, tuple[Item, Item]]:
    """Drop each tied name (checked against its kept name); dropped -> (its item, kept item)."""
    pairs = {}
    for dropped, kept in tied.items():
        missing = [n for n in (dropped, kept) if n not in s.items]
        if missing:
            raise ValueError(
                f"tied={{{dropped!r}: {kept!r}}}: {missing} is not an exported model name; "
                f"tied names are as written, after rename (e.g. {', '.join(list(s.items)[:6])})"
            )
        if dropped == kept or kept in tied:
            raise ValueError(
                f"tied={{{dropped!r}: {kept!r}}}: expected each dropped name to map to a "
                f"different name that is written; {kept!r} is "
                + ("the same name" if dropped == kept else "dropped itself")
            )
        a, b = s.items[dropped], s.items[kept]
        if (a.shape, a.src_dtype) != (b.shape, b.src_dtype):
            raise ValueError(
                f"tied={{{dropped!r}: {kept!r}}}: cannot be tied, shapes/dtypes differ "
                f"({list(a.shape)} {a.src_dtype} vs {list(b.shape)} {b.src_dtype})"
            )
        pairs[dropped] = (s.items.pop(dropped), b)
        s.meta[dropped] = kept  # as huggingface_hub records a dropped shared tensor
    return pairs


def _check_tied(reader: CheckpointReader, pairs: dict[str, tuple[Item, Item]], where: str) -> None:
    """Tied names must hold the same bytes: read each pair (one at a time) and compare."""
    for dropped, (a, b) in pairs.items():
        sd = {i.key: torch.empty(i.shape, dtype=i.src_dtype) for i in (a, b)}
        reader.load(sd)
        x, y = (sd[i.key].reshape(-1).view(torch.uint8) for i in (a, b))
        if not torch.equal(x, y):
            raise ValueError(
                f"tied: {dropped!r} ({a.key}) and {b.key!r} hold different values in {where}, "
                "so they are not tied weights; export both (drop this tied= entry)"
            )


def _write_set(
    out: Storage, s: _Set, max_size: int, reader: CheckpointReader, bar: Any
) -> tuple[list[str], int]:
    """Write one file set; return its file names and bytes written."""
    plan = plan_shards(((n, i.nbytes) for n, i in s.items.items()), max_size, s.stem)
    for old in old_files(s.stem, out.listdir()):
        out.rm(old)
    sharded = len(plan) > 1
    written = 0
    for fname, names in plan.items():
        items = [s.items[n] for n in names]
        layout = [(n, i.dtype, i.shape) for n, i in zip(names, items, strict=True)]
        meta = {"format": "pt"} if sharded else {"format": "pt", **s.meta}
        tensors: Iterator[tuple[str, torch.Tensor]] = zip(
            names, read_items(reader, items, bar), strict=True
        )
        with out.open_atomic(fname) as f:
            written += write_safetensors(f, layout, tensors, meta)
    if sharded:  # last: the index commits the set
        total = sum(i.nbytes for i in s.items.values())
        out.write_bytes(index_json(total, plan, s.meta), index_name(s.stem))
    return [*plan, *([index_name(s.stem)] if sharded else [])], written


def export_hf(
    url: str,
    out_dir: str,
    *,
    step: int | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    include: Iterable[str] = ("model",),
    rename: Mapping[str, str] | Callable[[str], str] | None = None,
    tied: Mapping[str, str] | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: bool | None = False,
    verify: str = "checksum",
) -> HFExportSummary:
    """Write a checkpoint's model weights to ``out_dir`` in the Hugging Face layout.

    Args:
        url: a muon-ckpt run root (newest committed step, or ``step``), a step directory, or a
            plain DCP directory (its keys are the model's FQNs, under a ``model.`` prefix
            only if every dotted key has one); local or any fsspec URL.
        out_dir: the output directory (local or fsspec URL; remote uses ``storage_options``).
            Files of a previous export there (``model*.safetensors``, its index) are replaced;
            other files (config.json, tokenizer, ...) are left alone.
        dtype: cast floating tensors of one or more dimensions (``bf16``, ``float16``, ...).
        max_shard_size: bytes per shard, ``"5GB"``, ``"500MB"``, ``"100KB"`` or an int.
        include: ``model`` (default) and/or ``optim`` (a separate ``optimizer*`` set).
        rename: output names from the model's FQNs: ``{regex: replacement}`` (the first pattern
            that matches a whole name applies; ``\\1`` for groups) or a function.
        tied: ``{dropped: kept}`` names of tied weights (after rename): ``dropped`` is written
            once, as ``kept``, after checking both hold the same bytes (as transformers'
            ``_tied_weights_keys``). A checkpoint does not record ties by itself.
        progress: a progress bar on stderr (``None``: only on a terminal).
        verify: ``"checksum"`` (former name ``"crc32"``) checks sizes and checksums of every
            file read, ``"size"`` sizes.

    Raises:
        ValueError: bad arguments, or ``include`` selects no tensor.
        CheckpointNotFoundError / CheckpointCorruptError: as for a load.
    """
    inc = tuple(include)
    if not inc or any(s not in HF_SECTIONS for s in inc):
        hint = "; extra has no Hugging Face layout: export_safetensors exports it" * (
            "extra" in inc
        )
        raise ValueError(f"include must be a non-empty subset of {HF_SECTIONS}, got {inc!r}{hint}")
    max_size = parse_size(max_shard_size)
    cast = parse_dtype(dtype)
    renamer = make_renamer(rename)
    reader = CheckpointReader(resolve(Storage(url, storage_options), step), verify=verify)
    r, md = reader.resolved, reader.metadata
    sets = {s: _collect(md, s, renamer, cast, r.kind == "dcp") for s in inc}
    for section, s in sets.items():
        if not s.items:
            raise nothing_to_export(md, (section,), r.url)
    if tied and "model" not in sets:
        raise ValueError("tied= names model weights: include 'model'")
    pairs = _apply_ties(sets["model"], tied) if tied else {}
    _check_tied(reader, pairs, r.url)
    groups = [k for k in bytes_keys(md) if section_of(k) == "optim"]
    if "optim" in sets:
        if r.step is not None:
            sets["optim"].meta["step"] = str(r.step)
        if groups:
            hp: dict[str, Any] = {k: None for k in groups}
            reader.load(hp)
            sets["optim"].meta["optim.param_groups"] = json.dumps(hp, sort_keys=True, default=repr)
    opts = storage_options if "://" in out_dir and not out_dir.startswith("file://") else {}
    out = Storage(out_dir, opts)
    out.check_root()
    out.makedirs()
    summary = HFExportSummary(out.url, r.step, 0, 0, tied=dict(tied or {}))
    if "model" in sets:
        summary.skipped = [k for k in bytes_keys(md) if section_of(k) == "model"]
    total = sum(i.nbytes for s in sets.values() for i in s.items.values())
    with progress_bar(total, f"export step {r.step}", enabled=progress) as bar:
        for section, s in sets.items():
            files, written = _write_set(out, s, max_size, reader, bar)
            summary.files[section] = files
            summary.tensors += len(s.items)
            summary.bytes += written
    return summary
