"""Optimizer-state sources for import: what a source holds (by parameter FQN) and reading it.

Three kinds, opened by ``open_source``:

- a ``torch.save``d optimizer state dict (torch.optim.AdamW/Adam/SGD/Muon, muon_ckpt's Muon),
  read with ``torch.load(weights_only=True)``; positional ids are mapped to FQNs through the
  groups' ``param_names``/``names``, an explicit ``names`` list, or ``model.named_parameters()``;
- a safetensors file of ``state.<fqn>.<key>`` (or ``optim.state.<fqn>.<key>``) tensors;
- a DCP checkpoint: muon-ckpt's own layout (run root or step directory) or a plain DCP directory
  of flattened keys (``state.<fqn>.exp_avg``, torch's ``flatten_optimizer_state_dict``).

A source lists ``SrcEntry``s (FQN, state key, global shape, dtype) and fills buffers shaped like
the targets: plain tensors, or DTensors whose local shard receives the matching slice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

import muon_ckpt._collective as coll
from muon_ckpt._errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from muon_ckpt._shards import shard_box
from muon_ckpt.interop._hflayout import OPTIMIZER_STEM, index_name, read_set, single_name
from muon_ckpt.interop._safetensors import SafetensorsFile
from muon_ckpt.load import CheckpointReader, unbounded_records
from muon_ckpt.store import Storage, resolve
from muon_ckpt.store.dcp import tensor_entries

__all__ = ["STATE_PREFIXES", "Source", "SrcEntry", "open_source"]

STATE_PREFIXES = ("optim.state.", "optimizer.state.", "state.")


@dataclass(frozen=True)
class SrcEntry:
    key: str  # the source key, by FQN: state.<fqn>.<name> (or as stored, e.g. optim.state...)
    fqn: str
    name: str  # the state key as stored: exp_avg, moment1, momentum_buffer, step, ...
    shape: tuple[int, ...]
    dtype: torch.dtype


def split_state_key(key: str) -> tuple[str, str] | None:
    for prefix in STATE_PREFIXES:
        if key.startswith(prefix):
            fqn, _, name = key[len(prefix) :].rpartition(".")
            return (fqn, name) if fqn and name else None
    return None


def fill_from_full(buf: torch.Tensor, full: torch.Tensor) -> None:
    """Copy into ``buf`` (plain or DTensor) its part of the full source tensor."""
    if isinstance(buf, DTensor):
        offset, shape = shard_box(buf)
        idx = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        buf.to_local().copy_(full[idx])
    else:
        buf.copy_(full.reshape(buf.shape))


class Source:
    """Base: ``description``, ``step`` (if the source knows it), ``entries``, ``read``."""

    description: str = ""
    step: int | None = None
    entries: list[SrcEntry]

    def read(self, wanted: list[tuple[SrcEntry, torch.Tensor]]) -> None:
        raise NotImplementedError


class _TensorsSource(Source):
    """Full tensors already in memory (torch.save'd or given state dicts)."""

    def __init__(self, tensors: dict[str, tuple[str, str, torch.Tensor]], description: str):
        self.description = description
        self._t = {k: t for k, (_, _, t) in tensors.items()}
        self.entries = [
            SrcEntry(k, fqn, name, tuple(t.shape), t.dtype) for k, (fqn, name, t) in tensors.items()
        ]

    def read(self, wanted: list[tuple[SrcEntry, torch.Tensor]]) -> None:
        for e, buf in wanted:
            fill_from_full(buf, self._t[e.key])


class _SafetensorsSource(Source):
    """One safetensors file, or the files of a set (``export_hf``'s ``optimizer*``)."""

    def __init__(self, files: list[SafetensorsFile], description: str, step: str | None) -> None:
        self.description = description
        self.step = int(step) if step and step.isdigit() else None
        self.entries = []
        self._file: dict[str, SafetensorsFile] = {}
        for f in files:
            for key, info in f.tensors.items():
                parts = split_state_key(key)
                if parts:
                    self.entries.append(SrcEntry(key, *parts, info.shape, info.dtype))
                    self._file[key] = f

    def read(self, wanted: list[tuple[SrcEntry, torch.Tensor]]) -> None:
        for e, buf in wanted:
            fill_from_full(buf, self._file[e.key].read(e.key))


def _hf_optimizer_set(storage: Storage, where: str) -> Source:
    files, meta = read_set(storage, OPTIMIZER_STEM)
    opened = [SafetensorsFile(storage.child(f)) for f in files]
    step = meta.get("step") if meta else opened[0].metadata.get("step")
    return _SafetensorsSource(opened, f"optimizer safetensors set {where}", step)


class _DCPSource(Source):
    def __init__(self, storage: Storage, step: int | None, verify: str) -> None:
        r = resolve(storage, step)
        self.step = r.step
        what = "muon-ckpt checkpoint" if r.manifest else "DCP checkpoint"
        self.description = f"{what} at {r.url}"
        # Every rank reads the slices of its own targets; each file is checked by one rank.
        self._reader = CheckpointReader(
            r, verify=verify, rank=coll.rank(), world_size=coll.world_size()
        )
        self.entries = []
        for key, tm in tensor_entries(self._reader.metadata).items():
            parts = split_state_key(key)
            if parts:
                self.entries.append(SrcEntry(key, *parts, tuple(tm.size), tm.properties.dtype))

    def read(self, wanted: list[tuple[SrcEntry, torch.Tensor]]) -> None:
        if wanted:
            self._reader.load({e.key: buf for e, buf in wanted})


def _kind_of_torch_optimizer(groups: Sequence[Mapping[str, Any]]) -> str:
    g = groups[0] if groups else {}
    if "use_muon" in g:
        return "muon_ckpt Muon"
    if "adjust_lr_fn" in g:
        return "torch.optim.Muon"
    if "dampening" in g:
        return "torch.optim.SGD"
    if "betas" in g:
        return "torch.optim.AdamW" if g.get("decoupled_weight_decay") else "torch.optim.Adam"
    return "optimizer"


def _positional_names(
    groups: Sequence[Mapping[str, Any]], names: Sequence[str] | None, model: Any, where: str
) -> dict[int, str]:
    ids = [i for g in groups for i in g.get("params", [])]
    if names is not None:
        how, order = "the names list", list(names)
    elif all("param_names" in g for g in groups) and groups:
        how, order = "the groups' param_names", [n for g in groups for n in g["param_names"]]
    elif all(g.get("names") for g in groups) and groups:
        how, order = "the groups' names", [n for g in groups for n in g["names"]]
    elif model is not None:
        how, order = "model.named_parameters()", [n for n, _ in model.named_parameters()]
    else:
        raise CheckpointError(
            f"{where}: the optimizer state dict identifies params by position (ids {ids[:4]}"
            f"{'...' if len(ids) > 4 else ''}); pass model= (its named_parameters() in the "
            "order the source optimizer got them) or names= (one FQN per id) to map them"
        )
    if len(order) != len(ids):
        raise CheckpointError(
            f"{where}: the source optimizer has {len(ids)} params but {how} gives "
            f"{len(order)} names; pass names= with one FQN per param, in the source "
            "optimizer's order"
        )
    return dict(zip(ids, order, strict=True))


def _from_state_dict(
    sd: Mapping[str, Any], names: Sequence[str] | None, model: Any, where: str
) -> Source:
    for k in ("optimizer", "optim"):
        if "state" not in sd and isinstance(sd.get(k), Mapping):
            sd = sd[k]
    if not isinstance(sd.get("state"), Mapping) or not isinstance(sd.get("param_groups"), list):
        raise CheckpointError(
            f"{where}: not an optimizer state dict (expected keys 'state' and 'param_groups', "
            f"found {sorted(map(str, sd))[:8]}); save optimizer.state_dict()"
        )
    groups = sd["param_groups"]
    id_to_name = _positional_names(groups, names, model, where)
    tensors: dict[str, tuple[str, str, torch.Tensor]] = {}
    for pid, st in sd["state"].items():
        if pid not in id_to_name:
            raise CheckpointCorruptError(f"{where}: state for param id {pid} not in any group")
        fqn = id_to_name[pid]
        for name, v in st.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                v = torch.tensor(float(v), dtype=torch.float32)
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
                tensors[f"state.{fqn}.{name}"] = (fqn, name, v)
    kind = _kind_of_torch_optimizer(groups)
    return _TensorsSource(tensors, f"{kind} state dict {where}")


def _is_nested_state_dict(sd: Mapping[str, Any]) -> bool:
    return any(isinstance(sd.get(k), Mapping) for k in ("state", "optimizer", "optim"))


def _from_flat_mapping(sd: Mapping[str, Any], where: str) -> Source:
    tensors = {}
    for k, v in sd.items():
        parts = split_state_key(str(k))
        if parts and isinstance(v, torch.Tensor):
            tensors[str(k)] = (*parts, v)
    return _TensorsSource(tensors, where)


def _check_bounded(f: Any, size: int, source: str) -> None:
    """A torch.save zip whose records torch.load cannot expand beyond the file's size (the
    same check as a checkpoint's items: ``io._itemzip.unbounded_records``)."""

    def read(lo: int, hi: int) -> bytes:
        f.seek(lo)
        return f.read(hi - lo)

    why = unbounded_records(read, size)
    f.seek(0)
    if why is not None:
        raise CheckpointCorruptError(
            f"{source!r}: not loaded: the file {why}, so torch.load could allocate far more "
            "than its size; torch.save writes its records stored, apart from each other"
        )


def open_source(
    source: Any,
    *,
    names: Sequence[str] | None = None,
    model: Any = None,
    storage_options: dict[str, Any] | None = None,
    step: int | None = None,
    verify: str = "checksum",
) -> Source:
    """Open ``source``: a path/URL (file or directory), or an in-memory state dict."""
    if isinstance(source, Mapping):
        if _is_nested_state_dict(source):
            return _from_state_dict(source, names, model, "given state dict")
        return _from_flat_mapping(source, "given flat state dict")
    if hasattr(source, "__fspath__"):
        source = str(source.__fspath__())
    if not isinstance(source, str) or not source:
        raise TypeError(
            f"source must be a path, an fsspec URL or a state dict, got {type(source).__name__}"
        )
    storage = Storage(source, storage_options)
    if storage.isfile():
        with storage.open() as f:
            head = f.read(9)
        if len(head) == 9 and head[8:9] == b"{":
            f = SafetensorsFile(storage)
            return _SafetensorsSource([f], f"safetensors file {source}", f.metadata.get("step"))
        if head[:2] == b"PK" or head[:1] == b"\x80":
            with storage.open() as f:
                if head[:2] == b"PK":
                    _check_bounded(f, storage.size(), source)
                try:
                    sd = torch.load(f, map_location="cpu", weights_only=True)
                except Exception as e:
                    raise CheckpointError(
                        f"{source!r}: torch.load(weights_only=True) refused the file "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
                        "muon-ckpt never unpickles arbitrary objects: torch.save only "
                        "optimizer.state_dict() (tensors, numbers, strings, lists, dicts)"
                    ) from e
            if not isinstance(sd, Mapping):
                raise CheckpointError(
                    f"{source!r}: holds a {type(sd).__name__}, not an optimizer state dict"
                )
            if _is_nested_state_dict(sd):
                return _from_state_dict(sd, names, model, repr(source))
            return _from_flat_mapping(sd, f"torch.save'd flat state dict {source}")
        raise CheckpointError(
            f"{source!r}: not a safetensors file, a torch.save file or a DCP directory "
            f"(first bytes {head[:9]!r})"
        )
    if not storage.exists():
        raise CheckpointNotFoundError(f"{source!r} does not exist")
    if any(storage.exists(n) for n in (index_name(OPTIMIZER_STEM), single_name(OPTIMIZER_STEM))):
        return _hf_optimizer_set(storage, source)
    return _DCPSource(storage, step, verify)
