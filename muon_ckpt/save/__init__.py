"""The save path: the snapshot of the ``save()`` call on every rank (``take``), then every
rank's files written and checksummed, confirmed on the storage, committed by rank 0, and the
old steps deleted (``SaveJob``, here or in a thread); what the run's line retires and a save's
admission (``RunLine``, ``Admission``); the url's writer (``UrlWriter``) and the writer of a
step's files (``StepWriter``, as its ``WritePolicy`` says), which the memory tier's parts use
too."""

from muon_ckpt.save._deferred import hook_step
from muon_ckpt.save._job import SaveJob, UrlWriter
from muon_ckpt.save._line import Admission, RunLine, new_id
from muon_ckpt.save._snapshot import SaveSources, Snapshot, StagedSavePlanner, take
from muon_ckpt.save._spec import Handoff, Prebuilt, WriteSpec, Written
from muon_ckpt.save._streams import FileRecords
from muon_ckpt.save._writer import StepWriter, WritePolicy

__all__ = [
    "Admission",
    "FileRecords",
    "Handoff",
    "Prebuilt",
    "RunLine",
    "SaveJob",
    "SaveSources",
    "Snapshot",
    "StagedSavePlanner",
    "StepWriter",
    "UrlWriter",
    "WritePolicy",
    "WriteSpec",
    "Written",
    "hook_step",
    "new_id",
    "take",
]
