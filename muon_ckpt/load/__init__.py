"""The one verifying load path: a DCP reader that checks every byte it hands on against the
manifest (``VerifyingReader``), used by the manager's loads and, in one process, by import,
export and inspect (``CheckpointReader``); ``verify_step``: a step checked as a load would
find it, without loading it (``muon-ckpt verify``)."""

from muon_ckpt.load._attempt import LoadOutcome, LoadTargets, attempt, undo
from muon_ckpt.load._checkpoint import CheckpointReader
from muon_ckpt.load._decide import Decision, History, refuse_newer
from muon_ckpt.load._item_zip import unbounded_records
from muon_ckpt.load._planner import SafeLoadPlanner
from muon_ckpt.load._reader import VerifyingReader
from muon_ckpt.load._resume import Loaded, loaded, refusal, resume
from muon_ckpt.load._verify import verify_step

__all__ = [
    "CheckpointReader",
    "Decision",
    "History",
    "LoadOutcome",
    "LoadTargets",
    "Loaded",
    "SafeLoadPlanner",
    "VerifyingReader",
    "attempt",
    "loaded",
    "refusal",
    "refuse_newer",
    "resume",
    "unbounded_records",
    "undo",
    "verify_step",
]
