"""Storage: the only fsspec caller; the checkpoint layout and manifest; the one catalog of steps.

``Storage`` (a root on any fsspec filesystem), ``Catalog`` (steps and their status; commit,
delete, retention), ``resolve``/``verify``/``prune`` (for the CLI and interop), the layout
names and ``Manifest``, and DCP's metadata read without unpickling untrusted bytes.
"""

from muon_ckpt.store._catalog import Catalog, write_dirname
from muon_ckpt.store._checksum import (
    CHUNK_BYTES,
    Checksum,
    check_chunks,
    chunk_span,
    crc_hex,
    file_checksum,
    mismatched_chunks,
)
from muon_ckpt.store._confirm import CONFIRM_MODES, confirm_files
from muon_ckpt.store._crc import implementation as crc32c_implementation
from muon_ckpt.store._dcpfs import DelegatingFileSystem, dcp_filesystem
from muon_ckpt.store._layout import (
    KEY_FORMAT_VERSION,
    MANIFEST,
    MAX_STEP,
    METADATA,
    FileEntry,
    Manifest,
    extra_key,
    is_file_name,
    model_key,
    optim_group_key,
    optim_state_key,
    parse_step_dirname,
    rank_extra_key,
    step_dirname,
)
from muon_ckpt.store._lease import DEFAULT_LEASE_SECONDS, LEASE, Lease
from muon_ckpt.store._lines import SavePlan
from muon_ckpt.store._metadata import bytes_keys, parse_metadata, tensor_entries
from muon_ckpt.store._probe import open_run, open_storage
from muon_ckpt.store._resolve import Resolved, VerifyResult, prune, resolve, verify
from muon_ckpt.store._steps import COMMITTED, CORRUPT, NEWER, SUPERSEDED, UNCOMMITTED, StepInfo
from muon_ckpt.store._storage import (
    DEFAULT_TIMEOUT,
    Storage,
    is_storage_failure,
    open_regular,
    storage_error,
)

__all__ = [
    "CHUNK_BYTES",
    "COMMITTED",
    "CONFIRM_MODES",
    "CORRUPT",
    "DEFAULT_LEASE_SECONDS",
    "DEFAULT_TIMEOUT",
    "KEY_FORMAT_VERSION",
    "LEASE",
    "MANIFEST",
    "MAX_STEP",
    "METADATA",
    "NEWER",
    "SUPERSEDED",
    "UNCOMMITTED",
    "Catalog",
    "Checksum",
    "DelegatingFileSystem",
    "FileEntry",
    "Lease",
    "Manifest",
    "Resolved",
    "SavePlan",
    "StepInfo",
    "Storage",
    "VerifyResult",
    "bytes_keys",
    "check_chunks",
    "chunk_span",
    "confirm_files",
    "crc32c_implementation",
    "crc_hex",
    "dcp_filesystem",
    "extra_key",
    "file_checksum",
    "is_file_name",
    "is_storage_failure",
    "mismatched_chunks",
    "model_key",
    "open_regular",
    "open_run",
    "open_storage",
    "optim_group_key",
    "optim_state_key",
    "parse_metadata",
    "parse_step_dirname",
    "prune",
    "rank_extra_key",
    "resolve",
    "step_dirname",
    "storage_error",
    "tensor_entries",
    "verify",
    "write_dirname",
]
