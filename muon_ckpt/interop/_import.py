"""Import optimizer state from other tools into a Muon optimizer (Muon and AdamW groups).

Key mapping (source state key -> Muon state key)::

    exp_avg          -> moment1          (AdamW groups; momentum_buffer of a Muon group only
    exp_avg_sq       -> moment2           with adam_into_muon=True)
    step             -> step             (AdamW groups)
    momentum_buffer  -> momentum_buffer  (Muon groups)
    moment1/moment2  -> moment1/moment2  (muon-ckpt's own checkpoints)

Everything is checked (names, shapes) before the optimizer is touched; then the whole source is
read and copied in. On N ranks every rank calls this (it is collective only through
``optimizer.init_state()``) and reads just the slices its DTensor shards need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import TensorMeta

from muon_ckpt._errors import CheckpointError, CheckpointMismatchError
from muon_ckpt._tensors import local_tensor
from muon_ckpt.interop._sources import Source, SrcEntry, open_source
from muon_ckpt.state import canonical_names, strip_wrappers

__all__ = ["ImportReport", "import_optimizer_state"]

CANONICAL = {
    "exp_avg": "moment1",
    "exp_avg_sq": "moment2",
    "moment1": "moment1",
    "moment2": "moment2",
    "momentum_buffer": "momentum_buffer",
    "step": "step",
}


@dataclass
class ImportReport:
    """What ``import_optimizer_state`` did (or, with ``dry_run``, would do)."""

    source: str
    source_step: int | None = None
    dry_run: bool = False
    imported: dict[str, dict[str, str]] = field(default_factory=dict)  # fqn -> {dst: src key}
    fresh: list[str] = field(default_factory=list)  # params left with fresh (zero) state
    unused: list[str] = field(default_factory=list)  # source keys that went nowhere
    casts: dict[str, tuple[str, str]] = field(default_factory=dict)  # src key -> (from, to)
    missing: dict[str, list[str]] = field(default_factory=dict)  # fqn -> state keys not found
    hints: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"import from {self.source}"
        if self.source_step is not None:
            head += f" (step {self.source_step})"
        lines = [
            head + (" [dry run: nothing changed]" if self.dry_run else ""),
            f"  {len(self.imported)} params got state, {len(self.fresh)} left fresh, "
            f"{len(self.unused)} source keys unused, {len(self.casts)} dtype casts",
        ]
        for fqn, m in self.imported.items():
            pairs = ", ".join(f"{d} <- {s}" for d, s in m.items())
            lines.append(f"  got state   {fqn}: {pairs}")
        lines += [f"  left fresh  {fqn}" for fqn in self.fresh]
        lines += [f"  unused      {k}" for k in self.unused]
        lines += [f"  cast        {k}: {a} -> {b}" for k, (a, b) in self.casts.items()]
        for fqn, keys in self.missing.items():
            lines.append(f"  incomplete  {fqn}: no source for {', '.join(keys)}")
        lines += [f"  hint: {h}" for h in self.hints]
        return "\n".join(lines)


@dataclass
class _Target:
    fqn: str
    param: torch.Tensor
    use_muon: bool


def _targets(optimizer: Any, model: Any) -> list[_Target]:
    groups = getattr(optimizer, "param_groups", None)
    if (
        not groups
        or any("use_muon" not in g for g in groups)
        or not hasattr(optimizer, "init_state")
    ):
        raise TypeError(
            f"import_optimizer_state needs a Muon optimizer (param groups with 'use_muon' and "
            f"an init_state() method), got {type(optimizer).__name__}"
        )
    by_id: dict[int, str] = {}
    if model is not None:  # canonical names, as checkpoints store them (no _orig_mod., module.)
        named = list(model.named_parameters())
        clean = canonical_names(model, [n for n, _ in named])
        by_id = {id(p): clean[n] for n, p in named}
    out = []
    for gi, g in enumerate(groups):
        names = g.get("names") or []
        for i, p in enumerate(g["params"]):
            fqn = by_id.get(id(p)) or (names[i] if i < len(names) else None)
            if not fqn:
                raise ValueError(
                    f"param {i} of param group {gi} has no name: pass model= or give the "
                    "group a 'names' list of FQNs"
                )
            out.append(_Target(fqn, p, bool(g["use_muon"])))
    return out


def _wanted_keys(t: _Target, adam_into_muon: bool) -> dict[str, tuple[str, ...]]:
    """Target state key -> canonical source keys, by preference."""
    if t.use_muon:
        return {
            "momentum_buffer": ("momentum_buffer", "moment1")
            if adam_into_muon
            else ("momentum_buffer",)
        }
    return {"moment1": ("moment1",), "moment2": ("moment2",), "step": ("step",)}


def _check_shape(e: SrcEntry, t: _Target, dst: str) -> None:
    if dst == "step":
        ok, want = int(torch.Size(e.shape).numel()) == 1, "()"
    else:
        ok, want = tuple(e.shape) == tuple(t.param.shape), str(tuple(t.param.shape))
    if not ok:
        raise CheckpointMismatchError(
            f"{e.key}: source shape {tuple(e.shape)} does not match {t.fqn}.{dst} of the "
            f"optimizer, shape {want}; the source belongs to another model (or the names "
            "map params to the wrong FQNs)"
        )


def _plan(
    targets: list[_Target], src: Source, adam_into_muon: bool, report: ImportReport
) -> list[tuple[_Target, str, SrcEntry]]:
    by_fqn: dict[str, dict[str, SrcEntry]] = {}
    for e in src.entries:
        canon = CANONICAL.get(e.name)
        if canon is not None:
            by_fqn.setdefault(e.fqn, {}).setdefault(canon, e)
    # Names without wrapper atoms (a source or target named by a compiled or wrapped model),
    # for the names that do not match as they are; only where that name is unambiguous.
    bare: dict[str, list[str]] = {}
    for fqn in by_fqn:
        bare.setdefault(strip_wrappers(fqn), []).append(fqn)

    def state_of(fqn: str) -> dict[str, SrcEntry]:
        if fqn in by_fqn:
            return by_fqn[fqn]
        found = bare.get(strip_wrappers(fqn), [])
        return by_fqn[found[0]] if len(found) == 1 else {}

    used: set[str] = set()
    plan = []
    adam_skipped = []
    for t in targets:
        have = state_of(t.fqn)
        got: dict[str, str] = {}
        missing = []
        for dst, prefs in _wanted_keys(t, adam_into_muon).items():
            e = next((have[c] for c in prefs if c in have), None)
            if e is None:
                missing.append(dst)
                continue
            _check_shape(e, t, dst)
            dst_dtype = torch.float32 if dst == "step" else t.param.dtype
            if e.dtype != dst_dtype:
                report.casts[e.key] = (str(e.dtype), str(dst_dtype))
            plan.append((t, dst, e))
            used.add(e.key)
            got[dst] = e.key
        if got:
            report.imported[t.fqn] = got
            if missing:
                report.missing[t.fqn] = missing
        else:
            report.fresh.append(t.fqn)
            if t.use_muon and "moment1" in have and not adam_into_muon:
                adam_skipped.append(t.fqn)
    report.unused = sorted(e.key for e in src.entries if e.key not in used)
    if adam_skipped:
        report.hints.append(
            f"{len(adam_skipped)} Muon params (e.g. {adam_skipped[0]}) have Adam state but no "
            "momentum_buffer; pass adam_into_muon=True to use exp_avg as their momentum"
        )
    known = {t.fqn for t in targets}
    strangers = sorted({e.fqn for e in src.entries} - known)
    if strangers and report.fresh:
        report.hints.append(
            f"{len(strangers)} source params match no optimizer param (e.g. {strangers[0]!r}) "
            f"while {len(report.fresh)} params got nothing (e.g. {report.fresh[0]!r}): check "
            "the FQNs (model=/names=)"
        )
    return plan


def _buffer_like(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor with ``like``'s shape, placement and the device of its data, in
    ``dtype`` (a DTensor around a host view keeps its local part on the host)."""
    local = local_tensor(like)
    if not isinstance(like, DTensor) or local.device.type == like.device_mesh.device_type:
        return torch.empty_like(like, dtype=dtype)
    meta = TensorMeta(like.shape, like.stride(), dtype)
    spec = dataclasses.replace(like._spec, tensor_meta=meta)
    return DTensor(torch.empty(local.shape, dtype=dtype), spec, requires_grad=False)


