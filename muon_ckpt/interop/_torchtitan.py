"""torchtitan's checkpoint layout, both ways (no torchtitan needed for either).

torchtitan's ``CheckpointManager`` (``torchtitan/components/checkpointer/dcp.py``) writes one
plain DCP directory per step, ``<folder>/step-<N>`` (no padding; a step counts once its
``.metadata`` exists), of one state dict whose keys are::

    <fqn>                                   the model's state_dict(), at the top level
    optimizer.state.<fqn>.<key>             OptimizersContainer: torch's flattened optimizer
    optimizer.param_groups.<fqn>.<hparam>     state, every group entry once per parameter
    lr_scheduler.last_epoch                 LRSchedulersContainer
    dataloader.dp_rank_<r>, .world_size     each data-parallel rank's StatefulDataLoader state
    train_state.step, .ntokens_seen         the Trainer

and its loader asks for every key its objects' ``state_dict()`` has (DCP's default planner).

``export_torchtitan`` writes a step of ours in that layout: ``model.<fqn>`` at the top level,
``optim.state.<fqn>.moment1``/``moment2`` as torch's ``exp_avg``/``exp_avg_sq`` (``step``,
``momentum_buffer`` and other names as they are), each group's hyperparameters once per
parameter (``adamw_betas``/``adamw_eps`` as ``betas``/``eps``), ``extra.lr_scheduler`` as
``lr_scheduler``, and each rank's ``rank_extra.<r>.dataloader`` and (rank 0's)
``rank_extra.<r>.train_state`` as ``dataloader``/``train_state``: what
``MuonCheckpointManager`` saves.
``import_torchtitan`` loads such a step into a model, a Muon optimizer (through
``import_optimizer_state``: ``exp_avg`` -> ``moment1``, ...) and objects of torchtitan's
kind (``load_state_dict`` of each section).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor

import muon_ckpt._collective as coll
import muon_ckpt._dcp as _dcp
from muon_ckpt._errors import CheckpointMismatchError, CheckpointNotFoundError
from muon_ckpt._tensors import local_tensor
from muon_ckpt.interop._import import ImportReport, import_optimizer_state
from muon_ckpt.load import CheckpointReader
from muon_ckpt.state import canonical_names, strip_wrappers
from muon_ckpt.store import METADATA, Storage, resolve
from muon_ckpt.store.dcp import bytes_keys, dcp_filesystem, tensor_entries

__all__ = [
    "TITAN_SECTIONS",
    "TorchtitanExportSummary",
    "TorchtitanImportReport",
    "export_torchtitan",
    "find_torchtitan_step",
    "import_torchtitan",
]

# torchtitan's names of its non-model states (checkpointer/base.py).
OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE = (
    "optimizer",
    "lr_scheduler",
    "dataloader",
    "train_state",
)
TITAN_SECTIONS = (OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE)
_STATE_OUT = {"moment1": "exp_avg", "moment2": "exp_avg_sq"}  # ours -> torch's (rest as is)
_HPARAM_OUT = {"adamw_betas": "betas", "adamw_eps": "eps"}
_STEP_RE = re.compile(r"step-(\d+)")  # torchtitan's own pattern (re.search, as it does)
_GROUPS = "optim.param_groups."


def find_torchtitan_step(source: str, storage_options: dict[str, Any] | None = None) -> str:
    """``source`` itself when it is a DCP directory (a torchtitan step), else the newest
    ``step-<N>`` under it that has a ``.metadata``, as torchtitan's loader picks it."""
    storage = Storage(source, storage_options)
    if storage.isfile(METADATA):
        return storage.url_of()
    steps = []
    for name in storage.listdir() if storage.exists() else []:
        m = _STEP_RE.search(name)
        if m and storage.isfile(name, METADATA):
            steps.append((int(m.group(1)), name))
    if not steps:
        raise CheckpointNotFoundError(
            f"{source!r}: no torchtitan step (a step-<N> directory with a {METADATA}) and "
            "not a DCP directory itself"
        )
    return storage.url_of(max(steps)[1])


# ---------------------------------------------------------------------------- export


