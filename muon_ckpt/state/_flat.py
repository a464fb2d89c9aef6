"""Model / optimizer / extra state <-> one flat DCP state dict keyed by parameter FQN.

Save and load build the same dict; its tensor values ARE the live tensors (parameters, buffers,
optimizer states), so ``dcp.load`` writes into them in place and DTensors reshard on the way.
Keys (see ``store._layout``; FQNs without wrapper prefixes, see ``state._names``)::

    model.<fqn>                        every entry of model.state_dict()
    optim.state.<fqn>.<key>            every entry of optimizer.state[param]
    optim.param_groups.<lead>.<hparam>  every hyperparameter of a group (not params/names), once:
                                       <lead> is the FQN of the group's first param
    optim.param_groups.<lead>.params   the FQNs of the group's params (a list)
    extra.<name>                       obj.state_dict(), nested; DCP flattens it to extra.<name>.<k>
    rank_extra.<rank>.<name>           the same, for each rank's own objects
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from muon_ckpt._errors import CheckpointMismatchError
from muon_ckpt._tensors import host_copy
from muon_ckpt.state._names import canonical_names, legacy_aliases, param_fqns, strip_wrappers
from muon_ckpt.store import extra_key, model_key, optim_group_key, optim_state_key, rank_extra_key

__all__ = [
    "PARTS",
    "FlatState",
    "LoadReport",
    "check_stateful",
    "extra_digests",
    "module_extra_states",
]

PARTS = ("model", "optim", "extra", "rank_extra")
_GROUP_SKIP = ("params", "names")
_GROUPS = "optim.param_groups."
_EXTRA_STATE = "_extra_state"  # torch's key for a module's get_extra_state()
_WRAPPED = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod", "module")


def extra_state_owner(model: torch.nn.Module, key: str) -> torch.nn.Module | None:
    """The module whose ``get_extra_state()`` is ``model.state_dict()``'s entry ``key``, or
    None when ``key`` is not such an entry."""
    if key != _EXTRA_STATE and not key.endswith("." + _EXTRA_STATE):
        return None
    owner: Any = model.get_submodule(key[: -len(_EXTRA_STATE)].rstrip("."))
    while type(owner).get_extra_state is torch.nn.Module.get_extra_state:
        # A wrapper whose state_dict() names its wrapped module's entries as its own
        # (activation checkpointing, FSDP1, torch.compile), or a parameter or buffer of
        # that name (None).
        inner = next((getattr(owner, a) for a in _WRAPPED if hasattr(owner, a)), None)
        if not isinstance(inner, torch.nn.Module):
            return None
        owner = inner
    return owner


class _ExtraState:
    """A module's extra state (``get_extra_state``/``set_extra_state``) as a Stateful."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def state_dict(self) -> Any:
        return self._module.get_extra_state()

    def load_state_dict(self, state: Any) -> None:
        self._module.set_extra_state(state)


def module_extra_states(model: torch.nn.Module | None) -> dict[str, Any]:
    """Every module's extra state of ``model`` as a Stateful, by its state-dict key (what a
    load changes besides tensors, kept to be restored)."""
    if model is None:
        return {}
    out: dict[str, Any] = {}
    for key in model.state_dict(keep_vars=True):
        owner = extra_state_owner(model, key)
        if owner is not None:
            out[key] = _ExtraState(owner)
    return out


def check_stateful(field_name: str, objs: Any) -> dict[str, Any]:
    """Validate ``extra`` / ``rank_extra`` (construction time): a dict of name -> Stateful."""
    if objs is None:
        return {}
    if not isinstance(objs, dict):
        raise ValueError(
            f"{field_name} must be a dict of name -> object with state_dict()/load_state_dict(), "
            f"got {type(objs).__name__}"
        )
    for name, obj in objs.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(
                f"{field_name} names must be non-empty strings without '/', got {name!r}"
            )
        missing = [
            m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))
        ]
        if missing:
            raise ValueError(
                f"{field_name}[{name!r}] must have state_dict() and load_state_dict() (torch's "
                f"Stateful protocol), got a {type(obj).__name__} without {' and '.join(missing)}; "
                "wrap it in an object that defines both"
            )
    return dict(objs)


