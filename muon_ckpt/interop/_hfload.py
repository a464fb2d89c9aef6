"""Load model weights from a Hugging Face layout directory (``model.safetensors``, or shards and
``model.safetensors.index.json``: ``_hflayout``), e.g. to start fine-tuning from an export.

Works on plain models and on FSDP2/DTensor models on any number of ranks: each rank reads only
the bytes of its own shard (a row range for ``Shard(0)``, the whole tensor otherwise) and
copies them into its local tensor; no collective. Everything is checked first (the index, every
shard's header, names and shapes; with ``strict`` that every weight is present and every file
tensor used); then tensors are read and copied one at a time. Safetensors files carry no
checksums, so a read error after the checks (an I/O failure) can leave the model partly loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from muon_ckpt._errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
)
from muon_ckpt._shards import shard_box
from muon_ckpt._tensors import local_tensor
from muon_ckpt.interop._hflayout import MODEL_STEM, make_renamer, read_set
from muon_ckpt.interop._safetensors import SafetensorsFile, TensorInfo
from muon_ckpt.state import strip_wrappers
from muon_ckpt.store import Storage

__all__ = ["HFLoadReport", "load_hf_model"]


@dataclass
class HFLoadReport:
    """What ``load_hf_model`` did."""

    source: str
    files: list[str] = field(default_factory=list)
    loaded: dict[str, str] = field(default_factory=dict)  # model key -> file tensor name
    tied: dict[str, str] = field(default_factory=dict)  # model key -> key it shares a tensor with
    missing: list[str] = field(default_factory=list)  # model keys with no tensor in the files
    unexpected: list[str] = field(default_factory=list)  # file tensors no model key uses
    casts: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (from, to)

    def __str__(self) -> str:
        lines = [
            f"load from {self.source} ({len(self.files)} file(s))",
            f"  {len(self.loaded)} tensors loaded, {len(self.tied)} tied, "
            f"{len(self.missing)} missing, {len(self.unexpected)} unexpected, "
            f"{len(self.casts)} dtype casts",
        ]
        lines += [
            f"  loaded      {k}" + (f" <- {n}" if n != k else "") for k, n in self.loaded.items()
        ]
        lines += [f"  tied        {k} = {v}" for k, v in self.tied.items()]
        lines += [f"  missing     {k}" for k in self.missing]
        lines += [f"  unexpected  {k}" for k in self.unexpected]
        lines += [f"  cast        {k}: {a} -> {b}" for k, (a, b) in self.casts.items()]
        return "\n".join(lines)


def _read_headers(st: Storage, files: list[str]) -> dict[str, tuple[SafetensorsFile, TensorInfo]]:
    out: dict[str, tuple[SafetensorsFile, TensorInfo]] = {}
    for fname in files:
        f = SafetensorsFile(st.child(fname))
        for name, info in f.tensors.items():
            if name in out:
                raise CheckpointCorruptError(
                    f"{st.url!r}: tensor {name!r} is in {out[name][0].path} and {f.path}"
                )
            out[name] = (f, info)
    return out


def _read_local(
    f: SafetensorsFile, name: str, info: TensorInfo, target: torch.Tensor
) -> torch.Tensor:
    """The part of file tensor ``name`` that ``target`` (plain or DTensor) holds locally."""
    if not isinstance(target, DTensor):
        return f.read(name)
    offset, shape = shard_box(target)
    if len(shape) >= 1 and all(o == 0 for o in offset[1:]) and tuple(shape[1:]) == info.shape[1:]:
        return f.read(name, rows=(offset[0], offset[0] + shape[0]))  # a row block: its bytes only
    full = f.read(name)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]


def load_hf_model(
    model: torch.nn.Module,
    hf_dir: str,
    *,
    strict: bool = True,
    rename: Mapping[str, str] | Callable[[str], str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> HFLoadReport:
    """Copy the weights of a Hugging Face layout directory into ``model``, in place.

    Args:
        model: a plain or FSDP2 (DTensor) model; every rank calls this with its own model.
        hf_dir: a directory with ``model.safetensors`` or ``model.safetensors.index.json``
            and its shards (local or any fsspec URL), as ``export_hf`` or transformers write.
        strict: every model tensor must be in the files and every file tensor used (a tied
            weight is satisfied by the tensor it shares); else CheckpointMismatchError before
            anything changes. With ``strict=False`` the report lists what was missing/unused.
        rename: file names from the model's FQNs, as for ``export_hf`` (the same map).
        storage_options: fsspec options for a remote ``hf_dir``.

    Raises:
        CheckpointNotFoundError: no Hugging Face model files at ``hf_dir``.
        CheckpointMismatchError: a shape differs, or (strict) a tensor is missing or unused.
        CheckpointCorruptError: an index or file header is malformed, or a shard is missing.
    """
    st = Storage(hf_dir, storage_options)
    files, _ = read_set(st, MODEL_STEM)
    have = _read_headers(st, files)
    renamer = make_renamer(rename)
    report = HFLoadReport(source=st.url, files=files)
    plan: list[tuple[str, str, torch.Tensor]] = []
    owner: dict[int, str] = {}  # id(tensor) -> the first model key that holds it
    pending: list[tuple[str, int]] = []
    for key, value in model.state_dict(keep_vars=True).items():
        name = renamer(strip_wrappers(key))
        if not isinstance(value, torch.Tensor) or name not in have:
            pending.append((key, id(value)))
            continue
        f, info = have[name]
        if tuple(value.shape) != info.shape:
            raise CheckpointMismatchError(
                f"{f.path}: {name!r} has shape {list(info.shape)} in the files but "
                f"{key!r} has {list(value.shape)} in the model; build the model with the "
                "exported configuration (or fix rename=)"
            )
        if info.dtype != value.dtype:
            report.casts[name] = (str(info.dtype), str(value.dtype))
        plan.append((key, name, value))
        report.loaded[key] = name
        owner.setdefault(id(value), key)
    for key, ident in pending:
        if ident in owner:
            report.tied[key] = owner[ident]
        else:
            report.missing.append(key)
    report.unexpected = sorted(set(have) - set(report.loaded.values()))
    if strict and (report.missing or report.unexpected):
        raise CheckpointMismatchError(
            f"{st.url!r} does not match the model: {len(report.missing)} model tensor(s) not "
            f"in the files {report.missing[:8]}, {len(report.unexpected)} file tensor(s) no "
            f"model key uses {report.unexpected[:8]}. Pass rename= if the names differ, or "
            "strict=False to load what matches"
        )
    with torch.no_grad():
        for _key, name, value in plan:
            f, info = have[name]
            data = _read_local(f, name, info, value)
            dest = local_tensor(value)
            dest.copy_(data.reshape(dest.shape))
    return report
