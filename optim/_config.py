"""Validation of Muon's constructor arguments and param groups (ValueErrors name field and value)."""

from __future__ import annotations

import difflib
import numbers
import re
from typing import Any

from torch.distributed.tensor import DTensor

from optim._mesh import check_placements, main_mesh
from optim._ns_dtype import NS_DTYPE_CHOICES, NS_METHOD_CHOICES

ADJUST_LR_FNS = ("match_rms_adamw", "original")

GROUP_DEFAULTS: dict[str, Any] = {
    "lr": 0.02,
    "weight_decay": 0.0,
    "momentum": 0.95,
    "nesterov": True,
    "ns_steps": 5,
    "ns_dtype": "auto",
    "ns_method": "auto",
    "none_grad": False,
    "use_muon": True,
    "adamw_betas": (0.9, 0.95),
    "adamw_eps": 1e-8,
}


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _where(gi: int) -> str:
    return f"param group {gi}"


def check_constructor(chunk_size: Any, warmup_step: Any, adjust_lr_fn: Any) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if not isinstance(warmup_step, int) or isinstance(warmup_step, bool) or warmup_step < 0:
        raise ValueError(f"warmup_step must be an int >= 0, got {warmup_step!r}")
    if adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


# torch's names for what Muon's groups call otherwise: given in a group, they would be ignored.
_RENAMED = {"betas": "adamw_betas", "eps": "adamw_eps"}


def _extends(key: str, muon_key: str) -> bool:
    """Whether ``key`` is a name of its own built on ``muon_key`` by whole words
    (``no_weight_decay``, ``weight_decay_mult``), not a typo of it (``weight_decays``)."""
    word = r"[a-z0-9]{2,}"
    return (
        re.fullmatch(rf"{word}_{re.escape(muon_key)}|{re.escape(muon_key)}_{word}", key) is not None
    )


def check_keys(group: dict, gi: int) -> None:
    """Raise ValueError for a key of a group as given by the user (constructor,
    ``add_param_group``) that Muon would ignore: torch's name for a Muon hyperparameter, or a
    near miss of one (a typo). Other keys are kept as they are (schedulers add their own)."""
    where = _where(gi)
    for key in group:
        if key in GROUP_DEFAULTS or key in ("params", "names"):
            continue
        if key in _RENAMED:
            raise ValueError(
                f"{where}: {key!r} is torch.optim's name; Muon's groups take "
                f"{_RENAMED[key]!r} (the value given would be ignored)"
            )
        close = difflib.get_close_matches(key, list(GROUP_DEFAULTS), n=1, cutoff=0.85)
        if close and not _extends(key, close[0]):
            raise ValueError(
                f"{where}: unknown hyperparameter {key!r}; did you mean {close[0]!r}? (the "
                "value given would be ignored)"
            )


def check_group(group: dict, gi: int) -> None:
    """Raise ValueError for the first bad hyperparameter or parameter of ``group``."""
    where = _where(gi)
    lr = group["lr"]
    if not _is_number(lr) or not lr >= 0:  # (NaN too)
        raise ValueError(f"{where}: lr must be a number >= 0, got {lr!r}")
    wd = group["weight_decay"]
    if not _is_number(wd) or not wd >= 0:
        raise ValueError(f"{where}: weight_decay must be a number >= 0, got {wd!r}")
    for key in ("use_muon", "nesterov", "none_grad"):
        if not isinstance(group[key], bool):
            raise ValueError(f"{where}: {key} must be a bool, got {group[key]!r}")
    m = group["momentum"]
    if not _is_number(m) or not 0.0 <= m < 1.0:
        raise ValueError(f"{where}: momentum must be in [0, 1), got {m!r}")
    ns = group["ns_steps"]
    if not isinstance(ns, int) or isinstance(ns, bool) or not 1 <= ns < 100:
        raise ValueError(f"{where}: ns_steps must be an int in [1, 100), got {ns!r}")
    check_ns_dtype(group["ns_dtype"], gi)
    check_ns_method(group["ns_method"], gi)
    betas = group["adamw_betas"]
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(_is_number(b) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ValueError(f"{where}: adamw_betas must be two numbers in [0, 1), got {betas!r}")
    eps = group["adamw_eps"]
    if not _is_number(eps) or not eps >= 0:
        raise ValueError(f"{where}: adamw_eps must be a number >= 0, got {eps!r}")

    params = group["params"]
    names = group.get("names")
    if names is not None:
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{where}: names must be a list of str, got {names!r}")
        if len(names) != len(params):
            raise ValueError(
                f"{where}: names has {len(names)} entries but the group has {len(params)} "
                "params; give one name per param, in the same order"
            )
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if list(names).count(n) > 1})
            raise ValueError(f"{where}: names must be unique, got duplicates {dup}")

    for pi, p in enumerate(params):
        label = repr(names[pi]) if names is not None else f"#{pi}"
        if not p.is_floating_point():
            raise ValueError(f"{where}: param {label} must be floating point, got {p.dtype}")
        if group["use_muon"] and p.ndim < 2 and getattr(p, "_fsdp_flattened", False):
            # (FSDP1's mark on the params it flattens; 1-D: a piece of a flat shard, where
            # NO_SHARD and one rank keep the matrix's shape)
            raise ValueError(
                f"{where}: param {label} (shape {tuple(p.shape)}) is flattened by FSDP1 "
                "(FullyShardedDataParallel; Lightning's FSDPStrategy): this rank holds a piece "
                "of a flat shard, and Muon orthogonalises whole matrices. Shard the model with "
                "fully_shard (FSDP2; Lightning's ModelParallelStrategy), whose DTensors Muon reads"
            )
        if group["use_muon"] and p.ndim < 2:
            raise ValueError(
                f"{where}: param {label} has shape {tuple(p.shape)} but a use_muon=True group "
                "needs >= 2-D matrices; put 0-D/1-D params (biases, norms) in a group with "
                "use_muon=False (AdamW)"
            )
        if group["use_muon"] and isinstance(p, DTensor):
            try:
                check_placements(p, label)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None


def check_ns_dtype(value: Any, gi: int) -> None:
    if not isinstance(value, str) or value not in NS_DTYPE_CHOICES:
        raise ValueError(
            f"{_where(gi)}: ns_dtype must be one of {NS_DTYPE_CHOICES} (the dtype Newton-Schulz "
            f"runs in; 'auto': bf16 where the device has fast bf16 matrix units), got {value!r}"
        )


def check_ns_method(value: Any, gi: int) -> None:
    if not isinstance(value, str) or value not in NS_METHOD_CHOICES:
        raise ValueError(
            f"{_where(gi)}: ns_method must be one of {NS_METHOD_CHOICES} ('gram': the Gram "
            "iteration for matrices whose aspect ratio exceeds 2, 'standard': torch.optim.Muon's "
            f"iteration; 'auto': gram on CUDA and in fp32), got {value!r}"
        )


def check_meshes(groups: list[dict]) -> None:
    """Raise ValueError unless the Muon params' meshes are one mesh and slices of it
    (``_mesh.main_mesh``); AdamW params, updated where they lie, may be on any mesh."""
    meshes = []
    for g in groups:
        if g["use_muon"]:
            for p in g["params"]:
                if isinstance(p, DTensor) and all(p.device_mesh is not m for m in meshes):
                    meshes.append(p.device_mesh)
    main_mesh(meshes)