@dataclass
class TorchtitanExportSummary:
    """What ``export_torchtitan`` wrote: ``step_dir`` and its key counts; ``defaults``: keys
    torchtitan's loader asks for that the step did not hold, written with these values."""

    step_dir: str
    step: int
    tensors: int = 0
    objects: int = 0
    defaults: dict[str, Any] = field(default_factory=dict)
    sections: list[str] = field(default_factory=list)


def _out_name(key: str) -> str | None:
    """The torchtitan key of a stored key (None: not exported; groups are done apart)."""
    head, _, rest = key.partition(".")
    if head == "model":
        return rest
    if key.startswith("optim.state."):
        fqn, _, name = key[len("optim.state.") :].rpartition(".")
        return f"{OPTIMIZER}.state.{fqn}.{_STATE_OUT.get(name, name)}"
    if head == "extra":
        name, _, path = rest.partition(".")
        return f"{name}.{path}" if name == LR_SCHEDULER and path else None
    if head == "rank_extra":
        _, _, tail = rest.partition(".")
        name, _, path = tail.partition(".")
        return f"{name}.{path}" if name in (DATALOADER, TRAIN_STATE) and path else None
    return None


def _rank_order(key: str) -> tuple[int, str]:
    """Rank 0's ``rank_extra`` first (torchtitan keeps one copy of a key every rank saves)."""
    parts = key.split(".", 2)
    if parts[0] == "rank_extra" and len(parts) > 1 and parts[1].isdigit():
        return int(parts[1]), key
    return -1, key


def _group_items(hp: dict[str, Any]) -> dict[str, Any]:
    """Our groups' hyperparameters (``optim.param_groups.<lead>.<hparam>`` and the group's
    ``params`` list) as torchtitan's per-parameter ``param_groups.<fqn>.<hparam>``."""
    leads: dict[str, dict[str, Any]] = {}
    for key, value in hp.items():
        lead, _, name = key[len(_GROUPS) :].rpartition(".")
        leads.setdefault(lead, {})[name] = value
    out: dict[str, Any] = {}
    for lead, group in leads.items():
        fqns = group.pop("params", None) or [lead]  # (0.2 stored hyperparameters per param)
        for fqn in fqns:
            for name, value in group.items():
                out[
                    f"{OPTIMIZER}.param_groups.{strip_wrappers(fqn)}.{_HPARAM_OUT.get(name, name)}"
                ] = value
    return out


