"""Hugging Face transformers: ``MuonCkptTrainer``, a ``Trainer`` that saves and resumes through
``CheckpointManager`` (``MuonCkptMixin`` gives the same to another ``Trainer`` subclass).

The Trainer's own save (``_save_checkpoint``) writes ``optimizer.state_dict()`` with one
``torch.save`` (which an optimizer with CPU offload on refuses) beside the model's files,
``scheduler.pt``, ``rng_state.pth`` and ``trainer_state.json``. Here it saves the model, the
optimizer (offloaded states read where they are), the lr scheduler, the grad scaler and the
``TrainerState`` (``extra``), and each rank's RNG states (``rank_extra``), as one step
``global_step`` of the url. ``train()`` resumes the url's newest step the way the Trainer
resumes its own checkpoints, so that everything the Trainer does on a resume stays its own:
the ``TrainerState`` (global step, log history, callbacks' state) of the newest committed step
is handed to the Trainer as a ``trainer_state.json`` in a temporary directory, from which it
computes the epoch and the batches it skips; the step is loaded where the Trainer loads its
optimizer (after ``accelerator.prepare``), and that load decides: where it ends on another
step (the newest did not load, the memory tier holds a newer one), the Trainer's loop starts
again from that step's TrainerState. The RNG states are set where the Trainer sets its own
(after the skipped batches). At another world size each rank's RNG states start fresh
(``load(elastic=True)``, WARNING). Needs transformers 5.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import posixpath
import shutil
import tempfile
from typing import Any

from muon_ckpt._config import ManagerConfig
from muon_ckpt._errors import CheckpointError, CheckpointNotFoundError
from muon_ckpt.integrations._hf_state import RngStates, TrainerStateText
from muon_ckpt.manager import CheckpointManager
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

_log = logging.getLogger("muon_ckpt")

# The Trainer methods the mixin overrides: private, so checked against the installed version.
_HOOKS = (
    "_inner_training_loop",
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


@dataclasses.dataclass
class _Resume:
    """A ``train()`` that resumes the url: the step asked for, the step whose
    ``trainer_state.json`` the Trainer was handed (in ``tmpdir``), and the RNG states once
    loaded. The load after ``accelerator.prepare`` decides; when it loads another step than
    ``handed`` (the newest did not load, or the memory tier holds a newer one), the training
    loop starts again from that step's TrainerState (``_Restart``)."""

    step: int | None  # asked for (None: the newest that loads)
    handed: int | None  # None: the Trainer starts fresh
    tmpdir: str | None
    rng: RngStates


