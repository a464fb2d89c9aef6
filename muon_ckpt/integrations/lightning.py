"""PyTorch Lightning: ``MuonCheckpoint``, a callback that saves and resumes a ``Trainer.fit``
through ``CheckpointManager``.

Lightning's own path (``Trainer.save_checkpoint`` -> ``dump_checkpoint`` -> ``CheckpointIO``)
builds one dict from ``optimizer.state_dict()``, which an optimizer with CPU offload on
refuses, and writes it with one ``torch.save``; a ``CheckpointIO`` plugin only sees that dict.
So the callback goes around it: it saves the LightningModule and the optimizer through the
manager (offloaded states are read where they are), and beside them, as ``extra``, what
Lightning's own checkpoint restores: the fit loop's progress (global step, epoch, batch
position), the lr schedulers and the precision plugin (the same on every rank), and as
``rank_extra`` each rank's callbacks' and datamodule's state and its resumable dataloaders'
position. It loads at ``on_fit_start`` (after ``configure_optimizers``, before the fit loop
runs: where Lightning restores its own), and applies Lightning's part with Lightning's own
``load_state_dict`` methods (on another number of ranks, all but each rank's own:
``load(elastic=True)``). It is a ``Checkpoint``, so the Trainer adds no default
``ModelCheckpoint`` (whose save would call ``optimizer.state_dict()``).
"""

from __future__ import annotations

import logging
import os
import posixpath
import random
import sys
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from muon_ckpt._config import ManagerConfig
from muon_ckpt.manager import CheckpointManager
from muon_ckpt.state import pack, unpack
from muon_ckpt.store import parse_step_dirname

__all__ = ["MuonCheckpoint"]

_log = logging.getLogger("muon_ckpt")