def export_torchtitan(
    url: str,
    out_dir: str,
    *,
    step: int | None = None,
    model_only: bool = False,
    storage_options: dict[str, Any] | None = None,
    verify: str = "checksum",
) -> TorchtitanExportSummary:
    """Write a step of ours as torchtitan's step ``<out_dir>/step-<N>`` (``N``: the saved
    ``train_state.step``, else the step), which torchtitan's ``CheckpointManager`` resumes
    with ``checkpoint.folder`` at ``out_dir``.

    Full tensors, written by this one process (it holds the whole step in memory).
    ``model_only``: the weights alone, for torchtitan's ``initial_load_path`` (with
    ``initial_load_model_only``). Otherwise also the optimizer, ``lr_scheduler`` and
    ``train_state`` (``train_state.step``/``ntokens_seen`` default to the step and 0, said
    in ``defaults``) and ``dataloader`` when the step has it; torchtitan asks for every key of
    its objects, so resume with the optimizer the step was saved with (its state and group
    keys), and with ``checkpoint.exclude_from_loading=["dataloader"]`` for a step without
    one."""
    reader = CheckpointReader(resolve(Storage(url, storage_options), step), verify=verify)
    r, md = reader.resolved, reader.metadata
    if r.manifest is None or r.step is None:
        raise ValueError(
            f"{r.url} is a plain DCP directory, not a muon-ckpt step; torchtitan reads it "
            "as it is (export_torchtitan converts muon-ckpt's keys)"
        )
    names: dict[str, str | None] = {}
    taken: set[str | None] = set()
    for k in sorted([*tensor_entries(md), *bytes_keys(md)], key=_rank_order):
        n = _out_name(k)
        names[k] = None if n in taken else n  # a rank's copy of rank 0's (world_size, ...)
        taken.add(n)
    if model_only:
        names = {k: n for k, n in names.items() if k.startswith("model.")}
    wanted = {k: n for k, n in names.items() if n is not None}
    groups = [] if model_only else [k for k in bytes_keys(md) if k.startswith(_GROUPS)]
    sd: dict[str, Any] = {}
    for k, tm in tensor_entries(md).items():
        if k in wanted:
            sd[k] = torch.empty(tm.size, dtype=tm.properties.dtype)
    for k in bytes_keys(md):
        if k in wanted or k in groups:
            sd[k] = None
    reader.load(sd)
    out = {wanted[k]: v for k, v in sd.items() if k in wanted}
    clash = [n for n in out if "." not in n and n in TITAN_SECTIONS]
    if clash:
        raise CheckpointMismatchError(
            f"{r.url}: model key {clash[0]!r} is also a torchtitan state name; torchtitan's "
            "layout cannot hold it"
        )
    out.update(_group_items({k: sd[k] for k in groups}))
    summary = TorchtitanExportSummary("", r.step)
    if not model_only:
        if f"{TRAIN_STATE}.step" not in out:
            summary.defaults = {f"{TRAIN_STATE}.step": r.step, f"{TRAIN_STATE}.ntokens_seen": 0}
            out.update(summary.defaults)
        elif f"{TRAIN_STATE}.ntokens_seen" not in out:
            summary.defaults = {f"{TRAIN_STATE}.ntokens_seen": 0}
            out.update(summary.defaults)
    titan_step = out.get(f"{TRAIN_STATE}.step", r.step)
    if not isinstance(titan_step, int) or titan_step < 0:
        raise CheckpointMismatchError(
            f"{r.url}: extra['train_state'] step is {titan_step!r}, expected an int >= 0"
        )
    target = Storage(out_dir, storage_options if "://" in out_dir else None)
    name = f"step-{titan_step}"
    if target.exists(name, METADATA):
        raise FileExistsError(f"{target.url_of(name)} already holds a torchtitan step")
    target.makedirs(name)
    path = target.path(name)
    writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=target.is_local)
    writer.fs = dcp_filesystem(target)
    writer.path = writer.fs.init_path(path)
    _dcp.save(out, writer, None, None, f"writing {target.url_of(name)}", alone=True)
    summary.step_dir = target.url_of(name)
    summary.tensors = sum(isinstance(v, torch.Tensor) for v in out.values())
    summary.objects = len(out) - summary.tensors
    summary.sections = sorted(
        {n.split(".", 1)[0] for n in out if n.split(".", 1)[0] in TITAN_SECTIONS}
        | ({"model"} if any(n.split(".", 1)[0] not in TITAN_SECTIONS for n in out) else set())
    )
    return summary


# ---------------------------------------------------------------------------- import


@dataclass
class TorchtitanImportReport:
    """What ``import_torchtitan`` loaded from ``source`` (the step directory)."""

    source: str
    step: int | None  # the step's train_state.step (None: the step has none)
    model: list[str] = field(default_factory=list)  # FQNs loaded
    optimizer: ImportReport | None = None
    states: list[str] = field(default_factory=list)  # sections given to load_state_dict
    unused: list[str] = field(default_factory=list)  # sections of the step nothing took


def _section(key: str, claimed: set[str]) -> str | None:
    head = key.split(".", 1)[0]
    return head if "." in key and head in claimed else None


