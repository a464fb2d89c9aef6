"""muon-ckpt: checkpoint distributed training runs, centred on optimizer state.

Public names are imported lazily so that ``muon-ckpt --help`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from muon_ckpt._config import MemoryOptions
from muon_ckpt._errors import (
    CheckpointCollectiveError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointLeaseError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    CheckpointVersionError,
)
from muon_ckpt._version import __version__

if TYPE_CHECKING:
    from muon_ckpt.interop import (
        ExportSummary,
        HFExportSummary,
        HFLoadReport,
        ImportReport,
        export_hf,
        export_safetensors,
        import_optimizer_state,
        load_hf_model,
    )
    from muon_ckpt.manager import CheckpointManager

_LAZY = {
    "CheckpointManager": "muon_ckpt.manager",
    "import_optimizer_state": "muon_ckpt.interop",
    "ImportReport": "muon_ckpt.interop",
    "export_safetensors": "muon_ckpt.interop",
    "ExportSummary": "muon_ckpt.interop",
    "export_hf": "muon_ckpt.interop",
    "HFExportSummary": "muon_ckpt.interop",
    "load_hf_model": "muon_ckpt.interop",
    "HFLoadReport": "muon_ckpt.interop",
}

__all__ = [
    "CheckpointCollectiveError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointLeaseError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointStorageError",
    "CheckpointVersionError",
    "ExportSummary",
    "HFExportSummary",
    "HFLoadReport",
    "ImportReport",
    "MemoryOptions",
    "__version__",
    "export_hf",
    "export_safetensors",
    "import_optimizer_state",
    "load_hf_model",
]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'muon_ckpt' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
