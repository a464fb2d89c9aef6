"""Model and optimizer state in and out: import optimizer state from other tools (torch.save'd
optimizer state dicts, safetensors, foreign DCP checkpoints), export to safetensors, and the
Hugging Face layout both ways (export_hf, load_hf_model), torchtitan's layout both ways
(export_torchtitan, import_torchtitan). Every stored byte is read through
``load``'s verifying reader or the safetensors reader; nothing is unpickled."""

from muon_ckpt.interop._export import ExportSummary, export_safetensors, section_of
from muon_ckpt.interop._hfexport import HFExportSummary, export_hf
from muon_ckpt.interop._hfload import HFLoadReport, load_hf_model
from muon_ckpt.interop._import import ImportReport, import_optimizer_state
from muon_ckpt.interop._torchtitan import (
    TorchtitanExportSummary,
    TorchtitanImportReport,
    export_torchtitan,
    import_torchtitan,
)

__all__ = [
    "ExportSummary",
    "HFExportSummary",
    "HFLoadReport",
    "ImportReport",
    "TorchtitanExportSummary",
    "TorchtitanImportReport",
    "export_hf",
    "export_safetensors",
    "export_torchtitan",
    "import_optimizer_state",
    "import_torchtitan",
    "load_hf_model",
    "section_of",
]