@torch.no_grad()
def import_torchtitan(
    source: str,
    *,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    states: Mapping[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    adam_into_muon: bool = False,
) -> TorchtitanImportReport:
    """Load a torchtitan step into ``model`` (by FQN), ``optimizer`` (a Muon:
    ``import_optimizer_state``) and ``states`` (``{section: obj}``: ``obj.load_state_dict``
    gets the section's keys, e.g. torchtitan's ``lr_scheduler``, ``dataloader``,
    ``train_state`` objects). ``source``: a torchtitan checkpoint folder (its newest step)
    or one ``step-<N>`` directory. Call it on every rank (each reads what its DTensor shards
    need). Names, shapes and dtypes are checked before anything changes; a section of the
    step that nothing takes is reported (``unused``)."""
    where = find_torchtitan_step(source, storage_options)
    reader = CheckpointReader(
        resolve(Storage(where, storage_options)),
        verify="size",  # a plain DCP directory has no checksums
        rank=coll.rank(),
        world_size=coll.world_size(),
    )
    md = reader.metadata
    have = md.state_dict_metadata
    claimed = set(TITAN_SECTIONS) | set(states or {})
    model_keys = [k for k in have if _section(k, claimed) is None]
    report = TorchtitanImportReport(where, None)
    sd: dict[str, Any] = {}
    targets: dict[str, torch.Tensor] = {}
    if model is not None:
        own = model.state_dict()
        clean = canonical_names(model, list(own))
        want = {clean[k]: v for k, v in own.items() if isinstance(v, torch.Tensor)}
        missing = sorted(set(want) - set(model_keys))
        extra = sorted(set(model_keys) - set(want))
        if missing or extra:
            raise CheckpointMismatchError(
                f"{where}: the model's keys and the step's differ: the model has "
                f"{missing[:6]} that the step lacks, the step has {extra[:6]} that the model "
                "lacks; build the model the step was saved from (or claim a section of your "
                "own with states=)"
            )
        for fqn, t in want.items():
            tm = have[fqn]
            if tuple(tm.size) != tuple(t.shape) or getattr(tm, "properties", None) is None:
                raise CheckpointMismatchError(
                    f"{where}: {fqn!r} has shape {tuple(tm.size)} in the step but "
                    f"{tuple(t.shape)} in the model"
                )
            if tm.properties.dtype != t.dtype:
                raise CheckpointMismatchError(
                    f"{where}: {fqn!r} is {tm.properties.dtype} in the step but {t.dtype} "
                    "in the model; cast the model first"
                )
            sd[fqn] = torch.empty_like(t)
            targets[fqn] = t
    for name in states or {}:
        keys = [k for k in have if k.startswith(f"{name}.")]
        if not keys:
            raise CheckpointMismatchError(
                f"{where}: no {name!r} state in the step (it has "
                f"{sorted({k.split('.', 1)[0] for k in have if '.' in k} & claimed)})"
            )
        for k in keys:
            sd[k] = (
                torch.empty(have[k].size, dtype=have[k].properties.dtype)
                if k in tensor_entries(md)
                else None
            )
    if optimizer is not None and not any(k.startswith(f"{OPTIMIZER}.state.") for k in have):
        raise CheckpointMismatchError(f"{where}: the step holds no optimizer state")
    if optimizer is not None:  # checked before anything is read into place
        import_optimizer_state(
            optimizer,
            where,
            model=model,
            adam_into_muon=adam_into_muon,
            dry_run=True,
            storage_options=storage_options,
            verify="size",
        )
    reader.load(sd)  # everything read before anything changes
    for fqn, t in targets.items():
        _copy(t, sd[fqn])
    report.model = sorted(targets)
    if optimizer is not None:
        report.optimizer = import_optimizer_state(
            optimizer,
            where,
            model=model,
            adam_into_muon=adam_into_muon,
            storage_options=storage_options,
            verify="size",
        )
    for name, obj in (states or {}).items():
        obj.load_state_dict(
            {k[len(name) + 1 :]: v for k, v in sd.items() if k.startswith(f"{name}.")}
        )
        report.states.append(name)
    sections = {k.split(".", 1)[0] for k in have if _section(k, claimed)}
    taken = set(report.states) | ({OPTIMIZER} if optimizer is not None else set())
    report.unused = sorted(sections - taken)
    step = sd.get(f"{TRAIN_STATE}.step")
    if step is None and f"{TRAIN_STATE}.step" in have:
        probe: dict[str, Any] = {f"{TRAIN_STATE}.step": None}
        reader.load(probe)
        step = probe[f"{TRAIN_STATE}.step"]
    report.step = step if isinstance(step, int) else None
    return report


def _copy(dest: torch.Tensor, src: torch.Tensor) -> None:
    if isinstance(dest, DTensor):
        local_tensor(dest).copy_(local_tensor(src))
    else:
        dest.copy_(src)
