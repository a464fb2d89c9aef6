"""Checksums of stored files: CRC32C per chunk (zlib's crc32 in older manifests), computed
while files are written and checked wherever bytes are read."""

from muon_ckpt.store._checksum import (
    CHUNK_BYTES,
    Checksum,
    check_chunks,
    chunk_span,
    crc_hex,
    file_checksum,
    mismatched_chunks,
)
from muon_ckpt.store._crc import crc_function, write_algorithm
from muon_ckpt.store._crc import implementation as crc32c_implementation

__all__ = [
    "CHUNK_BYTES",
    "Checksum",
    "check_chunks",
    "chunk_span",
    "crc32c_implementation",
    "crc_function",
    "crc_hex",
    "file_checksum",
    "mismatched_chunks",
    "write_algorithm",
]
