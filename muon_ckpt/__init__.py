"""muon-ckpt: checkpoint distributed training runs, centred on optimizer state.

Public names are imported lazily so that ``muon-ckpt --help`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from muon_ckpt._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)

__version__ = "0.1.0"

_LAZY = {
    "CheckpointManager": "muon_ckpt.manager",
    "import_optimizer_state": "muon_ckpt._import",
    "ImportReport": "muon_ckpt._import",
    "export_safetensors": "muon_ckpt._export",
}

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "ImportReport",
    "__version__",
    "export_safetensors",
    "import_optimizer_state",
]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'muon_ckpt' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
