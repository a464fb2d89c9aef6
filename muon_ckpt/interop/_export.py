"""Export a checkpoint's consolidated (full) tensors to one safetensors file.

Runs in one process with no process group, whatever the world size of the save: tensors are read
through the verifying reader (``io.CheckpointReader``: DCP assembles every shard into the full
tensor; sizes and checksums are checked as for a load), a batch of at most ``_BATCH`` bytes at a
time, and streamed to the output (local path or fsspec URL), which appears only when complete.
Keys are kept as stored (``model.<fqn>``, ``optim.state.<fqn>.<key>``, ...), so the file can be
given back to ``import_optimizer_state``; the optimizer's param-group hyperparameters go into
the metadata as JSON (safetensors holds tensors only).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from muon_ckpt._progress import progress_bar
from muon_ckpt.interop._safetensors import write_safetensors
from muon_ckpt.io import CheckpointReader
from muon_ckpt.store import KEY_FORMAT_VERSION, Storage, bytes_keys, resolve, tensor_entries

__all__ = ["ExportSummary", "export_safetensors", "parse_dtype"]

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
    """model / optim / extra, for muon-ckpt keys and for foreign flattened DCP keys."""
    head = key.split(".", 1)[0]
    if head in SECTIONS:
        return head
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


def _batches(
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]], src_dtype: dict[str, torch.dtype]
) -> Iterable[list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    batch: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    size = 0
    for item in layout:
        n = torch.Size(item[2]).numel() * src_dtype[item[0]].itemsize
        if batch and size + n > _BATCH:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        yield batch


def export_safetensors(
    url: str,
    out: str,
    *,
    step: int | None = None,
    include: Iterable[str] = ("model", "optim"),
    dtype: str | torch.dtype | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: bool | None = False,
    verify: str = "crc32",
) -> ExportSummary:
    """Write the full tensors of a checkpoint to the safetensors file ``out``.

    Args:
        url: a muon-ckpt run root (newest committed step, or ``step``), a step directory, or a
            plain DCP directory; local or any fsspec URL.
        out: the output file (local path or fsspec URL; remote ``out`` uses ``storage_options``).
        include: sections to export: ``model``, ``optim``, ``extra``.
        dtype: cast floating tensors of one or more dimensions to this dtype (scalars such as
            AdamW's ``step`` keep theirs); default: as stored.
        progress: draw a progress bar on stderr (``None``: only on a TTY).
        verify: ``"crc32"`` checks the size and checksum of every file read (a damaged file
            is a CheckpointCorruptError naming it); ``"size"`` sizes only.
    """
    inc = tuple(include)
    bad = [s for s in inc if s not in SECTIONS]
    if bad or not inc:
        raise ValueError(f"include must be a non-empty subset of {SECTIONS}, got {inc!r}")
    cast = parse_dtype(dtype)
    reader = CheckpointReader(resolve(Storage(url, storage_options), step), verify=verify)
    r, md = reader.resolved, reader.metadata
    src_dtype, layout = {}, []
    for key, tm in sorted(tensor_entries(md).items()):
        if section_of(key) not in inc:
            continue
        d = tm.properties.dtype
        src_dtype[key] = d
        if cast is not None and d.is_floating_point and len(tm.size) >= 1:
            d = cast
        layout.append((key, d, tuple(tm.size)))
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
    total = sum(torch.Size(s).numel() * d.itemsize for _, d, s in layout)

    def tensors(bar: Any) -> Iterator[tuple[str, torch.Tensor]]:
        for batch in _batches(layout, src_dtype):
            sd = {k: torch.empty(s, dtype=src_dtype[k]) for k, _, s in batch}
            reader.load(sd)
            for k, d, _ in batch:
                t = sd.pop(k).to(d)
                bar.update(t.numel() * t.element_size())
                yield k, t

    opts = storage_options if "://" in out and not out.startswith("file://") else {}
    with (
        progress_bar(total, f"export step {r.step}", enabled=progress) as bar,
        Storage(out, opts).open_atomic() as f,
    ):
        written = write_safetensors(f, layout, tensors(bar), meta)
    skipped = [k for k in nontensor if k not in groups]
    return ExportSummary(out, r.step, len(layout), written, skipped)
