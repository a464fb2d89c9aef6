"""Model and optimizer state in and out: import optimizer state from other tools (torch.save'd
optimizer state dicts, safetensors, foreign DCP checkpoints), export to safetensors, and the
Hugging Face layout both ways (export_hf, load_hf_model). Every stored byte is read through
``load``'s verifying reader or the safetensors reader; nothing is unpickled."""

from muon_ckpt.interop._export import ExportSummary, export_safetensors, section_of
from muon_ckpt.interop._hfexport import HFExportSummary, export_hf
from muon_ckpt.interop._hfload import HFLoadReport, load_hf_model
from muon_ckpt.interop._import import ImportReport, import_optimizer_state

__all__ = [
    "ExportSummary",
    "HFExportSummary",
    "HFLoadReport",
    "ImportReport",
    "export_hf",
    "export_safetensors",
    "import_optimizer_state",
    "load_hf_model",
    "section_of",
]
