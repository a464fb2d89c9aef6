"""The memory tier: recent steps kept in host memory that outlives the training process
(``/dev/shm`` by default), replicated to ranks on other nodes, restored first and verified
(``load._memory``). Never counted as persisted; the url's steps are unchanged by it."""

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
from muon_ckpt.memory._restore import TierView, restore_from_memory
from muon_ckpt.memory._saves import MemorySaves
from muon_ckpt.memory._tier import MemoryJob, MemoryOptions, MemoryTier, MemoryWrite

__all__ = [
    "MemoryJob",
    "MemoryOptions",
    "MemorySaves",
    "MemoryTier",
    "MemoryWrite",
    "PartInfo",
    "TierView",
    "default_root",
    "is_run_dirname",
    "layout_digest",
    "list_parts",
    "read_run_file",
    "restore_from_memory",
    "run_dirname",
    "unsafe_reason",
]
