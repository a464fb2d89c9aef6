"""A stored checkpoint opened for reading in this process: import, export and inspect read
through the same verifying reader as the manager's load, with the same ``verify`` option."""

from __future__ import annotations

from typing import Any

import muon_ckpt._dcp as _dcp
from muon_ckpt._config import VERIFY_MODES, checks_content, read_threads
from muon_ckpt.load._planner import SafeLoadPlanner
from muon_ckpt.load._reader import VerifyingReader
from muon_ckpt.store import Resolved

__all__ = ["CheckpointReader"]


class CheckpointReader:
    """``resolved`` opened for reading: ``metadata`` (checked against the manifest: every
    file present at its size, the metadata's checksum) and ``load(sd)``, which fills ``sd``'s
    tensors (DTensors: their local slices) and non-tensor keys in place, checking the size and
    (``verify="checksum"``) the checksums of every file it reads. ``rank``/``world_size``: when N
    processes each read a part, which files this one checks whole (every file by some rank)."""

    def __init__(
        self,
        resolved: Resolved,
        *,
        verify: str = "checksum",
        io_threads: int | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.resolved = resolved
        self.metadata = resolved.metadata()
        m = resolved.manifest
        self._reader = VerifyingReader(
            resolved.storage.child(*resolved.parts),
            None if m is None else m.files,
            metadata=self.metadata,
            rank=rank,
            world_size=world_size,
            io_threads=read_threads(io_threads, resolved.storage.is_local),
            verify_crc=checks_content(verify),
        )

    def load(self, sd: dict[str, Any]) -> None:
        what = f"reading {self.resolved.url}"
        _dcp.load(sd, self._reader, SafeLoadPlanner(), None, what, alone=True)
