"""The memory tier: recent steps kept in host memory that outlives the training process
(``/dev/shm`` by default), replicated to ranks on other nodes, restored first and verified
(``load_tiers``). Never counted as persisted; the url's steps are unchanged by it but for the
flush at ``close()``. ``MemoryWriter`` writes a manager's steps here; the save coordinator
(``muon_ckpt._saves``) decides which."""

from muon_ckpt.memory._dirs import (
    PartInfo,
    default_root,
    is_run_dirname,
    layout_digest,
    list_parts,
    read_run_file,
    run_dirname,
    unsafe_reason,
)
from muon_ckpt.memory._flush import PartCopy
from muon_ckpt.memory._restore import load_tiers, restore_from_memory
from muon_ckpt.memory._saves import MemoryWriter
from muon_ckpt.memory._tier import MemoryJob, MemoryTier, MemoryWrite

__all__ = [
    "MemoryJob",
    "MemoryTier",
    "MemoryWrite",
    "MemoryWriter",
    "PartCopy",
    "PartInfo",
    "default_root",
    "is_run_dirname",
    "layout_digest",
    "list_parts",
    "load_tiers",
    "read_run_file",
    "restore_from_memory",
    "run_dirname",
    "unsafe_reason",
]
