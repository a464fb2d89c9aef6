"""The save path: the snapshot of the ``save()`` call on every rank (``take``), then every
rank's files written and checksummed, confirmed on the storage, committed by rank 0, and the
old steps deleted (``SaveJob``, here or in a thread); what the run's line retires
(``RunLine``); a manager's saves one after another (``UrlSaves``)."""

from muon_ckpt.save._deferred import hook_step
from muon_ckpt.save._job import Prebuilt, SaveJob, StagedSavePlanner, WriteSpec, spec_for
from muon_ckpt.save._line import RunLine
from muon_ckpt.save._saves import UrlSaves, new_id
from muon_ckpt.save._snapshot import SaveSources, Snapshot, take
from muon_ckpt.save._writer import ChecksumWriter, FileRecords

__all__ = [
    "ChecksumWriter",
    "FileRecords",
    "Prebuilt",
    "RunLine",
    "SaveJob",
    "SaveSources",
    "Snapshot",
    "StagedSavePlanner",
    "UrlSaves",
    "WriteSpec",
    "hook_step",
    "new_id",
    "spec_for",
    "take",
]
