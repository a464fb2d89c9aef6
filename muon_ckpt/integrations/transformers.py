"""Hugging Face transformers: ``MuonCkptTrainer``, a ``Trainer`` that saves and resumes through
``CheckpointManager`` (``MuonCkptMixin`` gives the same to another ``Trainer`` subclass).

The Trainer's own save (``_save_checkpoint``) writes ``optimizer.state_dict()`` with one
``torch.save`` (which an optimizer with CPU offload on refuses) beside the model's files,
``scheduler.pt``, ``rng_state.pth`` and ``trainer_state.json``. Here it saves the model, the
optimizer (offloaded states read where they are), the lr scheduler, the grad scaler and the
``TrainerState`` (``extra``), and each rank's RNG states (``rank_extra``), as one step
``global_step`` of the url. ``train()`` resumes the url's newest step the way the Trainer
resumes its own checkpoints, so that everything the Trainer does on a resume stays its own:
the ``TrainerState`` (global step, log history, callbacks' state) is read first and handed to
the Trainer as a ``trainer_state.json`` in a temporary directory, from which the Trainer
computes the epoch and the batches it skips; the rest is loaded where the Trainer loads its
optimizer (after ``accelerator.prepare``), and the RNG states are set where it sets its own
(after the skipped batches). Needs transformers 5.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import posixpath
import random
import shutil
import tempfile
from typing import Any

import numpy as np
import torch

from muon_ckpt._config import ManagerConfig
from muon_ckpt._errors import CheckpointError, CheckpointNotFoundError
from muon_ckpt.manager import CheckpointManager
from muon_ckpt.state import pack, unpack
from muon_ckpt.store import parse_step_dirname
from offload import OffloadingOptimizer

try:
    import transformers
    from transformers.trainer_callback import ExportableState
except ImportError as e:  # the framework is not a dependency of muon-ckpt
    raise ImportError(
        "muon_ckpt.integrations.transformers needs transformers 5: "
        "pip install 'muon-ckpt[transformers]' (or pip install 'transformers>=5')"
    ) from e

__all__ = ["MuonCkptMixin", "MuonCkptTrainer"]

# The Trainer methods the mixin overrides: private, so checked against the installed version.
_HOOKS = (
    "_save_checkpoint",
    "_prepare_for_training",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_scaler",
    "_load_rng_state",
)
_missing = [h for h in _HOOKS if not hasattr(transformers.Trainer, h)]
if _missing:
    raise ImportError(
        f"muon_ckpt.integrations.transformers needs transformers 5 (its Trainer lacks "
        f"{_missing}); found transformers {transformers.__version__}"
    )

# The names of the Trainer's state in the manager's extra and rank_extra.
_STATE, _SCHED, _SCALER, _RNG = "hf_trainer_state", "lr_scheduler", "grad_scaler", "hf_rng"
_TAKEN = {"url", "model", "optimizer", "extra", "rank_extra", "interval", "new_run"}
_STATE_FILE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME


class _TrainerStateText:
    """The ``TrainerState`` as the JSON ``trainer_state.json`` holds (rank 0's: its
    process-zero flags are set again by the Trainer on a resume), the same on every rank."""

    def __init__(self, trainer: Any = None) -> None:
        self._trainer = trainer
        self.loaded: str | None = None

    def state_dict(self) -> dict[str, Any]:
        if self._trainer is None:  # a load's template
            return {"json": ""}
        state = dataclasses.asdict(self._trainer.state)
        state["is_local_process_zero"] = state["is_world_process_zero"] = True
        return {"json": json.dumps(state, indent=2, sort_keys=True) + "\n"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state["json"]


class _RngStates:
    """This rank's RNG states, those the Trainer's ``rng_state.pth`` holds (Python, NumPy, the
    CPU's and CUDA's), as one blob (``state.pack``: NumPy's state comes back with its key
    array as a uint32 tensor, which ``np.random.set_state`` takes). A load keeps them
    (``loaded``) until the Trainer's moment to set them."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        states: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "cpu": torch.random.get_rng_state(),
        }
        if torch.cuda.is_available():
            states["cuda"] = torch.cuda.random.get_rng_state_all()
        return {"state": pack(states, f"rank_extra[{_RNG!r}]")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = unpack(state["state"])

    def apply(self) -> None:
        s = self.loaded
        if s is None:
            return
        random.setstate(s["python"])
        np.random.set_state(s["numpy"])  # (steps before 0.4 hold its keys as int64: taken too)
        torch.random.set_rng_state(s["cpu"])
        if "cuda" in s and torch.cuda.is_available():
            saved = s["cuda"]
            if len(saved) == torch.cuda.device_count():
                torch.cuda.random.set_rng_state_all(saved)
            else:  # another number of visible devices: this process's own device only
                torch.cuda.random.set_rng_state(saved[torch.cuda.current_device() % len(saved)])


@dataclasses.dataclass
class _Resume:
    """A resume in progress: the step chosen, the temporary directory that holds its
    ``trainer_state.json`` for the Trainer, and the RNG states once loaded."""

    step: int
    asked: bool  # that step was named (else: the newest that loads)
    tmpdir: str
    rng: _RngStates


def _inner(optimizer: Any) -> Any:
    """The user's optimizer inside accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


def _url_of(path: str) -> str:
    return path.rstrip("/")


class MuonCkptMixin:
    """Mix into a ``transformers.Trainer`` subclass (before it): its checkpoints go to
    ``checkpoint_url`` through ``CheckpointManager``, and ``train()`` resumes the newest step.

    ``checkpoint_url``: the run root (any fsspec URL). ``checkpoint_options``: any
    ``CheckpointManager`` option but ``interval`` (the Trainer's ``save_steps`` /
    ``save_strategy`` decide when to save; ``keep_last`` defaults to ``save_total_limit``).
    ``cpu_offload``: turn the optimizer's CPU offload on once accelerate has prepared it (an
    optimizer passed with offload already on is handled the same way).

    ``train()`` with ``resume_from_checkpoint`` None resumes the url's newest committed step
    (a fresh run when there is none); ``True`` too, but refuses a url without a step;
    ``"<url>/step-XXXXXXXX"`` resumes that step (the first save then retires the newer ones);
    another path is a checkpoint of the Trainer's own, resumed by the Trainer (its url must
    be empty). Not supported: ``load_best_model_at_end``, hyperparameter search,
    ``push_to_hub`` of checkpoints, DeepSpeed and FSDP through accelerate.
    """

    def __init__(
        self,
        *args: Any,
        checkpoint_url: str,
        checkpoint_options: dict[str, Any] | None = None,
        cpu_offload: bool = False,
        **kwargs: Any,
    ) -> None:
        options = dict(checkpoint_options or {})
        bad = sorted(set(options) & _TAKEN)
        unknown = sorted(set(options) - set(ManagerConfig.__dataclass_fields__))
        if bad or unknown:
            raise ValueError(
                f"checkpoint_options got {bad or unknown}: "
                + (
                    "the Trainer decides when to save (save_steps) and passes its model and "
                    "optimizer; give checkpoint_url for the url"
                    if bad
                    else "not a CheckpointManager option"
                )
            )
        super().__init__(*args, **kwargs)
        t: Any = self
        options.setdefault("keep_last", t.args.save_total_limit)
        ManagerConfig(url=checkpoint_url, **options)  # a bad option fails here, not at a save
        if t.args.load_best_model_at_end:
            raise ValueError(
                "MuonCkptTrainer does not support load_best_model_at_end (it loads the "
                "Trainer's own checkpoint directories); leave it False"
            )
        self.checkpoint_url = _url_of(checkpoint_url)
        self._muon_options = options
        self._muon_offload = cpu_offload
        self._muon_manager: CheckpointManager | None = None
        self._muon_resume: _Resume | None = None
        self._muon_saved: int | None = None
        self._muon_parks = cpu_offload  # offload to turn on once prepared (this train())
        # The step the last train() resumed (None: it started fresh or from the Trainer's own).
        self.resumed_step: int | None = None

    # ------------------------------------------------------------------ train
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        resume = self._choose_resume(resume_from_checkpoint)
        self.resumed_step = None
        if resume is not None:
            self._muon_resume = resume
            resume_from_checkpoint = resume.tmpdir
        elif resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            self._refuse_two_sources()
        try:
            out = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)  # type: ignore[misc]
        except BaseException:
            with contextlib.suppress(CheckpointError):
                self._finish()
            raise
        self._finish()
        return out

    def _choose_resume(self, asked: str | bool | None) -> _Resume | None:
        """Read the ``TrainerState`` of the step to resume (the newest committed one, or the
        one asked for), into a temporary ``trainer_state.json``; None: nothing to resume."""
        step = None
        if isinstance(asked, str) and posixpath.dirname(_url_of(asked)) == self.checkpoint_url:
            step = parse_step_dirname(posixpath.basename(_url_of(asked)))
            if step is None:
                raise ValueError(
                    f"resume_from_checkpoint={asked!r} is inside checkpoint_url but not a step "
                    "directory (step-XXXXXXXX); `muon-ckpt ls URL` lists the steps"
                )
        elif isinstance(asked, str) and _url_of(asked) == self.checkpoint_url:
            raise ValueError(
                f"resume_from_checkpoint={asked!r} is checkpoint_url itself: leave "
                "resume_from_checkpoint out to resume its newest step, or name one "
                "(<url>/step-XXXXXXXX)"
            )
        elif isinstance(asked, str):
            return None  # the Trainer's own checkpoint directory
        text = _TrainerStateText()
        # Sizes only: this reads just the TrainerState; the load that follows reads and
        # verifies the whole step (and is checked to be this one).
        options = {**self._muon_options, "verify": "size"}
        with CheckpointManager(self.checkpoint_url, extra={_STATE: text}, **options) as mgr:
            got = mgr.load(step, parts=("extra",))
        if got is None:
            if asked is True:
                raise CheckpointNotFoundError(
                    f"resume_from_checkpoint=True, but {self.checkpoint_url} has no committed "
                    "step (nor resume_from); leave it out to start fresh"
                )
            return None
        tmpdir = tempfile.mkdtemp(prefix="muon-ckpt-hf-")
        with open(os.path.join(tmpdir, _STATE_FILE), "w", encoding="utf-8") as f:
            f.write(text.loaded or "")
        return _Resume(got, step is not None, tmpdir, _RngStates())

    def _refuse_two_sources(self) -> None:
        with CheckpointManager(self.checkpoint_url, **self._muon_options) as mgr:
            newest = mgr.latest_step()
        if newest is not None:
            raise ValueError(
                f"resume_from_checkpoint names a checkpoint of the Trainer's own, but "
                f"{self.checkpoint_url} has committed steps (newest {newest}) that would "
                "continue this run too: leave resume_from_checkpoint out to resume the url, "
                "or use another checkpoint_url"
            )

    def _finish(self) -> None:
        """The end of a train(): the pending save committed, the manager closed."""
        resume, self._muon_resume = self._muon_resume, None
        mgr, self._muon_manager = self._muon_manager, None
        try:
            if mgr is not None:
                mgr.close()
        finally:
            if resume is not None:
                shutil.rmtree(resume.tmpdir, ignore_errors=True)

    # ------------------------------------------------------------------ the manager
    def _manager(self) -> CheckpointManager:
        """This train()'s manager: made once accelerate has prepared the optimizer and the
        Trainer has made its scheduler (both change between train() calls)."""
        if self._muon_manager is None:
            t: Any = self
            extra: dict[str, Any] = {_STATE: _TrainerStateText(t), _SCHED: t.lr_scheduler}
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None:
                extra[_SCALER] = scaler
            rng = self._muon_resume.rng if self._muon_resume is not None else _RngStates()
            self._muon_manager = CheckpointManager(
                self.checkpoint_url,
                model=t.model,
                optimizer=_inner(t.optimizer),
                extra=extra,
                rank_extra={_RNG: rng},
                **self._muon_options,
            )
        return self._muon_manager

    # ------------------------------------------------------------------ the Trainer's hooks
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        t: Any = self
        if trial is not None:
            raise ValueError("MuonCkptTrainer does not save during a hyperparameter search")
        t.store_flos()
        # What the Trainer's own _save_checkpoint records of its stateful callbacks.
        for cb in [
            c for c in [*t.callback_handler.callbacks, t.control] if isinstance(c, ExportableState)
        ]:
            name = cb.__class__.__name__
            if isinstance(t.state.stateful_callbacks[name], list):
                t.state.stateful_callbacks[name].append(cb.state())
            else:
                t.state.stateful_callbacks[name] = cb.state()
        step = t.state.global_step
        if step != self._muon_saved:  # (the end of an epoch saves the step its end saved)
            self._manager().save(step, force=True)
            self._muon_saved = step

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        t: Any = self
        parked = (
            isinstance(_inner(t.optimizer), OffloadingOptimizer) and _inner(t.optimizer).cpu_offload
        )
        if parked:  # accelerate's prepare round-trips optimizer.state_dict()
            _inner(t.optimizer).turn_off_cpu_offload()
        self._muon_parks = parked or self._muon_offload
        out = super()._prepare_for_training(*args, **kwargs)  # type: ignore[misc]
        self._park()
        return out

    def _park(self) -> None:
        """Offload on, where asked, once accelerate has prepared the optimizer: before a
        resume loads into it (the states go straight to the CPU, never to the device)."""
        if not self._muon_parks:
            return
        t: Any = self
        opt = _inner(t.optimizer)
        if not isinstance(opt, OffloadingOptimizer):
            raise TypeError(
                f"cpu_offload=True needs an optimizer with CPU offload (optim.Muon), got "
                f"{type(opt).__module__}.{type(opt).__name__}"
            )
        if not opt.cpu_offload:
            opt.turn_on_cpu_offload()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._resuming(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        # (ours: the weights are loaded with the optimizer, all or nothing)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        resume = self._muon_resume
        if not self._resuming(checkpoint) or resume is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        self._park()
        mgr = self._manager()
        got = mgr.load(resume.step if resume.asked else None)
        if got != resume.step:
            raise CheckpointError(
                f"{self.checkpoint_url}: the Trainer resumed from step {resume.step}'s "
                f"TrainerState, but step {got} loaded (see the WARNING above: step "
                f"{resume.step} did not load); resume that step explicitly: "
                f"trainer.train(resume_from_checkpoint='{self.checkpoint_url}/"
                f"step-{got:08d}')"
            )
        self.resumed_step = got
        self._muon_saved = got

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not self._resuming(checkpoint):
            super()._load_scaler(checkpoint)  # type: ignore[misc]

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self._resuming(checkpoint):
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
        elif self._muon_resume is not None:
            self._muon_resume.rng.apply()

    def _resuming(self, checkpoint: str | None) -> bool:
        r = self._muon_resume
        return r is not None and checkpoint == r.tmpdir


class MuonCkptTrainer(MuonCkptMixin, transformers.Trainer):
    """A ``transformers.Trainer`` whose checkpoints go through ``CheckpointManager``
    (``MuonCkptMixin`` says how)."""
