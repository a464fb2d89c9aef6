"""torchtitan: ``MuonCheckpointManager``, a checkpoint manager for torchtitan's ``Trainer``
(torchtitan 0.3, whose ``Trainer.Config.checkpoint`` takes any ``BaseCheckpointManager``).

torchtitan builds its checkpointer from ``config.checkpoint`` with the model parts, the
``OptimizersContainer``, the ``LRSchedulersContainer``, the dataloader and ``{"train_state":
trainer}``, and calls ``load(step)`` once, ``save(step, last_step)`` after every step,
``maybe_wait_for_staging()`` before every optimizer step and ``close()``. This one hands all
of it to a ``CheckpointManager``: the model, the container's one optimizer (CPU offload may
be on), ``lr_scheduler`` as ``extra`` (the same on every rank) and ``train_state`` (its
token count is each rank's own) and the dataloader as each rank's ``rank_extra``, at
``<dump_folder>/<folder>`` (or ``url``: any fsspec URL), saved every ``interval`` steps and at
the last, keeping ``keep_latest_k``; on another number of ranks the run resumes its step
elastically (``_titan_state``). While the url has no committed
step, ``initial_load_path`` (a torchtitan checkpoint folder or step) is imported instead, the
way torchtitan's own manager starts from it (``initial_load_model_only``). ``muon-ckpt export
URL --torchtitan DIR`` writes a step back in torchtitan's layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from muon_ckpt._config import ManagerConfig
from muon_ckpt.integrations import _titan_state
from muon_ckpt.integrations._titan_state import load_titan, titan_manager
from muon_ckpt.interop import import_torchtitan
from optim import Muon

try:
    from torchtitan.components.checkpointer import (
        DATALOADER,
        LR_SCHEDULER,
        TRAIN_STATE,
        BaseCheckpointManager,
    )
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.tools import filesystem
except ImportError as e:  # the framework is not a dependency of muon-ckpt
    raise ImportError(
        "muon_ckpt.integrations.torchtitan needs torchtitan 0.3 (its BaseCheckpointManager): "
        "pip install 'muon-ckpt[torchtitan]'; without torchtitan, "
        "muon_ckpt.interop's import_torchtitan/export_torchtitan read and write its layout"
    ) from e

__all__ = ["MuonCheckpointManager", "MuonOptimizersContainer"]

if (DATALOADER, LR_SCHEDULER, TRAIN_STATE) != (
    _titan_state.DATALOADER,
    _titan_state.LR_SCHEDULER,
    _titan_state.TRAIN_STATE,
):
    raise ImportError(
        f"muon_ckpt.integrations.torchtitan needs torchtitan 0.3's state names; this "
        f"torchtitan names them {(DATALOADER, LR_SCHEDULER, TRAIN_STATE)}"
    )

_TAKEN = {"url", "model", "optimizer", "extra", "rank_extra", "interval", "keep_last"}
_EXCLUDABLE = (DATALOADER,)  # what exclude_from_loading may name


class MuonCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpointer, through ``CheckpointManager`` (the module says how).

    ``Trainer.Config(checkpoint=MuonCheckpointManager.Config(enable=True, interval=500,
    async_save=True))``. The fields of torchtitan's ``Config`` keep their meaning, except:
    ``last_save_model_only`` / ``last_save_in_hf`` / ``export_dtype`` (the last step is a
    full step; export it with ``muon-ckpt export``), ``initial_load_in_hf`` (unsupported),
    ``exclude_from_loading`` (only ``"dataloader"``: then neither loaded nor saved), ``create_seed_checkpoint``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        url: str | None = None
        """Run root, any fsspec URL (None: ``<dump_folder>/<folder>``)."""

        async_save: bool | Literal["deferred"] = False
        """``save()`` returns after the snapshot; write and commit run in the background
        (``"deferred"``: the snapshot too, as ``CheckpointManager``'s ``async_save``)."""

        options: dict[str, Any] = field(default_factory=dict)
        """Further ``CheckpointManager`` options (``storage_options``, ``memory``,
        ...)."""

        last_save_model_only: bool = False
        """Unsupported (the last step is a full step): must stay False."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            bad = sorted(set(self.options) & (_TAKEN | {"async_save"}))
            if bad:
                raise ValueError(
                    f"MuonCheckpointManager.Config.options got {bad}: set interval, "
                    "keep_latest_k, url and async_save as fields of the Config"
                )
            unsupported = [
                name
                for name in ("last_save_model_only", "last_save_in_hf", "initial_load_in_hf")
                if getattr(self, name)
            ]
            if unsupported or self.create_seed_checkpoint:
                raise ValueError(
                    f"MuonCheckpointManager does not support {unsupported or ['create_seed_checkpoint']}"
                    ": leave it False (export a step with `muon-ckpt export`, "
                    "`--torchtitan` or `--hf`)"
                )
            odd = sorted(set(self.exclude_from_loading) - set(_EXCLUDABLE))
            if odd:
                raise ValueError(
                    f"MuonCheckpointManager: exclude_from_loading may name only "
                    f"{sorted(_EXCLUDABLE)}, got {odd}"
                )
            keep = self.keep_latest_k or None
            ManagerConfig(url=self.url or self.folder, keep_last=keep, **self.options)

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future = None  # saves in flight are the manager's (wait())
        if len(model_parts) != 1:
            raise ValueError(
                f"MuonCheckpointManager saves one model part per rank, got {len(model_parts)} "
                "(pipeline parallelism with several stages per rank)"
            )
        inner = list(getattr(optimizers, "optimizers", [optimizers]))
        if len(inner) != 1:
            raise ValueError(
                f"MuonCheckpointManager saves one optimizer; the container holds {len(inner)} "
                f"({', '.join(type(o).__name__ for o in inner)}). Give every parameter "
                "group to one optimizer (optim.Muon takes AdamW groups: use_muon=False)"
            )
        self.config = config
        self.url = config.url or filesystem.join(base_folder, config.folder)
        self.model, self.optimizer = model_parts[0], inner[0]
        self.states = {LR_SCHEDULER: lr_schedulers, **states}
        if DATALOADER in config.exclude_from_loading:
            dataloader = None
        self.dataloader = dataloader
        self.manager = titan_manager(
            self.url,
            model=self.model,
            optimizer=self.optimizer,
            lr_schedulers=lr_schedulers,
            states=states,
            dataloader=dataloader,
            keep_last=config.keep_latest_k or None,
            async_save=config.async_save,
            **config.options,
        )
        self.loaded_step: int | None = None  # the step the last load restored (None: none)

    def __del__(self) -> None:
        self.close()

    # ------------------------------------------------------------------ the hooks
    def _load(self, step: int = -1) -> bool:
        c = self.config
        if step == -1 and c.load_step != -1:
            step = c.load_step
        got = load_titan(self.manager, None if step == -1 else step, self.states)
        if got is not None:
            self.loaded_step = got
            return True
        if not c.initial_load_path:
            return False
        model_only = c.initial_load_model_only
        states = {} if model_only else dict(self.states)
        if not model_only and self.dataloader is not None:
            states[DATALOADER] = self.dataloader
        report = import_torchtitan(
            c.initial_load_path,
            model=self.model,
            optimizer=None if model_only else self.optimizer,
            states=states,
            storage_options=c.options.get("storage_options"),
        )
        self.loaded_step = report.step if TRAIN_STATE in states else None
        return True

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        c = self.config
        if c.load_only:
            return False
        due = (
            curr_step % c.interval == 0
            or last_step
            or (curr_step == 1 and c.enable_first_step_checkpoint)
        )
        return due and self.manager.save(curr_step)

    def _maybe_wait_for_staging(self) -> None:
        pass  # save() returns once its snapshot is taken: nothing is being staged

    def _wait_for_saving(self) -> None:
        self.manager.wait()

    def _close(self) -> None:
        if hasattr(self, "manager"):
            self.manager.close()


class MuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that builds ``optim.Muon`` too: a
    ``ParamGroupConfig`` with ``optimizer_name="Muon"`` takes Muon's group keys
    (``use_muon=False`` for its AdamW groups), and every such group goes to one Muon, as
    ``MuonCheckpointManager`` needs. ``cpu_offload``: turn Muon's CPU offload on once built.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        implementation: Literal["for-loop", "foreach", "fused", "fused_opt_states_bf16"] = (
            "for-loop"
        )
        """torch optimizers' implementation; Muon ignores it (fused is CUDA only)."""

        cpu_offload: bool = False
        """Muon's states parked in (pinned) CPU memory between steps."""

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        super().__init__(config, model_parts=model_parts)
        if config.cpu_offload:
            for opt in self.optimizers:
                if isinstance(opt, Muon):
                    opt.turn_on_cpu_offload()

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Any:
        if name == "Muon":
            return _build_muon
        return OptimizersContainer._resolve_optimizer_factory(name)


def _build_muon(groups: list[dict[str, Any]], **kwargs: Any) -> Muon:
    """torchtitan's groups as Muon takes them: ``param_names`` as ``names``; no ``fused`` /
    ``foreach`` (torch optimizers' implementation switches)."""
    out = []
    for g in groups:
        g = {k: v for k, v in g.items() if k not in ("fused", "foreach")}
        g["names"] = list(g.pop("param_names", []))
        out.append(g)
    return Muon(out, **kwargs)