def _lightning() -> Any:
    """The Lightning package the user trains with: the one imported already (its Trainer only
    counts callbacks of its own ``Checkpoint`` class), else ``lightning.pytorch``, else
    ``pytorch_lightning``."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        if name in sys.modules:
            return sys.modules[name]
    try:
        import lightning.pytorch as pl  # type: ignore[import-not-found]
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError as e:
            raise ImportError(
                "muon_ckpt.integrations.lightning needs PyTorch Lightning 2.x: "
                "pip install 'muon-ckpt[lightning]' (or pip install lightning)"
            ) from e
    return pl


if TYPE_CHECKING:
    import pytorch_lightning as _pl
else:
    _pl = _lightning()

# The names of Lightning's state in the manager's extra and rank_extra.
_SHARED, _OWN = "lightning", "lightning_rank"
_TAKEN = {"url", "model", "optimizer", "extra", "rank_extra", "interval"}


@runtime_checkable
class _Offloading(Protocol):
    @property
    def cpu_offload(self) -> bool: ...

    def turn_off_cpu_offload(self) -> None: ...


class _Shared:
    """What Lightning's checkpoint restores that is the same on every rank: the fit loop's
    progress, the lr schedulers, the precision plugin (its grad scaler). A load only keeps
    what it read (``loaded``); ``MuonCheckpoint`` applies it once the whole load succeeded."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer  # a Trainer (several of its attributes are untyped)
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        t = self._trainer
        loop = t.fit_loop.state_dict()
        # The dataloaders' position is each rank's own (_Own), and its structure is known
        # only once the fit loop has built them.
        loop["state_dict"] = {k: v for k, v in loop["state_dict"].items() if k != "combined_loader"}
        return {
            "fit_loop": loop,
            "lr_schedulers": [c.scheduler.state_dict() for c in t.lr_scheduler_configs],
            "precision": t.precision_plugin.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


class _Own:
    """Each rank's own: its callbacks' and datamodule's ``state_dict()`` and its resumable
    dataloaders' position, as one blob (``state.pack``: their structure and types vary, and a
    load's template is taken before the dataloaders exist; NumPy values converted, anything a
    load could not read back refused at the save)."""

    def __init__(self, trainer: Any, skip: Any) -> None:
        self._trainer, self._skip = trainer, skip
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        t = self._trainer
        own: dict[str, Any] = {
            "callbacks": {
                cb.state_key: cb.state_dict() for cb in t.callbacks if cb is not self._skip
            },
            "combined_loader": t.fit_loop.state_dict()["state_dict"].get("combined_loader"),
            "datamodule": None if t.datamodule is None else t.datamodule.state_dict(),
        }
        return {"state": pack(own, f"MuonCheckpoint's rank_extra[{_OWN!r}]")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = unpack(state["state"])


class MuonCheckpoint(_pl.callbacks.Checkpoint):
    """Save a ``Trainer.fit`` every ``every_n_train_steps`` optimizer steps to ``url`` through
    ``CheckpointManager``, and resume the newest committed step when the fit starts.

    Saved as step ``trainer.global_step``: the LightningModule, its one optimizer (CPU
    offload stays on), and what Lightning's own checkpoint restores (the fit loop's progress,
    lr schedulers, precision plugin, callbacks', datamodule's and resumable dataloaders'
    state); ``extra``/``rank_extra`` add objects of your own. Every other keyword is a
    ``CheckpointManager`` option (``keep_last``, ``async_save``, ``storage_options``,
    ``resume_from``, ...), checked here. ``manager`` is the manager during a fit;
    ``resumed_step`` the step the last fit resumed (None: it started fresh).

    Not restored, as in Lightning: the RNG states (add them through ``rank_extra``: a fit
    resumed mid-epoch sets the states they loaded again before its first batch, since
    Lightning makes the dataloader's iterator after the load and it draws from them); a
    dataloader without ``state_dict()``/``load_state_dict()`` restarts its epoch. Not
    called: the LightningModule's ``on_save_checkpoint``/``on_load_checkpoint``. On another
    number of ranks the fit resumes elastically: each rank's own state starts fresh (WARNING).
    """

    def __init__(
        self,
        url: str,
        *,
        every_n_train_steps: int | None = None,
        extra: dict[str, Any] | None = None,
        rank_extra: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        fields = set(ManagerConfig.__dataclass_fields__) - _TAKEN
        unknown = sorted(set(options) - fields)
        if unknown:
            raise ValueError(
                f"MuonCheckpoint got {unknown}, which is not a CheckpointManager option; "
                f"use every_n_train_steps for the interval, and any of {sorted(fields)}"
            )
        taken = sorted({_SHARED, _OWN} & (set(extra or {}) | set(rank_extra or {})))
        if taken:
            raise ValueError(
                f"extra/rank_extra name {taken[0]!r} is MuonCheckpoint's own (Lightning's "
                "state); choose another name"
            )
        self._options = {"url": url, "interval": every_n_train_steps, **options}
        ManagerConfig(**self._options)  # a bad option fails here, not when the fit starts
        self._extra, self._rank_extra = dict(extra or {}), dict(rank_extra or {})
        self.manager: CheckpointManager | None = None
        self.resumed_step: int | None = None
        self._last_step: int | None = None
        self._started = False
        self._rng: dict[str, Any] | None = None  # the global RNG states after a resume

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer: _pl.Trainer, pl_module: _pl.LightningModule) -> None:
        if not isinstance(trainer, _pl.Trainer):
            raise TypeError(
                f"MuonCheckpoint is a callback of {_pl.__name__}, but the Trainer is a "
                f"{type(trainer).__module__}.{type(trainer).__name__}; import the Trainer's "
                "package before muon_ckpt.integrations.lightning"
            )
        self._started, self._rng = True, None
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"MuonCheckpoint saves one optimizer; configure_optimizers returned "
                f"{len(trainer.optimizers)}. Return one (e.g. optim.Muon with AdamW groups)"
            )
        shared, own = _Shared(trainer), _Own(trainer, self)
        self.manager = CheckpointManager(
            model=pl_module,
            optimizer=trainer.optimizers[0],
            extra={**self._extra, _SHARED: shared},
            rank_extra={**self._rank_extra, _OWN: own},
            **self._options,
        )
        if trainer.ckpt_path is not None and self.manager.latest_step() is not None:
            raise ValueError(
                f"fit(ckpt_path={trainer.ckpt_path!r}) and MuonCheckpoint({self.manager.url!r}), "
                "which has committed steps, would both restore this fit: leave ckpt_path out "
                "to resume the url, or give MuonCheckpoint a new url"
            )
        self.resumed_step = self.manager.load(elastic=True)
        if self.resumed_step is not None:
            _apply(trainer, shared.loaded, own.loaded)
            if own.loaded is None:
                _log.warning(
                    "MuonCheckpoint: step %d was saved on another number of ranks: each "
                    "rank's callbacks', datamodule's and dataloaders' state%s start fresh",
                    self.resumed_step,
                    f" and {sorted(self._rank_extra)}" if self._rank_extra else "",
                )
            self._rng = _rng_states()  # (set by rank_extra: see on_train_start)
        self._last_step = trainer.global_step
        if _nothing_to_train(trainer):  # the fit loop returns at once: no on_train_end
            self._finish(trainer)

    def on_train_start(self, trainer: _pl.Trainer, pl_module: _pl.LightningModule) -> None:
        # A fit resumed mid-epoch made the dataloader's iterator after the load, which drew
        # from the global RNG where the interrupted fit did not: the states the load set
        # (rank_extra) are set again here, before the first batch is fetched, so that the
        # dataset's own draws (a random augmentation) are the interrupted fit's too. An
        # iterator that draws only at its first batch (a generator ``__iter__``) has not
        # drawn yet: they are set again after that batch instead (on_train_batch_start).
        # (Resumed at an epoch's end, both fits draw the next epoch's iterator from them.)
        batches = trainer.fit_loop.epoch_loop.batch_progress
        if batches.current.ready == 0 or batches.is_last_batch:
            self._rng = None
        elif self._rng is not None and not _same_rng(self._rng, _rng_states()):
            _set_rng_states(self._rng)
            self._rng = None

    def on_train_batch_start(
        self, trainer: _pl.Trainer, pl_module: _pl.LightningModule, _batch: Any, _idx: int
    ) -> None:
        rng, self._rng = self._rng, None
        if rng is not None:
            _set_rng_states(rng)

    def on_train_batch_end(
        self,
        trainer: _pl.Trainer,
        pl_module: _pl.LightningModule,
        _outputs: Any,
        _batch: Any,
        _batch_idx: int,
    ) -> None:
        # Where ModelCheckpoint(every_n_train_steps) saves, so Lightning's restart resumes
        # after this batch; once per optimizer step (gradient accumulation calls it per batch).
        step = trainer.global_step
        if self.manager is None or step == self._last_step:
            return
        self._last_step = step
        self.manager.save(step)

    def on_train_end(self, trainer: _pl.Trainer, pl_module: _pl.LightningModule) -> None:
        self._finish(trainer)

    def on_exception(
        self, trainer: _pl.Trainer, pl_module: _pl.LightningModule, exception: BaseException
    ) -> None:
        restoring = not self._started  # Lightning restores ckpt_path before on_fit_start
        try:
            self._finish(trainer)
        except Exception as e:  # the fit's own exception is the one to raise
            _log.error("MuonCheckpoint, after %s: %s", type(exception).__name__, e)
        path = trainer.ckpt_path
        if path is not None and restoring and self._names_a_step(str(path)):
            raise ValueError(
                f"fit(ckpt_path={str(path)!r}) names a muon-ckpt checkpoint, which Lightning's "
                "loader cannot read (it reads one torch.save file). Leave ckpt_path out: "
                f"MuonCheckpoint({self._options['url']!r}) resumes its url's newest committed "
                "step by itself; to start from another run, pass MuonCheckpoint(url, "
                "resume_from=<that url, or (url, step)>)"
            ) from exception

    # ------------------------------------------------------------------ helpers
    def _finish(self, trainer: _pl.Trainer) -> None:
        """Commit the pending save; then bring offloaded states back, since Lightning's
        teardown moves every optimizer state to the CPU with ``.to()``, which a parked
        (offloaded) state refuses."""
        mgr, self.manager = self.manager, None
        self._started = False
        try:
            if mgr is not None:
                mgr.close()
        finally:
            for opt in trainer.optimizers:
                if isinstance(opt, _Offloading) and opt.cpu_offload:
                    opt.turn_off_cpu_offload()

    def _names_a_step(self, path: str) -> bool:
        """Whether ``path`` is this callback's url, inside it, or a step directory."""

        def norm(p: str) -> str:
            return p.rstrip("/") if "://" in p else os.path.abspath(p)

        path, url = norm(path), norm(str(self._options["url"]))
        name = posixpath.basename(path).removeprefix("overwrite-")
        return path == url or path.startswith(url + "/") or parse_step_dirname(name) is not None


def _rng_states() -> dict[str, Any]:
    """The global RNG states (torch's CPU and CUDA generators, NumPy's, Python's)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
    }


def _same_rng(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two ``_rng_states()`` are the same states (nothing drew between them)."""
    same_np = all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
        for x, y in zip(a["numpy"], b["numpy"], strict=True)
    )
    cuda_a, cuda_b = a["cuda"] or [], b["cuda"] or []
    return (
        a["python"] == b["python"]
        and same_np
        and torch.equal(a["cpu"], b["cpu"])
        and len(cuda_a) == len(cuda_b)
        and all(torch.equal(x, y) for x, y in zip(cuda_a, cuda_b, strict=True))
    )