class _Restart(Exception):
    """The load ended on ``step`` (None: nothing to resume), not the one handed."""

    def __init__(self, step: int | None) -> None:
        super().__init__(step)
        self.step = step


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
        self._muon_text = TrainerStateText()  # the manager's TrainerState (its load's JSON)
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
        """The resume of this train(): the ``TrainerState`` of the url's newest committed step
        (or the one asked for) read into a temporary ``trainer_state.json`` for the Trainer,
        which the load after ``accelerator.prepare`` confirms or corrects (``_Restart``);
        None: a checkpoint of the Trainer's own."""
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
        text = TrainerStateText()
        # Sizes only, and only the TrainerState: the load after prepare reads and verifies
        # the whole step, and the memory tier's (which this one, without a model, skips).
        options = {**self._muon_options, "verify": "size"}
        try:
            with CheckpointManager(self.checkpoint_url, extra={_STATE: text}, **options) as mgr:
                got = mgr.load(step, parts=("extra",))
        except CheckpointNotFoundError:
            if step is None or self._muon_options.get("memory") is None:
                raise
            got = None  # perhaps the tier's: the load after prepare finds it, or raises
        if got is None and asked is True:
            raise CheckpointNotFoundError(
                f"resume_from_checkpoint=True, but {self.checkpoint_url} has no committed "
                "step (nor resume_from); leave it out to start fresh"
            )
        resume = _Resume(step, None, None, RngStates())
        if got is not None:
            self._hand(resume, got, text.loaded)
        return resume

    @staticmethod
    def _hand(resume: _Resume, step: int, state: str | None) -> None:
        """Give the Trainer ``step``'s TrainerState (its ``trainer_state.json``)."""
        if resume.tmpdir is None:
            resume.tmpdir = tempfile.mkdtemp(prefix="muon-ckpt-hf-")
        with open(os.path.join(resume.tmpdir, _STATE_FILE), "w", encoding="utf-8") as f:
            f.write(state or "")
        resume.handed = step

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
        try:
            self._close_manager()
        finally:
            if resume is not None and resume.tmpdir is not None:
                shutil.rmtree(resume.tmpdir, ignore_errors=True)

    def _close_manager(self) -> None:
        mgr, self._muon_manager = self._muon_manager, None
        if mgr is not None:
            mgr.close()

    # ------------------------------------------------------------------ the manager
    def _manager(self) -> CheckpointManager:
        """This train()'s manager: made once accelerate has prepared the optimizer and the
        Trainer has made its scheduler (both change between train() calls)."""
        if self._muon_manager is None:
            t: Any = self
            self._muon_text = TrainerStateText(t)
            extra: dict[str, Any] = {_STATE: self._muon_text, _SCHED: t.lr_scheduler}
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None:
                extra[_SCALER] = scaler
            rng = self._muon_resume.rng if self._muon_resume is not None else RngStates()
            self._muon_manager = CheckpointManager(
                self.checkpoint_url,
                model=t.model,
                optimizer=_inner(t.optimizer),
                extra=extra,
                rank_extra={_RNG: rng},
                **self._muon_options,
            )
        return self._muon_manager

    def _load(self) -> None:
        """The resume's load, once accelerate has prepared the model and optimizer: the step
        it ends on is the one the Trainer resumes (elastic: at another world size each rank's
        RNG states start fresh, WARNING, as the Trainer's own resume without its RNG file)."""
        resume = self._muon_resume
        if resume is None:
            return
        resume.rng.loaded = None
        got = self._manager().load(resume.step, elastic=True)
        if got != resume.handed:
            raise _Restart(got)
        if got is None:
            return
        if resume.rng.loaded is None:
            _log.warning(
                "%s: step %d was saved on another number of ranks: each rank's RNG states "
                "start fresh (dropout and sampling differ from the run that saved it)",
                self.checkpoint_url,
                got,
            )
        self.resumed_step = self._muon_saved = got

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        loop = super()._inner_training_loop  # type: ignore[misc]
        call = inspect.signature(loop).bind(*args, **kwargs)
        while True:
            try:
                return loop(*call.args, **call.kwargs)
            except _Restart as e:  # the load decided: the Trainer starts from that step
                call.arguments["resume_from_checkpoint"] = self._restart(e.step)

    def _restart(self, step: int | None) -> str | None:
        """Hand the Trainer the TrainerState of ``step``, which the load ended on, and ask
        for exactly that step when the Trainer's loop loads again; the tmpdir (None: fresh)."""
        resume = self._muon_resume
        state = self._muon_text.loaded
        self._close_manager()  # (the Trainer makes its scheduler again)
        if resume is None:
            raise AssertionError("a restart without a resume")
        if step is None:
            resume.step = resume.handed = None
            return None
        _log.info("%s: resuming step %d, the step that loaded", self.checkpoint_url, step)
        resume.step = step
        self._hand(resume, step, state)
        return resume.tmpdir

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
        self._load()
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
        if not self._resuming(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        # (ours: loaded at the end of _prepare_for_training, all or nothing)

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
        return r is not None and r.tmpdir is not None and checkpoint == r.tmpdir


class MuonCkptTrainer(MuonCkptMixin, transformers.Trainer):
    """A ``transformers.Trainer`` whose checkpoints go through ``CheckpointManager``
    (``MuonCkptMixin`` says how)."""
