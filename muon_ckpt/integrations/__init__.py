"""Adapters for training frameworks: each module imports its framework when it is imported
itself (never here), and reaches muon-ckpt through ``CheckpointManager`` only.

``muon_ckpt.integrations.lightning.MuonCheckpoint``: a PyTorch Lightning callback.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "MuonCheckpoint": "muon_ckpt.integrations.lightning",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'muon_ckpt.integrations' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