def _set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state_all(states["cuda"])


def _nothing_to_train(trainer: Any) -> bool:
    """Whether the fit loop will return before its first batch: its step or epoch limit is
    reached (what ``_FitLoop.done`` checks first), or it has no batches."""
    loop = trainer.fit_loop
    steps = loop.max_steps not in (-1, None) and trainer.global_step >= loop.max_steps
    epochs = loop.max_epochs not in (-1, None) and (
        loop.epoch_progress.current.processed >= loop.max_epochs
    )
    return bool(steps or epochs or trainer.limit_train_batches == 0)


def _apply(trainer: Any, shared: Any, own: Any) -> None:
    """Give Lightning back its state, through its own ``load_state_dict`` methods, as
    ``Trainer.fit(ckpt_path=...)`` restores them."""
    loop = shared["fit_loop"]
    if own is not None and own.get("combined_loader"):
        loop["state_dict"]["combined_loader"] = own["combined_loader"]
    trainer.fit_loop.load_state_dict(loop)
    for config, state in zip(trainer.lr_scheduler_configs, shared["lr_schedulers"]):
        config.scheduler.load_state_dict(state)
    if shared["precision"]:
        trainer.precision_plugin.load_state_dict(shared["precision"])
    if own is None:  # another world size (elastic): each rank's own state stays as it is
        return
    states = own["callbacks"]
    for cb in trainer.callbacks:
        if cb.state_key in states:
            cb.load_state_dict(states[cb.state_key])
    if trainer.datamodule is not None and own["datamodule"]:
        trainer.datamodule.load_state_dict(own["datamodule"])
