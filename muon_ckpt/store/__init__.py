"""Storage: the only fsspec caller; the checkpoint layout and manifest; the one catalog of steps.

``Storage`` (a root on any fsspec filesystem), ``Catalog`` (steps and their status; commit,
delete, retention), ``resolve``/``verify``/``prune`` (for the CLI and interop), the layout
names and ``Manifest``, and DCP's metadata read without unpickling untrusted bytes.
"""

from muon_ckpt.store._catalog import (
    COMMITTED,
    CORRUPT,
    UNCOMMITTED,
    Catalog,
    Resolved,
    StepInfo,
    VerifyResult,
    prune,
    resolve,
    verify,
)
from muon_ckpt.store._checksum import (
    CHUNK_BYTES,
    Checksum,
    check_chunks,
    chunk_span,
    crc_hex,
    file_checksum,
)
from muon_ckpt.store._crc import implementation as crc32c_implementation
from muon_ckpt.store._dcpfs import DelegatingFileSystem, dcp_filesystem
from muon_ckpt.store._layout import (
    KEY_FORMAT_VERSION,
    MANIFEST,
    METADATA,
    FileEntry,
    Manifest,
    extra_key,
    model_key,
    optim_group_key,
    optim_state_key,
    parse_step_dirname,
    rank_extra_key,
    step_dirname,
)
from muon_ckpt.store._metadata import bytes_keys, parse_metadata, tensor_entries
from muon_ckpt.store._storage import Storage

__all__ = [
    "CHUNK_BYTES",
    "COMMITTED",
    "CORRUPT",
    "KEY_FORMAT_VERSION",
    "MANIFEST",
    "METADATA",
    "UNCOMMITTED",
    "Catalog",
    "Checksum",
    "DelegatingFileSystem",
    "FileEntry",
    "Manifest",
    "Resolved",
    "StepInfo",
    "Storage",
    "VerifyResult",
    "bytes_keys",
    "check_chunks",
    "chunk_span",
    "crc32c_implementation",
    "crc_hex",
    "dcp_filesystem",
    "extra_key",
    "file_checksum",
    "model_key",
    "optim_group_key",
    "optim_state_key",
    "parse_metadata",
    "parse_step_dirname",
    "prune",
    "rank_extra_key",
    "resolve",
    "step_dirname",
    "tensor_entries",
    "verify",
]
