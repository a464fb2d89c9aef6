"""What ``MuonCkptTrainer`` keeps of a Trainer beside the model and the optimizer: its
``TrainerState`` as the JSON of ``trainer_state.json`` (``extra``) and each rank's RNG states,
those of its ``rng_state.pth`` (``rank_extra``). Needs neither transformers nor accelerate."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import numpy as np
import torch

from muon_ckpt.state import pack, unpack

__all__ = ["RngStates", "TrainerStateText"]


class TrainerStateText:
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


class RngStates:
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
        return {"state": pack(states, "rank_extra['hf_rng']")}

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
