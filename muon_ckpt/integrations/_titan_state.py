"""What ``MuonCheckpointManager`` (torchtitan) hands the manager and how it resumes, without
torchtitan: its states by torchtitan's names (``lr_scheduler`` the same on every rank;
``train_state`` and ``dataloader`` each rank's own), and a load that resumes on any number
of ranks. At another world size (``load(elastic=True)``) the train state keeps the step it
loaded, the one thing of it every rank shares, while its token count and the dataloader's
position start fresh, with a WARNING."""

from __future__ import annotations

import logging
from typing import Any

from muon_ckpt.manager import CheckpointManager

__all__ = ["DATALOADER", "LR_SCHEDULER", "TRAIN_STATE", "load_titan", "titan_manager"]

_log = logging.getLogger("muon_ckpt")

# torchtitan 0.3's names of its states (torchtitan.components.checkpointer).
DATALOADER, LR_SCHEDULER, TRAIN_STATE = "dataloader", "lr_scheduler", "train_state"


def titan_manager(
    url: str,
    *,
    model: Any,
    optimizer: Any,
    lr_schedulers: Any,
    states: dict[str, Any],
    dataloader: Any,
    **options: Any,
) -> CheckpointManager:
    """The manager of a torchtitan run: ``lr_schedulers`` as ``extra``, every other state
    (``train_state``: its token count is each rank's own) and ``dataloader`` (None: neither
    saved nor loaded) as ``rank_extra``."""
    own = {k: v for k, v in states.items() if k != LR_SCHEDULER}
    if dataloader is not None:
        own[DATALOADER] = dataloader
    return CheckpointManager(
        url,
        model=model,
        optimizer=optimizer,
        extra={LR_SCHEDULER: lr_schedulers},
        rank_extra=own,
        **options,
    )


def load_titan(manager: CheckpointManager, step: int | None, states: dict[str, Any]) -> int | None:
    """Load ``step`` (None: the newest that loads) on any number of ranks; the step loaded.
    Saved on another number of ranks, each rank's own state is not loaded: the train state
    is given the step loaded (its step number: ``save(curr_step)``), the rest starts fresh."""
    got = manager.load(step, elastic=True)
    train = states.get(TRAIN_STATE)
    if got is None or train is None:
        return got
    now = train.state_dict()
    if now.get("step") != got:
        train.load_state_dict({**now, "step": got})
        _log.warning(
            "%s: step %d was saved on another number of ranks: the train state resumes at "
            "step %d; each rank's %s start fresh",
            manager.url,
            got,
            got,
            ", ".join(sorted({*now, DATALOADER} - {"step"})),
        )
    return got
