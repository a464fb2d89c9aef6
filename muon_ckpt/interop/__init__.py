"""Optimizer state in and out: import from other tools (torch.save'd optimizer state dicts,
safetensors, foreign DCP checkpoints) and export to safetensors. Every stored byte is read
through ``io``'s verifying reader or the safetensors reader; nothing is unpickled."""

from muon_ckpt.interop._export import ExportSummary, export_safetensors
from muon_ckpt.interop._import import ImportReport, import_optimizer_state

__all__ = ["ExportSummary", "ImportReport", "export_safetensors", "import_optimizer_state"]