@torch.no_grad()
def import_optimizer_state(
    optimizer: Any,
    source: Any,
    *,
    model: torch.nn.Module | None = None,
    names: Sequence[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    step: int | None = None,
    adam_into_muon: bool = False,
    dry_run: bool = False,
    verify: str = "checksum",
) -> ImportReport:
    """Load optimizer state from ``source`` into ``optimizer`` (a Muon), by parameter FQN.

    Args:
        optimizer: the Muon optimizer to fill; its params may be DTensors; offload may be on.
        source: a ``torch.save``d optimizer state dict, a safetensors file, a DCP checkpoint
            directory (muon-ckpt run root or step, or a plain/torchtitan DCP dir), as a local
            path or fsspec URL; or an already loaded state dict.
        model: gives the optimizer's FQNs (else the groups' ``names``), and the source's
            positional ids when the source has no names of its own.
        names: the source's FQNs in its positional-id order (overrides the above for the source).
        storage_options: fsspec options for a remote ``source``.
        step: which step of a muon-ckpt run to read (default: newest committed).
        adam_into_muon: use Adam's ``exp_avg`` as the momentum of Muon (matrix) params.
        dry_run: plan and check only; the optimizer is not changed.
        verify: for a muon-ckpt source, ``"checksum"`` (former name ``"crc32"``) checks the
            size and checksums of every file read, ``"size"`` sizes only (as
            ``CheckpointManager(verify=)``).

    Raises:
        CheckpointMismatchError: a source tensor's shape does not match its parameter.
        CheckpointNotFoundError: no checkpoint at ``source`` (or not that step).
        CheckpointError: the source cannot be read safely or is not optimizer state.
    """
    targets = _targets(optimizer, model)
    src = open_source(
        source,
        names=names,
        model=model,
        storage_options=storage_options,
        step=step,
        verify=verify,
    )
    if not src.entries:
        raise CheckpointError(
            f"{src.description}: no optimizer state found (expected keys "
            "state.<fqn>.<key> / optim.state.<fqn>.<key>, or an optimizer state dict)"
        )
    report = ImportReport(source=src.description, source_step=src.step, dry_run=dry_run)
    plan = _plan(targets, src, adam_into_muon, report)
    if dry_run:
        return report
    optimizer.init_state()
    # With CPU offload on, states are written where they are parked (pinned host memory):
    # nothing comes to the device, and offload stays on.
    views = optimizer.cpu_state_views() if optimizer.cpu_offload else {}
    dests = []
    for t, dst, _ in plan:
        state = optimizer.state[t.param][dst]
        dests.append(views.get(id(state), state))
    wanted = []
    for (_, dst, e), dest in zip(plan, dests, strict=True):
        buf = torch.empty(e.shape, dtype=e.dtype) if dst == "step" else _buffer_like(dest, e.dtype)
        wanted.append((e, buf))
    src.read(wanted)  # everything is read before anything is written
    for dest, (_, buf) in zip(dests, wanted, strict=True):
        local_tensor(dest).copy_(local_tensor(buf).reshape(local_tensor(dest).shape))
    return report