def check_objects(
    model: Any, optimizer: Any, extra: Any, rank_extra: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Validate the objects a manager saves and loads (construction time); the ``extra`` and
    ``rank_extra`` dicts."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    extra, rank_extra = check_stateful("extra", extra), check_stateful("rank_extra", rank_extra)
    both = sorted(set(extra) & set(rank_extra))
    if both:
        raise ValueError(f"{both} are names in both extra and rank_extra; use each name once")
    if optimizer is not None:
        param_fqns(model, optimizer)  # a param without a name is a configuration error
    return extra, rank_extra


def extra_digests(extra: dict[str, Any]) -> dict[str, str]:
    """A digest of each ``extra`` object's state (values, tensors by their bytes), so ranks can
    check cheaply that they save the same thing."""
    out = {}
    for name, obj in extra.items():
        h = hashlib.blake2b(digest_size=16)
        _feed(h, obj.state_dict())
        out[name] = h.hexdigest()
    return out


def _feed(h: Any, v: Any) -> None:
    """Feed ``v`` into ``h`` independently of the process: dict items and set elements in
    sorted order (insertion order and string hashing differ between processes)."""
    if isinstance(v, Tensor):
        h.update(f"T{v.dtype}{tuple(v.shape)}".encode())
        if not hasattr(v, "_local_tensor"):  # a DTensor's shards differ by rank: shape only
            t = v.detach().cpu().contiguous()
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(v, dict):
        h.update(b"D%d" % len(v))
        for k, x in sorted(v.items(), key=lambda kv: repr(kv[0])):
            _feed(h, k)
            _feed(h, x)
    elif isinstance(v, (set, frozenset)):
        h.update(b"S%d" % len(v))
        for x in sorted(v, key=repr):
            _feed(h, x)
    elif isinstance(v, (list, tuple)):
        h.update(b"L%d" % len(v))
        for x in v:
            _feed(h, x)
    else:
        h.update(pickle.dumps(v, protocol=4))


def prepare_optimizer_state(optimizer: torch.optim.Optimizer) -> set[int]:
    """Create missing state (no step, parameters untouched) so a load can fill it in place.

    Returns the ids of params whose state was created here.
    """
    before = {id(p) for p, st in optimizer.state.items() if st}
    init = getattr(optimizer, "init_state", None)
    if callable(init):
        init()
    elif not before:
        # Any other torch optimizer: one step with zero grads and lr=0 (torch's own helper for
        # the same purpose); parameters do not change, the state tensors are created.
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(optimizer)
    return {id(p) for p, st in optimizer.state.items() if st} - before


@dataclass
class LoadReport:
    """What a load did not load as is (``load(strict=False)``; empty for a strict load).

    ``missing``: keys of this model/optimizer that the checkpoint lacks (left as they were;
    optimizer state created for the load starts fresh: zeros, step 0); ``unexpected``: keys of
    the checkpoint that nothing here takes; ``mismatched``: ``(key, why)`` for keys whose
    shape, dtype or kind differ (left as they were); ``kept_hparams``: ``(group, hparam, why)``
    for hyperparameters left as they are because the group's params disagreed when saved.
    """

    step: int | None = None
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, str]] = field(default_factory=list)
    kept_hparams: list[tuple[int, str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched or self.kept_hparams)

    def summary(self) -> str:
        parts = []
        for name, items in (
            ("missing from the checkpoint", self.missing),
            ("not taken from the checkpoint", self.unexpected),
            ("different shape/dtype/kind", [k for k, _ in self.mismatched]),
            ("hyperparameters kept", [f"group {g} {h}" for g, h, _ in self.kept_hparams]),
        ):
            if items:
                shown = ", ".join(items[:6]) + (
                    f", ... ({len(items)} in all)" if len(items) > 6 else ""
                )
                parts.append(f"{name}: {shown}")
        return "; ".join(parts) or "everything matched"


@dataclass
class FlatState:
    """The flat dict handed to DCP, plus where each optimizer entry goes back."""

    sd: dict[str, Any] = field(default_factory=dict)
    # key -> (param, state key) for optimizer state
    state_slots: dict[str, tuple[Tensor, str]] = field(default_factory=dict)
    group_fqns: list[list[str]] = field(default_factory=list)  # each group's param FQNs
    # key -> extra, rank_extra or a module's extra state (a Stateful)
    stateful: dict[str, Any] = field(default_factory=dict)
    group_of: dict[str, int] = field(default_factory=dict)  # param FQN -> its group's index
    unsure_groups: set[int] = field(default_factory=set)  # relaxed: groups with a changed param
    stateless: list[Tensor] = field(default_factory=list)  # params without state when saved

    @classmethod
    def build(
        cls,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        extra: dict[str, Any],
        *,
        rank_extra: dict[str, Any] | None = None,
        rank: int = 0,
        parts: tuple[str, ...] = PARTS,
    ) -> FlatState:
        fs = cls()
        if model is not None and "model" in parts:
            msd = model.state_dict()
            clean = canonical_names(model, list(msd))
            for k, v in msd.items():
                fs.sd[model_key(clean[k])] = v
                owner = extra_state_owner(model, k)
                if owner is not None:  # loaded through set_extra_state, as extra is
                    fs.stateful[model_key(clean[k])] = _ExtraState(owner)
        if optimizer is not None and "optim" in parts:
            fqns = param_fqns(model, optimizer)
            for gi, (group, names) in enumerate(zip(optimizer.param_groups, fqns, strict=True)):
                fs.group_fqns.append(names)
                for p, fqn in zip(group["params"], names, strict=True):
                    fs.group_of[fqn] = gi
                    for sk, v in optimizer.state.get(p, {}).items():
                        key = optim_state_key(fqn, sk)
                        fs.sd[key] = v
                        fs.state_slots[key] = (p, sk)
                if not names:
                    continue
                # Once per group, under its first param's name, with the names of all of them:
                # a load maps each of its groups to the saved group that held its params.
                fs.sd[optim_group_key(names[0], "params")] = list(names)
                for hk, hv in group.items():
                    if hk not in _GROUP_SKIP:
                        fs.sd[optim_group_key(names[0], hk)] = hv
        objs = []
        if "extra" in parts:
            objs += [(extra_key(n), o) for n, o in extra.items()]
        if "rank_extra" in parts:
            objs += [(rank_extra_key(rank, n), o) for n, o in (rank_extra or {}).items()]
        for key, obj in objs:
            fs.sd[key] = obj.state_dict()
            fs.stateful[key] = obj
        return fs

    def host_state_keys(self, views: dict[int, Tensor]) -> set[str]:
        """The keys whose state has a host view in ``views`` (``id(state tensor) -> view``)."""
        return {k for k in self.state_slots if id(self.sd[k]) in views}

    def use_host_states(self, views: dict[int, Tensor]) -> set[str]:
        """Put the host view of each offloaded state (from the optimizer) where the state
        itself was; returns the keys replaced."""
        keys = self.host_state_keys(views)
        for k in keys:
            self.sd[k] = views[id(self.sd[k])]
        return keys

    def detach_objects(self) -> None:
        """Deep copies of every non-tensor value (hyperparameters, ``extra`` state dicts; their
        tensors as CPU copies), so that a background write sees the values of this moment."""
        for key, v in self.sd.items():
            if not isinstance(v, Tensor):
                self.sd[key] = host_copy(v)

    # ------------------------------------------------------------------ load side
    def _drop(self, key: str) -> None:
        del self.sd[key]
        self.state_slots.pop(key, None)

    def _rename(self, key: str, saved: str) -> None:
        """Load ``key`` from the checkpoint's ``saved`` (a name from before canonical FQNs)."""
        self.sd[saved] = self.sd.pop(key)
        if key in self.state_slots:
            self.state_slots[saved] = self.state_slots.pop(key)
        if key in self.stateful:
            self.stateful[saved] = self.stateful.pop(key)

    def check_against(
        self, metadata: Any, fresh: set[int], url: str, *, strict: bool = True
    ) -> LoadReport:
        """Fit the dict to the checkpoint before anything is read.

        Strict: raise CheckpointMismatchError for a missing key, a wrong shape/dtype, or a
        model/optimizer key of the checkpoint that nothing here takes. Relaxed: leave those
        out of the load and report them. Either way, optimizer state that this load created
        for a param that had none when saved is dropped again, and hyperparameters the
        checkpoint does not have are left as they are.
        """
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        report = LoadReport()
        have = metadata.state_dict_metadata
        if self.group_fqns:
            # Hyperparameters: read every saved group entry (small Python values) and map them
            # to this optimizer's groups after the read (apply_loaded), whatever the grouping.
            for key in [k for k in self.sd if k.startswith(_GROUPS)]:
                del self.sd[key]
            for key, md in have.items():
                if key.startswith(_GROUPS):  # a tensor hyperparameter is read into a new one
                    tensor = isinstance(md, TensorStorageMetadata)
                    self.sd[key] = (
                        torch.empty(md.size, dtype=md.properties.dtype) if tensor else None
                    )
        aliases = legacy_aliases(have)
        for key in [k for k in self.sd if k not in have]:
            if key in aliases:
                self._rename(key, aliases[key])
            elif key in self.stateful:  # a dict module extra state, flattened, wrapped names
                under = next((a for a in aliases if a.startswith(f"{key}.")), None)
                if under is not None:
                    self._rename(key, aliases[under][: len(aliases[under]) - len(under) + len(key)])
        for key in list(self.stateful):
            flat, _ = flatten_state_dict({key: self.sd[key]})
            missing = sorted(k for k in flat if k not in have)
            if not missing:
                why = next(
                    (
                        f"{k!r} {w}"
                        for k, v in flat.items()
                        if (w := _mismatch(v, have[k], TensorStorageMetadata)) is not None
                    ),
                    None,
                )
                if why is None:
                    continue
                if strict:
                    raise CheckpointMismatchError(f"{url}: {_display(key)}: key {why}")
                report.mismatched.append((key, why))
                self._drop(key)
                del self.stateful[key]
                continue
            if not strict:
                report.missing.append(key)
                self._drop(key)
                del self.stateful[key]
                continue
            raise CheckpointMismatchError(
                f"{url}: {_display(key)} has key(s) {missing[:8]} that the checkpoint does not: its "
                "state_dict() differs from the one saved; the checkpoint has "
                f"{sorted(k for k in have if k.startswith(f'{key}.'))[:8]}; load(strict=False) "
                "leaves it as it is"
            )
        saved_state_fqns = {k.rsplit(".", 1)[0] for k in have if k.startswith("optim.state.")}
        for key in list(self.sd):
            if key in self.stateful:
                continue
            if key.startswith(_GROUPS):
                continue
            if key in self.state_slots and key not in have:
                p, _ = self.state_slots[key]
                fqn = key.rsplit(".", 1)[0]
                if id(p) in fresh and fqn not in saved_state_fqns:
                    self._drop(key)  # no state when saved: removed again after the load
                    self.stateless.append(p)
                    continue
            why = None if key in have else "missing"
            if why is None:
                why = _mismatch(self.sd[key], have[key], TensorStorageMetadata)
            if why is None:
                continue
            if strict:
                if why == "missing":
                    raise CheckpointMismatchError(_missing_msg(key, have, set(self.sd), url))
                raise CheckpointMismatchError(f"{url}: key {key!r} {why}")
            if why == "missing":
                report.missing.append(key)
            else:
                report.mismatched.append((key, why))
            if key in self.state_slots:  # its group's saved hyperparameters may be another's
                gi = self.group_of.get(key[len("optim.state.") :].rsplit(".", 1)[0])
                if gi is not None:
                    self.unsure_groups.add(gi)
            self._drop(key)
        ours = set(self.sd)
        sections = [s for s in ("model.", "optim.state.") if any(k.startswith(s) for k in ours)]
        nested = tuple(f"{k}." for k in self.stateful)  # a module's extra state, flattened
        unexpected = sorted(
            k
            for k in have
            if k.startswith(tuple(sections)) and k not in ours and not k.startswith(nested)
        )
        dropped = {k for k in report.missing} | {k for k, _ in report.mismatched}
        unexpected = [k for k in unexpected if k not in dropped]
        if unexpected and strict:
            raise CheckpointMismatchError(
                f"{url}: the checkpoint has {len(unexpected)} key(s) this model/optimizer does "
                f"not: {unexpected[:8]}; was a parameter renamed or removed? load(strict=False) "
                "loads what matches and reports the rest"
            )
        report.unexpected = unexpected
        return report

    def apply_loaded(
        self,
        optimizer: torch.optim.Optimizer | None,
        url: str,
        report: LoadReport,
        *,
        strict: bool = True,
    ) -> None:
        """Write back what DCP could not load in place (Python values, hyperparameters, extra)."""
        if optimizer is not None:
            for p in self.stateless:
                optimizer.state.pop(p, None)
            for key, (p, sk) in self.state_slots.items():
                v = self.sd[key]
                if not isinstance(v, Tensor):
                    optimizer.state[p][sk] = v
            saved = self._saved_hparams()
            for gi, fqns in enumerate(self.group_fqns):
                self._apply_group(
                    optimizer, gi, [f for f in fqns if f in saved], saved, url, report, strict
                )
        for key, obj in self.stateful.items():
            obj.load_state_dict(self.sd[key])

    def _saved_hparams(self) -> dict[str, dict[str, Any]]:
        """Param FQN -> the hyperparameters of its group when saved, from the group entries
        read (``<lead>.params`` lists), or from per-param entries (muon-ckpt <= 0.2)."""
        groups: dict[str, dict[str, Any]] = {}
        for key, v in self.sd.items():
            if key.startswith(_GROUPS):
                lead, hk = key[len(_GROUPS) :].rsplit(".", 1)
                groups.setdefault(strip_wrappers(lead), {})[hk] = v
        out: dict[str, dict[str, Any]] = {}
        for lead, hp in groups.items():
            params = hp.pop("params", None)
            for fqn in params if isinstance(params, list) else [lead]:
                out[strip_wrappers(fqn)] = hp
        return out

    def _apply_group(
        self,
        optimizer: torch.optim.Optimizer,
        gi: int,
        fqns: list[str],
        saved: dict[str, dict[str, Any]],
        url: str,
        report: LoadReport,
        strict: bool,
    ) -> None:
        """Set group ``gi``'s hyperparameters from the saved group(s) of its params ``fqns``."""
        group = optimizer.param_groups[gi]
        for hk in sorted({h for f in fqns for h in saved[f]} - set(_GROUP_SKIP)):
            have = [(f, saved[f][hk]) for f in fqns if hk in saved[f]]
            (f0, v0), rest = have[0], have[1:]
            odd = next(((f, v) for f, v in rest if v is not v0 and not _same(v0, v)), None)
            if odd is not None:
                if strict:
                    raise CheckpointMismatchError(
                        f"{url}: params {f0!r} and {odd[0]!r} share param group {gi} here but "
                        f"were in groups with {hk}={v0!r} and {hk}={odd[1]!r} when saved (was a "
                        "param moved to another group?); load(strict=False) keeps this group's "
                        "own hyperparameters"
                    )
                report.kept_hparams.append((gi, hk, "its params had different values"))
            elif gi in self.unsure_groups:
                if not _same(group.get(hk), v0):
                    why = "a param of the group has state that does not match the checkpoint"
                    report.kept_hparams.append((gi, hk, why))
            elif _same_layout(group.get(hk), v0):
                group[hk].copy_(v0)  # in place: a scheduler or a captured graph holds it
            else:
                group[hk] = v0


def _display(key: str) -> str:
    """``extra.sched`` -> ``extra['sched']``; ``rank_extra.1.data`` -> ``rank_extra['data']``."""
    head, rest = key.split(".", 1)
    if head == "rank_extra":
        rank, name = rest.split(".", 1)
        return f"rank_extra[{name!r}] of rank {rank}"
    return f"{head}[{rest!r}]"


def _mismatch(value: Any, md: Any, tensor_md: type) -> str | None:
    is_tensor = isinstance(value, Tensor)
    if is_tensor != isinstance(md, tensor_md):
        kind = "a tensor" if isinstance(md, tensor_md) else "a Python object"
        here = "a tensor" if is_tensor else type(value).__name__
        return f"is {kind} in the checkpoint but {here} here"
    if not is_tensor:
        return None
    if tuple(value.shape) != tuple(md.size):
        return (
            f"has shape {tuple(md.size)} in the checkpoint but {tuple(value.shape)} in this "
            "model/optimizer; build the model with the shapes it was saved with"
        )
    if value.dtype != md.properties.dtype:
        return (
            f"has dtype {md.properties.dtype} in the checkpoint but {value.dtype} here; cast the "
            "model/optimizer to match first"
        )
    return None


def _same_layout(a: Any, b: Any) -> bool:
    return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:
        return False


def _missing_msg(key: str, have: dict[str, Any], ours: set[str], url: str) -> str:
    prefix = key.split(".", 1)[0] + "."
    unknown = sorted(k for k in have if k.startswith(prefix) and k not in ours)
    hint = f" The checkpoint has keys this model does not: {unknown[:8]}." if unknown else ""
    return (
        f"{url}: key {key!r} is not in the checkpoint.{hint} Was a parameter renamed? Keys are "
        "parameter FQNs; load with the model the checkpoint was saved from, or load(strict=False) "
        "to load what matches and report the rest"
    )
