"""Export a checkpoint's consolidated (full) tensors to one safetensors file.

Runs in one process with no process group, whatever the world size of the save: tensors are read
through the verifying reader (``load.CheckpointReader``: DCP assembles every shard into the full
tensor; sizes and checksums are checked as for a load), a batch of at most ``_BATCH`` bytes at a
time, and streamed to the output (local path or fsspec URL), which appears only when complete.
Keys are kept as stored (``model.<fqn>``, ``optim.state.<fqn>.<key>``, ...), so the file can be
given back to ``import_optimizer_state``; the optimizer's param-group hyperparameters go into
the metadata as JSON (safetensors holds tensors only).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from muon_ckpt._progress import progress_bar
from muon_ckpt.interop._safetensors import write_safetensors
from muon_ckpt.load import CheckpointReader
from muon_ckpt.store import Storage, resolve
from muon_ckpt.store.dcp import bytes_keys, tensor_entries
from muon_ckpt.store.keys import KEY_FORMAT_VERSION

__all__ = [
    "ExportSummary",
    "Item",
    "export_items",
    "export_safetensors",
    "nothing_to_export",
    "parse_dtype",
    "read_items",
]

SECTIONS = ("model", "optim", "extra")
_BATCH = 256 * 1024 * 1024
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "fp64": torch.float64,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``None``, a floating torch.dtype, or its name (``bf16``, ``float16``, ...)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        return dtype
    d = _DTYPES.get(str(dtype).lower().removeprefix("torch."))
    if d is None:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return d


def section_of(key: str) -> str:
    """model / optim / extra, for muon-ckpt keys and for foreign flattened DCP keys (each
    rank's ``rank_extra`` is extra state too, never the model's)."""
    head = key.split(".", 1)[0]
    if head in SECTIONS:
        return head
    if re.match(r"rank_extra\.\d+\.", key):  # (not a foreign model's own 'rank_extra')
        return "extra"
    if head in ("state", "param_groups", "optimizer"):
        return "optim"
    return "model"


@dataclass
class ExportSummary:
    """What ``export_safetensors`` wrote."""

    out: str
    step: int | None
    tensors: int
    bytes: int
    skipped: list[str] = field(default_factory=list)  # non-tensor keys (not in the file)


@dataclass(frozen=True)
class Item:
    """One tensor to export: its stored key, dtype as stored and as written, and shape."""

    key: str
    src_dtype: torch.dtype
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def src_nbytes(self) -> int:
        return math.prod(self.shape) * self.src_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def export_items(md: Any, keys: Iterable[str], cast: torch.dtype | None) -> list[Item]:
    """An Item per key of ``md`` in ``keys`` (in that order); floating tensors of one or more
    dimensions are cast to ``cast`` (scalars such as AdamW's ``step`` keep their dtype)."""
    entries = tensor_entries(md)
    out = []
    for key in keys:
        tm = entries[key]
        d = tm.properties.dtype
        to = cast if cast is not None and d.is_floating_point and len(tm.size) >= 1 else d
        out.append(Item(key, d, to, tuple(tm.size)))
    return out


def read_items(reader: CheckpointReader, items: list[Item], bar: Any) -> Iterator[torch.Tensor]:
    """The full tensors of ``items``, in order, cast: read a batch of at most ``_BATCH`` bytes
    at a time (one larger tensor alone), so memory holds one batch whatever the model size."""
    batch: list[Item] = []
    size = 0
    for item in [*items, None]:
        if batch and (item is None or size + item.src_nbytes > _BATCH):
            sd = {i.key: torch.empty(i.shape, dtype=i.src_dtype) for i in batch}
            reader.load(sd)
            for i in batch:
                t = sd.pop(i.key).to(i.dtype)
                bar.update(i.nbytes)
                yield t
            batch, size = [], 0
        if item is not None:
            batch.append(item)
            size += item.src_nbytes


def nothing_to_export(md: Any, inc: tuple[str, ...], where: str) -> ValueError:
    """The error for an ``include`` that selects no tensor, with what the checkpoint has."""
    counts = {s: 0 for s in SECTIONS}
    for key in tensor_entries(md):
        counts[section_of(key)] += 1
    objects = {s: 0 for s in SECTIONS}
    for key in bytes_keys(md):
        objects[section_of(key)] += 1
    have = ", ".join(f"{s}: {counts[s]} tensors, {objects[s]} other values" for s in SECTIONS)
    return ValueError(
        f"include={inc!r} selects no tensor of {where} ({have}); nothing to export. Include "
        "a section that has tensors; non-tensor values cannot go into safetensors "
        "(muon-ckpt inspect shows them)"
    )


def export_safetensors(
    url: str,
    out: str,
    *,
    step: int | None = None,
    include: Iterable[str] = ("model",),
    dtype: str | torch.dtype | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: bool | None = False,
    verify: str = "checksum",
) -> ExportSummary:
    """Write the full tensors of a checkpoint to the safetensors file ``out``.

    Args:
        url: a muon-ckpt run root (newest committed step, or ``step``), a step directory, or a
            plain DCP directory; local or any fsspec URL.
        out: the output file (local path or fsspec URL; remote ``out`` uses ``storage_options``).
        include: sections to export: ``model`` (default), ``optim``, ``extra``; one that
            selects no tensor is a ValueError.
        dtype: cast floating tensors of one or more dimensions to this dtype (scalars such as
            AdamW's ``step`` keep theirs); default: as stored.
        progress: draw a progress bar on stderr (``None``: only on a TTY).
        verify: ``"checksum"`` (former name ``"crc32"``) checks the size and checksums of
            every file read (a damaged file is a CheckpointCorruptError naming it); ``"size"``
            sizes only.
    """
    inc = tuple(include)
    bad = [s for s in inc if s not in SECTIONS]
    if bad or not inc:
        raise ValueError(f"include must be a non-empty subset of {SECTIONS}, got {inc!r}")
    cast = parse_dtype(dtype)
    reader = CheckpointReader(resolve(Storage(url, storage_options), step), verify=verify)
    r, md = reader.resolved, reader.metadata
    items = export_items(md, sorted(k for k in tensor_entries(md) if section_of(k) in inc), cast)
    if not items:
        raise nothing_to_export(md, inc, r.url)
    nontensor = [k for k in bytes_keys(md) if section_of(k) in inc]
    groups = [k for k in nontensor if k.startswith(("optim.param_groups.", "param_groups."))]
    meta = {
        "format": "muon-ckpt-export",
        "key_format_version": str(KEY_FORMAT_VERSION),
        "source": r.url,
        "include": ",".join(inc),
        "dtype": str(cast) if cast is not None else "",
        "torch_version": torch.__version__,
    }
    if r.step is not None:
        meta["step"] = str(r.step)
    if groups:
        hp: dict[str, Any] = {k: None for k in groups}
        reader.load(hp)
        meta["optim.param_groups"] = json.dumps(hp, sort_keys=True, default=repr)
    total = sum(i.nbytes for i in items)
    layout = [(i.key, i.dtype, i.shape) for i in items]

    def tensors(bar: Any) -> Iterator[tuple[str, torch.Tensor]]:
        yield from zip((i.key for i in items), read_items(reader, items, bar), strict=True)

    opts = storage_options if "://" in out and not out.startswith("file://") else {}
    with (
        progress_bar(total, f"export step {r.step}", enabled=progress) as bar,
        Storage(out, opts).open_atomic() as f,
    ):
        written = write_safetensors(f, layout, tensors(bar), meta)
    skipped = [k for k in nontensor if k not in groups]
    return ExportSummary(out, r.step, len(items), written, skipped)
