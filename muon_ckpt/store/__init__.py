"""Storage: the only fsspec caller; the checkpoint layout and manifest; the one catalog of steps.

``Storage`` (a root on any fsspec filesystem), ``Catalog`` (steps and their ``Status``;
begin, commit, delete, tidy), ``resolve``/``verify``/``prune`` (for the CLI and interop), the
layout's names and ``Manifest``. Narrower concerns have modules of their own:
``store.checksums``, ``store.keys`` (DCP keys by parameter name), ``store.dcp`` (DCP's
metadata, read safely, and filesystem).
"""

from muon_ckpt.store._catalog import Catalog, write_dirname
from muon_ckpt.store._confirm import check_stored, confirm_files
from muon_ckpt.store._layout import (
    DATA,
    MANIFEST,
    MAX_STEP,
    METADATA,
    FileEntry,
    Manifest,
    check_step,
    data_dirname,
    data_ref,
    data_ref_name,
    is_file_name,
    parse_data_dirname,
    parse_step_dirname,
    step_dirname,
)
from muon_ckpt.store._lease import LEASE
from muon_ckpt.store._lines import SavePlan, mark_tier
from muon_ckpt.store._local import open_regular
from muon_ckpt.store._probe import check_run_root, open_run, open_storage
from muon_ckpt.store._resolve import Resolved, VerifyResult, prune, resolve, verify
from muon_ckpt.store._run_index import INDEX
from muon_ckpt.store._steps import Status, StepInfo, layout_of
from muon_ckpt.store._storage import Storage, is_storage_failure

__all__ = [
    "DATA",
    "INDEX",
    "LEASE",
    "MANIFEST",
    "MAX_STEP",
    "METADATA",
    "Catalog",
    "FileEntry",
    "Manifest",
    "Resolved",
    "SavePlan",
    "Status",
    "StepInfo",
    "Storage",
    "VerifyResult",
    "check_run_root",
    "check_step",
    "check_stored",
    "confirm_files",
    "data_dirname",
    "data_ref",
    "data_ref_name",
    "is_file_name",
    "is_storage_failure",
    "layout_of",
    "mark_tier",
    "open_regular",
    "open_run",
    "open_storage",
    "parse_data_dirname",
    "parse_step_dirname",
    "prune",
    "resolve",
    "step_dirname",
    "verify",
    "write_dirname",
]
